"""The whole pipeline on generated data, CPU only: what `make demo` runs.

    python tools/demo.py [--data DIR] [--preset small|tiny|digits] [--recipe tiny_simclr] [--out outputs/demo]

1. the datasets in the real layouts (skipped when already there): the synthetic shapes, or with
   ``--preset digits`` scikit-learn's real handwritten digits (``datasets/digits`` by default);
2. pretraining with ``accelerate launch -m pretrain`` on the tiny ``--recipe``;
3. a random-init backbone of the same architecture, the baseline of every row;
4. for both backbones: weighted kNN, VOC07 linear SVM, the ``bn`` linear probe, and FPN
   fine-tunes on the synthetic VOC (several seeds, backbone frozen) from its detectron2 conversion;
5. ``OUT/report.md`` with the results table (spread and budget beside each figure) and the plots.

The stages are a table (``plan``) run by one loop (``run_stages``). Every stage is one of the
project's commands run as a child process (the same commands the README gives for real data); its
output goes to ``OUT/logs/<stage>.log``. A stage whose result file exists is not run again, so a
second ``make demo`` only rebuilds the report (``--fresh`` redoes everything). A failed stage does
not stop the others: the stages that need its result are not run, every other one is, the report
is written with the failure in it, and the demo exits with status 1 naming the failed stages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks.learning import DIGITS_EPOCHS  # the learning table's digits budget, the demo's too
from contrastive_transfer.cli import atomic_write, open_append, write_text
from contrastive_transfer.json_limits import read_json, read_json_lines
from contrastive_transfer.synthetic.digits import DETECTION_OVERRIDES, PRETRAIN_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]

BACKBONES = ("pretrained", "random")
# What the detection rows can and cannot say at the demo's budget: the AP50 figures behind the
# frozen backbone and the 600 iterations (2026-11-25, small preset, AMD EPYC, 2 cores).
DETECTION_NOTE = (
    "Detection: the FPN and heads fine-tuned for {iters} iterations on the backbone's frozen features "
    "(`configs/detection/tiny_voc0712_R_18_FPN_frozen.yaml`), what the features give detection at a CPU "
    "budget; measured beforehand with tiny SimCLR (pretrained with `data.backend: torchvision`) "
    "against random init (2 seeds each): AP50 5.4 ± 0.8 vs "
    "3.1 ± 0.1 at 400 iterations, 9.5 ± 0.5 vs 4.8 ± 0.7 at 600. With the whole network fine-tuned (the "
    "MoCo paper's protocol, `tiny_voc0712_R_18_FPN_syncbn.yaml`, constant lr, 2 seeds each), a random-init "
    "backbone catches up with a 6-epoch tiny SimCLR by about 1,200 iterations (AP50 3.8 ± 0.8 vs 3.1 ± 0.2 "
    "at 300, 9.1 ± 0.7 vs 6.9 ± 1.5 at 600, 15.2 ± 1.1 vs 13.7 ± 0.9 at 900, 22.0 ± 4.0 vs 22.5 ± 0.1 at "
    "1200; `python -m benchmarks.transfer --curve`): at this scale a random backbone learns the shapes' "
    "outlines quickly, so the frozen backbone is what shows the features' gain."
)
# The digits' detection rows: what the VOC evaluator averages over.
DIGITS_NOTE = (
    "Detection: the FPN and heads fine-tuned for {iters} iterations on the backbone's frozen features "
    "(`configs/detection/tiny_voc0712_R_18_FPN_frozen.yaml`) on canvases of train-split digits, tested on "
    "canvases of val-split digits, without detectron2's horizontal flip (a mirrored digit is no digit). "
    "The detector has the data's 10 classes, the digits 0-9 (read from the "
    "VOC folder's class files), and the VOC evaluator averages AP over those 10 digits."
)
# The backbone frozen, the FPN and heads trained: what the features give detection within the demo's
# budget. With the whole network trained (the paper's protocol), random init catches up with a
# briefly pretrained backbone by about 1,200 iterations (DETECTION_NOTE).
DETECTION_CONFIG = ROOT / "configs" / "detection" / "tiny_voc0712_R_18_FPN_frozen.yaml"


@dataclass(frozen=True)
class Budget:
    """What one demo preset spends (the synthetic images are 64-224 px, so the protocols run at
    reduced sizes; the preprocessing is recorded in each metrics.json). ``pretrain``: recipe
    overrides of the data preset; ``classify_size``: (resize, crop) of kNN and the probe."""

    pretrain_epochs: int
    probe_epochs: int
    detection_iters: int
    detection_seeds: int
    svm: tuple[str, ...] = ()
    pretrain: tuple[str, ...] = ()
    detection: tuple[str, ...] = ()  # transfer.detection KEY VALUE options of the data
    classify_size: tuple[int, int] = (73, 64)
    svm_size: tuple[int, int] = (146, 128)  # resize, crop: the VOC07 SVM's warp
    data_name: str = "the synthetic `{preset}` data"


BUDGETS = {
    # Six pretraining epochs: the learning table's budget (tiny SimCLR, the default, is below its
    # init's kNN after 2 epochs and 20 points above it after 6). 600 detection iterations: the
    # frozen-backbone gain is 4.7 AP50 there (7 standard errors) and 2.3 at 400 (DETECTION_NOTE).
    "small": Budget(pretrain_epochs=6, probe_epochs=10, detection_iters=600, detection_seeds=2),
    # A smoke run of every stage (the test suite's): one pretraining epoch at 32 px, every
    # evaluation at 32 px, four detection iterations, three SVM costs.
    "tiny": Budget(
        pretrain_epochs=1,
        probe_epochs=2,
        detection_iters=4,
        detection_seeds=2,
        svm=("--costs", "0.1,1,10"),
        pretrain=("data.image_size=32",),
        classify_size=(36, 32),
        svm_size=(36, 32),
    ),
    # The real digits (40-px images, the digit placed at random): the digits augmentation at 32 px,
    # the learning table's digits budget (benchmarks/learning.py, DIGITS_EPOCHS).
    "digits": Budget(
        pretrain_epochs=DIGITS_EPOCHS,
        probe_epochs=10,
        detection_iters=600,
        detection_seeds=2,
        pretrain=PRETRAIN_OVERRIDES,
        detection=DETECTION_OVERRIDES,
        classify_size=(37, 32),
        data_name="the real handwritten digits (scikit-learn's UCI copy)",
    ),
}
# Where a preset's data and demo go by default (others: datasets/synthetic, outputs/demo): the
# digits demo beside the synthetic one, so that neither refuses the other's folder.
DEFAULT_DATA = {"digits": Path("datasets/digits")}
DEFAULT_OUT = {"digits": Path("outputs/demo_digits")}


@dataclass(frozen=True)
class Stage:
    """One step of the demo: a child command (or an in-process function) whose success leaves
    ``result`` on disk; ``needs`` names the stages whose results it reads. ``side_by_side``:
    commands run at the same time, one core each, before ``command`` (the detection seeds: two
    one-thread processes on 2 cores do twice the work of one two-thread process)."""

    name: str
    result: Path
    command: list[str] | Callable[[], None]
    needs: tuple[str, ...] = ()
    side_by_side: tuple[list[str], ...] = ()


@dataclass
class Outcome:
    failed: dict[str, str] = field(default_factory=dict)  # stage -> one line: what failed, its log
    seconds: dict[str, float] = field(default_factory=dict)


def run_side_by_side(commands: tuple[list[str], ...], log: Path, env: dict) -> str | None:
    """Run ``commands`` at once, one thread each, output to ``log.<i>``; None, or the first failure line."""
    procs = []
    for i, cmd in enumerate(commands):
        part = log.with_suffix(f".{i}.log")
        with open_append(part, fresh=True) as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            one_core = {**os.environ, **env, "OMP_NUM_THREADS": "1"}
            procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=one_core), part))
    failures = [f"exit {p.wait()}; {_why(part)} (log: {part})" for p, part in procs]
    return next((line for (p, _), line in zip(procs, failures) if p.returncode != 0), None)


def run_stage(stage: Stage, logs: Path, env: dict) -> str | None:
    """Run one stage, its output to ``logs/<name>.log``; None on success, else the failure line."""
    log = logs / f"{stage.name}.log"
    if stage.side_by_side:
        failure = run_side_by_side(stage.side_by_side, log, env)
        if failure:
            return failure
    with open_append(log, fresh=True) as f:
        if callable(stage.command):
            try:
                stage.command()
            except Exception as e:  # noqa: BLE001 - any failure of an in-process stage is its failure line
                f.write(f"{type(e).__name__}: {e}\n")
                return f"{type(e).__name__}: {e} (log: {log})"
        else:
            f.write("$ " + " ".join(stage.command) + "\n")
            f.flush()
            env = {**os.environ, **env}
            code = subprocess.call(stage.command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
            if code != 0:
                return f"exit {code}; {_why(log)} (log: {log})"
    if not finished(stage.result):
        return f"finished without writing {stage.result} (log: {log})"
    return None


def finished(result: Path) -> bool:
    """Whether a stage left its result: a regular file. A link planted there is no result (and the
    stage's own writer replaces it), where ``exists()`` would follow it and skip the stage."""
    return result.is_file() and not result.is_symlink()


def _why(log: Path) -> str:
    """The child's own one-line error (its last ``error: `` line), else its last line: a command
    started through ``accelerate launch`` ends with the launcher's traceback after our line."""
    from contrastive_transfer.untrusted import read_untrusted  # torch: imported when a file is read

    text = read_untrusted(log, "log").decode("utf-8", errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or ["(no output)"])[-1][:300]


def run_stages(stages: list[Stage], logs: Path, env: dict, fresh: bool = False) -> Outcome:
    """Run the table in order. A stage whose result exists is skipped (unless ``fresh``); a stage
    that needs a failed or skipped one is not run; every other stage runs whatever failed before."""
    logs.mkdir(parents=True, exist_ok=True)
    outcome = Outcome()
    for i, stage in enumerate(stages, 1):
        prefix = f"[{i}/{len(stages)} {stage.name}]"
        missing = [n for n in stage.needs if n in outcome.failed]
        if missing:
            outcome.failed[stage.name] = f"not run: needs {', '.join(missing)}"
            print(f"{prefix} not run: needs {', '.join(missing)}", flush=True)
            continue
        if finished(stage.result) and not fresh:
            print(f"{prefix} already done: {stage.result}", flush=True)
            continue
        start = time.time()
        failure = run_stage(stage, logs, env)
        outcome.seconds[stage.name] = time.time() - start
        if failure:
            outcome.failed[stage.name] = failure
            print(f"{prefix} FAILED: {failure}", flush=True)
        else:
            print(f"{prefix} {outcome.seconds[stage.name]:.0f} s -> {stage.result}", flush=True)
    return outcome


def failure_line(failed: dict[str, str]) -> str:
    """The failed stages with why each failed, and the stages that could not run, in one line."""
    not_run = [name for name, why in failed.items() if why.startswith("not run")]
    reasons = [f"{name}: {why}" for name, why in failed.items() if name not in not_run]
    return f"{len(failed)} stage(s) failed; " + "; ".join(
        reasons + ([f"not run: {', '.join(not_run)}"] if not_run else [])
    )


def random_init_checkpoint(arch: str, path: Path, seed: int) -> None:
    """torchvision's initialization of `arch` (a torchvision state dict: a layout every tool reads)."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = getattr(torchvision.models, arch)(weights=None)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("fc.")}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(state, f))


def _py_detection(pkl: Path, data: Path, budget: Budget) -> Callable[..., list[str]]:
    """transfer.detection on the demo's config and budget into ``out``; ``flags`` before the
    config options, ``options`` (KEY VALUE pairs) after them."""
    iters = budget.detection_iters

    def command(out: Path, flags: tuple[str, ...] = (), options: tuple[str, ...] = ()) -> list[str]:
        return [
            sys.executable, "-m", "transfer.detection", "--config-file", str(DETECTION_CONFIG), "--num-gpus", "1",
            "--data-root", str(data), *flags, "MODEL.WEIGHTS", str(pkl), "OUTPUT_DIR", str(out),
            "SOLVER.MAX_ITER", str(iters), "SOLVER.STEPS", f"({int(iters * 0.8)},)", *budget.detection, *options,
        ]  # fmt: skip

    return command


def evaluation_stages(name: str, weights: Path, needs: tuple[str, ...], paths: dict, budget: Budget) -> list[Stage]:
    """kNN, VOC07 SVM, linear probe, conversion and detection of one backbone."""
    py, d, data, imagenet = sys.executable, paths["out"] / name, paths["data"], paths["data"] / "imagenet"
    weights_arg = ["--weights", str(weights)]
    resize, crop = (str(v) for v in budget.classify_size)
    pkl = d / "detectron2.pkl"
    detect, seeds = _py_detection(pkl, data, budget), budget.detection_seeds
    # fmt: off
    return [
        Stage(f"{name}-knn", d / "knn" / "metrics.json", [
            py, "-m", "transfer.knn", *weights_arg, "--train-dir", str(imagenet / "train"),
            "--val-dir", str(imagenet / "val"), "--k", "20", "--t", "0.07", "--resize", resize, "--crop", crop,
            "--output-dir", str(d / "knn"),
        ], needs),
        Stage(f"{name}-voc07-svm", d / "voc07_svm" / "metrics.json", [
            py, "-m", "transfer.voc07_svm", *weights_arg, "--voc-root", str(data / "VOC2007"),
            "--resize", str(budget.svm_size[0]), "--crop", str(budget.svm_size[1]), *budget.svm,
            "--output-dir", str(d / "voc07_svm"),
        ], needs),
        # The bn preset: BN without affine before the fc, so one lr fits every backbone's feature
        # scale (the moco preset's lr 30 on raw features diverges on some of these backbones).
        Stage(f"{name}-linear", d / "linear" / "metrics.json", [
            py, "-m", "transfer.linear", *weights_arg, "--dataset", "imagenet", "--data-root", str(imagenet),
            "--preset", "bn", "--epochs", str(budget.probe_epochs), "--resize", resize, "--crop", crop,
            "--output-dir", str(d / "linear"),
        ], needs),
        Stage(f"{name}-convert", pkl, [py, "-m", "converters.to_detectron2", str(weights), str(pkl)], needs),
        # Each seed alone into OUTPUT_DIR/seed_<s> side by side; then --resume finds them all done
        # and writes their mean and std (transfer.detection's own aggregation).
        Stage(f"{name}-detection", d / "detection" / "metrics.json",
              detect(d / "detection", flags=("--seeds", str(seeds), "--resume")), (f"{name}-convert",),
              tuple(detect(d / "detection" / f"seed_{s}", options=("SEED", str(s))) for s in range(seeds))),
    ]
    # fmt: on


def plan(args, budget: Budget) -> list[Stage]:
    """The demo's stages in order."""
    from pretrain.config import load_config

    py, out, data = sys.executable, args.out, args.data
    recipe = ROOT / "configs" / "pretrain" / f"{args.recipe}.yaml"
    arch = load_config(recipe, [], 1).model.arch
    pretrain_dir, imagenet = out / "pretrain", data / "imagenet"
    final, random_ckpt = pretrain_dir / "checkpoint_final.pth", out / "random" / "random_init.pth"
    paths = {"out": out, "data": data}
    # fmt: off
    return [
        Stage("data", data / "manifest.json", [
            py, "-m", "contrastive_transfer.synthetic", "--out", str(data), "--preset", args.preset,
            "--seed", str(args.seed),
        ]),
        Stage("pretrain", final, [
            str(Path(py).parent / "accelerate"), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "pretrain", "--config", str(recipe),
            f"data.root={imagenet / 'train'}", f"train.output_dir={pretrain_dir}", f"train.seed={args.seed}",
            f"knn.train_dir={imagenet / 'train'}", f"knn.val_dir={imagenet / 'val'}",
            f"train.epochs={budget.pretrain_epochs}", *budget.pretrain,
        ], ("data",)),
        Stage("random-init", random_ckpt, lambda: random_init_checkpoint(arch, random_ckpt, args.seed)),
        *evaluation_stages("pretrained", final, ("pretrain",), paths, budget),
        *evaluation_stages("random", random_ckpt, ("data", "random-init"), paths, budget),
        Stage("curves", out / "plots" / "curves.png", [
            py, "-m", "pretrain.analysis", "curves", str(pretrain_dir), "--out", str(out / "plots"),
        ], ("pretrain",)),
    ]
    # fmt: on


# ------------------------------------------------------------------------------------ report
@dataclass(frozen=True)
class Figure:
    """One backbone's value of a row: mean, sample std over ``n`` runs (None for one run)."""

    mean: float
    std: float | None = None
    n: int = 1

    def __str__(self) -> str:
        return f"{self.mean:.2f}" + (f" ± {self.std:.2f}" if self.std is not None else "")


def _read(path: Path) -> dict | None:
    return read_json(path) if path.is_file() else None


def _detection(metrics: dict | None, key: str) -> Figure | None:
    if metrics is None:
        return None
    if "mean" in metrics:  # several seeds: transfer.detection's mean and sample std
        task = next(iter(metrics["mean"].values()))["bbox"]
        std = next(iter(metrics["std"].values()))["bbox"]
        return Figure(task[key], std[key], len(metrics["seeds"]))
    return Figure(next(iter(metrics["results"].values()))["bbox"][key])


def collect(out: Path) -> dict[str, dict[str, Figure | None]]:
    """{row: {backbone: Figure or None (stage failed or not run)}} from the stages' metrics.json."""
    rows: dict[str, dict[str, Figure | None]] = {}
    for b in BACKBONES:
        knn, probe = _read(out / b / "knn" / "metrics.json"), _read(out / b / "linear" / "metrics.json")
        svm = _read(out / b / "voc07_svm" / "metrics.json")
        det = _read(out / b / "detection" / "metrics.json")
        for row, value in [
            ("kNN top-1 (%)", knn and Figure(knn["top1"])),
            ("VOC07 SVM mAP (%)", svm and Figure(svm["layers"]["res5avg"]["mAP"])),
            ("linear probe top-1 (%)", probe and Figure(probe["top1"])),
            ("FPN AP50 on VOC07 test", _detection(det, "AP50")),
            ("FPN AP on VOC07 test", _detection(det, "AP")),
        ]:
            rows.setdefault(row, {})[b] = value
    return rows


def gain_line(p: Figure | None, r: Figure | None) -> str:
    """The difference, and for figures over several seeds whether it exceeds twice its standard error."""
    if p is None or r is None:
        return "—"
    text = f"{p.mean - r.mean:+.2f}"
    if p.std is not None and r.std is not None:
        se = (p.std**2 / p.n + r.std**2 / r.n) ** 0.5
        text += f" (SE {se:.2f}: {'above' if abs(p.mean - r.mean) > 2 * se else 'within'} 2 SE)"
    return text


def svm_chance(out: Path) -> str:
    """The SVM's floor on the test split, from either backbone's record: the mAP of random rankings,
    which a backbone without information scores (a random init sits near it)."""
    for b in BACKBONES:
        svm = _read(out / b / "voc07_svm" / "metrics.json")
        if svm and "chance_mAP" in svm["test"]:
            return f"; chance {svm['test']['chance_mAP']:.2f} ± {svm['test']['chance_mAP_std']:.2f} (random rankings)"
    return ""


def budgets(budget: Budget, seed: int, chance: str = "") -> dict[str, str]:
    return {
        "kNN top-1 (%)": f"k 20, τ 0.07, {budget.classify_size[1]} px center crop; deterministic",
        "VOC07 SVM mAP (%)": f"res5avg, {budget.svm_size[1]} px; deterministic{chance}",
        "linear probe top-1 (%)": f"bn preset, {budget.probe_epochs} epochs, seed {seed}",
        "FPN AP50 on VOC07 test": f"backbone frozen, {budget.detection_iters} iterations × 2 images, mean ± "
        f"std of {budget.detection_seeds} fine-tune seeds",
        "FPN AP on VOC07 test": "as AP50",
    }


def pretrain_summary(pretrain_dir: Path) -> str:
    path = pretrain_dir / "metrics.jsonl"
    rows = read_json_lines(path) if path.is_file() else []
    steps = [r for r in rows if "loss" in r]
    if not steps:
        return "no pretraining figures (the stage failed or did not run)"
    knn = [r["knn_top1"] for r in rows if "knn_top1" in r]
    # step_time excludes data; both are means over the row's window_steps (1 in rows written before)
    seconds = sum((r.get("step_time", 0.0) + r.get("data_time", 0.0)) * r.get("window_steps", 1) for r in steps)
    text = (
        f"{steps[-1]['step']} steps ({steps[-1]['epoch']:.0f} epochs, ~{seconds / 60:.1f} min of steps), "
        f"final loss {steps[-1]['loss']:.3f}"
    )
    return text + (f", kNN monitor top-1 by epoch: {', '.join(f'{v:.1f}' for v in knn)}" if knn else "")


def comparison_plot(rows: dict, path: Path, data_name: str = "synthetic data") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in rows if all(rows[n].get(b) for b in BACKBONES)]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.5))
    for offset, (b, color) in enumerate([("pretrained", "tab:blue"), ("random", "tab:gray")]):
        figs = [rows[n][b] for n in names]
        ys = [i + 0.4 * offset for i in range(len(names))]
        ax.barh(ys, [f.mean for f in figs], height=0.38, color=color, label=b,
                xerr=[f.std or 0.0 for f in figs], capsize=3)  # fmt: skip
        for y, f in zip(ys, figs):
            ax.text(f.mean + (f.std or 0.0) + 0.5, y, str(f), va="center", fontsize=9)
    ax.set_yticks([i + 0.2 for i in range(len(names))], names)
    ax.invert_yaxis()
    ax.set_xlabel("score (error bars: std over fine-tune seeds)")
    ax.set_xlim(0, 1.25 * max(rows[n][b].mean for n in names for b in BACKBONES))
    ax.set_title(f"Pretrained vs random-init backbone\n({data_name}, CPU)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def write_report(args, budget: Budget, failed: dict[str, str]) -> Path:
    """OUT/report.md from whatever the stages left: a failed stage's figures are "—"."""
    out = args.out
    rows = collect(out)
    plots = [out / "plots" / "pretrained_vs_random.png", out / "plots" / "curves.png"]
    data_name = budget.data_name.format(preset=args.preset)
    comparison_plot(rows, plots[0], "real digits" if args.preset == "digits" else "synthetic data")
    spent = budgets(budget, args.seed, svm_chance(out))
    lines = [
        f"# Demo report: {args.recipe} on {data_name} (CPU)",
        "",
        f"Pretraining: `configs/pretrain/{args.recipe}.yaml`, seed {args.seed}, {pretrain_summary(out / 'pretrain')}.",
        "",
        "| metric | pretrained | random init | difference | budget and spread |",
        "|---|---|---|---|---|",
    ]
    for name, vals in rows.items():
        p, r = vals["pretrained"], vals["random"]
        lines.append(f"| {name} | {p or '—'} | {r or '—'} | {gain_line(p, r)} | {spent[name]} |")
    lines += ["", (DIGITS_NOTE if args.preset == "digits" else DETECTION_NOTE).format(iters=budget.detection_iters), ""]
    if failed:
        lines += ["## Failed stages", ""] + [f"- `{name}`: {why}" for name, why in failed.items()] + [""]
    lines += [
        "Each figure comes from the stage's `metrics.json` under this folder (`pretrained/` and "
        "`random/`), which also records the preprocessing and settings; the commands and their full "
        "output are in `logs/`.",
        "",
    ]
    lines += [f"![{p.stem}]({p.relative_to(out)})" for p in plots if p.is_file()]
    report = out / "report.md"
    out.mkdir(parents=True, exist_ok=True)
    write_text(report, "\n".join(lines) + "\n")
    return report


def claim_output(args) -> str | None:
    """Record what OUT holds (OUT/demo.json); the reason to refuse when it holds another demo, whose
    finished stages would otherwise be taken for this one's."""
    settings = {"recipe": args.recipe, "preset": args.preset, "seed": args.seed, "data": str(args.data)}
    record = args.out / "demo.json"
    if record.is_symlink():  # the demo's own record: one planted as a link is not adopted
        return f"{record} is a symbolic link, expected this demo's own record: not read; remove it"
    if record.is_file():
        held = read_json(record)
        if held != settings:
            diff = ", ".join(f"{k} {held.get(k)} (now {v})" for k, v in settings.items() if held.get(k) != v)
            return f"{args.out} holds another demo ({diff}); pass --fresh (FRESH=1) to redo it, or another --out"
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(record, json.dumps(settings, indent=1))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="data folder (default datasets/digits; synthetic presets: datasets/synthetic)",
    )
    # The digits by default, as `make demo`: they show the gain more clearly in the same time (docs/demo.md).
    parser.add_argument("--preset", default="digits", choices=sorted(BUDGETS), help="data preset (and its budget)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", default="tiny_simclr", help="a tiny recipe: configs/pretrain/<recipe>.yaml")
    parser.add_argument(
        "--out",
        "--output-dir",
        type=Path,
        default=None,
        help="output folder (default outputs/demo, outputs/demo_digits)",
    )
    parser.add_argument("--fresh", action="store_true", help="redo every stage")
    args = parser.parse_args(argv)

    recipe = ROOT / "configs" / "pretrain" / f"{args.recipe}.yaml"
    if not (args.recipe.startswith("tiny_") and recipe.is_file()):
        names = sorted(p.stem for p in recipe.parent.glob("tiny_*.yaml"))
        print(f"error: RECIPE={args.recipe}: expected a tiny recipe of configs/pretrain: {', '.join(names)}")
        return 2
    args.data = args.data or DEFAULT_DATA.get(args.preset, Path("datasets/synthetic"))
    args.out = args.out or DEFAULT_OUT.get(args.preset, Path("outputs/demo"))
    args.data, args.out = args.data.resolve(), args.out.resolve()
    if args.fresh and args.out.exists():
        shutil.rmtree(args.out)
    stale = claim_output(args)
    if stale:
        print(f"error: {stale}", file=sys.stderr)
        return 2
    budget = BUDGETS[args.preset]
    # One stage at a time uses all cores; passive OpenMP waiting keeps idle threads from spinning.
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
    }
    outcome = run_stages(plan(args, budget), args.out / "logs", env, args.fresh)
    report = write_report(args, budget, outcome.failed)
    print(f"\nreport: {report}")
    if outcome.failed:
        print(f"error: {failure_line(outcome.failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
