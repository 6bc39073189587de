"""VOC 2007/2012 and COCO 2017 under one root, registered under detectron2's builtin names.

The root is ``--data-root`` or ``$DETECTRON2_DATASETS`` (default ``./datasets``) and holds
``VOC2007/``, ``VOC2012/`` (devkit layout, not ``VOCdevkit/VOC2007``) and ``coco/`` — the layout
detectron2 documents and ``transfer.datasets.synthetic`` writes, so pointing the root at the
synthetic datasets trains on them under the same names.

detectron2 registers these names itself at import time, but only from ``$DETECTRON2_DATASETS``
and without checking anything until the data is first read (for a test set: after training).
We re-register them so that a missing split file, annotation or image is a one-line error
naming the file, raised before training starts (:func:`check_datasets`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets.builtin_meta import _get_builtin_metadata
from detectron2.data.datasets.coco import load_coco_json
from detectron2.data.datasets.pascal_voc import CLASS_NAMES as VOC_CLASS_NAMES
from detectron2.data.datasets.pascal_voc import load_voc_instances


class DatasetError(FileNotFoundError):
    """A dataset file is missing or unreadable; the message names it and the expected layout."""


def default_root() -> Path:
    return Path(os.path.expanduser(os.getenv("DETECTRON2_DATASETS", "datasets")))


def _all_images_exist(name: str, records: list[dict]) -> list[dict]:
    for record in records:
        if not os.path.isfile(record["file_name"]):
            raise DatasetError(f"dataset {name}: image {record['file_name']} is missing "
                               f"({len(records)} images listed)")
    return records


@dataclass(frozen=True)
class VocSplit:
    """``<root>/<folder>/ImageSets/Main/<split>.txt`` listing ids of ``Annotations/<id>.xml``
    and ``JPEGImages/<id>.jpg``. Year 2007 selects the VOC07 11-point AP in evaluation."""

    folder: str
    split: str

    @property
    def year(self) -> int:
        return int(self.folder[-4:])

    def required(self, root: Path) -> list[Path]:
        base = root / self.folder
        return [base / "ImageSets" / "Main" / f"{self.split}.txt", base / "Annotations", base / "JPEGImages"]

    def load(self, name: str, root: Path) -> list[dict]:
        base = root / self.folder
        ids = (base / "ImageSets" / "Main" / f"{self.split}.txt").read_text().split()
        for image_id in ids:  # load_voc_instances would stop at the first one with a bare errno
            if not (base / "Annotations" / f"{image_id}.xml").is_file():
                raise DatasetError(f"dataset {name}: annotation {base / 'Annotations' / image_id}.xml "
                                   f"is missing (listed in ImageSets/Main/{self.split}.txt)")
        return _all_images_exist(name, load_voc_instances(str(base), self.split, VOC_CLASS_NAMES))

    def register(self, name: str, root: Path) -> None:
        DatasetCatalog.register(name, partial(self.load, name, root))
        MetadataCatalog.get(name).set(thing_classes=list(VOC_CLASS_NAMES), dirname=str(root / self.folder),
                                      year=self.year, split=self.split, evaluator_type="pascal_voc")


@dataclass(frozen=True)
class CocoSplit:
    """COCO instances JSON plus its image folder (categories keep their official ids; detectron2
    maps them to contiguous ones)."""

    image_dir: str
    json_file: str

    def required(self, root: Path) -> list[Path]:
        return [root / self.json_file, root / self.image_dir]

    def load(self, name: str, root: Path) -> list[dict]:
        return _all_images_exist(name, load_coco_json(str(root / self.json_file), str(root / self.image_dir), name))

    def register(self, name: str, root: Path) -> None:
        DatasetCatalog.register(name, partial(self.load, name, root))
        MetadataCatalog.get(name).set(json_file=str(root / self.json_file), image_root=str(root / self.image_dir),
                                      evaluator_type="coco", **_get_builtin_metadata("coco"))


# detectron2's builtin names (detectron2/data/datasets/builtin.py) for the sets this project uses.
DATASETS: dict[str, VocSplit | CocoSplit] = {
    **{f"voc_2007_{s}": VocSplit("VOC2007", s) for s in ("trainval", "train", "val", "test")},
    **{f"voc_2012_{s}": VocSplit("VOC2012", s) for s in ("trainval", "train", "val")},
    "coco_2017_train": CocoSplit("coco/train2017", "coco/annotations/instances_train2017.json"),
    "coco_2017_val": CocoSplit("coco/val2017", "coco/annotations/instances_val2017.json"),
}


def register_datasets(root: str | os.PathLike | None = None) -> Path:
    """(Re-)register every name of :data:`DATASETS` under `root` (default: :func:`default_root`).
    Must run in every process: spawned workers start from detectron2's own registration."""
    root = Path(root).expanduser().resolve() if root is not None else default_root().resolve()
    for name, spec in DATASETS.items():
        if name in DatasetCatalog.list():
            DatasetCatalog.remove(name)
            MetadataCatalog.remove(name)
        spec.register(name, root)
    return root


def check_datasets(names, root: str | os.PathLike | None = None, load: bool = False) -> None:
    """Raise :class:`DatasetError` naming the first missing file of the datasets `names`.

    Checks the split list / JSON and folders; with `load`, also reads every annotation and checks
    that each listed image exists (a few seconds for a COCO-sized set)."""
    root = Path(root).expanduser().resolve() if root is not None else default_root().resolve()
    for name in names:
        spec = DATASETS.get(name)
        if spec is None:
            if name not in DatasetCatalog.list():
                raise DatasetError(f"dataset {name!r} is not registered; known: {', '.join(sorted(DATASETS))}")
            continue  # registered by the user's own code: theirs to check
        required = spec.required(root)
        for path in required:
            if not path.exists():
                layout = " + ".join(str(p.relative_to(root)) for p in required)
                raise DatasetError(f"dataset {name}: {path} does not exist (expected {layout} under the data "
                                   f"root {root}; set --data-root or DETECTRON2_DATASETS)")
        if load:
            DatasetCatalog.get(name)
