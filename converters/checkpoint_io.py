"""A ResNet backbone from any supported checkpoint: layout detection, prefix stripping, depth detection.

Every reader of weights (converters, VOC07 SVM, linear and kNN probes, detection) goes through
``load_backbone``, so all of them accept the same files. The result is always a torchvision ResNet
state dict (``conv1.weight``, ``layer1.0.bn1.running_mean``, ...) without ``fc``.

A *layout* (``converters.layouts``) says where the backbone lives in a file; this project's own
files carry the backbone record of ``contrastive_transfer.contract``, whose version is checked here.

The depth is read from the keys (blocks per stage, basic vs bottleneck blocks, bottleneck width),
then every tensor is checked against a torchvision model of that depth: a wrong file fails here with
one line naming the file and the keys, not later inside detectron2.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from contrastive_transfer.cli import UserError
from contrastive_transfer.contract import (
    ARCHS,
    METHOD_STATE,
    STEM_KERNELS,
    FormatError,
    pretraining_image_size,
    read_backbone_record,
    resnet_backbone,
    training_state,
    weights_sha256,
)
from contrastive_transfer.safe_load import UnsafeFileError, load_weights_file
from contrastive_transfer.untrusted import tensor_problem
from converters.layouts import ENCODERS, LAYOUTS

logger = logging.getLogger(__name__)


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read as a ResNet backbone; the message is one line naming the
    file and the keys, shapes or options at fault."""


@dataclass
class Backbone:
    state_dict: dict[str, torch.Tensor]  # torchvision ResNet names, no fc.*
    arch: str  # resnet18 | resnet34 | resnet50 | resnet101 | resnet152 | wide_resnet50_2 | wide_resnet101_2
    stem: str  # "imagenet" (7x7/2 conv + max-pool) | "small" (3x3/1 conv, no max-pool)
    layout: str  # the detected (or forced) layout name
    dropped: list[str] = field(default_factory=list)  # non-backbone tensors of the container (heads, queues, ...)
    source: str = ""  # the input path
    encoder: str = "query"  # which encoder was read: "query" | "key"
    image_size: int | None = None  # the pretraining crop, when the checkpoint records it (this project's)
    weights_sha256: str = ""  # contract.weights_sha256 of state_dict: metrics.json names the weights by it

    @property
    def depth(self) -> int:
        return ARCHS[self.arch].depth


_STEM_OF_KERNEL = {kernel: stem for stem, kernel in STEM_KERNELS.items()}
_BACKBONE_KEY = re.compile(r"^(conv1|bn1|layer[1-4])\.")
_BLOCK_KEY = re.compile(r"^layer([1-4])\.(\d+)\.")


@functools.lru_cache(maxsize=None)
def _expected_shapes(arch: str, stem: str) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only: no memory, no initialization cost
        net, _ = resnet_backbone(arch, stem)
    return {k: tuple(v.shape) for k, v in net.state_dict().items()}


# --------------------------------------------------------------------------------------------
# Reading a layout


# A torchvision ResNet flattened into nn.Sequential(*list(resnet.children())[:-1]) (lightly's
# examples) numbers its children: conv1, bn1, relu, maxpool, layer1..layer4, avgpool.
_SEQUENTIAL_CHILDREN = {"0": "conv1", "1": "bn1", "4": "layer1", "5": "layer2", "6": "layer3", "7": "layer4"}


def _unwrap(key: str) -> str:
    """Drop DataParallel/DDP (`module.`) and torch.compile (`_orig_mod.`) wrapper components."""
    return ".".join(part for part in key.split(".") if part not in ("module", "_orig_mod"))


def _container(ckpt, path: str) -> dict[str, torch.Tensor] | None:
    obj = ckpt
    for part in filter(None, path.split(".")):
        if not isinstance(obj, Mapping) or part not in obj:
            return None
        obj = obj[part]
    if not isinstance(obj, Mapping):
        return None
    tensors: dict[str, torch.Tensor] = {}
    original: dict[str, str] = {}
    for k, v in obj.items():
        if isinstance(k, str) and isinstance(v, torch.Tensor):
            name = _unwrap(k)
            if name in tensors:  # e.g. a `module.` copy beside a plain copy: which one is meant is unknowable
                raise _KeyCollision(
                    f"keys {original[name]!r} and {k!r} both read as {name!r} once the wrapper prefixes "
                    "(module., _orig_mod.) are dropped: the file holds two copies; keep the one you mean"
                )
            tensors[name], original[name] = v, k
    return tensors or None


class _KeyCollision(Exception):
    """Raised inside the layout search; load_backbone names the file."""


def _from_sequential(name: str) -> str:
    head, _, rest = name.partition(".")
    return f"{_SEQUENTIAL_CHILDREN[head]}.{rest}" if head in _SEQUENTIAL_CHILDREN else name


_DETECTRON2_NAMES = (  # converters.to_detectron2's renaming, undone (regex, replacement), in this order
    (re.compile(r"^stem\."), ""),
    (re.compile(r"^res([2-5])\."), lambda m: f"layer{int(m.group(1)) - 1}."),
    (re.compile(r"\bconv([1-3])\.norm\."), r"bn\1."),
    (re.compile(r"\bshortcut\.norm\."), "downsample.1."),
    (re.compile(r"\bshortcut\."), "downsample.0."),
)


def _from_detectron2(name: str) -> str:
    for pattern, replacement in _DETECTRON2_NAMES:
        name = pattern.sub(replacement, name)  # type: ignore[arg-type]
    return name


def _torchvision_names(sub: dict[str, torch.Tensor], names: str = "torchvision") -> dict[str, torch.Tensor] | None:
    """The tensors under one prefix in torchvision names, or None if they do not look like a ResNet
    (``names="detectron2"``: a ResNet in detectron2's names, those converters.to_detectron2 writes)."""
    if names == "detectron2":
        return {_from_detectron2(k): v for k, v in sub.items()} if "stem.conv1.weight" in sub else None
    if "conv1.weight" in sub:
        return sub
    if "0.weight" in sub and any(k.startswith("4.0.") for k in sub):
        return {_from_sequential(k): v for k, v in sub.items()}
    return None


def _is_backbone_tensor(name: str) -> bool:
    return bool(_BACKBONE_KEY.match(name) or _BACKBONE_KEY.match(_from_sequential(name)))


def _find(ckpt, sources, names: str = "torchvision") -> tuple[dict[str, torch.Tensor], list[str], str, str] | None:
    """The first (container, prefix) holding a ResNet: (its tensors in torchvision names, the
    container's other tensors, container, prefix)."""
    for path, prefix in sources:
        tensors = _container(ckpt, path)
        if tensors is None:
            continue
        sub = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        named = _torchvision_names(sub, names)
        if named is not None:
            others = [k for k in tensors if not k.startswith(prefix)]
            return named, others, path, prefix
    return None


def _load_file(path: Path):
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: no such file")
    try:
        # one reader per format (safe_load.load_weights_file): weights_only torch files (the numpy
        # RNG globals let training states of the earlier format load), .safetensors, detectron2 .pkl
        ckpt = load_weights_file(path)
    except UnsafeFileError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # torch.load / safetensors / pickle raise many types for a file that is not one
        what = "safetensors file" if path.suffix == ".safetensors" else "torch checkpoint or detectron2 .pkl"
        raise CheckpointError(f"{path}: not a readable {what} ({_first_line(e)})") from None
    return _numpy_to_torch(ckpt, str(path))


# The record a weights file written by the converters carries under ``METADATA_KEY``, as strings
# (all a .safetensors header holds; the same in a .pth and a .pkl, so one reader serves the three):
# format, arch, stem, image_size (when known), weights_sha256, and how it was read (source_layout,
# encoder). ``.safetensors`` files written before the .pth and .pkl carried it say the older format.
WEIGHTS_METADATA_FORMAT = "contrastive-transfer/weights-metadata/v1"
_METADATA_FORMATS = (WEIGHTS_METADATA_FORMAT, "contrastive-transfer/torchvision-safetensors/v1")
METADATA_KEY = "metadata"
MAX_IMAGE_SIZE = 4096  # a pretraining crop read from a file (--crop auto) is bounded by this


def _numpy_to_torch(ckpt, source: str, depth: int = 0, where: str = ""):
    """The numpy arrays of a ``.pkl`` as tensors, wherever its dicts hold them (detectron2's under
    ``model`` or ``blobs``, ``legacy_to_safe``'s at the top level or nested as in the original),
    so that one validation (``untrusted.tensor_problem``) judges every format. Dicts deeper than
    any layout's container are left as they are (no layout reads there)."""
    if isinstance(ckpt, np.ndarray):
        if ckpt.dtype.kind not in "fiubc":
            raise CheckpointError(
                f"{source}: {where or '(top level)'} has dtype {ckpt.dtype}, expected real floating point weights"
            )
        return torch.from_numpy(np.array(ckpt))  # a writable copy: pickled arrays are read-only
    if isinstance(ckpt, Mapping) and depth < _MAX_CONTAINER_DEPTH:
        return {k: _numpy_to_torch(v, source, depth + 1, f"{where}.{k}" if where else str(k)) for k, v in ckpt.items()}
    return ckpt


_MAX_CONTAINER_DEPTH = 6  # the deepest layout container (classy_state_dict.base_model.model.trunk) is 4 levels down


def _metadata_record(ckpt, source: str) -> dict | None:
    """The backbone record in the metadata the converters write (``weights_metadata``), sizes bounded."""
    meta = ckpt.get(METADATA_KEY) if isinstance(ckpt, Mapping) else None
    if not isinstance(meta, Mapping) or meta.get("format") not in _METADATA_FORMATS:
        return None
    size = meta.get("image_size", "")
    if size not in ("", None) and not (str(size).isdigit() and 1 <= int(size) <= MAX_IMAGE_SIZE):
        raise CheckpointError(f"{source}: metadata image_size={size!r}, expected an integer from 1 to {MAX_IMAGE_SIZE}")
    return {
        "arch": meta.get("arch"),
        "stem": meta.get("stem"),
        "image_size": int(size) if size not in ("", None) else None,
        "weights_sha256": meta.get("weights_sha256"),
    }


def read_record(ckpt, source: str) -> dict | None:
    """The record a loaded weights file carries: this project's backbone record (checkpoints), or
    the converters' metadata (.safetensors, .pth, .pkl); None for a file from elsewhere."""
    try:
        return read_backbone_record(ckpt, source) or _metadata_record(ckpt, source)
    except FormatError as e:
        raise CheckpointError(str(e)) from None


def weights_metadata(arch: str, stem: str, image_size: int | None, weights_sha256: str, **how: str) -> dict[str, str]:
    """The record a converted weights file carries under ``METADATA_KEY`` (strings only: the form a
    .safetensors header holds), so that every evaluator reads the same from every format."""
    meta = {"format": WEIGHTS_METADATA_FORMAT, "arch": arch, "stem": stem, "weights_sha256": weights_sha256, **how}
    if image_size is not None:
        meta["image_size"] = str(image_size)
    return {k: v for k, v in meta.items() if v}


def backbone_metadata(backbone: Backbone) -> dict[str, str]:
    """``weights_metadata`` of a backbone read by ``load_backbone``."""
    return weights_metadata(
        backbone.arch,
        backbone.stem,
        backbone.image_size,
        backbone.weights_sha256,
        source_layout=backbone.layout,
        encoder=backbone.encoder,
    )


def carried_metadata(ckpt, source: str) -> dict[str, str] | None:
    """``weights_metadata`` of the record a loaded file carries (either form), None without one: what
    a conversion that keeps tensors only (legacy_to_safe's .safetensors) writes beside them."""
    record = read_record(ckpt, source)
    if record is None:
        return None
    size = pretraining_image_size(record)
    strings = {k: record.get(k) for k in ("arch", "stem", "weights_sha256")}
    return weights_metadata(**{k: v if isinstance(v, str) else "" for k, v in strings.items()}, image_size=size)


def pycls_problem(ckpt) -> str | None:
    """Why a pycls checkpoint (``model_state`` in pycls names: ``stem.conv``, ``s1.b1.f.a``, ...) is
    read nowhere, or None when ``ckpt`` is not one. One sentence for every entry point, the
    evaluators, the converters and detection alike (detectron2 alone would read it by its ``.pyth``
    suffix, with matching heuristics that fit pycls's RegNets, not a ResNet's stages).

    Its ResNet cannot be read faithfully: where a block's stride sits (the 1x1 or the 3x3 conv) is
    pycls's ``RESNET.STRIDE_1X1``, whose default changed between pycls versions, and the weights do
    not record it (a strided 1x1 has the shape of an unstrided one)."""
    try:
        state = _container(ckpt, "model_state")
    except _KeyCollision:  # not judged here: the layout search names the collision
        return None
    if not state or not any(k.startswith("stem.conv.") or re.match(r"s\d+\.b\d+\.", k) for k in state):
        return None
    return (
        "a pycls checkpoint (model_state, names stem.conv, s1.b1.f.a, ...): not read, because its weights do not "
        "record where each block's stride is (pycls's RESNET.STRIDE_1X1) and the ResNet read from them could "
        "compute another network; export the backbone in torchvision names from pycls with the config it was "
        "trained with"
    )


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _describe(ckpt) -> str:
    if not isinstance(ckpt, Mapping):
        return f"the file holds a {type(ckpt).__name__}, not a dict"
    top = [str(k) for k in list(ckpt)[:8]]
    hints = sorted(
        {
            k
            for path in ("", "state_dict", "model", METHOD_STATE, "method")  # "method": older training states
            for k in (_container(ckpt, path) or {})
            if k.endswith("conv1.weight")
        }
    )[:4]
    pycls = pycls_problem(ckpt)
    if pycls is not None:
        return pycls
    caffe2 = any(k in (_container(ckpt, "model") or {}) for k in ("conv1_w", "res_conv1_bn_s"))
    if caffe2:  # the MSRA / Detectron1 ImageNet models of detectron2's model zoo (R-50.pkl)
        return (
            "Caffe2 names (conv1_w, res2_0_branch2a_w, ...): a ResNet for BGR input with the stride in its 1x1 "
            "convs, which the torchvision ResNet of the converters and evaluators does not compute; use it with "
            "transfer.detection"
        )
    return f"top-level keys {top}" + (f", conv1 weights at {hints}" if hints else "")


# --------------------------------------------------------------------------------------------
# Depth detection and validation


def _detect_arch(sd: dict[str, torch.Tensor], source: str) -> str:
    """The smallest torchvision ResNet whose blocks contain every block present in `sd`."""
    counts = [0, 0, 0, 0]
    for k in sd:
        m = _BLOCK_KEY.match(k)
        if m:
            stage, block = int(m.group(1)) - 1, int(m.group(2))
            counts[stage] = max(counts[stage], block + 1)
    first = sd.get("layer1.0.conv1.weight")
    if first is not None and first.dim() == 4:
        bottleneck = tuple(first.shape[2:]) == (1, 1)  # a bottleneck opens with a 1x1 conv, a basic block with 3x3
    else:
        bottleneck = any(re.match(r"layer[1-4]\.\d+\.conv3\.weight$", k) for k in sd)
    channels = sd["conv1.weight"].shape[0]  # the stem's: _detect_stem checked it is one of ARCHS'
    # Basic blocks have no bottleneck width; a wrong width there is reported as a shape error.
    width = first.shape[0] if bottleneck and first is not None and first.dim() == 4 else 64
    fits = [
        name
        for name, spec in ARCHS.items()
        if spec.bottleneck == bottleneck
        and spec.channels == channels
        and (spec.width_per_group == width or not bottleneck)
        and all(c <= b for c, b in zip(counts, spec.blocks))
    ]
    if not fits:
        kind = "bottleneck" if bottleneck else "basic"
        raise CheckpointError(
            f"{source}: {kind} blocks per stage {tuple(counts)} with {channels} stem channels and stage-1 width "
            f"{width} fit no supported ResNet ({', '.join(ARCHS)})"
        )
    return min(fits, key=lambda name: sum(ARCHS[name].blocks))


def _validate(sd: dict[str, torch.Tensor], arch: str, stem: str, source: str) -> dict[str, torch.Tensor]:
    expected = _expected_shapes(arch, stem)
    out, storages = {}, set()
    for k, shape in expected.items():
        if k not in sd and k.endswith("num_batches_tracked"):
            out[k] = torch.tensor(0)  # older/VISSL-converted files omit it; it has no effect in eval
        elif k in sd:
            if tuple(sd[k].shape) != shape:  # first: the shape bounds what reading the values costs
                raise CheckpointError(
                    f"{source}: {k} has shape {tuple(sd[k].shape)}, expected {shape} for {arch} ({stem} stem)"
                )
            _check_tensor(sd[k], k, source)
            v = sd[k].detach().cpu()
            v = v.float() if v.is_floating_point() else v
            # each tensor its own contiguous storage: safetensors refuses tensors that share memory
            # (tied weights: one tensor under two names, or views of one buffer) and non-contiguous
            # ones (channels_last), and the backbone keeps no more than it holds
            storage = v.untyped_storage()
            shared = storage.data_ptr() in storages and storage.nbytes() > 0
            if shared or storage.nbytes() != v.nbytes or not v.is_contiguous():
                v = v.contiguous().clone()
            storages.add(v.untyped_storage().data_ptr())
            out[k] = v
    missing = [k for k in expected if k not in out]
    if missing:
        raise CheckpointError(
            f"{source}: {len(missing)} {arch} backbone tensors missing, e.g. {', '.join(missing[:4])}"
        )
    unexpected = [k for k in sd if _BACKBONE_KEY.match(k) and k not in expected]
    if unexpected:
        raise CheckpointError(
            f"{source}: tensors {', '.join(unexpected[:4])} do not belong to {arch} "
            f"({len(unexpected)} unexpected backbone tensors)"
        )
    return out


def _check_tensor(v: torch.Tensor, name: str, source: str) -> None:
    """Dense, real floating point (counters excepted), stored values within its storage (no
    stride 0), then finite: anything else would fail later with a traceback, or worse, evaluate to
    chance without a word. The same rule as detection's (``untrusted.tensor_problem``)."""
    problem = tensor_problem(v, integer_ok=name.endswith("num_batches_tracked"))
    if problem is not None:
        raise CheckpointError(f"{source}: {name} {problem}")


_STEM_CHANNELS = sorted({spec.channels for spec in ARCHS.values()})


def _detect_stem(sd: dict[str, torch.Tensor], source: str) -> str:
    shape = tuple(sd["conv1.weight"].shape)
    fits = len(shape) == 4 and shape[0] in _STEM_CHANNELS and shape[1] == 3
    stem = _STEM_OF_KERNEL.get((shape[2], shape[3])) if fits else None
    if stem is None:
        known = len(shape) == 4 and shape[0] in _STEM_CHANNELS
        c = shape[0] if known else "C"
        raise CheckpointError(
            f"{source}: conv1.weight has shape {shape}, expected ({c}, 3, 7, 7) (imagenet stem) or "
            f"({c}, 3, 3, 3) (small stem)"
            + ("" if known else f", C one of {', '.join(map(str, _STEM_CHANNELS))} (64: torchvision's ResNets)")
        )
    return stem


# --------------------------------------------------------------------------------------------
# Public API


def load_backbone(path: str | os.PathLike, encoder: str = "query", layout: str = "auto") -> Backbone:
    """Read the ResNet backbone of `path` (query encoder, or the momentum encoder with encoder="key").

    layout="auto" tries every layout of ``LAYOUTS`` in order; a layout name forces one.
    Raises CheckpointError with a one-line message for anything that is not a supported ResNet.
    """
    path = Path(path)
    source = str(path)
    if encoder not in ENCODERS:
        raise CheckpointError(f"encoder={encoder!r}: expected one of {ENCODERS}")
    if layout != "auto" and layout not in LAYOUTS:
        raise CheckpointError(f"layout={layout!r}: expected 'auto' or one of {list(LAYOUTS)}")
    ckpt = _load_file(path)
    record = read_record(ckpt, source)  # this project's files: the version is checked here
    try:
        return _read_backbone(ckpt, record, source, encoder, layout)
    except _KeyCollision as e:
        raise CheckpointError(f"{source}: {e}") from None


def _read_backbone(ckpt, record: dict | None, source: str, encoder: str, layout: str) -> Backbone:
    candidates = list(LAYOUTS.values()) if layout == "auto" else [LAYOUTS[layout]]

    found = next((c for c in candidates if _find(ckpt, c.query, c.names) is not None), None)
    if found is None:
        which = (
            "no ResNet backbone found"
            if layout == "auto"
            else f"not in the {layout!r} layout ({LAYOUTS[layout].description})"
        )
        if training_state(ckpt) is not None:
            which = (
                "a training checkpoint of this project written before it carried the backbone record; "
                "convert the run's checkpoint_final.pth, or resume the run once to rewrite it"
            )
        raise CheckpointError(f"{source}: {which}; {_describe(ckpt)}")

    hit = _find(ckpt, found.query if encoder == "query" else found.key, found.names)
    if hit is None:
        raise CheckpointError(f"{source}: no momentum encoder in this {found.name!r} checkpoint (use --encoder query)")
    tensors, others, container, _ = hit
    other = _find(ckpt, found.key if encoder == "query" else found.query, found.names)
    other_prefix = other[3] if other is not None and other[2] == container else None
    backbone_tensors = {k: v for k, v in tensors.items() if _BACKBONE_KEY.match(k)}
    if "conv1.weight" not in backbone_tensors:
        raise CheckpointError(f"{source}: no ResNet backbone found; {_describe(ckpt)}")
    stem = _detect_stem(backbone_tensors, source)
    arch = _detect_arch(backbone_tensors, source)
    state_dict = _validate(backbone_tensors, arch, stem, source)
    # The other encoder's backbone is not "dropped": it is the --encoder choice not taken.
    dropped = [k for k in tensors if k not in backbone_tensors] + [
        k
        for k in others
        if other_prefix is None or not k.startswith(other_prefix) or not _is_backbone_tensor(k[len(other_prefix) :])
    ]
    if record is not None and (record.get("arch"), record.get("stem")) != (arch, stem):
        raise CheckpointError(
            f"{source}: the record says {record.get('arch')} ({record.get('stem')} stem) "
            f"but its tensors are {arch} ({stem} stem)"
        )
    # Files without the record (hand-made, or a baseline saved in this project's shape) may still
    # say their pretraining size in config.data.image_size.
    size = pretraining_image_size(record if record is not None else ckpt) if isinstance(ckpt, Mapping) else None
    if size is not None and not (isinstance(size, int) and 1 <= size <= MAX_IMAGE_SIZE):
        raise CheckpointError(f"{source}: image_size={size!r} recorded, expected an integer from 1 to {MAX_IMAGE_SIZE}")
    digest = weights_sha256(state_dict)
    recorded = record.get("weights_sha256") if record is not None and encoder == "query" else None
    if recorded and recorded != digest:
        raise CheckpointError(
            f"{source}: its weights do not match the weights_sha256 it records ({recorded[:12]}...): "
            "the tensors were changed after the file was written; use the original file"
        )
    return Backbone(state_dict, arch, stem, found.name, dropped, source, encoder, size, digest)


def backbone_layout(ckpt) -> str | None:
    """The name of the layout (``LAYOUTS``) in which a loaded weights file holds a ResNet, judged
    by its key names alone (numpy arrays of a ``.pkl`` count as tensors), or None: how
    ``transfer.detection`` tells a torchvision-named backbone (which its detectron2 model cannot
    load) from detectron2 weights, by the same rules the converters use. Nothing is validated."""
    probe = _names_only(ckpt, depth=0)
    try:
        return next((c.name for c in LAYOUTS.values() if _find(probe, c.query, c.names) is not None), None)
    except _KeyCollision:
        return None


def _names_only(obj, depth: int):
    # the dict structure with an empty meta tensor for every array: enough for _find, costs nothing
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return torch.empty(0, device="meta")
    if isinstance(obj, Mapping) and depth < _MAX_CONTAINER_DEPTH:
        return {k: _names_only(v, depth + 1) for k, v in obj.items()}
    return None


def build_resnet(backbone: Backbone) -> nn.Module:
    """A torchvision ResNet (fc = Identity) holding `backbone`'s weights (strict load), in eval mode."""
    net, _ = resnet_backbone(backbone.arch, backbone.stem)
    net.load_state_dict(backbone.state_dict, strict=True)
    return net.eval()


def summary_lines(backbone: Backbone) -> list[str]:
    dropped = f"dropped {len(backbone.dropped)} non-backbone tensors" + (
        f" ({', '.join(backbone.dropped[:4])}{', ...' if len(backbone.dropped) > 4 else ''})"
        if backbone.dropped
        else ""
    )
    return [
        f"read {backbone.source}: layout {backbone.layout}, {backbone.encoder} encoder, {backbone.arch} "
        f"(depth {backbone.depth}, {backbone.stem} stem), {len(backbone.state_dict)} tensors",
        dropped,
    ]
