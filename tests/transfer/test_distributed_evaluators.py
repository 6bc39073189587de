"""``transfer.knn`` and ``transfer.voc07_svm`` launched on two gloo processes: one metrics.json each,
with the one-process figures (the features are the same bits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import transfer.knn as knn
import transfer.voc07_svm as voc07_svm

from ..multiprocess_harness import Workers, assert_check_passed

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def check_knn_command(rank: int, out_dir: str) -> None:
    knn.main(_knn_args(out_dir, Path(out_dir, "knn_two")))


def check_voc07_svm_command(rank: int, out_dir: str) -> None:
    voc07_svm.main(_svm_args(out_dir, Path(out_dir, "svm_two")))


def _svm_args(out_dir: str, out: Path) -> list[str]:
    root = Path(Path(out_dir, "data_root.txt").read_text(), "VOC2007")
    return [
        *("--weights", str(Path(out_dir, "weights.pth")), "--voc-root", str(root), "--output-dir", str(out)),
        *("--resize", "18", "--crop", "16", "--workers", "0", "--batch-size", "16", "--costs", "0.1,1", "--jobs", "1"),
    ]


def _knn_args(out_dir: str, out: Path) -> list[str]:
    root = Path(Path(out_dir, "data_root.txt").read_text(), "imagenet")
    return [
        *("--weights", str(Path(out_dir, "weights.pth")), "--train-dir", str(root / "train")),
        *("--val-dir", str(root / "val"), "--output-dir", str(out), "--k", "5"),
        *("--resize", "18", "--crop", "16", "--workers", "0", "--batch-size", "16"),
    ]


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


@pytest.fixture(scope="module")
def results(synthetic_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluators_two_processes")
    (out / "data_root.txt").write_text(str(synthetic_root))
    torch.manual_seed(0)
    net = torchvision.models.resnet18()
    net.conv1, net.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    torch.save(net.state_dict(), out / "weights.pth")
    return Workers(CHECKS, out, timeout_s=180).results(deadline_s=900), out


def test_knn_on_two_processes_writes_the_one_process_metrics_once(results, tmp_path):
    res, out = results
    assert_check_passed(res, "check_knn_command")
    knn.main(_knn_args(str(out), tmp_path / "knn_one"))
    two, one = (json.loads((d / "metrics.json").read_text()) for d in (out / "knn_two", tmp_path / "knn_one"))
    assert (two["top1"], two["top5"]) == (one["top1"], one["top5"])
    assert two["train"]["images"] == one["train"]["images"]


def test_voc07_svm_on_two_processes_writes_the_one_process_metrics_once(results, tmp_path):
    res, out = results
    assert_check_passed(res, "check_voc07_svm_command")
    voc07_svm.main(_svm_args(str(out), tmp_path / "svm_one"))
    two, one = (json.loads((d / "metrics.json").read_text()) for d in (out / "svm_two", tmp_path / "svm_one"))
    assert two["layers"]["res5avg"]["mAP"] == one["layers"]["res5avg"]["mAP"]  # the same features, bit for bit
    assert two["layers"]["res5avg"]["per_class"] == one["layers"]["res5avg"]["per_class"]
