"""Augmentation as data (pretrain/augment/views.py, configs/augment/): the four presets give bit for bit the
views of the hand-written pipelines they replace (tests/pretrain/view_reference.py) for several
seeds, epochs, indices, both views and AdCo's multi-crop; a custom pipeline (rotation + affine, no
flip, grayscale input) trains end to end and does what it says; bad declarations are one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from PIL import Image

from contrastive_transfer.errors import ConfigError
from pretrain.augment import build_multicrop_transforms, build_view_transforms
from pretrain.config import load_config
from pretrain.data import ImageDataset
from pretrain.engine import train
from pretrain.methods import METHODS

from . import view_reference as reference

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "pretrain"


def _views(dataset: ImageDataset, epoch: int, indices: list[int]) -> list[torch.Tensor]:
    dataset.set_epoch(epoch)
    items = dataset.__getitems__(indices)
    return [torch.stack([item[0][v] for item in items]) for v in range(len(dataset.views))]


@pytest.mark.parametrize("preset", ["mocov1", "mocov2", "simclr", "byol"])
@pytest.mark.parametrize("size,min_crop_scale", [(24, None), (40, 0.5)])
def test_presets_equal_the_hand_written_pipelines_bit_for_bit(synthetic_root, preset, size, min_crop_scale):
    root = synthetic_root / "imagenet" / "train"
    for seed in (0, 3):
        ours = ImageDataset(root, build_view_transforms(preset, size, min_crop_scale), seed=seed, backend="torchvision")
        ref = ImageDataset(
            root, reference.build_view_transforms(preset, size, min_crop_scale), seed=seed, backend="torchvision"
        )
        for epoch, indices in ((0, [0, 5, 17, 33]), (2, [7, 7, 250, 399])):
            got, want = _views(ours, epoch, indices), _views(ref, epoch, indices)
            assert len(got) == len(want) == 2
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (preset, seed, epoch)


def test_multicrop_equals_the_hand_written_pipeline(synthetic_root):
    root = synthetic_root / "imagenet" / "train"
    args = (48, [48, 32, 16], [0.2, 0.15, 0.1], [1.0, 0.8, 0.5], 0.3)
    ours, ref = (
        ImageDataset(root, build(*args), seed=1, backend="torchvision")
        for build in (build_multicrop_transforms, reference.build_multicrop_transforms)
    )
    got, want = _views(ours, 1, [3, 9, 100]), _views(ref, 1, [3, 9, 100])
    assert [g.shape[-1] for g in got] == [48, 48, 32, 16]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_recipe_builds_the_views_of_its_config(synthetic_root):
    cfg = load_config(RECIPES / "tiny_simclr.yaml", ["data.image_size=24"])
    root = synthetic_root / "imagenet" / "train"
    ours = ImageDataset(root, METHODS[cfg.method.name].view_transforms(cfg), seed=2, backend="torchvision")
    ref = ImageDataset(
        root, reference.build_view_transforms("simclr", 24, cfg.data.min_crop_scale), seed=2, backend="torchvision"
    )
    assert all(torch.equal(g, w) for g, w in zip(_views(ours, 1, [4, 8]), _views(ref, 1, [4, 8])))


# ------------------------------------------------------------------------------ custom views


def _asymmetric_image(path: Path, size: int = 48) -> None:
    """Black left half, white right half, and a bright square at angle 0 from the centre."""
    img = np.zeros((size, size, 3), dtype=np.uint8)
    img[:, size // 2 :] = 90
    img[size // 2 - 2 : size // 2 + 2, size - 10 : size - 6] = 255
    Image.fromarray(img).save(path)


def _left_right(view: torch.Tensor) -> tuple[float, float]:
    half = view.shape[-1] // 2
    return view[..., :half].mean().item(), view[..., half:].mean().item()


def _dataset(tmp_path: Path, views_cfg: list[dict], seed: int = 0) -> ImageDataset:
    folder = tmp_path / "images"
    if not folder.is_dir():
        folder.mkdir()
        for i in range(8):
            _asymmetric_image(folder / f"{i}.png")
    return ImageDataset(folder, build_view_transforms("mocov2", 48, None, views_cfg), seed=seed, backend="torchvision")


FULL_CROP = {"crop": {"scale": [1.0, 1.0], "ratio": [1.0, 1.0]}}


def test_no_flip_never_mirrors_and_the_control_always_does(tmp_path):
    never = _dataset(tmp_path, [{**FULL_CROP, "grayscale": {"p": 0.5}}])
    always = _dataset(tmp_path, [{**FULL_CROP, "hflip": {"p": 1.0}}])
    for epoch in range(3):
        for view in _views(never, epoch, list(range(8))):
            for image in view:
                left, right = _left_right(image)
                assert left < right  # never mirrored
        for view in _views(always, epoch, list(range(8))):
            assert all(_left_right(image)[0] > _left_right(image)[1] for image in view)


def _marker_angle(image: torch.Tensor) -> float:
    """Angle (degrees) of the bright square's centroid around the image centre."""
    bright = image.mean(dim=0) > image.mean(dim=0).max() - 0.3
    ys, xs = bright.nonzero(as_tuple=True)
    c = (image.shape[-1] - 1) / 2
    return math.degrees(math.atan2(-(ys.float().mean() - c), xs.float().mean() - c))


def test_rotation_stays_within_its_degrees(tmp_path):
    small = _dataset(tmp_path, [{**FULL_CROP, "rotation": {"degrees": 10}}])
    large = _dataset(tmp_path, [{**FULL_CROP, "rotation": {"degrees": 90}}])
    small_angles = [_marker_angle(img) for v in _views(small, 0, list(range(8))) for img in v]
    large_angles = [_marker_angle(img) for v in _views(large, 0, list(range(8))) for img in v]
    assert max(abs(a) for a in small_angles) <= 10 + 3  # the marker is a few pixels wide
    assert max(abs(a) for a in small_angles) > 1  # it did rotate
    assert max(abs(a) for a in large_angles) > 20  # the control: a wider range shows


def test_custom_pipeline_on_grayscale_images_trains_end_to_end(tmp_path):
    data = tmp_path / "gray" / "a"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(16):
        Image.fromarray(rng.integers(0, 255, (40, 40), dtype=np.uint8), mode="L").save(data / f"{i}.png")
    views = (
        "data.views=[{crop: {scale: [0.5, 1.0]}, rotation: {degrees: 15}, "
        "affine: {p: 0.5, translate: [0.1, 0.1], scale: [0.9, 1.1]}, grayscale: {p: 1.0}}]"
    )
    cfg = load_config(
        RECIPES / "tiny_simclr.yaml",
        [
            f"data.root={data.parent}",
            f"train.output_dir={tmp_path / 'out'}",
            "train.max_steps=2",
            "train.batch_size=8",
            "data.num_workers=0",
            "data.image_size=32",
            views,
        ],
    )
    assert list(cfg.data.views[0]) == ["crop", "rotation", "affine", "grayscale"] and len(cfg.data.views) == 2
    assert train(cfg, Accelerator(cpu=True)).is_file()
    sample = ImageDataset(data.parent, METHODS[cfg.method.name].view_transforms(cfg))[0][0][0]
    assert sample.shape == (3, 32, 32)  # a 1-channel image becomes 3 channels


# ------------------------------------------------------------------------------ bad declarations


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.views.0.twirl.p=0.5", "data.views.0.twirl: unknown op; expected one of crop, hflip"),
        ("data.views.0.jitter.brightnes=0.3", "data.views.0.jitter.brightnes: unknown parameter; allowed: brightness"),
        ("data.views.1.grayscale.p=1.5", "data.views.1.grayscale.p=1.5: expected a probability in [0, 1]"),
        ("data.views.0.crop.interpolation=lanczos", "data.views.0.crop.interpolation='lanczos': expected one of"),
        ("data.views.5.hflip.p=0", "data.views.5: expected 'all' or a view index below 2"),
        ("data.augmentation=randaug", "data.augmentation='randaug': expected one of mocov1, mocov2"),
        ("data.views.0.blur.sigma=[-1.0,2.0]", "data.views.0.blur: "),
    ],
)
def test_bad_declarations_fail_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPES / "tiny_mocov2.yaml", [override])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_edits_all_views_or_one_and_removes_with_null():
    cfg = load_config(
        RECIPES / "tiny_mocov2.yaml",
        [
            "data.augmentation=byol",
            "data.views.all.jitter.p=0.5",
            "data.views.1.solarize=null",
            "data.views.0.vflip.p=0.3",
        ],
    )
    v0, v1 = cfg.data.views
    assert v0.jitter.p == v1.jitter.p == 0.5 and v0.jitter.brightness == 0.4
    assert "solarize" not in v1 and v0.solarize.p == 0.0 and list(v0)[-1] == "vflip"
