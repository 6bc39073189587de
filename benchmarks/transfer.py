"""What pretraining buys downstream: one row per method family plus the supervised baseline and
random init, every row at the same budget, every evaluation over several seeds.

    python -m benchmarks.transfer [--preset small|digits] [--rows tiny_simclr,random] [--seeds 3] [--fresh]

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

``--preset digits`` (``benchmarks/transfer_digits.md``): the same evaluations on scikit-learn's real
handwritten digits (``contrastive_transfer/synthetic/digits.py``), one row per tiny recipe plus
random init, each pretrained as the digits learning table pretrains it (``benchmarks/learning.py
--preset digits``: DIGITS_EPOCHS epochs at 32 px with the digits augmentation, seed 0). Its
pretraining is not run twice: a row takes the learning table's seed-0 checkpoint under
--learning-work when that was pretrained with the row's config (the hash of the config saved in the
checkpoint); else it pretrains in its own run folder, as the learning table does. The synthetic table
does the same with the learning table's synthetic runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import cell, cpu_name, mean_std
from benchmarks.learning import (
    PRESETS,
    DataPreset,
    _git_sha,
    config_hash,
    ensure_data,
    experiment_hash,
    pretrain_run,
    random_init_record,
    run_folder,
    run_logged,
    tiny_recipes,
)
from contrastive_transfer.cli import atomic_write, write_text
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


@dataclass(frozen=True)
class Table:
    """One transfer table: the learning table's data preset it pretrains on (data, budget, recipe
    overrides), its rows, its document and the pixel size of its random init."""

    data: DataPreset
    rows: tuple[str, ...]
    out: str
    random_size: int
    epochs: int = 0  # the pretraining budget; 0: the data preset's

    @property
    def budget(self) -> int:
        return self.epochs or self.data.epochs


TABLES = {
    "small": Table(PRESETS["small"], ROWS, "benchmarks/transfer.md", 64),
    # every tiny recipe (the learning table's rows), random init last
    "digits": Table(PRESETS["digits"], (*tiny_recipes(), "random"), "benchmarks/transfer_digits.md", 32),
}
SMALL = TABLES["small"]
LABELS = {
    "knn": "kNN top-1",
    "svm": "VOC07 SVM mAP",
    "probe": "linear probe top-1",
    "AP50": "FPN AP50",
    "AP": "FPN AP",
}


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def pretrain(row: str, data: Path, run: Path, table: Table = SMALL, learning: Path | None = None) -> Path:
    """The row's backbone: its own (what its evaluations so far read), else the learning table's
    seed-0 checkpoint under ``learning`` (its --work) when pretrained with the row's config, else the
    tiny recipe pretrained here as the learning table pretrains it; random init for ``random``."""
    final = run / "pretrain" / "checkpoint_final.pth"
    if final.is_file():
        return final
    if row == "random":
        random_init_record(final, "resnet18", "imagenet", table.random_size)
        return final
    kept = learning_checkpoint(row, table, learning) if learning is not None else None
    if kept is not None:
        return kept
    pretrain_run(row, table.budget, 0, data, run, table.data.overrides)
    return final


def learning_checkpoint(row: str, table: Table, learning: Path) -> Path | None:
    """The learning table's seed-0 ``checkpoint_final.pth`` of ``row`` under its --work folder, when
    the config saved in it hashes to the row's (a run of an edited recipe is not this row's)."""
    from contrastive_transfer.safe_load import NUMPY_RNG_GLOBALS, UnsafeFileError, torch_load
    from pretrain.config import experiment

    path = run_folder(learning, table.data.name, table.budget) / "runs" / row / "seed0" / "pretrain"
    path = path / "checkpoint_final.pth"
    if not path.is_file():
        return None
    try:  # a training state, read as every reader of one reads it
        state = torch_load(path, NUMPY_RNG_GLOBALS, kind="training state")
    except UnsafeFileError:
        return None  # not this row's checkpoint: the row pretrains its own
    saved = state.get("config") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or not isinstance(saved.get("train"), dict):
        return None
    # pretrain saves train.mixed_precision as it ran: a recipe's null (the launcher's choice) is saved as
    # "no" by the plain `python -m pretrain` the learning table runs
    as_recipe = {**saved, "train": {**saved["train"], "mixed_precision": None}}
    kept = [saved, as_recipe] if saved["train"].get("mixed_precision") == "no" else [saved]
    return path if row_hash(row, table) in {experiment_hash(experiment(c)) for c in kept} else None


def _json(path: Path) -> dict:
    return read_json(path)


def evaluate(
    weights: Path, data: Path, run: Path, seeds: int, iters: int = DETECTION_ITERS, options: tuple[str, ...] = ()
) -> dict[str, list[float]]:
    """{metric: [value per seed]} (one value for the deterministic kNN and SVM); ``options``: the
    data's detection options (``DataPreset.detection``)."""
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
    return {**result, **detection(weights, data, run, seeds, iters, options=options)}


def detection(
    weights: Path, data: Path, run: Path, seeds: int, iters: int, every: int = 0, options: tuple[str, ...] = ()
) -> dict:
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
        opts += ["SOLVER.STEPS", steps, *options] + (["TEST.EVAL_PERIOD", str(every)] if every else [])
        config = CURVE_CONFIG if every else DETECTION_CONFIG
        cmd = _py("transfer.detection", "--config-file", str(config), "--num-gpus", "1", "--seeds",
                  str(seeds), "--resume", "--data-root", str(data), *opts)  # fmt: skip
        run_logged(cmd, run / f"{name}.log")
    metrics = _json(out / "metrics.json")
    # one seed: transfer.detection writes that run's own metrics.json in OUTPUT_DIR, no per_seed
    per_seed = metrics["per_seed"] if "per_seed" in metrics else {str(metrics["seed"]): metrics["results"]}
    folders = {s: out / f"seed_{s}" if "per_seed" in metrics else out for s in per_seed}
    bbox = [next(iter(results.values()))["bbox"] for results in per_seed.values()]
    result = {"AP50": [b["AP50"] for b in bbox], "AP": [b["AP"] for b in bbox]}
    if every:
        result["curve"] = {str(i): [] for i in range(every, iters + 1, every)}
        for seed in per_seed:
            for row in read_json_lines(folders[seed] / "training_metrics.json"):
                key = next((k for k in row if k.endswith("bbox/AP50")), None)
                if key and str(row["iteration"] + 1) in result["curve"]:
                    result["curve"][str(row["iteration"] + 1)].append(row[key])
        # detectron2 evaluates the last iteration after training, past its metrics writer: that
        # point is the run's final AP50, which metrics.json holds.
        if not result["curve"].get(str(iters)):
            result["curve"][str(iters)] = result["AP50"]
    return result


def measure(
    row: str,
    data: Path,
    work: Path,
    seeds: int,
    fresh: bool,
    table: Table = SMALL,
    learning: Path | None = None,
    iters: int = DETECTION_ITERS,
) -> dict:
    run = work / "runs" / row
    if fresh and run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    weights = pretrain(row, data, run, table, learning)
    values = evaluate(weights, data, run, seeds, iters, table.data.detection)
    return {
        "row": row,
        "values": values,
        "seeds": seeds,
        "detection_iters": iters,
        "config_hash": row_hash(row, table),
        "pretrained": str(weights),
        "git_sha": _git_sha(),
        "load_avg_5min": os.getloadavg()[1],
    }


def row_hash(row: str, table: Table = SMALL) -> str:
    """The random init's architecture and size, or the recipe's config hash at the table's budget
    (the learning table's hash of its seed-0 run)."""
    if row == "random":
        return f"random-resnet18-{table.random_size}px"
    return config_hash(row, table.budget, 0, table.data.overrides)


def gain(values: list[float], base: list[float]) -> str:
    """Gain over random init; ✓ where it exceeds twice its standard error (0 for deterministic figures)."""
    (m, s), (b, t) = mean_std(values), mean_std(base)
    se = ((s or 0.0) ** 2 / len(values) + (t or 0.0) ** 2 / len(base)) ** 0.5
    clear = m - b > 2 * se if se > 0 else m > b
    return f"{m - b:+.1f}" + (" ✓" if clear else "")


def intro(table: Table, args) -> str:
    """The table's protocol in one paragraph."""
    iters = getattr(args, "detection_iters", DETECTION_ITERS)
    if table.data.name == "small":
        command = "`python -m benchmarks.transfer`"
        data = (
            "the `small` synthetic ImageNet (1500 images, 10 shape classes, 64 px; `random`: torchvision's "
            "initialization, seed 0)"
        )
        detection = "the synthetic VOC07+12"
    else:
        command = f"`python -m benchmarks.transfer --preset {table.data.name}`"
        data = (
            f"{table.data.description}; the learning table's seed-0 checkpoint where it has one "
            f"(`python -m benchmarks.learning --preset {table.data.name}`, the same config hash; `random`: "
            f"torchvision's initialization, seed 0, at {table.random_size} px)"
        )
        detection = "canvases of train-split digits (VOC07+12 layout, the 10 digit classes), tested on val-split digits"
    return (
        f"{command}: each row pretrains its tiny recipe for {table.budget} epochs (seed 0) on {data}, then "
        "evaluates the backbone: kNN (k 20) and the VOC07 SVM (res5avg, 128 px) are deterministic; the `bn` "
        f"linear probe (10 epochs) and the FPN fine-tune on {detection} ({iters} iterations of 2 images at "
        f"96 px on the frozen backbone, `configs/detection/{DETECTION_CONFIG.name}`, lr × 0.1 at 80 %) are "
        f"mean ± sample std over {args.seeds} seeds of the fine-tune. Gain: over random init; ✓ where it exceeds "
        "twice its standard error over the fine-tune seeds (kNN and SVM have none: any gain of the one backbone "
        "is marked, and their spread over pretraining seeds is the learning table's). "
        f"Machine: {cpu_name()}, {os.cpu_count()} cores; other jobs may have shared it "
        "(each row's JSON under --work has the load average when it ended), which moves times, not figures."
    )


def write_table(rows: dict[str, dict], out: Path, args, table: Table = SMALL) -> None:
    measured = [r for r in table.rows if r in rows]
    base = rows.get("random", {}).get("values")
    heading = "" if table.data.name == "small" else f" on {table.data.heading}"
    lines = [
        f"# What pretraining buys: transfer of every method family, supervised and random init{heading}",
        "",
        intro(table, args),
        "",
        "| row | " + " | ".join(LABELS[m] for m in METRICS) + " | " + " | ".join(f"gain {m}" for m in METRICS) + " |",
        "|---|" + "---|" * (2 * len(METRICS)),
    ]
    for row in measured:
        v = rows[row]["values"]
        gains = [gain(v[m], base[m]) if base and row != "random" else "—" for m in METRICS]
        lines.append(f"| {row} | " + " | ".join(cell(v[m]) for m in METRICS) + " | " + " | ".join(gains) + " |")
    lines += svm_floor(Path(args.data or table.data.root))  # main's default data root
    missing = [r for r in table.rows if r not in rows]
    if missing:
        lines += ["", f"Not measured yet: {', '.join(missing)}."]
    lines += curve_table(rows)
    design = DESIGN if table.data.name == "small" else DIGITS_DESIGN
    lines += ["", design, "", f"![transfer]({out.with_suffix('.png').name})", ""]
    write_text(out, "\n".join(lines))
    _chart(rows, out.with_suffix(".png"), table)


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

DIGITS_DESIGN = """## Data design

Real handwriting, offline: scikit-learn's copy of the UCI digits, split once into train and val
(stratified, `docs/datasets.md`). Pretraining, kNN and the probe read the ImageFolder (a digit placed
at random in a 40-px image); the SVM and detection read canvases of 1-4 digits, trainval canvases
drawn from train-split digits and test canvases from val-split digits, so no evaluation sees a digit
that pretraining saw. The detector has the 10 digit classes (the VOC folder's class files), and
the VOC evaluator averages AP over them."""


def _chart(rows: dict[str, dict], path: Path, table: Table = SMALL) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r for r in table.rows if r in rows]
    curves = {r: rows[r]["curve"] for r in rows if "curve" in rows[r]}
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(15 if curves else 11, 4.5), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(len(names), 1)
    # one colour per row (the default cycle repeats after 10 of the digits table's 17); random in black
    colours = iter(plt.get_cmap("tab20").colors)
    for i, row in enumerate(names):
        means, stds = zip(*(mean_std(rows[row]["values"][m]) for m in METRICS))
        xs = [j + i * width for j in range(len(METRICS))]
        colour = "black" if row == "random" else next(colours)
        ax.bar(xs, means, width, yerr=[s or 0.0 for s in stds], capsize=2, color=colour, label=row.replace("tiny_", ""))
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(METRICS))], [LABELS[m].replace(" ", "\n", 1) for m in METRICS]
    )
    ax.set_ylabel("score (error bars: std over seeds)")
    ax.set_title("Transfer after the same pretraining budget")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
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
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def measure_curve(data: Path, work: Path, rows: dict[str, dict], table: Table = SMALL) -> None:
    for row in CURVE["rows"]:
        if row in rows and "curve" not in rows[row]:
            run = work / "runs" / row
            # the table's own weights (perhaps the learning table's checkpoint): not pretrained again
            saved = Path(rows[row].get("pretrained") or run / "none")
            weights = saved if saved.is_file() else pretrain(row, data, run, table)
            result = detection(
                weights, data, run, CURVE["seeds"], CURVE["iters"], CURVE["every"], options=table.data.detection
            )
            rows[row]["curve"] = result["curve"]
            write_text(work / "rows" / f"{row}.json", json.dumps(rows[row], indent=1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=sorted(TABLES), help="the data (default small)")
    parser.add_argument("--rows", default=None, help="comma-separated rows (default: all of the preset's: "
                        f"{', '.join(ROWS)}; digits: every tiny recipe and random)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3, help="fine-tune seeds per evaluation (default 3)")
    parser.add_argument("--curve", action="store_true", help="also AP50 against iterations (demo recipe, random)")
    parser.add_argument("--data", default=None, help="data root, generated if missing (default datasets/synthetic, "
                        "datasets/digits)")  # fmt: skip
    parser.add_argument("--work", default="outputs/bench_transfer", help="runs and measured rows")
    parser.add_argument(
        "--learning-work",
        default="outputs/bench_learning",
        help="benchmarks.learning's --work, whose seed-0 checkpoints are used where they have the row's config "
        "(default %(default)s)",
    )
    parser.add_argument("--out", default=None, help="default benchmarks/transfer.md, transfer_digits.md")
    parser.add_argument("--epochs", type=int, default=None, help="pretraining budget (default: the learning "
                        "table's, 6; digits 20)")  # fmt: skip
    parser.add_argument("--detection-iters", type=int, default=DETECTION_ITERS, help="default %(default)s")
    parser.add_argument("--fresh", action="store_true", help="measure the rows again")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    table = TABLES[args.preset]
    table = Table(table.data, table.rows, table.out, table.random_size, args.epochs or 0)
    chosen = args.rows.split(",") if args.rows else list(table.rows)
    if set(chosen) - set(table.rows):
        raise SystemExit(
            f"error: --rows {','.join(sorted(set(chosen) - set(table.rows)))}: expected some of {', '.join(table.rows)}"
        )
    data, out = Path(args.data or table.data.root).resolve(), Path(args.out or table.out)
    # the synthetic table keeps its folder of before; another preset's goes beside it, by budget
    work = Path(args.work).resolve()
    work = work if table.data.name == "small" else run_folder(work, table.data.name, table.budget)
    learning = Path(args.learning_work).resolve()
    ensure_data(data, table.data.name)
    (work / "rows").mkdir(parents=True, exist_ok=True)
    rows = {p.stem: _json(p) for p in (work / "rows").glob("*.json")}
    for row in ["random", *[r for r in chosen if r != "random"]]:  # the baseline first: every gain needs it
        if row not in chosen and "random" in rows:
            continue
        kept, current = rows.get(row), row_hash(row, table)
        same = kept and kept["config_hash"] == current and kept["seeds"] == args.seeds
        if same and not args.fresh and kept.get("detection_iters", DETECTION_ITERS) == args.detection_iters:
            print(f"{row}: measured before", flush=True)
            continue
        print(f"{row}: pretraining and evaluating ({args.seeds} seeds) ...", flush=True)
        stale = kept is not None and kept["config_hash"] != current  # the recipe changed: start clean
        rows[row] = measure(
            row, data, work, args.seeds, args.fresh or stale, table=table, learning=learning, iters=args.detection_iters
        )
        write_text(work / "rows" / f"{row}.json", json.dumps(rows[row], indent=1))
        write_table(rows, out, args, table)
    if args.curve:
        measure_curve(data, work, rows, table)
    write_table(rows, out, args, table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
