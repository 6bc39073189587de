"""Two-stage view augmentation: per-sample geometry, then batched photometry with per-sample parameters.

torchvision's v2 ops take one parameter set per call, so a view's random colour ops run one
image at a time, and on small images the per-call overhead dominates (ColorJitter ≈ 3.7 ms per
64 px view). A :class:`ViewTransform` keeps a view's ops as torchvision v2 ops in the paper's order
and runs it in two stages:

1. ``sample(image)``, per sample: the geometric ops (RandomResizedCrop, RandomHorizontalFlip) by
   torchvision on uint8, and one vector of uniforms ``u`` that fixes every photometric draw.
   Both come from the global torch RNG, which the dataset seeds per ``(seed, epoch, index)``.
2. ``finish(crops, u)``, per batch: uint8 → float32 in [0, 1], the photometric ops in declared
   order with the per-sample parameters decoded from ``u`` (ColorJitter on CPU tensors by the
   fused kernel of ``pretrain/augment/jitter_cpu.py``, same arithmetic), then Normalize. Every op treats the
   samples independently (elementwise, per-image mean, depthwise convolution), so a sample's
   output does not depend on which other samples share its batch. Works on CPU and CUDA.

The photometric ops follow torchvision's float definitions: brightness ``x·b``; contrast
``c·x + (1−c)·mean(gray(x))``; saturation ``s·x + (1−s)·gray(x)``; hue: HSV hue shifted by ``h``
(mod 1); each clamped to [0, 1]; ColorJitter applies the four in a random order per sample;
grayscale is ITU-R 601-2 luma (0.2989 R + 0.587 G + 0.114 B) on 3 channels; Gaussian blur uses
torchvision's kernel ``softmax(−(t/σ)²)``, t = linspace(±(k−1)/(2√2)), i.e. exp(−i²/2σ²), reflect
padding, one σ per sample; solarize inverts ``x ≥ threshold``. They run on float rather than
on uint8, so intermediate results are not rounded to 1/255 steps.

Geometric ops run in stage 1 wherever they are listed. For the flip, listed after the colour
ops in MoCo's order, this changes nothing: it commutes with all of them (they are pointwise, use a
flip-invariant mean, or (blur) a symmetric kernel with symmetric padding).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

__all__ = [
    "adjust_brightness",
    "adjust_contrast",
    "adjust_saturation",
    "adjust_hue",
    "gaussian_blur",
    "ColorJitterStage",
    "GrayscaleStage",
    "GaussianBlurStage",
    "SolarizeStage",
    "ViewTransform",
]

# torchvision's adjust_* / gaussian_blur take one float parameter per call (their range checks
# reject a per-sample tensor), hence these batched versions; each takes x: B×3×H×W float in [0, 1]
# and one parameter per sample (shape (B,)). Grayscale and solarize have no per-sample parameter,
# so torchvision's own (batched) ops are used for them.


def _per_sample(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return p.to(x.dtype).reshape(-1, 1, 1, 1)


def _blend(x: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """ratio·x + (1 − ratio)·other, clamped to [0, 1] (torchvision's _blend, per-sample ratio)."""
    r = _per_sample(ratio, x)
    return (x * r).add_(other * (1 - r)).clamp_(0, 1)


def adjust_brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x·b clamped to [0, 1]."""
    return (x * _per_sample(factor, x)).clamp_(0, 1)


def adjust_contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """c·x + (1 − c)·m, m the mean luma of each image."""
    mean = TF.rgb_to_grayscale(x).mean(dim=(-3, -2, -1), keepdim=True)
    return _blend(x, mean, factor)


def adjust_saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """s·x + (1 − s)·gray(x)."""
    return _blend(x, TF.rgb_to_grayscale(x), factor)


def adjust_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Shift the HSV hue by ``shift`` (fraction of a turn, mod 1); value and saturation are kept.

    With M = max(r,g,b), C = M − min(r,g,b) and the hue as a position H ∈ [0, 6) on the colour
    hexagon ((g−b)/C if M = r, else (b−r)/C + 2 if M = g, else (r−g)/C + 4: torchvision's
    precedence), channel n ∈ {R: 5, G: 3, B: 1} of the result is M − C·clamp(2 − d, 0, 1), d the
    circular distance (period 6) between n + H + 6·shift and 2: HSV → RGB in closed form, without
    torchvision's torch.where and table look-ups (slow on CPU).
    """
    r, g, b = x.unbind(dim=-3)
    maxc = x.amax(dim=-3)
    chroma = x.amin(dim=-3).neg_().add_(maxc)
    max_r = maxc == r
    max_g = (maxc == g).logical_and_(max_r.logical_not())
    max_b = max_r.logical_or(max_g).logical_not_()
    h = (g - b).mul_(max_r)
    h.addcmul_((b - r).add_(chroma, alpha=2), max_g).addcmul_((r - g).add_(chroma, alpha=4), max_b)
    h.div_(chroma.masked_fill(chroma == 0, 1.0))  # gray pixels (C = 0) keep h = 0
    h.add_(_per_sample(shift, x).squeeze(-3), alpha=6).remainder_(6)  # shifted position, [0, 6)
    n_minus_2 = torch.tensor([3.0, 1.0, -1.0], dtype=x.dtype, device=x.device).reshape(3, 1, 1)
    k = h.unsqueeze(-3) + n_minus_2  # ∈ [−1, 9): one period suffices, d = min(|k|, |k − 6|)
    d = torch.minimum(k.sub(6).abs_(), k.abs_(), out=k)
    weight = d.neg_().add_(2).clamp_(0, 1)
    return torch.addcmul(maxc.unsqueeze(-3), chroma.unsqueeze(-3), weight, value=-1)


def gaussian_blur(x: torch.Tensor, kernel_size: int, sigma: torch.Tensor) -> torch.Tensor:
    """Blur with torchvision's kernel and reflect padding, one σ per sample.

    Separable: a horizontal then a vertical depthwise convolution, one group per (sample, channel).
    """
    b, c, h, w = x.shape
    lim = (kernel_size - 1) / (2.0 * math.sqrt(2.0))
    t = torch.linspace(-lim, lim, kernel_size, dtype=x.dtype, device=x.device)
    kernel = torch.softmax(-(t / sigma.to(x.dtype).reshape(-1, 1)).pow(2), dim=1)  # B×k, rows sum to 1
    weight = kernel.repeat_interleave(c, dim=0)  # (B·C)×k
    r = kernel_size // 2
    y = F.pad(x, [r, r, r, r], mode="reflect").reshape(1, b * c, h + 2 * r, w + 2 * r)
    y = F.conv2d(y, weight.reshape(b * c, 1, 1, kernel_size), groups=b * c)
    y = F.conv2d(y, weight.reshape(b * c, 1, kernel_size, 1), groups=b * c)
    return y.reshape(b, c, h, w)


def _where(mask: torch.Tensor, x: torch.Tensor, op, *params: torch.Tensor) -> torch.Tensor:
    """x with op applied (in place) to the samples where mask holds."""
    idx = mask.nonzero().squeeze(1)
    if idx.numel():
        x[idx] = op(x[idx], *(p[idx] for p in params))
    return x


# ------------------------------------------------------------------------------------ stages
# Each stage turns per-sample uniforms u (B × n_uniforms, in [0, 1)) into named per-sample
# parameters (params) and applies them to a batch (apply). Tests drive apply with given parameters.


class ColorJitterStage:
    """torchvision ColorJitter applied with probability p; its four ops in a random order per sample."""

    def __init__(self, jitter: v2.ColorJitter, p: float = 1.0):
        self.p = float(p)
        # (name, range, op) in torchvision's fn_idx order; a component set to 0 is None (skipped).
        self.components = [
            (name, getattr(jitter, name), op)
            for name, op in (
                ("brightness", adjust_brightness),
                ("contrast", adjust_contrast),
                ("saturation", adjust_saturation),
                ("hue", adjust_hue),
            )
        ]
        self.n_uniforms = 1 + 4 + 4  # applied?, four factors, four sort keys for the order
        self.enabled = tuple(bounds is not None for _, bounds, _ in self.components)

    def params(self, u: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"apply": u[:, 0] < self.p, "order": u[:, 5:9].argsort(dim=1)}  # a uniform permutation
        for j, (name, bounds, _) in enumerate(self.components):
            if bounds is not None:
                lo, hi = bounds
                out[name] = lo + (hi - lo) * u[:, 1 + j]
        return out

    def apply(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        if x.device.type == "cpu":  # one fused pass per op and image (pretrain/augment/jitter_cpu.py)
            from pretrain.augment.jitter_cpu import color_jitter_

            factors = torch.stack(
                [
                    params[name] if on else torch.zeros(len(x))
                    for (name, _, _), on in zip(self.components, self.enabled)
                ],
                dim=1,
            )
            return color_jitter_(x.contiguous(), params["apply"], params["order"], factors, self.enabled)
        return self.apply_per_op(x, params)

    def apply_per_op(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The torch path (CUDA): each op on the samples that take it at each of the four steps."""
        for step in range(4):
            for fn_id, (name, bounds, op) in enumerate(self.components):
                if bounds is not None:
                    x = _where(params["apply"] & (params["order"][:, step] == fn_id), x, op, params[name])
        return x


class GrayscaleStage:
    """RandomGrayscale: ITU-R 601-2 luma on three channels, with probability p."""

    def __init__(self, gray: v2.RandomGrayscale, p: float = 1.0):
        self.p, self.n_uniforms = float(p) * gray.p, 1

    def params(self, u: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"apply": u[:, 0] < self.p}

    def apply(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return _where(params["apply"], x, lambda y: TF.rgb_to_grayscale(y, num_output_channels=3))


class GaussianBlurStage:
    """GaussianBlur (square kernel, σ ~ U(sigma)) with probability p."""

    def __init__(self, blur: v2.GaussianBlur, p: float = 1.0):
        if blur.kernel_size[0] != blur.kernel_size[1]:
            raise ValueError(f"GaussianBlur: a square kernel is expected, got {list(blur.kernel_size)}")
        self.kernel_size, self.sigma, self.p = blur.kernel_size[0], tuple(blur.sigma), float(p)
        self.n_uniforms = 2

    def params(self, u: torch.Tensor) -> dict[str, torch.Tensor]:
        lo, hi = self.sigma
        return {"apply": u[:, 0] < self.p, "sigma": lo + (hi - lo) * u[:, 1]}

    def apply(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return _where(params["apply"], x, lambda y, s: gaussian_blur(y, self.kernel_size, s), params["sigma"])


class SolarizeStage:
    """RandomSolarize with probability p. The threshold is on the decoded image's uint8 scale
    (128 → x ≥ 128/255 becomes 1 − x), as in the uint8 pipelines the recipes come from."""

    def __init__(self, solarize: v2.RandomSolarize, p: float = 1.0):
        self.threshold, self.p, self.n_uniforms = solarize.threshold / 255, float(p) * solarize.p, 1

    def params(self, u: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"apply": u[:, 0] < self.p}

    def apply(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return _where(params["apply"], x, lambda y: TF.solarize(y, self.threshold))


# Which batched stage runs each torchvision op (RandomApply([op], p) is unwrapped into op, p).
PHOTOMETRIC_STAGES = {
    v2.ColorJitter: ColorJitterStage,
    v2.RandomGrayscale: GrayscaleStage,
    v2.GaussianBlur: GaussianBlurStage,
    v2.RandomSolarize: SolarizeStage,
}
# Per-sample ops on the uint8 image (stage 1). They run before the colour ops wherever they are
# listed: flips commute with every colour op; for the others this is the declared semantics.
GEOMETRIC = (
    v2.RandomResizedCrop,
    v2.RandomHorizontalFlip,
    v2.RandomVerticalFlip,
    v2.RandomRotation,
    v2.RandomAffine,
    v2.RandomPerspective,
    v2.RandomEqualize,
)


class ViewTransform:
    """One view's augmentation (torchvision v2 ops in the paper's order, then ToDtype and Normalize),
    run as per-sample geometry + batched photometry (module docstring).

    ``transforms`` lists the ops as declared. ``view(image)`` augments one image (PIL or CHW
    tensor) with the global RNG, like a v2 transform; ``finish(torch.stack(crops), torch.stack(us))``
    gives, for each sample, exactly what ``view`` would have given it.
    """

    def __init__(self, ops: Sequence[v2.Transform], mean: Sequence[float], std: Sequence[float]):
        self.to_float, self.normalize = v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))
        self.transforms = [*ops, self.to_float, self.normalize]
        self.geometric, self.stages, self.slices = [], [], []
        for op in ops:
            inner, p = op, 1.0
            if isinstance(op, v2.RandomApply):
                if len(op.transforms) != 1:
                    raise ValueError(f"ViewTransform: RandomApply must wrap one op, got {op.transforms}")
                inner, p = op.transforms[0], op.p
            if isinstance(op, GEOMETRIC) or isinstance(inner, GEOMETRIC):
                self.geometric.append(op)  # stage 1, whatever its place among the colour ops
            elif type(inner) in PHOTOMETRIC_STAGES:
                stage = PHOTOMETRIC_STAGES[type(inner)](inner, p)
                start = self.slices[-1].stop if self.slices else 0
                self.stages.append(stage)
                self.slices.append(slice(start, start + stage.n_uniforms))
            else:
                raise ValueError(
                    f"ViewTransform: unsupported op {op!r}; expected one of "
                    f"{', '.join(t.__name__ for t in (*GEOMETRIC, *PHOTOMETRIC_STAGES))}"
                    f" (optionally in RandomApply)"
                )
        self.n_uniforms = self.slices[-1].stop if self.slices else 0

    def sample(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample, from the global RNG: (uint8 C×H×W crop, uniforms fixing the photometric draws)."""
        x = image if isinstance(image, torch.Tensor) else TF.to_image(image)
        for op in self.geometric:
            x = op(x)
        return x.as_subclass(torch.Tensor), torch.rand(self.n_uniforms)

    def params(self, u: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Per stage, the per-sample parameters encoded in uniforms u (B × n_uniforms)."""
        return [stage.params(u[:, s]) for stage, s in zip(self.stages, self.slices)]

    def finish(self, crops: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """B×C×H×W uint8 crops and B × n_uniforms uniforms → normalized float32 views (batched)."""
        x = self.to_float(crops)
        if x is crops:  # already float32: the stages write in place
            x = x.clone()
        for stage, params in zip(self.stages, self.params(u.to(x.device))):
            x = stage.apply(x, params)
        return TF.normalize(x, self.normalize.mean, self.normalize.std, inplace=True)  # x is ours

    def __call__(self, image: Any) -> torch.Tensor:
        crop, u = self.sample(image)
        return self.finish(crop[None], u[None])[0]

    def __repr__(self) -> str:
        return "ViewTransform(\n" + "".join(f"    {op}\n" for op in self.transforms) + ")"
