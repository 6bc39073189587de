"""The synthetic datasets are read by the real readers (detectron2, pycocotools, torchvision) and
agree with what the generator says it wrote."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from contrastive_transfer.synthetic import COCO_CATEGORIES, VOC_CLASSES, generate

VOC_SPLITS = [
    ("VOC2007", "trainval"),
    ("VOC2007", "train"),
    ("VOC2007", "val"),
    ("VOC2007", "test"),
    ("VOC2012", "trainval"),
]


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_seed_same_bytes_regardless_of_workers(synthetic_root, tmp_path):
    generate(tmp_path / "again", seed=0, preset="tiny", workers=2)
    assert _tree_digest(tmp_path / "again") == _tree_digest(synthetic_root)
    generate(tmp_path / "other", seed=1, preset="tiny", workers=1)
    a = (synthetic_root / "VOC2007" / "JPEGImages" / "000001.jpg").read_bytes()
    assert (tmp_path / "other" / "VOC2007" / "JPEGImages" / "000001.jpg").read_bytes() != a


def test_imagenet_imagefolder(synthetic_root, synthetic_manifest):
    from torchvision.datasets import ImageFolder

    for split in ("train", "val"):
        ds = ImageFolder(str(synthetic_root / "imagenet" / split))
        expected = synthetic_manifest["imagenet"][split]
        assert sorted(ds.classes) == sorted(synthetic_manifest["imagenet"]["classes"])
        assert len(ds.classes) >= 10
        assert len(ds) == expected["images"]
        counts = Counter(ds.classes[t] for t in ds.targets)
        assert counts == Counter(expected["per_class"])
        image, target = ds[0]
        assert image.mode == "RGB" and min(image.size) >= 64
        assert ds.samples[0][0].endswith(".JPEG")


@pytest.mark.parametrize("year,split", VOC_SPLITS)
def test_voc_read_by_detectron2(synthetic_root, synthetic_manifest, year, split):
    from detectron2.data.datasets.pascal_voc import load_voc_instances

    expected = synthetic_manifest[year]["splits"][split]
    dicts = load_voc_instances(str(synthetic_root / year), split, VOC_CLASSES)
    assert [d["image_id"] for d in dicts] == expected["ids"]
    for d in dicts:
        with Image.open(d["file_name"]) as im:
            assert im.size == (d["width"], d["height"])
        names = [VOC_CLASSES[a["category_id"]] for a in d["annotations"]]
        assert names == [name for name, _ in expected["objects"][d["image_id"]]]
        for a in d["annotations"]:
            x0, y0, x1, y1 = a["bbox"]
            assert 0 <= x0 < x1 <= d["width"] and 0 <= y0 < y1 <= d["height"]


def _xml_objects(path: Path) -> list[tuple[str, int, tuple[int, ...]]]:
    objs = ET.parse(path).getroot().findall("object")
    return [
        (
            o.findtext("name"),
            int(o.findtext("difficult")),
            tuple(int(o.find("bndbox").findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax")),
        )
        for o in objs
    ]


@pytest.mark.parametrize("year,split", VOC_SPLITS)
def test_voc_difficult_flags_and_per_class_files_agree_with_xml(synthetic_root, synthetic_manifest, year, split):
    root = synthetic_root / year
    expected = synthetic_manifest[year]["splits"][split]
    ids = (root / "ImageSets" / "Main" / f"{split}.txt").read_text().split()
    assert ids == expected["ids"]
    objects = {i: _xml_objects(root / "Annotations" / f"{i}.xml") for i in ids}
    for i in ids:
        assert [[n, d] for n, d, _ in objects[i]] == expected["objects"][i]
    for cls in VOC_CLASSES:
        lines = (root / "ImageSets" / "Main" / f"{cls}_{split}.txt").read_text().splitlines()
        labels = dict((parts[0], int(parts[1])) for parts in (line.split() for line in lines))
        assert list(labels) == ids
        for i in ids:
            flags = [d for n, d, _ in objects[i] if n == cls]
            want = -1 if not flags else (1 if 0 in flags else 0)  # 0: present only as difficult
            assert labels[i] == want, (cls, split, i)


def test_voc_has_difficult_objects_and_difficult_only_labels(synthetic_root, synthetic_manifest):
    splits = synthetic_manifest["VOC2007"]["splits"]
    for split in ("trainval", "test"):
        flags = [d for objs in splits[split]["objects"].values() for _, d in objs]
        assert 0 < sum(flags) < len(flags), split
    zeros = sum(
        line.split()[1] == "0"
        for f in (synthetic_root / "VOC2007" / "ImageSets" / "Main").glob("*_trainval.txt")
        for line in f.read_text().splitlines()
    )
    assert zeros > 0


def test_voc_splits_are_disjoint_and_2012_is_trainval_only(synthetic_root):
    main07 = synthetic_root / "VOC2007" / "ImageSets" / "Main"
    read = lambda p: set(p.read_text().split())  # noqa: E731
    train, val, trainval, test = (read(main07 / f"{s}.txt") for s in ("train", "val", "trainval", "test"))
    assert train | val == trainval and not train & val and not trainval & test
    main12 = synthetic_root / "VOC2012" / "ImageSets" / "Main"
    assert sorted(p.name for p in main12.glob("*.txt") if "_" not in p.name) == ["trainval.txt"]


@pytest.mark.parametrize("split", ["train2017", "val2017"])
def test_coco_read_by_pycocotools_and_detectron2(synthetic_root, synthetic_manifest, split):
    from detectron2.data.datasets.coco import load_coco_json
    from pycocotools.coco import COCO

    json_file = synthetic_root / "coco" / "annotations" / f"instances_{split}.json"
    coco = COCO(str(json_file))
    expected = synthetic_manifest["coco"][split]
    assert len(coco.getImgIds()) == expected["images"]
    assert len(coco.getAnnIds()) == expected["annotations"]
    ids = sorted(coco.getCatIds())
    assert len(ids) == 80 and ids[-1] == 90 and ids != list(range(1, 81))  # non-contiguous, as COCO
    per_category = Counter(a["category_id"] for a in coco.dataset["annotations"])
    assert {str(k): v for k, v in per_category.items()} == expected["per_category"]

    unhidden = set(expected["fully_visible_annotation_ids"])
    for ann in coco.dataset["annotations"]:
        img = coco.imgs[ann["image_id"]]
        x, y, w, h = ann["bbox"]
        assert 0 <= x and 0 <= y and x + w <= img["width"] and y + h <= img["height"]
        assert 0 < ann["area"] <= w * h and ann["iscrowd"] == 0
        # Re-rasterize the outline: the box (of the visible pixels) lies within the outline's
        # pixels, and equals their extent when the object is fully visible.
        outline = Image.new("L", (img["width"], img["height"]))
        ImageDraw.Draw(outline).polygon(ann["segmentation"][0], fill=1, outline=1)
        ys, xs = np.nonzero(np.asarray(outline))
        extent = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
        assert extent[0] - 1 <= x and extent[1] - 1 <= y and x + w <= extent[2] + 1 and y + h <= extent[3] + 1
        if ann["id"] in unhidden:
            assert np.allclose((x, y, x + w, y + h), extent, atol=1), (ann, extent)
    assert len(unhidden) >= len(coco.dataset["annotations"]) // 4

    dicts = load_coco_json(str(json_file), str(synthetic_root / "coco" / split), f"synthetic_test_{split}")
    assert len(dicts) == expected["images"]
    assert sum(len(d["annotations"]) for d in dicts) == expected["annotations"]
    for d in dicts:
        assert Path(d["file_name"]).is_file()


def test_coco_categories_are_the_real_ones():
    from detectron2.data.datasets.builtin_meta import COCO_CATEGORIES as D2

    assert [(c["id"], c["name"]) for c in D2 if c["isthing"]] == list(COCO_CATEGORIES)


def test_places205_file_lists(synthetic_root, synthetic_manifest):
    root = synthetic_root / "places205"
    images = root / "data" / "vision" / "torralba" / "deeplearning" / "images256"
    for split in ("train", "val"):
        lines = (root / "trainvalsplit_places205" / f"{split}_places205.csv").read_text().splitlines()
        pairs = [line.split(" ") for line in lines]
        assert all(len(p) == 2 for p in pairs)
        labels = Counter(int(label) for _, label in pairs)
        classes = synthetic_manifest["places205"]["classes"]
        assert len(lines) == synthetic_manifest["places205"][split]["images"]
        assert sorted(labels) == list(range(len(classes)))
        for rel, label in pairs:
            assert rel.startswith(classes[int(label)] + "/") and (images / rel).is_file()


def test_cli_rerun_is_a_noop_and_foreign_data_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "contrastive_transfer.synthetic", "--out", str(tmp_path), "--preset", "tiny"]
    subprocess.run(cmd, check=True, capture_output=True)
    manifest = tmp_path / "manifest.json"
    before = manifest.stat().st_mtime_ns
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    assert manifest.stat().st_mtime_ns == before and "VOC2007" in out

    foreign = tmp_path / "foreign"
    (foreign / "coco").mkdir(parents=True)
    (foreign / "coco" / "mine.txt").write_text("keep me")
    res = subprocess.run(cmd[:4] + [str(foreign)], capture_output=True, text=True)
    assert res.returncode != 0 and "--force" in res.stderr
    assert (foreign / "coco" / "mine.txt").read_text() == "keep me"

    res = subprocess.run(cmd[:-1] + ["huge"], capture_output=True, text=True)
    assert res.returncode != 0 and "huge" in res.stderr


# slow: a minute of training; marked so, its module is also scheduled among the first (tests/conftest.py)
@pytest.mark.slow
def test_class_is_in_the_pixels_a_trained_network_learns_it_a_random_one_does_not(synthetic_root):
    """Issue 2: a ResNet-18 (detectron2-convertible 7×7 stem, 64 px) trained for ``steps`` supervised
    steps separates the ImageNet-like classes in kNN on the val split; its random init does not.
    Measured (seed 0): random init 32 %; 40 steps 71 % (68 % with ATEN_CPU_CAPABILITY=default), as
    many as after 60; 30 steps 62 %."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    from pretrain.data import eval_transform
    from pretrain.knn import knn_accuracy
    from pretrain.models import build_backbone

    steps = 40
    train_dir, val_dir = synthetic_root / "imagenet" / "train", synthetic_root / "imagenet" / "val"
    torch.manual_seed(0)
    backbone, dim = build_backbone("resnet18", "imagenet")
    classifier = torch.nn.Linear(dim, 10)

    def knn() -> float:
        return knn_accuracy(backbone, str(train_dir), str(val_dir), 64, torch.device("cpu"), k=20)

    random_init = knn()

    data = ImageFolder(str(train_dir), transform=eval_transform(64))
    loader = DataLoader(data, batch_size=32, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam([*backbone.parameters(), *classifier.parameters()], lr=1e-3)
    step = 0
    while step < steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(classifier(backbone(x)), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
    trained = knn()
    print(
        f"\nkNN top-1 on imagenet/val (10 classes, chance 10%): supervised {steps} steps {trained:.1f}%, "
        f"random init {random_init:.1f}%"
    )
    assert random_init < 40, "the class must not be readable by an untrained network"
    assert trained >= max(45.0, random_init + 20.0)


def test_a_manifest_that_is_not_the_generators_is_one_line(tmp_path):
    """The generator reads its earlier manifest.json back through the gate and the JSON limits: a
    list there (before: AttributeError) or deep nesting is one line naming it; the folder is kept."""
    from contrastive_transfer.cli import UserError

    for text in ("[1, 2]", "[" * 100_000):
        (tmp_path / "manifest.json").write_text(text)
        with pytest.raises((UserError, ValueError)) as e:
            generate(tmp_path, seed=0, preset="tiny")
        assert "manifest.json" in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert (tmp_path / "manifest.json").read_text() == text
