"""pretrain.data: recipe parameters against docs/methods.md (Augmentation recipes), normalization, per-sample
reproducibility (workers, epochs, resume), the sharded sampler, and robustness to bad files."""

import inspect
import shutil

import pytest
import torch
from PIL import Image
from torchvision import transforms as T1  # v1 transforms: an independent reference pipeline
from torchvision.transforms import v2

from pretrain.augment import build_multicrop_transforms, build_view_transforms
from pretrain.config import ENGINE_DEFAULTS
from pretrain.data import (
    BadImageTracker,
    ImageDataset,
    ShardedSampler,
    build_loader,
    collate,
    eval_transform,
    finish_views,
    set_loader_epoch,
)
from pretrain.data_backends import BACKENDS

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
BILINEAR, BICUBIC = v2.InterpolationMode.BILINEAR, v2.InterpolationMode.BICUBIC


def describe(pipeline):
    """The random ops as plain tuples; jitter as strengths (brightness (0.6, 1.4) → 0.4)."""
    out = []
    for op in pipeline.transforms:
        p = 1.0
        if isinstance(op, v2.RandomApply):
            assert len(op.transforms) == 1
            p, op = op.p, op.transforms[0]
        if isinstance(op, v2.RandomResizedCrop):
            interp = v2.InterpolationMode(op.interpolation)
            out.append(("crop", tuple(op.size), tuple(op.scale), interp))
        elif isinstance(op, v2.ColorJitter):
            s = [
                round(op.brightness[1] - 1, 6),
                round(op.contrast[1] - 1, 6),
                round(op.saturation[1] - 1, 6),
                round(op.hue[1], 6),
            ]
            out.append(("jitter", *s, p))
        elif isinstance(op, v2.RandomGrayscale):
            out.append(("gray", op.p))
        elif isinstance(op, v2.GaussianBlur):
            out.append(("blur", tuple(op.kernel_size), tuple(op.sigma), p))
        elif isinstance(op, v2.RandomHorizontalFlip):
            out.append(("flip", op.p))
        elif isinstance(op, v2.RandomSolarize):
            out.append(("solarize", op.threshold, op.p))
    return out


def tail_is_float_normalize(pipeline):
    ops = [op for op in pipeline.transforms if not isinstance(op, v2.ToPureTensor)]
    to_dtype, norm = ops[-2], ops[-1]
    return (
        isinstance(to_dtype, v2.ToDtype)
        and to_dtype.scale
        and to_dtype.dtype == torch.float32
        and isinstance(norm, v2.Normalize)
        and tuple(norm.mean) == MEAN
        and tuple(norm.std) == STD
    )


# Written from docs/methods.md (Augmentation recipes) at 224 px (blur kernel 23 = 10% of the side, odd).
CROP = lambda lo, interp=BILINEAR: ("crop", (224, 224), (lo, 1.0), interp)  # noqa: E731
BLUR = lambda p: ("blur", (23, 23), (0.1, 2.0), p)  # noqa: E731
EXPECTED = {
    "mocov1": [[CROP(0.2), ("gray", 0.2), ("jitter", 0.4, 0.4, 0.4, 0.4, 1.0), ("flip", 0.5)]] * 2,
    "mocov2": [[CROP(0.2), ("jitter", 0.4, 0.4, 0.4, 0.1, 0.8), ("gray", 0.2), BLUR(0.5), ("flip", 0.5)]] * 2,
    "simclr": [[CROP(0.08), ("flip", 0.5), ("jitter", 0.8, 0.8, 0.8, 0.2, 0.8), ("gray", 0.2), BLUR(0.5)]] * 2,
    "byol": [
        [
            CROP(0.08, BICUBIC),
            ("flip", 0.5),
            ("jitter", 0.4, 0.4, 0.2, 0.1, 0.8),
            ("gray", 0.2),
            BLUR(blur_p),
            ("solarize", 128, sol_p),
        ]
        for blur_p, sol_p in ((1.0, 0.0), (0.1, 0.2))
    ],
}


@pytest.mark.parametrize("recipe", sorted(EXPECTED) + ["aug+"])
def test_recipe_parameters_match_the_papers(recipe):
    views = build_view_transforms(recipe, 224)
    expected = EXPECTED["mocov2" if recipe == "aug+" else recipe]
    assert [describe(t) for t in views] == expected
    assert all(tail_is_float_normalize(t) for t in views)


@pytest.mark.parametrize("recipe", sorted(EXPECTED))
def test_min_crop_scale_replaces_only_the_crop_floor(recipe):
    views = build_view_transforms(recipe, 224, min_crop_scale=0.5)
    expected = [[("crop", d[1], (0.5, 1.0), d[3]) if d[0] == "crop" else d for d in view] for view in EXPECTED[recipe]]
    assert [describe(t) for t in views] == expected
    key = describe(build_multicrop_transforms(224, key_min_scale=0.5)[0])[0]
    assert key[2] == (0.5, 1.0)
    with pytest.raises(ValueError, match="min_crop_scale"):
        build_view_transforms(recipe, 224, min_crop_scale=1.5)


@pytest.mark.parametrize("side", [32, 64, 96, 160, 224])
def test_blur_kernel_is_odd_and_about_ten_percent(side):
    (blur,) = [d for d in describe(build_view_transforms("simclr", side)[0]) if d[0] == "blur"]
    k = blur[1][0]
    assert k % 2 == 1 and k >= 3 and abs(k - 0.1 * side) <= 1.5, (side, k)


def test_unknown_recipe_lists_allowed_names():
    with pytest.raises(ValueError) as e:
        build_view_transforms("mocov3", 64)
    assert all(name in str(e.value) for name in ("mocov1", "mocov2", "simclr", "byol"))


def test_multicrop_is_adco_at_224_and_scales_down():
    crops = build_multicrop_transforms(224)
    got = [describe(t) for t in crops]
    ref = [
        (224, 0.2, 1.0),
        (224, 0.2, 1.0),
        (192, 0.172, 0.86),
        (160, 0.143, 0.715),
        (128, 0.114, 0.571),
        (96, 0.086, 0.429),
    ]
    assert [(d[0][1][0], *d[0][2]) for d in got] == ref
    for d in got:  # aug+ on every crop
        assert [x[0] for x in d] == ["crop", "jitter", "gray", "blur", "flip"]
        assert d[1] == ("jitter", 0.4, 0.4, 0.4, 0.1, 0.8) and d[2] == ("gray", 0.2) and d[3][3] == 0.5
    image = Image.new("RGB", (80, 70), (10, 200, 30))
    assert [tuple(t(image).shape) for t in build_multicrop_transforms(64)] == [
        (3, 64, 64),
        (3, 64, 64),
        (3, 55, 55),
        (3, 46, 46),
        (3, 37, 37),
        (3, 27, 27),
    ]
    with pytest.raises(ValueError, match="same length"):
        build_multicrop_transforms(64, sizes=[32, 16], min_scales=[0.2], max_scales=[1.0])


@pytest.mark.parametrize("recipe", ["mocov1", "mocov2", "simclr", "byol"])
def test_views_are_normalized_float32_chw(recipe):
    torch.manual_seed(0)
    pil = Image.fromarray(torch.randint(0, 256, (50, 60, 3), dtype=torch.uint8).numpy())
    lo = (0 - torch.tensor(MEAN)) / torch.tensor(STD)
    hi = (1 - torch.tensor(MEAN)) / torch.tensor(STD)
    for t in build_view_transforms(recipe, 32):
        for x in (t(pil), t(v2.functional.to_image(pil))):  # PIL or the dataset's uint8 tensor
            assert type(x) is torch.Tensor and x.dtype == torch.float32 and x.shape == (3, 32, 32)
            assert (x.amin((1, 2)) >= lo - 1e-5).all() and (x.amax((1, 2)) <= hi + 1e-5).all()
            assert x.amin() < 0 < x.amax()  # normalized, not [0, 1]


def test_eval_transform_normalizes_and_center_crops():
    mean_rgb = tuple(round(255 * m) for m in MEAN)
    x = eval_transform(32)(Image.new("RGB", (90, 50), mean_rgb))
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert x.abs().max() < 0.01  # the ImageNet mean maps to ~0
    # A smooth gradient against torchvision's v1 PIL pipeline (resize 37 = round(32·256/224), crop 32).
    yy, xx = torch.meshgrid(torch.arange(50), torch.arange(90), indexing="ij")
    arr = torch.stack([xx * 255 // 89, yy * 255 // 49, (xx + yy) * 255 // 138], -1).to(torch.uint8)
    pil = Image.fromarray(arr.numpy())
    ref = T1.Compose([T1.Resize(37), T1.CenterCrop(32), T1.ToTensor(), T1.Normalize(MEAN, STD)])(pil)
    torch.testing.assert_close(eval_transform(32)(pil), ref, atol=0.05, rtol=0)


# ------------------------------------------------------------------------------ dataset


@pytest.fixture
def train_root(synthetic_root):
    return synthetic_root / "imagenet" / "train"  # read only: it is a session fixture


@pytest.fixture
def small_copy(train_root, tmp_path):
    """Two classes, 12 images each (24), copied so that tests may corrupt them."""
    for cls in sorted(p.name for p in train_root.iterdir())[:2]:
        (tmp_path / "data" / cls).mkdir(parents=True)
        for f in sorted((train_root / cls).iterdir())[:12]:
            shutil.copy(f, tmp_path / "data" / cls / f.name)
    return tmp_path / "data"


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_seed_epoch_index_same_views_and_global_rng_untouched(train_root, backend):
    views = build_view_transforms("mocov2", 32)
    a, b, c = (ImageDataset(train_root, views, seed=s, backend=backend) for s in (3, 3, 4))

    def finished(ds, i):  # a sample's views as the device gets them, whichever backend made them
        return finish_views(collate([ds[i]])[0], views, torch.device("cpu"))

    assert len(a) == len(list(train_root.rglob("*.JPEG"))) and a.classes == sorted(p.name for p in train_root.iterdir())
    state = torch.get_rng_state()
    _, la, bad = a[5]
    assert torch.equal(torch.get_rng_state(), state), "sample seeding leaked into the global RNG"
    va, vb = finished(a, 5), finished(b, 5)
    assert bad == [] and la == b[5][1] == a.samples[5][1]
    assert all(torch.equal(x, y) for x, y in zip(va, vb))
    assert not torch.equal(va[0], va[1]), "the two views should be different draws"
    b.set_epoch(1)
    assert not torch.equal(finished(b, 5)[0], va[0]), "a new epoch must give new augmentations"
    assert not torch.equal(finished(c, 5)[0], va[0])


def test_the_datasets_default_backend_is_the_configs():
    assert inspect.signature(ImageDataset).parameters["backend"].default == ENGINE_DEFAULTS["data"]["backend"]


def _run(loader, epochs, start_batch=0):
    out = []
    for epoch in epochs:
        set_loader_epoch(loader, epoch, start_batch)
        out.append(list(loader))
    return out


def _same_batches(xs, ys):
    assert len(xs) == len(ys)
    for (vx, lx, bx), (vy, ly, by) in zip(xs, ys):
        assert torch.equal(lx, ly) and bx == by
        assert all(torch.equal(a, b) for a, b in zip(vx, vy))


def test_results_identical_with_0_and_2_workers(train_root):
    runs = {}
    for workers in (0, 2):  # 2 persistent workers: epoch 1 must reach the workers' dataset copies
        ds = ImageDataset(train_root, build_view_transforms("byol", 24), seed=0)
        runs[workers] = _run(build_loader(ds, 16, seed=1, num_workers=workers), epochs=[0, 1])
    for e in (0, 1):
        _same_batches(runs[0][e], runs[2][e])
        assert [tuple(v.shape) for v in runs[0][e][0][0]] == [(16, 3, 24, 24)] * 2
    assert not torch.equal(runs[2][0][0][0][0], runs[2][1][0][0][0])


def test_loader_resume_reproduces_the_uninterrupted_epoch(train_root):
    ds = ImageDataset(train_root, build_view_transforms("mocov2", 16), seed=0)
    full = _run(build_loader(ds, 8, seed=0), epochs=[2])[0]
    resumed_loader = build_loader(ds, 8, seed=0)
    resumed = _run(resumed_loader, epochs=[2], start_batch=3)[0]
    batches = len(ds) // 8
    assert len(full) == batches and len(resumed_loader) == batches - 3
    _same_batches(resumed, full[3:])


def test_loader_rejects_dataset_smaller_than_one_global_batch(train_root):
    ds = ImageDataset(train_root, build_view_transforms("mocov2", 16))
    with pytest.raises(ValueError, match="batch_size"):
        build_loader(ds, len(ds) // 2 + 1, num_replicas=2)


def test_collate_stacks_views_and_concatenates_bad_paths():
    item = lambda i, bad: ([torch.full((3, 4, 4), i), torch.full((3, 2, 2), -i)], i, bad)  # noqa: E731
    views, labels, bad = collate([item(1, []), item(2, ["x.jpg"]), item(3, ["y.jpg", "z.jpg"])])
    assert [v.shape for v in views] == [(3, 3, 4, 4), (3, 3, 2, 2)]
    assert views[1][2].eq(-3).all() and labels.tolist() == [1, 2, 3] and labels.dtype == torch.int64
    assert bad == ["x.jpg", "y.jpg", "z.jpg"]


def test_collate_takes_the_batch_finish_produced_without_copying_and_stacks_anything_else(train_root):
    ds = ImageDataset(train_root, build_view_transforms("mocov2", 16), seed=0)
    items = ds.__getitems__([3, 1, 4])
    views, _, _ = collate(items)
    for j, v in enumerate(views):
        assert v.data_ptr() == items[0][0][j].data_ptr()  # the batch itself, not a copy
        assert torch.equal(v, torch.stack([item[0][j] for item in items]))
    # Rows of one batch in another order, or a subset, are stacked (copied) as given.
    shuffled = [items[2], items[0], items[1]]
    views, _, _ = collate(shuffled)
    assert views[0].data_ptr() != items[0][0][0].data_ptr()
    assert torch.equal(views[0], torch.stack([item[0][0] for item in shuffled]))
    assert torch.equal(collate(items[:2])[0][0], torch.stack([items[0][0][0], items[1][0][0]]))


def test_corrupt_files_are_reported_and_replaced(small_copy):
    files = sorted(small_copy.rglob("*.JPEG"))
    garbage, truncated = files[4], files[15]
    garbage.write_bytes(b"this is not a jpeg" * 50)
    whole = truncated.read_bytes()
    truncated.write_bytes(whole[: len(whole) // 2])
    ds = ImageDataset(small_copy, build_view_transforms("mocov2", 16), seed=0)
    paths = [p for p, _ in ds.samples]
    i = paths.index(str(garbage))
    views, label, bad = ds[i]
    assert bad == [str(garbage)] and label == ds.samples[i + 1][1]
    assert [v.shape for v in views] == [(3, 16, 16)] * 2
    assert ds[paths.index(str(truncated))][2] == [str(truncated)]

    loader, seen = build_loader(ds, 4, seed=0), []
    tight, loose = BadImageTracker(max_fraction=0.05), BadImageTracker(max_fraction=0.1)
    for views, labels, bad in loader:
        assert views[0].shape[0] == labels.shape[0] == 4
        seen += bad
        for tracker in (tight, loose):
            tracker.update(bad, len(labels))
    assert sorted(seen) == sorted([str(garbage), str(truncated)])
    loose.check()  # 2 / 24 = 8.3% ≤ 10%
    with pytest.raises(RuntimeError) as e:
        tight.check()
    assert garbage.name in str(e.value) and truncated.name in str(e.value) and "8.3" in str(e.value)


def test_all_files_unreadable_raises(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="no readable image"):
        ImageDataset(tmp_path, [eval_transform(16)])[0]


def test_tracker_names_at_most_five_files():
    t = BadImageTracker(max_fraction=0.0)
    t.check()  # nothing seen yet
    t.update([f"bad{i}.jpg" for i in range(7)], 100)
    with pytest.raises(RuntimeError) as e:
        t.check()
    assert "bad4.jpg" in str(e.value) and "bad5.jpg" not in str(e.value)
    assert "7 of 100" in t.summary()


def test_flat_folder_gives_label_minus_one(train_root, tmp_path):
    for p in sorted(train_root.rglob("*.JPEG"))[:5]:
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "notes.txt").write_text("not an image")
    ds = ImageDataset(tmp_path, [eval_transform(16)])
    assert len(ds) == 5 and ds.classes == [] and {ds[i][1] for i in range(5)} == {-1}


def test_missing_or_empty_root_errors_name_the_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        ImageDataset(tmp_path / "does_not_exist", [eval_transform(16)])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    (tmp_path / "empty" / "class_a").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        ImageDataset(tmp_path / "empty", [eval_transform(16)])
    assert "empty" in str(e.value) and ".jpg" in str(e.value) and "class_a" in str(e.value)


# ------------------------------------------------------------------------------ sampler


def test_sampler_shards_are_disjoint_interleaved_slices_of_one_permutation():
    n, world, b = 103, 3, 4
    full = list(ShardedSampler(n, 1, 0, seed=7, batch_size=1))
    assert sorted(full) == list(range(n))
    kept = full[: (n // (world * b)) * world * b]  # 96: whole global batches only
    shards = [ShardedSampler(n, world, r, seed=7, batch_size=b) for r in range(world)]
    for r, s in enumerate(shards):
        assert s.batches_per_epoch == 8 and len(s) == 32
        assert list(s) == kept[r::world]
    assert sorted(i for s in shards for i in s) == sorted(kept)
    s = shards[0]
    s.set_epoch(1)
    assert list(s) != kept[0::world] and list(s) == list(s)
    assert list(ShardedSampler(n, world, 0, seed=8, batch_size=b)) != kept[0::world]


def test_sampler_resume_skips_exactly_the_consumed_batches():
    s = ShardedSampler(50, 2, 1, seed=0, batch_size=3)  # 8 batches of 3 per rank
    s.set_epoch(4)
    uninterrupted = list(s)
    r = ShardedSampler(50, 2, 1, seed=0, batch_size=3)
    r.set_epoch(4, start_batch=5)
    assert list(r) == uninterrupted[15:] and len(r) == 9 and r.batches_per_epoch == 8
    r.set_epoch(4, start_batch=8)
    assert list(r) == [] and len(r) == 0
    r.set_epoch(5)  # the next epoch starts from its first batch again
    assert len(list(r)) == 24
    with pytest.raises(ValueError):
        r.set_epoch(5, start_batch=9)
    with pytest.raises(ValueError):
        ShardedSampler(50, 2, 2, seed=0, batch_size=3)


def test_every_preset_file_is_a_named_preset_and_builds():
    """The presets the config accepts are the files of configs/augment/, and each builds its views
    (a preset file added without its name, or a name without its file, fails here)."""
    from pretrain.augment.views import PRESET_DIR, PRESETS

    assert set(PRESETS) == {p.stem for p in PRESET_DIR.glob("*.yaml")}
    for name in PRESETS:
        assert len(build_view_transforms(name, 32)) == 2
