"""Convert a trusted legacy pickle once into a file that loads without running code.

    python -m converters.legacy_to_safe IN OUT --i-trust-this-file

Every reader of the project refuses a file that needs more than tensors, numpy arrays and plain
containers (docs/security.md). A file you trust (your own old checkpoint, a model-zoo file whose
source you checked) is converted here once: it is unpickled WITHOUT restriction, which runs any
code it holds, so do it only for files whose source you trust, ideally in a throw-away container.
This is the only place in the project that does so, and only with ``--i-trust-this-file``.

What is kept: tensors, numpy arrays (as tensors; in a ``.pkl`` output as arrays), numbers, strings,
bytes, None and dicts/lists/tuples of them; an ``argparse.Namespace`` (MoCo's ``args``) becomes a
dict. Anything else is dropped and listed. OUT's suffix picks the format: ``.pth`` (torch.save,
loads with ``weights_only=True``), ``.pkl`` (detectron2 weights for the restricted unpickler) or
``.safetensors`` (the tensors only, under dotted names). The written file is read back through the
safe loader before the command succeeds.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from contrastive_transfer.cli import DEBUG_HELP, UserError, atomic_write, command
from contrastive_transfer.safe_load import is_torch_zip, load_pickle, torch_load
from contrastive_transfer.untrusted import open_untrusted

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
            return torch.load(path, map_location="cpu", weights_only=False)  # noqa: S614 - the opt-in
        except pickle.UnpicklingError:
            pass  # a plain pickle named .pth: read it as one below
    with open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")  # noqa: S301 - the opt-in


def plain(obj: Any, where: str, dropped: list[str], numpy_out: bool = False) -> Any:
    """``obj`` as data only (see the module docstring); what is not data is listed in ``dropped``."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_meta:
            dropped.append(f"{where} ({obj.layout} tensor)")
            return None
        t = obj.detach().cpu()
        return t.numpy() if numpy_out else t
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biufc":
            dropped.append(f"{where} (numpy array of {obj.dtype})")
            return None
        return obj if numpy_out else torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                dropped.append(f"{where}[{k!r}] (key of type {type(k).__name__})")
                continue
            value = plain(v, f"{where}.{k}" if where else str(k), dropped, numpy_out)
            if value is not None or v is None:
                out[k] = value
        return out
    if isinstance(obj, (list, tuple)):
        items = [plain(v, f"{where}[{i}]", dropped, numpy_out) for i, v in enumerate(obj)]
        return type(obj)(items) if type(obj) in (list, tuple) else list(items)
    dropped.append(f"{where or 'the file'} ({type(obj).__module__}.{type(obj).__qualname__})")
    return None


def _flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.contiguous()}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _write(data: Any, out: Path) -> None:
    if out.suffix == ".pkl":
        payload = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)

        def write(tmp: Path) -> None:
            tmp.write_bytes(payload)

        atomic_write(out, write)
        load_pickle(out)
    elif out.suffix == ".safetensors":
        from safetensors.torch import load_file, save_file

        tensors = _flat_tensors(data)
        if not tensors:
            raise UserError(f"{out}: the file holds no tensors to write as safetensors; use a .pth output")
        atomic_write(out, lambda tmp: save_file(tensors, str(tmp)))
        load_file(out)
    else:
        atomic_write(out, lambda tmp: torch.save(data, tmp))
        torch_load(out)  # proves the promise: the new file loads weights-only


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
    dropped: list[str] = []
    data = plain(loaded, "", dropped, numpy_out=out.suffix == ".pkl")
    _write(data, out)
    shown = "; ".join(dropped[:4]) + (" ..." if len(dropped) > 4 else "")
    note = f"; dropped {len(dropped)} non-data objects: {shown}" if dropped else ""
    print(f"wrote {out} (loads without running code){note}")


if __name__ == "__main__":
    main()
