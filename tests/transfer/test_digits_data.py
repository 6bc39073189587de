"""The real-digits preset (``--preset digits``): every image is scikit-learn's digit it names, the
split is stratified and disjoint (scikit-learn's own stratified split as the judge of the class
counts), the detection canvases hold train digits for training and val digits for testing, and
detectron2's VOC loader, the project's registered loader and the SVM's reader all read it."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from contrastive_transfer.synthetic import generate
from contrastive_transfer.synthetic.digits import DIGIT_CLASSES, DIGITS, INK_THRESHOLD, stratified_split

SPLITS = [
    ("VOC2007", "trainval"),
    ("VOC2007", "train"),
    ("VOC2007", "val"),
    ("VOC2007", "test"),
    ("VOC2012", "trainval"),
]


@pytest.fixture(scope="module")
def manifest(digits_root) -> dict:
    return json.loads((digits_root / "manifest.json").read_text())


@pytest.fixture(scope="module")
def sklearn_digits():
    from sklearn.datasets import load_digits

    return load_digits()


def test_imagefolder_images_are_the_digits_they_name_split_stratified_and_disjoint(
    digits_root, manifest, sklearn_digits
):
    from sklearn.model_selection import train_test_split
    from torchvision.datasets import ImageFolder

    seen: dict[str, list[int]] = {}
    for split in ("train", "val"):
        ds = ImageFolder(str(digits_root / "imagenet" / split))
        assert ds.classes == [str(d) for d in range(10)]
        seen[split] = []
        for path, target in ds.samples:
            index = int(path.rsplit("/", 1)[1].split(".")[0])
            assert sklearn_digits.target[index] == target  # the folder is the digit's label
            seen[split].append(index)
        for path, _ in ds.samples[::97]:
            index = int(path.rsplit("/", 1)[1].split(".")[0])
            assert _unplaced_correlation(path, manifest["imagenet"][split]["placements"][f"{index:04d}"],
                                         sklearn_digits.images[index]) > 0.85  # fmt: skip
    train, val = set(seen["train"]), set(seen["val"])
    assert not train & val and train | val == set(range(1797))
    assert sorted(val) == manifest["imagenet"]["val"]["indices"]
    # Stratified: each class's val count is what scikit-learn's stratified split gives, within 1.
    _, ref_val = train_test_split(np.arange(1797), test_size=len(val), stratify=sklearn_digits.target, random_state=0)
    ours, ref = Counter(sklearn_digits.target[sorted(val)]), Counter(sklearn_digits.target[ref_val])
    assert all(abs(ours[c] - ref[c]) <= 1 for c in range(10)), (ours, ref)
    assert all(abs(ours[c] / np.sum(sklearn_digits.target == c) - DIGITS.val_fraction) < 0.01 for c in range(10))


@pytest.mark.parametrize("year,split", SPLITS)
def test_voc_read_by_detectron2_boxes_hold_every_digit_pixel(digits_root, manifest, year, split):
    from detectron2.data.datasets.pascal_voc import load_voc_instances

    expected = manifest[year]["splits"][split]
    dicts = load_voc_instances(str(digits_root / year), split, DIGIT_CLASSES)
    assert [d["image_id"] for d in dicts] == expected["ids"]
    for d in dicts:
        with Image.open(d["file_name"]) as im:
            assert im.size == (d["width"], d["height"]) and im.mode == "RGB"
            gray = np.asarray(im.convert("L"))
        names = [DIGIT_CLASSES[a["category_id"]] for a in d["annotations"]]
        assert names == [name for name, _ in expected["objects"][d["image_id"]]] and 1 <= len(names) <= 4
        inside = np.zeros_like(gray, dtype=bool)
        for a in d["annotations"]:
            x0, y0, x1, y1 = (int(round(v)) for v in a["bbox"])  # detectron2: 0-based, exclusive end
            assert 0 <= x0 < x1 <= d["width"] and 0 <= y0 < y1 <= d["height"]
            assert gray[y0:y1, x0:x1].max() > 160  # ink in every box
            inside[y0:y1, x0:x1] = True
        # brute force: no bright pixel outside the boxes (the background is noise around 24; JPEG
        # ringing stays below the ink threshold plus a margin)
        assert gray[~inside].max() < INK_THRESHOLD + 64, d["image_id"]


def test_detection_digits_train_from_train_test_from_val_and_the_project_loader_reads_them(digits_root, manifest):
    from transfer.detection.datasets import DATASETS

    train, val = set(manifest["imagenet"]["train"]["indices"]), set(manifest["imagenet"]["val"]["indices"])
    used = {
        (year, split): {i for digits in manifest[year]["splits"][split]["digits"].values() for i in digits}
        for year, split in SPLITS
    }
    for (year, split), indices in used.items():
        assert indices <= (val if split == "test" else train), (year, split)
    assert len(used[("VOC2007", "test")]) > 300  # the deck cycles through the split's digits
    ids = {s: set(manifest["VOC2007"]["splits"][s]["ids"]) for s in ("train", "val", "trainval", "test")}
    assert ids["train"] | ids["val"] == ids["trainval"] and not ids["train"] & ids["val"]
    assert not ids["trainval"] & ids["test"]
    first = Counter(objs[0][0] for objs in manifest["VOC2007"]["splits"]["test"]["objects"].values())
    assert first == Counter({str(c): 40 for c in range(10)})  # canvases balanced by their first digit
    for name in ("voc_2007_trainval", "voc_2007_test", "voc_2012_trainval"):
        records = DATASETS[name].load(name, digits_root)
        assert {a["category_id"] for r in records for a in r["annotations"]} == set(range(10))


def test_svm_split_has_the_ten_digit_classes_agreeing_with_the_annotations(digits_root, manifest):
    from transfer.datasets.readers import read_voc_labels

    for split in ("trainval", "test"):
        labels = read_voc_labels(digits_root / "VOC2007", split)
        assert labels.classes == [str(d) for d in range(10)]
        objects = manifest["VOC2007"]["splits"][split]["objects"]
        assert labels.ids == manifest["VOC2007"]["splits"][split]["ids"]
        for row, image_id in zip(labels.labels, labels.ids):
            present = {name for name, _ in objects[image_id]}
            assert [1 if c in present else -1 for c in labels.classes] == row.tolist()
        assert (labels.labels == 1).sum(axis=0).min() >= 30  # every class has positives for the SVM


def test_same_seed_same_bytes_another_seed_another_split(digits_root, manifest, sklearn_digits, tmp_path):
    again = generate(tmp_path / "again", seed=0, preset="digits")
    assert json.loads(json.dumps(again)) == manifest
    for rel in ("VOC2007/JPEGImages/000007.jpg", "imagenet/val/3/" + _first("3", manifest)):
        assert (tmp_path / "again" / rel).read_bytes() == (digits_root / rel).read_bytes()
    train, val = stratified_split(sklearn_digits.target, DIGITS.val_fraction, seed=1)
    assert sorted(val.tolist()) != manifest["imagenet"]["val"]["indices"]
    counts = np.bincount(sklearn_digits.target[val], minlength=10)
    assert {str(c): int(n) for c, n in enumerate(counts)} == manifest["imagenet"]["val"]["per_class"]
    assert not set(train) & set(val) and len(train) + len(val) == 1797


def _first(cls: str, manifest: dict) -> str:
    from sklearn.datasets import load_digits

    target = load_digits().target
    return f"{next(i for i in manifest['imagenet']['val']['indices'] if str(target[i]) == cls):04d}.JPEG"


def _unplaced_correlation(path, placement: dict, digit: np.ndarray) -> float:
    """The placed digit undone (cut out of its box, rotated back, 8×8 box means) against the source:
    their correlation; and nothing outside the box (black, up to JPEG ringing)."""
    x, y, w, h = placement["box"]
    side = placement["side"]
    with Image.open(path) as im:
        assert im.mode == "RGB" and im.size == (DIGITS.image_side,) * 2
        gray = im.convert("L")
    outside = np.asarray(gray).copy()
    outside[y : y + h, x : x + w] = 0
    assert outside.max() < 40
    back = gray.crop((x, y, x + w, y + h)).rotate(-placement["angle"], Image.Resampling.BILINEAR)
    left, top = (w - side) // 2, (h - side) // 2
    small = back.crop((left, top, left + side, top + side)).resize((8, 8), Image.Resampling.BOX)
    return float(np.corrcoef(np.asarray(small, dtype=np.float64).ravel(), digit.ravel())[0, 1])


def test_the_placement_check_fails_on_another_digit(digits_root, manifest, sklearn_digits):
    """The control of the pixel check: the same image against another digit's source correlates less."""
    index = manifest["imagenet"]["val"]["indices"][0]
    label = sklearn_digits.target[index]
    other = next(i for i in range(1797) if sklearn_digits.target[i] != label)
    path = digits_root / "imagenet" / "val" / str(label) / f"{index:04d}.JPEG"
    placement = manifest["imagenet"]["val"]["placements"][f"{index:04d}"]
    assert _unplaced_correlation(path, placement, sklearn_digits.images[other]) < 0.85
