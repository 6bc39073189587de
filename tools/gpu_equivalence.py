"""Compare the losses of two pretraining runs step by step (metrics.jsonl), e.g. the same recipe on
1 GPU and on 2 GPUs with the same global batch: with synchronized BN (SimCLR) the runs are the same
computation, so the losses must agree to float tolerance.

    python tools/gpu_equivalence.py RUN_A RUN_B [--rtol 1e-3]

Prints one line per step and exits 1 when a step differs by more than --rtol (relative)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contrastive_transfer.json_limits import read_json_lines


def losses(run: Path) -> dict[int, float]:
    rows = read_json_lines(run / "metrics.jsonl")
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--rtol", type=float, default=1e-3)
    args = parser.parse_args()
    a, b = losses(args.run_a), losses(args.run_b)
    steps = sorted(set(a) & set(b))
    if not steps:
        print(f"error: no common logged step in {args.run_a} and {args.run_b}", file=sys.stderr)
        return 1
    worst = 0.0
    for step in steps:
        rel = abs(a[step] - b[step]) / max(abs(b[step]), 1e-12)
        worst = max(worst, rel)
        print(f"step {step}: {a[step]:.6f} vs {b[step]:.6f} (rel {rel:.2e})")
    print(
        f"{'EQUAL' if worst <= args.rtol else 'DIFFERENT'}: worst relative difference {worst:.2e} "
        f"(tolerance {args.rtol:g})"
    )
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
