"""Augmentation as data: each view is an ordered mapping ``op name → parameters`` in the config.

    data:
      augmentation: mocov2        # a preset of configs/augment/ (mocov1, mocov2, simclr, byol, supervised, digits)
      views: null                 # null: the preset's views; a list replaces them;
                                  # a mapping edits them: {0: {jitter: {p: 0.5}, hflip: null}}

On the command line: ``data.views.0.jitter.p=0.5`` edits view 0, ``data.views.all.jitter.p=0.5``
every view, ``data.views.all.hflip=null`` removes an op, ``data.views.all.rotation.degrees=15``
adds one (after the others of its group, see below). A preset with one view uses it for both views,
with independent draws; BYOL declares two.

Execution (``pretrain/augment/pipeline.py``): the geometric ops (crop, flips, rotation, affine, perspective,
equalize) run per image on uint8 in their declared order; then the colour ops (jitter, grayscale,
blur, solarize) run batched with per-image draws, in their declared order, then normalisation.
An op with p = 0 still takes its random draws (so the other ops draw as before); ``null`` removes it.

Every op and parameter is in ``OPS``; docs/augmentation.md lists them with the presets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from torchvision.transforms import v2

from contrastive_transfer.contract import IMAGENET_MEAN, IMAGENET_STD
from contrastive_transfer.paths import escapes

if TYPE_CHECKING:
    from pretrain.augment.pipeline import ViewTransform

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "augment"
PRESETS = ("mocov1", "mocov2", "simclr", "byol", "supervised", "digits")
SIGMA = (0.1, 2.0)  # blur σ range of MoCo v2 / SimCLR / BYOL (the presets); not scaled with image size
ALIASES = {"aug+": "mocov2", "aug_plus": "mocov2", "moco_v1": "mocov1", "moco_v2": "mocov2"}
INTERPOLATIONS = {
    "bilinear": v2.InterpolationMode.BILINEAR,
    "bicubic": v2.InterpolationMode.BICUBIC,
    "nearest": v2.InterpolationMode.NEAREST,
}


class ViewError(ValueError):
    """A bad view declaration; the message names the key and the allowed values."""


def blur_kernel_size(side: int) -> int:
    """SimCLR's kernel: radius = (side // 10) // 2, size 2·radius + 1 (23 at 224); at least 3."""
    return max(3, 2 * ((side // 10) // 2) + 1)


@dataclass(frozen=True)
class Op:
    defaults: dict[str, Any]
    build: Callable[[dict, int], v2.Transform]  # (parameters, crop size of the view) -> torchvision op
    geometric: bool


def _maybe(p: float, op: v2.Transform) -> v2.Transform:
    # RandomApply draws one uniform per call: only wrap when p < 1, so that p = 1 draws as the bare op.
    return op if p >= 1 else v2.RandomApply([op], p=p)


def _pair(value) -> tuple[float, float] | None:
    return None if value is None else tuple(float(v) for v in value)


OPS: dict[str, Op] = {
    "crop": Op(
        {"size": None, "scale": [0.08, 1.0], "ratio": None, "interpolation": "bilinear"},
        lambda a, size: v2.RandomResizedCrop(
            size,
            scale=_pair(a["scale"]),
            antialias=True,
            interpolation=INTERPOLATIONS[a["interpolation"]],
            **({} if a["ratio"] is None else {"ratio": _pair(a["ratio"])}),
        ),
        True,
    ),
    "hflip": Op({"p": 0.5}, lambda a, size: v2.RandomHorizontalFlip(p=a["p"]), True),
    "vflip": Op({"p": 0.5}, lambda a, size: v2.RandomVerticalFlip(p=a["p"]), True),
    "rotation": Op(
        {"p": 1.0, "degrees": 10.0, "fill": 0},
        lambda a, size: _maybe(a["p"], v2.RandomRotation(a["degrees"], fill=a["fill"])),
        True,
    ),
    "affine": Op(
        {"p": 1.0, "degrees": 0.0, "translate": None, "scale": None, "shear": None, "fill": 0},
        lambda a, size: _maybe(
            a["p"],
            v2.RandomAffine(
                a["degrees"], translate=_pair(a["translate"]), scale=_pair(a["scale"]), shear=a["shear"], fill=a["fill"]
            ),
        ),
        True,
    ),
    "perspective": Op(
        {"p": 0.5, "distortion": 0.5, "fill": 0},
        lambda a, size: v2.RandomPerspective(a["distortion"], p=a["p"], fill=a["fill"]),
        True,
    ),
    "equalize": Op({"p": 0.5}, lambda a, size: v2.RandomEqualize(p=a["p"]), True),
    "jitter": Op(
        {"p": 1.0, "brightness": 0.0, "contrast": 0.0, "saturation": 0.0, "hue": 0.0},
        lambda a, size: _maybe(a["p"], v2.ColorJitter(a["brightness"], a["contrast"], a["saturation"], a["hue"])),
        False,
    ),
    "grayscale": Op({"p": 0.2}, lambda a, size: v2.RandomGrayscale(p=a["p"]), False),
    "blur": Op(
        {"p": 0.5, "sigma": [0.1, 2.0], "kernel": None},
        lambda a, size: v2.RandomApply(
            [v2.GaussianBlur(a["kernel"] or blur_kernel_size(size), sigma=_pair(a["sigma"]))], p=a["p"]
        ),
        False,
    ),
    "solarize": Op(
        {"p": 0.2, "threshold": 128}, lambda a, size: v2.RandomSolarize(threshold=a["threshold"], p=a["p"]), False
    ),
}


def preset(name: str) -> list[dict]:
    """The views of a preset file (configs/augment/<name>.yaml), as plain lists of mappings."""
    name = ALIASES.get(name, name)
    if escapes(f"{name}.yaml") is not None or "/" in str(name) or "\\" in str(name):  # a name, never a path
        raise ViewError(f"data.augmentation={name!r}: expected a preset name in {PRESET_DIR}, not a path")
    path = PRESET_DIR / f"{name}.yaml"
    if name not in PRESETS and not path.is_file():
        raise ViewError(
            f"data.augmentation={name!r}: expected one of {', '.join(PRESETS)} "
            f"(aliases: {', '.join(ALIASES)}), or a file name in {PRESET_DIR}"
        )
    return OmegaConf.to_container(OmegaConf.load(path))["views"]


def resolve(augmentation: str, views) -> list[dict]:
    """The full list of views: the preset's (``views`` null), ``views`` itself (a list), or the
    preset edited by ``views`` (a mapping from view index to op edits; an op set to null is
    removed). One declared view serves as both views (independent draws)."""
    if isinstance(views, (DictConfig, ListConfig)):
        views = OmegaConf.to_container(views)
    edits = None
    if views is None or isinstance(views, dict):
        views, edits = preset(augmentation), views
    if not isinstance(views, list) or not views:
        raise ViewError(
            "data.views: expected null (the preset's), a list of views, or edits by view index "
            "(e.g. data.views.0.jitter.p=0.5)"
        )
    if len(views) > MAX_VIEWS:
        raise ViewError(f"data.views: {len(views)} views, expected at most {MAX_VIEWS}")
    resolved = [dict(views[0]), dict(views[0])] if len(views) == 1 else [dict(v) for v in views]
    for key, change in (edits or {}).items():
        if not (key == "all" or (str(key).isdigit() and int(key) < len(resolved))) or not isinstance(change, dict):
            raise ViewError(
                f"data.views.{key}: expected 'all' or a view index below {len(resolved)}, mapping op "
                "names to parameters (or to null, which removes the op)"
            )
        for index in range(len(resolved)) if key == "all" else [int(key)]:
            resolved[index] = _edit(resolved[index], change)
    for i, view in enumerate(resolved):
        check_view(view, f"data.views.{i}")
    return resolved


def _edit(view: dict, edits: dict) -> dict:
    out = {name: dict(params or {}) for name, params in view.items()}
    for name, params in edits.items():
        if params is None:
            out.pop(name, None)
        else:
            out.setdefault(name, {}).update(params)
    return out


# Parameters that size memory or work per image: a crop of 10^5 pixels a side, a blur kernel of 10^6
# taps. Bounded like data.image_size (pretrain.config.RANGES), far above any recipe.
_BOUNDED = {"crop": {"size": 4096}, "blur": {"kernel": 1023}}
MAX_VIEWS = 64  # views per image (multi-crop uses 2 + a few); each is decoded, augmented and encoded


def check_view(view, where: str) -> None:
    if not isinstance(view, dict) or not view:
        raise ViewError(f"{where}: expected a mapping of op names to parameters, e.g. {{crop: {{scale: [0.2, 1]}}}}")
    for name, params in view.items():
        if name not in OPS:
            raise ViewError(f"{where}.{name}: unknown op; expected one of {', '.join(OPS)}")
        params = params or {}
        if not isinstance(params, dict):
            raise ViewError(f"{where}.{name}: expected a mapping of parameters from {sorted(OPS[name].defaults)}")
        unknown = sorted(set(params) - set(OPS[name].defaults))
        if unknown:
            raise ViewError(
                f"{where}.{name}.{unknown[0]}: unknown parameter; allowed: {', '.join(sorted(OPS[name].defaults))}"
            )
        for param, high in _BOUNDED.get(name, {}).items():
            value = params.get(param)
            if value is not None and (type(value) is not int or not 1 <= value <= high):
                raise ViewError(f"{where}.{name}.{param}={value!r:.80}: expected an integer from 1 to {high}")
        p = params.get("p")
        if p is not None and not (isinstance(p, (int, float)) and 0 <= p <= 1):
            raise ViewError(f"{where}.{name}.p={p!r}: expected a probability in [0, 1]")
        interpolation = params.get("interpolation")
        if interpolation is not None and interpolation not in INTERPOLATIONS:
            raise ViewError(
                f"{where}.{name}.interpolation={interpolation!r}: expected one of {', '.join(INTERPOLATIONS)}"
            )
        args = {**OPS[name].defaults, **params}
        if name == "crop":
            args["size"] = args["size"] or 32
        try:  # torchvision checks the rest of each op's arguments
            OPS[name].build(args, 32)
        except (TypeError, ValueError) as e:
            raise ViewError(f"{where}.{name}: {' '.join(str(e).split())}") from None


def build_view(
    view: dict,
    image_size: int,
    min_crop_scale: float | None = None,
    size: int | None = None,
    scale: tuple[float, float] | None = None,
):
    """A ViewTransform of one declared view (geometric ops first, colour ops after, each group in
    declared order). ``size``/``scale`` replace the crop's (multi-crop); ``min_crop_scale`` replaces
    the lower bound of its scale."""
    from pretrain.augment.pipeline import ViewTransform

    ops = []
    crop_size = size or (view.get("crop") or {}).get("size") or image_size
    for name, params in view.items():
        args = {**OPS[name].defaults, **(params or {})}
        if name == "crop":
            args["size"] = crop_size
            lo, hi = scale or args["scale"]
            args["scale"] = [min_crop_scale if (min_crop_scale is not None and scale is None) else lo, hi]
        ops.append(OPS[name].build(args, crop_size))
    return ViewTransform(ops, IMAGENET_MEAN, IMAGENET_STD)  # it runs the geometric ops first


def with_min_crop_scale(views: list[dict], min_crop_scale: float | None) -> list[dict]:
    """``views`` with ``min_crop_scale`` written into every crop as the lower bound of its scale
    (what ``build_view`` applies), so that a config shows the crop that runs; None keeps them."""
    if min_crop_scale is None:
        return views
    out = []
    for view in views:
        if "crop" in view:
            crop = dict(view["crop"] or {})
            crop["scale"] = [min_crop_scale, (crop.get("scale") or OPS["crop"].defaults["scale"])[1]]
            view = {**view, "crop": crop}
        out.append(view)
    return out


def to_yaml(views: list[dict]) -> str:
    return OmegaConf.to_yaml(OmegaConf.create({"views": views}))


def build_view_transforms(
    augmentation: str, image_size: int, min_crop_scale: float | None = None, views=None
) -> list[ViewTransform]:
    """The ViewTransforms of the declared views (above): those of the augmentation preset
    ``augmentation`` (``data.augmentation``, a name in configs/augment/), or ``views`` (a full list,
    or edits of the preset). ``min_crop_scale`` replaces the lower bound
    of every view's crop area (MoCo 0.2, SimCLR and BYOL 0.08); None keeps the declared one."""
    if min_crop_scale is not None and not 0 < min_crop_scale <= 1:
        raise ValueError(f"min_crop_scale={min_crop_scale}: expected a fraction of the image area in (0, 1]")
    return [build_view(view, image_size, min_crop_scale) for view in resolve(augmentation, views)]


def build_multicrop_transforms(
    image_size: int,
    sizes: Sequence[int] | None = None,
    min_scales: Sequence[float] | None = None,
    max_scales: Sequence[float] | None = None,
    key_min_scale: float | None = None,
    view: dict | None = None,
) -> list[ViewTransform]:
    """AdCo: crop 0 is the key (``image_size``, the view's crop scale or ``key_min_scale``–1), then
    one query crop per size with its own scale range, all with the ops of ``view`` (default: the
    mocov2 preset, aug+).

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
    view = view or resolve("mocov2", None)[0]
    queries = [build_view(view, image_size, size=s, scale=(lo, hi)) for s, lo, hi in zip(sizes, min_scales, max_scales)]
    return [build_view(view, image_size, key_min_scale, size=image_size)] + queries
