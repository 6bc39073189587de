"""benchmarks/detection_speed.py: its figures against hand-computed values, and the claim its
configs rest on: detectron2's SyncBN on one process is BN. Its CPU dry run (`--tiny`: the report's
shape, a ratio computed from the two timings, CPU-vs-CPU evaluation equal to the last bit) is
checked where tools/gpu_check.sh's dry run runs it: tests/test_gpu_tools.py."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import detection_speed as ds


def test_medians_after_the_warm_up_and_the_ratio_follow_their_definitions():
    # (value, iteration): iteration 0 (a slow first step) is the warm-up
    assert ds.median_after([(9.0, 0), (1.0, 1), (3.0, 2), (2.0, 3), (10.0, 4)], warmup=1) == 2.5
    assert ds.median_after([(9.0, 0), (1.0, 1), (3.0, 2)], warmup=2) == 3.0
    with pytest.raises(ValueError):
        ds.median_after([(9.0, 0)], warmup=1)
    # starts at 0, 5, 6, 8, 11: iterations last 5, 1, 2, 3; after one warm-up: median(1, 2, 3)
    assert ds.iteration_seconds([0.0, 5.0, 6.0, 8.0, 11.0], warmup=1) == 2.0
    assert ds.ratio(0.51, 0.5) == pytest.approx(1.02)
    assert ds.ratio(1.0, 0.0) == math.inf


def test_ap_and_detection_differences_against_hand_computed_values():
    rows = ds.ap_difference(
        {"AP": 10.5, "AP50": 20.0, "AP75": float("nan"), "APs": 1.0}, {"AP": 10.25, "AP50": 20.0, "AP75": float("nan")}
    )
    assert rows == {
        "AP": {"device": 10.5, "cpu": 10.25, "difference": 0.25},
        "AP50": {"device": 20.0, "cpu": 20.0, "difference": 0.0},
        "AP75": {"device": rows["AP75"]["device"], "cpu": rows["AP75"]["cpu"], "difference": 0.0},
    }
    assert ds.ap_difference({"AP": float("nan")}, {"AP": 1.0})["AP"]["difference"] != 0  # NaN vs a value differs

    def image(boxes, scores, classes):
        return torch.tensor(boxes, dtype=torch.float32), torch.tensor(scores), torch.tensor(classes)

    device = {
        "a": image([[0, 0, 10, 10], [5, 5, 8, 9]], [0.9, 0.5], [1, 2]),
        "b": image([[1, 1, 4, 4]], [0.3], [0]),
        "c": image([[0, 0, 1, 1]], [0.2], [3]),
    }
    cpu = {
        "a": image([[0, 0, 10, 10.25], [5, 5, 8, 9]], [0.875, 0.5], [1, 2]),  # 0.25 px, 0.025 apart
        "b": image([[1, 1, 4, 4]], [0.3], [4]),  # another class: not compared
        "c": image([[0, 0, 1, 1], [2, 2, 3, 3]], [0.2, 0.1], [3, 3]),  # another count: not compared
    }
    d = ds.detection_difference(device, cpu)
    assert d["images"] == 3 and d["detections"] == 4 and d["images_same_classes"] == 1
    assert d["max_box_difference"] == 0.25
    assert d["max_score_difference"] == pytest.approx(0.025)


pytest.importorskip("detectron2")


def test_detectron2_sync_bn_on_one_process_is_batch_norm():
    """The benchmark (and transfer.detection) turn the configs' SyncBN into BN on one process.
    detectron2's SyncBN there is nn.SyncBatchNorm without a process group, which falls back to
    batch_norm: the same losses and running statistics as BN, to the bit, on the CPU."""
    from transfer.detection.config import build_config

    for config, keys in (
        ("voc0712_R_50_FPN_24k_syncbn", ["MODEL.FPN.NORM", "MODEL.RESNETS.NORM"]),
        ("voc0712_R_50_C4_24k_syncbn", ["MODEL.RESNETS.NORM"]),
    ):
        cfg, _ = build_config(str(ds.CONFIG_DIR / f"{config}.yaml"), ["MODEL.DEVICE", "cpu", *ds.TINY_OVERRIDES])
        d = ds.sync_bn_difference(cfg)
        assert d["keys"] == keys  # what the config files have as SyncBN
        # the control: the second model really has SyncBatchNorm layers (the C4 head's res5 and extra norm too)
        assert d["sync_bn_layers"] == d["bn_statistics"] // 2 > 50
        assert d["max_loss_difference"] == 0.0 and d["max_statistic_difference"] == 0.0
