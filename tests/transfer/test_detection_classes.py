"""The detection class list comes from the data: the digits register their 10 names, the head is
sized by them, and detectron2's own VOC evaluator (the judge) averages AP over those 10 classes;
real VOC's 20 names keep detectron2's order; sets with different lists are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets.pascal_voc import CLASS_NAMES
from detectron2.evaluation import PascalVOCDetectionEvaluator
from detectron2.structures import Boxes, Instances

from contrastive_transfer.errors import ConfigError
from transfer.detection.config import build_config, fit_num_classes
from transfer.detection.datasets import DatasetError, dataset_classes, register_datasets

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "detection" / "tiny_voc0712_R_18_FPN_frozen.yaml"
DIGITS = [str(d) for d in range(10)]
VOC_SETS = ["voc_2007_trainval", "voc_2012_trainval", "voc_2007_test"]


@pytest.fixture
def registered():
    yield register_datasets
    register_datasets()  # back to $DETECTRON2_DATASETS for whatever runs next


def _ground_truth_as_detections(evaluator, name: str, keep) -> None:
    """Every ground-truth box of the classes ``keep`` accepts, fed back as a detection of score 1."""
    for record in DatasetCatalog.get(name):
        kept = [a for a in record["annotations"] if keep(a["category_id"])]
        instances = Instances((record["height"], record["width"]))
        instances.pred_boxes = Boxes(torch.tensor([a["bbox"] for a in kept], dtype=torch.float32).reshape(-1, 4))
        instances.scores = torch.ones(len(kept))
        instances.pred_classes = torch.tensor([a["category_id"] for a in kept], dtype=torch.int64)
        evaluator.process([{"image_id": record["image_id"]}], [{"instances": instances}])


def test_digits_train_ten_classes_and_the_voc_evaluator_averages_over_them(digits_root, registered):
    registered(digits_root)
    for name in VOC_SETS:
        assert MetadataCatalog.get(name).thing_classes == DIGITS
    classes = dataset_classes(VOC_SETS)
    assert classes == DIGITS
    cfg, _ = build_config(str(CONFIG), [])
    assert cfg.MODEL.ROI_HEADS.NUM_CLASSES == 20  # the VOC config's count ...
    sized, notes = fit_num_classes(cfg, classes, [])
    assert sized.MODEL.ROI_HEADS.NUM_CLASSES == 10 and "20 -> 10" in notes[0]  # ... gives way to the data's
    # detectron2's evaluator: every digit found -> AP 100; digits 0-4 found, 5-9 missed -> the mean
    # over 10 classes is 50 (over 20 VOC classes it would be 25, or NaN for the absent ones)
    for keep, expected in ((lambda c: True, 100.0), (lambda c: c < 5, 50.0)):
        evaluator = PascalVOCDetectionEvaluator("voc_2007_test")
        evaluator.reset()
        _ground_truth_as_detections(evaluator, "voc_2007_test", keep)
        bbox = evaluator.evaluate()["bbox"]
        assert bbox["AP50"] == pytest.approx(expected, abs=1e-6)
        assert bbox["AP"] == pytest.approx(expected, abs=1e-6)


def test_real_voc_names_keep_detectrons_order_and_count(synthetic_root, registered):
    registered(synthetic_root)  # the shapes are written with the 20 VOC names, as real VOC is
    classes = dataset_classes(VOC_SETS)
    assert classes == list(CLASS_NAMES)
    cfg, _ = build_config(str(CONFIG), [])
    same, notes = fit_num_classes(cfg, classes, [])
    assert same is cfg and notes == []


def test_sets_with_different_class_lists_and_a_contradicting_override_are_refused(
    digits_root, synthetic_root, registered, tmp_path
):
    (tmp_path / "VOC2007").symlink_to(digits_root / "VOC2007")
    (tmp_path / "VOC2012").symlink_to(synthetic_root / "VOC2012")
    registered(tmp_path)
    assert MetadataCatalog.get("voc_2012_trainval").thing_classes == list(CLASS_NAMES)
    with pytest.raises(DatasetError, match=r"dataset voc_2012_trainval has the classes .* but voc_2007_trainval"):
        dataset_classes(VOC_SETS)
    cfg, _ = build_config(str(CONFIG), ["MODEL.ROI_HEADS.NUM_CLASSES", "20"])
    with pytest.raises(ConfigError, match=r"override MODEL.ROI_HEADS.NUM_CLASSES 20: the datasets have 10 classes"):
        fit_num_classes(cfg, DIGITS, ["MODEL.ROI_HEADS.NUM_CLASSES", "20"])


def test_a_voc_layout_without_class_files_keeps_the_20_names(digits_root, registered, tmp_path):
    main = tmp_path / "VOC2007" / "ImageSets" / "Main"
    main.mkdir(parents=True)
    (main / "test.txt").write_text((digits_root / "VOC2007/ImageSets/Main/test.txt").read_text())
    registered(tmp_path)
    assert MetadataCatalog.get("voc_2007_test").thing_classes == list(CLASS_NAMES)


def test_a_class_list_beyond_the_cap_is_one_line(digits_root, registered, tmp_path):
    import shutil

    from transfer.detection.datasets import MAX_VOC_CLASSES, check_datasets

    shutil.copytree(digits_root / "VOC2007", tmp_path / "VOC2007")
    main = tmp_path / "VOC2007" / "ImageSets" / "Main"
    listing = (main / "0_test.txt").read_text()
    for c in range(MAX_VOC_CLASSES + 1 - 10):  # the head is sized by the class files: a flood is refused
        (main / f"extra{c}_test.txt").write_text(listing)
    registered(tmp_path)
    with pytest.raises(DatasetError, match=rf"voc_2007_test: .* has {MAX_VOC_CLASSES + 1} <class>_test.txt files"):
        check_datasets(["voc_2007_test"], tmp_path, load=True)
