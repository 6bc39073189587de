"""Exact fp32 for similarities and logits, whatever the run's precision settings.

With temperatures of 0.07-0.2 and 65536-column queues, fp16/bf16 logits lose the positive's margin
in rounding, so every loss computes its similarities and logits in (at least) fp32 with autocast
disabled. float64 inputs stay float64 (the tests compare against float64 references).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["fp32", "no_autocast"]


def fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or in its own dtype when that is wider (float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@contextlib.contextmanager
def no_autocast(x: torch.Tensor) -> Iterator[None]:
    """Autocast and TF32 off on ``x``'s device for the block, restored after.

    Explicit casts are not enough: CUDA autocast would run a matmul on fp32 inputs in fp16, and
    with TF32 allowed (a common global setting for speed) an fp32 matmul keeps only 10 mantissa
    bits, which moves logits at τ = 0.07 by more than EqCo's margins."""
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        with torch.autocast(device_type=x.device.type, enabled=False):
            yield
    finally:
        matmul.allow_tf32 = allowed
