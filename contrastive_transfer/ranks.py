"""The distributed pieces every tower shares: the process group a launcher asked for, this
process's rank, what global rank 0 decides, and the gather of per-process shards back into dataset
order. Pretraining (``pretrain/dist.py``), detection (``transfer/detection/run.py``) and the
frozen-feature evaluators (``transfer/features.py``, ``transfer/linear_probe.py``) use these, so the
rules below hold once for all of them.

Every function is exact in one process (``torch.distributed`` not initialized, or a world of one),
where it reduces to the identity or a local equivalent; with several it works on gloo (CPU) and
NCCL (CUDA; tensors on this rank's GPU)."""

from __future__ import annotations

import os
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from contrastive_transfer.cli import UserError

__all__ = [
    "initialized",
    "world_size",
    "rank",
    "is_main",
    "local_device",
    "check_launch",
    "init_from_launcher",
    "all_reduce_with_grad",
    "decided_by_rank0",
    "done_by_rank0",
    "gather_in_order",
    "shard_indices",
    "summed",
]

T = TypeVar("T")


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Number of processes in the default group; 1 when not initialized."""
    return dist.get_world_size() if initialized() else 1


def rank() -> int:
    """Global rank of this process; 0 when not initialized."""
    return dist.get_rank() if initialized() else 0


def is_main() -> bool:
    """Global rank 0: the one process that writes a run's files and holds its output lock."""
    return rank() == 0


def local_device() -> torch.device:
    """This process's GPU (``LOCAL_RANK`` of the launcher) when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_launch(module: str) -> None:
    """Stop a launch that asked for several processes but runs one.

    ``accelerate launch --cpu --num_processes N`` (and ``--num_machines M`` with ``--cpu``) goes
    through Accelerate's single-process launcher, which ignores the count: it sets the rendezvous
    address for the N processes but starts one, without WORLD_SIZE. The job would silently run on
    one process (pretraining with N times the per-process batch, an evaluator N times slower)."""
    cpu_launcher = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1")
    if cpu_launcher and "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ:
        raise UserError(
            "`accelerate launch --cpu --num_processes N` starts ONE process (Accelerate's CPU launcher "
            f"ignores the count); for N CPU processes use `torchrun --nproc_per_node N -m {module} ...` "
            f"or `accelerate launch --multi_gpu --num_processes N -m {module} ...` (gloo without GPUs)"
        )


def init_from_launcher(module: str) -> bool:
    """Join the process group that ``torchrun`` / ``accelerate launch`` / ``srun torchrun`` set up
    in the environment (WORLD_SIZE > 1): NCCL on GPUs, gloo on CPUs. True when this call created it
    (the caller then destroys it at the end); False in one process or when a group already exists.
    ``module`` (``transfer.knn``) names the command in the line of ``check_launch``."""
    check_launch(module)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or initialized():
        return False
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True


class _AllReduceWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


def all_reduce_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Differentiable sum over ranks: every rank's output depends on every rank's x, so the
    backward sums the incoming gradients too (the reasoning of ``pretrain.dist.gather_with_grad``).
    Used for synchronized BN statistics. Identity in one process."""
    if world_size() == 1:
        return x
    return _AllReduceWithGrad.apply(x)


def decided_by_rank0(value: T) -> T:
    """Global rank 0's ``value`` (any picklable object) on every process; ``value`` itself in one
    process (``torch.distributed`` not initialized, or a world of one).

    Why rank 0's: machines with their own disks can see different files (a seed finished on
    machine 0 only, an index saved beside the run), and every decision that starts or skips
    collective work must be the same everywhere, or the processes that went ahead wait forever."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def done_by_rank0(work: Callable[[], T]) -> T:
    """``work()`` run on global rank 0 only, its result on every process; a ``UserError`` it raises
    is raised on every process, so that the others stop too instead of waiting in their next
    collective for a rank 0 that left (a held output lock, a state file from another run)."""
    outcome: tuple[str, object] = ("", None)
    if is_main():
        try:
            outcome = ("ok", work())
        except UserError as e:
            outcome = ("error", str(e))
    kind, value = decided_by_rank0(outcome)
    if kind == "error":
        raise UserError(value)
    return value  # type: ignore[return-value]


def summed(values: list[float], device: torch.device) -> list[float]:
    """``values`` summed over all processes (float64, through ``device``: this rank's GPU under
    NCCL), the same list on every rank; ``values`` itself in one process."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def shard_indices(n: int, unit: int = 1) -> list[int]:
    """This rank's share of ``range(n)`` cut into units of ``unit`` items (the last may be short):
    units r, r+W, r+2W, ... Pass the batch size as the unit and every item meets the same batch
    mates as in one process, so a network that computes a batch's rows with batch-dependent
    kernels still gives the same bits. :func:`gather_in_order` puts the shards back in order."""
    starts = range(rank() * unit, n, world_size() * unit)
    return [i for start in starts for i in range(start, min(start + unit, n))]


@torch.no_grad()
def gather_in_order(local: torch.Tensor, n: int, unit: int = 1, block_rows: int = 1 << 15) -> torch.Tensor:
    """Every rank's rows of :func:`shard_indices` ``(n, unit)`` gathered back into the order
    0..n-1, on every rank and on ``local``'s device.

    all_gather needs equal shapes: every shard is padded to the longest one's whole units, and the
    padding, which the interleave puts after the last real row, is cut off. The rows travel in
    blocks of about ``block_rows`` per rank (through this rank's GPU under NCCL), so that a bank of
    a million features kept on the CPU never needs a second copy on the GPU."""
    world = world_size()
    if world == 1 or n == 0:
        return local
    longest = -(-n // (world * unit)) * unit  # whole units: the shard of rank 0 rounded up
    padded = torch.cat([local, local.new_zeros((longest - local.shape[0], *local.shape[1:]))])
    via = local_device() if dist.get_backend() == "nccl" else local.device
    out = []
    for block in padded.split(max(1, block_rows // unit) * unit):
        block = block.to(via).contiguous()
        parts = [torch.empty_like(block) for _ in range(world)]
        dist.all_gather(parts, block)
        # parts[r] holds units u·W + r: stacked on a rank axis after the unit axis, back in order.
        units = torch.stack([p.view(-1, unit, *p.shape[1:]) for p in parts], dim=1)
        out.append(units.flatten(0, 2).to(local.device))
    return torch.cat(out)[:n]
