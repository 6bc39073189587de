"""data.backend: device (pretrain/augment/on_device.py), run on CPU through the interface a GPU uses:
the workers send bytes and draws, finish_views decodes (batched decode_jpeg, TorchCodec's and
torchvision's) and augments; the views are the torchvision reference's for the same (seed, epoch,
index)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from pretrain.augment import build_view_transforms, on_device
from pretrain.augment.on_device import EncodedBatch, jpeg_decoders
from pretrain.data import ImageDataset, build_loader, collate, finish_views, set_loader_epoch

CPU = torch.device("cpu")
STD = torch.tensor((0.229, 0.224, 0.225)).reshape(1, 3, 1, 1)


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
