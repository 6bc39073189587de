"""Learning happens: a brief pretraining (the shared `brief_pretraining` run: tiny SimCLR with the
quarter-width ResNet-18, a few epochs on the synthetic ImageNet layout) beats its own random
initialization in weighted kNN."""

from __future__ import annotations

import pytest
import torch

from contrastive_transfer.contract import KNN_TEMPERATURE
from converters.checkpoint_io import build_resnet, load_backbone
from pretrain.knn import knn_accuracy

pytestmark = pytest.mark.slow

MARGIN = 5.0  # points of top-1 on 300 val images (10 classes, chance 10 %)


def _knn(checkpoint, data) -> float:
    net = build_resnet(load_backbone(checkpoint))
    return knn_accuracy(
        net, str(data["train_dir"]), str(data["val_dir"]), data["image_size"], torch.device("cpu"), k=20
    )  # τ: the monitor's default


def test_brief_pretraining_beats_its_random_init_in_knn(brief_pretraining, capsys):
    init, pretrained = (
        _knn(brief_pretraining["init"], brief_pretraining),
        _knn(brief_pretraining["pretrained"], brief_pretraining),
    )
    monitor = [row["knn_top1"] for row in brief_pretraining["metrics"] if "knn_top1" in row]
    with capsys.disabled():
        print(
            f"\nkNN top-1 (k 20, t {KNN_TEMPERATURE}, {brief_pretraining['image_size']} px): random init {init:.1f} %, "
            f"after pretraining {pretrained:.1f} % "
            f"(engine's kNN monitor: {monitor[-1]:.1f} %)"
        )
    # The engine's monitor saw the same backbone: the exported checkpoint is what was trained.
    assert monitor[-1] == pytest.approx(pretrained, abs=1e-6)
    assert pretrained >= init + MARGIN
