"""EqCo's claim in miniature: tiny MoCo v2 (configs/pretrain/tiny_mocov2.yaml, 256-key queue) with
plain InfoNCE vs EqCo at K negatives per query, same data and budget, kNN top-1 of the backbone.

    python -m benchmarks.eqco_k [--ks 16,64,256] [--losses infonce,eqco] [--seeds 0,1] [--epochs 6]

The paper (Zhu et al., EqCo) reports that MoCo v2 with EqCo's margin τ·log(α/K) keeps its accuracy
as K shrinks (α = the queue length, 65536 on ImageNet) while plain InfoNCE degrades. Here α = 256, the
tiny queue, and K of its keys are drawn per query without replacement (``method.num_negatives``).
At K = α the margin is 0 and EqCo is InfoNCE: that cell is one run, reported in both columns.

SiMo is not in this grid: its negatives are the batch's other keys (K = B − 1), so varying K at a
fixed batch would change the budget; its rows in the first table (tiny_simo, K = 15; tiny_simo_k16,
K = 8) are its figures.

Runs are kept per (loss, K, seed) under --work (resumable; --fresh redoes them). Each run rewrites the
part of --out after ``benchmarks.learning.SECTION_MARK`` (the learning table above it is left alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from benchmarks.learning import (
    EPOCHS,
    RECIPES,
    SECTION_MARK,
    _budget,
    config_hash,
    ensure_small_synthetic,
    evaluate,
    random_baseline,
    run_logged,
)
from contrastive_transfer.cli import write_text
from contrastive_transfer.json_limits import read_json, read_json_lines

HOST = "tiny_mocov2"
ALPHA = 256  # tiny_mocov2's queue_size


def overrides(loss: str, k: int) -> list[str]:
    """The host's overrides for (loss, K). K = ALPHA is tiny_mocov2 itself (the whole queue, and
    EqCo's margin τ·log(α/K) would be 0), whatever the loss."""
    if k == ALPHA:
        return []
    out = [f"method.num_negatives={k}"]
    if loss == "eqco":
        out.append(f"method.loss.eqco_alpha={ALPHA}")
    return out


def run_name(loss: str, k: int, seed: int) -> str:
    # EqCo at K = α has margin 0: the same run as InfoNCE.
    return f"{'infonce' if k == ALPHA else loss}_k{k}_s{seed}"


def measure(loss: str, k: int, seed: int, epochs: int, data: Path, work: Path) -> dict:
    from pretrain.config import load_config

    run = work / "runs" / run_name(loss, k, seed)
    run.mkdir(parents=True, exist_ok=True)
    extra = overrides(loss, k)
    args = [
        f"data.root={data / 'imagenet' / 'train'}",
        f"train.output_dir={run / 'pretrain'}",
        *_budget(epochs, seed),
        *extra,
    ]
    cfg = load_config(RECIPES / f"{HOST}.yaml", args)
    seconds, _ = run_logged(
        [sys.executable, "-m", "pretrain", "--config", str(RECIPES / f"{HOST}.yaml"), *args], run / "pretrain.log"
    )
    rows = read_json_lines(run / "pretrain" / "metrics.jsonl")
    last = [r for r in rows if "loss" in r][-1]
    knn = evaluate(run / "pretrain" / "checkpoint_final.pth", data, run, probe=False)["knn_top1"]
    random = random_baseline(cfg.model.arch, cfg.model.stem, cfg.data.image_size, data, work, probe=False)
    return {
        "loss": "infonce" if k == ALPHA else loss,
        "k": k,
        "seed": seed,
        "epochs": epochs,
        "knn_top1": knn,
        "random_knn_top1": random["knn_top1"],
        "final_loss": last["loss"],
        "seconds": seconds,
        "config_hash": config_hash(HOST, epochs, seed, tuple(extra)),
    }


def _cell(values: list[float]) -> str:
    if not values:
        return "not measured"
    if len(values) == 1:
        return f"{values[0]:.1f} (1 seed)"
    each = ", ".join(f"{v:.1f}" for v in values)
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f} (n {len(values)}: {each})"


def write_section(rows: list[dict], args, out: Path) -> None:
    from contrastive_transfer.paths import read_text  # torch: imported when a file is read

    head = read_text(out, "report") if out.is_file() else ""
    head = head[: head.index(SECTION_MARK)] if SECTION_MARK in head else head
    randoms = sorted({r["random_knn_top1"] for r in rows})
    seeds = ", ".join(str(s) for s in sorted({r["seed"] for r in rows})) or "none yet"
    budget = "the budget of the table above" if args.epochs == EPOCHS else f"the table above: {EPOCHS}"
    lines = [
        SECTION_MARK,
        "",
        "## EqCo's claim in miniature: InfoNCE vs EqCo as K shrinks",
        "",
        f"`python -m benchmarks.eqco_k --epochs {args.epochs}`: {HOST} (256-key queue, same data, seeds "
        f"{seeds}) pretrained {args.epochs} epochs ({budget}) with K "
        f"negatives per query drawn from the queue, plain InfoNCE vs EqCo (margin τ·log(α/K), α = {ALPHA}); "
        "kNN top-1 (k 20) of the backbone on the small preset, mean ± sample std over seeds with the "
        f"per-seed values. Random init kNN: {', '.join(f'{v:.1f}' for v in randoms) or 'not measured'}. "
        f"At K = {ALPHA} EqCo's margin is 0 and both columns are the same runs. SiMo is not in the grid "
        "(its K is B − 1 = 15 at batch 16); see tiny_simo and tiny_simo_k16 above. Read the cells against "
        f"the host's own gain: its {HOST} row above says whether it beats its init at all in this budget; "
        "where it does not, the K comparison is within noise.",
        "",
        "| K | InfoNCE kNN top-1 | EqCo kNN top-1 | EqCo − InfoNCE |",
        "|---|---|---|---|",
    ]
    for k in args.ks:
        cells = {
            loss: [r["knn_top1"] for r in rows if r["k"] == k and r["loss"] == ("infonce" if k == ALPHA else loss)]
            for loss in ("infonce", "eqco")
        }
        diff = "-"
        if cells["infonce"] and cells["eqco"] and k != ALPHA:
            diff = f"{statistics.mean(cells['eqco']) - statistics.mean(cells['infonce']):+.1f}"
        lines.append(f"| {k} | {_cell(cells['infonce'])} | {_cell(cells['eqco'])} | {diff} |")
    lines.append("")
    write_text(out, head.rstrip("\n") + "\n\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.eqco_k",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ks", default="16,64,256", help=f"negatives per query, each ≤ {ALPHA}")
    parser.add_argument("--losses", default="infonce,eqco")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--data", default="datasets/synthetic", help="synthetic data root (generated if missing)")
    parser.add_argument("--work", default="outputs/bench_eqco_k")
    parser.add_argument("--out", default="benchmarks/learning.md")
    parser.add_argument("--fresh", action="store_true", help="measure the runs again")
    args = parser.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    if any(not 0 < k <= ALPHA for k in args.ks):
        raise SystemExit(f"error: --ks {args.ks}: expected 1..{ALPHA} (the tiny queue)")
    losses = args.losses.split(",")
    if set(losses) - {"infonce", "eqco"}:
        raise SystemExit(f"error: --losses {args.losses}: expected infonce and/or eqco")
    seeds = [int(s) for s in args.seeds.split(",")]
    data, work, out = Path(args.data).resolve(), Path(args.work).resolve() / f"{args.epochs}ep", Path(args.out)
    ensure_small_synthetic(data)
    rows_dir = work / "rows"
    rows_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for seed in seeds:
        for k in args.ks:
            for loss in losses:
                name = run_name(loss, k, seed)
                row_file = rows_dir / f"{name}.json"
                current = config_hash(HOST, args.epochs, seed, tuple(overrides(loss, k)))
                if row_file.is_file() and not args.fresh:
                    if read_json(row_file).get("config_hash") == current:
                        continue
                    print(f"{name}: the host recipe changed since it was measured: measuring again")
                if (work / "runs" / name).exists() and (args.fresh or row_file.is_file()):
                    shutil.rmtree(work / "runs" / name)
                print(f"{name}: pretraining {args.epochs} epochs ...", flush=True)
                row = measure(loss, k, seed, args.epochs, data, work)
                write_text(row_file, json.dumps(row, indent=1))
                print(f"{name}: kNN {row['knn_top1']:.1f} (random {row['random_knn_top1']:.1f})", flush=True)
                write_section([read_json(p) for p in sorted(rows_dir.glob("*.json"))], args, out)
    write_section([read_json(p) for p in sorted(rows_dir.glob("*.json"))], args, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
