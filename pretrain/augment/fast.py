"""The fast CPU backend of the views (``data.backend: fast``): the same declared views, the same
random draws, run on uint8 with libjpeg-turbo, OpenCV and small numba kernels.

What a worker does per image: one decode (simplejpeg, libjpeg-turbo) for all its views, made when
its views are (the dataset draws from the JPEG header's size first: ``draw``, then ``render``);
per view the geometric draws of the torchvision ops (``RandomResizedCrop.make_params``'s torch
calls, the flips' ``torch.rand(1)``, then the view's uniforms), in the order ``ViewTransform.sample`` draws
them, so the parameters are those of the reference (``data.backend: torchvision``) for the same
``(seed, epoch, index)``; crop + resize on uint8; the colour stages on one float32 planar copy of
the 224-px view with the parameters ``ViewTransform.params`` decodes (the reference's formulas,
without rounding between ops); one rounding to uint8. Flips mirror the uint8 crop (they commute
with every colour op). Out of the worker go uint8 views (a quarter of the bytes of float32);
``pretrain.data.finish_views`` normalises them on the device.

Shortcuts, each measured in tests/pretrain/test_augment_fast.py and stated in docs/augmentation.md:

* resize: OpenCV's, on uint8 (fixed-point weights). Crops enlarged or shrunk by at most
  ``LINEAR_UP_TO`` (2×) are resized bilinearly (bicubic) without antialiasing, larger reductions
  with OpenCV's area filter; the reference antialiases with a triangle (cubic) filter. torchvision's
  own antialiased uint8 resize costs 1.5–9× OpenCV's bilinear (0.17–0.9 ms per 224-px view).
* blur: the reference's kernel (exp(−t²/2σ²), reflect padding) truncated to radius ⌈3σ⌉ (at most
  the declared kernel's radius) and renormalised: at σ = 2 a 13-tap kernel instead of 23; run by a
  numba kernel with the taps unrolled (OpenCV's sepFilter2D for radii above BLUR_MAX_RADIUS).
* one rounding to uint8 at the end, and solarize's threshold decided on float (as the reference).

Views whose geometric ops are not crop / flips (rotation, affine, perspective, equalize) run the
reference's geometry on the decoded image and then the fast colour stage.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import cv2
import numba
import numpy as np
import torch
from torchvision.transforms import v2

from pretrain.augment.jitter_cpu import BRIGHTNESS, CONTRAST, SATURATION
from pretrain.augment.pipeline import (
    ColorJitterStage,
    GaussianBlurStage,
    GrayscaleStage,
    SolarizeStage,
    ViewTransform,
)

__all__ = ["FastView", "FastCrops", "decode_rgb", "jpeg_size", "LINEAR_UP_TO", "blur", "blur_kernel"]

# DataLoader workers are processes, one core each: OpenCV's own thread pool would oversubscribe.
cv2.setNumThreads(1)

# Resize factor (crop side / output side) up to which OpenCV's bilinear (or bicubic) resize without
# antialiasing is used; above it OpenCV's area resize (a box filter: antialiased, not the
# reference's triangle). PSNR against the reference: docs/augmentation.md.
LINEAR_UP_TO = 2.0
# Up to this radius the blur's taps are unrolled by LLVM (one compiled kernel per radius) and the
# pixels vectorised: 1.8× OpenCV's float sepFilter2D (σ = 2: 92 vs 169 µs per 224-px view); beyond
# it (σ > 3 at 224 px) the loop stays rolled and OpenCV is faster.
BLUR_MAX_RADIUS = 9


_INTERPOLATION = {
    v2.InterpolationMode.BILINEAR: cv2.INTER_LINEAR,
    v2.InterpolationMode.BICUBIC: cv2.INTER_CUBIC,
    v2.InterpolationMode.NEAREST: cv2.INTER_NEAREST,  # torch's "nearest" (floor), never antialiased
}


def decode_rgb(data: bytes) -> np.ndarray | None:
    """H×W×3 uint8 RGB of a JPEG (simplejpeg: libjpeg-turbo, accurate DCT and upsampling, the
    same as Pillow's decoder), or None when ``data`` is not a JPEG (the caller uses Pillow).
    Raises ValueError on a corrupt or truncated JPEG (strict: libjpeg's warnings are errors)."""
    import simplejpeg

    from contrastive_transfer.images import MAX_IMAGE_PIXELS

    if not simplejpeg.is_jpeg(data):
        return None
    header = simplejpeg.decode_jpeg_header(data)
    if header[0] * header[1] > MAX_IMAGE_PIXELS:  # the one pixel limit, from the header (docs/security.md)
        raise ValueError(f"its header claims {header[1]}x{header[0]} pixels, above the limit of {MAX_IMAGE_PIXELS}")
    if header[2] not in ("Gray", "YCbCr", "RGB"):  # CMYK / YCCK: libjpeg-turbo cannot make RGB
        return None
    return simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from the header of a JPEG that ``decode_rgb`` would decode with
    libjpeg-turbo, or None for anything it would not (not a JPEG, unreadable header, above the
    pixel limit, CMYK): the caller decodes those at once, by ``decode_rgb``'s own paths."""
    import simplejpeg

    from contrastive_transfer.images import MAX_IMAGE_PIXELS

    if not simplejpeg.is_jpeg(data):
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if height * width > MAX_IMAGE_PIXELS or colorspace not in ("Gray", "YCbCr", "RGB"):
        return None
    return height, width


def blur_kernel(sigma: float, kernel_size: int) -> np.ndarray:
    """torchvision's Gaussian kernel for σ, truncated to radius ⌈3σ⌉ (≤ kernel_size // 2),
    renormalised; float32, as a column for cv2.sepFilter2D."""
    radius = min(kernel_size // 2, max(1, math.ceil(3 * sigma)))
    return _gaussian(radius, sigma).reshape(-1, 1)


def blur(x: np.ndarray, k: np.ndarray, scratch=None, out: np.ndarray | None = None) -> None:
    """x (3×H×W float32) blurred in place with the column kernel k (``blur_kernel``), reflect-101
    borders: numba's unrolled kernel up to BLUR_MAX_RADIUS, OpenCV's sepFilter2D beyond (or on
    images no wider than the radius). scratch(name, shape) gives a reusable float32 array. With
    ``out`` (3×H×W uint8) the blur is the view's last op: the result goes there, rounded once
    (one pass over the view fewer), and x is left undefined."""
    _, h, w = x.shape
    r = len(k) // 2
    if r <= BLUR_MAX_RADIUS and r < min(h, w):
        shape = (h, w + 2 * r)
        pad = scratch("blur", shape) if scratch is not None else np.empty(shape, dtype=np.float32)
        rounded = out is not None
        # the half kernel as float32 scalars: numba compiles one kernel per radius
        _blur(x, pad, tuple(k[r:, 0]), out if rounded else _NO_OUT, rounded)
        return
    for plane in x:
        cv2.sepFilter2D(plane, -1, k, k, dst=plane, borderType=cv2.BORDER_REFLECT_101)
    if out is not None:
        _to_uint8(x.reshape(3, -1), out.reshape(3, -1))


_NO_OUT = np.empty((1, 1, 1), dtype=np.uint8)


@numba.njit(cache=True, nogil=True)
def _gaussian(radius, sigma):  # numba: numpy's calls on a 13-element array cost 40 µs per view
    pdf = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    return (pdf / pdf.sum()).astype(np.float32)


# ------------------------------------------------------------------------------ numba kernels
# Why hand-written: the colour ops need per-image parameters and clamps between ops; OpenCV's
# cvtColor/transform round to uint8 after each op (hue to 1.4° steps), torch's ops are many
# passes with temporaries (pretrain/augment/jitter_cpu.py). These are one vectorisable pass per op
# over a planar float32 copy, the reference's formulas.


_F0, _F1, _F255 = np.float32(0.0), np.float32(1.0), np.float32(255.0)
_WR, _WG, _WB = np.float32(0.2989), np.float32(0.587), np.float32(0.114)  # ITU-R 601-2 luma


@numba.njit(cache=True, nogil=True)  # no fastmath: v / 255 exactly as torchvision's to_dtype divides
def _to_planar(src, x):
    """x[c, p] = src[3p + c] / 255: a contiguous H×W×3 uint8 view, flattened, → 3×(H·W) float32 in
    [0, 1]. One pass, de-interleaving as it converts (cv2.split then a conversion was 2.5× slower)."""
    for p in range(x.shape[1]):
        x[0, p] = np.float32(src[3 * p]) / _F255
        x[1, p] = np.float32(src[3 * p + 1]) / _F255
        x[2, p] = np.float32(src[3 * p + 2]) / _F255


@numba.njit(cache=True, nogil=True, fastmath=True)
def _clamp(v):
    return min(max(v, _F0), _F1)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _hue_channel(k, maxc, chroma):
    """M − C·clamp(2 − d, 0, 1), d = min(|k|, |k − 6|): channel n from k = H + n − 2 (jitter_cpu.py)."""
    d = min(abs(k), abs(k - np.float32(6.0)))
    return maxc - chroma * _clamp(np.float32(2.0) - d)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _hue_(x, shift6):
    """adjust_hue's closed form (jitter_cpu._hue) in float32, branch-free so that it vectorises.
    Every constant is float32: an integer literal (``2 * chroma``) made numba type the rest of the
    pixel's arithmetic float64, at half the vector width, 3× slower (81 → 25 µs per 224-px view)."""
    six, two, four = np.float32(6.0), np.float32(2.0), np.float32(4.0)
    for p in range(x.shape[1]):
        r, g, b = x[0, p], x[1, p], x[2, p]
        maxc = max(r, max(g, b))
        chroma = maxc - min(r, min(g, b))
        num = (g - b) if maxc == r else (((b - r) + two * chroma) if maxc == g else ((r - g) + four * chroma))
        h = num / (chroma if chroma > _F0 else _F1) + shift6
        h = h - six if h >= six else h
        h = h + six if h < _F0 else h
        x[0, p] = _hue_channel(h + np.float32(3.0), maxc, chroma)
        x[1, p] = _hue_channel(h + _F1, maxc, chroma)
        x[2, p] = _hue_channel(h - _F1, maxc, chroma)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _jitter_op(x, op, factor):
    """One ColorJitter op in place on x (3×N float32): the formulas of jitter_cpu.py, in float32."""
    n = x.shape[1]
    f = np.float32(factor)
    if op == BRIGHTNESS:
        for c in range(3):
            for p in range(n):
                x[c, p] = _clamp(f * x[c, p])
    elif op == CONTRAST:
        total = 0.0
        for p in range(n):
            total += _WR * x[0, p] + _WG * x[1, p] + _WB * x[2, p]
        offset = np.float32((1.0 - factor) * (total / n))
        for c in range(3):
            for p in range(n):
                x[c, p] = _clamp(f * x[c, p] + offset)
    elif op == SATURATION:
        for p in range(n):
            gray = (_F1 - f) * (_WR * x[0, p] + _WG * x[1, p] + _WB * x[2, p])
            x[0, p] = _clamp(f * x[0, p] + gray)
            x[1, p] = _clamp(f * x[1, p] + gray)
            x[2, p] = _clamp(f * x[2, p] + gray)
    else:
        _hue_(x, np.float32((6.0 * factor) % 6.0))


@numba.njit(cache=True, nogil=True, fastmath=True)
def _grayscale(x):
    for p in range(x.shape[1]):
        x[0, p] = x[1, p] = x[2, p] = _WR * x[0, p] + _WG * x[1, p] + _WB * x[2, p]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _solarize(x, threshold):
    for c in range(3):
        for p in range(x.shape[1]):
            if x[c, p] >= threshold:
                x[c, p] = _F1 - x[c, p]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _blur(x, pad, k, out, rounded):
    """x (3×H×W float32) blurred in place by the symmetric kernel whose half is the float32 tuple
    k = (k0, k1, …, kr), reflect-101 borders (r < H, W); pad: an H×(W+2r) float32 scratch.
    Vertical pass into pad's interior, its columns reflected, horizontal pass back into x, or
    (``rounded``) into out (3×H×W uint8) as _to_uint8 rounds, x left half done."""
    _, h, w = x.shape
    r = len(k) - 1
    for c in range(3):
        plane = x[c]
        for i in range(h):
            for j in range(w):
                acc = k[0] * plane[i, j]
                for t in range(1, r + 1):
                    a = i - t if i >= t else t - i
                    b = i + t if i + t < h else 2 * h - 2 - i - t
                    acc += k[t] * (plane[a, j] + plane[b, j])
                pad[i, r + j] = acc
        for i in range(h):
            for t in range(1, r + 1):
                pad[i, r - t] = pad[i, r + t]
                pad[i, r + w - 1 + t] = pad[i, r + w - 1 - t]
            if rounded:  # the view's last op: straight to uint8, as _to_uint8 would round it
                for j in range(w):
                    acc = k[0] * pad[i, r + j]
                    for t in range(1, r + 1):
                        acc += k[t] * (pad[i, r + j - t] + pad[i, r + j + t])
                    out[c, i, j] = np.uint8(_clamp(acc) * _F255 + np.float32(0.5))
            else:
                for j in range(w):
                    acc = k[0] * pad[i, r + j]
                    for t in range(1, r + 1):
                        acc += k[t] * (pad[i, r + j - t] + pad[i, r + j + t])
                    plane[i, j] = acc


@numba.njit(cache=True, nogil=True, fastmath=True)
def _to_uint8(x, out):
    """out (3×N uint8) = round(255·x)."""
    half = np.float32(0.5)
    for c in range(3):
        for p in range(x.shape[1]):
            out[c, p] = np.uint8(_clamp(x[c, p]) * _F255 + half)


@numba.njit(cache=True, nogil=True)
def _to_chw(src, out):
    """out[c, p] = src[3p + c]: a view without colour op, H×W×3 (flattened) → 3×(H·W) uint8."""
    for p in range(out.shape[1]):
        out[0, p] = src[3 * p]
        out[1, p] = src[3 * p + 1]
        out[2, p] = src[3 * p + 2]


# ------------------------------------------------------------------------------ one view


def batch_output(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 batch. In a DataLoader worker it is made in shared memory, as
    torch's default_collate does: a batch in private memory is copied into shared memory when it
    is sent to the main process (4.8 MB per 32 views at 224 px)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(math.prod(shape))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape)


class FastCrops(NamedTuple):
    """The fast backend's (uint8 crop, uniforms) left for the device (``data.colour_on_device``):
    a pair like the reference's, which on a CPU device the fast backend finishes with its own
    colour kernels (the views the workers would have made, bit for bit) rather than torch's."""

    crops: torch.Tensor
    uniforms: torch.Tensor


class FastView:
    """A ViewTransform run by the fast backend: ``sample`` draws what the reference draws and
    crops; ``colour`` runs the colour stages of one sample and writes its uint8 view."""

    def __init__(self, transform: ViewTransform):
        self.transform = transform
        self.crop: v2.RandomResizedCrop | None = None
        self._log_ratio: tuple[float, float] | None = None
        self._scratches: dict[tuple[str, int], np.ndarray] = {}  # per thread (numba's kernels release the GIL)
        self.flips: list[tuple[int, float]] = []  # (axis: 1 horizontal, 0 vertical, p as float32), in order
        self.fast_geometry = True
        for op in transform.geometric:
            if isinstance(op, v2.RandomResizedCrop) and self.crop is None and not self.flips:
                self.crop = op
            elif isinstance(op, (v2.RandomHorizontalFlip, v2.RandomVerticalFlip)):
                self.flips.append((1 if isinstance(op, v2.RandomHorizontalFlip) else 0, float(np.float32(op.p))))
            else:  # rotation, affine, ...; a flip before the crop: the reference's geometry
                self.fast_geometry = False
        for stage in transform.stages:
            if type(stage) not in (ColorJitterStage, GrayscaleStage, GaussianBlurStage, SolarizeStage):
                raise ValueError(f"fast backend: no kernel for {type(stage).__name__}")

    def sample(self, image: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """(H×W×3 uint8 crop, uniforms), from the global RNG like ViewTransform.sample. The flips
        mirror the uint8 crop: they commute with every colour op (pipeline.py)."""
        if not self.fast_geometry:
            crop, u = self.transform.sample(torch.from_numpy(image).permute(2, 0, 1))
            return np.ascontiguousarray(crop.permute(1, 2, 0).numpy()), u
        box, flip, u = self.draw(*image.shape[:2])
        return self.render(image, box, flip), u

    def draw(self, height: int, width: int) -> tuple[tuple[int, int, int, int] | None, int | None, torch.Tensor]:
        """What ``sample`` draws for an image of that size, without its pixels (fast geometry
        only): (crop box or None, cv2.flip code or None, uniforms), in the reference's order."""
        box = self._crop_box(height, width) if self.crop is not None else None
        flip = [False, False]  # vertical, horizontal
        for axis, p in self.flips:
            # RandomHorizontalFlip's test, flipped when not rand(1) >= p, is made in float32: the
            # same with p rounded to float32 (the tensor comparison cost 4 µs, this 1 µs).
            if torch.rand(1).item() < p:
                flip[axis] = not flip[axis]
        code = (-1 if flip[0] and flip[1] else int(flip[1])) if flip[0] or flip[1] else None  # 0 vertical
        return box, code, torch.rand(self.transform.n_uniforms)

    def render(self, image: np.ndarray, box: tuple[int, int, int, int] | None, flip: int | None) -> np.ndarray:
        """The uint8 crop of ``draw``'s box and flip."""
        out = image if box is None else self._resized_crop(image, *box)
        if flip is not None:  # cv2.flip: 5 µs; numpy's copy of a mirrored view is 50× slower
            out = cv2.flip(out, flip)
        return out

    def _crop_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, height, width): ``RandomResizedCrop.make_params`` with the same torch calls in
        the same order (so the same draws and the same float32 arithmetic), without its per-call
        size query and tensor indexing (13 µs → 7 µs per view). Tested against make_params."""
        if self._log_ratio is None:
            self._log_ratio = tuple(float(v) for v in self.crop._log_ratio)  # the float32 logs, as doubles
        (lo, hi), (log_lo, log_hi), area = self.crop.scale, self._log_ratio, height * width
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(lo, hi).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_lo, log_hi)).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        ratio = self.crop.ratio  # make_params' fallback: a central crop, no draw
        if width / height < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif width / height > max(ratio):
            w, h = int(round(height * max(ratio))), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def _resized_crop(self, image: np.ndarray, top: int, left: int, height: int, width: int) -> np.ndarray:
        size_h, size_w = self.crop.size
        crop = image[top : top + height, left : left + width]
        interpolation = _INTERPOLATION[v2.InterpolationMode(self.crop.interpolation)]
        if max(height / size_h, width / size_w) > LINEAR_UP_TO and interpolation != cv2.INTER_NEAREST:
            interpolation = cv2.INTER_AREA
        return cv2.resize(crop, (size_w, size_h), interpolation=interpolation)

    def colour(self, crop: np.ndarray, params: list[dict], i: int, out: np.ndarray) -> None:
        """Sample i's colour stages (``params``: the batch's ``numpy_params``, as lists) on
        ``crop``; the uint8 view into ``out`` (3×H×W)."""
        h, w, _ = crop.shape
        src = np.ascontiguousarray(crop).reshape(-1)
        applied = [(stage, p) for stage, p in zip(self.transform.stages, params) if p["apply"][i]]
        if not applied:  # float and back is exact for uint8 (v/255·255 + 0.5 truncates to v)
            _to_chw(src, out.reshape(3, h * w))
            return
        x = self._scratch("view", (3, h * w))
        _to_planar(src, x)
        for n, (stage, p) in enumerate(applied):
            if isinstance(stage, ColorJitterStage):
                for op in p["order"][i]:
                    if stage.enabled[op]:
                        _jitter_op(x, op, p["factors"][i][op])
            elif isinstance(stage, GrayscaleStage):
                _grayscale(x)
            elif isinstance(stage, GaussianBlurStage):
                last = n == len(applied) - 1
                k = blur_kernel(float(p["sigma"][i]), stage.kernel_size)
                blur(x.reshape(3, h, w), k, self._scratch, out if last else None)
                if last:
                    return
            else:
                _solarize(x, np.float32(stage.threshold))
        _to_uint8(x, out.reshape(3, h * w))

    def _scratch(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 working array, one per name and thread, kept: a fresh 600 KB array per 224-px
        view comes from mmap when the allocator has none free, and its first touch faults."""
        key = (name, threading.get_ident())
        x = self._scratches.get(key)
        if x is None or x.shape != shape:
            x = self._scratches[key] = np.empty(shape, dtype=np.float32)
        return x

    def __getstate__(self) -> dict:  # spawned workers: the scratch arrays stay behind
        return {**self.__dict__, "_scratches": {}}

    def numpy_params(self, u: torch.Tensor) -> list[dict]:
        """The batch's per-stage parameters (ViewTransform.params) as numpy; the jitter's four
        factors as one B×4 array (0 where a component is off)."""
        out = []
        for stage, params in zip(self.transform.stages, self.transform.params(u)):
            p = {k: v.numpy() for k, v in params.items()}
            if isinstance(stage, ColorJitterStage):
                names = [name for name, _, _ in stage.components]
                p["factors"] = np.stack(
                    [p[n] if on else np.zeros(len(u)) for n, on in zip(names, stage.enabled)], axis=1
                ).astype(np.float64)
            out.append(p)
        return out

    def list_params(self, u: torch.Tensor) -> list[dict]:
        """``numpy_params`` as Python lists, what ``colour`` takes: indexing them and passing their
        items to numba costs half what numpy scalars do."""
        return [{k: v.tolist() for k, v in p.items()} for p in self.numpy_params(u)]

    def finish_on_cpu(self, crops: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """B×3×H×W uint8 crops (CPU) and their uniforms → the uint8 views ``batch`` makes."""
        return self.batch([(c.permute(1, 2, 0).numpy(), ui) for c, ui in zip(crops, u)], colour=True)

    def batch(self, drawn: list[tuple], colour: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The views of a batch from its samples' draws (``sample``): B×3×H×W uint8 views
        (``colour``), or the uint8 crops with their uniforms for the device (``colour`` False)."""
        h, w, _ = drawn[0][0].shape
        u = torch.stack([d[1] for d in drawn])
        if not colour:
            hwc = torch.from_numpy(np.stack([d[0] for d in drawn]))
            return hwc.permute(0, 3, 1, 2).contiguous(), u
        out = batch_output((len(drawn), 3, h, w))
        params = self.list_params(u)
        for i, (crop, _) in enumerate(drawn):
            self.colour(crop, params, i, out[i].numpy())
        return out
