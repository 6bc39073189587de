"""Training curves of a run from its ``metrics.jsonl`` (written by ``pretrain.engine``).

Each line is one logged step: step, epoch, lr, data_time, step_time, loss and the method's
diagnostics (mi_bound, npc_mean, npc_cv, pos_cos, neg_cos; grad_q_norm_mean/std every
``train.diagnostics_every`` steps), or a kNN row (step, epoch, knn_top1) at epoch ends. Rows are
merged by step, later lines winning: a resumed run re-logs the steps after its last checkpoint.

Writes curves.csv (one row per step, every logged column) and curves.png (one panel per logged
quantity).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from contrastive_transfer.paths import read_text
from pretrain.analysis.common import AnalysisError, pyplot, save_figure, write_csv

# The engine's columns in a readable order; anything else a method logs follows, sorted.
KNOWN_COLUMNS = (
    "step",
    "epoch",
    "lr",
    "loss",
    "infonce",
    "mi_bound",
    "npc_mean",
    "npc_cv",
    "pos_cos",
    "neg_cos",
    "grad_q_norm_mean",
    "grad_q_norm_std",
    "knn_top1",
    "data_time",
    "step_time",
)

# (panel title, y label, keys drawn as lines); a panel is drawn when one of its keys was logged.
PANELS = (
    ("loss", "loss", ("loss", "infonce")),
    ("learning rate", "lr", ("lr",)),
    ("mutual-information bound (EqCo Eq. 4/6)", "nats", ("mi_bound",)),
    ("gradient norm ‖∂L/∂q‖ (mean ± std)", "norm", ("grad_q_norm_mean",)),
    ("kNN top-1", "%", ("knn_top1",)),
    ("NPC multiplier q_B (DCL)", "", ("npc_mean", "npc_cv")),
    ("cosines", "cos", ("pos_cos", "neg_cos")),
)


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl merged by step (later lines win), sorted by step."""
    if not os.path.lexists(path):  # a FIFO or device is the gate's to name (read_text)
        raise AnalysisError(f"{path} does not exist (expected the metrics.jsonl of a `python -m pretrain` run)")
    by_step: dict[int, dict] = {}
    for number, line in enumerate(read_text(path, "metrics log", kind="log").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise AnalysisError(f"{path} line {number}: not JSON ({e.msg}): {line[:80]!r}") from None
        except ValueError as e:  # an integer of more than 4,300 digits
            raise AnalysisError(f"{path} line {number}: not JSON ({' '.join(str(e).split())[:120]})") from None
        except RecursionError:  # json's parser recurses per nesting level
            raise AnalysisError(f"{path} line {number}: nested too deeply, expected a flat object of metrics") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise AnalysisError(f"{path} line {number}: expected an object with an integer 'step', got {line[:80]!r}")
        by_step.setdefault(row["step"], {}).update(row)
    if not by_step:
        raise AnalysisError(f"{path} holds no metrics rows")
    return [by_step[s] for s in sorted(by_step)]


def columns_of(rows: list[dict]) -> list[str]:
    present = {k for r in rows for k in r}
    return [c for c in KNOWN_COLUMNS if c in present] + sorted(present - set(KNOWN_COLUMNS))


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot(rows: list[dict], path: Path, title: str) -> Path:
    plt = pyplot()
    panels = [p for p in PANELS if any(_series(rows, k)[0] for k in p[2])]
    cols = 2 if len(panels) > 1 else 1
    n_rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(6 * cols, 3.2 * n_rows), squeeze=False)
    for ax, (panel_title, ylabel, keys) in zip(axes.flat, panels):
        for key in keys:
            steps, values = _series(rows, key)
            if not steps:
                continue
            single = len(steps) < 3 or key == "knn_top1"
            ax.plot(steps, values, "o-" if single else "-", ms=3, label=key)
            if key == "grad_q_norm_mean":
                std = dict(zip(*_series(rows, "grad_q_norm_std")))
                if std:
                    lo = [v - std.get(s, 0.0) for s, v in zip(steps, values)]
                    hi = [v + std.get(s, 0.0) for s, v in zip(steps, values)]
                    ax.fill_between(steps, lo, hi, alpha=0.25)
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def run(run_dir: Path, out_dir: Path | None = None) -> dict[str, Path]:
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "analysis"
    rows = read_metrics(run_dir / "metrics.jsonl")
    csv_path = write_csv(out_dir / "curves.csv", columns_of(rows), rows)
    png_path = plot(rows, out_dir / "curves.png", f"{run_dir.name}: {len(rows)} logged steps")
    return {"csv": csv_path, "png": png_path}


# ------------------------------------------------------------------------------------ command line


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a pretraining output folder (train.output_dir)")
    parser.add_argument("--out", "--output-dir", type=Path, help="output folder (default RUN_DIR/analysis)")


def cli(args) -> None:
    written = run(args.run_dir, args.out)
    print(f"wrote {written['png']} and {written['csv']}")
