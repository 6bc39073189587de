"""ColorJitter on a CPU batch, fused per image (numba): what ``ColorJitterStage`` runs on CPU.

Why hand-written: torchvision's ops take one parameter set per call, and our batched torch
versions (``pretrain.augment.pipeline.adjust_*``) run each op as 5–45 elementwise passes over the whole
batch with temporaries. At 224 px that cost 4 ms per view for MoCo v1's always-on jitter (hue
alone 2.8 ms), slower than PIL's uint8 C loops in the plain pipeline. No library fuses a
per-sample colour jitter on CPU (kornia runs the same eager passes; DALI is GPU-only), so this
kernel does the same arithmetic per pixel, one image at a time, in a single pass per op:

* brightness ``clamp(b·x)``; contrast ``clamp(c·x + (1−c)·mean(gray(x)))``; saturation
  ``clamp(s·x + (1−s)·gray(x))``, gray the ITU-R 601-2 luma 0.2989 R + 0.587 G + 0.114 B;
* hue: the closed form of ``pretrain.augment.pipeline.adjust_hue`` (HSV hue position shifted by 6·h,
  value and saturation kept).

Arithmetic is in float64 per pixel, stored as float32, so results match torchvision's float32 ops
to a few ulps (tests: against torchvision per sample and against the torch path). Each image is
independent of the rest of its batch. The torch path stays for CUDA tensors.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["color_jitter_"]

BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)  # torchvision's fn_idx order


@numba.njit(cache=True, nogil=True)
def _clamp01(v):
    return min(max(v, 0.0), 1.0)


@numba.njit(cache=True, nogil=True)
def _gray(r, g, b):
    return 0.2989 * r + 0.587 * g + 0.114 * b


@numba.njit(cache=True, nogil=True)
def _hue(r, g, b, shift6):
    """(r, g, b) with its HSV hue position H ∈ [0, 6) moved by shift6 ∈ [0, 6): the closed form of
    adjust_hue. The wrap into [0, 6) is two compares instead of a float modulo (40 % of the
    hue's time when it was one)."""
    maxc, minc = max(r, max(g, b)), min(r, min(g, b))
    chroma = maxc - minc  # 0 for gray pixels: H = 0 and every channel comes out as maxc
    num = g - b if maxc == r else ((b - r) + 2.0 * chroma if maxc == g else (r - g) + 4.0 * chroma)
    h = num / (chroma if chroma > 0.0 else 1.0) + shift6  # ∈ [−1, 11)
    h = h - 6.0 if h >= 6.0 else h
    h = h + 6.0 if h < 0.0 else h  # the remainder mod 6, in [0, 6)
    return _channel(h + 3.0, maxc, chroma), _channel(h + 1.0, maxc, chroma), _channel(h - 1.0, maxc, chroma)


@numba.njit(cache=True, nogil=True)
def _channel(k, maxc, chroma):
    """Channel n of the result from k = H + n − 2 (n = 5 R, 3 G, 1 B): M − C·clamp(2 − d, 0, 1),
    d = min(|k|, |k − 6|) the circular distance to 0."""
    d = min(abs(k), abs(k - 6.0))
    return maxc - chroma * min(max(2.0 - d, 0.0), 1.0)


@numba.njit(cache=True, nogil=True)
def _jitter(x, apply, order, factors, enabled):
    """In place on x (B × 3 × N float32): per image i with apply[i], the ops order[i] (fn ids),
    op j with factor factors[i, j], skipping ops whose enabled[j] is False."""
    for i in range(x.shape[0]):
        if not apply[i]:
            continue
        img = x[i]
        n = img.shape[1]
        for step in range(4):
            op = order[i, step]
            if not enabled[op]:
                continue
            f = float(factors[i, op])
            if op == BRIGHTNESS:
                for p in range(n):
                    for c in range(3):
                        img[c, p] = _clamp01(f * img[c, p])
            elif op == CONTRAST:
                total = 0.0
                for p in range(n):
                    total += _gray(img[0, p], img[1, p], img[2, p])
                offset = (1.0 - f) * (total / n)
                for p in range(n):
                    for c in range(3):
                        img[c, p] = _clamp01(f * img[c, p] + offset)
            elif op == SATURATION:
                for p in range(n):
                    gray = (1.0 - f) * _gray(img[0, p], img[1, p], img[2, p])
                    for c in range(3):
                        img[c, p] = _clamp01(f * img[c, p] + gray)
            else:
                shift6 = (6.0 * f) % 6.0
                for p in range(n):
                    r, g, b = _hue(float(img[0, p]), float(img[1, p]), float(img[2, p]), shift6)
                    img[0, p], img[1, p], img[2, p] = r, g, b


def color_jitter_(
    x: torch.Tensor,
    apply: torch.Tensor,
    order: torch.Tensor,
    factors: torch.Tensor,
    enabled: tuple[bool, bool, bool, bool],
) -> torch.Tensor:
    """Jitter x (B×3×H×W float32, CPU) in place and return it.

    apply: (B,) bool; order: B×4 fn ids (brightness 0, contrast 1, saturation 2, hue 3);
    factors: B×4, column j the factor of op j; enabled[j] False skips op j (jitter range 0).
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 4 or x.shape[1] != 3 or not x.is_contiguous():
        raise ValueError(
            f"color_jitter_: expected a contiguous CPU float32 B×3×H×W tensor (updated in "
            f"place), got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    _jitter(
        x.view(x.shape[0], 3, -1).numpy(),
        apply.numpy().astype(np.bool_),
        order.numpy().astype(np.int64),
        factors.numpy().astype(np.float32),
        np.array(enabled, dtype=np.bool_),
    )
    return x
