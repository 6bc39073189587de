"""Benchmarks: each module writes the markdown table beside it (``python -m benchmarks.<name>``)."""

from __future__ import annotations

import platform
import statistics
import subprocess


def cpu_name() -> str:
    """The CPU's model name (lscpu), e.g. "AMD EPYC": the machine a figure was measured on."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def cell(values: list[float], signed: bool = False) -> str:
    """A table cell: "mean ± std" over seeds, or the value alone when there is one."""
    mean, std = mean_std(values)
    return f"{mean:{'+' if signed else ''}.1f}" + (f" ± {std:.1f}" if std is not None else "")
