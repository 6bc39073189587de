"""The linear probe on two gloo processes (the places205 preset: its BatchNorm head synchronised):
the one-process result (head within float tolerance, the same top-1), metrics.json and
probe_last.pth written by rank 0 alone, a held output directory refused on every rank, and a
SIGTERM to one process mid-epoch stopping both after the same batch, saved, with `--resume`
ending on the uninterrupted two-process head bit for bit."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import contrastive_transfer.cli as cli
import transfer.linear as linear
import transfer.linear_probe as linear_probe
from contrastive_transfer.cli import OutputLock
from transfer.probe_presets import PROBE_STATE

from ..multiprocess_harness import Workers, assert_check_passed

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _args(out_dir: str, out: Path, *extra: str) -> list[str]:
    # places205: 60 training images, global batch 16 (8 a process): 3 batches an epoch
    root = Path(out_dir, "data_root.txt").read_text()
    return [
        *("--weights", str(Path(out_dir, "weights.pth")), "--dataset", "places205"),
        *("--data-root", str(Path(root, "places205")), "--preset", "places205", "--output-dir", str(out)),
        *("--epochs", "2", "--batch-size", "16", "--lr", "0.1", "--resize", "36", "--crop", "32"),
        *("--workers", "0", *extra),
    ]


def _recording_writes(into: list) -> None:
    """Record every metrics.json and probe state this process writes (names only)."""
    real_json, real_save = cli.write_json, linear_probe.atomic_torch_save

    def write_json(path, value, *a, **k):
        into.append(Path(path).name)
        return real_json(path, value, *a, **k)

    def atomic_torch_save(obj, path):
        into.append(Path(path).name)
        return real_save(obj, path)

    cli.write_json, linear_probe.atomic_torch_save = write_json, atomic_torch_save


def check_two_processes(rank: int, out_dir: str) -> None:
    writes: list[str] = []
    real_json, real_save = cli.write_json, linear_probe.atomic_torch_save
    _recording_writes(writes)
    try:
        linear.main(_args(out_dir, Path(out_dir, "two")))
    finally:
        cli.write_json, linear_probe.atomic_torch_save = real_json, real_save
    Path(out_dir, f"writes{rank}.json").write_text(json.dumps(writes))


def check_a_held_directory_stops_every_rank(rank: int, out_dir: str) -> None:
    with pytest.raises(SystemExit) as stop:  # @command: the UserError as one line, exit 1
        linear.main(_args(out_dir, Path(out_dir, "held")))
    assert "is in use by another run" in str(stop.value.code) and "\n" not in str(stop.value.code), stop.value.code


def check_preempted_on_one_rank_stops_both(rank: int, out_dir: str) -> None:
    batches, real_check = [], linear_probe.check_divergence

    def check_then_signal(loss, first, lr):  # called once per trained batch, before its step
        batches.append(loss)
        if rank == 1 and len(batches) == 2:  # the second batch of the first epoch, one process only
            os.kill(os.getpid(), signal.SIGTERM)
        return real_check(loss, first, lr)

    linear_probe.check_divergence = check_then_signal
    try:
        with pytest.raises(SystemExit) as stop:
            linear.main(_args(out_dir, Path(out_dir, "cut")))
    finally:
        linear_probe.check_divergence = real_check
    assert stop.value.code == 75 and len(batches) == 2, (stop.value.code, len(batches))
    if rank == 0:  # the state rank 0 saved says where both stopped
        saved = _state(Path(out_dir, "cut"))
        assert (saved["epoch"], saved["partial"]["batch"], saved["history"]) == (0, 2, []), saved["partial"]
    linear.main(_args(out_dir, Path(out_dir, "cut"), "--resume"))


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


@pytest.fixture(scope="module")
def results(synthetic_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("probe_two_processes")
    (out / "data_root.txt").write_text(str(synthetic_root))
    torch.manual_seed(0)
    net = torchvision.models.resnet18()
    net.conv1, net.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    torch.save(net.state_dict(), out / "weights.pth")
    with OutputLock(out / "held", "--output-dir"):  # another run holds it while the workers run
        return Workers(CHECKS, out, timeout_s=180).results(deadline_s=900), out


def _state(out: Path) -> dict:
    return torch.load(out / PROBE_STATE, weights_only=False)


def test_two_processes_give_the_one_process_probe(results, tmp_path):
    res, out = results
    assert_check_passed(res, "check_two_processes")
    linear.main(_args(str(out), tmp_path / "one"))
    two, one = _state(out / "two"), _state(tmp_path / "one")
    assert two["head"].keys() == one["head"].keys()  # the synchronised BN saves as the plain one
    for k, v in one["head"].items():
        torch.testing.assert_close(two["head"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    m_two, m_one = (json.loads((d / "metrics.json").read_text()) for d in (out / "two", tmp_path / "one"))
    for a, b in zip(m_two["history"], m_one["history"]):
        assert abs(a["top1"] - b["top1"]) <= 0.1 and abs(a["train_loss"] - b["train_loss"]) < 1e-4, (a, b)


def test_rank0_alone_writes(results):
    res, out = results
    assert_check_passed(res, "check_two_processes")
    rank0, rank1 = (json.loads((out / f"writes{r}.json").read_text()) for r in (0, 1))
    assert rank1 == [] and rank0.count("metrics.json") == 1 and PROBE_STATE in rank0


def test_a_held_output_directory_stops_every_rank_with_one_line(results):
    assert_check_passed(results[0], "check_a_held_directory_stops_every_rank")


def test_a_signal_to_one_process_stops_both_after_the_same_batch_and_resumes_exactly(results):
    res, out = results
    assert_check_passed(res, "check_preempted_on_one_rank_stops_both")
    full, resumed = _state(out / "two"), _state(out / "cut")
    assert all(torch.equal(v, resumed["head"][k]) for k, v in full["head"].items())
    strip = lambda h: [{k: v for k, v in e.items() if k != "seconds"} for e in h]  # noqa: E731
    history = [json.loads((d / "metrics.json").read_text())["history"] for d in (out / "two", out / "cut")]
    assert strip(history[0]) == strip(history[1])
