"""The digits augmentation preset (configs/augment/digits.yaml): the fast backend makes the
reference's views of it (its affine runs the reference's geometry), it never mirrors a digit (the
simclr preset, with its flip, is the control) and it rotates only slightly."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from pretrain.augment import build_view_transforms
from pretrain.augment.views import resolve
from pretrain.data import ImageDataset, collate


def test_the_preset_declares_no_flip_and_only_grey_colour_ops():
    view = resolve("digits", None)[0]
    assert list(view) == ["crop", "affine", "jitter", "blur"]
    assert view["jitter"].get("hue", 0) == 0 and view["jitter"].get("saturation", 0) == 0


def test_fast_backend_draws_and_crops_equal_the_reference(digits_root):
    root = digits_root / "imagenet" / "train"
    views = build_view_transforms("digits", 32, 0.5)
    indices = list(range(0, 1258, 37))
    ref, fast = (
        collate(ImageDataset(root, views, seed=2, colour_on_device=True, backend=b).__getitems__(indices))[0]
        for b in ("torchvision", "fast")
    )
    for (ref_crops, ref_u), (crops, u) in zip(ref, fast):
        assert torch.equal(u, ref_u) and crops.dtype == torch.uint8
        assert torch.equal(crops, ref_crops)  # the affine view runs the reference's geometry on the same decode


def _asymmetric(tmp_path, n: int = 8):
    """40-px images: a digit-sized square bright on its left half, dim on its right half."""
    folder = tmp_path / "imgs" / "a"
    folder.mkdir(parents=True)
    for i in range(n):
        image = np.zeros((40, 40), dtype=np.uint8)
        image[4:36, 4:20], image[4:36, 20:36] = 250, 90
        Image.fromarray(image).convert("RGB").save(folder / f"{i}.JPEG", quality=95)
    return folder.parent


def _left_minus_right(view: torch.Tensor) -> float:
    half = view.shape[-1] // 2
    return float(view[..., :half].float().mean() - view[..., half:].float().mean())


def test_digits_views_are_never_mirrored_and_the_flipping_control_is(tmp_path):
    root = _asymmetric(tmp_path)
    signs = {}
    for preset in ("digits", "simclr"):
        dataset = ImageDataset(root, build_view_transforms(preset, 32, 0.5), seed=0)
        diffs = []
        for epoch in range(4):
            dataset.set_epoch(epoch)
            diffs += [_left_minus_right(view) for item in dataset.__getitems__(list(range(8))) for view in item[0]]
        signs[preset] = np.sign(diffs)
    assert (signs["digits"] > 0).all()  # 64 views: the bright half stays on the left
    assert (signs["simclr"] < 0).any()  # the control: a flip puts it on the right


def test_every_tiny_recipe_builds_its_views_on_the_digits_by_naming_the_preset(digits_root):
    """The digits overrides (augmentation preset, 32 px) on each tiny recipe: its views, AdCo's
    multi-crop included, are made from the digits preset's ops, at the recipe's sizes."""
    from pathlib import Path

    from contrastive_transfer.synthetic.digits import PRETRAIN_OVERRIDES
    from pretrain.config import load_config
    from pretrain.methods import METHODS

    recipes = sorted((Path(__file__).resolve().parents[2] / "configs" / "pretrain").glob("tiny_*.yaml"))
    assert len(recipes) >= 16
    with Image.open(next((digits_root / "imagenet" / "train" / "3").iterdir())) as im:
        image = im.convert("RGB")
    for recipe in recipes:
        cfg = load_config(recipe, [f"data.root={digits_root / 'imagenet' / 'train'}", *PRETRAIN_OVERRIDES])
        assert cfg.data.augmentation == "digits" and list(cfg.data.views[0]) == ["crop", "affine", "jitter", "blur"]
        views = METHODS[cfg.method.name].view_transforms(cfg)
        sides = [view(image).shape[-1] for view in views]
        expected = {"tiny_adco_multicrop": 6, "tiny_supervised": 1}.get(recipe.stem, 2)  # key + 5 queries; one view
        assert sides[0] == 32 and len(sides) == expected, (recipe.stem, sides)
