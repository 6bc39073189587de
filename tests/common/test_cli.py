"""contrastive_transfer.cli: one-line failures, writability probes, the run lock, atomic writes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from contrastive_transfer.cli import (
    OutputLock,
    UserError,
    atomic_write,
    command,
    ensure_writable_dir,
    remove_stale_temporaries,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]


def test_command_turns_expected_failures_into_one_line_and_keeps_bugs():
    @command
    def fails_with(argv):
        raise argv.pop(0)

    with pytest.raises(SystemExit) as e:
        fails_with([UserError("bad value\n  of --x")])
    assert e.value.code == "error: bad value of --x"

    with pytest.raises(SystemExit) as e:
        fails_with([PermissionError(13, "Permission denied", "/data/out")])
    assert e.value.code == "error: Permission denied: /data/out; fix its permissions or choose another path"

    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        fails_with([ZeroDivisionError("bug")])
    with pytest.raises(UserError):  # --debug shows the traceback of an expected failure too
        fails_with([UserError("x"), "--debug"])


def test_unwritable_location_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(UserError, match=rf"--out {blocker}/sub is not a writable directory"):
        ensure_writable_dir(blocker / "sub", "--out")
    assert ensure_writable_dir(tmp_path / "new" / "dir", "--out").is_dir()
    assert list((tmp_path / "new" / "dir").iterdir()) == []  # the probe file is gone


_HOLD = textwrap.dedent("""
    import sys, time
    from contrastive_transfer.cli import OutputLock
    OutputLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(60)
""")


def test_second_run_is_refused_naming_the_holder_and_a_killed_holder_does_not_block(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=rf"in use by another run \(pid {holder.pid} on "):
            OutputLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with OutputLock(tmp_path):  # the kernel released the dead holder's lock
        with pytest.raises(UserError):  # and the lock is exclusive within one process too
            OutputLock(tmp_path).acquire()
    with OutputLock(tmp_path):
        pass


_HOLD_WITH_A_WORKER = textwrap.dedent("""
    import fcntl, multiprocessing, os, sys, time
    from contrastive_transfer.cli import OutputLock
    if sys.argv[2] == "raw":  # the control: a plain flock, shared with the child like any descriptor
        fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        OutputLock(sys.argv[1]).acquire()
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    worker.start()  # as a DataLoader worker is started
    print(worker.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("how", ["raw", "OutputLock"])
def test_a_killed_run_does_not_leave_its_lock_to_its_forked_workers(how, tmp_path):
    """The run is killed outright (SIGKILL, the OOM killer) and its worker lives on: the next run
    must get the directory at once. The control (a plain flock) shows the worker's copy of the
    descriptor keeps the lock."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_WITH_A_WORKER, str(tmp_path), how],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        worker = int(holder.stdout.readline())
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(worker, 0)  # the worker is alive
        deadline, got = time.monotonic() + 3, False  # the child drops its copy as it starts: soon
        while not got and time.monotonic() < deadline:
            try:
                OutputLock(tmp_path).acquire().release()
                got = True
            except UserError:
                time.sleep(0.05)
        assert got is (how == "OutputLock"), how
    finally:
        holder.kill()
        os.kill(worker, signal.SIGKILL)


def test_a_forked_child_releasing_its_copy_does_not_close_the_childs_own_lock(tmp_path):
    """A child inherits the parent's OutputLock object; its descriptor number is free in the child
    (dropped at the fork) and the child's own lock can get it. Releasing the inherited object there
    must leave the child's lock alone. The control closes that number as an unguarded release did."""
    parent = OutputLock(tmp_path / "a").acquire()
    try:
        for control in (True, False):
            pid = os.fork()
            if pid == 0:  # the child: exit 0 when its own lock survives
                code = 2
                try:
                    # The lowest free number goes to the next open: fill the free numbers below the
                    # dropped one (a pytest-xdist worker leaves gaps) so that the child's lock gets it.
                    while (filler := os.open(os.devnull, os.O_RDONLY)) < parent._fd:
                        pass
                    os.close(filler)
                    own = OutputLock(tmp_path / "b").acquire()
                    if own._fd != parent._fd:
                        os._exit(3)  # the setup failed, not the lock
                    os.close(parent._fd) if control else parent.release()
                    try:
                        OutputLock(tmp_path / "b").acquire()
                        code = 1  # the lock was gone
                    except UserError:
                        code = 0
                    own.release()
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == (1 if control else 0), control
    finally:
        parent.release()


@pytest.mark.parametrize("plant", ["symlink", "hard link"])
def test_the_lock_never_writes_through_a_link_planted_at_its_name(plant, tmp_path):
    """``DIR/.lock`` planted as a link to a file outside the folder (a shared output folder): the
    lock is one line naming it, and the file stays as it was. Control: opening the name as the
    lock did before (``os.open(O_RDWR | O_CREAT)``, then truncate) empties the file outside."""
    victim, out = tmp_path / "victim.txt", tmp_path / "shared"
    out.mkdir()
    victim.write_text("precious")
    (os.symlink if plant == "symlink" else os.link)(victim, out / ".lock")
    with pytest.raises(UserError) as e:
        OutputLock(out, "--output-dir").acquire()
    assert "\n" not in str(e.value) and str(out / ".lock") in str(e.value), e.value
    assert victim.read_text() == "precious" and not OutputLock._held
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)  # the control: the old open
    os.ftruncate(fd, 0)
    os.close(fd)
    assert victim.read_text() == ""


def test_atomic_write_and_open_append_never_follow_a_planted_link(tmp_path, monkeypatch):
    """A link planted at the target is replaced, not followed; one planted at the temporary name
    (which holds the pid) is never opened; an append-mode log that is a link is one line. The
    control: a plain ``write_text`` through the same link writes the file outside."""
    from contrastive_transfer.cli import open_append

    victim, out = tmp_path / "victim.txt", tmp_path / "out"
    out.mkdir()
    victim.write_text("precious")
    (out / "metrics.json").symlink_to(victim)
    monkeypatch.setattr("secrets.token_hex", lambda n: "0" * 2 * n)  # the temporary's name, foreseen
    planted = out / f".metrics.json.tmp{os.getpid()}-00000000"
    planted.symlink_to(victim)
    with pytest.raises(UserError, match="every name tried exists"):
        write_json(out / "metrics.json", {"top1": 1.0})
    monkeypatch.undo()
    write_json(out / "metrics.json", {"top1": 1.0})
    assert not (out / "metrics.json").is_symlink() and json.loads((out / "metrics.json").read_text()) == {"top1": 1.0}
    (out / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(UserError, match=r"metrics\.jsonl is a symbolic link"):
        open_append(out / "metrics.jsonl")
    assert victim.read_text() == "precious"
    (out / "metrics.jsonl").write_text("control")  # what a plain write does through the link
    assert victim.read_text() == "control"


def test_a_fresh_log_replaces_a_planted_link_or_hard_link_and_writes_nothing_outside(tmp_path):
    """``open_append(fresh=True)`` (a subprocess's output, its old content discarded) renames a new
    file over whatever is at the path: a link and a hard link are replaced, their files outside
    unchanged; a folder there is one line. Control: the same links opened to append are refused."""
    from contrastive_transfer.cli import open_append

    out = tmp_path / "out"
    out.mkdir()
    for plant in (os.symlink, os.link):
        victim = tmp_path / f"victim_{plant.__name__}.txt"
        victim.write_text("precious")
        log = out / f"{plant.__name__}.log"
        plant(victim, log)
        with pytest.raises(UserError, match=r"symbolic link|2 names"):  # the control: in place, refused
            open_append(log)
        with open_append(log, fresh=True) as f:
            f.write("the stage's output\n")
        assert victim.read_text() == "precious"
        assert not log.is_symlink() and log.stat().st_nlink == 1 and log.read_text() == "the stage's output\n"
    (out / "folder.log").mkdir()
    with pytest.raises(UserError, match=r"folder\.log: .*expected a log file there"):
        open_append(out / "folder.log", fresh=True)
    assert sorted(p.name for p in out.iterdir()) == ["folder.log", "link.log", "symlink.log"]  # no temporaries


def test_atomic_write_leaves_no_partial_file_and_stale_temporaries_are_removed(tmp_path):
    target = tmp_path / "checkpoint.pth"
    target.write_text("good")

    def crash(f):
        f.write(b"half")
        raise OSError(28, "No space left on device", f.name)

    with pytest.raises(OSError):
        atomic_write(target, crash)
    assert target.read_text() == "good" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pth"]

    atomic_write(target, lambda f: f.write(b"new"))
    assert target.read_text() == "new"

    dead = tmp_path / ".checkpoint.pth.tmp999999"
    dead_drawn = tmp_path / ".checkpoint.pth.tmp999998-0a1b2c3d"  # atomic_write's names: pid, then a draw
    ours = tmp_path / f".checkpoint.pth.tmp{os.getpid()}-0a1b2c3d"
    unrelated = tmp_path / ".notes.tmpx"
    for f in (dead, dead_drawn, ours, unrelated):
        f.write_text("")
    assert sorted(remove_stale_temporaries(tmp_path)) == [dead_drawn, dead]
    assert not dead.exists() and not dead_drawn.exists() and ours.exists() and unrelated.exists()


# Every command that writes into a folder takes both spellings of the option, as one option.
OUTPUT_FOLDER_COMMANDS = [
    ["transfer.knn"],
    ["transfer.linear"],
    ["transfer.voc07_svm"],
    ["contrastive_transfer.synthetic"],
    ["pretrain.analysis", "curves"],
    ["pretrain.analysis", "negatives"],
    ["pretrain.analysis", "npc"],
    ["pretrain.analysis", "mi-toy"],
    ["tools.demo"],
]


def test_output_folder_options_take_both_spellings():
    probe = textwrap.dedent(
        """
        import contextlib, io, json, runpy, sys
        out = {}
        for argv in json.loads(sys.argv[1]):
            sys.argv = [argv[0], *argv[1:], "--help"]
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                try:
                    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
                except SystemExit:
                    pass
            out[" ".join(argv)] = " ".join(buf.getvalue().split())
        print(json.dumps(out))
        """
    )
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(OUTPUT_FOLDER_COMMANDS)], cwd=repo, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    helps = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(helps) == sorted(" ".join(c) for c in OUTPUT_FOLDER_COMMANDS)
    # argparse lists the spellings of one option together: "--out OUT, --output-dir OUT" (or reversed)
    together = re.compile(r"--out [A-Z_]+, --output-dir |--output-dir [A-Z_]+, --out ")
    for name, text in helps.items():
        assert together.search(text), f"python -m {name}: --out and --output-dir are not one option:\n{text[:1500]}"


def test_a_lost_peer_is_one_line_and_other_runtime_errors_keep_their_traceback():
    import torch.distributed  # noqa: F401  (peer_lost only speaks when torch.distributed is loaded)

    from contrastive_transfer.cli import peer_lost

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:32965. GLHF!\nmore")
    line = peer_lost(gloo)
    assert line is not None and "\n" not in line and "Connection closed by peer" in line
    assert peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None  # a bug stays a bug
    assert peer_lost(ValueError("Connection closed by peer")) is None


def test_write_json_refuses_nan_in_one_line_and_keeps_the_earlier_file(tmp_path):
    path = tmp_path / "metrics.json"
    write_json(path, {"top1": 51.5, "per_class": {"cat": {"cv_ap": [0.5, None]}}})
    before = path.read_bytes()
    assert json.loads(before) == {"top1": 51.5, "per_class": {"cat": {"cv_ap": [0.5, None]}}}
    bad = {"top1": 52.0, "per_class": {"cat": {"cv_ap": [0.5, float("nan")]}}}
    assert "NaN" in json.dumps(bad)  # control: the json module writes it without complaint

    @command
    def evaluator(argv):
        write_json(path, bad)

    with pytest.raises(SystemExit) as e:
        evaluator([])
    assert e.value.code == f"error: {path}: per_class.cat.cv_ap[1]=nan: not a finite number; nothing written"
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["metrics.json"]
    with pytest.raises(UserError, match=r"top5=inf"):
        write_json(path, {"top5": float("inf")})


def test_every_evaluator_writes_its_metrics_through_write_json():
    """One writer for metrics: no module that writes a metrics.json dumps JSON into atomic_write itself."""
    sources = [p for d in ("transfer", "converters", "pretrain") for p in (REPO / d).rglob("*.py")]
    sources = [p for p in sources if "metrics.json" in p.read_text()]
    offenders = [
        str(p.relative_to(REPO)) for p in sources if re.search(r"atomic_write\([^\n]*json\.dumps", p.read_text())
    ]
    assert not offenders, offenders
    for module in ("knn", "linear", "voc07_svm", "detection/run"):
        assert "write_json(" in (REPO / "transfer" / f"{module}.py").read_text(), module


def test_a_log_row_with_an_infinite_gradient_norm_is_kept_as_null_and_read_back(tmp_path):
    """The engine's rows go through json_line: an fp16 overflow's inf (or a NaN) becomes null, and
    the project's own strict reader (json_limits, standard JSON only) reads the log back."""
    import json

    import pytest

    from contrastive_transfer.cli import json_line
    from contrastive_transfer.json_limits import JsonLimitError, read_json_lines

    row = {"step": 2, "loss": 3.5, "grad_q_norm_mean": float("inf"), "nested": {"x": [1.0, float("nan")]}}
    control, log = tmp_path / "control.jsonl", tmp_path / "metrics.jsonl"
    control.write_text(json.dumps(row) + "\n")  # Python's default writes Infinity, which JSON lacks
    with pytest.raises(JsonLimitError, match="Infinity"):
        read_json_lines(control)
    log.write_text(json_line({"step": 1, "loss": 4.0}) + json_line(row))
    assert read_json_lines(log) == [
        {"step": 1, "loss": 4.0},
        {"step": 2, "loss": 3.5, "grad_q_norm_mean": None, "nested": {"x": [1.0, None]}},
    ]
