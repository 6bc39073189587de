"""Convert a trusted legacy pickle once into a file that loads without running code.

    python -m converters.legacy_to_safe IN OUT --i-trust-this-file

Every reader of the project refuses a file that needs more than tensors, numpy arrays and plain
containers (docs/security.md). A file you trust (your own old checkpoint, a model-zoo file whose
source you checked) is converted here once: it is unpickled WITHOUT restriction, which runs any
code it holds, so do it only for files whose source you trust, ideally in a throw-away container.
This is the only place in the project that does so, and only with ``--i-trust-this-file``.

What is kept: tensors, numpy arrays (as tensors; in a ``.pkl`` output as arrays), numbers, strings,
bytes, None and dicts/lists/tuples of them; an ``argparse.Namespace`` (MoCo's ``args``) becomes a
dict. Anything else is dropped and listed, and so are quantized and sparse tensors (no reader
takes them). OUT's suffix picks the format: ``.pth`` (torch.save, loads with ``weights_only=True``),
``.pkl`` (detectron2 weights for the restricted unpickler) or ``.safetensors`` (the tensors only,
under dotted names, with the record the file carries, a checkpoint's backbone record or a
converter's ``metadata``, as the header's metadata: ``converters.checkpoint_io.weights_metadata``).
A tensor whose dtype the format lacks (numpy has no bfloat16 or float8) is
widened to float32 or complex64, which hold its values exactly, and listed. The written file is read
back through the safe loader before it takes OUT's name.
"""

from __future__ import annotations

import argparse
import functools
import pickle
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from contrastive_transfer.cli import DEBUG_HELP, UserError, atomic_write, command
from contrastive_transfer.safe_load import is_torch_zip, load_pickle, torch_load
from contrastive_transfer.untrusted import check_expansion, open_untrusted
from converters.checkpoint_io import CheckpointError, carried_metadata

FLAG = "--i-trust-this-file"
_SCALARS = (str, int, float, bool, bytes, type(None))


def _saved_by_torch(path: Path) -> bool:
    """A file in one of torch.save's formats, whatever its name: a zip by its first bytes, or the
    legacy format by the number its first pickle holds (read with torch's restricted unpickler;
    a plain pickle holds the object itself there)."""
    from torch import _weights_only_unpickler as weights_only

    with open_untrusted(path, "weights") as f:  # the gate, as for every input: no special file
        if is_torch_zip(f):
            return True
        try:
            return weights_only.load(f, encoding="utf-8") == torch.serialization.MAGIC_NUMBER
        except Exception:  # anything the restricted unpickler refuses or cannot read: not torch's
            return False


def _trusted_load(path: Path) -> Any:
    """The one unrestricted unpickling of the project (see the module docstring)."""
    if _saved_by_torch(path) or path.suffix in (".pth", ".pt", ".tar", ".pyth"):
        try:
            with open_untrusted(path, "weights") as f:  # trusted code, but still no special file
                return torch.load(f, map_location="cpu", weights_only=False)  # noqa: S614 - the opt-in
        except pickle.UnpicklingError:
            pass  # a plain pickle named .pth: read it as one below
    with open_untrusted(path, "weights") as f:
        return pickle.load(f, encoding="latin1")  # noqa: S301 - the opt-in


def plain(obj: Any, where: str, dropped: list[str], out: str = ".pth", widened: list[str] | None = None) -> Any:
    """``obj`` as data only, in what OUT's format (its suffix ``out``) stores (see the module
    docstring); what is not data is listed in ``dropped``, a tensor widened to a dtype the format
    holds (exactly) in ``widened``. Tensors become numpy arrays for a ``.pkl``."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_meta or obj.is_quantized:
            # no reader of the project takes these (a quantized tensor is rebuilt from a size the
            # file states, which the safe loader refuses), so the written file would not load back
            dropped.append(f"{where} ({'quantized' if obj.is_quantized else obj.layout} tensor)")
            return None
        # the conjugate and negative bits are flags, not stored values: numpy and safetensors take
        # the stored ones (a conjugated 1-1j would be written as 1+1j)
        t = _stored_as(obj.detach().cpu().resolve_conj().resolve_neg(), out, where, dropped, widened)
        return t.numpy() if t is not None and out == ".pkl" else t
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biufc":
            dropped.append(f"{where} (numpy array of {obj.dtype})")
            return None
        if out == ".pkl":
            return obj
        return _stored_as(torch.from_numpy(np.ascontiguousarray(obj)), out, where, dropped, widened)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    if isinstance(obj, dict):
        result = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                dropped.append(f"{where}[{k!r}] (key of type {type(k).__name__})")
                continue
            value = plain(v, f"{where}.{k}" if where else str(k), dropped, out, widened)
            if value is not None or v is None:
                result[k] = value
        return result
    if isinstance(obj, (list, tuple)):
        items = [plain(v, f"{where}[{i}]", dropped, out, widened) for i, v in enumerate(obj)]
        return type(obj)(items) if type(obj) in (list, tuple) else list(items)
    dropped.append(f"{where or 'the file'} ({type(obj).__module__}.{type(obj).__qualname__})")
    return None


def _stored_as(t: torch.Tensor, out: str, where: str, dropped: list[str], widened: list[str] | None):
    """``t`` in a dtype OUT's format holds: its own, else float32 / complex64 for a narrower float
    (bfloat16, the float8s, complex32: every value exactly), else None (listed as dropped)."""
    if _holds(out, t.dtype):
        return t
    wider = torch.float32 if t.is_floating_point() else torch.complex64 if t.is_complex() else None
    if wider is not None and t.dtype.itemsize < wider.itemsize and _holds(out, wider):  # never narrower
        try:
            wide = t.to(wider)
        except NotImplementedError:  # e.g. float4_e2m1fn_x2, two values packed in a byte
            pass
        else:
            if widened is not None:
                widened.append(f"{where} ({t.dtype})")
            return wide
    dropped.append(f"{where} ({t.dtype}: no {out} dtype holds it)")
    return None


@functools.cache
def _holds(out: str, dtype: torch.dtype) -> bool:
    """Whether OUT's format stores ``dtype`` as it is. Probed on an empty tensor rather than
    listed: numpy's and safetensors' dtypes grow with their versions. torch.save holds them all."""
    empty = torch.empty(0, dtype=dtype)
    try:
        if out == ".pkl":
            empty.numpy()
        elif out == ".safetensors":
            from safetensors.torch import save

            save({"probe": empty})
    except (TypeError, KeyError, ValueError):  # how numpy and safetensors say "no such dtype"
        return False
    return True


def _flat_tensors(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors of nested dicts under dotted names, each with storage of its own: safetensors
    refuses tensors that share memory (tied weights, views of one another)."""
    flat = _flat_tensor_items(obj, "")
    seen: set[int] = set()
    out = {}
    for name, t in flat:
        t = t.contiguous()
        shared = t.untyped_storage().data_ptr() in seen and t.numel() > 0
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t.clone() if shared else t
    return out


def _flat_tensor_items(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if not isinstance(obj, dict):
        return []
    return [item for k, v in obj.items() for item in _flat_tensor_items(v, f"{prefix}.{k}" if prefix else str(k))]


def _write(data: Any, out: Path) -> None:
    """``data`` to ``out`` in its suffix's format, read back by the project's own reader before it
    takes OUT's name: a file that would not load is never left there."""
    check: Callable[[Path], object]
    if out.suffix == ".pkl":
        payload = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
        write, check = (lambda f: f.write(payload)), load_pickle
    elif out.suffix == ".safetensors":
        from safetensors.torch import load_file, save

        tensors = _flat_tensors(data)
        if not tensors:
            raise UserError(f"{out}: the file holds no tensors to write as safetensors; use a .pth output")
        try:  # the record the evaluators read (--crop auto's size), which tensors alone would lose
            metadata = carried_metadata(data, str(out))
        except CheckpointError as e:
            raise UserError(f"{out}: not written, the file's record cannot be read ({e})") from None

        write, check = (lambda f: f.write(save(tensors, metadata=metadata))), load_file
    else:
        # the check proves the promise: the new file loads weights-only
        write, check = (lambda f: torch.save(data, f)), torch_load
    try:
        atomic_write(out, write, check)
    except UserError as e:
        raise UserError(f"{out}: not written, the converted file does not load back ({e})") from None


def _first(names: list[str]) -> str:
    return "; ".join(names[:4]) + (" ..." if len(names) > 4 else "")


@command
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m converters.legacy_to_safe", description=__doc__.split("\n")[0], epilog=DEBUG_HELP
    )
    parser.add_argument("input", help="the legacy pickle (.pth/.pt/.tar/.pkl) you trust")
    parser.add_argument("output", help="the safe file to write: .pth, .pkl or .safetensors")
    parser.add_argument(FLAG, dest="trust", action="store_true", help="required: loading IN runs any code it holds")
    args = parser.parse_args(argv)
    src, out = Path(args.input), Path(args.output)
    if not args.trust:
        raise UserError(
            f"{src}: not converted, unpickling it runs any code it holds; "
            f"pass {FLAG} only if you trust its source (docs/security.md)"
        )
    if not src.is_file():
        raise UserError(f"{src}: no such file")
    if out.exists() and out.resolve() == src.resolve():
        raise UserError(f"{out}: the output would overwrite the input; choose another OUT")
    try:
        loaded = _trusted_load(src)
    except Exception as e:  # the file is trusted but may still be damaged
        raise UserError(f"{src}: cannot be unpickled ({type(e).__name__}: {e}); check the file") from None
    check_expansion(loaded, src)  # `plain` walks every path: shared references must not multiply them
    dropped: list[str] = []
    widened: list[str] = []
    data = plain(loaded, "", dropped, out.suffix, widened)
    _write(data, out)
    note = f"; dropped {len(dropped)} objects: {_first(dropped)}" if dropped else ""
    if widened:  # every value kept exactly, in a dtype OUT's format has
        note += f"; widened {len(widened)} tensors to float32 or complex64: {_first(widened)}"
    print(f"wrote {out} (loads without running code){note}")


if __name__ == "__main__":
    main()
