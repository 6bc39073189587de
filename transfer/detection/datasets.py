"""VOC 2007/2012 and COCO 2017 under one root, registered under detectron2's builtin names.

The root is ``--data-root`` or ``$DETECTRON2_DATASETS`` (default ``./datasets``) and holds
``VOC2007/``, ``VOC2012/`` (devkit layout, not ``VOCdevkit/VOC2007``) and ``coco/`` — the layout
detectron2 documents and ``contrastive_transfer.synthetic`` writes, so pointing the root at the
synthetic datasets trains on them under the same names.

detectron2 registers these names itself at import time, but only from ``$DETECTRON2_DATASETS``
and without checking anything until the data is first read (for a test set: after training).
We re-register them so that a missing split file, annotation or image is a one-line error
naming the file, raised before training starts (:func:`check_datasets`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from xml.etree import ElementTree

from defusedxml import DefusedXmlException
from defusedxml import ElementTree as defused_etree
from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets.builtin_meta import _get_builtin_metadata
from detectron2.data.datasets.coco import load_coco_json
from detectron2.data.datasets.pascal_voc import CLASS_NAMES as VOC_CLASS_NAMES

from contrastive_transfer import json_limits
from contrastive_transfer.cli import UserError
from contrastive_transfer.images import MAX_IMAGE_PIXELS  # noqa: F401  (sets Pillow's limit in every process)
from contrastive_transfer.paths import inside
from contrastive_transfer.untrusted import UnsafeFileError, check_file, read_untrusted
from transfer.datasets.readers import voc_class_files


class DatasetError(UserError, FileNotFoundError):
    """A dataset file is missing or unreadable; the message names it and the expected layout."""


def default_root() -> Path:
    return Path(os.path.expanduser(os.getenv("DETECTRON2_DATASETS", "datasets")))


# A box may overhang its image by this much (pixels, or this fraction of the side if larger):
# annotation tools round, and VOC's 1-based corners reach the last pixel. It is clipped and counted;
# anything further out is a broken annotation and stops the run.
BOX_TOLERANCE_PX, BOX_TOLERANCE_FRACTION = 2.0, 0.01


def _checked(name: str, source: Path, records: list[dict]) -> list[dict]:
    """The records, after checking that every image exists and every box is a box inside its
    image (clipped within the tolerance, refused beyond); a one-line DatasetError otherwise."""
    from detectron2.structures import BoxMode

    if not records:
        raise DatasetError(f"dataset {name}: {source} lists no images")
    clipped = 0
    for record in records:
        if not os.path.lexists(record["file_name"]):
            raise DatasetError(
                f"dataset {name}: image {record['file_name']} is missing ({len(records)} images listed in {source})"
            )
        try:  # the gate, from a stat (nothing opened): a FIFO or a link to a device would hang a worker
            check_file(record["file_name"], "image")
        except UnsafeFileError as e:
            raise DatasetError(f"dataset {name}: {e}") from None
        width, height = record["width"], record["height"]
        for ann in record.get("annotations", []):
            x0, y0, x1, y1 = BoxMode.convert(list(ann["bbox"]), ann["bbox_mode"], BoxMode.XYXY_ABS)
            where = f"dataset {name}: {source}: image {record['file_name']} ({width}x{height})"
            if not (x1 > x0 and y1 > y0):
                raise DatasetError(f"{where} has a box of non-positive size {[x0, y0, x1, y1]}; fix or remove it")
            tol_x = max(BOX_TOLERANCE_PX, BOX_TOLERANCE_FRACTION * width)
            tol_y = max(BOX_TOLERANCE_PX, BOX_TOLERANCE_FRACTION * height)
            if x0 < -tol_x or y0 < -tol_y or x1 > width + tol_x or y1 > height + tol_y:
                raise DatasetError(
                    f"{where} has a box {[x0, y0, x1, y1]} outside the image (beyond the "
                    f"{BOX_TOLERANCE_PX:g} px / {BOX_TOLERANCE_FRACTION:.0%} tolerance); fix it"
                )
            box = [
                min(max(x0, 0.0), width),
                min(max(y0, 0.0), height),
                min(max(x1, 0.0), width),
                min(max(y1, 0.0), height),
            ]
            if box != [x0, y0, x1, y1]:
                clipped += 1
                ann["bbox"], ann["bbox_mode"] = box, BoxMode.XYXY_ABS
    if clipped:
        logging.getLogger("detectron2").warning(
            f"dataset {name}: clipped {clipped} boxes that overhung their image by less than the tolerance ({source})"
        )
    return records


MAX_SIDE = 65535  # pixels; an image size beyond, read from an annotation, is broken (or hostile)


def _check_coco_json(name: str, path: Path, image_root: Path) -> None:
    """The fields detectron2 reads, present, of the right types and consistent, before it reads them."""
    try:
        data = json_limits.loads(read_untrusted(path, "json"), f"dataset {name}: {path}")
    except UnsafeFileError as e:
        raise DatasetError(f"dataset {name}: {e}") from None
    except json_limits.JsonLimitError as e:
        raise DatasetError(str(e)) from None
    if not isinstance(data, dict):
        raise DatasetError(f"dataset {name}: {path} holds a {type(data).__name__}, expected a COCO instances object")
    missing = [key for key in ("images", "annotations", "categories") if not isinstance(data.get(key), list)]
    if missing:
        raise DatasetError(
            f"dataset {name}: {path} has no {' / '.join(repr(k) for k in missing)} list "
            "(a COCO instances file needs images, annotations and categories)"
        )
    for key, fields in _COCO_FIELDS.items():
        seen: dict = {}
        for i, entry in enumerate(data[key]):
            bad = "not an object" if not isinstance(entry, dict) else _bad_fields(entry, fields)
            if not bad and key != "categories" and seen.setdefault(entry["id"], i) != i:
                bad = f"has id {entry['id']!r:.40}, which {key}[{seen[entry['id']]}] has too (ids are unique)"
            if bad:
                raise DatasetError(f"dataset {name}: {path}: {key}[{i}] {bad}; fix the file")
    for image in data["images"]:  # detectron2 joins file_name to the image folder: it may not leave it
        inside(image_root, image["file_name"], f"dataset {name}: {path}: image {image['id']}")
    builtin = set(_get_builtin_metadata("coco")["thing_dataset_id_to_contiguous_id"])
    foreign = sorted({c["id"] for c in data["categories"]} - builtin)
    if foreign:
        raise DatasetError(
            f"dataset {name}: {path}: category ids {foreign[:5]} are not among the 80 COCO categories "
            "that the coco_2017 sets are registered with"
        )
    images = {image["id"] for image in data["images"]}
    categories = {category["id"] for category in data["categories"]}
    for ann in data["annotations"]:
        if ann["image_id"] not in images:
            raise DatasetError(
                f"dataset {name}: {path}: annotation {ann.get('id')} points to image_id "
                f"{ann['image_id']}, which is not in 'images'"
            )
        if ann["category_id"] not in categories:
            raise DatasetError(
                f"dataset {name}: {path}: annotation {ann.get('id')} has category_id "
                f"{ann['category_id']}, which is not in 'categories'"
            )


def _is_side(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_SIDE


def _is_box(v) -> bool:
    return (
        isinstance(v, list) and len(v) == 4 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
    )


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_segmentation(v) -> bool:
    """Polygons (lists of numbers) or an RLE object with ``counts`` and ``size``; empty: none."""
    if v is None or v == [] or v == {}:  # detectron2 skips an empty one
        return True
    if isinstance(v, list):
        return all(isinstance(p, list) and all(map(_is_number, p)) for p in v)
    if isinstance(v, dict):
        counts, size = v.get("counts"), v.get("size")
        return (
            (isinstance(counts, str) or (isinstance(counts, list) and all(isinstance(c, int) for c in counts)))
            and isinstance(size, list)
            and len(size) == 2
            and all(map(_is_side, size))
        )
    return False


# What detectron2's load_coco_json (and pycocotools' index under it) reads of each entry, and what
# it must be; a field marked optional is checked only where present.
_OPTIONAL = "optional"
_COCO_FIELDS = {
    "images": {
        "id": (lambda v: isinstance(v, (int, str)), "an integer or string"),
        "file_name": (lambda v: isinstance(v, str) and bool(v), "a relative path"),
        "height": (_is_side, f"an integer from 1 to {MAX_SIDE}"),
        "width": (_is_side, f"an integer from 1 to {MAX_SIDE}"),
    },
    "annotations": {
        "id": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
        "image_id": (lambda v: isinstance(v, (int, str)), "an integer or string"),
        "category_id": (lambda v: isinstance(v, int), "an integer"),
        "bbox": (_is_box, "a list of 4 numbers [x, y, w, h]"),
        "segmentation": (
            _is_segmentation,
            "polygons [[x, y, ...], ...] or an RLE object with 'counts' and 'size' [height, width]",
            _OPTIONAL,
        ),
        "keypoints": (
            lambda v: isinstance(v, list) and len(v) % 3 == 0 and all(map(_is_number, v)),
            "a list of numbers x, y, visibility per keypoint",
            _OPTIONAL,
        ),
        "iscrowd": (lambda v: v in (0, 1) and not isinstance(v, bool), "0 or 1", _OPTIONAL),
        "area": (lambda v: _is_number(v) and v >= 0, "a number >= 0 (COCO's evaluation bins objects by it)", _OPTIONAL),
        "ignore": (lambda v: v == 0 and not isinstance(v, bool), "0 (detectron2 reads no ignored objects)", _OPTIONAL),
    },
    "categories": {
        "id": (lambda v: isinstance(v, int), "an integer"),
        "name": (lambda v: isinstance(v, str), "a string"),
    },
}


def _bad_fields(entry: dict, fields: dict) -> str:
    for key, (ok, expected, *optional) in fields.items():
        if key not in entry:
            if optional:
                continue
            return f"lacks {key!r}"
        if not ok(entry[key]):
            return f"has {key}={entry[key]!r:.60}, expected {expected}"
    return ""


def _read_text(path: Path, name: str, kind: str) -> str:
    """The file's text through the gate (``untrusted``: a regular file within the cap of ``kind``)."""
    try:
        return read_untrusted(path, kind).decode("utf-8")
    except UnsafeFileError as e:
        raise DatasetError(f"dataset {name}: {e}") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"dataset {name}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _voc_record(name: str, base: Path, image_id: str, classes: list[str]) -> dict:
    """One image's record as detectron2's load_voc_instances builds it, from a defusedxml parse;
    ``category_id`` is the object's index in ``classes``."""
    from detectron2.structures import BoxMode

    path = base / "Annotations" / f"{image_id}.xml"
    where = f"dataset {name}: {path}"
    try:
        tree = ElementTree.ElementTree(defused_etree.fromstring(read_untrusted(path, "xml")))
    except UnsafeFileError as e:
        raise DatasetError(f"dataset {name}: {e}") from None
    except (DefusedXmlException, ElementTree.ParseError) as e:
        raise DatasetError(
            f"{where}: refused ({type(e).__name__}: {' '.join(str(e).split())}); VOC annotations are plain XML "
            "without entities or a DTD"
        ) from None
    try:
        height, width = int(tree.findtext("./size/height")), int(tree.findtext("./size/width"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DatasetError(f"{where}: no <size> with integer <width> and <height>; fix the annotation") from None
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE):
        raise DatasetError(f"{where}: <size> {width}x{height}, expected sides from 1 to {MAX_SIDE}")
    instances = []
    for obj in tree.findall("object"):
        cls = obj.findtext("name")
        if cls not in classes:
            shown = "the 20 VOC classes" if classes == list(VOC_CLASS_NAMES) else f"this set's classes {classes}"
            raise DatasetError(f"{where}: object class {cls!r:.40} is not one of {shown:.300}")
        try:
            bbox = [float(obj.findtext(f"bndbox/{k}")) for k in ("xmin", "ymin", "xmax", "ymax")]  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise DatasetError(f"{where}: a {cls} object without a numeric <bndbox> xmin/ymin/xmax/ymax") from None
        if not all(map(math.isfinite, bbox)):
            raise DatasetError(f"{where}: a {cls} object whose <bndbox> is not finite ({bbox})")
        bbox[0] -= 1.0  # 1-based inclusive pixel indices, as detectron2 reads them
        bbox[1] -= 1.0
        instances.append({"category_id": classes.index(cls), "bbox": bbox, "bbox_mode": BoxMode.XYXY_ABS})
    return {
        "file_name": os.path.join(str(base), "JPEGImages", image_id + ".jpg"),
        "image_id": image_id,
        "height": height,
        "width": width,
        "annotations": instances,
    }


# A class list read from file names is capped: the box head is sized by it.
MAX_VOC_CLASSES = 1000


@dataclass(frozen=True)
class VocSplit:
    """``<root>/<folder>/ImageSets/Main/<split>.txt`` listing ids of ``Annotations/<id>.xml``
    and ``JPEGImages/<id>.jpg``. Year 2007 selects the VOC07 11-point AP in evaluation.

    The classes are the data's (:meth:`classes`): the ``<cls>_<split>.txt`` files of the split, as
    the VOC07 SVM reads them; real VOC (and the synthetic shapes) have the 20 VOC classes there, the
    digits preset its 10 digits. Trained on 20 classes, 10 data never holds would each score AP 0
    and halve every mean the VOC evaluator reports."""

    folder: str
    split: str

    @property
    def year(self) -> int:
        return int(self.folder[-4:])

    def required(self, root: Path) -> list[Path]:
        base = root / self.folder
        return [base / "ImageSets" / "Main" / f"{self.split}.txt", base / "Annotations", base / "JPEGImages"]

    def classes(self, root: Path) -> list[str]:
        """The split's class names: detectron2's order of the 20 VOC names where the class files name
        exactly those (the order of every VOC model), else sorted (the SVM's order); the 20 VOC
        names where the split has no class files (a VOC layout with the split lists only)."""
        try:
            files = voc_class_files(root / self.folder / "ImageSets" / "Main", self.split)
            names = [p.stem.split("_")[0] for p in files]
        except OSError:  # unreadable folder: check_datasets names it when the set is used
            names = []
        if not names or set(names) == set(VOC_CLASS_NAMES):
            return list(VOC_CLASS_NAMES)
        return names

    def load(self, name: str, root: Path, classes: list[str] | None = None) -> list[dict]:
        classes = self.classes(root) if classes is None else classes
        if len(classes) > MAX_VOC_CLASSES:
            raise DatasetError(
                f"dataset {name}: {root / self.folder / 'ImageSets' / 'Main'} has {len(classes)} "
                f"<class>_{self.split}.txt files, more than the {MAX_VOC_CLASSES} classes a detector here is sized for"
            )
        base = root / self.folder
        listing = base / "ImageSets" / "Main" / f"{self.split}.txt"
        ids = _read_text(listing, name, "list").split()
        for image_id in ids:  # ids join Annotations/ and JPEGImages/: none may lead outside them
            inside(base / "Annotations", f"{image_id}.xml", f"dataset {name}: {listing}: image id {image_id!r}")
        for image_id in ids:  # a missing one named before any is parsed
            if not os.path.lexists(base / "Annotations" / f"{image_id}.xml"):
                raise DatasetError(
                    f"dataset {name}: annotation {base / 'Annotations' / image_id}.xml "
                    f"is missing (listed in ImageSets/Main/{self.split}.txt)"
                )
        # detectron2's load_voc_instances, restated over defusedxml: its xml.etree parse turns entities
        # into tracebacks (and PascalVOCDetectionEvaluator parses the same files again: only files
        # this check accepted reach it), its np.loadtxt fails on a split of one id.
        return _checked(name, base / "Annotations", [_voc_record(name, base, i, classes) for i in ids])

    def register(self, name: str, root: Path) -> None:
        classes = self.classes(root)
        DatasetCatalog.register(name, partial(self.load, name, root, classes))
        MetadataCatalog.get(name).set(
            thing_classes=classes,
            dirname=str(root / self.folder),
            year=self.year,
            split=self.split,
            evaluator_type="pascal_voc",
        )


@dataclass(frozen=True)
class CocoSplit:
    """COCO instances JSON plus its image folder (categories keep their official ids; detectron2
    maps them to contiguous ones)."""

    image_dir: str
    json_file: str

    def required(self, root: Path) -> list[Path]:
        return [root / self.json_file, root / self.image_dir]

    def load(self, name: str, root: Path) -> list[dict]:
        _check_coco_json(name, root / self.json_file, root / self.image_dir)
        return _checked(
            name, root / self.json_file, load_coco_json(str(root / self.json_file), str(root / self.image_dir), name)
        )

    def register(self, name: str, root: Path) -> None:
        DatasetCatalog.register(name, partial(self.load, name, root))
        MetadataCatalog.get(name).set(
            json_file=str(root / self.json_file),
            image_root=str(root / self.image_dir),
            evaluator_type="coco",
            **_get_builtin_metadata("coco"),
        )


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
                raise DatasetError(
                    f"dataset {name}: {path} does not exist (expected {layout} under the data "
                    f"root {root}; set --data-root or DETECTRON2_DATASETS)"
                )
        if load:
            DatasetCatalog.get(name)


def dataset_classes(names) -> list[str] | None:
    """The class list the registered datasets `names` share (their ``thing_classes``; None where none
    has one): a model trains on one list and is evaluated with it, so sets with different lists are
    refused, naming both."""
    first, classes = None, None
    for name in names:
        these = MetadataCatalog.get(name).get("thing_classes")
        if these is None:  # registered by the user's own code without classes: theirs to size
            continue
        if classes is None:
            first, classes = name, list(these)
        elif list(these) != classes:
            raise DatasetError(
                f"dataset {name} has the classes {list(these)[:12]!s:.300} but {first} has {classes[:12]!s:.300}: "
                "the training and test sets need one class list (VOC: the ImageSets/Main/<class>_<split>.txt files)"
            )
    return classes
