"""JSON from elsewhere, bounded before it is built (docs/security.md).

Python's ``json`` recurses once per nesting level: 100,000 ``[`` end in a RecursionError deep
inside the decoder. ``loads`` measures the nesting first (strings blanked out, then a running sum
over the brackets, vectorised) and refuses more than ``MAX_JSON_DEPTH`` levels in one line, before
decoding; it also refuses text that is not UTF-8, numbers that are not finite (``NaN``,
``Infinity``, ``1e400``) and integers beyond Python's digit limit, each in one line naming the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np

from contrastive_transfer.cli import UserError

MAX_JSON_DEPTH = 32  # a COCO instances file is 5 levels deep

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JsonLimitError(UserError, ValueError):
    """A JSON file that is not UTF-8, nests too deeply or holds a number that is not finite."""


def depth(data: bytes) -> int:
    """How deep the brackets of ``data`` nest (outside strings)."""
    brackets = np.frombuffer(_STRING.sub(b"", data).translate(None, _NOT_BRACKETS), np.uint8)
    if not brackets.size:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max())


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is not finite")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def loads(data: bytes, where: str) -> Any:
    """``data`` decoded as JSON after the checks of the module docstring; JsonLimitError (one line
    naming ``where``) otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JsonLimitError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    levels = depth(data)
    if levels > MAX_JSON_DEPTH:
        raise JsonLimitError(
            f"{where} nests {levels} levels deep (at most {MAX_JSON_DEPTH}); it is not a file of this kind"
        )
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise JsonLimitError(f"{where} is not valid JSON ({e})") from None
    except (ValueError, RecursionError) as e:  # a number refused above, or an integer past Python's digit limit
        raise JsonLimitError(f"{where}: {' '.join(str(e).split())}") from None


def read_json(path: str | os.PathLike, kind: str = "json") -> Any:
    """A JSON file through the gate (``untrusted.read_untrusted``: a regular file within ``kind``'s
    cap) and the limits above: one line naming the file for anything else."""
    from contrastive_transfer.untrusted import read_untrusted  # torch: imported when a file is read

    return loads(read_untrusted(path, kind), str(path))


def read_json_lines(path: str | os.PathLike, kind: str = "log") -> list[Any]:
    """The values of a JSON-lines file (``metrics.jsonl``), blank lines skipped, through the gate
    and the limits above, each line named by its number in a refusal."""
    from contrastive_transfer.untrusted import read_untrusted

    data = read_untrusted(path, kind)
    return [loads(line, f"{path} line {n}") for n, line in enumerate(data.splitlines(), 1) if line.strip()]
