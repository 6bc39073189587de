"""Frozen features (FAIR pooling table, cache), kNN votes against brute force, the linear probe's
frozen backbone and exact resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torchvision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import transfer.features as features
import transfer.linear as linear
import transfer.linear_probe as linear_probe
from contrastive_transfer.contract import knn_bank, knn_vote
from converters.checkpoint_io import load_backbone
from transfer.features import LayerFeatures, Preprocessing, pool
from transfer.knn import topk_accuracy
from transfer.layers import pooling_for
from transfer.probe_presets import PRESETS, PROBE_STATE


def small_stem_resnet18(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = torchvision.models.resnet18()
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    net.fc = nn.Identity()
    return net


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """A random-init small-stem ResNet-18 as a plain torchvision state_dict file."""
    path = tmp_path_factory.mktemp("ckpt") / "resnet18_small_random.pth"
    torch.save(small_stem_resnet18().state_dict(), path)
    return path


# --------------------------------------------------------------------------------------- features


def test_fair_pooling_table_at_224():
    """The FAIR benchmark's (kernel, stride, pad) and dims for ResNet-50 at 224 px (transfer.md §3.2)."""
    table = {
        "conv1": ((10, 10, 4), 9216),
        "res2": ((16, 8, 0), 9216),
        "res3": ((13, 5, 0), 8192),
        "res4": ((8, 3, 0), 9216),
        "res5": ((6, 1, 0), 8192),
    }
    maps = {"conv1": 112, "res2": 56, "res3": 28, "res4": 14, "res5": 7}
    for layer, ((k, s, p), _) in table.items():
        assert pooling_for(layer, maps[layer], maps[layer]) == ((k, k), (s, s), (p, p))
    described = LayerFeatures(torchvision.models.resnet50().eval(), [*table, "res5avg"]).describe(224)
    assert {name: d["dim"] for name, d in described.items()} == {
        **{n: d for n, (_, d) in table.items()},
        "res5avg": 2048,
    }
    fmap = torch.randn(2, 16, 7, 7)
    assert torch.equal(pool("res5", fmap), nn.AvgPool2d(6, 1, 0)(fmap).flatten(1))
    assert torch.allclose(pool("res5avg", fmap), fmap.mean(dim=(2, 3)))


def test_pooling_keeps_the_grid_on_small_maps():
    for layer, grid in (("res4", 3), ("res5", 2)):
        for side in (2 * grid, 4, 8, 9):
            if side < grid:
                continue
            assert pool(layer, torch.randn(1, 5, side, side)).shape[1] == 5 * grid * grid
    with pytest.raises(ValueError, match="too small"):
        pool("res4", torch.randn(1, 5, 2, 2))


def test_preprocessing_warp_vs_center():
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 100, 3), dtype=np.uint8))
    assert Preprocessing(48, 40, "warp").transform()(image).shape == (3, 40, 40)
    assert Preprocessing(48, 40, "center").transform()(image).shape == (3, 40, 40)
    assert not torch.equal(
        Preprocessing(48, 40, "warp").transform()(image), Preprocessing(48, 40, "center").transform()(image)
    )


def pil_reference(image, resize: int, crop: int, mode: str) -> np.ndarray:
    """VISSL's preprocessing written with PIL alone: shorter side → `resize` with the long side
    int(resize · long / short), PIL bilinear; then a crop×crop warp (PIL bilinear) or centre crop."""
    from PIL import Image

    w, h = image.size
    size = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
    image = image.resize(size, Image.BILINEAR)
    if mode == "warp":
        return np.asarray(image.resize((crop, crop), Image.BILINEAR))
    left, top = int(round((size[0] - crop) / 2.0)), int(round((size[1] - crop) / 2.0))
    return np.asarray(image.crop((left, top, left + crop, top + crop)))


def test_preprocessing_is_the_pil_pipeline_pixel_for_pixel(synthetic_root):
    from PIL import Image
    from torchvision.transforms import v2

    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in ((375, 500), (333, 500), (500, 281), (97, 131))
    ]
    jpegs = sorted((synthetic_root / "VOC2007" / "JPEGImages").glob("*.jpg"))[:4]
    images += [Image.open(path).convert("RGB") for path in jpegs]
    mean, std = np.array(features.IMAGENET_MEAN), np.array(features.IMAGENET_STD)
    differs_from_tensor_path = 0
    for mode in ("warp", "center"):
        for resize, crop in ((256, 224), (73, 64)):
            prep = Preprocessing(resize, crop, mode)
            for image in images:
                expected = pil_reference(image, resize, crop, mode)
                np.testing.assert_array_equal(np.asarray(prep.pil_steps()(image)), expected)
                tensor = prep.transform()(image)
                reference = ((expected / 255.0 - mean) / std).transpose(2, 0, 1)
                np.testing.assert_allclose(tensor.numpy(), reference, rtol=0, atol=1e-5)
                # The previous pipeline (resizing the uint8 tensor) is measurably different.
                old = v2.Compose([v2.ToImage(), v2.Resize(resize, antialias=True)])(image)
                if mode == "warp":
                    old = v2.Resize((crop, crop), antialias=True)(old)
                    differs_from_tensor_path += not np.array_equal(old.permute(1, 2, 0).numpy(), expected)
    assert differs_from_tensor_path >= len(images)
    assert Preprocessing().describe()["resampling"].startswith("PIL")


def test_feature_cache_extracts_once(synthetic_root, random_checkpoint, tmp_path, monkeypatch):
    from transfer.datasets.readers import read_image_folder

    model, backbone = features.load_model(random_checkpoint)
    prep = Preprocessing(36, 32, "center")
    data = read_image_folder(synthetic_root / "imagenet" / "val")
    data.transform = prep.transform()
    cache = features.FeatureCache(tmp_path, backbone, prep)
    calls = []
    real = features.extract
    monkeypatch.setattr(features, "extract", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = cache.get(lambda names: LayerFeatures(model, names), data, "val", ["res5avg", "res5"])
    second = cache.get(lambda names: LayerFeatures(model, names), data, "val", ["res5avg"])
    assert len(calls) == 1
    assert first["res5avg"].shape == (len(data), 512) and first["res5"].shape == (len(data), 2048)
    np.testing.assert_array_equal(first["res5avg"], second["res5avg"])
    # Independent: the same images through the plain torchvision model give the same features.
    x = torch.stack([data[i][0] for i in range(3)])
    with torch.no_grad():
        np.testing.assert_allclose(first["res5avg"][:3], model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_a_feature_cache_is_named_by_the_weights_not_the_file(synthetic_root, random_checkpoint, tmp_path):
    """The same tensors in another file (a checkpoint that also records its folder, as pretraining's
    does) share the cache folder; one changed value or another preprocessing do not."""
    from transfer.datasets.readers import read_image_folder

    data = read_image_folder(synthetic_root / "imagenet" / "val")
    state = torch.load(random_checkpoint, weights_only=True)
    prep = Preprocessing(36, 32, "center")
    torch.save({"state_dict": state, "output_dir": str(tmp_path / "elsewhere")}, tmp_path / "a.pth")
    state["layer4.1.bn2.bias"][0] += 1e-3
    torch.save(state, tmp_path / "changed.pth")

    def folder(path, p=prep):
        return features.FeatureCache(tmp_path, load_backbone(path), p)._dir(data)

    assert (tmp_path / "a.pth").read_bytes() != random_checkpoint.read_bytes()
    assert folder(tmp_path / "a.pth") == folder(random_checkpoint)
    assert folder(tmp_path / "changed.pth") != folder(random_checkpoint)
    assert folder(random_checkpoint, p=Preprocessing(36, 28, "center")) != folder(random_checkpoint)


def test_a_feature_cache_never_reads_or_writes_through_a_link(synthetic_root, random_checkpoint, tmp_path):
    """A cache folder is named by a hash of the inputs, so a link can be planted in its place in a
    shared folder: the cache refuses it in one line (before, it read the features found there and
    wrote its own files into the folder linked). A cached file that is a link is extracted again and
    replaced; one that is not a 2-D float array is one line. The writer holds the same rule
    (``atomic_write(within=)``); the control: without it, the write lands outside."""
    from contrastive_transfer.cli import UserError, atomic_write
    from transfer.datasets.readers import read_image_folder

    model, backbone = features.load_model(random_checkpoint)
    prep = Preprocessing(36, 32, "center")
    data = read_image_folder(synthetic_root / "imagenet" / "val")
    data.transform = prep.transform()
    root, outside = tmp_path / "cache", tmp_path / "outside"
    cache = features.FeatureCache(root, backbone, prep)
    outside.mkdir()
    root.mkdir()
    cache._dir(data).symlink_to(outside)
    extractor = lambda names: LayerFeatures(model, names)  # noqa: E731
    with pytest.raises(UserError, match="is a symbolic link, expected a folder of this feature cache"):
        cache.get(extractor, data, "val", ["res5avg"])
    assert list(outside.iterdir()) == []
    target = cache.path(data, "val", "res5avg")
    with pytest.raises(UserError, match="outside"):
        atomic_write(target, lambda f: f.write(b"x"), within=root)
    assert list(outside.iterdir()) == []
    atomic_write(target, lambda f: f.write(b"x"))  # the control: a write without the rule lands outside
    assert [p.name for p in outside.iterdir()] == [target.name]
    cache._dir(data).unlink()
    cache._dir(data).mkdir()
    (outside / "planted.npy").write_bytes(b"outside")
    target.symlink_to(outside / "planted.npy")
    got = cache.get(extractor, data, "val", ["res5avg"])["res5avg"]
    assert got.shape == (len(data), 512) and not target.is_symlink()
    assert (outside / "planted.npy").read_bytes() == b"outside"
    target.write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(UserError, match=r"res5avg_features\.npy: unreadable .*expected cached features"):
        cache.get(extractor, data, "val", ["res5avg"])


# -------------------------------------------------------------------------------------------- kNN


def test_knn_votes_match_brute_force():
    rng = np.random.default_rng(0)
    bank = torch.nn.functional.normalize(torch.randn(50, 8, dtype=torch.float64), dim=1)
    query = torch.nn.functional.normalize(torch.randn(13, 8, dtype=torch.float64), dim=1)
    labels = torch.as_tensor(rng.integers(0, 4, 50))
    k, t = 7, 0.07
    got = knn_vote(query, bank, labels, 4, k, t, max_similarities=5 * 50)  # chunks of 5 queries
    for q in range(13):
        sims = [float(query[q] @ bank[j]) for j in range(50)]
        nearest = sorted(range(50), key=lambda j: -sims[j])[:k]
        expected = [sum(np.exp(sims[j] / t) for j in nearest if labels[j] == c) for c in range(4)]
        np.testing.assert_allclose(got[q].numpy(), expected, rtol=1e-10)
    scores = torch.tensor([[0.1, 0.5, 0.4], [0.9, 0.05, 0.05]])
    assert topk_accuracy(scores, torch.tensor([2, 0]), ks=(1, 2)) == {"top1": 50.0, "top2": 100.0}


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any torch operation produces."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_knn_vote_in_chunks_equals_the_brute_force_vote_exactly_and_never_holds_bank_by_queries():
    """Integer-valued float64 vectors: every similarity is exact whatever the product's summation
    order (a 1-row and a 36-row product round differently otherwise), so the chunked vote must equal
    the one-chunk vote bit for bit, and the brute-force formula up to exp's last bit."""
    g = torch.Generator().manual_seed(0)
    bank = torch.randint(-100_000, 100_001, (300, 16), generator=g).double()
    query = torch.randint(-100_000, 100_001, (37, 16), generator=g).double()
    labels = torch.randint(0, 5, (300,), generator=g)
    k, t = 20, 4e9  # similarities up to 1.6e11 (exact in float64): exp(sim / t) stays finite
    sims = query @ bank.T
    assert all(len(set(row.tolist())) == 300 for row in sims)  # no ties: the k nearest are one set
    brute = torch.zeros(37, 5, dtype=torch.float64)
    for q in range(37):
        for j in sorted(range(300), key=lambda j: -sims[q, j].item())[:k]:
            brute[q, labels[j]] += math.exp(sims[q, j].item() / t)
    whole = knn_vote(query, bank, labels, 5, k, t, max_similarities=300 * 37)  # one chunk: the full matrix
    torch.testing.assert_close(whole, brute, rtol=1e-14, atol=0)
    for budget in (300, 300 * 4, 300 * 36):  # 1, 4 and 36 queries a chunk (the last chunk shorter)
        with LargestTensor() as seen:
            chunked = knn_vote(query, bank, labels, 5, k, t, max_similarities=budget)
        assert torch.equal(chunked, whole), budget
        assert seen.numel <= max(budget, 300 * 16), (budget, seen.numel)  # never 37 × 300 similarities
    with LargestTensor() as seen:
        knn_vote(query, bank, labels, 5, k, t, max_similarities=300 * 37)
    assert seen.numel == 300 * 37  # the control: the one-chunk vote does hold the whole matrix


def test_knn_bank_normalises_on_the_cpu_in_float32_in_place():
    x = torch.randn(1000, 8, generator=torch.Generator().manual_seed(1)) * 5
    reference = torch.nn.functional.normalize(x.clone(), dim=1)
    bank = knn_bank(x, block_rows=64)  # 16 blocks
    assert bank.dtype == torch.float32 and bank.data_ptr() == x.data_ptr()  # no second bank
    assert torch.equal(bank, reference)
    halves = knn_bank(np.ones((3, 4), dtype=np.float16), "cpu")  # a float16 array: float32 on a CPU
    assert halves.dtype == torch.float32 and torch.allclose(halves, torch.full((3, 4), 0.5))


# ----------------------------------------------------------------------------------- linear probe


def probe_args(ckpt, root, out, *extra):
    return [
        "--weights",
        str(ckpt),
        "--dataset",
        "places205",
        "--data-root",
        str(root / "places205"),
        "--preset",
        "places205",
        "--output-dir",
        str(out),
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--lr",
        "0.1",
        "--resize",
        "36",
        "--crop",
        "32",
        "--workers",
        "0",
        *extra,
    ]


def test_linear_probe_leaves_backbone_bit_identical(synthetic_root, random_checkpoint, tmp_path, monkeypatch):
    loaded = []
    real = linear_probe.load_model
    monkeypatch.setattr(linear_probe, "load_model", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    linear.main(probe_args(random_checkpoint, synthetic_root, tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["backbone_unchanged"] and metrics["feature"]["dim"] == 4 * 512
    assert metrics["feature"]["head"] == "BN(no affine) + fc" and len(metrics["history"]) == 2
    model = loaded[0][0]
    on_disk = load_backbone(random_checkpoint).state_dict
    after = model.state_dict()
    assert on_disk.keys() == after.keys()
    assert all(torch.equal(after[k], v) for k, v in on_disk.items())  # weights and BN buffers, every bit
    # The check can fail: one forward pass in train mode moves the BN statistics.
    model.train()(torch.randn(4, 3, 32, 32))
    assert "bn1.running_mean" in linear_probe.backbone_changes(model, on_disk)


def test_linear_probe_resume_repeats_the_run(synthetic_root, random_checkpoint, tmp_path, monkeypatch):
    linear.main(probe_args(random_checkpoint, synthetic_root, tmp_path / "full"))
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())["history"]

    saves = []
    real_save = linear_probe.atomic_torch_save

    def save_then_stop(obj, path):
        real_save(obj, path)
        saves.append(path)
        raise KeyboardInterrupt  # "killed" right after the first epoch's checkpoint

    monkeypatch.setattr(linear_probe, "atomic_torch_save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        linear.main(probe_args(random_checkpoint, synthetic_root, tmp_path / "cut"))
    monkeypatch.setattr(linear_probe, "atomic_torch_save", real_save)
    with pytest.raises(SystemExit, match="--resume"):  # never overwrites a run silently
        linear.main(probe_args(random_checkpoint, synthetic_root, tmp_path / "cut"))
    linear.main(probe_args(random_checkpoint, synthetic_root, tmp_path / "cut", "--resume"))
    resumed = json.loads((tmp_path / "cut" / "metrics.json").read_text())["history"]
    strip = lambda h: [{k: v for k, v in e.items() if k != "seconds"} for e in h]  # noqa: E731
    assert strip(resumed) == strip(full)


def test_a_finished_probe_is_never_replaced_by_a_probe_that_does_not_continue_it(
    synthetic_root, random_checkpoint, tmp_path
):
    """A folder holding a finished probe's metrics.json and no probe state (moved away, or never
    copied along): before, ``--resume`` found nothing to resume and trained afresh over it, and so
    did a run without ``--resume``. Now both are one line naming the file, and the folder is
    untouched; the control: with its state, ``--resume`` continues and writes the same record."""
    out = tmp_path / "done"
    linear.main(probe_args(random_checkpoint, synthetic_root, out))
    record = json.loads((out / "metrics.json").read_text())
    (out / PROBE_STATE).rename(tmp_path / PROBE_STATE)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}
    for extra in (["--resume"], []):
        with pytest.raises(SystemExit) as e:
            linear.main(probe_args(random_checkpoint, synthetic_root, out, *extra))
        line = str(e.value)
        assert "\n" not in line and f"{out / 'metrics.json'} is a finished probe's output" in line, line
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == before
    (tmp_path / PROBE_STATE).rename(out / PROBE_STATE)
    linear.main(probe_args(random_checkpoint, synthetic_root, out, "--resume"))
    again = json.loads((out / "metrics.json").read_text())
    strip = lambda h: [{k: v for k, v in e.items() if k != "seconds"} for e in h]  # noqa: E731
    assert strip(again["history"]) == strip(record["history"])


def test_presets_follow_the_papers():
    moco, adco, places = PRESETS["moco"], PRESETS["adco"], PRESETS["places205"]
    assert [moco.lr_at(e) for e in (0, 59, 60, 79, 80, 99)] == pytest.approx([30, 30, 3, 3, 0.3, 0.3])
    assert adco.lr_at(0) == pytest.approx(10) and adco.lr_at(50) == pytest.approx(0.01 + 0.5 * (10 - 0.01))
    assert [places.lr_at(e) for e in (6, 7, 14, 21)] == pytest.approx([0.01, 1e-3, 1e-4, 1e-5])
    assert places.nesterov and places.weight_decay == 1e-4 and places.head_bn and not moco.head_bn
    assert moco.with_epochs(5).milestones == (3, 4)
