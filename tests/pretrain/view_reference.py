"""Frozen reference: the view recipes as hand-written torchvision v2 pipelines before augmentation
became data (configs/augment/). The tests check that the declared presets build views that are bit
for bit these. Do not edit: it is the yardstick, not the implementation."""

from __future__ import annotations

from typing import Sequence

from torchvision.transforms import v2

from pretrain.augment import ViewTransform

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_ALIASES = {"aug+": "mocov2", "aug_plus": "mocov2", "moco_v1": "mocov1", "moco_v2": "mocov2"}
RECIPES = ("mocov1", "mocov2", "simclr", "byol")
BICUBIC = v2.InterpolationMode.BICUBIC
SIGMA = (0.1, 2.0)


def blur_kernel_size(side: int) -> int:
    """SimCLR's kernel: radius = (side // 10) // 2, size 2·radius + 1 (23 at 224); at least 3."""
    return max(3, 2 * ((side // 10) // 2) + 1)


def _view(*ops) -> ViewTransform:
    # Geometric ops run per sample on the uint8 image the dataset decoded once; the colour ops run
    # batched on float in ImageDataset.__getitems__; normalization comes last (pretrain/augment/pipeline.py).
    return ViewTransform(ops, IMAGENET_MEAN, IMAGENET_STD)


def _aug_plus(size: int, scale: tuple[float, float] = (0.2, 1.0)) -> ViewTransform:
    """MoCo v2 aug+: crop → jitter(.4,.4,.4,.1) p .8 → gray .2 → blur p .5 → flip."""
    return _view(
        v2.RandomResizedCrop(size, scale=scale, antialias=True),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        v2.RandomGrayscale(p=0.2),
        v2.RandomApply([v2.GaussianBlur(blur_kernel_size(size), sigma=SIGMA)], p=0.5),
        v2.RandomHorizontalFlip(),
    )


def _byol(size: int, blur_p: float, solarize_p: float, scale: tuple[float, float] = (0.08, 1.0)) -> ViewTransform:
    """BYOL: crop (bicubic) → flip → jitter(.4,.4,.2,.1) p .8 → gray → blur → solarize."""
    return _view(
        v2.RandomResizedCrop(size, scale=scale, interpolation=BICUBIC, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
        v2.RandomGrayscale(p=0.2),
        v2.RandomApply([v2.GaussianBlur(blur_kernel_size(size), sigma=SIGMA)], p=blur_p),
        v2.RandomSolarize(threshold=128, p=solarize_p),
    )  # x ≥ 128/255 → 1 − x


def build_view_transforms(recipe: str, image_size: int, min_crop_scale: float | None = None) -> list[ViewTransform]:
    """Two view transforms; BYOL's two differ (blur, solarize), the other recipes reuse one.

    ``min_crop_scale`` replaces the recipe's lower bound of the crop area (MoCo 0.2, SimCLR and
    BYOL 0.08); None keeps the paper's.
    """
    name = _ALIASES.get(recipe, recipe)
    if min_crop_scale is not None and not 0 < min_crop_scale <= 1:
        raise ValueError(f"min_crop_scale={min_crop_scale}: expected a fraction of the image area in (0, 1]")
    moco_scale = (min_crop_scale or 0.2, 1.0)
    simclr_scale = (min_crop_scale or 0.08, 1.0)
    if name == "mocov1":  # InstDisc: jitter always applied; crop → gray → jitter → flip
        t = _view(
            v2.RandomResizedCrop(image_size, scale=moco_scale, antialias=True),
            v2.RandomGrayscale(p=0.2),
            v2.ColorJitter(0.4, 0.4, 0.4, 0.4),
            v2.RandomHorizontalFlip(),
        )
    elif name == "mocov2":
        t = _aug_plus(image_size, moco_scale)
    elif name == "simclr":  # torch port of the TF recipe (strength s = 1)
        t = _view(
            v2.RandomResizedCrop(image_size, scale=simclr_scale, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomApply([v2.ColorJitter(0.8, 0.8, 0.8, 0.2)], p=0.8),
            v2.RandomGrayscale(p=0.2),
            v2.RandomApply([v2.GaussianBlur(blur_kernel_size(image_size), sigma=SIGMA)], p=0.5),
        )
    elif name == "byol":
        return [
            _byol(image_size, blur_p=1.0, solarize_p=0.0, scale=simclr_scale),
            _byol(image_size, blur_p=0.1, solarize_p=0.2, scale=simclr_scale),
        ]
    else:
        raise ValueError(
            f"unknown augmentation recipe {recipe!r}; expected one of "
            f"{', '.join(RECIPES)} (aliases: {', '.join(_ALIASES)})"
        )
    return [t, t]  # same pipeline, different random draws


def build_multicrop_transforms(
    image_size: int,
    sizes: Sequence[int] | None = None,
    min_scales: Sequence[float] | None = None,
    max_scales: Sequence[float] | None = None,
    key_min_scale: float | None = None,
) -> list[ViewTransform]:
    """AdCo: crop 0 is the key (``image_size``, scale .2–1, or ``key_min_scale``–1), then one aug+
    query crop per size (the query crops keep their own scale ranges).

    ``sizes`` are pixels; the default is AdCo's (224, 192, 160, 128, 96) scaled to ``image_size``.
    """
    sizes = sizes or [round(s * image_size / 224) for s in (224, 192, 160, 128, 96)]
    min_scales = min_scales or (0.2, 0.172, 0.143, 0.114, 0.086)
    max_scales = max_scales or (1.0, 0.86, 0.715, 0.571, 0.429)
    if not len(sizes) == len(min_scales) == len(max_scales):
        raise ValueError(
            f"multi-crop: sizes {list(sizes)}, min_scales {list(min_scales)} and "
            f"max_scales {list(max_scales)} must have the same length"
        )
    queries = [_aug_plus(s, (lo, hi)) for s, lo, hi in zip(sizes, min_scales, max_scales)]
    return [_aug_plus(image_size, (key_min_scale or 0.2, 1.0))] + queries
