"""Does every method learn? One row per tiny recipe, same data and budget: pretrain on the synthetic
ImageNet-like set (or on the real handwritten digits), then kNN and linear-probe top-1 of the
exported backbone against the same architecture at random initialization, with wall time, images/s
and peak memory.

    python -m benchmarks.learning [--preset small|digits] [--recipes tiny_simclr,tiny_mocov2]
                                  [--epochs E] [--seeds 3] [--fresh]

Each recipe is pretrained with seeds 0..S-1 and compared with random inits of the same seeds; a
row is the mean ± std over its seeds, and it clears the 5-point kNN margin on its mean gain.

Every measured run is one JSON line of ``benchmarks/learning_runs.jsonl`` (committed), keyed by
(data preset, recipe, seed, config hash): a run with a line there is never measured again, on any
machine, unless --fresh. The hash is of what the run trains (``pretrain.config.experiment``: paths,
the monitor and keys at today's defaults left out, older spellings upgraded), and each line stores
that experiment, so a row carries over to later versions of the code that add options; an edited
recipe or a changed default hashes differently and is measured again, from a clean
run directory under --work (where the runs themselves live). Each run rewrites --out (markdown) and
its PNG from the lines whose hash is the recipe's current one, listing what is missing.

``--preset digits`` (``benchmarks/learning_digits.md``): scikit-learn's UCI digits (1,258 train /
539 val images, the digit placed at random in a 40-px image; ``contrastive_transfer/synthetic/
digits.py``), pretrained at 32 px with the ``digits`` augmentation (no flip, small affine) for
DIGITS_EPOCHS epochs, batch 16, the recipes' ResNet-18 with its ImageNet stem (at 32 px, res5 is
1×1; the small stem would cost 16× the compute).

Why 20 epochs: the pilot (2026-11-25, seed 0, AMD EPYC 2 cores shared with other jobs, load
average about 4; kNN k 20 on val, ``transfer.knn --crop auto``; random init 39.9):
tiny_simclr 10 epochs 64.2 (+24.3; 4.0 min of steps); tiny_mocov2 10 epochs 42.9 (+3.0; 5.5 min),
20 epochs 62.0 (+22.1; 12.5 min; its monitor at epochs 5/10/15: 41.0, 48.2, 59.4). At 10 epochs
MoCo v2 has barely started; at 20 both clear the issue's +20 points. Steps took 0.24-0.38 s under
that load against 0.13 s when the machine was quieter, so a 20-epoch run should take 3-4 min of
pretraining on two idle cores plus about a minute of kNN and probe: the whole table (16 recipes ×
3 seeds, AdCo's multi-crop about 2.5× the others) about 3.5-4 hours, more than the synthetic
table's 2. ``--epochs 10`` halves it for the recipes that learn as fast as SimCLR.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import cell, cpu_name, mean_std
from contrastive_transfer.cli import atomic_write, open_append, write_text
from contrastive_transfer.json_limits import read_json, read_json_lines
from contrastive_transfer.synthetic.digits import DETECTION_OVERRIDES, PRETRAIN_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "configs" / "pretrain"
# The probe: the bn preset (BatchNorm without affine + fc on res5avg, 10 epochs; transfer/probe_presets.py).
# The BN makes one lr fit every backbone: without it (the moco preset) lr 30 diverges on these
# backbones and so did lr 0.3 on tiny_simclr's, whose features are larger than a random init's.
KNN_K, PROBE_PRESET = 20, "bn"
EPOCHS = 6  # pretraining budget of a row: the same images seen by every recipe
SEEDS = 3  # pretraining seeds per row: one seed's spread (up to ±6 kNN points) exceeds the margin
MARGIN = 5.0  # kNN points a recipe must gain over its random init (the synthetic data's; DataPreset.margin)
DIGITS_EPOCHS = 20  # the digits' budget: the pilot below (module docstring)
RUNS_FILE = ROOT / "benchmarks" / "learning_runs.jsonl"  # every measured run, one JSON line each


@dataclasses.dataclass(frozen=True)
class DataPreset:
    """The data a table runs on: the generator's preset, its default folders and the recipe overrides."""

    name: str
    root: str  # default --data
    out: str  # default --out
    epochs: int  # default --epochs
    overrides: tuple[str, ...]  # recipe overrides every run of this data takes
    heading: str
    description: str  # the data and the input size, for the table's intro
    margin: float = MARGIN  # kNN points a row must gain over random init (the real digits: issue 36's +20)
    detection: tuple[str, ...] = ()  # transfer.detection options every fine-tune on this data takes


PRESETS = {
    "small": DataPreset(
        "small", "datasets/synthetic", "benchmarks/learning.md", EPOCHS, (), "the synthetic data",
        "the `small` synthetic ImageNet-like set (1500 training images, 10 shape classes, 64 px)",
    ),
    "digits": DataPreset(
        "digits", "datasets/digits", "benchmarks/learning_digits.md", DIGITS_EPOCHS, PRETRAIN_OVERRIDES,
        "the real handwritten digits",
        "scikit-learn's UCI handwritten digits (1258 training / 539 val images, 10 classes, each digit placed at "
        "random in a 40-px image; `--preset digits`), pretrained at 32 px with the `digits` augmentation "
        "(no flip, crops of ≥ half the image, ±15° affine)",
        20.0,
        DETECTION_OVERRIDES,
    ),
}  # fmt: skip


def ensure_small_synthetic(data: Path) -> None:
    ensure_data(data, "small")


def ensure_data(data: Path, preset: str = "small") -> None:
    """The data preset at ``data``: the generator does nothing where the manifest holds today's
    config, and rewrites a folder written with another (the digits' earlier VOC class names)."""
    subprocess.run(
        [sys.executable, "-m", "contrastive_transfer.synthetic", "--out", str(data), "--preset", preset],
        cwd=ROOT,
        check=True,
    )


def tiny_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("tiny_*.yaml"))


def _git_sha() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def run_logged(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run ``cmd`` (output to ``log``); (wall seconds, peak RSS in MiB of the process tree, sampled)."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open_append(log, fresh=True) as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        peak = [0.0]

        def sample():
            handle = psutil.Process(proc.pid)
            while proc.poll() is None:
                try:
                    rss = sum(p.memory_info().rss for p in [handle, *handle.children(recursive=True)])
                    peak[0] = max(peak[0], rss / 2**20)
                except psutil.Error:
                    pass
                time.sleep(0.5)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        # SIGTERM's default action ends this process at once, orphaning the run, which would go on
        # writing into a folder the next benchmark resumes: raise instead, so `finally` stops it.
        previous = signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        watcher.join()
    if code != 0:
        from contrastive_transfer.paths import read_text  # torch: imported when a file is read

        tail = "\n".join(read_text(log, "log", kind="log").splitlines()[-8:])
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed (exit {code}); see {log}:\n{tail}")
    return time.time() - start, peak[0]


def evaluate(weights: Path, data: Path, out: Path, probe: bool = True) -> dict[str, float]:
    """kNN and (unless ``probe`` is False) linear-probe top-1 of a backbone, each at the checkpoint's
    pretraining size."""
    py = sys.executable
    imagenet = data / "imagenet"
    if not (out / "knn" / "metrics.json").is_file():
        run_logged(
            [
                py,
                "-m",
                "transfer.knn",
                "--weights",
                str(weights),
                "--train-dir",
                str(imagenet / "train"),
                "--val-dir",
                str(imagenet / "val"),
                "--k",
                str(KNN_K),
                "--crop",
                "auto",
                "--workers",
                "0",
                "--output-dir",
                str(out / "knn"),
            ],
            out / "knn.log",
        )
    knn = read_json(out / "knn" / "metrics.json")
    if not probe:
        return {"knn_top1": knn["top1"]}
    if not (out / "linear" / "metrics.json").is_file():
        run_logged(
            [
                py,
                "-m",
                "transfer.linear",
                "--weights",
                str(weights),
                "--dataset",
                "imagenet",
                "--data-root",
                str(imagenet),
                "--preset",
                PROBE_PRESET,
                "--crop",
                "auto",
                "--workers",
                "0",
                "--output-dir",
                str(out / "linear"),
                "--resume",  # an interrupted probe continues (the probe checks its settings match)
            ],
            out / "linear.log",
        )
    linear = read_json(out / "linear" / "metrics.json")
    return {"knn_top1": knn["top1"], "linear_top1": linear["top1"]}


def random_init_record(path: Path, arch: str, stem: str, image_size: int, seed: int = 0) -> None:
    """torchvision's initialization of ``arch`` (``seed``) in this project's backbone record, so that
    --crop auto sees the pretraining size: the random-init row of the learning and transfer tables."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    state = {k: v for k, v in getattr(torchvision.models, arch)().state_dict().items() if not k.startswith("fc.")}
    record = {"backbone": state, "arch": arch, "stem": stem, "method": "random", "step": 0}
    record["config"] = {"data": {"image_size": image_size}}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(record, f))


def random_baseline(
    arch: str, stem: str, image_size: int, data: Path, work: Path, probe: bool = True, seed: int = 0
) -> dict[str, float]:
    """The same architecture at torchvision's initialization, evaluated once per (arch, stem, size, seed)."""
    out = work / "random" / f"{arch}_{stem}_{image_size}" / f"seed{seed}"
    weights = out / "checkpoint_final.pth"
    if not weights.is_file():
        random_init_record(weights, arch, stem, image_size, seed)
    return evaluate(weights, data, out, probe)


def _budget(epochs: int, seed: int = 0) -> list[str]:
    return [f"train.epochs={epochs}", f"train.seed={seed}", "train.log_with=none"]


def recipe_experiment(recipe: str, epochs: int, seed: int = 0, extra: tuple[str, ...] = ()) -> dict:
    """What a run of ``recipe`` at this budget trains (``pretrain.config.experiment``: the resolved
    config without paths, the monitor and keys at their defaults)."""
    from omegaconf import OmegaConf

    from pretrain.config import experiment, load_config

    return experiment(OmegaConf.to_container(load_config(RECIPES / f"{recipe}.yaml", [*_budget(epochs, seed), *extra])))


def experiment_hash(experiment: dict) -> str:
    return hashlib.sha256(json.dumps(experiment, sort_keys=True).encode()).hexdigest()[:10]


def config_hash(recipe: str, epochs: int, seed: int = 0, extra: tuple[str, ...] = ()) -> str:
    """The key of a measured run: a row measured in one checkout, or by an earlier version of the
    code, stays valid, and goes stale when what trains changes."""
    return experiment_hash(recipe_experiment(recipe, epochs, seed, extra))


def row_hash(row: dict) -> str:
    """A row's key, from the experiment it stores, seen by today's code (an older spelling upgraded
    by ``pretrain.migrate``); rows measured before rows stored it keep their recorded hash."""
    from pretrain.config import experiment

    return experiment_hash(experiment(row["config"])) if "config" in row else row["config_hash"]


def run_folder(work: Path, preset: str, epochs: int) -> Path:
    """Where a table's runs live under --work: ``<epochs>ep`` for the synthetic data (its folder of
    before), ``<preset>_<epochs>ep`` for another."""
    return work / (f"{epochs}ep" if preset == "small" else f"{preset}_{epochs}ep")


def pretrain_run(recipe: str, epochs: int, seed: int, data: Path, run: Path, extra: tuple[str, ...] = ()):
    """Pretrain ``recipe`` (+ ``extra``) at this budget into ``run/pretrain`` (a pretraining interrupted
    midway resumes; a finished one is kept): (wall seconds, peak MiB, 5-minute load average) of the
    pretraining, kept in ``run/pretrain_timing.json`` (the time of the resumed part only, if resumed)."""
    overrides = [
        f"data.root={data / 'imagenet' / 'train'}",
        f"train.output_dir={run / 'pretrain'}",
        *_budget(epochs, seed),
        *extra,
    ]
    final, timing = run / "pretrain" / "checkpoint_final.pth", run / "pretrain_timing.json"
    if final.is_file() and timing.is_file():  # pretrained before an evaluation was interrupted
        return tuple(read_json(timing))
    seconds, peak = run_logged(
        [sys.executable, "-m", "pretrain", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides],
        run / "pretrain.log",
    )
    load = os.getloadavg()[1]
    write_text(timing, json.dumps([seconds, peak, load]))
    return seconds, peak, load


def measure(
    recipe: str,
    epochs: int,
    seed: int,
    data: Path,
    work: Path,
    fresh: bool = False,
    extra: tuple[str, ...] = (),
    run: Path | None = None,
) -> dict:
    """One run: pretrain ``recipe`` (+ ``extra``) in ``run`` (default ``work/runs/<recipe>/seed<s>``),
    evaluate it and the random init of its seed (kept under ``work/random``)."""
    from omegaconf import OmegaConf

    from pretrain.config import load_config

    run = run or work / "runs" / recipe / f"seed{seed}"
    if fresh and run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    cfg = load_config(RECIPES / f"{recipe}.yaml", [*_budget(epochs, seed), *extra])
    seconds, peak, load = pretrain_run(recipe, epochs, seed, data, run, extra)
    final = run / "pretrain" / "checkpoint_final.pth"
    rows = read_json_lines(run / "pretrain" / "metrics.jsonl")
    steps = max(r["step"] for r in rows if "loss" in r)
    pretrained = evaluate(final, data, run)
    trained = recipe_experiment(recipe, epochs, seed, extra)
    random = random_baseline(cfg.model.arch, cfg.model.stem, cfg.data.image_size, data, work, seed=seed)
    return {
        "recipe": recipe,
        "seed": seed,
        "method": cfg.method.name,
        "loss": OmegaConf.select(cfg, "method.loss.name", default="-"),  # AdCo, SiMo, SimCo: their own loss
        "epochs": epochs,
        "steps": steps,
        "batch": cfg.train.batch_size,
        "image_size": cfg.data.image_size,
        "seconds": seconds,
        "images_per_s": steps * cfg.train.batch_size / seconds,
        "peak_mib": peak,
        **pretrained,
        "random_knn_top1": random["knn_top1"],
        "random_linear_top1": random["linear_top1"],
        "load_avg_5min": load,
        "config_hash": experiment_hash(trained),
        "config": trained,
        "git_sha": _git_sha(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
    }


# benchmarks/eqco_k.py writes its table after this line of --out; this module keeps it.
SECTION_MARK = "<!-- python -m benchmarks.eqco_k writes below this line -->"


def kept_section(out: Path) -> str:
    """The part of ``out`` from SECTION_MARK on ('' if none), so that each tool rewrites only its own."""
    from contrastive_transfer.paths import read_text  # torch: imported when a file is read

    text = read_text(out, "report") if out.is_file() else ""
    return text[text.index(SECTION_MARK) :] if SECTION_MARK in text else ""


def _values(runs: list[dict], key: str) -> list[float]:
    return [r[key] for r in runs]


def verdict(gains: list[float], margin: float = MARGIN) -> str:
    """Whether the mean kNN gain clears the margin, and whether that is within the seeds' spread
    (the margin lies within one standard deviation of the mean gain: another seed could flip it)."""
    mean, std = mean_std(gains)
    word = "✓" if mean >= margin else "below the margin"
    return word + (" (within spread)" if std is not None and abs(mean - margin) < std else "")


def above_two_se(gains: list[float]) -> str:
    """Whether the mean gain over random init exceeds twice its standard error (≥ 2 seeds)."""
    mean, std = mean_std(gains)
    return "-" if std is None else ("yes" if mean > 2 * std / math.sqrt(len(gains)) else "no")


def knn_gains(runs: list[dict]) -> list[float]:
    return [r["knn_top1"] - r["random_knn_top1"] for r in runs]


def table_line(recipe: str, runs: list[dict], margin: float = MARGIN) -> str:
    gains = knn_gains(runs)
    first = runs[0]
    cells = [
        recipe,
        first["method"],
        ", ".join(str(r["seed"]) for r in runs),
        cell(_values(runs, "knn_top1")),
        cell(_values(runs, "random_knn_top1")),
        cell(gains, signed=True),
        above_two_se(gains),
        verdict(gains, margin),
        cell(_values(runs, "linear_top1")),
        cell(_values(runs, "random_linear_top1")),
        f"{statistics.fmean(_values(runs, 'seconds')) / 60:.1f}",
        f"{statistics.fmean(_values(runs, 'images_per_s')):.0f}",
        f"{max(_values(runs, 'peak_mib')):.0f}",
        f"{max(r.get('load_avg_5min', float('nan')) for r in runs):.1f}",
        f"`{first['config_hash']}`",
        ", ".join(f"`{sha}`" for sha in dict.fromkeys(r["git_sha"] for r in runs)),
    ]
    return "| " + " | ".join(cells) + " |"


def summary(runs: dict[str, list[dict]], margin: float = MARGIN) -> str:
    """One sentence over the measured rows: how many clear the margin, and the probe's gains, which
    tell a backbone that learned little from one whose kNN neighbourhoods are not yet class-pure."""
    if not runs:
        return "No row measured yet."
    verdicts = [verdict(knn_gains(measured), margin) for measured in runs.values()]
    clear = [v for v in verdicts if v.startswith("✓")]
    below = [v for v in verdicts if not v.startswith("✓")]
    probe = [statistics.fmean(r["linear_top1"] - r["random_linear_top1"] for r in m) for m in runs.values()]
    return (
        f"{len(clear)} of {len(runs)} measured rows clear the {margin:.0f}-point kNN margin "
        f"({sum('within spread' in v for v in clear)} of them within spread); {len(below)} are below it "
        f"({sum('within spread' in v for v in below)} of them within spread). The mean linear-probe gain over "
        f"random init lies between {min(probe):+.1f} and {max(probe):+.1f} points across the rows."
    )


def write_table(runs: dict[str, list[dict]], recipes: list[str], out: Path, args) -> None:
    # Only the listed recipes: rows of a recipe since deleted stay on disk but not in the figures.
    runs = {recipe: runs[recipe] for recipe in recipes if runs.get(recipe)}
    seeds = ", ".join(map(str, range(args.seeds)))
    data = PRESETS[getattr(args, "preset", "small")]
    flag = "" if data.name == "small" else f" --preset {data.name}"
    lines = [
        f"# Does every method learn? Tiny recipes on {data.heading}",
        "",
        f"`python -m benchmarks.learning{flag} --epochs {args.epochs} --seeds {args.seeds}`: each tiny recipe "
        f"pretrained for {args.epochs} epochs with seeds {seeds} on {data.description}, then kNN (k {KNN_K}) and "
        f"the `{PROBE_PRESET}` linear probe (BN without affine "
        "+ fc on res5avg, 10 epochs, SGD lr 0.03 × 0.1 at epochs 2, 5, 8) at the pretraining size, against the "
        "same architecture at torchvision's random initialization with the same seeds. Figures are mean ± sample "
        "std over the seeds; the gain is the mean of the per-seed gains, `> 2 SE` whether it exceeds twice its "
        "standard error. A row clears the margin when its mean kNN "
        f"gain is ≥ {data.margin:.0f} points; `within spread` marks rows whose mean gain is less than one standard "
        f"deviation from the margin. Machine: {cpu_name()}, {os.cpu_count()} CPU cores, one thread per process; "
        "`min`, `img/s`: mean per run, slower under load (`load`: the highest 5-minute load average when a "
        "pretraining ended); `git`: the commits the row's runs were measured at.",
        "",
        summary(runs, data.margin),
        "",
        "| recipe | method | seeds | kNN top-1 | random kNN | gain | > 2 SE | margin | probe top-1 | random probe | "
        "min | img/s | peak MiB | load | config (seed 0) | git |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe in recipes:
        measured = runs.get(recipe, [])
        if measured:
            lines.append(table_line(recipe, measured, data.margin))
        missing = [s for s in range(args.seeds) if s not in {r["seed"] for r in measured}]
        if missing:
            lines.append(f"| {recipe} | seeds {', '.join(map(str, missing))} not measured yet |" + " |" * 14)
    png = out.with_suffix(".png")
    lines += ["", f"![kNN top-1 per recipe]({png.name})", ""]
    write_text(out, "\n".join(lines) + kept_section(out))
    _chart(runs, png)


def _chart(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(n for n in runs if runs[n])
    if not names:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names)), 4))
    x = range(len(names))
    for shift, key, label in ((-0.2, "knn_top1", "pretrained"), (0.2, "random_knn_top1", "random init")):
        stats = [mean_std(_values(runs[n], key)) for n in names]
        ax.bar([i + shift for i in x], [m for m, _ in stats], 0.4, yerr=[s or 0 for _, s in stats], label=label)
    ax.set_xticks(list(x), [n.replace("tiny_", "") for n in names], rotation=30, ha="right")
    ax.set_ylabel("kNN top-1 (%), mean ± std over seeds")
    ax.set_title("kNN top-1 after the same pretraining budget")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def read_runs(path: Path) -> list[dict]:
    """The lines of the runs file (each one measured run), in the order they were measured."""
    if not path.is_file():
        return []
    return read_json_lines(path)


def _key(row: dict) -> tuple:
    return row.get("preset", "small"), row["recipe"], row["seed"], row_hash(row)


def append_run(path: Path, row: dict) -> None:
    """One line per run, appended (a run measured again with --fresh: its later line wins)."""
    with open_append(path) as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def carry_legacy_rows(work: Path, path: Path, preset: str) -> None:
    """Rows an older version kept only under ``work/rows/<recipe>/seed<s>.json`` go into the runs
    file (the one migration place of that layout), unless it has them."""
    have = {_key(r) for r in read_runs(path)}
    for legacy in sorted((work / "rows").glob("*/seed*.json")):
        row = {"preset": preset, **read_json(legacy)}
        if _key(row) not in have:
            append_run(path, row)
            have.add(_key(row))


def current_runs(rows: list[dict], preset: str, hashes: dict[tuple[str, int], str]) -> dict[str, list[dict]]:
    """{recipe: its runs sorted by seed}: for each (recipe, seed) of ``hashes`` the last line of this
    preset measured with that config hash (lines of an older config are not shown)."""
    latest = {_key(r): r for r in rows}
    runs: dict[str, list[dict]] = {}
    for (recipe, seed), h in sorted(hashes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row = latest.get((preset, recipe, seed, h))
        if row is not None:
            runs.setdefault(recipe, []).append(row)
    return runs


def measure_kept(recipe: str, seed: int, args, data: Path, work: Path) -> None:
    """Measure (recipe, seed) unless the runs file has it with the current config, and no --fresh."""
    preset = PRESETS[args.preset]
    current = config_hash(recipe, args.epochs, seed, preset.overrides)
    rows = [r for r in read_runs(args.runs) if _key(r)[:3] == (preset.name, recipe, seed)]
    if not args.fresh and any(row_hash(r) == current for r in rows):
        print(f"{recipe} seed {seed}: measured before ({args.runs})")
        return
    if rows and not args.fresh:
        print(f"{recipe} seed {seed}: config {current} differs from the measured {row_hash(rows[-1])}: measuring")
    # the run folder holds a run of another config (or --fresh): resuming it would mix them, start clean
    stale = bool(rows) or args.fresh
    print(f"{recipe} seed {seed}: pretraining {args.epochs} epochs ...", flush=True)
    row = {"preset": preset.name, **measure(recipe, args.epochs, seed, data, work, stale, preset.overrides)}
    append_run(args.runs, row)
    print(
        f"{recipe} seed {seed}: kNN {row['knn_top1']:.1f} (random {row['random_knn_top1']:.1f}), probe "
        f"{row['linear_top1']:.1f} (random {row['random_linear_top1']:.1f}), {row['seconds'] / 60:.1f} min",
        flush=True,
    )


def default_out(preset: DataPreset, epochs: int) -> Path:
    """The preset's table at its own budget; another budget's beside it (``learning_digits_40ep.md``),
    so a longer run never overwrites the committed table."""
    out = Path(preset.out)
    return out if epochs == preset.epochs else out.with_name(f"{out.stem}_{epochs}ep{out.suffix}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.learning",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS), help="the data (default small)")
    parser.add_argument("--recipes", default=None, help="comma-separated tiny recipes (default: all)")
    parser.add_argument("--epochs", type=int, default=None, help=f"default {EPOCHS}; digits {DIGITS_EPOCHS}")
    parser.add_argument("--seeds", type=int, default=SEEDS, help=f"pretraining seeds per row (default {SEEDS})")
    parser.add_argument("--data", default=None, help="data root, generated if missing (default datasets/synthetic, "
                        "datasets/digits)")  # fmt: skip
    parser.add_argument("--work", default="outputs/bench_learning", help="the runs' folders")
    parser.add_argument("--runs", type=Path, default=RUNS_FILE, help="the measured runs (JSON lines, committed)")
    parser.add_argument("--out", default=None, help="default benchmarks/learning.md, learning_digits.md "
                        "(another --epochs: learning_digits_40ep.md)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="measure the rows again")
    parser.add_argument(
        "--plan", action="store_true", help="rewrite --out from the runs file and list the runs missing; train nothing"
    )
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    args.epochs = args.epochs or preset.epochs
    data, out = Path(args.data or preset.root).resolve(), Path(args.out or default_out(preset, args.epochs))
    # the synthetic runs keep their folder of before (its rows are carried into the runs file)
    work = run_folder(Path(args.work).resolve(), preset.name, args.epochs)
    if not args.plan:
        ensure_data(data, preset.name)
    if preset.name == "small" and not args.plan:  # --plan writes the table, never the runs file
        carry_legacy_rows(work, args.runs, preset.name)
    every = tiny_recipes()
    chosen = args.recipes.split(",") if args.recipes else every
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        raise SystemExit(f"error: --recipes {','.join(unknown)}: expected tiny recipes from {', '.join(every)}")
    # Seed-major: every recipe gets its first seed before any gets its second, so a table stopped
    # midway has a row for each recipe.
    hashes = {(r, s): config_hash(r, args.epochs, s, preset.overrides) for r in every for s in range(args.seeds)}

    def table() -> None:
        write_table(current_runs(read_runs(args.runs), preset.name, hashes), every, out, args)

    if args.plan:
        table()
        kept = current_runs(read_runs(args.runs), preset.name, hashes)
        for recipe in every:
            done = {r["seed"] for r in kept.get(recipe, [])}
            print(f"{recipe}: missing seeds {[s for s in range(args.seeds) if s not in done] or 'none'}")
        return

    for seed in range(args.seeds):
        for recipe in chosen:
            measure_kept(recipe, seed, args, data, work)
            table()
    table()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
