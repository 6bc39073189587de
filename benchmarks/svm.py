"""VOC07 SVM stage on fixed features: our solvers against two references, at equal process counts.

    python -m benchmarks.svm [--classes N] [--ref-classes N] [--jobs 1,2] [--costs ...] [--features FILE.npz]
                             [--runs fair,plain,liblinear,newton] [--markdown]
    python -m benchmarks.svm --export-cache OUT/features --voc-root VOC [--layer res5avg] --features FILE.npz

Runs, each on 1 core and on 2 (``--jobs``: processes for the loops and liblinear, torch threads
for newton), on the same L2-normalised features:

* **fair**: the FAIR tools' loop (fair_self_supervision_benchmark ``train_svm_kfold``): per class,
  per cost, ``cross_val_score`` of ``LinearSVC`` on the dense array, then a refit on all of
  trainval at every cost; the best CV cost's model is scored. Processes split the classes.
* **plain**: the same loop refitting only the chosen cost.
* **liblinear**: ``run_svms(solver="liblinear")`` (the same liblinear fits as the references).
* **newton**: ``run_svms(solver="newton")`` (``transfer.svm_solver``, every SVM at its optimum).

Printed per run: wall and CPU seconds (CPU summed over the worker processes), mAP, speed-ups over
both references on the same number of cores; then the primal objectives of newton against
liblinear for every (class, cost, fold) (the largest relative excess of ours), and the classes
whose test AP differs, with both chosen costs and objectives. ``--markdown`` prints the table rows
of ``benchmarks/svm.md``. ``--ref-classes`` runs the (slow) references on the first N classes only;
our runs are then timed on those N classes too, so every ratio compares the same work.

Features: ``--features`` (.npz with train_x, train_labels, test_x, test_labels: ``--export-cache``
writes one from a ``transfer.voc07_svm`` feature cache directory) or VOC07-sized synthetic ones
(5011 / 4952 images, 2048-d non-negative, 20 multi-label classes with difficult entries), cached
under ``$XDG_CACHE_HOME/contrastive-transfer/bench_svm/`` (default ``~/.cache``).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np

from contrastive_transfer.cli import atomic_write
from transfer.voc07_protocol import DEFAULT_COSTS, l2_normalize, scoring_targets, training_targets, voc_ap
from transfer.voc07_solvers import make_svm, run_svms

RUNS = ("fair", "plain", "liblinear", "newton")


def synthetic_voc_features(
    seed: int = 0, n_train: int = 5011, n_test: int = 4952, dim: int = 2048, classes: int = 20
) -> dict[str, np.ndarray]:
    """ReLU'd features with a shared low-rank part (correlated channels, as CNN features), a weak
    per-class direction and noise; class frequencies 3–30 %, 5 % of positives difficult."""
    rng = np.random.default_rng(seed)
    basis, directions = rng.normal(size=(64, dim)), rng.normal(size=(classes, dim))
    freq = np.linspace(0.03, 0.3, classes)

    def split(n):
        present = rng.random((n, classes)) < freq
        labels = np.where(present, 1, -1).astype(np.int8)
        labels[present & (rng.random((n, classes)) < 0.05)] = 0
        x = rng.normal(size=(n, 64)) @ basis / 8 + 0.12 * present @ directions + 0.7 * rng.normal(size=(n, dim))
        return np.maximum(x, 0).astype(np.float32), labels

    (train_x, train_labels), (test_x, test_labels) = split(n_train), split(n_test)
    return dict(train_x=train_x, train_labels=train_labels, test_x=test_x, test_labels=test_labels)


# ------------------------------------------------------------------------------------ references
def _reference_class(xtr, y, xte, keep, target, costs, refit_all: bool) -> float:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import cross_val_score

    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    best, best_cost, best_model = -np.inf, None, None
    for cost in costs:
        cv = cross_val_score(make_svm(cost), xtr, y, cv=3, scoring="average_precision").mean()
        model = make_svm(cost).fit(xtr, y) if refit_all else None  # the FAIR tools save every cost's model
        if cv > best:
            best, best_cost, best_model = cv, cost, model
    if best_model is None:
        best_model = make_svm(best_cost).fit(xtr, y)
    return voc_ap(best_model.decision_function(xte[keep]), target)


def reference(train_x, train_labels, test_x, test_labels, costs, jobs: int = 1, refit_all: bool = True) -> np.ndarray:
    """Per-class test AP of the FAIR loop (refit_all) or of the plain loop (only the chosen cost
    refit); classes split over `jobs` processes."""
    from joblib import Parallel, delayed

    xtr, xte = l2_normalize(train_x), l2_normalize(test_x)
    ytr = training_targets(train_labels)
    calls = [
        (xtr, ytr[:, c], xte, *scoring_targets(test_labels, c), costs, refit_all) for c in range(train_labels.shape[1])
    ]
    if jobs == 1:
        return np.array([_reference_class(*a) for a in calls])
    return np.array(Parallel(n_jobs=jobs)(delayed(_reference_class)(*a) for a in calls))


# ------------------------------------------------------------------------------------ measuring
def _descendants_cpu() -> float:
    """CPU seconds of the live descendant processes (joblib's workers outlive a call)."""
    total, todo = 0.0, [os.getpid()]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        pid = todo.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                for child in map(int, children):
                    todo.append(child)
                    fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
                    total += (int(fields[11]) + int(fields[12])) / tick
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _cpu() -> float:
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + reaped.ru_utime + reaped.ru_stime + _descendants_cpu()


def timed(fn):
    wall, cpu = time.perf_counter(), _cpu()
    result = fn()
    return result, time.perf_counter() - wall, _cpu() - cpu


# ------------------------------------------------------------------------------------ data
def load_features(path: str | None) -> tuple[dict[str, np.ndarray], str]:
    if path:
        return _read_arrays(path), path
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
    cache = cache_root / "contrastive-transfer" / "bench_svm" / "voc07_like_seed0.npz"
    if not cache.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        features = synthetic_voc_features()
        atomic_write(cache, lambda f: np.savez(f, **features))
    return _read_arrays(cache), f"{cache} (synthetic_voc_features, seed 0)"


def _read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """An .npz (or .npy) of features through the gate: plain arrays only."""
    from contrastive_transfer.untrusted import open_untrusted  # torch: imported when a file is read

    with open_untrusted(path, "features") as f:
        loaded = np.load(f, allow_pickle=False)
        return dict(loaded) if isinstance(loaded, np.lib.npyio.NpzFile) else {"array": loaded}


def export_cache(cache_dir: str, voc_root: str, layer: str, out: str) -> None:
    """An .npz for --features from a voc07_svm feature cache (OUT/features: one key folder per
    image list, so trainval and test sit in different folders)."""
    from transfer.datasets.readers import read_voc_labels

    arrays = {}
    for split, name in (("trainval", "train"), ("test", "test")):
        found = sorted(Path(cache_dir).glob(f"*/{split}_{layer}_features.npy"))
        if len(found) != 1:
            raise SystemExit(
                f"error: --export-cache {cache_dir}: expected one */{split}_{layer}_features.npy, found {len(found)} "
                "(run transfer.voc07_svm first; one checkpoint per cache folder)"
            )
        path = found[0]
        arrays[f"{name}_x"] = _read_arrays(path)["array"]
        arrays[f"{name}_labels"] = read_voc_labels(voc_root, split).labels
        if len(arrays[f"{name}_x"]) != len(arrays[f"{name}_labels"]):
            raise SystemExit(f"error: {path}: {len(arrays[f'{name}_x'])} rows but {voc_root} lists a different count")
    atomic_write(out, lambda f: np.savez(f, **arrays))
    print(f"wrote {out}: train {arrays['train_x'].shape}, test {arrays['test_x'].shape}")


# ------------------------------------------------------------------------------------ main
def _jobs(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--jobs {text!r}: expected core counts like 1,2")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.svm",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--features", default=None, help=".npz with train_x, train_labels, test_x, test_labels")
    parser.add_argument("--classes", type=int, default=20, help="evaluate the first N classes")
    parser.add_argument("--costs", default=",".join(str(c) for c in DEFAULT_COSTS))
    parser.add_argument("--jobs", type=_jobs, default=[1, 2], help="core counts to compare (default 1,2)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"subset of {','.join(RUNS)}")
    parser.add_argument("--markdown", action="store_true", help="also print the table rows of benchmarks/svm.md")
    parser.add_argument("--export-cache", default=None, help="voc07_svm feature cache (OUT/features) → --features")
    parser.add_argument("--voc-root", default=None, help="with --export-cache: the VOC2007 folder (labels)")
    parser.add_argument("--layer", default="res5avg", help="with --export-cache: the layer")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as transfer.voc07_svm's main (before torch loads)
    if args.export_cache:
        if not (args.voc_root and args.features):
            raise SystemExit("error: --export-cache needs --voc-root and --features (the .npz to write)")
        return export_cache(args.export_cache, args.voc_root, args.layer, args.features)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in RUNS for r in runs):
        raise SystemExit(f"error: --runs {args.runs!r}: expected names from {','.join(RUNS)}")
    costs = [float(c) for c in args.costs.split(",")]
    warnings.filterwarnings("ignore")  # liblinear's ConvergenceWarnings: expected at large costs

    data, source = load_features(args.features)
    k = min(args.classes, data["train_labels"].shape[1])
    tr_x, te_x = data["train_x"], data["test_x"]
    tr_l, te_l = data["train_labels"][:, :k], data["test_labels"][:, :k]
    names = [f"class{c}" for c in range(k)]
    import sklearn
    import torch

    print(
        f"features: {source}: train {tr_x.shape}, test {te_x.shape}, {k} classes, {len(costs)} costs\n"
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch threads {torch.get_num_threads()}, "
        f"scikit-learn {sklearn.__version__}, numpy {np.__version__}, torch {torch.__version__}",
        flush=True,
    )
    rows: dict[tuple[str, int], tuple[float, float, float]] = {}  # (run, jobs) → wall, cpu, mAP
    results = {}
    for jobs in args.jobs:
        for run in reversed(RUNS):  # fastest first
            if run not in runs:
                continue
            if run in ("fair", "plain"):
                call = partial(reference, tr_x, tr_l, te_x, te_l, costs, jobs, refit_all=run == "fair")
            else:
                call = partial(run_svms, tr_x, tr_l, te_x, te_l, names, costs, jobs=jobs, solver=run)
            out, wall, cpu = timed(call)
            aps = out if run in ("fair", "plain") else out.test_ap
            results[run, jobs] = out
            rows[run, jobs] = (wall, cpu, 100 * float(np.mean(aps)))
            print(f"{run:>9s}, {jobs} core(s): {wall:8.1f} s wall {cpu:8.1f} s CPU   mAP {rows[run, jobs][2]:.4f}")
            print(_speedups(rows, run, jobs), flush=True)
    _objectives(results, args.jobs[0], costs)
    if args.markdown:
        _markdown(rows, k, len(costs), source)


def _speedups(rows, run, jobs) -> str:
    wall = rows[run, jobs][0]
    parts = [f"{wall and rows[ref, jobs][0] / wall:.2f}x vs {ref}" for ref in ("fair", "plain") if (ref, jobs) in rows]
    return "           speed-up (wall, same processes): " + (", ".join(parts) or "no reference run yet")


def _objectives(results, jobs, costs) -> None:
    ours, lib = results.get(("newton", jobs)), results.get(("liblinear", jobs))
    if ours is None or lib is None:
        return
    rel = (ours.objectives - lib.objectives) / lib.objectives
    worst = np.unravel_index(np.nanargmax(rel), rel.shape)
    print(
        f"objectives, {rel.size} (class, cost, fold) problems: max relative excess of newton over liblinear "
        f"{np.nanmax(rel):.2e} (class {worst[0]}, C={costs[worst[1]]:g}, fold {worst[2]}); liblinear above the optimum "
        f"by > 1e-6 relative in {int(np.sum(rel < -1e-6))}, by up to {-np.nanmin(rel):.2e}"
    )
    print(f"mAP newton {ours.map:.4f}, liblinear {lib.map:.4f}: difference {ours.map - lib.map:+.4f}")
    for c in np.nonzero(np.abs(ours.test_ap - lib.test_ap) > 1e-9)[0]:
        jl, jo = costs.index(lib.chosen_cost[c]), costs.index(ours.chosen_cost[c])
        print(
            f"  class {c}: AP liblinear {100 * lib.test_ap[c]:.4f} (C={lib.chosen_cost[c]:g}, refit objective "
            f"{lib.refit_objective[c]:.6g}), newton {100 * ours.test_ap[c]:.4f} (C={ours.chosen_cost[c]:g}, "
            f"{ours.refit_objective[c]:.6g}); fold objectives at C={costs[jl]:g}: liblinear "
            f"{lib.objectives[c, jl].mean():.6g}, newton {ours.objectives[c, jl].mean():.6g}"
            + (
                f"; at C={costs[jo]:g}: liblinear {lib.objectives[c, jo].mean():.6g}, "
                f"newton {ours.objectives[c, jo].mean():.6g}"
                if jo != jl
                else ""
            )
        )


def _markdown(rows, k, n_costs, source) -> None:
    print(f"\n| run ({k} classes × {n_costs} costs) | cores | wall | CPU | mAP | vs fair | vs plain |")
    print("|---|---|---|---|---|---|---|")
    for (run, jobs), (wall, cpu, m) in rows.items():
        ratios = [f"{rows[ref, jobs][0] / wall:.2f}×" if (ref, jobs) in rows else "—" for ref in ("fair", "plain")]
        print(f"| {run} | {jobs} | {wall:.1f} s | {cpu:.1f} s | {m:.4f} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()
