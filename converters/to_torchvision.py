"""Write a checkpoint's ResNet backbone as a plain torchvision ResNet state dict (no fc).

    python -m converters.to_torchvision IN OUT.pth|OUT.safetensors [--encoder query|key] [--layout auto|...]

``OUT.safetensors`` writes the same tensors as safetensors (loading runs no code). Both formats
carry the backbone record as metadata (``converters.checkpoint_io.weights_metadata``): ``format``
(``contrastive-transfer/weights-metadata/v1``), ``arch``, ``stem``, ``image_size`` (when known),
``weights_sha256``, ``source_layout`` and ``encoder``, as strings: in the .safetensors header, and
in the .pth as the one entry ``metadata`` beside the tensors. Every converter and evaluator of this
project reads it back, ``--crop auto`` included.

Load it with ``torchvision.models.<arch>().load_state_dict(sd, strict=False)`` (``fc.*`` is
missing and ``metadata`` unexpected; ``sd.pop("metadata")`` first for ``strict=True`` elsewhere).
A small-stem backbone keeps its 3x3 ``conv1``: rebuild the stem first
(``conv1 = Conv2d(3, 64, 3, 1, 1, bias=False)``, ``maxpool = Identity()``), or build the network with
``contrastive_transfer.contract.resnet_backbone(arch, "small")``. The ``_<m>x`` archs (SimCLR's
width multiplier) are not torchvision's: ``resnet_backbone(arch, stem)`` builds them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from converters.cli import convert_backbone, converter_main


def convert(
    in_path: str | os.PathLike, out_path: str | os.PathLike, encoder: str = "query", layout: str = "auto"
) -> dict:
    from converters.checkpoint_io import CheckpointError

    out_path = Path(out_path)
    if out_path.suffix == ".pkl":
        raise CheckpointError(
            f"{out_path}: a torch.save file must not be named .pkl (detectron2 would read it "
            "with pickle); use .pth, or converters.to_detectron2 for a detectron2 pickle"
        )
    return convert_backbone(in_path, out_path, encoder, layout, _write_state_dict)[1]


def _write_state_dict(backbone, out_path: Path) -> int:
    import torch  # here, so that --help answers at once
    from safetensors.torch import save

    from contrastive_transfer.cli import atomic_write
    from converters.checkpoint_io import METADATA_KEY, backbone_metadata

    meta = backbone_metadata(backbone)
    if out_path.suffix == ".safetensors":
        atomic_write(out_path, lambda f: f.write(save(backbone.state_dict, metadata=meta)))
    else:
        atomic_write(out_path, lambda f: torch.save({**backbone.state_dict, METADATA_KEY: meta}, f))
    return len(backbone.state_dict)


def _report(summary: dict) -> str:
    from contrastive_transfer.contract import ARCHS

    arch = summary["arch"]
    if ARCHS[arch].channels != 64:  # torchvision has no network of this width
        return (
            f"wrote {summary['tensors']} tensors to {summary['output']}: "
            f"contrastive_transfer.contract.resnet_backbone({arch!r}, {summary['stem']!r}) builds the network "
            "that loads them (torchvision has no ResNet of this width)"
        )
    stem_note = "" if summary["stem"] == "imagenet" else "; small stem: rebuild conv1 as 3x3/1 and drop the max-pool"
    return (
        f"wrote {summary['tensors']} tensors to {summary['output']}: torchvision.models.{arch}() "
        f"loads them with strict=False (fc.* missing){stem_note}"
    )


main = converter_main(
    "converters.to_torchvision",
    __doc__,
    "torchvision state dict to write (.pth, or .safetensors with the record as metadata)",
    convert,
    _report,
)


if __name__ == "__main__":
    sys.exit(main())
