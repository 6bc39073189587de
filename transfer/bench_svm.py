"""Benchmark of the VOC07 SVM stage on fixed cached features (not a test).

    python -m transfer.bench_svm [--classes 20] [--costs ...] [--jobs -1] [--features FILE.npz]

Compares our ``run_svms`` with the straightforward reference — per class, per cost,
``cross_val_score`` + refit on dense features, one process (the FAIR tools' loop) — on the same
features: wall time of each, speed-up, and both mAPs (they must agree to 1e-4; with the same
liblinear seed they agree exactly). Features: ``--features`` (an .npz with train_x, train_labels,
test_x, test_labels, e.g. saved from a voc07_svm feature cache) or, by default, VOC07-sized
synthetic ones (5011 / 4952 images, 2048-d non-negative, 20 multi-label classes with
difficult entries), generated once from a fixed seed and cached under
``$XDG_CACHE_HOME/contrastive-transfer/bench_svm/`` (default ``~/.cache``).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import warnings
from pathlib import Path

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import cross_val_score

from transfer.voc07_svm import (
    DEFAULT_COSTS,
    l2_normalize,
    make_svm,
    run_svms,
    scoring_targets,
    training_targets,
    voc_ap,
)


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


def reference(train_x, train_labels, test_x, test_labels, costs) -> np.ndarray:
    """Per-class test AP of the straightforward loop (FAIR's svm_helper / train_svm_kfold)."""
    xtr, xte = l2_normalize(train_x), l2_normalize(test_x)
    ytr = training_targets(train_labels)
    aps = []
    for c in range(train_labels.shape[1]):
        best, best_model = -np.inf, None
        for cost in costs:
            svm = make_svm(cost)
            cv = cross_val_score(svm, xtr, ytr[:, c], cv=3, scoring="average_precision").mean()
            svm.fit(xtr, ytr[:, c])
            if cv > best:
                best, best_model = cv, svm
        keep, y = scoring_targets(test_labels, c)
        aps.append(voc_ap(best_model.decision_function(xte[keep]), y))
    return np.array(aps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m transfer.bench_svm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", default=None, help=".npz with train_x, train_labels, test_x, test_labels")
    parser.add_argument("--classes", type=int, default=20, help="evaluate the first N classes (time bound)")
    parser.add_argument("--costs", default=",".join(str(c) for c in DEFAULT_COSTS))
    parser.add_argument("--jobs", type=int, default=-1)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    costs = [float(c) for c in args.costs.split(",")]

    if args.features:
        data = dict(np.load(args.features))
        source = args.features
    else:
        cache_root = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
        cache = cache_root / "contrastive-transfer" / "bench_svm" / "voc07_like_seed0.npz"
        if not cache.is_file():
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.tmp{os.getpid()}.npz")
            np.savez(tmp, **synthetic_voc_features())
            os.replace(tmp, cache)
        data, source = dict(np.load(cache)), f"{cache} (synthetic_voc_features, seed 0)"
    k = args.classes
    tr_l, te_l = data["train_labels"][:, :k], data["test_labels"][:, :k]
    print(
        f"features: {source}: train {data['train_x'].shape}, test {data['test_x'].shape}, {k} classes, "
        f"{len(costs)} costs; machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    )

    names = [f"class{c}" for c in range(k)]

    def timed(fn):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        return result, time.perf_counter() - wall, time.process_time() - cpu

    # CPU seconds of a single process measure the work itself, whatever else runs on the machine;
    # the parallel run's wall time adds what the cores give.
    serial, serial_wall, serial_cpu = timed(
        lambda: run_svms(data["train_x"], tr_l, data["test_x"], te_l, names, costs, jobs=1)
    )
    print(f"ours, 1 process   : {serial_wall:8.1f} s wall {serial_cpu:8.1f} s CPU   mAP {serial.map:.6f}", flush=True)
    ours, ours_wall, _ = timed(lambda: run_svms(data["train_x"], tr_l, data["test_x"], te_l, names, costs, args.jobs))
    print(f"ours, jobs={args.jobs:<3d}    : {ours_wall:8.1f} s wall                 mAP {ours.map:.6f}", flush=True)
    ref_ap, ref_wall, ref_cpu = timed(lambda: reference(data["train_x"], tr_l, data["test_x"], te_l, costs))
    ref_map = 100 * ref_ap.mean()
    print(f"reference         : {ref_wall:8.1f} s wall {ref_cpu:8.1f} s CPU   mAP {ref_map:.6f}")
    print(
        f"speed-up: {ref_cpu / serial_cpu:.2f}x in CPU time (1 process), {ref_wall / ours_wall:.2f}x in wall time "
        f"(jobs={args.jobs}); |mAP difference| {abs(ours.map - ref_map):.2e}, "
        f"max per-class AP difference {np.abs(100 * ours.test_ap - 100 * ref_ap).max():.2e}"
    )
    print(
        f"| {k} classes × {len(costs)} costs | {ref_wall:.1f} s ({ref_cpu:.1f} s CPU) | {serial_wall:.1f} s "
        f"({serial_cpu:.1f} s CPU) | {ours_wall:.1f} s | {ref_cpu / serial_cpu:.2f}× | {ref_wall / ours_wall:.2f}× | "
        f"{ref_map:.4f} | {ours.map:.4f} |"
    )


if __name__ == "__main__":
    main()
