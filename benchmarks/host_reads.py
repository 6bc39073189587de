"""Reads of tensor values on the host per training step, counted in the real loop on the CPU.

On a GPU each such read makes the host wait until the device has computed the value, and the device
then idles while the host launches the next kernels. The loop (``pretrain.engine``) reads the device
only at the steps that log a metrics row or write a checkpoint (they need the values anyway); this
counts the reads of every other step, for the tiny recipe of every registered method, with a
``TorchFunctionMode`` that sees each call handing a tensor's value to Python.

    python -m benchmarks.pretraining --host-reads [--recipes tiny_mocov2,...]

``.to(device)`` is not counted: on the CPU the device is the host, so a move to the training
device cannot be told from a read there. On CUDA (``--device cuda``) every synchronizing call that
``torch.cuda.set_sync_debug_mode`` reports is counted too.
"""

from __future__ import annotations

import tempfile
import traceback
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

# Every Tensor method or torch function that returns a tensor's value to Python (or a host copy).
READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__complex__",
        "__array__",
        "__repr__",
        "__format__",
        "equal",
        "allclose",
        "is_nonzero",
    }
)


class HostReads(TorchFunctionMode):
    """Counts host reads while active; ``take()`` returns the count since the last take, and where
    the first of them happened (a traceback line), then starts again."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.first = 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.count += 1
            if self.first is None:
                self.first = f"{func.__name__} at {_caller()}"
        return func(*args, **(kwargs or {}))

    def take(self) -> tuple[int, str | None]:
        taken = self.count, self.first
        self.count, self.first = 0, None
        return taken


def _caller() -> str:
    """The innermost frame of the project's code (not torch's, not this file's)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "site-packages" not in frame.filename and frame.filename != __file__:
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "?"


@dataclass(frozen=True)
class Step:
    step: int  # 1-based
    row: bool  # it logged a metrics row
    reads: int  # host reads inside it and in moving its batch to the device
    first: str | None  # where the first of them happened
    syncs: int  # CUDA: synchronizations torch.cuda's sync debug mode reported (0 on the CPU)


@dataclass
class StepReads:
    recipe: str
    method: str
    steps: list[Step] = field(default_factory=list)

    @property
    def quiet_steps(self) -> list[Step]:
        return [s for s in self.steps if not s.row]

    @property
    def reads_per_quiet_step(self) -> float:
        return sum(s.reads + s.syncs for s in self.quiet_steps) / max(len(self.quiet_steps), 1)


@contextmanager
def cuda_syncs(on: bool):
    """The list of torch's warnings for synchronizing CUDA calls made inside (empty on the CPU)."""
    if not on:
        yield []
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def count_reads(
    recipe: Path, overrides: list[str], steps: int = 6, log_every: int = 3, cuda: bool = False
) -> StepReads:
    """Train ``steps`` steps of ``recipe`` (a row every ``log_every``) on the CPU, or on CUDA where
    the synchronizations are counted too, counting the host reads of each step and of the batch's
    move to the device before it."""
    from accelerate import Accelerator

    from pretrain import engine
    from pretrain.config import load_config

    counter = HostReads()
    step_fn, to_device_fn = engine.train_one_step, engine.to_device

    def to_device(run, batch):
        with counter:
            return to_device_fn(run, batch)

    def train_one_step(run, step, images, labels):
        with counter, cuda_syncs(cuda) as syncs:
            row = step_fn(run, step, images, labels)
        reads, first = counter.take()
        result.steps.append(
            Step(step + 1, row is not None, reads, first, sum("synchroniz" in str(w.message) for w in syncs))
        )
        return row

    with tempfile.TemporaryDirectory() as out, ExitStack() as stack:
        cfg = load_config(
            recipe,
            [
                *overrides,
                f"train.output_dir={out}",
                f"train.max_steps={steps}",
                f"train.log_every={log_every}",
                f"train.diagnostics_every={steps + 1}",
                f"train.checkpoint_every={steps + 1}",
                "train.resume=none",
                f"train.cpu={str(not cuda).lower()}",
                "knn.train_dir=null",
            ],
        )
        result = StepReads(recipe.stem, cfg.method.name)
        stack.enter_context(mock.patch.object(engine, "train_one_step", train_one_step))
        stack.enter_context(mock.patch.object(engine, "to_device", to_device))
        engine.train(cfg, Accelerator(cpu=not cuda))
    return result


def report(results: list[StepReads]) -> str:
    lines = [
        "| recipe | method | reads per step without a row | of which CUDA syncs | steps without / with a row "
        "| first read |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        quiet = r.quiet_steps
        first = next((s.first for s in quiet if s.first), "")
        syncs = sum(s.syncs for s in quiet) / max(len(quiet), 1)
        lines.append(
            f"| {r.recipe} | {r.method} | {r.reads_per_quiet_step:g} | {syncs:g} | {len(quiet)} / "
            f"{len(r.steps) - len(quiet)} | {first} |"
        )
    return "\n".join(lines) + "\n"
