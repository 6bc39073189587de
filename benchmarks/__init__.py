"""Benchmarks: each module writes the markdown table beside it (``python -m benchmarks.<name>``)."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """The CPU's model name (lscpu), e.g. "AMD EPYC": the machine a figure was measured on."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()
