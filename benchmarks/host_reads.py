"""Reads of tensor values on the host per training step, counted in the real loop on the CPU.

On a GPU each such read makes the host wait until the device has computed the value, and the device
then idles while the host launches the next kernels. The loop (``pretrain.engine``) reads the device
only at the steps that log a metrics row or write a checkpoint (they need the values anyway); this
counts the reads of every other step, for the tiny recipe of every registered method, with a
``TorchFunctionMode`` that sees each call handing a tensor's value to Python.

    python -m benchmarks.pretraining --host-reads [--recipes tiny_mocov2,...]

``.to(device)`` is not counted: on the CPU the device is the host, so a move to the training
device cannot be told from a read there; on a GPU, ``torch.cuda.set_sync_debug_mode`` catches it.
"""

from __future__ import annotations

import tempfile
import traceback
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

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


@dataclass
class StepReads:
    """Per step (1-based): whether it logged a row, and the reads inside it and in moving its batch."""

    recipe: str
    method: str
    steps: list[tuple[int, bool, int, str | None]] = field(default_factory=list)

    @property
    def quiet_steps(self) -> list[tuple[int, bool, int, str | None]]:
        return [s for s in self.steps if not s[1]]

    @property
    def reads_per_quiet_step(self) -> float:
        quiet = self.quiet_steps
        return sum(s[2] for s in quiet) / max(len(quiet), 1)


def count_reads(recipe: Path, overrides: list[str], steps: int = 6, log_every: int = 3) -> StepReads:
    """Train ``steps`` steps of ``recipe`` on the CPU (a row every ``log_every``), counting the host
    reads of each step and of the batch's move to the device before it."""
    from accelerate import Accelerator

    from pretrain import engine
    from pretrain.config import load_config

    counter = HostReads()
    step_fn, to_device_fn = engine.train_one_step, engine.to_device

    def to_device(run, batch):
        with counter:
            return to_device_fn(run, batch)

    def train_one_step(run, step, images, labels):
        with counter:
            row = step_fn(run, step, images, labels)
        result.steps.append((step + 1, row is not None, *counter.take()))
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
                "train.cpu=true",
                "knn.train_dir=null",
            ],
        )
        result = StepReads(recipe.stem, cfg.method.name)
        stack.enter_context(mock.patch.object(engine, "train_one_step", train_one_step))
        stack.enter_context(mock.patch.object(engine, "to_device", to_device))
        engine.train(cfg, Accelerator(cpu=True))
    return result


def report(results: list[StepReads]) -> str:
    lines = [
        "| recipe | method | reads per step without a row | steps without / with a row | first read |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        quiet = r.quiet_steps
        first = next((s[3] for s in quiet if s[3]), "")
        lines.append(
            f"| {r.recipe} | {r.method} | {r.reads_per_quiet_step:g} | {len(quiet)} / {len(r.steps) - len(quiet)} "
            f"| {first} |"
        )
    return "\n".join(lines) + "\n"
