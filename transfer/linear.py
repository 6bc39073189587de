"""Linear probes on a frozen backbone: ImageNet (MoCo, AdCo protocols) and Places205.

    python -m transfer.linear --weights CKPT --dataset imagenet|places205 --data-root DIR
                              --preset bn|moco|adco|places205 --output-dir OUT [--resume]

The backbone stays in eval mode with frozen weights (BN statistics never move); only the head
learns. After the run every backbone tensor is compared bit for bit with the checkpoint's.

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

Train images: RandomResizedCrop(crop) + horizontal flip; val: shorter side `resize`, center crop.
``--epochs`` rescales the step milestones in proportion (60/80 of 100 → 3/4 of 5).
Reported: top-1/top-5 of the last epoch and the best top-1 over epochs (MoCo reports the best).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from contrastive_transfer.cli import OutputLock, command
from transfer import eval_cli
from transfer.layers import LAYERS

logger = logging.getLogger(__name__)
CHECKPOINT = "checkpoint_last.pth"


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

    def with_epochs(self, epochs: int) -> "Preset":
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


def parser():
    p = eval_cli.make_parser("python -m transfer.linear", __doc__)
    eval_cli.add_checkpoint_args(p)
    p.add_argument("--dataset", required=True, choices=["imagenet", "places205"])
    p.add_argument(
        "--data-root",
        required=True,
        help="imagenet: train/ and val/ ImageFolders; places205: trainvalsplit_places205/ and data/vision/...",
    )
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--output-dir", "--out", required=True, help="metrics.json and checkpoint_last.pth go here")
    p.add_argument("--resume", action="store_true", help=f"continue from OUT/{CHECKPOINT}")
    p.add_argument("--epochs", type=int, default=None, help="override the preset's (milestones rescale)")
    p.add_argument("--lr", type=float, default=None, help="override the preset's base lr")
    p.add_argument("--layer", default=None, choices=sorted(LAYERS), help="override the preset's feature")
    eval_cli.add_size_args(p, "val: shorter side before the center crop", "network input side")
    eval_cli.add_loader_args(p, batch_size=None)
    p.add_argument("--seed", type=int, default=0, help="the head's initialization and the data order")
    return p


@command
def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.output_dir)
    # One probe per output directory: a second one would interleave its epochs into the same files.
    with OutputLock(out, "--output-dir"):
        from contrastive_transfer.cli import atomic_write
        from transfer.linear_probe import run

        metrics = run(args)
        atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1)))
    print(json.dumps({k: round(metrics[k], 2) for k in ("top1", "top5", "best_top1")}))


def __getattr__(name: str):
    # The probe itself (torch) lives in transfer.linear_probe; its names stay reachable from here.
    from transfer import linear_probe

    try:
        return getattr(linear_probe, name)
    except AttributeError:
        raise AttributeError(f"module 'transfer.linear' has no attribute {name!r}") from None


if __name__ == "__main__":
    main()
