"""Where the ResNet backbone lives in each supported checkpoint layout (no torch import, so a
converter's ``--help`` lists them at once).

A *layout* names a container (a dotted path of dict keys, ``""`` for the file itself) and a key
prefix, for the query (online) encoder and, when there is one, the momentum encoder. Before
matching, the wrappers ``module.`` (DataParallel/DDP) and ``_orig_mod.`` (torch.compile) are removed
from every key. Auto-detection tries the layouts in ``LAYOUTS`` order and takes the first that holds
a ResNet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    name: str
    description: str
    query: tuple[tuple[str, str], ...]  # (container, key prefix) of the query/online encoder, tried in order
    key: tuple[tuple[str, str], ...] = ()  # the same for the momentum (key / teacher) encoder
    names: str = "torchvision"  # the tensor names under the prefix: "torchvision" | "detectron2"


def _sources(containers: tuple[str, ...], prefixes: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return tuple((c, p) for c in containers for p in prefixes)


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout(
            "project",
            "this project's checkpoints: the backbone record of checkpoint_final.pth and checkpoint_last.pth "
            "(contrastive_transfer.contract)",
            query=(("backbone", ""),),
            key=(("momentum_backbone", ""),),
        ),
        Layout(
            "moco",
            "official MoCo v1/v2/v3 and AdCo checkpoints (state_dict with module.encoder_q. / module.base_encoder.)",
            query=_sources(("state_dict", ""), ("encoder_q.", "base_encoder.")),
            key=_sources(("state_dict", ""), ("encoder_k.", "momentum_encoder.")),
        ),
        Layout(
            "vissl",
            "VISSL checkpoints (classy_state_dict.base_model.model.trunk with _feature_blocks.)",
            query=_sources(
                ("classy_state_dict.base_model.model.trunk", "classy_state_dict.base_model.model", "model", ""),
                ("_feature_blocks.", "trunk._feature_blocks."),
            ),
        ),
        Layout(
            "detectron2",
            "detectron2 weights (.pkl) in detectron2's ResNet names (stem.conv1, res2..res5): what "
            "converters.to_detectron2 writes, and detectron2 models (backbone.bottom_up.)",
            query=_sources(("model", ""), ("", "backbone.bottom_up.", "backbone.")),
            names="detectron2",
        ),
        Layout(
            "backbone",
            "backbone.-prefixed state dicts (solo-learn, lightly, DINO student/teacher)",
            query=_sources(("state_dict", "model", "student", ""), ("backbone.",)),
            key=_sources(("state_dict", "model", ""), ("momentum_backbone.", "backbone_momentum."))
            + (("teacher", "backbone."),),
        ),
        Layout(
            "torchvision",
            "a torchvision ResNet state dict (fc.* dropped)",
            query=_sources(("state_dict", "model", ""), ("",)),
        ),
    )
}
ENCODERS = ("query", "key")
