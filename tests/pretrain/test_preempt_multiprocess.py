"""Preemption with two gloo processes (torchrun), where only process 1 gets the signal: both stop
after the same step with one checkpoint at that step, and the resumed run ends on the state of an
uninterrupted two-process run, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import LAST_NAME, read_training_state

from ..method_cases import NARROW
from .test_failsafe import training_state  # weights and optimizer moments, flattened

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def launch(target: list[str], out: Path, root: Path, **env: str) -> tuple[subprocess.Popen, Path]:
    """`torchrun --nproc_per_node 2 TARGET` on the tiny SimCLR recipe: 6 steps of batch 8, with the
    quarter-width ResNet-18 (the signal is sent at a step, not a time: a faster step changes nothing)."""
    log = out.parent / f"{out.name}.log"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
        *target,
        *("--config", "configs/pretrain/tiny_simclr.yaml"),
        f"data.root={root / 'imagenet' / 'train'}",
        f"train.output_dir={out}",
        *("train.batch_size=8", "train.max_steps=6", "train.checkpoint_every=100", "train.log_with=none"),
        NARROW,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    with open(log, "w") as f:  # a session of its own: a timeout kills torchrun with its workers
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # a process that stopped alone leaves the other one waiting
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail(f"torchrun did not finish within {timeout} s:\n{log.read_text()[-3000:]}")
    return rc, log.read_text()


def test_one_process_signalled_both_stop_at_the_same_step_and_resume_exactly(synthetic_root, tmp_path):
    straight = launch(["-m", "pretrain"], tmp_path / "straight", synthetic_root)
    out = tmp_path / "preempted"
    driver = ["-m", "tests.pretrain.preempt_driver"]
    one = launch(driver, out, synthetic_root, PREEMPT_RANK="1", PREEMPT_AT="2", PREEMPT_SIGNAL="SIGUSR1")
    rc, log = finish(*one)
    assert rc != 0 and "exitcode  : 75" in log, log[-3000:]  # torchrun fails, each worker said 75
    assert f"preempted (process 1 got SIGUSR1): saved {out / LAST_NAME} at step 3 of 6" in log, log[-3000:]
    assert read_training_state(out / LAST_NAME)["step"] == 3 and not (out / "checkpoint_final.pth").exists()
    rc, log = finish(*launch(["-m", "pretrain"], out, synthetic_root))  # train.resume=auto
    assert rc == 0 and "resumed from" in log and "at step 3" in log, log[-3000:]
    rc, log = finish(*straight)
    assert rc == 0, log[-3000:]
    reference, resumed = training_state(tmp_path / "straight"), training_state(out)
    assert reference.keys() == resumed.keys()
    different = [k for k, v in reference.items() if not torch.equal(v, resumed[k])]
    assert not different, different
