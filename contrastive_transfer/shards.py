"""Datasets kept as tar shards in the WebDataset layout: written, found and indexed (docs/datasets.md).

A shard is a plain (uncompressed) tar whose members are grouped into samples by key: ``KEY.jpg``
(or ``.png``, any image extension) is the image, ``KEY.cls`` its class as decimal text, and, for
the VOC07 classification lists, ``KEY.labels`` the image's value per class (``1 -1 0 ...``). The
writer (``python -m transfer.shards``) also leaves ``PREFIX.json`` beside ``PREFIX-NNNNNN.tar``:
the class names and the number of samples per shard. Shards from elsewhere read without it (classes
are then the labels' numbers).

Why an index and random access, not WebDataset's stream: the shards are read once, through the
gate, into the packed index pretraining already uses (``FileIndex``: per image its shard, offset
and size), and an image is then read by offset (``members.read_member``). The existing samplers,
their order, their division among processes and workers and their exact resume stay as they are,
and the same images as a folder or as shards are the same samples in the same order (the same
losses, features and figures). A stream would need its own shard-to-worker split, a shuffle
buffer and a resume that replays the stream: another order than the folder's, and a resume that
is not exact. The cost is one pass over the shards' headers (512 bytes per member) when a run
starts; each process then opens a shard once and reads its members at random offsets, where a
folder opens a file per image per epoch (benchmarks/shards.md). Hence the standard library's
``tarfile`` rather than the ``webdataset`` package: the index needs only the members' headers,
which ``tarfile`` reads, and webdataset's readers are those streams; nothing is added to the
dependencies.

A shard is untrusted like any input file: it is opened through the gate (a regular file within
the shard cap), and its members are checked before any is used: regular files only (no links,
devices, FIFOs or sparse files), names that stay relative (no ``..``, no absolute path), sizes that
lie within the shard and within the image cap, a bounded count, one image per key, labels that are
numbers. A refusal is one line naming the shard and the member.
"""

from __future__ import annotations

import glob
import io
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contrastive_transfer.cli import UserError, atomic_write, write_json
from contrastive_transfer.file_index import FileIndex
from contrastive_transfer.json_limits import read_json
from contrastive_transfer.members import forget
from contrastive_transfer.paths import escapes, printable
from contrastive_transfer.untrusted import KINDS, open_untrusted

__all__ = ["ShardError", "Sharded", "ShardWriter", "expand_braces", "shard_paths", "index_shards", "IMAGE_FIELDS"]

SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<number>\d+)\.tar$")
IMAGE_FIELDS = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp")  # torchvision's IMG_EXTENSIONS
LABEL_FIELDS = ("cls", "labels")  # read into the index; other fields (WebDataset's .json, .txt ...) are left
MAX_SHARDS = 1_000_000
MAX_MEMBERS = 1_000_000  # per shard: 512 MiB of headers alone; WebDataset's shards hold thousands
MAX_HEADER_BYTES = 1 << 20  # a pax or long-name record: a name and a few attributes, ~100 bytes
MAX_LABEL_BYTES = 4096  # a .cls number, or a VOC image's values for up to ~1000 classes
MAX_CLASSES = 100_000  # as for an ImageFolder (transfer/datasets/readers.py): a head is sized by it


class ShardError(UserError, ValueError):
    """A shard, a member or a shard pattern that cannot be read as the WebDataset layout."""


# ------------------------------------------------------------------------------------ finding shards


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` → a-000.tar, a-001.tar, a-002.tar (zero padding kept); ``{x,y}`` lists;
    several groups multiply. Written here (a dozen lines) rather than adding the ``braceexpand``
    package for the two forms WebDataset's shard names use."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail, body = pattern[: match.start()], pattern[match.end() :], match.group(1)
    numbers = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numbers:
        first, last = numbers.groups()
        if int(last) - int(first) >= MAX_SHARDS or int(last) < int(first):
            count = int(last) - int(first) + 1
            raise ShardError(f"{pattern}: the range {{{body}}} names {count} shards (expected 1 to {MAX_SHARDS})")
        items = [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    else:
        items = body.split(",")
    out = [p for item in items for p in expand_braces(head + item + tail)]
    if len(out) > MAX_SHARDS:
        raise ShardError(f"{pattern}: names more than {MAX_SHARDS} shards")
    return out


def shard_paths(root: str | os.PathLike) -> list[str] | None:
    """The shards a dataset root names, or None when it names a folder. A root is shards when it
    ends in ``.tar`` (braces expanded: ``shards/train-{000000..000127}.tar``), or when it is no
    folder but ``ROOT-NNNNNN.tar`` files exist (``shards/train`` for the writer's output, so that
    ``--data-root shards`` finds ``train-*`` and ``val-*``)."""
    text = os.fspath(root)
    if text.endswith(".tar"):
        return expand_braces(text)
    if os.path.isdir(text):
        return None
    base = os.path.basename(text)
    found = [p for p in glob.glob(glob.escape(text) + "-*.tar") if _prefix(p) == base]
    return sorted(found, key=_number) or None


def _number(path: str) -> int:
    match = SHARD_NAME.match(os.path.basename(path))
    return int(match.group("number")) if match else -1


def is_sharded(root: str | os.PathLike) -> bool:
    return shard_paths(root) is not None


def _prefix(path: str) -> str | None:
    match = SHARD_NAME.match(os.path.basename(path))
    return match.group("prefix") if match else None


# ---------------------------------------------------------------------------------------- reading


@dataclass
class _Sample:
    image: tuple[str, int, int] | None = None  # member name, data offset, size
    labels: dict[str, tuple[int, int]] = field(default_factory=dict)  # field → (offset, size)


def _refuse(shard: str, member: str, reason: str) -> ShardError:
    return ShardError(f"{shard}: member {printable(member)!r} {reason}")


_TYPES = (
    ("issym", "a symbolic link"),
    ("islnk", "a hard link"),
    ("ischr", "a character device"),
    ("isblk", "a block device"),
    ("isfifo", "a FIFO"),
    ("issparse", "a sparse file"),
)


def _check_member(shard: str, info: tarfile.TarInfo, end: int) -> None:
    """A member used only if it is a regular file whose name stays inside and whose data lies
    within the shard (a header may declare any size)."""
    kind = next((what for test, what in _TYPES if getattr(info, test)()), None)
    if kind or not info.isreg():
        raise _refuse(shard, info.name, f"is {kind or 'not a regular file'}, expected regular files only")
    why = escapes(info.name)
    if why:
        raise _refuse(shard, info.name, f"is named with {why}, expected KEY.EXTENSION names")
    if info.offset_data + info.size > end:
        raise _refuse(
            shard, info.name, f"declares {info.size} bytes beyond the shard's end ({end} bytes): truncated or crafted"
        )


class _BoundedReads:
    """The shard's file as ``tarfile`` reads it, no read above ``MAX_HEADER_BYTES``: tarfile reads a
    pax or GNU long-name record whole, at the size its header declares (the member data, which it
    would also read whole, is never read through it here)."""

    def __init__(self, shard: str, f):
        self.shard, self.f = shard, f
        self.seek, self.tell = f.seek, f.tell

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > MAX_HEADER_BYTES:
            raise ShardError(
                f"{self.shard}: a tar header record of {n} bytes at byte {self.f.tell()}, above "
                f"{MAX_HEADER_BYTES} (a pax or long-name record this large is crafted)"
            )
        return self.f.read(n)


def _members(shard: str, f, end: int) -> Iterator[tarfile.TarInfo]:
    """The shard's members, each checked; the members list tarfile keeps is emptied as it goes (a
    shard's count stays bounded in memory too). The archive must end with its end-of-archive block:
    a shard cut at a member's boundary would otherwise read as a shorter one."""
    try:
        # uncompressed only: members are read by offset
        tar = tarfile.open(fileobj=_BoundedReads(shard, f), mode="r:")  # type: ignore[call-overload]
        count = 0
        while (info := tar.next()) is not None:
            tar.members.clear()
            count += 1
            if count > MAX_MEMBERS:
                raise ShardError(f"{shard}: more than {MAX_MEMBERS} members, above the limit per shard")
            if info.isdir():  # tar's folder entries: nothing to read
                continue
            _check_member(shard, info, end)
            yield info
        f.seek(tar.offset)
        closing = f.read(tarfile.BLOCKSIZE)
    except (tarfile.TarError, EOFError, UnicodeError, ValueError) as e:
        if isinstance(e, UserError):
            raise
        raise ShardError(f"{shard}: not a readable uncompressed tar ({' '.join(str(e).split())})") from None
    if closing != bytes(tarfile.BLOCKSIZE):
        raise ShardError(f"{shard}: ends without tar's end-of-archive block after {count} members: truncated")


def _split_name(name: str) -> tuple[str, str]:
    """WebDataset's grouping: the key is the name up to the first dot of its last component, the
    field what follows (lower case here: ``.JPEG`` and ``.jpg`` are both images)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _scan_shard(shard: str) -> tuple[dict[str, _Sample], dict[str, bytes]]:
    """The shard's samples by key (in the order of their first member) and their label fields'
    bytes, keyed ``KEY.FIELD``."""
    samples: dict[str, _Sample] = {}
    with open_untrusted(shard, "shard") as f:
        end = os.fstat(f.fileno()).st_size
        for info in _members(shard, f, end):
            key, ext = _split_name(info.name)
            sample = samples.setdefault(key, _Sample())
            if ext in IMAGE_FIELDS:
                if sample.image is not None:
                    raise _refuse(shard, info.name, f"is a second image of sample {key!r} (after {sample.image[0]!r})")
                if info.size > KINDS["image"].cap:
                    raise _refuse(shard, info.name, f"is {info.size} bytes, above the limit for {KINDS['image'].what}")
                sample.image = (info.name, info.offset_data, info.size)
            elif ext in LABEL_FIELDS:
                if info.size > MAX_LABEL_BYTES:
                    raise _refuse(shard, info.name, f"is {info.size} bytes, above {MAX_LABEL_BYTES} for a label")
                sample.labels[ext] = (info.offset_data, info.size)
        texts = {}
        for key, sample in samples.items():
            for ext, (offset, size) in sample.labels.items():
                f.seek(offset)
                texts[f"{key}.{ext}"] = f.read(size)
    for key, sample in samples.items():
        if sample.image is None:
            member = f"{key}.{next(iter(sample.labels), '?')}"
            raise _refuse(shard, member, f"belongs to sample {key!r}, which has no image")
    return samples, texts


@dataclass
class Sharded:
    """A sharded dataset: its packed index (``FileIndex`` with member locations), the samples' keys
    and their VOC label rows (``labels`` fields, in index order) when the shards have them."""

    index: FileIndex
    keys: list[str]
    label_rows: list[bytes] | None


def _label(shard: str, key: str, text: bytes | None) -> int:
    if text is None:
        return -1
    value = text.strip()
    if not (value.isdigit() and len(value) <= 6 and int(value) < MAX_CLASSES):
        raise _refuse(shard, f"{key}.cls", f"holds {text[:40]!r}, expected a class number from 0 to {MAX_CLASSES - 1}")
    return int(value)


def index_shards(root: str | os.PathLike) -> Sharded:
    """Every shard of ``root`` (``shard_paths``) read into one packed index, in shard order and, in
    each, in the order of the samples' first members; ShardError (one line) for a bad shard, a bad
    member, or a shard whose count differs from the writer's manifest."""
    paths = shard_paths(root)
    if not paths:
        raise ShardError(f"{root}: no shards (expected PREFIX-NNNNNN.tar files or a pattern ending in .tar)")
    manifest = _manifest(paths)
    forget(paths)  # descriptors kept from an earlier index of these paths: the files may have been replaced
    names, labels, locations, keys = [], [], [], []
    rows: list[bytes | None] = []
    for number, shard in enumerate(paths):
        try:
            samples, texts = _scan_shard(shard)
        except FileNotFoundError:
            raise ShardError(f"{shard}: missing (a shard of {root})") from None
        expected = manifest["shards"].get(os.path.basename(shard), -1) if manifest else None
        if expected == -1:
            raise ShardError(f"{shard}: not listed in the manifest beside it (left from an earlier write?)")
        if expected is not None and expected != len(samples):
            raise ShardError(
                f"{shard}: {len(samples)} samples, the manifest beside it lists {expected}: truncated or replaced"
            )
        for key, sample in samples.items():
            assert sample.image is not None  # _scan_shard refused samples without one
            name, offset, size = sample.image
            names.append(name)
            labels.append(_label(shard, key, texts.get(f"{key}.cls")))
            locations.append((number, offset, size))
            keys.append(key)
            rows.append(texts.get(f"{key}.labels"))
    if not names:
        raise ShardError(f"{root}: the shards hold no images")
    if min(labels) < 0 <= max(labels):
        raise ShardError(f"{root}: some samples have a .cls member and others not; label every sample or none")
    classes = manifest.get("classes") or [str(c) for c in range(max(labels) + 1)]
    index = FileIndex.from_samples(root, zip(names, labels), classes, paths, np.asarray(locations, np.int64))
    index.check_labels(len(classes), os.fspath(root))
    label_rows = [r for r in rows if r is not None]
    if 0 < len(label_rows) < len(rows):
        raise ShardError(f"{root}: some samples have a .labels member and others not")
    return Sharded(index, keys, label_rows or None)


def _manifest(paths: Sequence[str]) -> dict:
    """The writer's ``PREFIX.json`` beside the first shard ({} when absent): class names and the
    samples per shard, checked to be those types."""
    prefix = _prefix(paths[0])
    if prefix is None:
        return {}
    path = os.path.join(os.path.dirname(paths[0]), f"{prefix}.json")
    if not os.path.exists(path):
        return {}
    data = read_json(path)
    classes, counts = (data.get(k) if isinstance(data, dict) else None for k in ("classes", "shards"))
    if not (
        isinstance(classes, list)
        and all(isinstance(c, str) for c in classes)
        and len(classes) <= MAX_CLASSES
        and isinstance(counts, dict)
        and all(isinstance(n, int) and n >= 0 for n in counts.values())
    ):
        raise ShardError(f"{path}: not a shard manifest (expected 'classes': [names] and 'shards': {{name: count}})")
    return {"classes": classes, "shards": counts}


# ---------------------------------------------------------------------------------------- writing


class ShardWriter:
    """Writes samples to ``OUT/PREFIX-NNNNNN.tar``, ``shard_size`` samples each, and ``PREFIX.json``.

    Deterministic: the same samples give the same bytes (members in sample order and, within a
    sample, sorted by field; mtime 0, uid and gid 0, no user or group names, mode 0444, the ustar
    format). Each shard is written to a temporary file and renamed when complete."""

    def __init__(self, out: str | os.PathLike, prefix: str, shard_size: int, classes: Sequence[str], layout: str):
        if shard_size < 1:
            raise UserError(f"--shard-size {shard_size}: expected at least 1 sample per shard")
        if escapes(prefix) or "/" in prefix:
            raise UserError(f"shard prefix {prefix!r}: expected one file name")
        self.out, self.prefix, self.shard_size = Path(out), prefix, shard_size
        self.classes, self.layout = list(classes), layout
        self.counts: dict[str, int] = {}
        self._pending: list[tuple[str, dict[str, bytes]]] = []
        self.out.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, fields: dict[str, bytes]) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", key):
            raise UserError(f"sample key {key!r}: expected letters, digits, '_' and '-' (a key holds no '.')")
        self._pending.append((key, fields))
        if len(self._pending) == self.shard_size:
            self._flush()

    def _flush(self) -> None:
        name = f"{self.prefix}-{len(self.counts):06d}.tar"

        def write(f) -> None:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for key, fields in self._pending:
                    for ext in sorted(fields):
                        info = tarfile.TarInfo(f"{key}.{ext}")
                        info.size, info.mtime, info.mode = len(fields[ext]), 0, 0o444
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        tar.addfile(info, io.BytesIO(fields[ext]))

        atomic_write(self.out / name, write)
        self.counts[name] = len(self._pending)
        self._pending = []

    def close(self) -> Path:
        """The last shard and the manifest written; the manifest's path."""
        if self._pending:
            self._flush()
        manifest = {
            "format": "webdataset",
            "layout": self.layout,
            "classes": self.classes,
            "samples": sum(self.counts.values()),
            "shards": self.counts,
        }
        return write_json(self.out / f"{self.prefix}.json", manifest)


def read_label_row(shard_member: str, text: bytes, classes: int) -> list[int]:
    """A VOC ``.labels`` member: one of 1, -1, 0 per class."""
    values = text.split()
    if len(values) != classes or any(v not in (b"1", b"-1", b"0") for v in values):
        raise ShardError(f"{shard_member}: expected {classes} values of 1, -1 or 0, got {text[:80]!r}")
    return [int(v) for v in values]
