"""Paths read from files stay inside their folder (docs/security.md).

A dataset list (Places205 csv, VOC split ids, COCO ``file_name``), a run name or an output path in a
recipe comes from a file someone else may have written: ``../`` or an absolute path there would
read or write outside the folder the user named. The check is lexical (no absolute path, no ``..``
component, no NUL): symbolic links inside a dataset root stay allowed, as datasets are commonly
assembled from links into shared storage; it is the file's text that may not point elsewhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath

from contrastive_transfer.cli import UserError
from contrastive_transfer.untrusted import read_untrusted

__all__ = ["PathEscapeError", "escapes", "inside", "check_run_name", "scan_image_folder", "read_text", "printable"]


class PathEscapeError(UserError, ValueError):
    """A path from a file that would leave the folder it must stay in."""


def escapes(relative: str) -> str | None:
    """Why ``relative`` would leave the folder it is joined to, or None when it stays inside."""
    if not isinstance(relative, str) or not relative:
        return "an empty path"
    if not relative.startswith(("/", "\\", "~")) and not any(c in relative for c in ("\x00", "..", ":")):
        return None  # the common case, without the path parsing below (a Places205 list has 2.45 M lines)
    if "\x00" in relative:
        return "a NUL character"
    if PurePosixPath(relative).is_absolute() or PureWindowsPath(relative).is_absolute() or relative.startswith("~"):
        return "an absolute path"
    if ".." in re.split(r"[\\/]", relative):
        return "a '..' component"
    return None


def inside(root: str | os.PathLike, relative: str, where: str) -> Path:
    """``root / relative``; PathEscapeError (one line naming ``where`` and the value) otherwise."""
    why = escapes(relative)
    if why is not None:
        raise PathEscapeError(
            f"{where}: path {relative!r} is {why} and would leave {root}; list paths relative to {root}"
        )
    return Path(root) / relative


_RUN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")


def check_run_name(name: object, where: str) -> str:
    """A run name becomes one folder under the output root: a single plain path component."""
    if not (isinstance(name, str) and _RUN_NAME.match(name) and name not in (".", "..")):
        raise PathEscapeError(
            f"{where}: name={name!r} must be one folder name (letters, digits, _ . + = -, not starting "
            "with '.' or '-'): it names the run's folder under the output root"
        )
    return name


def _walk_once(top: str, seen: set[tuple[int, int]]) -> list[tuple[str, list[str], list[str]]]:
    """os.walk following links, but into each real directory once (by device and inode, shared
    through ``seen``): a link back to a parent (a loop) would otherwise repeat images without end,
    and a link to a folder already scanned would count its images twice."""
    out = []
    for root, dirnames, filenames in os.walk(top, followlinks=True):
        st = os.stat(root)
        if root != top and (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        out.append((root, dirnames, filenames))
    return out


def scan_image_folder(directory: str | os.PathLike, class_to_idx: dict[str, int], extensions: tuple[str, ...]):
    """torchvision's ``make_dataset`` (same order, same error for a class without images) over
    ``_walk_once``: symbolic links are followed, each directory visited once (docs/security.md)."""
    directory = os.fspath(directory)
    suffixes = tuple(e.lower() for e in extensions)
    instances, available = [], set()
    # Every class folder is its own class's: a link from another class into it is not followed.
    tops = {c: os.path.join(directory, c) for c in sorted(class_to_idx) if os.path.isdir(os.path.join(directory, c))}
    seen = {(st.st_dev, st.st_ino) for st in map(os.stat, tops.values())}
    for target_class, target_dir in tops.items():
        for root, _, fnames in sorted(_walk_once(target_dir, seen)):
            for fname in sorted(fnames):
                if fname.lower().endswith(suffixes):
                    instances.append((os.path.join(root, fname), class_to_idx[target_class]))
                    available.add(target_class)
    empty = set(class_to_idx) - available
    if empty:
        raise FileNotFoundError(
            f"Found no valid file for the classes {', '.join(sorted(empty))}. "
            f"Supported extensions are: {', '.join(extensions)}"
        )
    return instances


class NotTextError(UserError, ValueError):
    """A list or log file that is not UTF-8 text."""


def read_text(path: str | os.PathLike, what: str = "file", kind: str = "list") -> str:
    """The file as UTF-8 text, read through the gate (``untrusted``: a regular file within the cap
    of ``kind``); NotTextError (one line, naming the file and the byte) for text that is not UTF-8."""
    try:
        return read_untrusted(path, kind).decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotTextError(
            f"{path}: the {what} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
        ) from None


def printable(path: str | os.PathLike) -> str:
    """A path as one line of UTF-8 text whatever its bytes: a file name that is not UTF-8 (Python
    holds its bytes as surrogates) shows them as \\xNN, and control characters are escaped, so a
    listing written or printed from it can neither fail to encode nor be split by a name."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
