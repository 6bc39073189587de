"""The one gate for bytes from files others made (docs/security.md, "Files, sizes and tensors").

Every reader of an input file (weights, training and probe states, configs, JSON, XML, lists,
images) opens it here, so the same rules hold at every entry point:

- **Regular files only**, after resolving links. The path is ``stat``-ed first, so a FIFO, socket,
  device or directory is refused without being opened (opening a FIFO blocks until a writer
  appears; reading ``/dev/zero`` never ends). The resolved path is then opened with
  ``O_NONBLOCK | O_NOFOLLOW`` and the descriptor ``fstat``-ed again: a file swapped for a FIFO
  between the two steps is refused too, and the open cannot block.
- **A size cap per kind** (``KINDS``), checked from the descriptor before a byte is read; reads
  are bounded by it, so a file that grows meanwhile is refused rather than read without end.
- **Archive records** (torch zips) are checked against their declared sizes before anything
  inflates them: every record within the kind's cap, no record inflating more than
  ``MAX_INFLATION`` times its stored size (``torch.save`` stores records uncompressed).
- **Records named once**: an archive with two records of one name is refused, so the record a
  check reads is the record the loader reads.
- **Loaded objects bounded in what they expand to** (``check_expansion``): shared references in a
  pickle make a graph whose paths a plain walk visits one by one (a few hundred bytes of nested
  ``[x, x]`` hold 2^64 paths); the expanded count is computed once per object and capped.
- **Tensors** (``tensor_problem``): layout, dtype, shape, strides and storage before any element
  is touched; finiteness after that.

A refusal is ``UnsafeFileError``: one line naming the file, what it is and what was expected.
"""

from __future__ import annotations

import os
import stat
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch

from contrastive_transfer.cli import UserError

__all__ = [
    "KINDS",
    "MAX_INFLATION",
    "UnsafeFileError",
    "check_file",
    "open_untrusted",
    "read_untrusted",
    "check_archive",
    "check_expansion",
    "check_loaded_tensors",
    "tensor_problem",
    "walk_tensors",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Kind:
    what: str  # how a message names such a file
    cap: int  # bytes


# The caps sit far above the largest real file of each kind (noted), far below what would hurt.
KINDS: dict[str, Kind] = {
    "weights": Kind("weights", 4 * GiB),  # wide_resnet101_2 with a momentum copy: ~1 GiB
    "training state": Kind("a training state", 8 * GiB),  # two encoders + optimizer moments of the above
    "probe state": Kind("a linear probe state", 1 * GiB),  # a 9216x1000 head and its optimizer: ~100 MiB
    "config": Kind("a config", 1 * MiB),  # the largest recipe or detection config here: ~10 KiB
    "json": Kind("a JSON file", 2 * GiB),  # COCO instances_train2017.json: 448 MiB
    "xml": Kind("an XML annotation", 1 * MiB),  # a VOC annotation: ~1 KiB
    "list": Kind("a list file", 512 * MiB),  # Places205's train list: ~100 MiB
    "log": Kind("a metrics log", 1 * GiB),  # metrics.jsonl of a long run: a few MiB
    "image": Kind("an image", 256 * MiB),  # a 16k x 16k JPEG is well below
    "file index": Kind("a file index", 2 * GiB),  # ImageNet's 1.28 M images: ~50 MiB
    "features": Kind("a feature array", 32 * GiB),  # ImageNet train's 1.28 M x 2048 float32: ~10 GiB
    "shard": Kind("a tar shard", 64 * GiB),  # WebDataset's advice: 100 MiB to a few GiB per shard
}

# What a loaded file may expand to as a tree (every container and value counted once per path that
# reaches it): a training state of the largest ResNet with its optimizer holds ~10^4, a plain walk of
# 10^7 takes seconds. Every walk over a loaded object (the tensor checks, the converters) stays below.
MAX_EXPANDED = 10_000_000
# Containers within containers: a checkpoint nests ~6 deep (an optimizer's state of a parameter);
# a recursive walk (Python's, OmegaConf's) stops with a RecursionError near 1,000.
MAX_NESTING = 100
MAX_INFLATION = 50  # a deflated record may inflate at most this much (float weights: ~1.1x)


class UnsafeFileError(UserError, ValueError):
    """A file refused before its contents are used: a special file where a file is expected, a
    file above its kind's cap, a crafted archive or tensor, or objects beyond plain data.
    ``reason`` is the message without the file's name (for callers that name it themselves)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason if reason is not None else message


def _refuse(path: str | os.PathLike, reason: str) -> UnsafeFileError:
    return UnsafeFileError(f"{path}: {reason}", reason)


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} bytes"


_TYPES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(kind: str) -> Kind:
    if kind not in KINDS:  # a programming error, not a user's
        raise KeyError(f"unknown file kind {kind!r}; expected one of {list(KINDS)}")
    return KINDS[kind]


def _check_stat(path: str | os.PathLike, st: os.stat_result, kind: Kind, resolved: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        what = next((name for test, name in _TYPES if test(st.st_mode)), "not a regular file")
        where = f" (a link to {resolved})" if os.fspath(resolved) != os.path.abspath(path) else ""
        raise _refuse(path, f"is {what}{where}, expected {kind.what} as a regular file")
    if st.st_size > kind.cap:
        raise _refuse(
            path, f"is {st.st_size} bytes, above the {_size(kind.cap)} limit for {kind.what} (docs/security.md)"
        )


def check_file(path: str | os.PathLike, kind: str) -> os.stat_result:
    """The ``stat`` of ``path`` (links followed) when it is a regular file within ``kind``'s cap;
    UnsafeFileError otherwise, without opening it. A missing file is FileNotFoundError."""
    spec = _kind(kind)
    st = os.stat(path)  # follows links; FileNotFoundError / PermissionError are the caller's OSError
    _check_stat(path, st, spec, os.path.realpath(path))
    return st


@contextmanager
def open_untrusted(path: str | os.PathLike, kind: str) -> Iterator[IO[bytes]]:
    """The file opened for reading, after ``check_file``; the descriptor is checked again (so
    nothing swapped in meanwhile is read). The caller bounds its reads by the size checked here
    (``read_untrusted`` does)."""
    spec = _kind(kind)
    check_file(path, kind)
    resolved = os.path.realpath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(resolved, flags)
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise
    try:
        _check_stat(path, os.fstat(fd), spec, resolved)
        os.set_blocking(fd, True)  # a regular file: the flag only served the open
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        yield f


def read_untrusted(path: str | os.PathLike, kind: str) -> bytes:
    """The file's bytes through the gate; never more than its checked size (within ``kind``'s
    cap) is read. The bound is the size itself: ``read(n)`` allocates n bytes before reading."""
    with open_untrusted(path, kind) as f:
        size = os.fstat(f.fileno()).st_size  # checked against the cap by open_untrusted
        data = f.read(size + 1)
    if len(data) > size:  # it grew after the check
        raise _refuse(path, f"grew while it was read (beyond the {size} bytes checked); read a file that is complete")
    return data


def check_archive(f: IO[bytes], path: str | os.PathLike, kind: str) -> bool:
    """A zip archive's records against their declared sizes, before anything inflates them; True
    when ``f`` is a zip archive. Files that are not zip archives pass (their own reader judges
    them)."""
    spec = _kind(kind)
    f.seek(0)
    if not zipfile.is_zipfile(f):
        f.seek(0)
        return False
    try:
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise _refuse(path, f"is a damaged zip archive ({e}), expected {spec.what}") from None
    finally:
        f.seek(0)
    names = [info.filename for info in records]
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:  # readers differ in which copy they take: the one scanned may not be the one loaded
        raise _refuse(
            path,
            f"archive holds two records named {repeated!r}: readers differ on which one they take (zipfile the last, "
            f"torch's its own), so what is checked could differ from what is loaded; expected {spec.what} "
            "with one record per name",
        )
    total = 0
    for info in records:
        total += info.file_size
        if info.file_size > spec.cap or total > spec.cap:
            raise _refuse(
                path,
                f"archive record {info.filename!r} declares {_size(info.file_size)} ({_size(total)} so far), "
                f"above the {_size(spec.cap)} limit for {spec.what}",
            )
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_INFLATION * max(info.compress_size, 1):
            raise _refuse(
                path,
                f"archive record {info.filename!r} inflates {_size(info.compress_size)} to {_size(info.file_size)} "
                f"(more than {MAX_INFLATION}x): a crafted archive, not a file torch.save wrote",
            )
    return True


# ----------------------------------------------------------------------------------------- tensors


def _view_problem(t: torch.Tensor) -> str | None:
    """Why the strided tensor ``t`` is not a plain view of its storage, or None: a negative offset
    or stride, a view past the storage's end, or one that repeats stored elements (a stride of 0
    along a dimension longer than 1, or more elements than stored). From the metadata alone: no
    element is read. No file the project or torch writes holds such a view; a crafted one costs
    its whole shape in memory the moment any element-wise check or copy touches it."""
    if t.numel() == 0:
        return None
    if t.storage_offset() < 0 or any(s < 0 for s in t.stride()):
        return f"has a negative offset or stride {tuple(t.stride())}"
    if _repeats(t.shape, t.stride()):
        return f"has stride 0 (shape {tuple(t.shape)}, strides {tuple(t.stride())}), expected stored values"
    itemsize = max(t.element_size(), 1)
    storage = t.untyped_storage().nbytes() // itemsize
    reach = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    if reach >= storage:
        return f"views element {reach} of a storage of {storage}"
    if t.numel() > storage:
        return (
            f"views {t.numel()} elements of a storage of {storage} (shape {tuple(t.shape)}, strides "
            f"{tuple(t.stride())}): stored values repeated"
        )
    return None


def tensor_problem(value: Any, integer_ok: bool = False) -> str | None:
    """Why ``value`` (a torch tensor or numpy array) is not usable as weights, or None.

    Layout, dtype, shape, strides and storage are checked first, from the metadata; only then are
    the elements read, for finiteness. Real floating point only (``integer_ok``: integers too,
    e.g. BatchNorm counters); complex, bool and other dtypes are refused. Weights hold what they
    show: a stride of 0 (one stored value repeated along a dimension) or a view beyond its
    storage is refused, wherever weights are read (no real checkpoint has one; a crafted one
    costs its whole shape in memory the moment it is read)."""
    if isinstance(value, np.ndarray):
        kind = value.dtype.kind
        if not (kind == "f" or (integer_ok and kind in "iu")):
            return f"has dtype {value.dtype}, expected real floating point weights"
        if _repeats(value.shape, value.strides):
            return f"has stride 0 (strides {value.strides}), expected stored values"
        return _non_finite(int(value.size - np.count_nonzero(np.isfinite(value))) if kind == "f" else 0, value.size)
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, expected a tensor"
    if value.layout != torch.strided or value.is_meta:
        what = "a meta" if value.is_meta else f"a {str(value.layout).replace('torch.', '')}"
        return f"is {what} tensor, expected a dense tensor with values"
    if value.is_complex() or not (value.is_floating_point() or (integer_ok and _is_integer(value.dtype))):
        return f"has dtype {value.dtype}, expected real floating point weights"
    problem = _view_problem(value)
    if problem is not None:
        return problem
    if not value.is_floating_point():
        return None
    try:
        # in float32, which holds every value of a narrower float exactly: torch's own isfinite is
        # missing for most float8s and wrong for one (float8_e8m0fnu's NaN counts as finite)
        finite = torch.isfinite(value if value.dtype.itemsize >= 4 else value.float())
    except NotImplementedError:  # a packed dtype (float4_e2m1fn_x2): no values torch computes with
        return f"has dtype {value.dtype}, expected float32, float64, float16 or bfloat16 weights"
    return None if bool(finite.all()) else _non_finite(int((~finite).sum()), value.numel())


def _repeats(shape: Any, strides: Any) -> bool:
    # a dimension of one element may have any stride: only a longer one repeats a stored value
    return any(s == 0 and n > 1 for n, s in zip(shape, strides))


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _non_finite(bad: int, total: int) -> str | None:
    if not bad:
        return None
    return (
        f"holds {bad} non-finite values (NaN or inf) of {total}: these weights are broken (a diverged run?); "
        "use an earlier checkpoint or other weights"
    )


def _children(item: Any) -> list | None:
    if isinstance(item, dict):
        return [*item.keys(), *item.values()]
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item)
    return None


def expanded_size(obj: Any, cap: int = MAX_EXPANDED) -> int | str:
    """How many nodes a plain recursive walk of ``obj`` visits (containers, keys and values, once
    per path), counted once per distinct container (memoized by id, so shared references cost
    nothing here); the reason as a string once it passes ``cap`` or a container contains itself."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # containers whose children are still being counted: the current path
    stack: list[tuple[Any, bool]] = [(obj, False)]
    while stack:
        item, finished = stack.pop()
        children = _children(item)
        if children is None:
            continue
        key = id(item)
        if finished:
            open_.discard(key)
            sizes[key] = 1 + sum(sizes.get(id(c), 1) for c in children)
            if sizes[key] > cap:
                return f"expands to more than {cap} values through shared references (a walk would visit each)"
        elif key in open_:
            return f"holds a {type(item).__name__} that contains itself (a walk would never end)"
        elif len(open_) >= MAX_NESTING:
            return f"nests containers more than {MAX_NESTING} levels deep (a checkpoint nests a few)"
        elif key not in sizes:
            open_.add(key)
            stack.append((item, True))
            stack.extend((c, False) for c in children)
    return sizes.get(id(obj), 1)


def check_expansion(obj: Any, path: str | os.PathLike, cap: int = MAX_EXPANDED) -> None:
    """UnsafeFileError (one line) when a loaded file's objects expand, walked as a tree, beyond
    ``cap`` nodes or refer to themselves; called before anything walks them."""
    size = expanded_size(obj, cap)
    if isinstance(size, str):
        raise _refuse(path, size)


def walk_tensors(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(where, tensor) for every tensor anywhere in a loaded file's containers. The walk is
    iterative: nesting cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, torch.Tensor):
            yield where or "(top level)", item
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))


def check_loaded_tensors(obj: Any, path: str | os.PathLike, kind: str, file_bytes: int | None = None) -> None:
    """Every tensor anywhere in a loaded file (weights or a training or probe state) is dense and
    a plain view of its storage (``_view_problem``, the same rule as ``tensor_problem``'s for
    weights), from the metadata, nothing read. With ``file_bytes``, the distinct storages together
    fit in the file: a tensor torch.load made from a size the pickle states (``torch.Tensor(n)``)
    rather than from stored bytes is refused before anything touches its memory."""
    _kind(kind)  # a kind the gate knows
    check_expansion(obj, path)
    storages: dict[tuple[int, int], int] = {}
    for where, item in walk_tensors(obj):
        if item.is_meta:
            continue
        if item.layout != torch.strided:
            layout = str(item.layout).replace("torch.", "")
            raise _refuse(path, f"tensor {where} is a {layout} tensor, expected dense tensors")
        problem = _view_problem(item)
        if problem is not None:
            raise _refuse(path, f"tensor {where} {problem}")
        storage = item.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    if file_bytes is not None and sum(storages.values()) > file_bytes:
        raise _refuse(
            path,
            f"holds {_size(sum(storages.values()))} of tensor storage in a file of {_size(file_bytes)}: tensors "
            "made from sizes the file states, not stored in it",
        )
