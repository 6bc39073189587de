"""The linear probe preempted: a SIGTERM (sent by another process to the probe and its DataLoader
workers, as a cluster does) in the middle of an epoch saves the head, the optimizer and where the
epoch stopped, exits 75, and `--resume` ends on the uninterrupted probe's head, bit for bit."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import transfer.linear as linear
import transfer.linear_probe as linear_probe
from transfer.probe_presets import PROBE_STATE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random-init small-stem ResNet-18 as a torchvision state_dict file."""
    torch.manual_seed(0)
    net = torchvision.models.resnet18()
    net.conv1, net.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    path = tmp_path_factory.mktemp("probe_ckpt") / "resnet18_small.pth"
    torch.save(net.state_dict(), path)
    return path


def args(ckpt: Path, root: Path, out: Path, *extra: str) -> list[str]:
    # places205: 60 training images, batch 16: 3 batches an epoch
    return [
        *("--weights", str(ckpt), "--dataset", "places205", "--data-root", str(root / "places205")),
        *("--preset", "places205", "--output-dir", str(out), "--epochs", "2", "--batch-size", "16"),
        *("--lr", "0.1", "--resize", "36", "--crop", "32", "--workers", "2", *extra),
    ]


def test_a_signal_mid_epoch_saves_where_it_stopped_and_the_resume_is_exact(
    synthetic_root, checkpoint, tmp_path, monkeypatch
):
    linear.main(args(checkpoint, synthetic_root, tmp_path / "full"))
    batches, real_check = [], linear_probe.check_divergence

    def check_then_signal(loss, first, lr):  # called once per trained batch
        batches.append(loss)
        if len(batches) == 2:  # the second batch of the first epoch
            workers = [str(c.pid) for c in multiprocessing.active_children()]
            subprocess.run(["kill", "-s", "TERM", *workers, str(os.getpid())], check=True)
        return real_check(loss, first, lr)

    monkeypatch.setattr(linear_probe, "check_divergence", check_then_signal)
    out = tmp_path / "cut"
    with pytest.raises(SystemExit) as stop:
        linear.main(args(checkpoint, synthetic_root, out))
    assert stop.value.code == 75
    saved = torch.load(out / PROBE_STATE, weights_only=False)
    assert (saved["epoch"], saved["partial"]["batch"], saved["history"]) == (0, 2, [])
    monkeypatch.undo()
    linear.main(args(checkpoint, synthetic_root, out, "--resume"))
    full, resumed = (torch.load(d / PROBE_STATE, weights_only=False) for d in (tmp_path / "full", out))
    assert all(torch.equal(v, resumed["head"][k]) for k, v in full["head"].items())
    strip = lambda h: [{k: v for k, v in e.items() if k != "seconds"} for e in h]  # noqa: E731
    history = [json.loads((d / "metrics.json").read_text())["history"] for d in (tmp_path / "full", out)]
    assert strip(history[0]) == strip(history[1])  # the cut epoch's mean loss too
