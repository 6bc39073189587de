"""VOC07 linear SVM evaluation of frozen features (the FAIR / VISSL protocol).

    python -m transfer.voc07_svm --weights CKPT --voc-root DIR [--layers res5avg,res5,res4]
                                 [--costs 0.01,0.1,...] --output-dir OUT

Protocol (Goyal et al. 2019, fair_self_supervision_benchmark; VISSL ``train_svm``):

* labels from ``ImageSets/Main/<cls>_<split>.txt`` (class order = sorted file names); train on
  trainval with difficult (0) → negative, test on test with difficult images dropped per class;
* features x ← x / (‖x‖₂ + 1e-5) of the layer (see ``transfer.features``) after shorter side 256
  then warp to 224×224;
* per class c and cost C, the SVM of ``LinearSVC(C, class_weight={1: 2, -1: 1}, squared hinge,
  L2 penalty, intercept_scaling 1)``: minimise ½‖(w, b)‖² + C Σ c_i max(0, 1 − y_i(w·x_i + b))²
  (c_i = 2 on positives); CV score = mean over a stratified, unshuffled 3-fold split of sklearn's
  average precision of the decision function (``cross_val_score(..., cv=3,
  scoring="average_precision")``); the cost with the largest CV score (first on ties) is refit on
  all of trainval;
* test AP = all-point interpolated AP (``voc_ap``); mAP = mean over classes × 100.

Solvers (``--solver``):

* ``newton`` (default): ``transfer.svm_solver`` solves every (class, cost, fold) problem to its
  optimum, certified to a relative ``--svm-tol`` (1e-8) of the objective, all the problems of a
  cost in one batch warm-started from the previous cost, the matrix products on ``--jobs`` torch
  threads.
* ``liblinear``: the FAIR tools' own ``LinearSVC(dual=True, tol=1e-4, max_iter=2000)``, fold by
  fold as ``cross_val_score`` does, on a CSR copy of the features made once, (class, cost) tasks in
  parallel processes, only the chosen cost refit. liblinear stops at ``tol``/``max_iter`` short of
  the optimum at large costs, so its CV scores (and sometimes the chosen cost) differ slightly.

See ``benchmarks/svm.py`` for the timings of both against the FAIR loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import scipy.sparse as sp
from joblib import Parallel, delayed

from contrastive_transfer.cli import UserError, command, ensure_writable_dir
from transfer import eval_cli
from transfer.layers import LAYERS

if TYPE_CHECKING:  # scikit-learn is imported where it is used, so that --help does not wait for it
    from sklearn.svm import LinearSVC

logger = logging.getLogger(__name__)

# VISSL's VOC07 grid (configs/.../svm_voc07.yaml); the FAIR tools append 0.5**k, k = 4..19.
DEFAULT_COSTS = (0.01, 0.1, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 50.0, 100.0, 1000.0)
CV_FOLDS = 3
SVM_SEED = 0  # liblinear's coordinate order; the FAIR tools leave it to numpy's global RNG
SVM_PARAMS = dict(
    class_weight={1: 2, -1: 1},
    intercept_scaling=1.0,
    penalty="l2",
    loss="squared_hinge",
    dual=True,
    tol=1e-4,
    max_iter=2000,
)
# VOC2007 sizes, for the refusal message and the count check on the real data set.
VOC07_TRAINVAL_IMAGES, VOC07_TEST_IMAGES = 5011, 4952


def make_svm(cost: float, seed: int = SVM_SEED) -> LinearSVC:
    from sklearn.svm import LinearSVC

    return LinearSVC(C=cost, random_state=seed, **SVM_PARAMS)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """x / (‖x‖₂ + 1e-5) per row, in float64 (the FAIR tools' normalization)."""
    x = np.asarray(x, dtype=np.float64)
    return x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-5)


def voc_ap(scores: np.ndarray, targets: np.ndarray) -> float:
    """All-point interpolated average precision (VOC2010+ devkit, the FAIR SVM tools).

    Rank by score (descending); precision P_k = TP_k / k and recall R_k = TP_k / #positives at each
    rank; with sentinels (R, P) = (0, 0) and (1, 0), make P non-increasing from the right
    (P̂_k = max_{j ≥ k} P_j), then AP = Σ_k (R_k − R_{k−1}) · P̂_k. targets: 1 positive, else negative.
    Not the VOC2007 11-point AP (mean of max precision at recall 0, 0.1, ..., 1), nor sklearn's
    average_precision_score (no interpolation).
    """
    scores, positive = np.asarray(scores, dtype=np.float64), np.asarray(targets) == 1
    if positive.sum() == 0:
        raise ValueError("voc_ap: no positive example")
    order = np.argsort(-scores, kind="stable")
    tp = np.cumsum(positive[order])
    fp = np.cumsum(~positive[order])
    recall = np.concatenate([[0.0], tp / positive.sum(), [1.0]])
    precision = np.concatenate([[0.0], tp / np.maximum(tp + fp, np.finfo(np.float64).eps), [0.0]])
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    changed = np.nonzero(recall[1:] != recall[:-1])[0] + 1
    return float(np.sum((recall[changed] - recall[changed - 1]) * precision[changed]))


def training_targets(labels: np.ndarray) -> np.ndarray:
    """VOC labels (1, -1, 0=difficult) → SVM targets for training: difficult counts as negative."""
    return np.where(labels == 1, 1, -1)


def scoring_targets(labels: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask of kept images, ±1 targets of those) for class c at test: difficult images dropped."""
    keep = labels[:, c] != 0
    return keep, np.where(labels[keep, c] == 1, 1, -1)


def check_disjoint(train_ids: list[str], test_ids: list[str], train_split: str, test_split: str) -> None:
    """Refuse to score SVMs on images they were trained on (fair_ssl#34: trainval 'test' AP)."""
    shared = set(train_ids) & set(test_ids)
    if shared:
        raise UserError(
            f"test split {test_split!r} shares {len(shared)} of its {len(test_ids)} images with the training split "
            f"{train_split!r}: the SVMs would be scored on their own training images; test on VOC2007 'test' "
            f"({VOC07_TEST_IMAGES} images)"
        )
    if len(train_ids) == VOC07_TRAINVAL_IMAGES and len(test_ids) != VOC07_TEST_IMAGES:
        raise UserError(
            f"training on VOC2007 trainval ({len(train_ids)} images) but the test split {test_split!r} "
            f"has {len(test_ids)} images, not the {VOC07_TEST_IMAGES} of VOC2007 test"
        )


def _quiet_svm():
    from sklearn.exceptions import ConvergenceWarning

    # liblinear stops at max_iter for large costs, as in the reference tools: expected, not news.
    warnings.filterwarnings("ignore", category=ConvergenceWarning)


def objective(w: np.ndarray, b: float, x, y: np.ndarray, cost: float) -> float:
    """LinearSVC's primal objective ½(‖w‖² + b²) + C Σ c_i max(0, 1 − y_i(w·x_i + b))², c_i = 2 on
    positives (the bias is penalised: liblinear's intercept_scaling 1)."""
    margin = np.maximum(0.0, 1.0 - y * (np.asarray(x @ w).ravel() + b))
    weight = np.where(y == 1, SVM_PARAMS["class_weight"][1], SVM_PARAMS["class_weight"][-1])
    return float(0.5 * (w @ w + b * b) + cost * np.sum(weight * margin * margin))


def cv_folds(y: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (train, held-out) rows of cross_val_score(cv=3) for a classifier: stratified, unshuffled."""
    from sklearn.model_selection import StratifiedKFold

    return list(StratifiedKFold(CV_FOLDS).split(np.zeros((len(y), 1)), y))


def fold_ap(y: np.ndarray, scores: np.ndarray) -> float:
    """cross_val_score's "average_precision" on one held-out fold (positive label 1)."""
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(y, scores, pos_label=1))


def cv_score(x, y: np.ndarray, cost: float, seed: int, with_objectives: bool = False):
    """Per-fold sklearn AP of one (class, cost) with liblinear: the FAIR tools' cross_val_score
    call written out (same folds, same fits, same scorer), so the primal objective of each fold's
    model can be returned too: (aps, objectives) when ``with_objectives``."""
    _quiet_svm()
    aps, objectives = [], []
    for train, held in cv_folds(y):
        try:
            svm = make_svm(cost, seed).fit(x[train], y[train])
        except ValueError as error:  # a training part with one class: cross_val_score's error_score=nan
            warnings.warn(f"SVM fit failed, fold scored nan: {error}", RuntimeWarning, stacklevel=2)
            aps.append(np.nan)
            objectives.append(np.nan)
            continue
        aps.append(fold_ap(y[held], svm.decision_function(x[held])))
        objectives.append(objective(svm.coef_[0], svm.intercept_[0], x[train], y[train], cost))
    return (np.array(aps), np.array(objectives)) if with_objectives else np.array(aps)


def fit_scores(x, y: np.ndarray, cost: float, seed: int, x_test, with_objective: bool = False):
    """Decision values on x_test of the SVM fit on all of (x, y) (and its objective)."""
    _quiet_svm()
    svm = make_svm(cost, seed).fit(x, y)
    scores = svm.decision_function(x_test)
    return (scores, objective(svm.coef_[0], svm.intercept_[0], x, y, cost)) if with_objective else scores


def _class_weights(y):
    """c_i of ±1 targets (a float64 tensor: a float32 weight would move C by 1e-8 relative)."""
    pos, neg = SVM_PARAMS["class_weight"][1], SVM_PARAMS["class_weight"][-1]
    return (y > 0).to(y.dtype) * float(pos - neg) + float(neg)


def newton_classes(xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, costs: list[float], tol: float) -> dict:
    """The protocol for a few classes with ``transfer.svm_solver``: per cost in increasing order,
    the (class, fold) problems solved together, warm-started from the previous cost; per-fold AP
    of the held-out rows; then each class refit on all rows at its chosen cost, warm-started from
    the mean of its fold solutions there. ytr: (n, k) ±1 targets. Returns numpy arrays: cv_ap and
    objectives (k, #costs, folds), chosen (k,) cost indices, refit_objective (k,), scores (n_test, k)."""
    import torch

    from transfer.svm_solver import Basis, solve, with_bias

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    xb = with_bias(torch.as_tensor(xtr, dtype=torch.float64, device=device))
    basis = Basis.of(xb)
    n, k = ytr.shape
    folds = [cv_folds(ytr[:, c]) for c in range(k)]
    y = torch.as_tensor(np.repeat(ytr, CV_FOLDS, axis=1), dtype=torch.float64, device=device)  # (n, k·F)
    rows = torch.zeros_like(y)
    for c in range(k):
        for f, (train, _) in enumerate(folds[c]):
            rows[train, c * CV_FOLDS + f] = 1.0
    weight = _class_weights(y)
    cv_ap = np.zeros((k, len(costs), CV_FOLDS))
    objectives = np.zeros((k, len(costs), CV_FOLDS))
    coords: dict[int, torch.Tensor] = {}
    v = None
    for j in sorted(range(len(costs)), key=lambda j: costs[j]):
        sol = solve(basis.xr, y, costs[j] * weight * rows, v, tol, gram=basis.gram)
        if not sol.converged.all():
            warnings.warn(
                f"SVM solver: {int((~sol.converged).sum())} problems at C={costs[j]:g} stopped at the iteration limit",
                stacklevel=2,
            )
        v = coords[j] = sol.w
        scores = (basis.xr @ v).cpu().numpy()
        objectives[:, j] = sol.objective.cpu().numpy().reshape(k, CV_FOLDS)
        for c in range(k):
            for f, (_, held) in enumerate(folds[c]):
                cv_ap[c, j, f] = fold_ap(ytr[held, c], scores[held, c * CV_FOLDS + f])
    chosen = cv_ap.mean(axis=2).argmax(axis=1)  # first on ties, in the order of `costs`
    start = torch.stack([coords[int(chosen[c])][:, c * CV_FOLDS : (c + 1) * CV_FOLDS].mean(1) for c in range(k)], 1)
    y_all = torch.as_tensor(ytr, dtype=torch.float64, device=device)
    cost_all = torch.as_tensor([costs[int(j)] for j in chosen], dtype=torch.float64, device=device)
    weight_all = _class_weights(y_all)
    refit = solve(basis.xr, y_all, cost_all * weight_all, start, tol, gram=basis.gram)
    if not refit.converged.all():
        stopped = int((~refit.converged).sum())
        warnings.warn(f"SVM solver: {stopped} refits stopped at the iteration limit", stacklevel=2)
    w = basis.weights(refit.w)
    xte_b = with_bias(torch.as_tensor(xte, dtype=torch.float64, device=device))
    return {
        "cv_ap": cv_ap,
        "objectives": objectives,
        "chosen": chosen,
        "refit_objective": refit.objective.cpu().numpy(),
        "scores": (xte_b @ w).cpu().numpy(),
    }


@dataclass
class SvmResult:
    classes: list[str]
    costs: list[float]
    cv_ap: np.ndarray  # (C, #costs) mean CV AP
    chosen_cost: np.ndarray  # (C,)
    test_ap: np.ndarray  # (C,)
    solver: str = "newton"
    # Primal objectives (transfer.svm_solver's f) of every CV fit (C, #costs, folds) and of the refits (C,).
    objectives: np.ndarray | None = None
    refit_objective: np.ndarray | None = None
    cv_ap_folds: np.ndarray | None = None  # (C, #costs, folds)

    @property
    def map(self) -> float:
        return float(100.0 * self.test_ap.mean())

    def to_json(self) -> dict:
        return {
            "mAP": self.map,
            "solver": self.solver,
            "costs": self.costs,
            "per_class": {
                c: {
                    "ap": 100.0 * float(self.test_ap[i]),
                    "cost": float(self.chosen_cost[i]),
                    "cv_ap": [float(v) for v in self.cv_ap[i]],
                    **(
                        {"objective_at_cost": float(self.refit_objective[i])}
                        if self.refit_objective is not None
                        else {}
                    ),
                }
                for i, c in enumerate(self.classes)
            },
        }


WarningSink = Callable[[list[tuple[str, str]]], None]


def _rewarn(records: list[tuple[str, str]]) -> None:
    for _, message in records:
        warnings.warn(message, stacklevel=2)


def _run(tasks, jobs: int, desc: str, on_warnings: WarningSink = _rewarn) -> list:
    """Run (key, fn, args) tasks, in parallel processes when jobs != 1, with progress; returns the
    results in task order. Warnings raised inside the tasks (in whichever process) go to
    ``on_warnings`` as (category, message) pairs."""
    keys = [k for k, _, _ in tasks]
    if jobs == 1:
        done = (_keyed(k, fn, *args) for k, fn, args in tasks)
    else:
        calls = (delayed(_keyed)(k, fn, *args) for k, fn, args in tasks)
        done = Parallel(n_jobs=jobs, return_as="generator_unordered")(calls)
    results = {}
    for key, result, records in eval_cli.progress(done, len(tasks), desc, unit="fit"):
        results[key] = result
        if records:
            on_warnings(records)
    return [results[k] for k in keys]


def _keyed(key, fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return key, result, [(w.category.__name__, str(w.message)) for w in caught]


SOLVERS = ("newton", "liblinear")


def run_svms(
    train_x: np.ndarray,
    train_labels: np.ndarray,
    test_x: np.ndarray,
    test_labels: np.ndarray,
    classes: list[str],
    costs=DEFAULT_COSTS,
    jobs: int = -1,
    seed: int = SVM_SEED,
    on_warnings: WarningSink = _rewarn,
    solver: str = "newton",
    tol: float | None = None,
) -> SvmResult:
    """The protocol on raw features (normalized here) and VOC label matrices (1, -1, 0).

    solver "newton": ``transfer.svm_solver`` (every problem to its optimum, certified to a relative
    ``tol``, default ``svm_solver.DEFAULT_TOL``), on ``jobs`` torch threads;
    "liblinear": scikit-learn's LinearSVC, one (class, cost) cross-validation per task (``seed``
    is liblinear's coordinate order; the newton solver needs none)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r}: expected one of {', '.join(SOLVERS)}")
    costs = [float(c) for c in costs]
    ytr = training_targets(train_labels)
    few = [f"{name} ({(ytr[:, c] == 1).sum()})" for c, name in enumerate(classes) if (ytr[:, c] == 1).sum() < CV_FOLDS]
    if few:  # the reference runs anyway; so do we, but say so once
        logger.warning(
            "%d-fold CV: %d classes have fewer than %d positive training images, so some folds have "
            "none and score AP 0, as in cross_val_score: %s",
            CV_FOLDS,
            len(few),
            CV_FOLDS,
            ", ".join(few),
        )
    n_classes = len(classes)
    if solver == "newton":
        from transfer.svm_solver import DEFAULT_TOL

        xtr, xte = l2_normalize(train_x), l2_normalize(test_x)
        # Threads, not processes: all problems of a cost advance in the same matrix products, which
        # torch splits over the cores; class groups in separate processes each redo the basis and
        # multiply fewer problems at a time (2 free cores, 20 VOC07-sized classes: 41 s with 2
        # threads against 66 s with 2 processes). main() makes OpenMP's idle threads sleep
        # (OMP_WAIT_POLICY=PASSIVE) so that they do not spin against other load.
        import torch

        threads = jobs if jobs > 0 else max(1, (os.cpu_count() or 1) + 1 + jobs)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            (out,) = _run(
                [(0, newton_classes, (xtr, ytr, xte, costs, tol or DEFAULT_TOL))],
                1,
                f"SVM (newton solver, {threads} thread{'s' * (threads > 1)})",
                on_warnings,
            )
        finally:
            torch.set_num_threads(before)
        cv_folds_ap, objectives = out["cv_ap"], out["objectives"]
        chosen = np.array([costs[int(j)] for j in out["chosen"]])
        refit_objective, scores = out["refit_objective"], out["scores"].T
    else:
        # CSR is liblinear's own input layout: converting once here spares every fit a dense → sparse
        # pass (the zero entries are skipped either way, so the fits are identical).
        xtr = sp.csr_matrix(l2_normalize(train_x))
        xte = sp.csr_matrix(l2_normalize(test_x))
        cv = _run(
            [
                ((c, j), cv_score, (xtr, ytr[:, c], cost, seed, True))
                for c in range(n_classes)
                for j, cost in enumerate(costs)
            ],
            jobs,
            "SVM cross-validation",
            on_warnings,
        )
        cv_folds_ap = np.array([aps for aps, _ in cv]).reshape(n_classes, len(costs), CV_FOLDS)
        objectives = np.array([obj for _, obj in cv]).reshape(n_classes, len(costs), CV_FOLDS)
        chosen = np.array([costs[int(np.argmax(row))] for row in cv_folds_ap.mean(axis=2)])
        refits = _run(
            [(c, fit_scores, (xtr, ytr[:, c], chosen[c], seed, xte, True)) for c in range(n_classes)],
            jobs,
            "SVM refit",
            on_warnings,
        )
        scores = [s for s, _ in refits]
        refit_objective = np.array([o for _, o in refits])
    test_ap = np.empty(n_classes)
    for c in range(n_classes):
        keep, y = scoring_targets(test_labels, c)
        test_ap[c] = voc_ap(scores[c][keep], y)
    return SvmResult(
        list(classes),
        costs,
        cv_folds_ap.mean(axis=2),
        chosen,
        test_ap,
        solver,
        objectives,
        refit_objective,
        cv_folds_ap,
    )


# --------------------------------------------------------------------------------------------- CLI
def _parse_costs(text: str) -> list[float]:
    try:
        costs = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--costs {text!r}: expected comma-separated positive numbers") from None
    if not costs or any(c <= 0 for c in costs):
        raise argparse.ArgumentTypeError(f"--costs {text!r}: expected comma-separated positive numbers")
    return costs


def _parse_tol(text: str) -> float:
    try:
        tol = float(text)
    except ValueError:
        tol = -1.0
    if not 0 < tol < 1:
        raise argparse.ArgumentTypeError(f"--svm-tol {text!r}: expected a number in (0, 1), e.g. 1e-8")
    return tol


def parser() -> argparse.ArgumentParser:
    p = eval_cli.make_parser("python -m transfer.voc07_svm", __doc__)
    eval_cli.add_checkpoint_args(p)
    p.add_argument("--voc-root", required=True, help="VOC2007 folder (ImageSets/Main, JPEGImages)")
    p.add_argument("--output-dir", "--out", required=True, help="metrics.json and the feature cache go here")
    p.add_argument("--layers", default="res5avg", help=f"comma-separated, from {', '.join(LAYERS)}")
    p.add_argument(
        "--costs",
        type=_parse_costs,
        default=",".join(f"{c:g}" for c in DEFAULT_COSTS),
        help="comma-separated SVM costs C, searched per class by 3-fold CV",
    )
    p.add_argument("--train-split", default="trainval", help="split the SVMs are trained and cross-validated on")
    p.add_argument("--test-split", default="test", help="split the APs are measured on")
    eval_cli.add_size_args(p, "shorter side before the warp", "network input side (warp, no crop)")
    eval_cli.add_loader_args(p, batch_size=32)
    p.add_argument(
        "--solver",
        choices=SOLVERS,
        default="newton",
        help="newton: batched primal Newton (transfer.svm_solver), every SVM solved to its optimum, certified "
        "to a relative --svm-tol of the objective; liblinear: scikit-learn's LinearSVC (dual, tol 1e-4, "
        "max_iter 2000) as in the FAIR/VISSL tools, which stops short of the optimum at large costs",
    )
    p.add_argument(
        "--svm-tol",
        type=_parse_tol,
        default=None,
        help="newton solver: stop when ‖∇f‖² ≤ 2·tol·f, i.e. f − min f ≤ tol·f (default 1e-8)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=-1,
        help="cores for the SVMs (-1: all): torch threads of the newton solver, processes of liblinear",
    )
    p.add_argument("--cache-dir", default=None, help="feature cache (default OUT/features)")
    return p


@command
def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    # Set before torch loads OpenMP: idle solver threads sleep instead of spinning against other load.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    costs = args.costs
    layers = [name.strip() for name in args.layers.split(",") if name.strip()]
    bad = [name for name in layers if name not in LAYERS]
    if bad or not layers:
        raise UserError(f"--layers {args.layers!r}: expected names from {', '.join(LAYERS)}")

    from contrastive_transfer.cli import atomic_write
    from converters.checkpoint_io import summary_lines
    from transfer.datasets.readers import read_voc_labels
    from transfer.features import FeatureCache, LayerFeatures, Preprocessing, load_model

    train = read_voc_labels(args.voc_root, args.train_split)
    test = read_voc_labels(args.voc_root, args.test_split)
    check_disjoint(train.ids, test.ids, args.train_split, args.test_split)
    if train.classes != test.classes:
        raise UserError(f"{args.voc_root}: classes of {args.train_split!r} and {args.test_split!r} differ")
    model, backbone = load_model(args.weights, args.encoder, args.layout)
    resize, crop = eval_cli.resolve_size(args.resize, args.crop, backbone.image_size)
    prep = Preprocessing(resize, crop, "warp")
    # The inputs are valid; before the long work, prove the outputs can be written.
    out = ensure_writable_dir(args.output_dir, "--output-dir")
    if args.cache_dir:
        ensure_writable_dir(args.cache_dir, "--cache-dir")
    for line in summary_lines(backbone):
        logger.info(line)

    with eval_cli.summarised_warnings("transfer.voc07_svm") as caught:
        transform = prep.transform()
        train.images.transform = test.images.transform = transform
        cache = FeatureCache(args.cache_dir or out / "features", args.weights, args.encoder, prep)
        kwargs = dict(batch_size=args.batch_size, workers=args.workers)
        make = lambda names: LayerFeatures(model, names)  # noqa: E731
        train_feats = cache.get(make, train.images, args.train_split, layers, **kwargs)
        test_feats = cache.get(make, test.images, args.test_split, layers, **kwargs)

        described = LayerFeatures(model, layers).describe(crop)
        from transfer.svm_solver import DEFAULT_TOL

        solver_record = (
            {
                "solver": "newton (transfer.svm_solver: batched primal Newton, exact optimum)",
                "stop": "‖∇f‖² ≤ 2·tol·f, so f − min f ≤ tol·f",
                "solver_tol": args.svm_tol or DEFAULT_TOL,
            }
            if args.solver == "newton"
            else {"solver": "liblinear (sklearn LinearSVC)", "seed": SVM_SEED}
        )
        metrics = {
            "protocol": "voc07_svm",
            **eval_cli.source_record(args.weights, args.encoder, backbone),
            "preprocessing": prep.describe(),
            "svm": {
                **{
                    k: v
                    for k, v in SVM_PARAMS.items()
                    if k != "class_weight" and (args.solver == "liblinear" or k not in ("dual", "tol", "max_iter"))
                },
                "class_weight": "{1: 2, -1: 1}",
                "cv_folds": CV_FOLDS,
                "cv_scoring": "average_precision",
                **solver_record,
                "features": "L2-normalized, float64",
                "test_ap": "all-point interpolated",
            },
            "train": {"split": args.train_split, "images": len(train.ids)},
            "test": {"split": args.test_split, "images": len(test.ids)},
            "layers": {},
        }
        for name in layers:
            start = time.time()
            result = run_svms(
                train_feats[name],
                train.labels,
                test_feats[name],
                test.labels,
                train.classes,
                costs,
                args.jobs,
                on_warnings=caught.add,
                solver=args.solver,
                tol=args.svm_tol,
            )
            metrics["layers"][name] = {**described[name], **result.to_json(), "svm_seconds": time.time() - start}
            logger.info("%s (%d-d): VOC07 SVM mAP %.2f", name, described[name]["dim"], result.map)
            atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1)))
    print(json.dumps({name: round(m["mAP"], 2) for name, m in metrics["layers"].items()}))


if __name__ == "__main__":
    main()
