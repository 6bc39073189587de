"""Supervised pretraining: the baseline every self-supervised backbone is compared against.

Papers: Kaiming He, Xiangyu Zhang, Shaoqing Ren, Jian Sun, "Deep Residual Learning for Image
Recognition", CVPR 2016, arXiv:1512.03385 (the ResNet and its labelled ImageNet training); the
comparison is the MoCo paper's (He et al., "Momentum Contrast for Unsupervised Visual
Representation Learning", CVPR 2020, arXiv:1911.05722).

The MoCo paper (He et al., CVPR'20, Tables 2–6) sets each self-supervised backbone beside the same
ResNet trained with labels on the same images, then transfers both. Here the labels are the
ImageFolder's (class folders of ``data.root``); everything else is the engine's, as for every
method: backbone, data path, budget, optimizer, checkpoint record and converters.

Per step, for N local images with one view x and labels y:

    L = mean_i  CE(W · f(x_i) + b, y_i)          f the ResNet up to its pooled res5, (W, b) one fc

One view of ``data.augmentation`` (the ``supervised`` preset: random resized crop 0.08–1 and flip,
torchvision's ImageNet recipe); BN is per process, as in torchvision's reference training script
without ``--sync-bn``. Only ``f`` is exported; the fc, like a contrastive head, is not.

Usage::

    python -m pretrain --config configs/pretrain/tiny_supervised.yaml   # 10 synthetic classes
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from contrastive_transfer.errors import ConfigError
from pretrain.augment import ViewTransform
from pretrain.losses.precision import fp32
from pretrain.methods.base import Method
from pretrain.models import build_encoder


class Supervised(Method):
    defaults = {"num_classes": 1000, "label_smoothing": 0.0}
    needs_labels: ClassVar[bool] = True

    @classmethod
    def check(cls, cfg, num_processes: int) -> None:
        m = cfg.method
        if not isinstance(m.num_classes, int) or m.num_classes < 2:
            raise ConfigError(f"method.num_classes={m.num_classes!r}: expected the number of class folders (≥ 2)")
        if not 0 <= m.label_smoothing < 1:
            raise ConfigError(f"method.label_smoothing={m.label_smoothing!r}: expected a value in [0, 1)")

    @classmethod
    def view_transforms(cls, cfg) -> list[ViewTransform]:
        return super().view_transforms(cfg)[:1]  # a one-view preset is declared for both views

    def __init__(self, cfg, num_processes: int) -> None:
        super().__init__(cfg, num_processes)
        m = cfg.method
        self.label_smoothing = float(m.label_smoothing)
        self.encoder = build_encoder(cfg.model.arch, cfg.model.stem, "linear", m.num_classes)

    def check_classes(self, classes: list[str], root) -> None:
        if len(classes) != self.encoder.head.out_features:
            found = f"{len(classes)} class folders" if classes else "no class folders (a flat folder has no labels)"
            raise ConfigError(
                f"method.num_classes={self.encoder.head.out_features}: data.root {root} has {found}; "
                "set method.num_classes to the number of class folders"
            )

    @property
    def backbone(self):
        return self.encoder.backbone

    def forward(self, views: list[torch.Tensor], labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = fp32(self.encoder(views[0]))  # fp32 under autocast, float64 kept (exactness tests)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        accuracy = (logits.detach().argmax(1) == labels).float().mean() * 100
        return {"loss": loss, "train_top1": accuracy}
