"""Distributed helpers: the one audited place for collectives in the pretraining code.

Every function is exact in a single process (``torch.distributed`` not initialized), where it
reduces to an identity or to a local equivalent, and works with gloo on CPU and NCCL on CUDA
(tensors must then live on this rank's GPU).

Shapes: N is the per-process batch, W the world size, B = N * W the global batch.
All gathers require the **same N on every rank** (``drop_last=True``): ``all_gather`` cannot
concatenate ragged batches, and the rank offsets below assume equal slices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Shared with detection and the evaluators: the one copy is in the base package.
from contrastive_transfer.ranks import all_reduce_with_grad, decided_by_rank0, rank, world_size

__all__ = [
    "world_size",
    "rank",
    "rank_offset",
    "gather_no_grad",
    "gather_with_grad",
    "all_reduce_with_grad",
    "shuffle_batch",
    "unshuffle_batch",
    "broadcast_",
    "all_ranks_equal",
    "decided_by_rank0",
]


def rank_offset(n_local: int) -> int:
    """Row of this rank's first local sample in a gathered (B, ...) tensor: ``rank * n_local``.

    The positive of local anchor i sits at column ``rank_offset(N) + i`` of the gathered
    candidates. Use the global rank, not the local GPU index (AdCo's multi-node bug).
    """
    return rank() * n_local


def _all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


@torch.no_grad()
def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """All-gather (N, ...) -> (W*N, ...) concatenated on dim 0, without autograd history.

    For MoCo keys, queue updates, permutations and metrics (like ``accelerator.gather``).
    In one process it returns ``x.detach()``: same values and storage, and, as in the
    multi-process case, no gradient path.
    """
    if world_size() == 1:
        return x.detach()
    return _all_gather_cat(x)


class _GatherWithGrad(torch.autograd.Function):
    """solo-learn's GatherLayer: all-gather forward, sum-all-reduce backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.n_local = x.shape[0]
        return _all_gather_cat(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # Clone: all_reduce is in place and autograd may still hold this buffer.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad.narrow(0, rank_offset(ctx.n_local), ctx.n_local)


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Differentiable all-gather (N, ...) -> (W*N, ...) concatenated on dim 0.

    Forward: the usual all-gather. Backward: the incoming (W*N, ...) gradient is
    **sum**-all-reduced and this rank's slice is returned.

    Why the sum: rank r computes a local loss L_r over its anchors, and L_r depends on the
    samples x_j of *every* rank j through the gathered candidates. The gradient that reaches
    x_j must therefore be sum_r dL_r/dx_j, and only the sum over ranks collects the terms that
    the other ranks computed. DDP then averages parameter gradients over ranks, which turns
    this into the gradient of mean_r L_r, i.e. exactly the single-process gradient of the loss
    over the global batch B. The sum looks like a W-fold overcount (vissl PR #230 asks), but
    it is what DDP's 1/W averaging expects. Returning only the local slice of the local
    gradient drops the cross-rank terms (lightly #1528, fixed by PR #1531); a collective that
    autograd does not see gives the right loss value and a gradient 1/W too small under DDP
    (lightly #1920). Test the gradient, not just the value.

    Identity in one process (gradient flows unchanged).
    """
    if world_size() == 1:
        return x
    return _GatherWithGrad.apply(x)


@torch.no_grad()
def shuffle_batch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MoCo's shuffle BN, input side: (N, ...) -> (shuffled (N, ...), idx_unshuffle (B,)).

    Multi-process: gather x from all ranks, draw a permutation of the B rows on rank 0 and
    broadcast it, and return this rank's slice of the permuted batch, so that the key
    encoder's per-GPU BN never sees a query's positive together with its own sub-batch.
    Single process: a random permutation of the local batch; only meaningful together with a
    SplitBatchNorm in the key encoder (otherwise BN statistics are permutation invariant).
    Requires equal N on all ranks. Pass the key-encoder output to :func:`unshuffle_batch`.
    """
    x_all = gather_no_grad(x)
    perm = torch.randperm(x_all.shape[0], device=x.device)
    # Each rank drew its own permutation; rank 0's must win so that the slices tile the batch.
    broadcast_(perm, src=0)
    idx_this = perm.view(world_size(), -1)[rank()]
    return x_all[idx_this], torch.argsort(perm)


@torch.no_grad()
def unshuffle_batch(y: torch.Tensor, idx_unshuffle: torch.Tensor) -> torch.Tensor:
    """MoCo's shuffle BN, output side: (N, ...) -> (N, ...) rows back in this rank's order.

    Gathers the encoder outputs of all ranks and takes this rank's slice of the inverse
    permutation returned by :func:`shuffle_batch`.
    """
    y_all = gather_no_grad(y)
    idx_this = idx_unshuffle.view(world_size(), -1)[rank()]
    return y_all[idx_this]


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast of ``t`` from rank ``src``; returns ``t``. No-op in one process."""
    if world_size() > 1:
        dist.broadcast(t, src=src)
    return t


@torch.no_grad()
def all_ranks_equal(t: torch.Tensor) -> bool:
    """True iff ``t`` is bitwise identical on all ranks (e.g. the MoCo queue). True in one process.

    Every rank compares its copy with rank 0's and the verdicts are combined with a MIN
    all-reduce, so all ranks return the same answer: an ``assert`` on it cannot leave some
    ranks waiting in the next collective. Costs one extra copy of ``t``, not W copies.
    """
    if world_size() == 1:
        return True
    ref = broadcast_(t.detach().clone(), src=0)
    ok = torch.tensor([int(torch.equal(ref, t))], device=t.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


class PendingFlags:
    """A MIN all-reduce of 0/1 flags started without waiting (``start_all_ranks_true``); ``wait()``
    returns the per-flag verdicts, the same on every rank. The flags stay on the device until then,
    so the step's backward runs while the reduction travels."""

    def __init__(self, flags: torch.Tensor) -> None:
        self.flags = flags.to(torch.int32)
        self.work = dist.all_reduce(self.flags, op=dist.ReduceOp.MIN, async_op=True) if world_size() > 1 else None

    def reduced(self) -> torch.Tensor:
        """The reduced flags, still on the device: on NCCL the wait orders the device's stream
        after the reduction without blocking the host (gloo's blocks until it is done)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.flags

    def wait(self) -> list[bool]:
        return [bool(v) for v in self.reduced().tolist()]  # a host read


def start_all_ranks_true(flags: torch.Tensor) -> PendingFlags:
    """Start the reduction of a (k,) bool tensor of per-rank flags."""
    return PendingFlags(flags)


def gather_objects(value) -> list:
    """Every rank's ``value`` (small picklable objects), in rank order, on every rank."""
    if world_size() == 1:
        return [value]
    out: list = [None] * world_size()
    dist.all_gather_object(out, value)
    return out
