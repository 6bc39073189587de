"""What global rank 0 decides, on every process: the one place for decisions that pretraining
(``pretrain/dist.py``) and detection (``transfer/detection/run.py``) must share across processes."""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

__all__ = ["decided_by_rank0"]

T = TypeVar("T")


def decided_by_rank0(value: T) -> T:
    """Global rank 0's ``value`` (any picklable object) on every process; ``value`` itself in one
    process (``torch.distributed`` not initialized, or a world of one).

    Why rank 0's: machines with their own disks can see different files (a seed finished on
    machine 0 only, an index saved beside the run), and every decision that starts or skips
    collective work must be the same everywhere, or the processes that went ahead wait forever."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
