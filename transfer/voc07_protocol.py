"""What the VOC07 SVM protocol computes (Goyal et al. 2019, fair_self_supervision_benchmark; VISSL
``train_svm``), whichever solver fits the SVMs (``transfer.voc07_solvers``):

* labels from ``ImageSets/Main/<cls>_<split>.txt`` (class order = sorted file names); train on
  trainval with difficult (0) → negative, test on test with difficult images dropped per class;
* features x ← x / (‖x‖₂ + 1e-5);
* per class, the cost C with the largest mean over a stratified, unshuffled 3-fold split of
  sklearn's average precision of the decision function (``cross_val_score(..., cv=3,
  scoring="average_precision")``; first on ties), refit on all of trainval;
* test AP = all-point interpolated AP (``voc_ap``); mAP = mean over classes × 100.

``chance_map`` gives the mAP of random rankings on a test split: the floor a table reads gains from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from contrastive_transfer.cli import UserError

logger = logging.getLogger(__name__)

# VISSL's VOC07 grid (configs/.../svm_voc07.yaml); the FAIR tools append 0.5**k, k = 4..19.
DEFAULT_COSTS = (0.01, 0.1, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 50.0, 100.0, 1000.0)
CV_FOLDS = 3
# VOC2007 sizes, for the refusal message and the count check on the real data set.
VOC07_TRAINVAL_IMAGES, VOC07_TEST_IMAGES = 5011, 4952


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


def per_class_ap(scores, test_labels: np.ndarray) -> np.ndarray:
    """Test AP of each class c from its decision values ``scores[c]`` on every test image."""
    aps = np.empty(len(scores))
    for c in range(len(aps)):
        keep, y = scoring_targets(test_labels, c)
        aps[c] = voc_ap(scores[c][keep], y)
    return aps


def chance_map(test_labels: np.ndarray, draws: int = 200, seed: int = 0) -> tuple[float, float]:
    """(mean, std) of the mAP × 100 that random rankings score on these test labels: i.i.d. uniform
    scores per class and image, ``draws`` times (seeded: the same labels give the same figures).

    What features without information score. It is well above 0 and grows as the split shrinks:
    a little above the mean positive rate on a large split, 20 on a split of 40 images with ~4 positives
    per class, where no gain between two backbones can be read.
    """
    rng = np.random.default_rng(seed)
    shape = (test_labels.shape[1], test_labels.shape[0])
    maps = [100 * float(per_class_ap(rng.random(shape), test_labels).mean()) for _ in range(draws)]
    return float(np.mean(maps)), float(np.std(maps))


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


def cv_folds(y: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (train, held-out) rows of cross_val_score(cv=3) for a classifier: stratified, unshuffled."""
    from sklearn.model_selection import StratifiedKFold

    return list(StratifiedKFold(CV_FOLDS).split(np.zeros((len(y), 1)), y))


def fold_ap(y: np.ndarray, scores: np.ndarray) -> float:
    """cross_val_score's "average_precision" on one held-out fold (positive label 1)."""
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(y, scores, pos_label=1))


def warn_few_positives(ytr: np.ndarray, classes: list[str]) -> None:
    """One warning for the classes with fewer positive training images than folds."""
    counts = (ytr == 1).sum(axis=0)
    few = [f"{name} ({counts[c]})" for c, name in enumerate(classes) if counts[c] < CV_FOLDS]
    if few:  # the reference runs anyway; so do we, but say so once
        logger.warning(
            "%d-fold CV: %d classes have fewer than %d positive training images, so some folds have "
            "none and score AP 0, as in cross_val_score: %s",
            CV_FOLDS,
            len(few),
            CV_FOLDS,
            ", ".join(few),
        )


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
                    # null where a fold could not be fit (one class in its training part): no score
                    "cv_ap": [float(v) if np.isfinite(v) else None for v in self.cv_ap[i]],
                    **(
                        {"objective_at_cost": float(self.refit_objective[i])}
                        if self.refit_objective is not None
                        else {}
                    ),
                }
                for i, c in enumerate(self.classes)
            },
        }
