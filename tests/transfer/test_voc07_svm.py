"""VOC07 SVM protocol: AP definition, equality with the straightforward scikit-learn loop, labels."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from sklearn.model_selection import cross_val_score
from sklearn.svm import LinearSVC

from contrastive_transfer.cli import UserError
from contrastive_transfer.synthetic import VOC_CLASSES
from transfer.datasets.readers import read_voc_labels
from transfer.voc07_protocol import chance_map, check_disjoint, scoring_targets, training_targets, voc_ap
from transfer.voc07_solvers import run_svms
from transfer.voc07_svm import main

# ------------------------------------------------------------------------------------------- AP


def ap_by_positives(scores, targets) -> float:
    """All-point interpolated AP written differently: mean over positives of the best precision at
    any rank at or below that positive's rank (no ties in the scores)."""
    order = np.argsort(-np.asarray(scores))
    hits = np.asarray(targets)[order] == 1
    precision = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    return float(np.mean([precision[k:].max() for k in np.nonzero(hits)[0]]))


def ap_11_point(scores, targets) -> float:
    order = np.argsort(-np.asarray(scores))
    hits = np.asarray(targets)[order] == 1
    tp = np.cumsum(hits)
    recall, precision = tp / hits.sum(), tp / np.arange(1, len(hits) + 1)
    return float(np.mean([precision[recall >= t].max() if (recall >= t).any() else 0.0 for t in np.linspace(0, 1, 11)]))


def test_ap_hand_computed_cases():
    # P = 1, 1/2, 1/3, 1/2, 3/5 at R = 1/3, 1/3, 1/3, 2/3, 1: the envelope lifts the 1/2 at R = 2/3 to 3/5.
    scores, targets = [5, 4, 3, 2, 1], [1, -1, -1, 1, 1]
    assert voc_ap(scores, targets) == pytest.approx((1 + 0.6 + 0.6) / 3, abs=1e-12)
    # 11-point: max precision 1 at recall 0, .1, .2, .3 and 3/5 at .4 ... 1.0.
    assert ap_11_point(scores, targets) == pytest.approx((4 * 1 + 7 * 0.6) / 11, abs=1e-12)
    assert abs(voc_ap(scores, targets) - ap_11_point(scores, targets)) > 0.01
    assert voc_ap([3, 2, 1], [1, 1, -1]) == pytest.approx(1.0)
    assert voc_ap([3, 2, 1], [-1, -1, 1]) == pytest.approx(1 / 3)
    # Precision already non-increasing: no interpolation, 11-point still differs.
    assert voc_ap([4, 3, 2, 1], [1, -1, 1, -1]) == pytest.approx((1 + 2 / 3) / 2)
    assert ap_11_point([4, 3, 2, 1], [1, -1, 1, -1]) == pytest.approx((6 * 1 + 5 * 2 / 3) / 11)


def test_ap_matches_positive_wise_definition_on_random_rankings():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(5, 60))
        targets = np.where(rng.random(n) < 0.3, 1, -1)
        targets[0] = 1
        scores = rng.normal(size=n)
        assert voc_ap(scores, targets) == pytest.approx(ap_by_positives(scores, targets), abs=1e-12)


def exact_chance_ap(targets) -> float:
    """Expected AP of a uniformly random ranking, by enumerating every ranking (ties have
    probability 0) and averaging the positive-wise AP: the brute force chance_map estimates."""
    rankings = itertools.permutations(range(len(targets)))
    return float(np.mean([ap_by_positives(-np.asarray(r), targets) for r in rankings]))


def test_chance_map_is_the_mean_ap_of_random_rankings():
    # One positive among two: AP 1 when it is ranked first, 1/2 when second; mean 3/4, std 1/4.
    mean, std = chance_map(np.array([[1], [-1]]), draws=2000)
    assert mean == pytest.approx(75.0, abs=4 * 25 / np.sqrt(2000)) and std == pytest.approx(25.0, rel=0.05)
    # Two classes, 7 images, a difficult one (0) dropped from class 0's scoring.
    labels = np.array([[1, -1], [-1, 1], [0, -1], [1, -1], [-1, -1], [-1, 1], [-1, 1]])
    expected = 100 * np.mean([exact_chance_ap(scoring_targets(labels, c)[1]) for c in range(2)])
    mean, std = chance_map(labels, draws=2000)
    assert mean == pytest.approx(expected, abs=4 * std / np.sqrt(2000))
    assert chance_map(labels) == chance_map(labels)  # seeded: a table's floor does not move between runs


# ------------------------------------------------------------------------------------------ SVM


def reference_map(xtr, ltr, xte, lte, costs) -> tuple[float, list[float]]:
    """The FAIR tools' loop, written out: per class, per cost, cross_val_score + refit (dense input)."""
    normalize = lambda x: x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-5)  # noqa: E731
    xtr, xte = normalize(xtr.astype(np.float64)), normalize(xte.astype(np.float64))
    aps, chosen = [], []
    for c in range(ltr.shape[1]):
        y = np.where(ltr[:, c] == 1, 1, -1)  # difficult (0) is a negative in training
        best, best_model, best_cost = -1.0, None, None
        for cost in costs:
            svm = LinearSVC(
                C=cost,
                class_weight={1: 2, -1: 1},
                intercept_scaling=1.0,
                penalty="l2",
                loss="squared_hinge",
                dual=True,
                tol=1e-4,
                max_iter=2000,
                random_state=0,
            )
            cv = cross_val_score(svm, xtr, y, cv=3, scoring="average_precision").mean()
            svm.fit(xtr, y)
            if cv > best:
                best, best_model, best_cost = cv, svm, cost
        keep = lte[:, c] != 0  # difficult images do not count at test
        aps.append(ap_by_positives(best_model.decision_function(xte[keep]), np.where(lte[keep, c] == 1, 1, -1)))
        chosen.append(best_cost)
    return 100 * float(np.mean(aps)), chosen


def random_problem(seed: int, n_train=150, n_test=120, dim=24, classes=4):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, dim))

    def split(n):
        labels = np.where(rng.random((n, classes)) < 0.3, 1, -1).astype(np.int8)
        labels[rng.random((n, classes)) < 0.08] = 0  # difficult
        x = rng.normal(size=(n, dim)) + 0.6 * (labels != -1) @ centers
        return np.maximum(x, 0).astype(np.float32), labels  # ReLU-like: exact zeros, as CNN features

    return (*split(n_train), *split(n_test))


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_map_equals_straightforward_sklearn_loop():
    xtr, ltr, xte, lte = random_problem(0)
    costs = [0.01, 0.1, 1.0, 10.0, 100.0]
    ref_map, ref_costs = reference_map(xtr, ltr, xte, lte, costs)
    ours = run_svms(xtr, ltr, xte, lte, [f"c{i}" for i in range(4)], costs, jobs=2, solver="liblinear")
    assert ours.map == pytest.approx(ref_map, abs=1e-6)
    assert list(ours.chosen_cost) == ref_costs
    assert len(set(ref_costs)) > 1 or 0 < ref_map < 100  # a problem where the choice matters


def test_separable_features_give_map_100():
    rng = np.random.default_rng(1)

    def split(n):
        labels = np.where(rng.random((n, 3)) < 0.4, 1, -1).astype(np.int8)
        labels[:3] = 1  # enough positives per fold
        return np.concatenate([(labels == 1) * 1.0, 0.01 * rng.random((n, 5))], axis=1), labels

    xtr, ltr = split(60)
    xte, lte = split(40)
    assert run_svms(xtr, ltr, xte, lte, ["a", "b", "c"], [0.1, 1.0, 10.0], jobs=1).map == pytest.approx(100.0)


# ---------------------------------------------------------------------------------- labels, splits


def write_voc(root, split, table: dict[str, dict[str, int]], extra_files=("trainval.txt",)):
    main_dir = root / "ImageSets" / "Main"
    main_dir.mkdir(parents=True, exist_ok=True)
    (root / "JPEGImages").mkdir(exist_ok=True)
    ids = list(next(iter(table.values())))
    for cls, labels in table.items():
        (main_dir / f"{cls}_{split}.txt").write_text("".join(f"{i} {labels[i]:2d}\n" for i in ids))
    for name in extra_files:
        (main_dir / name).write_text("".join(f"{i}\n" for i in ids))
    for i in ids:
        (root / "JPEGImages" / f"{i}.jpg").write_bytes(b"")
    return ids


def test_difficult_and_class_order_follow_the_voc_files(tmp_path):
    table = {
        "dog": {"000005": 1, "000007": 0, "000009": -1},
        "cat": {"000005": -1, "000007": 1, "000009": 0},
        "aeroplane": {"000005": 0, "000007": -1, "000009": 1},
    }
    write_voc(tmp_path, "trainval", table)
    voc = read_voc_labels(tmp_path, "trainval")
    assert voc.classes == ["aeroplane", "cat", "dog"]  # sorted file names; trainval.txt is not a class
    assert voc.ids == ["000005", "000007", "000009"]
    assert voc.labels.tolist() == [[0, -1, 1], [-1, 1, 0], [1, 0, -1]]
    # Training: difficult (0) becomes a negative, all images kept.
    assert training_targets(voc.labels).tolist() == [[-1, -1, 1], [-1, 1, -1], [1, -1, -1]]
    # Test: difficult images dropped for that class only.
    keep, y = scoring_targets(voc.labels, 2)  # dog
    assert keep.tolist() == [True, False, True] and y.tolist() == [1, -1]


def test_synthetic_voc_labels_match_the_generated_objects(synthetic_root, synthetic_manifest):
    voc = read_voc_labels(synthetic_root / "VOC2007", "test")
    assert voc.classes == sorted(VOC_CLASSES)
    split = synthetic_manifest["VOC2007"]["splits"]["test"]
    assert voc.ids == split["ids"]
    for i, image_id in enumerate(voc.ids):
        for c, cls in enumerate(voc.classes):
            flags = [difficult for name, difficult in split["objects"][image_id] if name == cls]
            expected = -1 if not flags else (1 if 0 in flags else 0)
            assert voc.labels[i, c] == expected, (image_id, cls)


def test_testing_on_trainval_is_refused(synthetic_root, tmp_path):
    voc = synthetic_root / "VOC2007"
    trainval = read_voc_labels(voc, "trainval").ids
    with pytest.raises(UserError, match="shares 40 of its 40 images"):
        check_disjoint(trainval, trainval, "trainval", "trainval")
    with pytest.raises(UserError, match="shares"):  # a partial overlap is refused too
        check_disjoint(trainval, read_voc_labels(voc, "val").ids, "trainval", "val")
    with pytest.raises(UserError, match="not the 4952"):
        check_disjoint([str(i) for i in range(5011)], ["x"] * 4000, "trainval", "test")
    with pytest.raises(SystemExit, match="training split 'trainval'"):
        main(
            [
                "--weights",
                str(tmp_path / "unused.pth"),
                "--voc-root",
                str(voc),
                "--test-split",
                "trainval",
                "--output-dir",
                str(tmp_path / "out"),
            ]
        )
    assert not (tmp_path / "out").exists()
