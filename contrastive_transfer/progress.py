"""Progress that suits where it goes: tqdm's bar on a terminal, plain lines elsewhere.

tqdm redraws its bar with carriage returns, which a log file keeps: a long run's log became one
line of hundreds of kilobytes. Into a file or a pipe, ``progress`` prints a whole line (count/total,
elapsed and remaining time, rate and the postfix metrics) every ~10 % of the total (at most one a
second), at least every ``every`` seconds, and at the end.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Iterable, Iterator

from tqdm import tqdm

LINES_PER_RUN = 10  # lines at evenly spaced counts, besides those ``every`` seconds adds
MIN_GAP_S = 1.0  # but not for loops done in seconds, whose counts would only add noise


def progress(
    iterable: Iterable | None = None,
    total: int | None = None,
    desc: str = "",
    unit: str = "batch",  # what most loops here count
    *,
    initial: int = 0,
    every: float = 30.0,
    disable: bool = False,
    file: IO[str] | None = None,
) -> tqdm | ProgressLines:
    """tqdm's interface (iterate, ``update``, ``set_postfix``, ``write``, ``close``, ``with``) over
    ``file`` (default: stderr); ``total`` defaults to ``len(iterable)``."""
    file = sys.stderr if file is None else file
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if disable or file.isatty():
        return tqdm(
            iterable, total=total, desc=desc, unit=unit, initial=initial, disable=disable, file=file, dynamic_ncols=True
        )
    return ProgressLines(iterable, total, desc, unit, initial, every, file)


class ProgressLines:
    """The part of tqdm's interface the project uses, printed as whole lines."""

    def __init__(
        self,
        iterable: Iterable | None,
        total: int | None,
        desc: str,
        unit: str,
        initial: int,
        every: float,
        file: IO[str],
    ) -> None:
        self.iterable, self.total, self.desc, self.unit, self.every, self.file = (
            iterable,
            total,
            desc,
            unit,
            every,
            file,
        )
        self.n = self.shown = self.initial = initial
        self.stride = max(1, total // LINES_PER_RUN) if total else None
        self.start = self.last = time.monotonic()
        self.postfix = ""

    def __iter__(self) -> Iterator:
        assert self.iterable is not None, "progress() was given no iterable to iterate"
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        waited = now - self.last
        counted = self.stride is not None and self.n - self.shown >= self.stride and waited >= MIN_GAP_S
        if counted or waited >= self.every or self.n == self.total:
            self._show(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def write(self, text: str, file: IO[str] | None = None) -> None:
        """As ``tqdm.write``: a message, to stdout unless told otherwise."""
        print(text, file=sys.stdout if file is None else file, flush=True)

    def close(self) -> None:
        if self.n != self.shown:
            self._show(time.monotonic())

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _show(self, now: float) -> None:
        self.shown, self.last = self.n, now
        line = tqdm.format_meter(
            self.n,
            self.total,
            now - self.start,
            prefix=f"{self.desc}: " if self.desc else "",
            unit=self.unit,
            postfix=self.postfix,
            initial=self.initial,
            bar_format="{desc}{n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
        )
        print(line, file=self.file, flush=True)


class Laps:
    """The wall time since the previous metrics row, charged to named parts as it passes.

    ``lap(name)`` charges the time since the previous lap to ``name``; nothing between two rows
    escapes a part, so the parts add up to the window's wall time. ``row`` reports the per-step
    parts as means over the window's steps and the others (a checkpoint, a monitor) as the
    seconds they took in the window, then starts the next window."""

    def __init__(self) -> None:
        self.first = self.start = self.mark = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.totals: dict[str, float] = {}  # over the whole run, for a closing summary
        self.steps = 0

    def lap(self, name: str, steps: int = 0) -> float:
        """Charge the seconds since the previous lap to ``name`` (and count ``steps`` done); returns them."""
        now = time.perf_counter()
        seconds, self.mark = now - self.mark, now
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.steps += steps
        return seconds

    def row(self, per_step: tuple[str, ...], extras: tuple[str, ...]) -> dict[str, float | int]:
        """``{part}_time`` (a mean per step for ``per_step``, seconds for ``extras``), the window's
        ``window_time`` (seconds, up to the last lap) and ``window_steps``."""
        n = max(self.steps, 1)
        out: dict[str, float | int] = {f"{p}_time": self.seconds.get(p, 0.0) / n for p in per_step}
        out.update({f"{e}_time": self.seconds.get(e, 0.0) for e in extras})
        out.update(window_time=self.mark - self.start, window_steps=self.steps)
        self.start, self.seconds, self.steps = self.mark, {}, 0
        return out
