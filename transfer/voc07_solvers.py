"""The two ways to fit the VOC07 protocol's SVMs (``transfer.voc07_protocol``), and ``run_svms``,
the protocol on raw features with either:

* ``newton`` (default): ``transfer.svm_solver`` solves every (class, cost, fold) problem to its
  optimum, certified to a relative ``tol`` (1e-8) of the objective, all the problems of a cost in
  one batch warm-started from the previous cost, the matrix products on ``jobs`` torch threads.
* ``liblinear``: the FAIR tools' own ``LinearSVC(dual=True, tol=1e-4, max_iter=2000)``, fold by
  fold as ``cross_val_score`` does, on a CSR copy of the features made once, (class, cost) tasks in
  parallel processes, only the chosen cost refit. liblinear stops at ``tol``/``max_iter`` short of
  the optimum at large costs, so its CV scores (and sometimes the chosen cost) differ slightly.

Per class c and cost C both minimise LinearSVC's primal (squared hinge, L2 penalty,
intercept_scaling 1, ``class_weight={1: 2, -1: 1}``):
½‖(w, b)‖² + C Σ c_i max(0, 1 − y_i(w·x_i + b))², c_i = 2 on positives.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np
import scipy.sparse as sp
from joblib import Parallel, delayed

from contrastive_transfer.progress import progress
from transfer.voc07_protocol import (
    CV_FOLDS,
    DEFAULT_COSTS,
    SvmResult,
    cv_folds,
    fold_ap,
    l2_normalize,
    per_class_ap,
    training_targets,
    warn_few_positives,
)

if TYPE_CHECKING:  # scikit-learn is imported where it is used, so that --help does not wait for it
    from sklearn.svm import LinearSVC

SOLVERS = ("newton", "liblinear")
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


def make_svm(cost: float, seed: int = SVM_SEED) -> LinearSVC:
    from sklearn.svm import LinearSVC

    return LinearSVC(C=cost, random_state=seed, **SVM_PARAMS)


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
    for key, result, records in progress(done, len(tasks), desc, unit="fit"):
        results[key] = result
        if records:
            on_warnings(records)
    return [results[k] for k in keys]


def _keyed(key, fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return key, result, [(w.category.__name__, str(w.message)) for w in caught]


class Fits(NamedTuple):
    """What a solver returns to ``run_svms``, per class c (of C) and cost j."""

    cv_ap_folds: np.ndarray  # (C, #costs, folds) held-out AP of each fold's fit
    objectives: np.ndarray  # (C, #costs, folds) primal objective of each fold's fit
    chosen_cost: np.ndarray  # (C,) the cost of the best mean CV AP
    refit_objective: np.ndarray  # (C,) of the SVM refit on all training rows at the chosen cost
    scores: np.ndarray | list  # scores[c]: that refit's decision values on the test images


def _fit_newton(train_x, ytr, test_x, costs: list[float], jobs: int, tol: float | None, on_warnings) -> Fits:
    import torch

    from transfer.svm_solver import DEFAULT_TOL

    xtr, xte = l2_normalize(train_x), l2_normalize(test_x)
    # Threads, not processes: all problems of a cost advance in the same matrix products, which
    # torch splits over the cores; class groups in separate processes each redo the basis and
    # multiply fewer problems at a time (2 free cores, 20 VOC07-sized classes: 41 s with 2
    # threads against 66 s with 2 processes). main() makes OpenMP's idle threads sleep
    # (OMP_WAIT_POLICY=PASSIVE) so that they do not spin against other load.
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
    chosen = np.array([costs[int(j)] for j in out["chosen"]])
    return Fits(out["cv_ap"], out["objectives"], chosen, out["refit_objective"], out["scores"].T)


def _fit_liblinear(train_x, ytr, test_x, costs: list[float], jobs: int, seed: int, on_warnings) -> Fits:
    n_classes = ytr.shape[1]
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
    cv_ap_folds = np.array([aps for aps, _ in cv]).reshape(n_classes, len(costs), CV_FOLDS)
    objectives = np.array([obj for _, obj in cv]).reshape(n_classes, len(costs), CV_FOLDS)
    chosen = np.array([costs[int(np.argmax(row))] for row in cv_ap_folds.mean(axis=2)])
    refits = _run(
        [(c, fit_scores, (xtr, ytr[:, c], chosen[c], seed, xte, True)) for c in range(n_classes)],
        jobs,
        "SVM refit",
        on_warnings,
    )
    return Fits(cv_ap_folds, objectives, chosen, np.array([o for _, o in refits]), [s for s, _ in refits])


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
    warn_few_positives(ytr, classes)
    if solver == "newton":
        fits = _fit_newton(train_x, ytr, test_x, costs, jobs, tol, on_warnings)
    else:
        fits = _fit_liblinear(train_x, ytr, test_x, costs, jobs, seed, on_warnings)
    return SvmResult(
        list(classes),
        costs,
        fits.cv_ap_folds.mean(axis=2),
        fits.chosen_cost,
        per_class_ap(fits.scores, test_labels),
        solver,
        fits.objectives,
        fits.refit_objective,
        fits.cv_ap_folds,
    )
