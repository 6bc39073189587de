"""data.backend: device (pretrain/augment/on_device.py), run on CPU through the interface a GPU uses:
the workers send bytes and draws, finish_views decodes (batched decode_jpeg, TorchCodec's and
torchvision's) and augments; the views are the torchvision reference's for the same (seed, epoch,
index), equal (``device``) or within the fast backend's stated PSNR (``device_batched``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from pretrain.augment import build_view_transforms, on_device
from pretrain.augment.on_device import (
    EncodedBatch,
    batched_crops,
    exact_crops,
    jpeg_decoders,
    padded_canvas,
    size_groups,
)
from pretrain.data import ImageDataset, build_loader, collate, finish_views, set_loader_epoch

CPU = torch.device("cpu")
STD = torch.tensor((0.229, 0.224, 0.225)).reshape(1, 3, 1, 1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image, on the 0–255 scale (tests/pretrain/test_augment_fast.py's)."""
    mse = (a.double() - b.double()).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(255**2 / mse.clamp(min=1e-12))


@pytest.fixture(scope="module")
def photo_root(tmp_path_factory):
    """Six JPEGs with ImageNet's sides and bytes (350–460 px, ~110 KB; benchmarks/data.py)."""
    from benchmarks.data import write_images

    root = tmp_path_factory.mktemp("photos")
    write_images(root, 6)
    return root / "photo"


@pytest.mark.parametrize("decoder", list(jpeg_decoders()))
@pytest.mark.parametrize("preset", ["mocov2", "byol"])
def test_device_views_are_the_references(synthetic_root, preset, decoder, monkeypatch):
    monkeypatch.setattr(on_device, "JPEG_DECODER", decoder)  # TorchCodec where installed, and torchvision
    root = synthetic_root / "imagenet" / "train"
    views = build_view_transforms(preset, 32)
    indices = [0, 5, 17, 33, 250]
    ref = collate(ImageDataset(root, views, seed=2, backend="torchvision").__getitems__(indices))[0]
    encoded, labels, bad = collate(ImageDataset(root, views, seed=2, backend="device").__getitems__(indices))
    assert isinstance(encoded, EncodedBatch) and encoded.data[0].dim() == 1 and bad == []
    got = finish_views(encoded, views, CPU)
    for g, r in zip(got, ref):
        # same decoder (libjpeg-turbo), resize and colour ops: equal up to float rounding
        assert g.shape == r.shape and ((g - r) * STD * 255).abs().max() < 0.01


def test_device_draws_do_not_depend_on_workers_and_non_jpegs_are_sent_decoded(synthetic_root, tmp_path):
    files = sorted((synthetic_root / "imagenet" / "train").rglob("*.JPEG"))[:16]
    for i, f in enumerate(files):
        if i % 4 == 0:
            Image.open(f).save(tmp_path / f"{i:02d}.png")
        else:
            (tmp_path / f"{i:02d}.jpg").write_bytes(f.read_bytes())
    views = build_view_transforms("simclr", 24)
    runs = []
    for workers in (0, 2):
        loader = build_loader(ImageDataset(tmp_path, views, seed=1, backend="device"), 8, num_workers=workers)
        set_loader_epoch(loader, 1)
        runs.append([torch.cat(finish_views(b[0], views, CPU)) for b in loader])
    assert all(torch.equal(a, b) for a, b in zip(*runs)) and len(runs[0]) == 2
    loader = build_loader(ImageDataset(tmp_path, views, seed=1, backend="torchvision"), 8)
    set_loader_epoch(loader, 1)
    for got, (ref_views, _, _) in zip(runs[0], loader):
        assert ((got - torch.cat(ref_views)) * STD * 255).abs().max() < 0.01


def test_views_with_geometry_beyond_crop_and_flips_are_refused(synthetic_root):
    views = build_view_transforms("mocov2", 24, views=[{"crop": {}, "rotation": {"degrees": 10}}])
    with pytest.raises(ValueError, match="data.backend=device"):
        ImageDataset(synthetic_root / "imagenet" / "train", views, backend="device")


def test_the_engine_trains_with_decode_on_the_device(synthetic_root, tmp_path):
    import json
    import math
    from pathlib import Path

    from accelerate import Accelerator

    from pretrain.config import load_config
    from pretrain.engine import train

    recipe = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "tiny_mocov2.yaml"
    overrides = [f"data.root={synthetic_root / 'imagenet' / 'train'}", f"train.output_dir={tmp_path}"]
    cfg = load_config(recipe, [*overrides, "data.backend=device", "train.max_steps=2", "knn.train_dir=null"])
    train(cfg, Accelerator(cpu=True))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)


def test_torchcodec_is_preferred_where_it_is_installed():
    try:
        import torchcodec.decoders  # noqa: F401
    except Exception:
        assert on_device.JPEG_DECODER == "torchvision"
    else:
        assert on_device.JPEG_DECODER == "torchcodec"


# ------------------------------------------------------------------ device_batched: roi_align geometry


@pytest.mark.parametrize("preset", ["mocov2", "simclr"])
def test_batched_views_are_within_the_stated_psnr_of_the_references(photo_root, preset):
    """``device_batched``'s 224 px views (crops by roi_align, then the colour stage) against the
    torchvision reference on the same draws, as the fast backend's are stated for such JPEGs
    (docs/augmentation.md: median 45 dB, worst 36 dB); measured here median 44–47 dB, worst 38."""
    views = build_view_transforms(preset, 224)
    indices = list(range(6))
    ref = collate(ImageDataset(photo_root, views, seed=4, backend="torchvision").__getitems__(indices))[0]
    encoded = collate(ImageDataset(photo_root, views, seed=4, backend="device_batched").__getitems__(indices))[0]
    assert encoded.backend == "device_batched"
    got = finish_views(encoded, views, CPU)
    quality = torch.cat([psnr(g * STD * 255, r * STD * 255) for g, r in zip(got, ref)])
    assert quality.min() > 35 and quality.median() > 40, quality


def test_batched_crops_are_the_reference_resize_and_a_wrong_box_or_flip_is_caught(photo_root):
    """The geometry alone against the reference's per-image antialiased resize on the same decoded
    images and draws; controls: the box's corner read as (left, top), and the flips left out."""
    views = build_view_transforms("mocov2", 224)
    encoded = collate(ImageDataset(photo_root, views, seed=1, backend="device_batched").__getitems__(range(6)))[0]
    images = on_device.decode_images(encoded, CPU)
    boxes, flips = encoded.boxes.tolist(), encoded.flips.tolist()
    ref = torch.cat([exact_crops(images, boxes, flips, views[v].geometric[0], v) for v in range(2)])

    def quality(boxes: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:  # view-major, as ref
        return psnr(torch.cat(batched_crops(images, boxes, flips, [(224, 224)] * 2)) * 255, ref)

    good = quality(encoded.boxes, encoded.flips)
    assert good.min() > 35 and good.median() > 40, good
    moved = (encoded.boxes[..., 0] != encoded.boxes[..., 1]).T.flatten()
    assert moved.all() and (quality(encoded.boxes[..., [1, 0, 2, 3]], encoded.flips) < 30).all()
    flipped = encoded.flips[..., 0].T.flatten()  # mocov2: horizontal flips only
    assert flipped.any() and not flipped.all()
    unflipped = quality(encoded.boxes, torch.zeros_like(encoded.flips))
    assert (unflipped[flipped] < 30).all() and torch.equal(unflipped[~flipped], good[~flipped])


def test_bicubic_views_take_the_exact_path(synthetic_root):
    """roi_align resizes bilinearly: BYOL's bicubic views are the reference's crops, as ``device``'s."""
    root = synthetic_root / "imagenet" / "train"
    views = build_view_transforms("byol", 32)
    ref = collate(ImageDataset(root, views, seed=2, backend="torchvision").__getitems__([1, 2, 3]))[0]
    encoded = collate(ImageDataset(root, views, seed=2, backend="device_batched").__getitems__([1, 2, 3]))[0]
    for g, r in zip(finish_views(encoded, views, CPU), ref):
        assert ((g - r) * STD * 255).abs().max() < 0.01


def test_the_padded_canvas_repeats_each_images_last_row_and_column():
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in ((5, 7), (9, 4), (6, 6))]
    canvas = padded_canvas(images)
    assert canvas.shape == (3, 3, 9, 7) and canvas.dtype == torch.float32
    for image, got in zip(images, canvas):
        h, w = image.shape[-2:]
        assert torch.equal(got, F.pad(image[None].float(), (0, 7 - w, 0, 9 - h), mode="replicate")[0])


def test_size_groups_bound_the_padding_and_the_canvas():
    shapes = [(375, 500), (500, 375), (333, 500), (500, 500), (4000, 300), (300, 4000), (32, 32)] * 3
    groups = size_groups(shapes)
    assert sorted(i for group in groups for i in group) == list(range(len(shapes)))
    for group in groups:
        padded = len(group) * max(shapes[i][0] for i in group) * max(shapes[i][1] for i in group)
        assert len(group) == 1 or padded <= 2 * sum(shapes[i][0] * shapes[i][1] for i in group)
    assert len(groups) < len(shapes) // 2  # similar sizes do share a canvas
    assert size_groups([(100, 100)] * 4) == [[0, 1, 2, 3]]
    assert size_groups([(100, 100)] * 4, limit=3 * 2 * 100 * 100) == [[0, 1], [2, 3]]


def test_batched_crops_flip_each_axis_and_take_mixed_sizes():
    """Hand-set boxes and all four flip combinations on smooth images of three sizes (one canvas
    each or shared), against the reference's crops; control: the vertical flip left out."""
    g = torch.Generator().manual_seed(0)
    images = []
    for h, w in ((300, 400), (420, 260), (90, 120)):
        yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
        smooth = torch.stack([xx, yy, (xx + yy) / 2]) * 200 + 20 + 25 * torch.sin(12 * xx + 7 * yy)
        images.append((smooth + 10 * torch.rand(3, h, w, generator=g)).clamp(0, 255).round().to(torch.uint8))
    # per image, two views' (top, left, height, width): shrunk up to 4.7×, whole, enlarged 1.6×
    boxes = torch.tensor([[[10, 20, 200, 150], [0, 0, 300, 400]], [[30, 5, 380, 250], [100, 60, 40, 50]]])
    boxes = torch.cat([boxes, torch.tensor([[[0, 0, 90, 120], [5, 7, 60, 30]]])])
    flips = torch.tensor([[[1, 0], [0, 1]], [[1, 1], [0, 0]], [[0, 1], [1, 1]]], dtype=torch.bool)  # (h, v)
    op = build_view_transforms("mocov2", 64)[0].geometric[0]
    ref = [exact_crops(images, boxes.tolist(), flips.tolist(), op, v) for v in range(2)]
    got = batched_crops(images, boxes, flips, [(64, 64)] * 2)
    quality = torch.cat([psnr(g * 255, r) for g, r in zip(got, ref)])
    assert quality.min() > 50, quality  # measured 54.7–56.8 dB (smooth shading)
    no_vflip = flips.clone()
    no_vflip[..., 1] = False
    wrong = torch.cat([psnr(g * 255, r) for g, r in zip(batched_crops(images, boxes, no_vflip, [(64, 64)] * 2), ref)])
    assert (wrong[flips[..., 1].T.flatten()] < 25).all()
