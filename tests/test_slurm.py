"""The SLURM launcher (contrastive_transfer.slurm) and the requeue logic of tools/slurm/run_step.sh,
with SLURM's variables faked and fake `srun`/`scontrol` on PATH: nothing here needs SLURM.

Judges: hand-expanded host lists (as `scontrol show hostnames` prints them), the command lines
torchrun, Accelerate and detectron2 document, and, for the script, the signals and the calls the fake
tools record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from contrastive_transfer.cli import UserError
from contrastive_transfer.slurm import PORT_BASE, Rendezvous, expand_hostlist, launcher_command, rendezvous

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node01", ["node01"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("a[9-11]", ["a9", "a10", "a11"]),  # no padding: the first bound has none
        ("a[009-011]", ["a009", "a010", "a011"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("x-1,y[2],z.lan", ["x-1", "y2", "z.lan"]),
        ("localhost,localhost", ["localhost", "localhost"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["", "n[1-", "n[3-1]", "n[a-b]", "n]1["])
def test_expand_hostlist_refuses_in_one_line(bad):
    with pytest.raises(UserError) as e:
        expand_hostlist(bad)
    assert "SLURM_JOB_NODELIST" in str(e.value) and "\n" not in str(e.value)


def _env(**extra) -> dict[str, str]:
    return {
        "SLURM_NNODES": "3",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-09]",
        "SLURM_JOB_ID": "123456",
    } | extra


def test_rendezvous_from_slurm_variables():
    got = rendezvous(_env(SLURM_GPUS_ON_NODE="4"))
    assert got == Rendezvous(3, 1, "gpu07", PORT_BASE + 123456 % 20000, 4, "123456")
    assert rendezvous(_env(MASTER_PORT="29500")).master_port == 29500  # the user's port wins
    assert rendezvous(_env()).nproc_per_node == 1  # no GPUs: one process per node
    assert rendezvous(_env(SLURM_GPUS_ON_NODE="4"), nproc_per_node=2).nproc_per_node == 2
    # Two jobs sharing a node meet on different ports.
    assert rendezvous(_env(SLURM_JOB_ID="1")).master_port != rendezvous(_env(SLURM_JOB_ID="2")).master_port


@pytest.mark.parametrize(
    "env, word",
    [
        ({"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "a"}, "SLURM_NNODES"),
        (_env(SLURM_NODEID="3"), "SLURM_NODEID"),
        (_env(SLURM_JOB_NODELIST="gpu[07-08]"), "SLURM_JOB_NODELIST"),
        (_env(SLURM_NNODES="two"), "SLURM_NNODES"),
    ],
)
def test_rendezvous_refuses_in_one_line(env, word):
    with pytest.raises(UserError) as e:
        rendezvous(env)
    assert word in str(e.value) and "\n" not in str(e.value)


def test_launcher_commands():
    rdzv = Rendezvous(2, 1, "gpu07", 29500, 8, "9")
    assert launcher_command("torchrun", rdzv, "py", ["-m", "pretrain", "--config", "c.yaml"]) == [
        *"py -m torch.distributed.run --nnodes 2 --node_rank 1 --nproc_per_node 8".split(),
        *"--master_addr gpu07 --master_port 29500 -m pretrain --config c.yaml".split(),
    ]
    assert launcher_command("accelerate", rdzv, "py", ["-m", "pretrain"]) == [
        *"py -m accelerate.commands.launch --multi_gpu --num_machines 2 --machine_rank 1".split(),
        *"--num_processes 16 --main_process_ip gpu07 --main_process_port 29500 -m pretrain".split(),
    ]
    # detectron2's parser swallows everything after its options as config opts: flags go first.
    assert launcher_command("detectron2", rdzv, "py", ["-m", "transfer.detection", "--resume", "K", "V"]) == [
        *"py -m transfer.detection --num-gpus 8 --num-machines 2 --machine-rank 1".split(),
        *"--dist-url tcp://gpu07:29500 --resume K V".split(),
    ]


def test_cli_dry_run_prints_the_command():
    env = {**os.environ, **_env(SLURM_GPUS_ON_NODE="2")}
    out = subprocess.run(
        [sys.executable, "-m", "contrastive_transfer.slurm", "torchrun", "--dry-run", "--", "-m", "pretrain"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "--nnodes 3 --node_rank 1 --nproc_per_node 2 --master_addr gpu07" in out.stdout
    assert "node 1 of 3" in out.stderr


# ------------------------------------------------------------------ tools/slurm/run_step.sh


_TRAINER = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    def stop(signum, frame):
        out.write_text(signal.Signals(signum).name)  # what a training process would save on
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    Path(sys.argv[2]).touch()
    time.sleep(float(sys.argv[3]))
    sys.exit(int(sys.argv[4]))
    """
)


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    """PATH with `srun` (runs its command after its own options) and `scontrol` (records its call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    skip_options = 'while [[ "$1" == --* ]]; do shift; [[ "$1" =~ ^[0-9]+$ ]] && shift; done'
    (bin_dir / "srun").write_text(f'#!/usr/bin/env bash\n{skip_options}\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/usr/bin/env bash\necho "$@" >> {tmp_path}/scontrol.log\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    (tmp_path / "trainer.py").write_text(_TRAINER)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


def _run_step(tmp_path: Path, sleep_s: float, exit_code: int) -> subprocess.Popen:
    script = (
        f"source {REPO}/tools/slurm/run_step.sh\n"
        f"run_step {sys.executable} {tmp_path}/trainer.py {tmp_path}/saved {tmp_path}/started {sleep_s} {exit_code}\n"
        "echo after-step $?\n"
    )
    return subprocess.Popen(
        ["bash", "-c", script], env=_fake_slurm(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(path: Path, timeout_s: float = 30) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.05)


def test_run_step_forwards_the_signal_and_requeues(tmp_path):
    shell = _run_step(tmp_path, sleep_s=60, exit_code=0)
    _wait_for(tmp_path / "started")
    shell.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@180` sends to the batch shell
    out, err = shell.communicate(timeout=30)
    assert (tmp_path / "saved").read_text() == "SIGTERM", "the training process was not told to save"
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert shell.returncode == 0 and "after-step" not in out, "the batch script went on after requeueing"
    assert "requeueing job 4242" in err


def test_a_signal_before_the_step_exists_still_stops_it_and_requeues(tmp_path):
    """The signal arrives right after run_step sets its trap, before `step=$!`: the batch shell must
    not die on an unset variable (set -u) but stop the step once it exists and requeue. `trap` is
    wrapped so that the shell signals itself at that very point."""
    script = (
        f"source {REPO}/tools/slurm/run_step.sh\n"
        'trap() { builtin trap "$@"; [ "$1" = - ] || kill -USR1 $$; }\n'  # the signal inside the window
        f"run_step {sys.executable} {tmp_path}/trainer.py {tmp_path}/saved {tmp_path}/started 60 0\n"
        "echo after-step $?\n"
    )
    shell = subprocess.Popen(
        ["bash", "-c", script], env=_fake_slurm(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = shell.communicate(timeout=30)  # the step sleeps 60 s unless it was told to stop
    assert "unbound variable" not in err, err
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"], err
    assert shell.returncode == 0 and "after-step" not in out and "requeueing job 4242" in err


def test_run_step_without_a_signal_neither_requeues_nor_hides_the_exit_code(tmp_path):
    # The control of the test above: the step ends by itself, with its own code.
    shell = _run_step(tmp_path, sleep_s=0, exit_code=3)
    out, _ = shell.communicate(timeout=30)
    assert out.strip() == "after-step 3"
    assert not (tmp_path / "scontrol.log").exists() and not (tmp_path / "saved").exists()


def test_sbatch_scripts_are_valid_bash_with_signal_and_requeue():
    for name in ("pretrain.sbatch", "detection.sbatch", "probe.sbatch", "run_step.sh"):
        path = REPO / "tools" / "slurm" / name
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, f"{name}: bash syntax error"
    for name in ("pretrain.sbatch", "detection.sbatch", "probe.sbatch"):
        text = (REPO / "tools" / "slurm" / name).read_text()
        assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text
        assert "contrastive_transfer.slurm" in text
