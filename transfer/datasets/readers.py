"""Image lists of the frozen-feature protocols: ImageNet folders, Places205 csv lists, VOC07 labels.

Each reader returns an ``ImageList`` (a packed index of paths + integer labels) that torch's
DataLoader reads; the VOC reader also returns the per-class label matrix of the VOC classification
files. Each also reads the same dataset written as tar shards (``python -m transfer.shards``). torchvision's
ImageFolder scan is reused for ImageNet; Places205's space-separated ``.csv`` lists and the VOC
per-class files have no reader in torchvision or detectron2 (detectron2 reads VOC boxes, not
the ``<cls>_<split>.txt`` image labels), hence these few lines.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

from contrastive_transfer.cli import UserError
from contrastive_transfer.file_index import FileIndex
from contrastive_transfer.image_list import ImageList
from contrastive_transfer.paths import escapes, inside, read_text, scan_image_folder
from contrastive_transfer.shards import index_shards, is_sharded, read_label_row

PLACES205_LISTS = "trainvalsplit_places205"
MAX_IMAGE_FOLDER_CLASSES = 100_000
PLACES205_CLASSES = 205  # labels 0..204; a class list is sized by the largest label, so it is checked first
PLACES205_IMAGES = "data/vision/torralba/deeplearning/images256"


class DatasetError(UserError, ValueError):
    """A dataset folder or file list that does not have the expected layout (one line)."""


def read_sharded(root: str | os.PathLike) -> ImageList | None:
    """The images of tar shards (``shard_paths``: a pattern ending in .tar, or ``ROOT-NNNNNN.tar``
    beside a missing folder ROOT), or None when ``root`` names no shards."""
    if not is_sharded(root):
        return None
    sharded = index_shards(root)
    check_class_count(sharded.index.classes, root)
    return ImageList(sharded.index)


def check_class_count(classes: list[str], root: str | os.PathLike) -> None:
    if len(classes) > MAX_IMAGE_FOLDER_CLASSES:  # a probe's head is sized by it
        raise DatasetError(
            f"{root}: {len(classes)} class folders, more than {MAX_IMAGE_FOLDER_CLASSES} (ImageNet-21k has 21,841); "
            "is this the folder of classes?"
        )


def read_image_folder(root: str | os.PathLike) -> ImageList:
    """torchvision ImageFolder layout ``root/<class>/<image>``; labels from sorted class folders.
    Tar shards of one (``python -m transfer.shards``) read the same (``read_sharded``)."""
    sharded = read_sharded(root)
    if sharded is not None:
        return sharded
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (expected an ImageFolder root <class>/<image>)")
    classes, class_to_idx = find_classes(str(root))
    check_class_count(classes, root)
    samples = scan_image_folder(root, class_to_idx, IMG_EXTENSIONS)  # each directory once: no link loop
    return ImageList(FileIndex.from_samples(root, samples, classes))


def read_places205(root: str | os.PathLike, split: str) -> ImageList:
    """``root/trainvalsplit_places205/<split>_places205.csv``: lines ``<relative path> <label>``
    (space separated despite the extension), images under ``root/data/vision/torralba/deeplearning/images256``."""
    sharded = read_sharded(Path(root) / split)
    if sharded is not None:
        return sharded
    root = Path(root)
    listing = root / PLACES205_LISTS / f"{split}_places205.csv"
    if not listing.is_file():
        raise FileNotFoundError(
            f"{listing}: missing (expected the Places205 file list "
            f"{PLACES205_LISTS}/{{train,val}}_places205.csv under --data-root)"
        )
    images = root / PLACES205_IMAGES
    names, labels = [], []  # names relative to images: packed as they are (2.45 M lines: no Path per line)
    for n, line in enumerate(read_text(listing, "Places205 list").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not (parts[1].isascii() and parts[1].isdigit()) or len(parts[1]) > 4:
            raise DatasetError(
                f"{listing}:{n}: expected '<relative/path.jpg> <label from 0 to {PLACES205_CLASSES - 1}>', "
                f"got {line[:200]!r}"
            )
        if int(parts[1]) >= PLACES205_CLASSES:
            raise DatasetError(
                f"{listing}:{n}: label {parts[1]} is not a Places205 class (expected 0 to {PLACES205_CLASSES - 1})"
            )
        if escapes(parts[0]):
            inside(images, parts[0], f"{listing}:{n}")  # the one line naming the list, the line and the path
        names.append(parts[0])
        labels.append(int(parts[1]))
    if not names:
        raise DatasetError(f"{listing}: no images listed")
    # Class names from the folder part of the paths (``a/abbey/x.jpg`` → ``a/abbey``), by label.
    folders: dict[int, str] = {}
    for name, y in zip(names, labels):
        if y not in folders:
            folders[y] = posixpath.dirname(name) or "."
    classes = [folders.get(y, str(y)) for y in range(max(labels) + 1)]
    return ImageList(FileIndex.from_samples(images, zip(names, labels), classes))


@dataclass
class VocLabels:
    """VOC classification labels of one split: ``labels[i, c]`` is the value of
    ``ImageSets/Main/<classes[c]>_<split>.txt`` for image ``ids[i]``: 1 present, -1 absent,
    0 present only as difficult."""

    split: str
    ids: list[str]
    classes: list[str]
    labels: np.ndarray  # (N, C) int8 in {1, -1, 0}
    images: ImageList


def voc_class_files(main: Path, split: str) -> list[Path]:
    """``main``'s ``<class>_<split>.txt`` files, sorted by class: the split's class list (names that
    split by ``_`` into exactly two parts, as the FAIR tools do: this skips ``trainval.txt``). Read
    by the SVM and by the detection sets' registration, so both see the same classes."""
    return sorted(p for p in main.glob(f"*_{split}.txt") if len(p.stem.split("_")) == 2)


def read_voc_labels(voc_root: str | os.PathLike, split: str) -> VocLabels:
    """Class order = sorted ``<cls>_<split>.txt`` names (only names that split by ``_`` into exactly
    two parts, as the FAIR tools do: this skips ``trainval.txt``); every class file must list the
    same image ids in the same order. Tar shards of a split (``VOC_ROOT/SPLIT-NNNNNN.tar``, written
    by ``python -m transfer.shards``) read the same (``_read_voc_shards``)."""
    if is_sharded(Path(voc_root) / split):
        return _read_voc_shards(Path(voc_root) / split, split)
    voc_root = Path(voc_root)
    main = voc_root / "ImageSets" / "Main"
    if not main.is_dir():
        hint = f" (did you mean {voc_root / 'VOC2007'}?)" if (voc_root / "VOC2007").is_dir() else ""
        raise FileNotFoundError(
            f"{main}: missing; --voc-root must be a VOC2007 folder with "
            f"ImageSets/Main/<class>_<split>.txt and JPEGImages/{hint}"
        )
    files = voc_class_files(main, split)
    if not files:
        raise FileNotFoundError(f"{main}: no <class>_{split}.txt files (is '{split}' a split of this VOC folder?)")
    classes = [p.stem.split("_")[0] for p in files]
    ids: list[str] | None = None
    columns = []
    for path in files:
        rows = [line.split() for line in read_text(path, "VOC class file").splitlines() if line.strip()]
        bad = next((r for r in rows if len(r) != 2 or r[1] not in ("1", "-1", "0")), None)
        if bad is not None:
            raise DatasetError(f"{path}: expected lines '<image id> <1|-1|0>', got {' '.join(bad)!r}")
        these = [r[0] for r in rows]
        if ids is None:
            ids = these
        elif these != ids:
            raise DatasetError(f"{path}: lists other image ids (or another order) than {files[0]}")
        columns.append([int(r[1]) for r in rows])
    labels = np.asarray(columns, dtype=np.int8).T
    paths = [str(inside(voc_root / "JPEGImages", f"{i}.jpg", f"{files[0]}: image id {i!r}")) for i in ids]
    missing = next((p for p in paths if not os.path.isfile(p)), None)
    if missing is not None:
        raise FileNotFoundError(f"{missing}: image listed in {files[0]} is missing")
    # ImageList labels are unused by the SVM; it reads the matrix.
    index = FileIndex.from_samples(voc_root / "JPEGImages", zip(paths, [0] * len(paths)), classes)
    return VocLabels(split, ids, classes, labels, ImageList(index))


def _read_voc_shards(root: Path, split: str) -> VocLabels:
    """A VOC split as shards: the image ids are the samples' keys, each image's values per class its
    ``KEY.labels`` member, the class names the writer's manifest."""
    sharded = index_shards(root)
    classes = sharded.index.classes
    if not classes or sharded.label_rows is None:
        raise DatasetError(
            f"{root}: shards without VOC labels (expected KEY.labels members and the manifest "
            f"{root.name}.json naming the classes, as python -m transfer.shards --layout voc07 writes)"
        )
    rows = [
        read_label_row(f"{path.shard}/{key}.labels", text, len(classes))
        for (path, _), key, text in zip(sharded.index, sharded.keys, sharded.label_rows)
    ]
    labels = np.asarray(rows, dtype=np.int8).reshape(len(rows), len(classes))
    return VocLabels(split, sharded.keys, classes, labels, ImageList(sharded.index))
