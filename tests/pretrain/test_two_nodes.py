"""Two "nodes" on localhost, each one process, launched as a SLURM user would (the launcher
``python -m contrastive_transfer.slurm torchrun`` with SLURM's variables faked), against one node
with two processes through the same launcher.

Two nodes differ from one in what every "main process" test sees: each node has a local rank 0.
The judges: the one-node run's weights and queue (bit for bit: the same arithmetic in the same
order on the same machine), Python's audit hooks (every file opened for writing or renamed into
place, by which global rank), the output folder's flock, and a killed node.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from contrastive_transfer.contract import METHOD_STATE, training_state

from ..multiprocess_harness import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RECIPE = "configs/pretrain/tiny_mocov2.yaml"  # momentum encoder, queue and shuffle BN: all cross ranks

# Loaded into every process through PYTHONPATH: records each write (open for writing, rename into
# place) under AUDIT_ROOT with the global rank that made it. torchrun's agents have no RANK.
_AUDIT = """
import os, sys
_root, _log = os.environ["AUDIT_ROOT"], os.environ["AUDIT_LOG"]
_fd = os.open(f"{_log}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def _note(path):
    path = os.path.abspath(os.fsdecode(path))
    if path.startswith(_root):
        os.write(_fd, f"{os.environ.get('RANK', 'agent')}\\t{path}\\n".encode())
def _hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1], args[2] or 0
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or flags & (os.O_WRONLY | os.O_RDWR):
            _note(args[0])
    elif event == "os.rename":
        _note(args[1])
sys.addaudithook(_hook)
"""


def _env(tmp: Path, nnodes: int, node: int, port: int) -> dict[str, str]:
    audit = tmp / "audit"
    audit.mkdir(exist_ok=True)
    (audit / "sitecustomize.py").write_text(_AUDIT)
    path = os.pathsep.join(filter(None, [str(audit), os.environ.get("PYTHONPATH")]))
    slurm = {"SLURM_NNODES": str(nnodes), "SLURM_NODEID": str(node), "SLURM_JOB_ID": "77"}
    slurm["SLURM_JOB_NODELIST"] = ",".join(["localhost"] * nnodes)
    return (
        os.environ
        | slurm
        | {
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": path,
            "AUDIT_ROOT": str(tmp / "runs"),
            "AUDIT_LOG": str(tmp / "writes"),
        }
    )


def _launch(tmp: Path, out: str, nnodes: int, nproc: int, max_steps: int, tag: str) -> list[subprocess.Popen]:
    """One launcher per node; each writes its log to tmp/<tag>.node<N>.log."""
    port = free_port()
    args = ["-m", "pretrain", "--config", RECIPE, f"data.root={tmp / 'data'}", f"train.output_dir={tmp / 'runs' / out}"]
    args += [f"train.max_steps={max_steps}", "train.checkpoint_every=1", "train.resume=auto"]
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "contrastive_transfer.slurm", "torchrun", "--nproc-per-node", str(nproc), "--"]
        log = open(tmp / f"{tag}.node{node}.log", "w")
        procs.append(subprocess.Popen(cmd + args, cwd=REPO, env=_env(tmp, nnodes, node, port), stdout=log, stderr=log))
    return procs


def _wait(procs: list[subprocess.Popen], tmp: Path, tag: str, timeout_s: float = 300) -> None:
    for node, proc in enumerate(procs):
        rc = proc.wait(timeout=timeout_s)
        assert rc == 0, f"{tag} node {node} exited with {rc}:\n{(tmp / f'{tag}.node{node}.log').read_text()[-3000:]}"


def _kill_tree(proc: subprocess.Popen) -> None:
    """A node dies: its launcher and everything it started (torchrun puts workers in new sessions)."""
    try:
        parent = psutil.Process(proc.pid)
        for p in [parent, *parent.children(recursive=True)]:
            p.kill()
    except psutil.NoSuchProcess:
        pass
    proc.wait()


def _pause_trees(procs: list[subprocess.Popen]) -> list[psutil.Process]:
    """SIGSTOP to each launcher and everything it started (a static rendezvous has no heartbeat to
    miss, and the run's collective timeouts are minutes)."""
    paused = []
    for proc in procs:
        parent = psutil.Process(proc.pid)
        for p in [parent, *parent.children(recursive=True)]:
            p.suspend()
            paused.append(p)
    return paused


def _lock_held(folder: Path) -> bool:
    try:
        fd = os.open(folder / ".lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# A second run, imported in advance (seconds of imports) and released the moment the first one holds
# the folder, so that it tries the lock while the first is surely running.
_INTRUDER = """
import pathlib, sys, time
import accelerate, pretrain.engine
from pretrain.__main__ import main
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.02)
main(sys.argv[2:])
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_root):
    """The reference (1 node × 2 processes, 3 steps) beside 2 nodes × 1 process run to step 1 then
    relaunched to step 3, with an intruding run tried while the second part holds the folder."""
    tmp = tmp_path_factory.mktemp("two_nodes")
    (tmp / "data").symlink_to(synthetic_root / "imagenet" / "train")
    ref = _launch(tmp, "one_node", nnodes=1, nproc=2, max_steps=3, tag="ref")
    first = _launch(tmp, "two_nodes", nnodes=2, nproc=1, max_steps=1, tag="first")
    _wait(ref + first, tmp, "reference / first part")
    folder = tmp / "runs" / "two_nodes"
    args = ["--config", RECIPE, f"data.root={tmp / 'data'}", f"train.output_dir={folder}", "train.max_steps=3"]
    intruder = subprocess.Popen(
        [sys.executable, "-c", _INTRUDER, str(tmp / "go"), *args],
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    second = _launch(tmp, "two_nodes", nnodes=2, nproc=1, max_steps=3, tag="second")
    end = time.monotonic() + 120
    while not _lock_held(folder) and time.monotonic() < end and second[0].poll() is None:
        time.sleep(0.02)
    assert _lock_held(folder), "the two-node run never held its output folder's lock"
    # Both nodes paused while the intruder tries: under load its start can outlast the run's last
    # steps, and it would then find the folder released (a race of the test, not of the lock).
    paused = _pause_trees(second)
    try:
        (tmp / "go").touch()
        _, intruder_err = intruder.communicate(timeout=120)
    finally:
        for p in paused:
            p.resume()
    _wait(second, tmp, "second part")
    return tmp, (intruder.returncode, intruder_err)


def _state(path: Path) -> dict[str, torch.Tensor]:
    return training_state(torch.load(path, map_location="cpu", weights_only=True))[METHOD_STATE]


def test_two_nodes_resumed_equal_one_node_bit_for_bit(runs):
    tmp, _ = runs
    ref, two = _state(tmp / "runs/one_node/checkpoint_last.pth"), _state(tmp / "runs/two_nodes/checkpoint_last.pth")
    assert ref.keys() == two.keys() and any("queue" in k for k in ref)
    different = [k for k in ref if not torch.equal(ref[k], two[k])]
    assert not different, f"2 nodes (resumed at step 1) differ from 1 node in {different[:5]}"
    steps = [json.loads(line)["step"] for line in (tmp / "runs/two_nodes/metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], f"each step logged once across the relaunch: {steps}"


def test_each_file_is_written_by_global_rank_zero_only(runs):
    tmp, _ = runs
    writers: dict[str, set[str]] = {}
    for log in tmp.glob("writes.*"):
        for line in log.read_text().splitlines():
            rank, path = line.split("\t", 1)
            writers.setdefault(os.path.relpath(path, tmp / "runs"), set()).add(rank)
    two_nodes = {p: r for p, r in writers.items() if p.startswith("two_nodes")}
    assert any("checkpoint_last.pth" in p for p in two_nodes), "the audit saw no checkpoint: it cannot fail"
    assert two_nodes.get("two_nodes/file_index.npz") == {"0"}, "the file index is built once, by rank 0"
    others = {p: r for p, r in two_nodes.items() if r != {"0"}}
    assert not others, f"files written by another process than global rank 0: {others}"


def test_a_second_run_into_the_folder_stops_in_one_line(runs):
    tmp, (rc, err) = runs
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "in use by another run" in lines[0], err[-2000:]
    assert not _lock_held(tmp / "runs" / "two_nodes"), "the lock outlived the run"


def test_a_dead_node_stops_the_other_in_one_line_and_a_relaunch_resumes(runs):
    tmp, _ = runs
    folder = tmp / "runs" / "two_nodes"
    nodes = _launch(tmp, "two_nodes", nnodes=2, nproc=1, max_steps=8, tag="dying")
    end = time.monotonic() + 180
    while time.monotonic() < end and nodes[0].poll() is None:
        rows = (folder / "metrics.jsonl").read_text().splitlines()
        if json.loads(rows[-1])["step"] >= 4:
            break
        time.sleep(0.1)
    _kill_tree(nodes[1])
    killed = time.monotonic()
    rc = nodes[0].wait(timeout=120)
    waited = time.monotonic() - killed
    log = (tmp / "dying.node0.log").read_text()
    assert rc != 0 and waited < 60, f"node 0 exited with {rc} after {waited:.0f} s"
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lost contact with another process" in errors[0], log[-3000:]
    assert "[rank0]: Traceback" not in log, log[-3000:]
    _wait(_launch(tmp, "two_nodes", nnodes=2, nproc=1, max_steps=8, tag="relaunch"), tmp, "relaunch")
    ckpt = torch.load(folder / "checkpoint_final.pth", map_location="cpu", weights_only=True)
    assert ckpt["step"] == 8
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), f"each step logged once across the death and the relaunch: {steps}"
