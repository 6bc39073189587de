"""A dataset's file list packed into three numpy arrays, so that loader workers share it.

A Python list of ``(path, label)`` tuples costs about 160 bytes per image (199 MiB for ImageNet's
1.28 M) in every process, and each DataLoader worker that reads an entry writes to its reference
count, turning the shared page into a private copy: with 8 workers per rank and 8 ranks per node,
the list is copied up to 64 times. Here the paths are one ``uint8`` buffer (relative to the root, as
the file system's bytes: names that are not UTF-8 survive) plus ``int64`` offsets and ``int32``
labels: about 40 bytes per image, no per-entry objects, so reading an entry writes nothing and the
pages stay shared. detectron2's ``DatasetFromList(serialize=True)`` does the same for its records.

``save``/``load`` keep an index beside a run (``.npz``, read without pickle), so that one process
builds it and the others read it, and a resumed run sees the same list it started with.

A dataset kept as tar shards (contrastive_transfer/shards.py) is indexed the same way: the names are
the members' names, and ``locations`` holds per image its shard, data offset and size (three
``int64``: 24 bytes more per image); an entry's path is then a ``Member``, read from its shard.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from contrastive_transfer.cli import UserError, atomic_write
from contrastive_transfer.members import Member
from contrastive_transfer.untrusted import check_archive, open_untrusted

__all__ = ["FileIndex", "FileIndexError"]

MAX_ENTRIES = 100_000_000  # 100 M images: beyond any dataset this reads; bounds what a file may claim


class FileIndexError(UserError, ValueError):
    """A saved index that is not one, or does not fit its dataset."""


class FileIndex(Sequence):
    """``index[i] -> (absolute path, label)``, like the list of tuples it replaces."""

    def __init__(
        self,
        root: str | os.PathLike,
        blob: np.ndarray,
        offsets: np.ndarray,
        labels: np.ndarray,
        classes: Sequence[str] = (),
        shards: Sequence[str] = (),
        locations: np.ndarray | None = None,
    ):
        self.root = os.fspath(root)
        self._prefix = os.fsencode(os.path.join(self.root, ""))
        self.blob, self.offsets, self.labels = blob, offsets, labels
        self.classes = list(classes)  # label i names classes[i]; none for a flat folder (labels -1)
        # tar shards: the shards' paths and, per image, (shard number, data offset, size) in it
        self.shards = list(shards)
        self.locations = locations if locations is not None else np.zeros((0, 3), dtype=np.int64)

    @classmethod
    def from_samples(
        cls,
        root: str | os.PathLike,
        samples: Iterable[tuple[str, int]],
        classes: Sequence[str] = (),
        shards: Sequence[str] = (),
        locations: np.ndarray | None = None,
    ) -> "FileIndex":
        """Pack ``(path under root, label)`` pairs (absolute or relative paths); for tar shards,
        ``(member name, label)`` pairs with the members' ``locations`` in ``shards``."""
        root = os.fspath(root)
        prefix = os.path.join(root, "")
        names, labels = [], []
        for path, label in samples:
            if path.startswith(prefix):  # what a scan of root returns; relpath is 10× slower
                path = path[len(prefix) :]
            elif os.path.isabs(path):
                path = os.path.relpath(path, root)
            names.append(os.fsencode(path))
            labels.append(label)
        offsets = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum([len(n) for n in names], out=offsets[1:])
        blob = np.frombuffer(b"".join(names), dtype=np.uint8)
        return cls(root, blob, offsets, np.asarray(labels, dtype=np.int32), classes, shards, locations)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} files")
        i = int(i) % len(self)
        name = self.blob[self.offsets[i] : self.offsets[i + 1]].tobytes()
        if self.shards:
            shard, offset, size = self.locations[i].tolist()
            return Member(self.shards[shard], os.fsdecode(name), offset, size), int(self.labels[i])
        return os.fsdecode(self._prefix + name), int(self.labels[i])

    def save(self, path: str | os.PathLike) -> Path:
        arrays: dict[str, np.ndarray] = {
            "blob": self.blob,
            "offsets": self.offsets,
            "labels": self.labels,
            "classes": np.array(self.classes, dtype=str),
            "root": np.array(self.root),
            "shards": np.array(self.shards, dtype=str),
            "locations": self.locations,
        }
        return atomic_write(path, lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]  # numpy's stub: allow_pickle

    @classmethod
    def load(cls, path: str | os.PathLike, root: str | os.PathLike) -> "FileIndex":
        """A saved index, checked: arrays of the right types whose offsets fit the buffer, names
        inside the root, labels that index its classes."""
        try:  # through the gate: a regular file within its cap, zip records checked before inflating
            with open_untrusted(path, "file index") as f:
                check_archive(f, path, "file index")
                check_array_headers(f, path)
                with np.load(f, allow_pickle=False) as arrays:
                    blob, offsets, labels = (arrays[k] for k in ("blob", "offsets", "labels"))
                    classes = arrays["classes"] if "classes" in arrays else np.array([], dtype=str)
                    shards = arrays["shards"] if "shards" in arrays else np.array([], dtype=str)
                    locations = arrays["locations"] if "locations" in arrays else np.zeros((0, 3), np.int64)
        except FileIndexError:
            raise
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise FileIndexError(f"{path}: not a file index ({' '.join(str(e).split()) or type(e).__name__})") from None
        why = (
            _inconsistency(blob, offsets, labels)
            or _text_problem(classes, "class names")
            or _text_problem(shards, "shard paths")
            or _location_problem(locations, len(shards), len(labels))
        )
        if why:
            raise FileIndexError(f"{path}: not a usable file index: {why}; delete it to rebuild it from the folder")
        index = cls(root, blob, offsets, labels, [str(c) for c in classes], [str(s) for s in shards], locations)
        index.check_labels(len(index.classes), str(path))
        return index

    @staticmethod
    def saved_root(path: str | os.PathLike) -> str | None:
        """The dataset root a saved index was built from (None: unreadable or not recorded)."""
        try:
            with open_untrusted(path, "file index") as f:
                check_archive(f, path, "file index")
                check_array_headers(f, path)
                with np.load(f, allow_pickle=False) as arrays:
                    root = arrays["root"] if "root" in arrays else None
                    return str(root) if root is not None and root.dtype.kind == "U" else None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, FileIndexError):
            return None

    def check_labels(self, num_classes: int, where: str) -> None:
        """Labels are class indices (or -1 for a flat folder): nothing is sized by a bad one."""
        if len(self) and (self.labels.min() < -1 or self.labels.max() >= max(num_classes, 0)):
            raise FileIndexError(f"{where}: labels outside [-1, {num_classes}) for its {num_classes} classes")


def check_array_headers(f: IO[bytes], path: str | os.PathLike) -> None:
    """Every ``.npy`` record of an ``.npz`` declares no more bytes than the record holds: numpy's
    reader reserves the shape its header states (``ndarray(count)``) before reading a byte, so a
    100-byte record may otherwise ask for 10^12 entries. Read with numpy's own header parser."""
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as archive:
            for info in archive.infolist():
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    # 3.0 differs from 2.0 only in the header's text encoding (UTF-8), not its layout
                    header = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = header(member)
                declared = math.prod(shape) * dtype.itemsize  # Python integers: no overflow
                if dtype.hasobject:  # a pickle inside: never read (np.load without allow_pickle)
                    raise FileIndexError(f"{path}: not a file index: array {info.filename!r} holds Python objects")
                if declared > info.file_size:
                    raise FileIndexError(
                        f"{path}: not a usable file index: array {info.filename!r} declares shape {shape} of "
                        f"{dtype} ({declared} bytes) in a record of {info.file_size} bytes; delete it to rebuild it"
                    )
    finally:
        f.seek(0)


def _text_problem(values: np.ndarray, what: str) -> str | None:
    return None if not len(values) or values.ndim == 1 and values.dtype.kind == "U" else f"{what} not text"


def _location_problem(locations: np.ndarray, shards: int, n: int) -> str | None:
    """Members' locations: (shard, offset, size) per image, in a shard of the index (a member's read
    checks offset and size against its shard again: the shard may have changed since)."""
    if not shards:
        return None if locations.size == 0 else "member locations without shards"
    if locations.dtype != np.int64 or locations.shape != (n, 3):
        return f"member locations of dtype {locations.dtype} and shape {locations.shape}, expected int64 ({n}, 3)"
    if n and (locations.min() < 0 or locations[:, 0].max() >= shards):
        return f"member locations outside the {shards} shards or negative"
    return None


def _inconsistency(blob: np.ndarray, offsets: np.ndarray, labels: np.ndarray) -> str | None:
    if (blob.dtype, offsets.dtype, labels.dtype) != (np.uint8, np.int64, np.int32):
        return f"dtypes {blob.dtype}, {offsets.dtype}, {labels.dtype} (expected uint8, int64, int32)"
    if blob.ndim != 1 or offsets.ndim != 1 or labels.ndim != 1 or len(labels) > MAX_ENTRIES:
        return "arrays of the wrong shape"
    if len(offsets) != len(labels) + 1 or offsets[0] != 0 or offsets[-1] != len(blob):
        return f"{len(offsets)} offsets for {len(labels)} files and {len(blob)} bytes"
    if np.any(np.diff(offsets) <= 0):
        return "offsets that do not increase"
    data = blob.tobytes()
    if b"\x00" in data:
        return "a NUL byte in a file name"
    for i in range(len(labels)):  # a planted index must not name files outside the dataset's root
        name = data[offsets[i] : offsets[i + 1]]
        if name.startswith(b"/") or b".." in name.split(b"/"):
            return f"file {i} ({os.fsdecode(name)!r}) leaves the dataset's root"
    return None
