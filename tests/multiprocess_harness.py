"""The one spawn harness of the tests that run several gloo processes on CPU.

A test module lists its checks as module-level functions ``check(rank, out_dir)`` (picklable by
name, so that the spawned workers can import them), starts them all in **one** ``mp.spawn`` (the
torch import of each worker costs seconds), and asserts per check on the collected tracebacks.
A check runs all of its collectives before it asserts, so that a failing rank cannot leave the
other one waiting in a collective; a missed collective still ends at the group timeout. A check
that needs to compare with a 1-process reference saves its results from rank 0 into ``out_dir``,
and the test computes the reference in the pytest process, where torch.distributed is not
initialized.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

WORLD = 2
Check = Callable[[int, str], None]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, checks: dict[str, Check], timeout_s: float) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    results: dict[str, str | None] = {}
    try:
        for name, check in checks.items():
            try:
                check(rank, out_dir)
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        torch_dist.destroy_process_group()


class Workers:
    """``world`` gloo processes running ``checks`` in order; started at construction, not joined."""

    def __init__(self, checks: dict[str, Check], out_dir: Path, world: int = WORLD, timeout_s: float = 60) -> None:
        self.out_dir, self.world = Path(out_dir), world
        self.context = mp.spawn(
            _worker, args=(world, free_port(), str(out_dir), checks, timeout_s), nprocs=world, join=False
        )

    def results(self, deadline_s: float = 600) -> list[dict[str, str | None]]:
        """Wait for the workers; per rank, check name -> traceback (None = passed)."""
        end = time.monotonic() + deadline_s
        while not self.context.join(timeout=max(1.0, end - time.monotonic())):  # raises if a worker died
            if time.monotonic() > end:
                self.terminate()
                raise TimeoutError(f"the {self.world} workers did not finish within {deadline_s} s")
        return [json.loads((self.out_dir / f"rank{r}.json").read_text()) for r in range(self.world)]

    def terminate(self) -> None:
        for p in self.context.processes:
            if p.is_alive():
                p.terminate()
            p.join()


def assert_check_passed(results: list[dict[str, str | None]], check: str) -> None:
    errors = [f"rank {r}:\n{res[check]}" for r, res in enumerate(results) if res[check]]
    assert not errors, "\n".join(errors)


# ---------------------------------------------------------------- helpers for the checks


def ddp_average(*tensors: torch.Tensor) -> None:
    """What DDP does to gradients, in place: sum over ranks, divided by the world size."""
    for t in tensors:
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
        t /= torch_dist.get_world_size()


class NaiveGather(torch.autograd.Function):
    """The gather of lightly before PR #1531: forward all-gathers, backward keeps only the local
    slice of the local gradient (the cross-rank terms are lost). Controls use it in place of
    ``pretrain.dist.gather_with_grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.n = x.shape[0]
        parts = [torch.empty_like(x) for _ in range(torch_dist.get_world_size())]
        torch_dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.narrow(0, torch_dist.get_rank() * ctx.n, ctx.n).clone()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a − ref| / max |ref|: a relative error that near-zero entries cannot blow up."""
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()
