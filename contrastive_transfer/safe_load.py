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

Both read the file through the gate of ``contrastive_transfer.untrusted`` (regular files within a
size cap per kind; a torch zip's records checked against their declared sizes before inflating;
every loaded tensor's view checked against its storage), and ``load_weights_file`` is the one
reader of a weights file in any format the project accepts (torch, ``.safetensors``, detectron2
``.pkl``), used by the converters, the evaluators and detection alike.

A user who trusts a legacy file converts it once with ``python -m converters.legacy_to_safe``
(the only place in the project that unpickles without restriction, behind an explicit flag).
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import tarfile
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import IO, Any

import numpy as np
import torch

from contrastive_transfer.untrusted import (
    UnsafeFileError,
    check_archive,
    check_expansion,
    check_loaded_tensors,
    open_untrusted,
    read_untrusted,
)

__all__ = [
    "UnsafeFileError",
    "LEGACY_COMMAND",
    "NUMPY_RNG_GLOBALS",
    "torch_load",
    "load_pickle",
    "load_weights_file",
    "pickle_globals",
    "unsafe_globals",
    "refusal",
]

LEGACY_COMMAND = "python -m converters.legacy_to_safe"


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


def unsafe_globals(source: str | os.PathLike | IO[bytes], allowed: Iterable[str] = ()) -> list[str]:
    """The globals of ``source`` (a path, or a file opened by the gate) that torch's weights-only
    loader does not allow (static: nothing runs)."""
    try:
        if not isinstance(source, (str, os.PathLike)):
            source.seek(0)
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # not a torch zip archive: a plain or legacy-format pickle
        pass
    try:
        if isinstance(source, (str, os.PathLike)):
            data = read_untrusted(source, "training state")
        else:
            source.seek(0)
            data = source.read()  # bounded: the gate checked the size of this descriptor
    except (OSError, UnsafeFileError):
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


def is_torch_zip(f: IO[bytes]) -> bool:
    """Whether torch reads ``f`` as its zip format: by its first bytes (a local record's magic), as
    torch itself decides, not by a directory near the end as ``zipfile.is_zipfile`` does; a legacy
    file or a pickle with a zip trailer is a zip to zipfile, not to torch. Leaves ``f`` at 0."""
    f.seek(0)
    magic = f.read(4)
    f.seek(0)
    return magic == b"PK\x03\x04"


def torch_load(path: str | os.PathLike, extra_globals: Iterable[Any] = (), kind: str = "weights") -> Any:
    """``torch.load(weights_only=True)`` on the CPU of ``path`` read through the gate as ``kind``
    (``contrastive_transfer.untrusted.KINDS``), allowing only ``extra_globals`` beyond torch's data
    types. UnsafeFileError (one line, naming the file and why) for a special file, a file above the
    cap, a crafted archive or tensor view, or a file that needs more globals; other exceptions (not
    a checkpoint, truncated) propagate for the caller to phrase."""
    extra = list(extra_globals)
    with open_untrusted(path, kind) as f:
        check_archive(f, path, kind)
        torch_zip = is_torch_zip(f)
        _check_sized_calls(f, path, torch_zip)
        try:
            with torch.serialization.safe_globals(extra):
                if not torch_zip:
                    _check_legacy_storages(f, path)
                obj = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if "weights_only" not in str(e) and "Weights only" not in str(e):
                raise
            allowed = {f"{g.__module__}.{g.__qualname__}" for g in extra if hasattr(g, "__qualname__")}
            raise UnsafeFileError(refusal(path, unsafe_globals(f, allowed))) from None
        check_loaded_tensors(obj, path, kind, file_bytes=os.fstat(f.fileno()).st_size)
    return obj


def _sized_constructors() -> frozenset[str]:
    """Globals torch's weights-only loader allows that build a buffer or a tensor from a size the
    pickle states rather than from stored bytes: ``bytearray(n)`` fills n bytes with zeros, a tensor
    class ``torch.FloatTensor(n)`` reserves n elements, the quantized, nested and wrapper rebuilders
    allocate or describe the shape they are given. torch.save writes none of them for the dense
    tensors of a checkpoint. (``torch.Tensor`` is allowed too, as the type argument of tensors with
    attributes; a storage it makes is not backed by the file, which ``check_loaded_tensors``
    refuses after the load, as it refuses a sparse tensor, naming its key.)"""
    classes = {f"{t.__module__}.{t.__name__}" for t in torch._tensor_classes}
    rebuilders = ("_rebuild_qtensor", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass")
    return frozenset({"builtins.bytearray", *classes, *(f"torch._utils.{r}" for r in rebuilders)})


SIZED_CONSTRUCTORS = _sized_constructors()


def _check_sized_calls(f: IO[bytes], path: str | os.PathLike, torch_zip: bool) -> None:
    """Refuse a torch file whose pickle names a global of SIZED_CONSTRUCTORS, before any
    unpickler runs (static: the weights-only unpickler resolves only GLOBAL opcodes, which
    ``pickle_globals`` lists, and torch's name mapping of Python 2 names is applied here too)."""
    from torch._utils import IMPORT_MAPPING, NAME_MAPPING

    try:
        if torch_zip:
            with zipfile.ZipFile(f) as archive:  # record sizes checked by check_archive
                names = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                pickles = [archive.read(n) for n in names]
        else:
            pickles = [f.read()]  # bounded: the gate checked this descriptor's size
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError):
        pickles = []  # torch.load judges a damaged file
    finally:
        f.seek(0)
    for data in pickles:
        for name in pickle_globals(data):
            module, _, attr = name.rpartition(".")
            module, attr = NAME_MAPPING.get((module, attr), (IMPORT_MAPPING.get(module, module), attr))
            if f"{module}.{attr}" in SIZED_CONSTRUCTORS:
                raise UnsafeFileError(
                    f"{path}: its pickle calls {module}.{attr}, which reserves memory of a size the file states "
                    "instead of reading stored tensors; not a checkpoint torch.save wrote for dense tensors"
                )


def _check_legacy_storages(f: IO[bytes], path: str | os.PathLike) -> None:
    """The storage sizes a legacy-format (not zip) torch file declares, against the file's size,
    before torch.load allocates them.

    torch's legacy reader (``torch.serialization._legacy_load``), weights_only included, allocates
    every storage at the size its pickle declares and only then reads the bytes: a 400-byte file
    declaring 2^30 floats asks for 4 GiB. The zip format's records are checked by ``check_archive``;
    here a dry run of the pickle (``_legacy_declared_storages``) gives the declared sizes, and their
    sum must fit in the file that should hold them. The tar format of torch < 0.4 reads sizes from
    the file and allocates them before any pickle: it is refused."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    try:
        with tarfile.open(fileobj=f, mode="r:"):
            is_tar = True
    except (tarfile.TarError, OSError, ValueError):
        is_tar = False
    if is_tar:
        raise UnsafeFileError(
            f"{path}: a torch file in the tar format of torch < 0.4, not read (its reader reserves whatever sizes "
            "the file states); if you trust it, load it with that torch and torch.save it again (zip format)"
        )
    f.seek(0)
    try:
        declared = _legacy_declared_storages(f)
    finally:
        f.seek(0)
    if sum(declared.values()) > size:
        raise UnsafeFileError(
            f"{path}: declares {sum(declared.values())} bytes of tensor storage in a file of {size} bytes "
            "(torch's legacy reader reserves what is declared before reading a byte): a truncated or crafted file; "
            "use a complete copy"
        )


def _legacy_declared_storages(f: IO[bytes]) -> dict[Any, int]:
    """The bytes of every storage a legacy-format torch file's pickle declares, by key: a dry run
    of torch's legacy reader (three header pickles, then the object's) with torch's weights-only
    unpickler, where each storage is counted when the pickle creates it and handed over on the
    meta device (no memory, no data read). Counted at creation, not in the loaded object: a
    storage the pickle makes and then drops is still reserved by the real reader."""
    from torch import _weights_only_unpickler as weights_only

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 6:
            raise pickle.UnpicklingError(f"Weights only load failed: unsupported persistent id {saved_id!r:.80}")
        storage_type, key, _location, numel, _view = saved_id[1:]
        dtype = getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"Weights only load failed: unsupported storage {saved_id!r:.80}")
        nbytes = numel * torch._utils._element_size(dtype)
        declared[key] = max(declared.get(key, 0), nbytes)
        meta = created.setdefault(key, torch.UntypedStorage(nbytes, device="meta"))
        return torch.storage.TypedStorage(wrap_storage=meta, dtype=dtype, _internal=True)

    declared: dict[Any, int] = {}
    created: dict[Any, torch.UntypedStorage] = {}
    # sparse tensors rebuilt here are queued in torch's global list for validation by the next
    # torch.load, which cannot validate meta tensors: they leave the list with the dry run
    pending, queued = torch._utils._sparse_tensors_to_validate, len(torch._utils._sparse_tensors_to_validate)
    unpickler = weights_only.Unpickler(f, encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        # the headers, plain data, checked as torch's legacy reader checks them
        if weights_only.load(f, encoding="utf-8") != torch.serialization.MAGIC_NUMBER:
            raise RuntimeError("Invalid magic number; corrupt file?")
        if weights_only.load(f, encoding="utf-8") != torch.serialization.PROTOCOL_VERSION:
            raise RuntimeError("Invalid protocol version; corrupt file?")
        weights_only.load(f, encoding="utf-8")  # system info
        unpickler.load()
    except pickle.UnpicklingError as e:  # phrased as torch.load phrases a refused global
        if "Weights only" in str(e):
            raise
        raise pickle.UnpicklingError(f"Weights only load failed: {e}") from None
    finally:
        del pending[queued:]
    # A tensor rebuilt on a storage grows it to fit its shape (``set_``): the real reader reserves
    # the grown size, and so do these meta storages.
    return {key: max(n, created[key].nbytes()) for key, n in declared.items()}


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
    """A detectron2 ``.pkl`` (numpy arrays in dicts) read through the gate and the restricted
    unpickler.

    UnsafeFileError names every global the file refers to beyond numpy arrays and containers (by a
    static scan); pickle.UnpicklingError and others propagate for a file that is not a pickle."""
    data = read_untrusted(path, "weights")
    if is_torch_zip(io.BytesIO(data)):
        raise pickle.UnpicklingError("a zip archive (a file written by torch.save: rename it to .pth)")
    try:
        obj = _DataUnpickler(io.BytesIO(data), encoding="latin1").load()
    except _Refused as e:
        allowed = {f"{m}.{n}" for m, n in _PICKLE_ALLOWED}
        names = [g for g in pickle_globals(data) if g not in allowed] or [e.name]
        raise UnsafeFileError(refusal(path, names)) from None
    if type(obj) is int and obj == torch.serialization.MAGIC_NUMBER:
        # torch.save's legacy format opens with this number in a pickle of its own: a pickle reader
        # would return it and leave the weights, in the pickles after it, unread
        raise pickle.UnpicklingError("a file written by torch.save in its legacy format: rename it to .pth")
    check_expansion(obj, path)  # shared references: every walk after this one visits each path
    return obj


# -------------------------------------------------------------------------- one reader per format


def _load_safetensors(path: str | os.PathLike) -> dict:
    """``{"state_dict": tensors, "metadata": string metadata}`` (the format holds tensors and strings
    only). safetensors opens a path: the descriptor the gate checked is handed over by its
    /proc/self/fd name, so the file read is the file checked."""
    from safetensors import safe_open

    with open_untrusted(path, "weights") as f:
        fd_path = f"/proc/self/fd/{f.fileno()}"
        with safe_open(fd_path if os.path.exists(fd_path) else os.fspath(path), framework="pt", device="cpu") as st:
            metadata = dict(st.metadata() or {})
            tensors = {name: st.get_tensor(name) for name in st.keys()}
    check_loaded_tensors(tensors, path, "weights")
    return {"state_dict": tensors, "metadata": metadata}


def load_weights_file(path: str | os.PathLike) -> Any:
    """A weights file in any format the project reads, by one rule at every entry point:
    ``.safetensors`` by its suffix; a torch zip archive by its content, whatever its name;
    ``.pkl`` otherwise a detectron2 pickle (numpy arrays, ``load_pickle``); anything else
    ``torch_load`` (including torch's legacy format). numpy arrays are returned as they are."""
    name = os.fspath(path)
    if name.endswith(".safetensors"):
        return _load_safetensors(path)
    if name.endswith(".pkl"):
        with open_untrusted(path, "weights") as f:
            is_zip = is_torch_zip(f)
        if not is_zip:
            return load_pickle(path)
    return torch_load(path, NUMPY_RNG_GLOBALS)
