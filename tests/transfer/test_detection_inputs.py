"""Detection inputs validated when read, each failure one line naming the file: COCO json without its
lists, annotations pointing to unknown images or categories, boxes of non-positive size or outside
the image (clipped within the tolerance and counted), images missing; VOC boxes likewise; and the
output directory locked for the job."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("detectron2")
from detectron2.structures import BoxMode  # noqa: E402

from contrastive_transfer.cli import OutputLock  # noqa: E402
from transfer.detection.__main__ import main  # noqa: E402
from transfer.detection.datasets import DatasetError, check_datasets, register_datasets  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "detection"
VAL_JSON = "coco/annotations/instances_val2017.json"


@pytest.fixture
def coco_root(synthetic_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(synthetic_root / "coco", root / "coco")
    register_datasets(root)
    yield root
    register_datasets()


def _edit(root: Path, change) -> Path:
    path = root / VAL_JSON
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


def _refused(root: Path, match: str) -> None:
    with pytest.raises(DatasetError) as e:
        check_datasets(["coco_2017_val"], root, load=True)
    message = str(e.value)
    assert "\n" not in message and "coco_2017_val" in message and re.search(match, message), message


def test_coco_json_without_its_lists_is_named(coco_root):
    path = _edit(coco_root, lambda d: d.pop("annotations"))
    _refused(coco_root, rf"{re.escape(str(path))} has no 'annotations' list")


def test_annotation_of_an_unknown_image_or_category(coco_root):
    original = (coco_root / VAL_JSON).read_text()
    _edit(coco_root, lambda d: d["annotations"][0].update(category_id=999))
    _refused(coco_root, r"category_id 999, which is not in 'categories'")
    (coco_root / VAL_JSON).write_text(original)
    _edit(coco_root, lambda d: d["annotations"][1].update(image_id=10**9))
    _refused(coco_root, r"points to image_id 1000000000, which is not in 'images'")


def test_box_of_non_positive_size(coco_root):
    _edit(coco_root, lambda d: d["annotations"][0].update(bbox=[5, 5, 0, 3]))
    _refused(coco_root, r"box of non-positive size")


def test_boxes_slightly_outside_are_clipped_and_counted_far_outside_refused(coco_root, caplog):
    data = json.loads((coco_root / VAL_JSON).read_text())
    ann = data["annotations"][0]
    image = next(i for i in data["images"] if i["id"] == ann["image_id"])
    width = image["width"]
    _edit(coco_root, lambda d: d["annotations"][0].update(bbox=[width - 10, 2, 11.5, 5]))  # 1.5 px over
    caplog.set_level(logging.WARNING, logger="detectron2")
    from detectron2.data import DatasetCatalog

    records = DatasetCatalog.get("coco_2017_val")
    assert "clipped 1 boxes" in caplog.text
    boxes = [(a["bbox"], a["bbox_mode"]) for r in records for a in r["annotations"] if r["width"] == width]
    assert all(BoxMode.convert(list(b), m, BoxMode.XYXY_ABS)[2] <= width for b, m in boxes)
    _edit(coco_root, lambda d: d["annotations"][0].update(bbox=[width - 10, 2, 60, 5]))  # 50 px over
    _refused(coco_root, r"outside the image")


def test_missing_image_is_named(coco_root):
    data = json.loads((coco_root / VAL_JSON).read_text())
    victim = coco_root / "coco" / "val2017" / data["images"][0]["file_name"]
    victim.unlink()
    _refused(coco_root, rf"image {re.escape(str(victim))} is missing")


def test_voc_box_outside_the_image_is_refused(synthetic_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(synthetic_root / "VOC2007", root / "VOC2007")
    image_id = (root / "VOC2007/ImageSets/Main/test.txt").read_text().split()[0]
    xml = root / "VOC2007/Annotations" / f"{image_id}.xml"
    text = xml.read_text()
    width = int(re.search(r"<width>(\d+)</width>", text).group(1))
    xml.write_text(re.sub(r"<xmax>\d+</xmax>", f"<xmax>{width + 40}</xmax>", text, count=1))
    register_datasets(root)
    try:
        with pytest.raises(DatasetError, match=rf"voc_2007_test: .*{image_id}\.jpg .*outside the image"):
            check_datasets(["voc_2007_test"], root, load=True)
    finally:
        register_datasets()


def test_a_second_job_into_a_locked_output_dir_is_refused(synthetic_root, tmp_path):
    out = tmp_path / "out"
    argv = [
        "--config-file",
        str(CONFIG_DIR / "tiny_voc0712_R_18_FPN_syncbn.yaml"),
        "--data-root",
        str(synthetic_root),
        "OUTPUT_DIR",
        str(out),
    ]
    with OutputLock(out, "OUTPUT_DIR"), pytest.raises(SystemExit) as e:
        main(argv)
    assert str(e.value).startswith(f"error: OUTPUT_DIR {out} is in use by another run (pid")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
