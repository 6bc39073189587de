"""Each seed paper's headline claim in miniature, on the real handwritten digits, under one protocol.

    python -m benchmarks.claims [--claims adco,eqco,moco,simco,dcl] [--seeds 0,1,2] [--extra-seeds 3,4]
                                [--plan] [--fresh]

One protocol for every run: a tiny recipe (ResNet-18, LARS, batch 16 unless the claim varies it)
with the digits overrides of ``benchmarks/learning.py --preset digits`` (``digits`` augmentation,
32 px), 20 epochs unless the claim varies them, then kNN top-1 (k 20) on the digits' val split and
the ``bn`` linear probe, beside torchvision's random init of the same seed. A claim is a set of
configurations (``Arm``: a recipe, its overrides, its epochs) and of comparisons between them; a
comparison's effect is computed per seed (runs of the same seed paired), and its verdict from the
mean and standard error of those effects (``verdict``). Nothing is tuned per claim: every override is
the variable the paper's claim is about.

Every measured run is one JSON line of ``benchmarks/claims_runs.jsonl`` (committed), keyed like
``benchmarks/learning.py``'s by (preset, recipe, seed, config hash): a run with a line there is never
measured again, on any machine; its folder under --work is named by that hash, so an interrupted run
resumes there and a changed configuration starts in a fresh one. A configuration shared by claims
(tiny MoCo v2 itself) is measured once, and one the digits learning table measured (a tiny recipe
at its 20-epoch budget: the same experiment, so the same key) is read from
``benchmarks/learning_runs.jsonl``. Each run rewrites --out and its PNG from every line measured
so far, listing the runs still missing. SIGTERM stops the run in progress (no orphaned child) and
keeps every line written.

Order: the claims run cheapest first, seed-major within a claim (every configuration gets seed 0
before any gets seed 1). After the base seeds, a comparison whose mean effect is smaller than its
seeds' spread (|mean| < std) gets the extra seeds, as the issue asks (5 seeds where the effect is
smaller than the spread).

Budget (measured 2026-11-25 on the 2 shared AMD EPYC cores, load average about 4, one thread): tiny
MoCo v2 at batch 16 took 0.43 s a step (5 epochs, 390 steps: 2.8 min of pretraining), against 0.13 s
when the machine was quiet (``benchmarks/learning.py``'s pilot); SimCLR at batch 256 took 16 ms an
image against 27 ms at batch 16, so the large-batch arms cost about 0.6 of a batch-16 run. Per seed
the grid is 30 configurations, about 24 batch-16 20-epoch runs' worth; at 3.5-4 min of pretraining
plus about a minute of kNN and probe on two quiet cores, about 2 h a seed: about 6 h for 3 seeds,
and the extra seeds of undecided effects come on top (2 runs per configuration involved). Under the
load above, about 2.5 times that: run it over several sessions, the runs file carries the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import signal
import statistics
from pathlib import Path

from benchmarks import cell, cpu_name, mean_std
from benchmarks.learning import (
    DIGITS_EPOCHS,
    KNN_K,
    PROBE_PRESET,
    _exit_on_signal,
    _key,
    append_run,
    config_hash,
    ensure_data,
    measure,
    read_runs,
)
from benchmarks.learning import (
    RUNS_FILE as LEARNING_RUNS,
)
from contrastive_transfer.cli import atomic_write, write_text
from contrastive_transfer.synthetic.digits import PRETRAIN_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
RUNS_FILE = ROOT / "benchmarks" / "claims_runs.jsonl"
OUT = ROOT / "benchmarks" / "claims.md"
PRESET = "digits"
SEEDS = (0, 1, 2)
EXTRA_SEEDS = (3, 4)
MIN_SEEDS = 3  # a verdict needs this many paired seeds


@dataclasses.dataclass(frozen=True)
class Arm:
    """One configuration of a claim: a tiny recipe, the overrides the claim varies, its epochs."""

    label: str
    recipe: str
    overrides: tuple[str, ...] = ()
    epochs: int = DIGITS_EPOCHS

    def extra(self) -> tuple[str, ...]:
        return (*PRETRAIN_OVERRIDES, *self.overrides)

    def hash(self, seed: int) -> str:
        return config_hash(self.recipe, self.epochs, seed, self.extra())


@dataclasses.dataclass(frozen=True)
class Comparison:
    """effect = sum of ``plus`` arms − sum of ``minus`` arms (kNN top-1), per seed. ``direction``:
    "greater" (the paper: the effect is positive) or "not_below" (the paper: it matches or beats)."""

    label: str
    plus: tuple[Arm, ...]
    minus: tuple[Arm, ...]
    direction: str
    paper: str  # the paper's figure for this effect


@dataclasses.dataclass(frozen=True)
class Claim:
    name: str
    title: str
    paper: str  # the paper's direction and magnitude, quoted with its table (markdown)
    departs: str  # where the miniature departs from the paper
    arms: tuple[Arm, ...]
    comparisons: tuple[Comparison, ...]  # the first is the claim's headline

    def cost(self) -> int:
        """Epochs of pretraining per seed, the claims' running order."""
        return sum(arm.epochs for arm in self.arms)


def _mocov2(label: str, *overrides: str, epochs: int = DIGITS_EPOCHS) -> Arm:
    return Arm(label, "tiny_mocov2", overrides, epochs)


HOST = _mocov2("MoCo v2 (queue 256, m 0.9)")  # tiny MoCo v2 itself, shared by four claims


def _eqco() -> Claim:
    info16, info64 = (_mocov2(f"InfoNCE, K {k}", f"method.num_negatives={k}") for k in (16, 64))
    eq16, eq64 = (_mocov2(f"EqCo, K {k}", f"method.num_negatives={k}", "method.loss.eqco_alpha=256") for k in (16, 64))
    simo = Arm("SiMo (K = batch − 1 = 15, α 256)", "tiny_simo")
    return Claim(
        "eqco",
        "EqCo: accuracy as the negatives shrink",
        "EqCo (Zhu et al.) scales InfoNCE's margin by τ·log(α/K) so that the loss's optimum does not depend "
        'on K: with it, MoCo v2 trains with "16 negative pairs per query" instead of 65,536 "with almost '
        'no accuracy drop"; SiMo (a SimCLR-like host with EqCo, K = batch − 1) "achieves comparable '
        'accuracy with MoCo v2". Its per-K comparison of plain InfoNCE and EqCo is a plot (Figure 2, '
        'α 65,536 on MoCo v2; its points are not in the text): "without EqCo the accuracy significantly drops if K '
        'becomes very small (e.g. K < 64)", while with EqCo "the performance surprisingly keeps steady under a '
        'wide range of Ks". Its SiMo α sweep (Table 5, linear top-1 %): α 256 68.0, 1024 68.1, 4096 68.1, '
        "16384 68.4, 65536 68.5, 262144 68.3. Table 2 (R-50, 200 epochs, 256 queries per batch): SiMo "
        "(K 16, α 256) 68.1 vs MoCo v2 67.5.",
        "K is drawn per query from tiny MoCo v2's 256-key queue (α = 256, not 65,536); the K = 256 cell is "
        "the whole queue, where EqCo's margin is 0 and EqCo is InfoNCE (one run, MoCo v2 itself).",
        (HOST, info64, eq64, info16, eq16, simo),
        (
            Comparison("EqCo − InfoNCE at K 16", (eq16,), (info16,), "greater", "positive (InfoNCE falls, EqCo flat)"),
            Comparison("EqCo − InfoNCE at K 64", (eq64,), (info64,), "greater", "positive, smaller than at 16"),
            Comparison("EqCo K 16 − full queue K 256", (eq16,), (HOST,), "not_below", '≈ 0 ("almost no drop")'),
            Comparison("SiMo − MoCo v2", (simo,), (HOST,), "not_below", "+0.6 (68.1 vs 67.5)"),
        ),
    )


def _batch(recipe: str, label: str, batch: int) -> Arm:
    return Arm(f"{label}, batch {batch}", recipe, () if batch == 16 else (f"train.batch_size={batch}",))


def _dcl() -> Claim:
    small, large = 16, 256
    arms = {(r, b): _batch(f"tiny_{r}", r.upper() if r != "simclr" else "SimCLR", b) for b in (16, 64, 256)
            for r in ("simclr", "dcl", "dclw")}  # fmt: skip

    def gap(method: str, batch: int) -> tuple[tuple[Arm, ...], tuple[Arm, ...]]:
        return (arms[method, batch],), (arms["simclr", batch],)

    def grows(method: str) -> Comparison:
        plus = (arms[method, small], arms["simclr", large])
        minus = (arms["simclr", small], arms[method, large])
        return Comparison(
            f"({method.upper()} − SimCLR) at batch {small} − at batch {large}", plus, minus, "greater",
            "IN-100: +6.6 at 32 vs +2.4 at 256 → +4.2; STL10 kNN: +7.9 vs +0.5 → +7.4",
        )  # fmt: skip

    return Claim(
        "dcl",
        "DCL: robustness to small batches",
        "DCL (Yeh et al.) removes the positive pair from InfoNCE's denominator, so the negative-positive "
        'coupling no longer depends on the batch size: "the performance of DCL keeps steadier than the SimCLR '
        'baseline while the batch size is varied". Its ImageNet sweep (Figure 3, from batch 1024 down): "SimCLR: -4.1% '
        'vs. -8.3%" (with DCL vs without); at batch 256 SimCLR 61.8 %, with DCL 65.9 %; 66.9 % at batch 256 / '
        "200 epochs in the abstract. Table 1 (ResNet-18, 200 "
        "epochs):\n\n"
        "| batch | 32 | 64 | 128 | 256 | 512 |\n|---|---|---|---|---|---|\n"
        "| ImageNet-100 linear, SimCLR | 74.2 | 77.6 | 79.3 | 80.7 | 81.3 |\n"
        "| ImageNet-100 linear, SimCLR w/ DCL | 80.8 | 82.0 | 81.9 | 83.1 | 82.8 |\n"
        "| STL10 kNN, SimCLR | 74.1 | 77.6 | 79.3 | 80.7 | 81.3 |\n"
        "| STL10 kNN, SimCLR w/ DCL | 82.0 | 82.8 | 81.8 | 81.2 | 81.0 |\n\n"
        "DCLW (DCL with positives weighted by a von Mises-Fisher term) has no batch sweep in the text.",
        "Batches 16, 64, 256 (the tiny recipes' 16 and 16×; 1,258 images give 78 steps an epoch at 16 and "
        "4 at 256), each at the same 20 epochs with the recipes' linear learning-rate scaling (lr 0.3 at "
        "batch 16). The paper's sweep starts at 32.",
        tuple(arms[r, b] for b in (16, 64, 256) for r in ("simclr", "dcl", "dclw")),
        (
            grows("dcl"),
            Comparison(f"DCL − SimCLR at batch {small}", *gap("dcl", small), "greater", "+6.6 at 32 (IN-100)"),
            grows("dclw"),
            Comparison(f"DCLW − SimCLR at batch {small}", *gap("dclw", small), "greater", "(no figure)"),
        ),
    )


def _simco() -> Claim:
    batches = (16, 64)
    arms = {(r, b): _batch(f"tiny_{r}", name, b) for b in batches
            for r, name in (("mocov2", "MoCo v2"), ("simmoco", "SimMoCo"), ("simco", "SimCo"))}  # fmt: skip
    arms["mocov2", 16] = HOST  # tiny MoCo v2 itself
    paper = {"simco": "+5.5 at 64, +3.9 at 128", "simmoco": "+1.4 at 64, +0.5 at 128"}
    return Claim(
        "simco",
        "SimCo / SimMoCo: no queue, no momentum encoder",
        "The dual temperature (Zhang et al.) lets MoCo v2 drop its queue (SimMoCo) and also its momentum "
        "encoder (SimCo), matching or beating MoCo v2. The official repository's table (CIFAR-100, "
        "ResNet-18, 200 epochs, online linear top-1, τ 0.1, dt_m 10):\n\n"
        "| batch | 64 | 128 | 256 | 512 | 1024 |\n|---|---|---|---|---|---|\n"
        "| MoCo v2 | 52.58 | 54.40 | 53.28 | 51.47 | 48.90 |\n"
        "| SimMoCo | 54.02 | 54.93 | 54.11 | 52.45 | 49.70 |\n"
        "| SimCo | 58.04 | 58.29 | 58.35 | 57.08 | 55.34 |\n\n"
        "SimCo 3.9 to 6.4 points above MoCo v2 at every batch, SimMoCo 0.5 to 1.4 (the settings: the "
        "repository's `bash_files`, solo-learn's online linear classifier).",
        "Batches 16 (the tiny recipes themselves) and 64, below the table's smallest (64: at 16 the digits give "
        "78 steps an epoch, at 256 only 4); each recipe's own tiny settings (MoCo v2's 256-key queue and m 0.9; "
        "SimMoCo's and SimCo's B − 1 in-batch negatives), 20 epochs, kNN rather than online linear.",
        tuple(arms[r, b] for b in batches for r in ("mocov2", "simmoco", "simco")),
        tuple(
            Comparison(f"{name} − MoCo v2 at batch {b}", (arms[r, b],), (arms["mocov2", b],), "greater", paper[r])
            for r, name in (("simco", "SimCo"), ("simmoco", "SimMoCo"))
            for b in batches
        ),  # fmt: skip
    )


def _adco() -> Claim:
    epochs = (5, 10, 20)
    moco = {e: _mocov2(f"MoCo v2 (queue 256), {e} epochs", epochs=e) for e in epochs[:-1]} | {20: HOST}
    adco = {e: Arm(f"AdCo (bank 256), {e} epochs", "tiny_adco", ("method.bank_size=256",), e) for e in epochs}
    paper = {5: "≈ +5 (at 10 of 200 epochs: 44.4 vs ≈ 39.4)", 10: "positive", 20: "≈ 0 to +1 (200 ep: 68.6 vs 67.5)"}
    return Claim(
        "adco",
        "AdCo: fewer epochs",
        'AdCo (Hu et al.) learns its negatives as adversaries: "with merely 10 epochs of pretraining, the AdCo '
        "has a top-1 accuracy of 44.4 %, which is almost 5 % higher than that of the MoCo v2 pretrained over the "
        'same number of epochs"; with more epochs AdCo reaches MoCo v2\'s accuracy "with about 30∼50 fewer '
        'epochs" (Figure 1, both with K = 65,536 negatives; R-50 ImageNet linear). At 200 epochs (Table 1): '
        "AdCo 68.6, MoCo v2 67.5.",
        "20, 10 and 5 epochs, each a full run with its own schedule (warm-up and cosine decay); AdCo's bank "
        "set to 256 vectors to match MoCo v2's 256-key queue (the tiny AdCo recipe has 32); both with the tiny "
        "recipes' momentum 0.9, as the paper gives both MoCo v2's 0.999 (runs before 2026-11-26 had AdCo at "
        "0.99 and are not shown).",
        tuple(arm for e in epochs for arm in (moco[e], adco[e])),
        tuple(
            Comparison(
                f"AdCo − MoCo v2 at {e} epochs", (adco[e],), (moco[e],), "greater" if e < 20 else "not_below", paper[e]
            )
            for e in epochs
        ),  # fmt: skip
    )


def _moco() -> Claim:
    queue = {k: _mocov2(f"MoCo v2, queue {k}", f"method.queue_size={k}") for k in (16, 64)}
    momentum = {m: _mocov2(f"MoCo v2, m {m:g}", f"method.momentum={m}") for m in (0.0, 0.99, 0.999)}
    return Claim(
        "moco",
        "MoCo: queue size and momentum",
        'MoCo (He et al.): "good features can be learned by a large dictionary that covers a rich set of negative '
        'samples, while the encoder for the dictionary keys is kept as consistent as possible"; copying the '
        'query encoder into the key encoder at every step (m = 0) "yields poor results", it fails to train, '
        "and m 0.99-0.999 work (the paper's momentum ablation, §4.1, ResNet-50 ImageNet linear top-1 as it is "
        "usually cited: m 0 fails, 0.9 55.2, 0.99 57.8, 0.999 59.0, 0.9999 58.9; not checked against the paper's "
        "text, which the project's copy, notes on the paper, lacks). On the queue, DCL's "
        "Figure 3 reports MoCo losing 5.9 points when its queue shrinks from 65,536 to 256 (54.7 % at 256); "
        "EqCo's Table 6 reports MoCo v2 flat over K: 256 67.0, 1024 67.1, 4096 67.6, 16384 67.3, 65536 67.5.",
        "Queues 16, 64 and 256 keys (batch 16; 1,258 training images, so the 256-key queue already holds a "
        "fifth of the data) and momenta 0, 0.9 (the tiny recipe's), 0.99, 0.999 over 1,580 steps: at 0.999 the "
        "key encoder's time constant is 1,000 steps, most of the run.",
        (queue[16], queue[64], HOST, momentum[0.0], momentum[0.99], momentum[0.999]),
        (
            Comparison("queue 256 − queue 16", (HOST,), (queue[16],), "greater", "positive (−5.9 from 65,536 to 256)"),
            Comparison("queue 256 − queue 64", (HOST,), (queue[64],), "greater", "positive"),
            Comparison("m 0.99 − m 0", (momentum[0.99],), (momentum[0.0],), "greater", "large (m 0 fails)"),
            Comparison("m 0.999 − m 0", (momentum[0.999],), (momentum[0.0],), "greater", "large (59.0 vs fails)"),
            Comparison("m 0.9 − m 0", (HOST,), (momentum[0.0],), "greater", "large (55.2 vs fails)"),
        ),
    )


def claims() -> dict[str, Claim]:
    """Every claim, cheapest first (the running order)."""
    every = [_adco(), _eqco(), _moco(), _simco(), _dcl()]
    return {c.name: c for c in sorted(every, key=Claim.cost)}


# --- verdicts -------------------------------------------------------------------------------------


def verdict(effects: list[float], direction: str) -> str:
    """The verdict on per-seed effects (kNN points): within 2 standard errors of 0 is *not at this
    scale*; beyond, *reproduced* when on the paper's side, *opposite* when not. A "not_below" claim
    (the paper: matches or beats) is reproduced unless the effect is significantly negative."""
    if len(effects) < MIN_SEEDS:
        return f"pending ({len(effects)} of {MIN_SEEDS} seeds)"
    mean, std = mean_std(effects)
    significant = abs(mean) > 2 * (std or 0.0) / math.sqrt(len(effects))
    if direction == "not_below":
        return "opposite" if significant and mean < 0 else "reproduced"
    if not significant:
        return "not at this scale"
    return "reproduced" if mean > 0 else "opposite"


def needs_more_seeds(effects: list[float]) -> bool:
    """The effect is smaller than its seeds' spread: 3 seeds cannot place it."""
    if len(effects) < MIN_SEEDS:
        return False
    mean, std = mean_std(effects)
    return abs(mean) < (std or 0.0)


def latest(rows: list[dict]) -> dict[tuple, dict]:
    """{(preset, recipe, seed, config hash): the last line of that run}."""
    return {_key(r): r for r in rows}


def arm_runs(arm: Arm, seeds: list[int], kept: dict[tuple, dict], hashes: dict) -> dict[int, dict]:
    """{seed: the arm's measured run} for the seeds measured at the arm's current config."""
    out = {}
    for seed in seeds:
        row = kept.get((PRESET, arm.recipe, seed, hashes[arm, seed]))
        if row is not None:
            out[seed] = row
    return out


def effects(comp: Comparison, seeds: list[int], kept: dict[tuple, dict], hashes: dict) -> dict[int, float]:
    """{seed: effect} over the seeds where every arm of the comparison is measured (paired by seed)."""
    runs = [arm_runs(a, seeds, kept, hashes) for a in (*comp.plus, *comp.minus)]
    both = [s for s in seeds if all(s in r for r in runs)]
    n = len(comp.plus)
    return {s: sum(r[s]["knn_top1"] for r in runs[:n]) - sum(r[s]["knn_top1"] for r in runs[n:]) for s in both}


# --- the document ---------------------------------------------------------------------------------


def _arm_line(arm: Arm, runs: dict[int, dict], required: list[int]) -> str:
    if not runs:
        return f"| {arm.label} | `{arm.recipe}` | {_overrides(arm)} | {arm.epochs} | not measured yet |" + " |" * 5
    rows = list(runs.values())
    knn = [r["knn_top1"] for r in rows]
    gain = [r["knn_top1"] - r["random_knn_top1"] for r in rows]
    missing = [s for s in required if s not in runs]
    cells = [
        arm.label,
        f"`{arm.recipe}`",
        _overrides(arm),
        str(arm.epochs),
        ", ".join(map(str, runs)) + (f" (missing {', '.join(map(str, missing))})" if missing else ""),
        cell(knn),
        cell(gain, signed=True),
        cell([r["linear_top1"] for r in rows]),
        f"{statistics.fmean(r['seconds'] for r in rows) / 60:.1f}",
        f"`{arm.hash(0)}`",
    ]
    return "| " + " | ".join(cells) + " |"


def _overrides(arm: Arm) -> str:
    return ", ".join(f"`{o}`" for o in arm.overrides) or "-"


def _effect_line(comp: Comparison, found: dict[int, float]) -> str:
    values = list(found.values())
    if not values:
        return f"| {comp.label} | {comp.paper} | not measured yet | | | pending (0 of {MIN_SEEDS} seeds) |"
    mean, std = mean_std(values)
    se = f"{2 * std / math.sqrt(len(values)):.1f}" if std is not None else "-"
    each = ", ".join(f"{v:+.1f}" for v in values)
    shown = cell(values, signed=True)
    return f"| {comp.label} | {comp.paper} | {shown} | {se} | {each} | {verdict(values, comp.direction)} |"


def claim_section(
    claim: Claim, seeds: list[int], kept: dict[tuple, dict], hashes: dict, required: list[int] | None = None
) -> list[str]:
    """The claim's section; ``required``: the base seeds, whose absence is listed (default ``seeds``)."""
    found = [effects(c, seeds, kept, hashes) for c in claim.comparisons]
    headline = verdict(list(found[0].values()), claim.comparisons[0].direction)
    lines = [
        f"## {claim.title}: {headline}",
        "",
        f"**The paper.** {claim.paper}",
        "",
        f"**The miniature departs** in: {claim.departs}",
        "",
        "| configuration | recipe | overrides | epochs | seeds | kNN top-1 | gain over random | probe top-1 | min | "
        "config (seed 0) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_arm_line(a, arm_runs(a, seeds, kept, hashes), required or seeds) for a in claim.arms),
        "",
        "| effect (kNN points) | paper | miniature, mean ± std | 2 SE | per seed | verdict |",
        "|---|---|---|---|---|---|",
        *(_effect_line(c, f) for c, f in zip(claim.comparisons, found)),
        "",
    ]
    return lines


def summary(every: dict[str, Claim], seeds: list[int], kept: dict[tuple, dict], hashes: dict) -> list[str]:
    lines = ["| claim | headline effect | miniature | verdict |", "|---|---|---|---|"]
    for claim in every.values():
        comp = claim.comparisons[0]
        values = list(effects(comp, seeds, kept, hashes).values())
        shown = cell(values, signed=True) + f" (n {len(values)})" if values else "not measured yet"
        lines.append(f"| [{claim.name}](#{_anchor(claim, seeds, kept, hashes)}) | {comp.label} | {shown} | "
                     f"{verdict(values, comp.direction)} |")  # fmt: skip
    return lines


def _anchor(claim: Claim, seeds, kept, hashes) -> str:
    title = claim_section(claim, seeds, kept, hashes)[0][3:].lower()
    return "".join(ch for ch in title.replace(" ", "-") if ch.isalnum() or ch in "-_")


def missing_runs(every: dict[str, Claim], seeds: list[int], kept: dict[tuple, dict], hashes: dict) -> list[str]:
    arms = dict.fromkeys(a for c in every.values() for a in c.arms)
    out = []
    for arm in arms:
        gone = [s for s in seeds if (PRESET, arm.recipe, s, hashes[arm, s]) not in kept]
        if gone:
            out.append(f"{arm.label} (`{arm.recipe}` {_overrides(arm)}, {arm.epochs} epochs): seeds "
                       f"{', '.join(map(str, gone))}")  # fmt: skip
    return out


def undecided_arms(claim: Claim, seeds: list[int], kept: dict[tuple, dict], hashes: dict) -> list[Arm]:
    """The arms of the claim's comparisons whose effect over ``seeds`` is smaller than its spread."""
    undecided = [c for c in claim.comparisons if needs_more_seeds(list(effects(c, seeds, kept, hashes).values()))]
    return list(dict.fromkeys(a for c in undecided for a in (*c.plus, *c.minus)))


def owed_extra_runs(every: dict[str, Claim], required: list[int], seeds: list[int], kept, hashes) -> list[str]:
    """The extra seeds' runs owed to comparisons whose effect over the required seeds is smaller
    than its spread (what ``run_claim`` measures after the base seeds)."""
    extra = [s for s in seeds if s not in required]
    out = []
    for claim in every.values():
        for arm in undecided_arms(claim, required, kept, hashes):
            gone = [s for s in extra if (PRESET, arm.recipe, s, hashes[arm, s]) not in kept]
            if gone:
                out.append(f"{arm.label} (`{arm.recipe}` {_overrides(arm)}, {arm.epochs} epochs; {claim.name}: an "
                           f"effect within its spread): seeds {', '.join(map(str, gone))}")  # fmt: skip
    return list(dict.fromkeys(out))


def write_document(
    every: dict[str, Claim], seeds: list[int], rows: list[dict], out: Path, required: list[int] | None = None
) -> None:
    """benchmarks/claims.md and its PNG from every run measured so far (``rows``) of ``seeds``; the runs
    missing among the ``required`` seeds (default all of ``seeds``; the extra seeds are optional) are listed."""
    required = required or seeds
    hashes = plan_hashes(every, seeds)
    kept = latest(rows)
    # the runs of the planned configurations (lines of an older config stay in the file, unshown)
    measured = [kept[k] for k in ((PRESET, a.recipe, s, h) for (a, s), h in hashes.items()) if k in kept]
    measured = list({id(r): r for r in measured}.values())  # an arm shared by two claims: one run
    machines = sorted({r.get("machine", "?") for r in measured}) or [f"{cpu_name()}, {os.cpu_count()} cores"]
    minutes = sum(r["seconds"] for r in measured) / 60
    missing = missing_runs(every, required, kept, hashes) + owed_extra_runs(every, required, seeds, kept, hashes)
    lines = [
        "# Each paper's headline claim in miniature, on the real digits",
        "",
        "`python -m benchmarks.claims`: every run is a tiny recipe pretrained on scikit-learn's UCI handwritten "
        "digits (1,258 training images, `--preset digits`, 32 px, the `digits` augmentation) for 20 epochs "
        "unless the claim varies the epochs, batch 16 unless it varies the batch, then kNN top-1 "
        f"(k {KNN_K}) on the 539 val digits and the `{PROBE_PRESET}` linear probe, beside torchvision's random "
        "init of the same seed. The only overrides are the variables each claim is about. An effect is a "
        "difference of kNN top-1 between configurations, computed per seed (the runs of one seed paired) and "
        "reported as mean ± sample std over seeds; its verdict: *not at this scale* when the mean lies within "
        "2 standard errors (2 SE = 2·std/√n) of 0, otherwise *reproduced* or *opposite* by its sign against "
        'the paper\'s. Where the paper claims a match ("not below"), the verdict is *reproduced* unless the '
        f"effect is significantly negative. A verdict needs {MIN_SEEDS} seeds; an effect smaller than its "
        "seeds' spread gets 2 more.",
        "",
        f"Budget: runs measured so far {len(measured)}, {minutes / 60:.1f} h of pretraining; the whole grid is "
        f"{len(dict.fromkeys(a for c in every.values() for a in c.arms))} configurations × {len(required)} "
        "seeds (more where an effect is within its spread). "
        f"Machine: {'; '.join(machines)}, one thread per run, often two runs or another job on the "
        "cores (`min`: minutes of pretraining per run, slower when the machine was shared; the kNN figures do "
        "not depend on it).",
        "",
        "The paper figures are ImageNet-scale (ResNet-50, 200 epochs, 65,536 negatives) or CIFAR/STL-scale; the "
        "miniature is a ResNet-18 on 1,258 8×8 digits upscaled into 40-px images for 20 epochs, on one CPU "
        "core. A *not at this scale* says the miniature cannot tell; it does not refute the paper.",
        "",
        *summary(every, seeds, kept, hashes),
        "",
        f"![kNN top-1 of every configuration, by claim]({out.with_suffix('.png').name})",
        "",
    ]
    for claim in every.values():
        lines += claim_section(claim, seeds, kept, hashes, required)
    lines += ["## Not measured yet", ""]
    lines += [f"- {m}" for m in missing] or ["Every planned run is measured."]
    # atomic: a benchmark stopped while writing leaves the previous document, not half of one
    write_text(out, "\n".join(lines) + "\n")
    _chart(every, seeds, kept, hashes, out.with_suffix(".png"))


def _chart(every: dict[str, Claim], seeds, kept, hashes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(every), figsize=(4.2 * len(every), 4.2), squeeze=False)
    for ax, claim in zip(axes[0], every.values()):
        stats = []
        for arm in claim.arms:
            knn = [r["knn_top1"] for r in arm_runs(arm, seeds, kept, hashes).values()]
            stats.append(mean_std(knn) if knn else (0.0, None))
        x = range(len(claim.arms))
        ax.bar(list(x), [m for m, _ in stats], yerr=[s or 0 for _, s in stats], color="tab:blue")
        ax.set_xticks(list(x), [a.label.replace(", ", "\n", 1) for a in claim.arms], rotation=60, ha="right",
                      fontsize=7)  # fmt: skip
        randoms = [r["random_knn_top1"] for a in claim.arms for r in arm_runs(a, seeds, kept, hashes).values()]
        if randoms:  # the same random inits for every arm of a seed
            ax.axhline(statistics.fmean(randoms), color="grey", linestyle="--", label="random init")
            ax.legend(fontsize=7, loc="upper right")
        ax.set_ylim(0, 100)
        ax.set_title(claim.title.split(":")[0], fontsize=10)
        ax.set_ylabel("kNN top-1 (%), mean ± std over seeds")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


# --- running --------------------------------------------------------------------------------------


def plan_hashes(every: dict[str, Claim], seeds: list[int]) -> dict[tuple[Arm, int], str]:
    """{(arm, seed): config hash} of every planned run: each resolves through load_config (and the
    method's own checks) here, before anything trains."""
    arms = dict.fromkeys(a for c in every.values() for a in c.arms)
    return {(a, s): a.hash(s) for a in arms for s in seeds}


def known_runs(args) -> list[dict]:
    """The claims' runs, then the digits learning table's: a claim's configuration that is a tiny
    recipe at its table budget (MoCo v2, SimCLR, DCL, ... at batch 16) is the same experiment, with
    the same key, and is not measured twice (the claims' own line wins)."""
    learning = [r for r in read_runs(args.learning_runs) if r.get("preset") == PRESET]
    return [*learning, *read_runs(args.runs)]


def run_dir(work: Path, arm: Arm, seed: int) -> Path:
    return work / "runs" / f"{arm.recipe}-{arm.hash(seed)}"


def measure_kept(arm: Arm, seed: int, args, data: Path, work: Path) -> bool:
    """Measure (arm, seed) unless the runs file has it at its current config (or --fresh); True if measured."""
    current = arm.hash(seed)
    done = getattr(args, "done", set())  # measured by this invocation: an arm shared by claims, once
    if (arm.recipe, seed, current) in done or (
        not args.fresh and (PRESET, arm.recipe, seed, current) in latest(known_runs(args))
    ):
        return False
    args.done = done | {(arm.recipe, seed, current)}
    run = run_dir(work, arm, seed)
    if args.fresh and run.exists():
        shutil.rmtree(run)
    print(f"{arm.label} seed {seed}: pretraining {arm.epochs} epochs in {run} ...", flush=True)
    row = measure(arm.recipe, arm.epochs, seed, data, work, False, arm.extra(), run=run)
    append_run(args.runs, {"preset": PRESET, "arm": arm.label, "overrides": list(arm.overrides), **row})
    print(f"{arm.label} seed {seed}: kNN {row['knn_top1']:.1f} (random {row['random_knn_top1']:.1f}), "
          f"{row['seconds'] / 60:.1f} min", flush=True)  # fmt: skip
    return True


def run_claim(claim: Claim, args, data: Path, work: Path, write) -> None:
    """The base seeds, seed-major; then the extra seeds for the arms of comparisons that need them."""
    for seed in args.seeds:
        for arm in claim.arms:
            if measure_kept(arm, seed, args, data, work):
                write()
    hashes = plan_hashes({claim.name: claim}, [*args.seeds, *args.extra_seeds])
    kept = latest(known_runs(args))
    arms = undecided_arms(claim, args.seeds, kept, hashes)
    for seed in args.extra_seeds:
        for arm in arms:
            if measure_kept(arm, seed, args, data, work):
                write()


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"error: seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.claims",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    every = claims()
    parser.add_argument("--claims", default=",".join(every), help=f"comma-separated, of {', '.join(every)}")
    parser.add_argument("--seeds", default="0,1,2", help="the base seeds of every configuration (default 0,1,2)")
    parser.add_argument("--extra-seeds", default="3,4", help="for effects smaller than their spread ('' for none)")
    parser.add_argument("--data", default="datasets/digits", help="the digits' root, generated if missing")
    parser.add_argument("--work", default="outputs/bench_claims", help="the runs' folders")
    parser.add_argument("--runs", type=Path, default=RUNS_FILE, help="the measured runs (JSON lines, committed)")
    parser.add_argument(
        "--learning-runs", type=Path, default=LEARNING_RUNS, help="runs of benchmarks/learning.py, reused where equal"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--plan", action="store_true", help="list the planned runs, rewrite --out from the runs file; train nothing"
    )
    parser.add_argument("--fresh", action="store_true", help="measure the chosen runs again")
    args = parser.parse_args(argv)
    chosen = [c for c in args.claims.split(",") if c]
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        raise SystemExit(f"error: --claims {','.join(unknown)}: expected claims from {', '.join(every)}")
    args.seeds, args.extra_seeds = _seeds(args.seeds), _seeds(args.extra_seeds)
    all_seeds = sorted({*args.seeds, *args.extra_seeds})

    def write() -> None:
        write_document(every, all_seeds, known_runs(args), args.out, args.seeds)

    if args.plan:
        write()
        kept = latest(known_runs(args))
        for name in chosen:
            for arm in every[name].arms:
                done = [s for s in args.seeds if (PRESET, arm.recipe, s, arm.hash(s)) in kept]
                print(f"{name}: {arm.label} ({arm.epochs} epochs): measured seeds {done or 'none'} of {args.seeds}")
        return
    # SIGTERM ends the benchmark through `finally` blocks (run_logged stops its child), never mid-line.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    data, work = Path(args.data).resolve(), Path(args.work).resolve()
    ensure_data(data, PRESET)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in chosen:
        run_claim(every[name], args, data, work, write)
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
