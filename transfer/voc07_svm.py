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

The protocol's definitions: ``transfer.voc07_protocol``; the solvers and ``run_svms``:
``transfer.voc07_solvers``. See ``benchmarks/svm.py`` for the timings of both solvers against the
FAIR loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from contrastive_transfer.cli import UserError, command, ensure_writable_dir
from transfer import eval_cli
from transfer.layers import LAYERS
from transfer.voc07_protocol import CV_FOLDS, DEFAULT_COSTS, chance_map, check_disjoint
from transfer.voc07_solvers import SOLVERS, SVM_PARAMS, SVM_SEED, run_svms

logger = logging.getLogger(__name__)


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


def _layers(text: str) -> list[str]:
    layers = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in layers if name not in LAYERS]
    if bad or not layers:
        raise UserError(f"--layers {text!r}: expected names from {', '.join(LAYERS)}")
    return layers


def _read_splits(args: argparse.Namespace):
    """The train and test label sets, refused when they overlap or name other classes."""
    from transfer.datasets.readers import read_voc_labels

    train = read_voc_labels(args.voc_root, args.train_split)
    test = read_voc_labels(args.voc_root, args.test_split)
    check_disjoint(train.ids, test.ids, args.train_split, args.test_split)
    if train.classes != test.classes:
        raise UserError(f"{args.voc_root}: classes of {args.train_split!r} and {args.test_split!r} differ")
    return train, test


def _svm_record(args: argparse.Namespace) -> dict:
    """metrics.json's "svm": the protocol's settings and those of the solver that ran (liblinear's
    stopping rule only for liblinear)."""
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
    return {
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
    }


def _chance_record(labels) -> dict:
    """The mAP random rankings score on the test split: the floor the layers' mAP is read against."""
    mean, std = chance_map(labels)
    return {"chance_mAP": mean, "chance_mAP_std": std}


@command
def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    # Set before torch loads OpenMP: idle solver threads sleep instead of spinning against other load.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    layers = _layers(args.layers)

    from transfer.features import Preprocessing, load_model

    train, test = _read_splits(args)
    model, backbone = load_model(args.weights, args.encoder, args.layout)
    resize, crop = eval_cli.resolve_size(args.resize, args.crop, backbone.image_size)
    prep = Preprocessing(resize, crop, "warp")
    with eval_cli.launched_processes("transfer.voc07_svm"):
        _run(args, layers, train, test, model, backbone, prep)


def _run(args, layers, train, test, model, backbone, prep) -> None:
    from contrastive_transfer.ranks import done_by_rank0
    from converters.checkpoint_io import summary_lines

    # The inputs are valid; before the long work, prove the outputs can be written (by rank 0, the
    # one process that writes under a launcher).
    out = done_by_rank0(lambda: _writable_outputs(args))
    for line in summary_lines(backbone):
        logger.info(line)

    with eval_cli.summarised_warnings("transfer.voc07_svm") as caught:
        metrics = {
            "protocol": "voc07_svm",
            **eval_cli.source_record(args.weights, args.encoder, backbone),
            "preprocessing": prep.describe(),
            "svm": _svm_record(args),
            "train": {"split": args.train_split, "images": len(train.ids)},
            "test": {"split": args.test_split, "images": len(test.ids), **_chance_record(test.labels)},
            "layers": {},
        }
        if not _evaluate_layers(args, layers, model, backbone, prep, train, test, metrics, out, caught.add):
            return  # a rank other than 0: its shards of the features are extracted
    print(json.dumps({name: round(m["mAP"], 2) for name, m in metrics["layers"].items()}))


def _writable_outputs(args):
    out = ensure_writable_dir(args.output_dir, "--output-dir")
    if args.cache_dir:
        ensure_writable_dir(args.cache_dir, "--cache-dir")
    return out


def _evaluate_layers(args, layers, model, backbone, prep, train, test, metrics: dict, out, on_warnings) -> bool:
    """Features of both splits (cached), then the SVMs of each layer; metrics.json rewritten after each.
    False, with nothing written, on a rank other than 0 of a launcher (it extracts its shards only)."""
    from contrastive_transfer.cli import write_json
    from transfer.features import FeatureCache, LayerFeatures

    train.images.transform = test.images.transform = prep.transform()
    cache = FeatureCache(args.cache_dir or out / "features", backbone, prep)
    kwargs = dict(batch_size=args.batch_size, workers=args.workers)
    make = lambda names: LayerFeatures(model, names)  # noqa: E731
    train_feats = cache.get(make, train.images, args.train_split, layers, **kwargs)
    test_feats = cache.get(make, test.images, args.test_split, layers, **kwargs)
    if train_feats is None:
        return False
    described = LayerFeatures(model, layers).describe(prep.crop)
    for name in layers:
        start = time.time()
        result = run_svms(
            train_feats[name],
            train.labels,
            test_feats[name],
            test.labels,
            train.classes,
            args.costs,
            args.jobs,
            on_warnings=on_warnings,
            solver=args.solver,
            tol=args.svm_tol,
        )
        metrics["layers"][name] = {**described[name], **result.to_json(), "svm_seconds": time.time() - start}
        logger.info("%s (%d-d): VOC07 SVM mAP %.2f", name, described[name]["dim"], result.map)
        write_json(out / "metrics.json", metrics)
    return True


if __name__ == "__main__":
    main()
