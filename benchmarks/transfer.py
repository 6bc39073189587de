"""What pretraining buys downstream: one row per method family plus the supervised baseline and
random init, every row at the same budget, every evaluation over several seeds.

    python -m benchmarks.transfer [--rows tiny_simclr,random] [--seeds 3] [--fresh]

Per row: pretrain the tiny recipe (6 epochs, seed 0, on the `small` synthetic ImageNet), then
evaluate its backbone with kNN and the VOC07 SVM (deterministic: no seed), the `bn` linear probe
(one run per seed: head initialization and data order) and FPN detection fine-tuned on the
synthetic VOC07+12 (one run per seed). ``random`` is torchvision's initialization of the same
ResNet-18. Each figure is mean ± sample std over the seeds; the gain over random init is marked
where it exceeds twice its standard error. ``--curve`` adds AP50 against iterations for the demo's
recipe and random init (longer fine-tunes evaluated along the way), the measurement behind the
demo's detection budget.

Rows are kept under --work, keyed by the hash of the recipe's resolved config at this budget (as
in benchmarks/learning.py): an interrupted table resumes, an edited recipe is measured again.
Writes --out (markdown) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from benchmarks import cell, cpu_name, mean_std
from benchmarks.learning import (
    EPOCHS,
    RECIPES,
    _git_sha,
    config_hash,
    ensure_small_synthetic,
    random_init_record,
    run_logged,
)
from contrastive_transfer.json_limits import read_json, read_json_lines

ROOT = Path(__file__).resolve().parents[1]
# One recipe per family (the list), the supervised baseline, and random init.
ROWS = (
    "tiny_simclr",
    "tiny_mocov2",
    "tiny_dclw",
    "tiny_simco",
    "tiny_simo",
    "tiny_adco",
    "tiny_supervised",
    "random",
)
# The demo's detection: the backbone frozen, 600 iterations (tools/demo.py says why). The curve
# fine-tunes the whole network (the paper's protocol), to show where random init catches up.
DETECTION_CONFIG = ROOT / "configs" / "detection" / "tiny_voc0712_R_18_FPN_frozen.yaml"
DETECTION_ITERS = 600
CURVE_CONFIG = ROOT / "configs" / "detection" / "tiny_voc0712_R_18_FPN_syncbn.yaml"
CURVE = {"rows": ("tiny_simclr", "random"), "iters": 1500, "every": 300, "seeds": 2}
METRICS = ("knn", "svm", "probe", "AP50", "AP")
LABELS = {
    "knn": "kNN top-1",
    "svm": "VOC07 SVM mAP",
    "probe": "linear probe top-1",
    "AP50": "FPN AP50",
    "AP": "FPN AP",
}


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def pretrain(row: str, data: Path, run: Path) -> Path:
    """The row's backbone: the tiny recipe pretrained at the learning table's budget, or random init."""
    final = run / "pretrain" / "checkpoint_final.pth"
    if final.is_file():
        return final
    if row == "random":
        random_init_record(final, "resnet18", "imagenet", 64)
        return final
    overrides = [
        f"data.root={data / 'imagenet' / 'train'}",
        f"train.output_dir={run / 'pretrain'}",
        f"train.epochs={EPOCHS}",
        "train.seed=0",
        "train.log_with=none",
    ]
    run_logged(_py("pretrain", "--config", str(RECIPES / f"{row}.yaml"), *overrides), run / "pretrain.log")
    return final


def _json(path: Path) -> dict:
    return read_json(path)


def evaluate(weights: Path, data: Path, run: Path, seeds: int) -> dict[str, list[float]]:
    """{metric: [value per seed]} (one value for the deterministic kNN and SVM)."""
    imagenet, w = data / "imagenet", ["--weights", str(weights), "--workers", "0"]
    steps = {
        "knn": _py("transfer.knn", *w, "--train-dir", str(imagenet / "train"), "--val-dir", str(imagenet / "val"),
                   "--k", "20", "--crop", "auto", "--output-dir", str(run / "knn")),
        "svm": _py("transfer.voc07_svm", *w, "--voc-root", str(data / "VOC2007"), "--resize", "146", "--crop", "128",
                   "--output-dir", str(run / "voc07_svm")),
    }  # fmt: skip
    for name, cmd in steps.items():
        if not (run / cmd[-1] / "metrics.json").is_file():
            run_logged(cmd, run / f"{name}.log")
    result = {
        "knn": [_json(run / "knn" / "metrics.json")["top1"]],
        "svm": [_json(run / "voc07_svm" / "metrics.json")["layers"]["res5avg"]["mAP"]],
        "probe": [],
    }
    for seed in range(seeds):
        out = run / "linear" / f"seed_{seed}"
        if not (out / "metrics.json").is_file():
            cmd = _py("transfer.linear", *w, "--dataset", "imagenet", "--data-root", str(imagenet), "--preset", "bn",
                      "--crop", "auto", "--seed", str(seed), "--output-dir", str(out), "--resume")  # fmt: skip
            run_logged(cmd, run / f"linear_{seed}.log")
        result["probe"].append(_json(out / "metrics.json")["top1"])
    return {**result, **detection(weights, data, run, seeds, DETECTION_ITERS)}


def detection(weights: Path, data: Path, run: Path, seeds: int, iters: int, every: int = 0) -> dict:
    """FPN fine-tunes on the synthetic VOC07+12 (lr × 0.1 at 80 %), one per seed: {"AP50": [...],
    "AP": [...]}; with ``every``, also AP50 at every ``every`` iterations ({"curve": {iter: [...]}})."""
    pkl = run / "detectron2.pkl"
    if not pkl.is_file():
        run_logged(_py("converters.to_detectron2", str(weights), str(pkl)), run / "convert.log")
    name = f"detection_{iters}it_{seeds}seeds" + (f"_every{every}" if every else "")
    out = run / name
    if not (out / "metrics.json").is_file():
        opts = ["MODEL.WEIGHTS", str(pkl), "OUTPUT_DIR", str(out), "SOLVER.MAX_ITER", str(iters)]
        # The curve's fine-tunes keep the lr constant: AP at iteration i then means the same in every run.
        steps = f"({int(iters * 0.8)},)" if not every else f"({10 * iters},)"
        opts += ["SOLVER.STEPS", steps] + (["TEST.EVAL_PERIOD", str(every)] if every else [])
        config = CURVE_CONFIG if every else DETECTION_CONFIG
        cmd = _py("transfer.detection", "--config-file", str(config), "--num-gpus", "1", "--seeds",
                  str(seeds), "--resume", "--data-root", str(data), *opts)  # fmt: skip
        run_logged(cmd, run / f"{name}.log")
    per_seed = _json(out / "metrics.json")["per_seed"]
    bbox = [next(iter(results.values()))["bbox"] for results in per_seed.values()]
    result = {"AP50": [b["AP50"] for b in bbox], "AP": [b["AP"] for b in bbox]}
    if every:
        result["curve"] = {str(i): [] for i in range(every, iters + 1, every)}
        for seed in per_seed:
            for row in read_json_lines(out / f"seed_{seed}" / "training_metrics.json"):
                key = next((k for k in row if k.endswith("bbox/AP50")), None)
                if key and str(row["iteration"] + 1) in result["curve"]:
                    result["curve"][str(row["iteration"] + 1)].append(row[key])
        # detectron2 evaluates the last iteration after training, past its metrics writer: that
        # point is the run's final AP50, which metrics.json holds.
        if not result["curve"].get(str(iters)):
            result["curve"][str(iters)] = result["AP50"]
    return result


def measure(row: str, data: Path, work: Path, seeds: int, fresh: bool) -> dict:
    run = work / "runs" / row
    if fresh and run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    weights = pretrain(row, data, run)
    values = evaluate(weights, data, run, seeds)
    return {
        "row": row,
        "values": values,
        "seeds": seeds,
        "detection_iters": DETECTION_ITERS,
        "config_hash": row_hash(row),
        "git_sha": _git_sha(),
        "load_avg_5min": os.getloadavg()[1],
    }


def row_hash(row: str) -> str:
    return "random-resnet18-64px" if row == "random" else config_hash(row, EPOCHS)


def gain(values: list[float], base: list[float]) -> str:
    """Gain over random init; ✓ where it exceeds twice its standard error (0 for deterministic figures)."""
    (m, s), (b, t) = mean_std(values), mean_std(base)
    se = ((s or 0.0) ** 2 / len(values) + (t or 0.0) ** 2 / len(base)) ** 0.5
    clear = m - b > 2 * se if se > 0 else m > b
    return f"{m - b:+.1f}" + (" ✓" if clear else "")


def write_table(rows: dict[str, dict], out: Path, args) -> None:
    measured = [r for r in ROWS if r in rows]
    base = rows.get("random", {}).get("values")
    lines = [
        "# What pretraining buys: transfer of every method family, supervised and random init",
        "",
        f"`python -m benchmarks.transfer`: each row pretrains its tiny recipe for {EPOCHS} epochs (seed 0) "
        "on the `small` synthetic ImageNet (1500 images, 10 shape classes, 64 px; `random`: torchvision's "
        "initialization, seed 0), then evaluates the backbone: kNN (k 20) and the VOC07 SVM (res5avg, 128 px) "
        f"are deterministic; the `bn` linear probe (10 epochs) and the FPN fine-tune on the synthetic VOC07+12 "
        f"({DETECTION_ITERS} iterations of 2 images at 96 px on the frozen backbone, "
        f"`configs/detection/{DETECTION_CONFIG.name}`, lr × 0.1 at 80 %) are mean ± sample std over "
        f"{args.seeds} seeds of the fine-tune. Gain: over random init; ✓ where it exceeds twice its "
        f"standard error. Machine: {cpu_name()}, {os.cpu_count()} cores; other jobs may have shared it (each "
        "row's JSON under --work has the load average when it ended), which moves times, not figures.",
        "",
        "| row | " + " | ".join(LABELS[m] for m in METRICS) + " | " + " | ".join(f"gain {m}" for m in METRICS) + " |",
        "|---|" + "---|" * (2 * len(METRICS)),
    ]
    for row in measured:
        v = rows[row]["values"]
        gains = [gain(v[m], base[m]) if base and row != "random" else "—" for m in METRICS]
        lines.append(f"| {row} | " + " | ".join(cell(v[m]) for m in METRICS) + " | " + " | ".join(gains) + " |")
    lines += svm_floor(Path(args.data))
    missing = [r for r in ROWS if r not in rows]
    if missing:
        lines += ["", f"Not measured yet: {', '.join(missing)}."]
    lines += curve_table(rows)
    lines += ["", DESIGN, "", f"![transfer]({out.with_suffix('.png').name})", ""]
    out.write_text("\n".join(lines))
    _chart(rows, out.with_suffix(".png"))


def svm_floor(data: Path) -> list[str]:
    """The VOC07 SVM column's floor: the mAP random rankings score on this test split."""
    if not (data / "VOC2007" / "ImageSets").is_dir():
        return []
    from transfer.datasets.readers import read_voc_labels
    from transfer.voc07_protocol import chance_map

    mean, std = chance_map(read_voc_labels(data / "VOC2007", "test").labels)
    return [
        "",
        f"Read the SVM column against its floor: random rankings score {mean:.2f} ± {std:.2f} mAP on this test "
        "split (`transfer.voc07_protocol.chance_map`, 200 draws; also in each SVM `metrics.json`). Random init "
        "sits near it: the SVM's gains are real but small on this data, and the probe and detection show them better.",
    ]


def curve_table(rows: dict[str, dict]) -> list[str]:
    """AP50 against iterations of the whole-network fine-tune (``--curve``), mean ± std over seeds."""
    curves = {r: rows[r]["curve"] for r in CURVE["rows"] if "curve" in rows.get(r, {})}
    if not curves:
        return []
    its = sorted({int(i) for c in curves.values() for i in c})
    lines = [
        "",
        "## Detection AP50 against iterations, whole network fine-tuned",
        "",
        f"`python -m benchmarks.transfer --curve`: the MoCo paper's protocol (every layer trained, "
        f"`configs/detection/{CURVE_CONFIG.name}`) at a constant lr, {CURVE['iters']} iterations of 2 images, "
        f"evaluated every {CURVE['every']}; AP50 mean ± std over {CURVE['seeds']} fine-tune seeds.",
        "",
        "| iterations | " + " | ".join(curves) + " |",
        "|---|" + "---|" * len(curves),
    ]
    for i in its:
        lines.append(
            f"| {i} | " + " | ".join(cell(c[str(i)]) if c.get(str(i)) else "—" for c in curves.values()) + " |"
        )
    return lines


# Why the synthetic data can show a gain, and what it shares with the detection data.
DESIGN = """## Data design

The pretraining images (synthetic ImageNet) and the detection images (synthetic VOC) are drawn by the
same generator (`contrastive_transfer/synthetic`): the same shapes, textures, muted palette,
backgrounds and clutter. What they share is the visual vocabulary: ImageNet class i is VOC class i's
shape, for the first 10 of VOC's 20 classes. What they do not share: a pretraining image holds one
large centred object; a detection image holds 1-4 objects of any of the 20 shapes at 22-60 % of the
short side, placed anywhere, partly hidden, plus tiny ones; and the detector must also localize. A
backbone that learned to tell the shapes apart from their outlines should start the fine-tune ahead
of one that has to learn that from a few hundred detection batches."""


def _chart(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r for r in ROWS if r in rows]
    curves = {r: rows[r]["curve"] for r in rows if "curve" in rows[r]}
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(14 if curves else 9, 4.5), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(len(names), 1)
    for i, row in enumerate(names):
        means, stds = zip(*(mean_std(rows[row]["values"][m]) for m in METRICS))
        xs = [j + i * width for j in range(len(METRICS))]
        ax.bar(xs, means, width, yerr=[s or 0.0 for s in stds], capsize=2, label=row.replace("tiny_", ""))
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(METRICS))], [LABELS[m].replace(" ", "\n", 1) for m in METRICS]
    )
    ax.set_ylabel("score (error bars: std over seeds)")
    ax.set_title("Transfer after the same pretraining budget")
    ax.legend(fontsize=8, ncol=2)
    if curves:
        ax = axes[0][1]
        for row, curve in curves.items():
            its = sorted(curve, key=int)
            means = [statistics.fmean(curve[i]) for i in its]
            stds = [statistics.stdev(curve[i]) if len(curve[i]) > 1 else 0.0 for i in its]
            ax.errorbar([int(i) for i in its], means, yerr=stds, marker="o", capsize=3, label=row.replace("tiny_", ""))
        ax.set_xlabel("iterations of the whole-network fine-tune (batch 2, constant lr)")
        ax.set_ylabel("AP50 on the synthetic VOC07 test")
        ax.set_title("Detection AP50 against iterations (mean ± std over seeds)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure_curve(data: Path, work: Path, rows: dict[str, dict]) -> None:
    for row in CURVE["rows"]:
        if row in rows and "curve" not in rows[row]:
            run = work / "runs" / row
            result = detection(pretrain(row, data, run), data, run, CURVE["seeds"], CURVE["iters"], CURVE["every"])
            rows[row]["curve"] = result["curve"]
            (work / "rows" / f"{row}.json").write_text(json.dumps(rows[row], indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None, help=f"comma-separated rows (default: all of {', '.join(ROWS)})")
    parser.add_argument("--seeds", type=int, default=3, help="fine-tune seeds per evaluation (default 3)")
    parser.add_argument("--curve", action="store_true", help="also AP50 against iterations (demo recipe, random)")
    parser.add_argument("--data", default="datasets/synthetic", help="synthetic data root (generated if missing)")
    parser.add_argument("--work", default="outputs/bench_transfer", help="runs and measured rows")
    parser.add_argument("--out", default="benchmarks/transfer.md")
    parser.add_argument("--fresh", action="store_true", help="measure the rows again")
    args = parser.parse_args(argv)
    chosen = args.rows.split(",") if args.rows else list(ROWS)
    if set(chosen) - set(ROWS):
        raise SystemExit(
            f"error: --rows {','.join(sorted(set(chosen) - set(ROWS)))}: expected some of {', '.join(ROWS)}"
        )
    data, work, out = Path(args.data).resolve(), Path(args.work).resolve(), Path(args.out)
    ensure_small_synthetic(data)
    (work / "rows").mkdir(parents=True, exist_ok=True)
    rows = {p.stem: _json(p) for p in (work / "rows").glob("*.json")}
    for row in ["random", *[r for r in chosen if r != "random"]]:  # the baseline first: every gain needs it
        if row not in chosen and "random" in rows:
            continue
        kept = rows.get(row)
        if kept and not args.fresh and kept["config_hash"] == row_hash(row) and kept["seeds"] == args.seeds:
            print(f"{row}: measured before", flush=True)
            continue
        print(f"{row}: pretraining and evaluating ({args.seeds} seeds) ...", flush=True)
        stale = kept is not None and kept["config_hash"] != row_hash(row)  # the recipe changed: start clean
        rows[row] = measure(row, data, work, args.seeds, args.fresh or stale)
        (work / "rows" / f"{row}.json").write_text(json.dumps(rows[row], indent=1))
        write_table(rows, out, args)
    if args.curve:
        measure_curve(data, work, rows)
    write_table(rows, out, args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
