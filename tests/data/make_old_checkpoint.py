"""Writes ``old_tiny_simclr_last.pth``: one step of ``tiny_simclr`` saved by an EARLIER commit's code,
for ``tests/pretrain/test_resume_across_versions.py``.

It was made with the code of commit dd67ff4 (before the loss options moved under ``method.loss``,
before the crop scale was derived into ``data.views`` and before the training state's key was
renamed ``method_state``)::

    git worktree add /tmp/old dd67ff4
    cd "$(mktemp -d)" && PYTHONPATH=/tmp/old python <this repo>/tests/data/make_old_checkpoint.py <this repo>/tests/data

The encoders are ``tiny_build_encoder`` (a 4-channel conv instead of ResNet-18), the images 16 px and the
batch 8, so the file stays a few tens of kB; the data root is the recipe's relative one, which the test
points at the synthetic datasets. Do not regenerate it with the current code: its point is to be old.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from unittest import mock

from torch import nn

FEATURES = 4
RECIPE = "tiny_simclr"
# What the test gives as well (the resume compares these).
OVERRIDES = ["data.image_size=16", "train.batch_size=8", "method.dim=4", "method.hidden_dim=4", "train.log_with=none"]


def tiny_build_encoder(arch, stem, head, dim, hidden_dim=None, bn_splits=1, out_bn=False):
    """Stands in for pretrain.models.build_encoder: conv → BN → ReLU → pool, then the real head."""
    from pretrain.models import Encoder, build_head

    backbone = nn.Sequential(
        nn.Conv2d(3, FEATURES, 3, stride=2, bias=False),
        nn.BatchNorm2d(FEATURES),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    return Encoder(backbone, build_head(head, FEATURES, hidden_dim or FEATURES, dim, out_bn))


def main(dest: Path) -> None:
    from accelerate import Accelerator

    from contrastive_transfer.synthetic import PRESETS, write_imagenet
    from pretrain.config import load_config
    from pretrain.engine import train

    repo = Path(__import__("pretrain").__file__).resolve().parents[1]
    write_imagenet(Path("datasets/synthetic/imagenet"), PRESETS["tiny"], 0, 1)
    cfg = load_config(repo / "configs" / "pretrain" / f"{RECIPE}.yaml", [*OVERRIDES, "train.max_steps=1"])
    with mock.patch("pretrain.methods.simclr.build_encoder", tiny_build_encoder):
        train(cfg, Accelerator(cpu=True))
    shutil.copy(Path(cfg.train.output_dir) / "checkpoint_last.pth", dest / f"old_{RECIPE}_last.pth")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
