"""Two gloo processes: the kNN monitor sharded over the processes equals the one-process monitor
(features in the folder's order, same accuracy); resuming on machines with their own disks: all
processes resume the same step from the file rank 0 chose, or all refuse with one line."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from pretrain.knn import extract_features, knn_accuracy

from ..multiprocess_harness import Workers, assert_check_passed

pytestmark = pytest.mark.multiprocess


def _backbone() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    ).eval()


def _roots(out_dir: str) -> tuple[str, str]:
    root = Path(out_dir, "data_root.txt").read_text()
    return os.path.join(root, "imagenet", "train"), os.path.join(root, "imagenet", "val")


def check_sharded_knn(rank: int, out_dir: str) -> None:
    train_dir, val_dir = _roots(out_dir)
    feats, labels, _ = extract_features(_backbone(), train_dir, 16, torch.device("cpu"), batch_size=7)
    acc = knn_accuracy(_backbone(), train_dir, val_dir, 16, torch.device("cpu"), k=5)
    torch.save({"feats": feats, "labels": labels, "acc": acc}, os.path.join(out_dir, f"knn{rank}.pt"))


def _resume_on_local_disks(rank: int, out_dir: str, rank0_has_file: bool, other_sees_it: bool):
    """engine.resume with one output folder per process; returns the step or the error text."""
    from omegaconf import OmegaConf

    from pretrain import engine

    disk = Path(out_dir) / f"case_{rank0_has_file}_{other_sees_it}" / f"machine{rank}"
    disk.mkdir(parents=True, exist_ok=True)
    cfg = OmegaConf.create({"train": {"resume": "auto", "output_dir": str(disk)}})
    state = {"method": {}, "optimizer": {}, "step": 7}
    accelerator = mock.Mock(is_main_process=rank == 0)
    if rank == 0 and rank0_has_file:
        torch.save(state, disk / "checkpoint_last.pth")
    real_is_file = Path.is_file

    def is_file(path):  # the other machine sees only its own disk, unless told otherwise
        if rank != 0 and "machine0" in str(path):
            return other_sees_it and real_is_file(path)
        return real_is_file(path)

    with (
        mock.patch.object(Path, "is_file", is_file),
        mock.patch.object(engine, "load_training_state", lambda *a, **k: 7),
    ):
        try:
            return engine.resume(cfg, accelerator, None, None, 10)
        except engine.ResumeError as e:
            return str(e)


def check_resume_all_or_none(rank: int, out_dir: str) -> None:
    fresh = _resume_on_local_disks(rank, out_dir, rank0_has_file=False, other_sees_it=False)
    assert fresh == 0, fresh  # nothing anywhere: every process starts afresh
    shared = _resume_on_local_disks(rank, out_dir, rank0_has_file=True, other_sees_it=True)
    assert shared == 7, shared  # a shared filesystem: every process resumes the same step
    local = _resume_on_local_disks(rank, out_dir, rank0_has_file=True, other_sees_it=False)
    assert isinstance(local, str) and "is not visible to process 1" in local and "shared by all machines" in local, (
        local
    )  # rank 0 has it, rank 1 cannot see it: BOTH refuse (rank 1 would otherwise start from 0)


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


@pytest.fixture(scope="module")
def results(synthetic_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_processes")
    (out / "data_root.txt").write_text(str(synthetic_root))
    return Workers(CHECKS, out, timeout_s=120).results(deadline_s=600), out


def test_sharded_knn_monitor_equals_one_process(results):
    res, out = results
    assert_check_passed(res, "check_sharded_knn")
    train_dir, val_dir = _roots(str(out))
    feats, labels, _ = extract_features(_backbone(), train_dir, 16, torch.device("cpu"), batch_size=7)
    acc = knn_accuracy(_backbone(), train_dir, val_dir, 16, torch.device("cpu"), k=5)
    for rank in (0, 1):
        got = torch.load(out / f"knn{rank}.pt")
        assert torch.equal(got["labels"], labels)  # the folder's order restored after the gather
        torch.testing.assert_close(got["feats"], feats, rtol=0, atol=1e-6)
        assert got["acc"] == acc


def test_resume_decision_on_machines_with_their_own_disks(results):
    assert_check_passed(results[0], "check_resume_all_or_none")
