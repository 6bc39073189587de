"""Reading weight files that may come from anywhere: loading a file never runs code from it.

Every file is untrusted (docs/security.md). The anchors of trust are not ours:

- ``torch_load``: ``torch.load(weights_only=True)`` (tensors, containers, numbers, strings and
  globals explicitly allowed). A refused file is one line naming the file and the globals it
  needs (``torch.serialization.get_unsafe_globals_in_checkpoint``, or a static scan of the pickle
  opcodes for files that are not torch zip archives), never a fallback to ``weights_only=False``.
- ``load_pickle``: a restricted ``pickle.Unpickler`` for detectron2 ``.pkl`` weights whose
  ``find_class`` resolves only numpy's array/dtype/scalar reconstruction, ``OrderedDict`` and
  ``_codecs.encode`` (protocol-2 pickles of model-zoo files); anything else is refused before it is
  imported, let alone called. Our checks and detectron2's checkpointer in the training processes
  (``transfer.detection.trainer``) use this same function.
- ``.safetensors`` files hold tensors and string metadata only (read by ``converters.checkpoint_io``).

A user who trusts a legacy file converts it once with ``python -m converters.legacy_to_safe``
(the only place in the project that unpickles without restriction, behind an explicit flag).
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from contrastive_transfer.cli import UserError

__all__ = [
    "UnsafeFileError",
    "LEGACY_COMMAND",
    "NUMPY_RNG_GLOBALS",
    "torch_load",
    "load_pickle",
    "pickle_globals",
    "unsafe_globals",
    "refusal",
]

LEGACY_COMMAND = "python -m converters.legacy_to_safe"


class UnsafeFileError(UserError, ValueError):
    """A file that holds objects beyond data: loading it could run code, so it is refused unread."""


def refusal(path: str | os.PathLike, globals_: Iterable[str]) -> str:
    """The one line for a refused file: what, which file, what to do."""
    names = sorted(set(globals_))
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    what = f"refers to {shown}" if names else "holds objects"
    return (
        f"refused to load {path}: it {what} beyond plain data, which loading would call as code; "
        f"if you trust its source, convert it once with `{LEGACY_COMMAND} {path} OUT --i-trust-this-file` "
        "(docs/security.md)"
    )


# ---------------------------------------------------------------------------------------- globals


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}


def pickle_globals(data: bytes) -> list[str]:
    """Every global a pickle refers to (``module.name``), found by reading its opcodes: nothing is
    imported or called. STACK_GLOBAL takes its two names from the preceding string pushes (direct or
    through the memo), which is how protocol-4+ pickles write them."""
    found: list[str] = []
    strings: list[str | None] = []
    memo: dict[int, Any] = {}
    offset = 0
    while offset < len(data):  # torch's legacy format is several pickles one after another
        stream = io.BytesIO(data[offset:])
        try:
            for op, arg, pos in pickletools.genops(stream):
                _note(op.name, arg, strings, memo, found)
                if op.name == "STOP":
                    offset += (pos or 0) + 1
                    break
            else:
                break
        except Exception:  # a truncated or garbled pickle (or raw storage bytes): stop there
            break
        memo.clear()
    return list(dict.fromkeys(found))


def _note(name: str, arg: Any, strings: list[str | None], memo: dict[int, Any], found: list[str]) -> None:
    # `strings` mirrors what each op pushed (None: not a string), enough for STACK_GLOBAL's operands
    if name in _STRING_OPS:
        strings.append(arg if isinstance(arg, str) else str(arg))
    elif name in _MEMO_GET:
        strings.append(memo.get(arg) or "")
    elif name == "MEMOIZE":
        memo[len(memo)] = strings[-1] if strings else None
    elif name in _MEMO_PUT:
        memo[arg] = strings[-1] if strings else None
    else:
        if name in ("GLOBAL", "INST"):
            found.append(str(arg).replace(" ", "."))
        elif name == "STACK_GLOBAL" and len(strings) >= 2 and strings[-2] and strings[-1]:
            found.append(f"{strings[-2]}.{strings[-1]}")
        strings.append(None)
    del strings[:-2]  # only the last two pushes ever matter


def unsafe_globals(path: str | os.PathLike, allowed: Iterable[str] = ()) -> list[str]:
    """The globals of ``path`` that torch's weights-only loader does not allow (static: nothing runs)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a torch zip archive: a plain or legacy-format pickle
        pass
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    allowed_set = set(allowed) | _torch_data_globals()
    return [g for g in pickle_globals(data) if g not in allowed_set]


def _torch_data_globals() -> set[str]:
    """What torch's weights-only loader allows (tensor rebuilding, storages, containers): only used
    to leave those out of the message; whether a file loads is decided by torch.load itself."""
    try:  # a private table of torch; without it, the storages of the legacy format are listed too
        from torch._weights_only_unpickler import _get_allowed_globals

        return set(_get_allowed_globals())
    except Exception:
        return {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2"}


# ----------------------------------------------------------------------------------- torch files


def _numpy_rng_globals() -> list[Any]:
    # np.random.get_state() is a tuple ('MT19937', uint32 ndarray, pos, has_gauss, cached): pickled
    # with numpy's array reconstruction. Checkpoints written before the RNG state was stored as a
    # list need exactly these to load; nothing else of numpy is allowed.
    return [_multiarray()._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _multiarray() -> Any:
    try:  # numpy >= 2 (numpy.core still imports there, with a deprecation warning)
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    return multiarray


def _numeric() -> Any:
    try:
        from numpy._core import numeric
    except ImportError:  # numpy 1.x
        from numpy.core import numeric  # type: ignore[no-redef]
    return numeric


NUMPY_RNG_GLOBALS: list[Any] = _numpy_rng_globals()


def torch_load(path: str | os.PathLike, extra_globals: Iterable[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, allowing only ``extra_globals`` beyond
    torch's data types. UnsafeFileError (one line, naming the file and what it needs) for a file
    that needs more; other exceptions (not a checkpoint, truncated) propagate for the caller to
    phrase."""
    extra = list(extra_globals)
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" not in str(e) and "Weights only" not in str(e):
            raise
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in extra if hasattr(g, "__qualname__")}
        raise UnsafeFileError(refusal(path, unsafe_globals(path, allowed))) from None


# ---------------------------------------------------------------------------------- pickle files


def _allowed_pickle_globals() -> dict[tuple[str, str], Callable[..., Any]]:
    multiarray, numeric = _multiarray(), _numeric()
    table: dict[tuple[str, str], Callable[..., Any]] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(module, "_reconstruct")] = multiarray._reconstruct
        table[(module, "scalar")] = multiarray.scalar  # type: ignore[attr-defined]
    for module in ("numpy.core.numeric", "numpy._core.numeric"):
        table[(module, "_frombuffer")] = numeric._frombuffer  # type: ignore[attr-defined]
    return table


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Protocol-2 pickles write bytes as _codecs.encode(str, "latin1"); no other codec is needed,
    # and a codec name must not reach the codec registry (which imports modules by name).
    if encoding not in ("latin1", "latin-1", "iso-8859-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


_PICKLE_ALLOWED = _allowed_pickle_globals()


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        target = _PICKLE_ALLOWED.get((module, name))
        if target is None:
            raise _Refused(f"{module}.{name}")
        return target

    def persistent_load(self, pid: Any) -> Any:
        # torch.save's legacy format refers to tensor storages by persistent id
        raise pickle.UnpicklingError("a persistent id (a file written by torch.save: rename it to .pth)")


def load_pickle(path: str | os.PathLike) -> Any:
    """A detectron2 ``.pkl`` (numpy arrays in dicts) read through the restricted unpickler.

    UnsafeFileError names every global the file refers to beyond numpy arrays and containers (by a
    static scan); pickle.UnpicklingError and others propagate for a file that is not a pickle."""
    data = Path(path).read_bytes()
    if zipfile.is_zipfile(io.BytesIO(data)):
        raise pickle.UnpicklingError("a zip archive (a file written by torch.save: rename it to .pth)")
    try:
        return _DataUnpickler(io.BytesIO(data), encoding="latin1").load()
    except _Refused as e:
        allowed = {f"{m}.{n}" for m, n in _PICKLE_ALLOWED}
        names = [g for g in pickle_globals(data) if g not in allowed] or [e.name]
        raise UnsafeFileError(refusal(path, names)) from None
