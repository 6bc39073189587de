"""`transfer.detection --seeds S --resume` on machines with their own disks: whether a seed is
finished is decided by global rank 0 and followed by every process, so no process starts a run that
the others skip (which would leave it waiting forever in the run's first collective). Two gloo
processes, each with its own output folder, stand for two machines."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("detectron2")
from detectron2.config import CfgNode  # noqa: E402

from transfer.detection import run as detection_run  # noqa: E402

from ..multiprocess_harness import Workers, assert_check_passed  # noqa: E402

pytestmark = pytest.mark.multiprocess


class Proceeded(Exception):
    """Raised where a worker would start registering datasets and training."""


def _worker_on_local_disk(rank: int, out_dir: str, finished_on: int) -> str:
    disk = Path(out_dir) / f"machine{rank}"
    disk.mkdir(exist_ok=True)
    if rank == finished_on:
        (disk / "metrics.json").write_text("{}")
    cfg = CfgNode({"OUTPUT_DIR": str(disk)})
    original = detection_run.register_datasets
    detection_run.register_datasets = lambda *a, **k: (_ for _ in ()).throw(Proceeded())
    try:
        detection_run.worker(cfg, [], SimpleNamespace(data_root=None), skip_if_done=True)
        return "skipped"
    except Proceeded:
        return "ran"
    finally:
        detection_run.register_datasets = original


def check_finished_on_rank0_is_skipped_everywhere(rank: int, out_dir: str) -> None:
    decision = _worker_on_local_disk(rank, os.path.join(out_dir, "a"), finished_on=0)
    assert decision == "skipped", f"rank {rank} {decision}: rank 0 has the seed's metrics.json"


def check_finished_only_elsewhere_runs_everywhere(rank: int, out_dir: str) -> None:
    decision = _worker_on_local_disk(rank, os.path.join(out_dir, "b"), finished_on=1)
    assert decision == "ran", f"rank {rank} {decision}: rank 0 has no metrics.json for this seed"


def check_each_rank_deciding_alone_disagrees(rank: int, out_dir: str) -> None:
    """The control: the per-process decision (the old behaviour) splits the processes."""
    disk = Path(out_dir) / "c" / f"machine{rank}"
    disk.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (disk / "metrics.json").write_text("{}")
    mine = (disk / "metrics.json").is_file()
    assert detection_run.decided_by_rank0(mine) is True
    assert mine == (rank == 0)


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


def test_rank0_decides_which_seeds_are_finished(tmp_path):
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
    results = Workers(CHECKS, tmp_path, timeout_s=60).results(deadline_s=300)
    for name in CHECKS:
        assert_check_passed(results, name)
