"""The linear probe's settings: its named presets and one run's typed parameters. No torch here:
``python -m transfer.linear --help`` lists the presets before torch would load.

Presets (``PRESETS``):

    bn         BatchNorm without affine + fc on res5avg, SGD nesterov lr 0.03, momentum 0.9,
               wd 1e-4, batch 64, 10 epochs, lr × 0.1 at epochs 2, 5 and 8. The BN makes the
               head blind to the feature scale, so one lr fits every backbone (random init,
               pretrained, any method): the preset for comparing backbones (the demo, the
               benchmarks). MAE's linear protocol puts the same BN before its classifier.
    moco       fc on res5avg, fc ~ N(0, 0.01), SGD lr 30, momentum 0.9, wd 0, batch 256,
               100 epochs, lr × 0.1 at epochs 60 and 80               (MoCo main_lincls.py)
               For exact reproduction: lr 30 on raw features assumes their scale is that of a
               MoCo-pretrained ResNet-50 (small activations after its last BN); on other
               backbones it can diverge, which the probe stops with one line.
    adco       as moco but lr 10 with per-epoch cosine decay to 0.01:
               lr_e = 0.01 + ½(1 + cos(π e / E))(10 − 0.01)           (AdCo lincls.py --cos)
               Assumes the same feature scale as moco.
    places205  BatchNorm without affine + fc on the pooled res5 map (2×2 grid, 4·C-d), SGD
               nesterov lr 0.01, momentum 0.9, wd 1e-4, batch 256, 28 epochs,
               lr × 0.1 at 7, 14, 21                                 (mmselfsup / OpenSelfSup)

``with_epochs`` rescales the step milestones in proportion (60/80 of 100 → 3/4 of 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

# Not the pretraining's checkpoint_last.pth: a probe's state is not a backbone checkpoint, and a
# probe written into a pretraining folder must not replace (or be taken for) the training state.
PROBE_STATE = "probe_last.pth"


@dataclass(frozen=True)
class Preset:
    layer: str
    head_bn: bool  # BatchNorm (no affine) on the features before the fc
    lr: float
    schedule: str  # "step" | "cosine"
    epochs: int
    milestones: tuple[int, ...] = ()
    final_lr: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    batch_size: int = 256

    def lr_at(self, epoch: int) -> float:
        """Learning rate of epoch `epoch` (0-based), set once per epoch as in the reference scripts."""
        if self.schedule == "cosine":
            return self.final_lr + 0.5 * (1 + math.cos(math.pi * epoch / self.epochs)) * (self.lr - self.final_lr)
        return self.lr * 0.1 ** sum(epoch >= m for m in self.milestones)

    def with_epochs(self, epochs: int) -> Preset:
        scale = epochs / self.epochs
        return replace(self, epochs=epochs, milestones=tuple(max(1, round(m * scale)) for m in self.milestones))


PRESETS = {
    # Measured on the synthetic ImageNet with ResNet-18 backbones from random init to 6-epoch
    # pretraining by every method (benchmarks/learning.md): lr 0.1 raised the training loss in its
    # first epochs, 0.03 did not; the BN keeps that true for features scaled ×100 (tests).
    "bn": Preset(
        "res5avg", True, 0.03, "step", 10, milestones=(2, 5, 8), nesterov=True, weight_decay=1e-4, batch_size=64
    ),
    "moco": Preset("res5avg", False, 30.0, "step", 100, milestones=(60, 80)),
    "adco": Preset("res5avg", False, 10.0, "cosine", 100, final_lr=0.01),
    "places205": Preset("res5", True, 0.01, "step", 28, milestones=(7, 14, 21), nesterov=True, weight_decay=1e-4),
}


@dataclass(frozen=True)
class ProbeSettings:
    """Everything one probe run depends on (``transfer.linear`` builds it from the command line)."""

    weights: str
    dataset: str  # "imagenet" | "places205"
    data_root: str
    preset_name: str
    preset: Preset  # the named preset with the overrides applied
    output_dir: Path
    encoder: str = "query"
    layout: str = "auto"
    resume: bool = False
    resize: int | None = None
    crop: int | str = 224  # or "auto": the checkpoint's pretraining size
    workers: int = 4
    seed: int = 0
