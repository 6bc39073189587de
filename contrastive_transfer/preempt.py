"""Preemption: a signal asks a training loop to stop at its next step boundary, after saving.

A cluster preempts a job (or reaches its time limit) by sending SIGTERM, or SIGUSR1 some time
before (SLURM's ``--signal=USR1@120``), then kills it after a grace period. A Python handler runs
in the main thread between bytecodes, possibly in the middle of a step, so it only records the
signal; the loop finishes the step, writes its checkpoint, and exits with ``PREEMPTED_EXIT_CODE``.
"""

from __future__ import annotations

import signal
import threading
from typing import Iterable, Sequence

from contrastive_transfer.cli import UserError

# EX_TEMPFAIL of sysexits.h, "temporary failure, the user is invited to retry": not 0 (the run is
# not done), not 1 (the failures that need a person), not 128+N (killed by signal N).
PREEMPTED_EXIT_CODE = 75
UNCATCHABLE = ("SIGKILL", "SIGSTOP")
DEFAULT_SIGNALS: Sequence[str] = ("SIGTERM", "SIGUSR1")  # a cluster's preemption, time limit, early warning


class Preempted(BaseException):
    """Raised by a training loop once it saved at the step reached after a preemption signal.

    A BaseException, like KeyboardInterrupt: a stop that was asked for, not a failure, so the
    loops' ``except Exception`` (detectron2's logs a traceback there) leave it alone."""


def signal_numbers(names: Iterable[str], key: str) -> list[signal.Signals]:
    """``["SIGTERM", "USR1"]`` -> the signals; one line naming ``key`` for a name that is none."""
    found = []
    for name in names:
        full = str(name).upper()
        full = full if full.startswith("SIG") else f"SIG{full}"
        if full in UNCATCHABLE or not hasattr(signal.Signals, full):
            raise UserError(
                f"{key}: {name!r} is not a signal a process can handle; expected names such as "
                "SIGTERM, SIGUSR1, SIGINT (or [] for none)"
            )
        found.append(signal.Signals[full])
    return found


class PreemptSignals:
    """While entered, the listed signals set ``received`` (the first one's name) instead of ending
    the process; the previous handlers come back on exit. Handlers can only be installed from the
    main thread: elsewhere (a test calling the loop from a thread) nothing is installed."""

    def __init__(self, names: Iterable[str], key: str = "train.preempt_signals") -> None:
        self.signals = signal_numbers(names, key)
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.signals]

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> PreemptSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()


def ignore_in_worker(names: list[str], worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores the preemption signals.

    A cluster signals every process of the job, DataLoader workers included. A worker that dies
    of SIGTERM makes the main process raise at once (torch's SIGCHLD handler), before it can save,
    and SIGUSR1's default action ends a process too. Workers still end with their main process:
    torch stops them through an event and a watchdog on the parent, not through these signals."""
    for s in names:
        signal.signal(signal.Signals[s], signal.SIG_IGN)
