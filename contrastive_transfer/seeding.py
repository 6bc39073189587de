"""Per-sample random draws that depend on ``(seed, epoch, index)`` alone: pretraining's views and the
linear probe's training augmentation, so that neither depends on the number of processes or
DataLoader workers, the batch a sample is fetched in, or where a run was resumed."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch


def stable_seed(*parts) -> int:
    """A stable 64-bit seed from a tuple (Python's hash() of str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def seeded_draws(seed: int, epoch: int, index: int, draw: Callable, *args) -> Any:
    """``draw(*args)`` with torch's global CPU generator seeded by ``(seed, epoch, index)``, the
    generator's state put back afterwards: how every backend seeds a sample's draws, so that its
    views depend on ``(seed, epoch, index)`` alone (pretrain/data.py), whatever the worker or batch.

    Why the global generator: the draws are torchvision's own (``RandomResizedCrop.make_params``,
    the flips' ``torch.rand(1)``), which take no generator; the fast and device backends make the
    same calls in the same order. Why put back: the caller's stream (the training loop's, with
    ``data.num_workers: 0``) is left as it was. Why the CPU generator alone and by hand:
    ``torch.manual_seed`` would also seed every accelerator (≈0.6 ms a sample), and
    ``torch.random.fork_rng(devices=[])``, the same save and restore, cost as much as a view's draws."""
    generator = torch.default_generator
    state = generator.get_state()
    try:
        generator.manual_seed(stable_seed("augment", seed, epoch, int(index)))
        return draw(*args)
    finally:
        generator.set_state(state)
