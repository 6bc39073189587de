"""Convert a checkpoint's ResNet backbone to detectron2 weights (a .pkl read with matching heuristics).

    python -m converters.to_detectron2 IN OUT.pkl [--encoder query|key] [--layout auto|...]

The renaming is detectron2's own torchvision rule (tools/convert-torchvision-to-d2.py, also used by
MoCo's convert-pretrain-to-detectron2.py); detectron2 ships it as a script, not as an importable
function, so it is re-stated here:

    conv1, bn1 (no `layer` in the name)  ->  stem.conv1, stem.conv1.norm
    layer1..layer4                       ->  res2..res5
    bnK                                  ->  convK.norm
    downsample.0, downsample.1           ->  shortcut, shortcut.norm

The pickle is ``{"model": {name: numpy array}, "__author__": ..., "matching_heuristics": True,
"metadata": the backbone record}`` (``converters.checkpoint_io.weights_metadata``: arch, stem,
image_size, weights_sha256 as strings, which the evaluators read and detectron2 ignores):
detectron2 reads ``.pkl`` files with pickle and, with ``matching_heuristics``, matches each model
key to the checkpoint key it ends with, so ``res2.0.conv1.weight`` lands on
``backbone.res2.0.conv1.weight`` (C4), ``backbone.bottom_up.res2...`` (FPN) and ``res5`` on
``roi_heads.res5`` (C4). The weights are torchvision's: the detectron2 config must say so (RGB,
torchvision mean/std, stride in the 3x3 conv); ``detectron2_config`` lists the fields.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from contrastive_transfer.contract import ARCHS
from converters.cli import convert_backbone, converter_main

if TYPE_CHECKING:  # the torch part is imported by convert(), so that --help answers at once
    from converters.checkpoint_io import Backbone

AUTHOR = "contrastive-transfer"

# torchvision's ImageNet normalization on the 0-255 RGB scale detectron2 feeds its models.
TORCHVISION_PIXEL_MEAN = [123.675, 116.28, 103.53]
TORCHVISION_PIXEL_STD = [58.395, 57.12, 57.375]

# Substring replacements, applied in this order (detectron2's tools/convert-torchvision-to-d2.py).
_RENAMES = (
    ("layer1", "res2"),
    ("layer2", "res3"),
    ("layer3", "res4"),
    ("layer4", "res5"),
    ("bn1", "conv1.norm"),
    ("bn2", "conv2.norm"),
    ("bn3", "conv3.norm"),
    ("downsample.0", "shortcut"),
    ("downsample.1", "shortcut.norm"),
)


def detectron2_name(torchvision_name: str) -> str:
    name = torchvision_name if "layer" in torchvision_name else "stem." + torchvision_name
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def detectron2_config(backbone: Backbone) -> dict[str, object]:
    """The detectron2 config fields these weights need (beyond MODEL.WEIGHTS)."""
    cfg: dict[str, object] = {
        "INPUT.FORMAT": "RGB",
        "MODEL.PIXEL_MEAN": TORCHVISION_PIXEL_MEAN,
        "MODEL.PIXEL_STD": TORCHVISION_PIXEL_STD,
        "MODEL.RESNETS.STRIDE_IN_1X1": False,
        "MODEL.RESNETS.DEPTH": backbone.depth,
    }
    spec = ARCHS[backbone.arch]
    if backbone.depth in (18, 34):
        cfg["MODEL.RESNETS.RES2_OUT_CHANNELS"] = 64  # basic blocks: stage 2 keeps the stem's 64 channels
    if spec.width_per_group != 64:
        cfg["MODEL.RESNETS.WIDTH_PER_GROUP"] = spec.width_per_group  # the bottleneck width of stage 2 (res2)
    if spec.channels != 64 and spec.bottleneck:  # SimCLR's wide ResNet-50s: every layer scaled, the stem too
        cfg["MODEL.RESNETS.STEM_OUT_CHANNELS"] = spec.channels
        cfg["MODEL.RESNETS.RES2_OUT_CHANNELS"] = 4 * spec.channels
    return cfg


def to_detectron2(backbone: Backbone) -> dict[str, np.ndarray]:
    """The backbone's tensors under detectron2 names, as numpy arrays (what detectron2's .pkl holds)."""
    from converters.checkpoint_io import CheckpointError

    if backbone.stem != "imagenet":
        raise CheckpointError(
            f"{backbone.source}: {backbone.arch} has the small 3x3/1 stem (conv1.weight "
            f"{tuple(backbone.state_dict['conv1.weight'].shape)}); detectron2's ResNet stem "
            "is 7x7/2 + max-pool, so it cannot be converted (use converters.to_torchvision or "
            "the frozen-feature evaluators)"
        )
    spec = ARCHS[backbone.arch]
    if not spec.bottleneck and spec.channels != 64:
        raise CheckpointError(
            f"{backbone.source}: {backbone.arch} has {spec.channels} stem channels; detectron2 "
            "builds ResNet-18/34 only with 64 (RES2_OUT_CHANNELS), so it cannot be converted (use "
            "converters.to_torchvision or the frozen-feature evaluators)"
        )
    model = {detectron2_name(k): v.numpy() for k, v in backbone.state_dict.items()}
    if len(model) != len(backbone.state_dict):  # cannot happen for torchvision names; guards the rules
        raise CheckpointError(f"{backbone.source}: detectron2 renaming collapsed tensors")
    return model


def convert(
    in_path: str | os.PathLike, out_path: str | os.PathLike, encoder: str = "query", layout: str = "auto"
) -> dict:
    """Write the detectron2 pickle atomically; returns a summary (also what the CLI prints)."""
    from converters.checkpoint_io import CheckpointError

    out_path = Path(out_path)
    if out_path.suffix != ".pkl":
        raise CheckpointError(
            f"{out_path}: the detectron2 weights must be named .pkl (detectron2 reads .pkl "
            "with pickle and anything else with torch.load)"
        )
    backbone, summary = convert_backbone(in_path, out_path, encoder, layout, _write_pickle)
    return {**summary, "detectron2_config": detectron2_config(backbone)}


def _write_pickle(backbone: Backbone, out_path: Path) -> int:
    from contrastive_transfer.cli import atomic_write
    from converters.checkpoint_io import METADATA_KEY, backbone_metadata

    model = to_detectron2(backbone)
    payload = {
        "model": model,
        "__author__": AUTHOR,
        "matching_heuristics": True,
        METADATA_KEY: backbone_metadata(backbone),
    }

    atomic_write(out_path, lambda f: pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL))
    return len(model)


def _format_value(value: object) -> str:
    return "[" + ", ".join(f"{x:g}" for x in value) + "]" if isinstance(value, list) else str(value)


def _report(summary: dict) -> str:
    return (
        f"wrote {summary['tensors']} detectron2 tensors to {summary['output']} ({summary['arch']})\n"
        "set in the detectron2 config: "
        + ", ".join(f"{k}: {_format_value(v)}" for k, v in summary["detectron2_config"].items())
        + f", MODEL.WEIGHTS: {summary['output']}"
    )


main = converter_main("converters.to_detectron2", __doc__, "detectron2 weights to write (.pkl)", convert, _report)


if __name__ == "__main__":
    sys.exit(main())
