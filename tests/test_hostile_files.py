"""Hostile files through the real command lines (issue 38), generated rather than listed.

Every kind of input (``hostile.mutants()``: weights, training and probe states, lists, images,
configs, metrics logs) is mutated into hostile variants, and each mutant is run through every
entry point that reads that kind (``ENTRY_POINTS``), as a subprocess of the real CLI under a
memory cap (RLIMIT_DATA, see MEMORY_CAP) and a time cap. Each must end with:

- a non-zero exit, and exactly one ``error: ...`` line on stderr, its last, naming the file (or
  the file a link leads to), no traceback (progress a command logged before it met the file may
  precede it);
- no allocation failure against the cap (the file is refused from its sizes before that);
- no file written outside the case's output folder (the inputs, the data and $HOME unchanged),
  and no code run (the payload's marker file absent).

A default run takes SAMPLE (entry point, mutant) pairs drawn with HOSTILE_SEED (set it to draw
others); the whole sweep is marked slow and sweep (`make test-sweep`). The controls show each
attack live without the gate.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from .hostile import (
    BOMB_INFLATED,
    SPECIAL,
    STRUCTURAL,
    bomb_jpeg,
    bomb_png,
    file_index_mutants,
    legacy_declaring,
    legacy_growing,
    legacy_unreferenced,
    mutants,
    resnet18_state,
    sized_call,
    torch_bytes,
    zip_bomb,
)

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
# RLIMIT_DATA of every child: its heap and anonymous mappings. Not RLIMIT_AS: importing torch and
# torchvision maps 3.4 GiB of address space (VmSize) of which ~680 MiB is resident, so an address
# space cap of 2 GiB stops the import ("libtorch_cpu.so: failed to map segment"), not an attack.
MEMORY_CAP = 2 << 30
PEAK_RSS_LIMIT = 1 << 30  # the bound on every case's peak resident memory (ru_maxrss)
TIME_CAP = 180  # seconds per child: a hang ends the test here (the 2 shared CI cores are slow)
SEED = int(os.environ.get("HOSTILE_SEED", "38"))
SAMPLE = int(os.environ.get("HOSTILE_SAMPLE", "2"))
MUTANTS = mutants()
TINY_SIMCLR = REPO / "configs" / "pretrain" / "tiny_simclr.yaml"
TINY_VOC = REPO / "configs" / "detection" / "tiny_voc0712_R_18_FPN_syncbn.yaml"


@dataclass(frozen=True)
class Case:
    """The folders of one run: ``inputs`` (the mutant and its neighbours), ``out`` (the only place
    the child may write; its working directory), ``home`` ($HOME, must stay empty)."""

    root: Path
    data: Path  # the synthetic datasets (shared, read-only for the child)
    weights: Path  # a valid weights file, for entry points whose hostile input is another

    @property
    def inputs(self) -> Path:
        return self.root / "inputs"

    @property
    def out(self) -> Path:
        return self.root / "out"


@dataclass(frozen=True)
class EntryPoint:
    name: str
    kind: str
    place: Callable[[Case], Path]  # where the mutant goes (its neighbours prepared around it)
    argv: Callable[[Case, Path], list[str]]
    slow_start: bool = False  # detectron2's import: only in the full sweep


def _plain(name: str) -> Callable[[Case], Path]:
    return lambda case: case.inputs / name


def _linked_copy(src: Path, dst: Path, replaced: Path) -> Path:
    """``dst`` mirrors ``src`` with symbolic links, except the directories leading to the
    relative path ``replaced``, which are real (so the mutant can take its place)."""
    dst.mkdir(parents=True, exist_ok=True)
    head, *rest = replaced.parts
    for entry in sorted(src.iterdir()):
        if entry.name == head and rest:
            _linked_copy(entry, dst / head, Path(*rest))
        elif entry.name != head:
            (dst / entry.name).symlink_to(entry)
    return dst / replaced


def _places_list(case: Case) -> Path:
    return _linked_copy(
        case.data / "places205", case.inputs / "places205", Path("trainvalsplit_places205/train_places205.csv")
    )


def _voc_class_file(case: Case) -> Path:
    return _linked_copy(case.data / "VOC2007", case.inputs / "VOC2007", Path("ImageSets/Main/dog_trainval.txt"))


def _image(case: Case) -> Path:
    train = case.data / "imagenet" / "train"
    first = sorted(p for p in train.iterdir() if p.is_dir())[0]
    image = sorted(first.iterdir())[0]
    return _linked_copy(train, case.inputs / "train", image.relative_to(train))


def _probe_state(case: Case) -> Path:
    from transfer.probe_presets import PROBE_STATE

    return case.out / PROBE_STATE


def _metrics_log(case: Case) -> Path:
    return case.inputs / "run" / "metrics.jsonl"


def _weights_argv(module: str, *rest: str) -> Callable[[Case, Path], list[str]]:
    return lambda case, x: ["-m", module, "--weights", str(x), *(a.format(data=case.data, out=case.out) for a in rest)]


_PROBE = ("--preset", "places205", "--epochs", "1", "--batch-size", "16", "--resize", "36", "--crop", "32")


def _linear_places(case: Case, places: Path, weights: Path, *extra: str) -> list[str]:
    return [
        *("-m", "transfer.linear", "--weights", str(weights), "--dataset", "places205"),
        *("--data-root", str(places), "--output-dir", str(case.out), "--workers", "0", *_PROBE, *extra),
    ]


ENTRY_POINTS = [
    EntryPoint(
        "to_torchvision",
        "weights",
        _plain("w.pth"),
        lambda c, x: ["-m", "converters.to_torchvision", str(x), str(c.out / "o.pth")],
    ),
    EntryPoint(
        "to_detectron2",
        "weights",
        _plain("w.pth"),
        lambda c, x: ["-m", "converters.to_detectron2", str(x), str(c.out / "o.pkl")],
    ),
    EntryPoint(
        "knn",
        "weights",
        _plain("w.pth"),
        _weights_argv(
            "transfer.knn", "--train-dir", "{data}/imagenet/train", "--val-dir", "{data}/imagenet/val", "--out", "{out}"
        ),
    ),
    EntryPoint(
        "linear",
        "weights",
        _plain("w.pth"),
        _weights_argv(
            "transfer.linear",
            "--dataset",
            "places205",
            "--data-root",
            "{data}/places205",
            "--preset",
            "places205",
            "--out",
            "{out}",
        ),
    ),
    EntryPoint(
        "voc07_svm",
        "weights",
        _plain("w.pth"),
        _weights_argv("transfer.voc07_svm", "--voc-root", "{data}/VOC2007", "--out", "{out}"),
    ),
    EntryPoint("npc", "weights", _plain("w.pth"), lambda c, x: ["-m", "pretrain.analysis", "npc", str(x)]),
    EntryPoint(
        "detection",
        "weights",
        _plain("w.pkl"),
        lambda c, x: [
            "-m",
            "transfer.detection",
            "--config-file",
            str(TINY_VOC),
            "--data-root",
            str(c.data),
            "OUTPUT_DIR",
            str(c.out),
            "MODEL.WEIGHTS",
            str(x),
        ],
        slow_start=True,
    ),
    EntryPoint(
        "pretrain_resume",
        "training state",
        _plain("checkpoint_last.pth"),
        lambda c, x: [
            "-m",
            "pretrain",
            "--config",
            str(TINY_SIMCLR),
            f"data.root={c.data}/imagenet/train",
            f"train.output_dir={c.out}",
            "train.max_steps=1",
            f"train.resume={x}",
        ],
    ),
    EntryPoint(
        "negatives",
        "training state",
        _plain("checkpoint_last.pth"),
        lambda c, x: ["-m", "pretrain.analysis", "negatives", str(c.out), "--checkpoint", str(x)],
    ),
    EntryPoint(
        "linear_resume",
        "probe state",
        _probe_state,
        lambda c, x: _linear_places(c, c.data / "places205", c.weights, "--resume"),
    ),
    EntryPoint(
        "places205_list", "list", _places_list, lambda c, x: _linear_places(c, c.inputs / "places205", c.weights)
    ),
    EntryPoint(
        "voc_class_list",
        "list",
        _voc_class_file,
        lambda c, x: [
            "-m",
            "transfer.voc07_svm",
            "--weights",
            str(c.weights),
            "--voc-root",
            str(c.inputs / "VOC2007"),
            "--out",
            str(c.out),
        ],
    ),
    EntryPoint(
        "knn_image",
        "image",
        _image,
        lambda c, x: [
            "-m",
            "transfer.knn",
            "--weights",
            str(c.weights),
            "--train-dir",
            str(c.inputs / "train"),
            "--val-dir",
            str(c.inputs / "train"),
            "--out",
            str(c.out),
            "--workers",
            "0",
            "--resize",
            "36",
            "--crop",
            "32",
        ],
    ),
    EntryPoint(
        "pretrain_config",
        "config",
        _plain("recipe.yaml"),
        lambda c, x: ["-m", "pretrain", "--config", str(x), "--print-config"],
    ),
    EntryPoint("curves", "log", _metrics_log, lambda c, x: ["-m", "pretrain.analysis", "curves", str(x.parent)]),
    EntryPoint(
        "claims_runs",
        "runs",
        _plain("claims_runs.jsonl"),
        lambda c, x: (
            ["-m", "benchmarks.claims", "--learning-runs", str(c.inputs / "none.jsonl"), "--runs", str(x)]
            + ["--plan", "--out", str(c.out / "claims.md")]
        ),
    ),
]

CASES = [(entry, name) for entry in ENTRY_POINTS for name, _ in MUTANTS[entry.kind]]


def _sample() -> list[tuple[EntryPoint, str]]:
    """SAMPLE cases of all, and as many of the structural mutants (issue 48), drawn with SEED."""
    quick = [c for c in CASES if not c[0].slow_start]
    rng = random.Random(SEED)
    drawn = rng.sample(quick, min(SAMPLE, len(quick)))
    structural = [c for c in quick if c[1] in STRUCTURAL and c not in drawn]
    return drawn + rng.sample(structural, min(SAMPLE, len(structural)))


def _id(case: tuple[EntryPoint, str]) -> str:
    return f"{case[0].name}-{case[1]}"


# ------------------------------------------------------------------------------------- the runner


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_CAP, MEMORY_CAP))


# Runs argv and reports its peak resident memory. Measured in a grandchild of this (large) test
# process: Linux carries a process's RSS high-water mark across exec, so a child forked from
# pytest (which has torch loaded) would report pytest's resident memory as its own peak; a child
# forked from this small launcher starts from the launcher's few MiB. wait4's ru_maxrss covers the
# child and the processes it waited for (data workers).
_LAUNCHER = """
import os, signal, subprocess, sys
fd, argv = int(sys.argv[1]), sys.argv[2:]
child = subprocess.Popen(argv)
_, status, usage = os.wait4(child.pid, 0)
os.write(fd, str(usage.ru_maxrss).encode())
code = os.waitstatus_to_exitcode(status)
if code < 0:  # killed by a signal: end the same way, so the caller sees it
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def run_measured(argv: list[str], **popen) -> tuple[subprocess.CompletedProcess | None, int]:
    """The child's outcome under the caps, and its peak resident memory in bytes (ru_maxrss);
    (None, 0) when it outlived TIME_CAP (its whole process group is killed)."""
    read_end, write_end = os.pipe()
    try:
        with subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(write_end), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="backslashreplace",
            preexec_fn=_limits,
            pass_fds=(write_end,),
            start_new_session=True,
            **popen,
        ) as child:
            os.close(write_end)
            write_end = -1
            try:
                out, err = child.communicate(timeout=TIME_CAP)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, 9)
                child.communicate()
                return None, 0
        peak_kib = os.read(read_end, 64).decode() or "0"
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    return subprocess.CompletedProcess(argv, child.returncode, out, err), int(peak_kib) * 1024  # KiB on Linux


def _snapshot(*roots: Path, skip: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            if Path(dirpath) == skip:
                dirnames[:] = []
                continue
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                if p == str(skip):  # the output folder itself changes (its entries are the child's)
                    continue
                st = os.lstat(p)
                out[p] = (st.st_size, st.st_mtime_ns)
    return out


def run_case(entry: EntryPoint, mutant: str, root: Path, data: Path, weights: Path) -> None:
    case = Case(root, data, weights)
    for folder in (case.inputs, case.out, root / "home"):
        folder.mkdir(parents=True, exist_ok=True)
    target = entry.place(case)
    target.parent.mkdir(parents=True, exist_ok=True)
    dict(MUTANTS[entry.kind])[mutant](target)
    before = _snapshot(root, data, skip=case.out)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOME": str(root / "home")}
    env.update(PYTHONWARNINGS="ignore", CT_DEBUG="0", TMPDIR=str(case.out))
    start = time.monotonic()
    proc, peak = run_measured([sys.executable, *entry.argv(case, target)], cwd=case.out, env=env)
    if proc is None:
        pytest.fail(f"{entry.name} on {mutant}: still running after {TIME_CAP} s (a hang)")
    print(f"peak RSS {entry.name} {mutant}: {peak / MiB:.0f} MiB")  # `-rP` lists them (docs/security.md)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    where = f"{entry.name} on {mutant} (rc {proc.returncode}, {time.monotonic() - start:.1f} s): {proc.stderr[-3000:]}"
    assert proc.returncode > 0, where
    assert "Traceback" not in proc.stderr, where
    # One error line, the last; a command may have logged progress before it met the file (knn's
    # "read WEIGHTS" line), which is no part of the error.
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("error: "), where
    assert target.name in errors[0] or os.path.realpath(target) in errors[0], where
    # refused from sizes, not stopped by the memory cap (an allocation failure means it got through)
    assert "MemoryError" not in errors[0] and "allocat" not in errors[0], where
    assert peak < PEAK_RSS_LIMIT, f"{where}: peak RSS {peak / MiB:.0f} MiB"
    after = _snapshot(root, data, skip=case.out)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"{where}: files outside {case.out} changed: {changed[:5]}"
    assert not list((root / "home").iterdir()) and not list(root.rglob("MARKER")), where


@pytest.fixture(scope="module")
def valid_weights(tmp_path_factory) -> Path:
    import torch

    path = tmp_path_factory.mktemp("valid") / "resnet18_small.pth"
    torch.save(resnet18_state(), path)
    return path


@pytest.mark.parametrize("case", _sample(), ids=_id)
def test_a_sample_of_mutants_through_the_command_lines(case, tmp_path, synthetic_root, valid_weights):
    run_case(*case, tmp_path, synthetic_root, valid_weights)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_mutant_through_every_command_line(case, tmp_path, synthetic_root, valid_weights):
    if case[0].slow_start:
        pytest.importorskip("detectron2")
    run_case(*case, tmp_path, synthetic_root, valid_weights)


def test_every_kind_has_mutants_and_an_entry_point():
    assert {e.kind for e in ENTRY_POINTS} == set(MUTANTS)
    assert all(len(MUTANTS[k]) > len(SPECIAL) for k in MUTANTS)
    # every kind has structural mutants (issue 48), and every one of them has an entry point
    assert all({name for name, _ in MUTANTS[k]} & STRUCTURAL for k in MUTANTS)
    assert {name for _, name in CASES} >= STRUCTURAL - {name for name, _ in file_index_mutants()}


@pytest.mark.parametrize("name", [name for name, _ in file_index_mutants()])
def test_every_file_index_mutant_is_one_line(name, tmp_path):
    """In process: pretraining rebuilds an index it cannot read, so its command line would hide
    the refusal; ``FileIndex.load`` (what a resumed run and the other processes call) must give it
    in one line naming the file, within a few seconds, before numpy reserves what a header declares."""
    from contrastive_transfer.cli import UserError
    from contrastive_transfer.file_index import FileIndex

    path = tmp_path / "file_index.npz"
    dict(file_index_mutants())[name](path)
    start = time.monotonic()
    with pytest.raises((UserError, OSError)) as e:
        FileIndex.load(path, "data")
    assert time.monotonic() - start < 10
    message = str(e.value) if isinstance(e.value, UserError) else f"{e.value.strerror}: {e.value.filename}"
    assert path.name in message and "\n" not in message, message


# ---------------------------------------------------------------------------------------- controls


def test_control_a_fifo_blocks_a_plain_open(tmp_path):
    fifo = tmp_path / "image.jpg"
    dict(SPECIAL)["fifo"](fifo)
    reader = threading.Thread(target=lambda: fifo.read_bytes(), daemon=True)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()  # what open() did in every reader before the gate
    with open(fifo, "wb"):  # a writer appears and leaves: the reader gets EOF
        pass
    reader.join(5)
    assert not reader.is_alive()


def test_control_dev_zero_and_a_zip_bomb_and_a_stride0_view_take_memory_without_the_gate(tmp_path):
    """Without the gate: reading /dev/zero runs into the memory cap; torch.load inflates the
    crafted record; a 4-byte storage viewed as 2^31 values costs 2 GiB once isfinite reads it; a
    legacy-format file of 368 bytes has torch.load (weights_only) allocate the 4 GiB it declares. The
    project's checks refuse the same files from their metadata (the assertions after the child)."""
    import torch

    from contrastive_transfer.safe_load import torch_load
    from contrastive_transfer.untrusted import UnsafeFileError, check_archive, check_loaded_tensors, read_untrusted

    bomb, view, legacy = tmp_path / "bomb.pth", tmp_path / "view.pth", tmp_path / "legacy.pth"
    dropped, grown = tmp_path / "dropped.pth", tmp_path / "grown.pth"
    buffer, tensor_class = tmp_path / "bytearray.pth", tmp_path / "tensor_class.pth"
    bomb.write_bytes(zip_bomb(torch_bytes({"w": torch.zeros(1)})))
    legacy.write_bytes(legacy_declaring(1 << 30))
    dropped.write_bytes(legacy_unreferenced(1 << 30))
    grown.write_bytes(legacy_growing(1 << 30))
    buffer.write_bytes(sized_call(bytearray, 1 << 32))
    tensor_class.write_bytes(sized_call(torch.FloatTensor, 1 << 30))
    view.write_bytes(torch_bytes({"w": torch.zeros(1).expand(1 << 31)}))
    script = f"""
import json, torch
out = {{}}
for name, attack in [
    ("dev_zero", lambda: open("/dev/zero", "rb").read()),
    ("zip_bomb", lambda: torch.load({str(bomb)!r}, weights_only=True)),
    ("stride0", lambda: torch.isfinite(torch.load({str(view)!r}, weights_only=True)["w"]).all()),
    ("legacy", lambda: torch.load({str(legacy)!r}, weights_only=True)),
    ("dropped", lambda: torch.load({str(dropped)!r}, weights_only=True)),
    ("grown", lambda: torch.load({str(grown)!r}, weights_only=True)),
    ("bytearray", lambda: torch.load({str(buffer)!r}, weights_only=True)),
    ("tensor_class", lambda: torch.load({str(tensor_class)!r}, weights_only=True)),
]:
    try:
        attack()
        out[name] = "completed"
    except (MemoryError, RuntimeError) as e:
        out[name] = type(e).__name__ + ": " + str(e)[:200]
print(json.dumps(out))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=TIME_CAP, preexec_fn=_limits
    )
    outcome = json.loads(proc.stdout)
    assert outcome["dev_zero"].startswith("MemoryError"), outcome
    assert "alloc" in outcome["zip_bomb"].lower() or outcome["zip_bomb"].startswith("MemoryError"), outcome
    assert "alloc" in outcome["stride0"].lower(), outcome
    assert "alloc" in outcome["legacy"].lower() and legacy.stat().st_size < 1000, outcome
    assert "alloc" in outcome["dropped"].lower() and dropped.stat().st_size < 1000, outcome
    assert "alloc" in outcome["grown"].lower() and grown.stat().st_size < 1000, outcome
    assert outcome["bytearray"].startswith("MemoryError") and buffer.stat().st_size < 2000, outcome
    assert "alloc" in outcome["tensor_class"].lower() and tensor_class.stat().st_size < 2000, outcome
    # the gate: each refused from sizes alone
    for path, check in [
        (Path("/dev/zero"), lambda p: read_untrusted(p, "weights")),
        (bomb, lambda p: check_archive(open(p, "rb"), p, "weights")),
        (view, lambda p: check_loaded_tensors(torch.load(p, weights_only=True), p, "weights")),
        (legacy, torch_load),
        (dropped, torch_load),
        (grown, torch_load),
        (buffer, torch_load),
        (tensor_class, torch_load),
    ]:
        with pytest.raises(UnsafeFileError) as e:
            check(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert BOMB_INFLATED > MEMORY_CAP


def test_a_tensor_not_stored_in_the_file_is_refused_before_it_is_touched(tmp_path):
    """``torch.Tensor(n)`` in a pickle (allowed by torch's weights-only loader, as the type of
    tensors with attributes) makes an uninitialized storage of n elements: the control loads 256 MiB
    of storage from a file of a few hundred bytes; the gate refuses the file after the load, from
    the storages' sizes, before any element is read."""
    import torch

    from contrastive_transfer.safe_load import torch_load
    from contrastive_transfer.untrusted import UnsafeFileError

    path = tmp_path / "not_stored.pth"
    path.write_bytes(sized_call(torch.Tensor, 1 << 26))
    loaded = torch.load(path, weights_only=True)["x"]  # the control
    assert loaded.untyped_storage().nbytes() == 1 << 28 and path.stat().st_size < 2000
    with pytest.raises(UnsafeFileError, match="256 MiB of tensor storage in a file of"):
        torch_load(path, kind="training state")
    stored = tmp_path / "stored.pth"  # a tied and sliced state of the same size class loads
    w = torch.randn(1 << 16)
    torch.save({"a": w, "b": w[10:], "c": w.view(256, 256).t()}, stored)
    assert torch.equal(torch_load(stored)["c"], w.view(256, 256).t())


def test_control_complex_nan_passed_the_old_finiteness_check_and_huge_jpeg_headers_are_live():
    import numpy as np
    import simplejpeg
    import torch

    from contrastive_transfer.untrusted import tensor_problem

    from .hostile import _valid_jpeg

    w = torch.full((4,), complex("nan+1j"))
    assert not w.is_floating_point()  # the old check: "not floating point, so nothing to check"
    assert "complex64" in tensor_problem(w) and "complex64" in tensor_problem(w.numpy())
    assert tensor_problem(np.full(3, np.nan, np.float32)).startswith("holds 3 non-finite")
    height, width, *_ = simplejpeg.decode_jpeg_header(bomb_jpeg(_valid_jpeg()))
    assert height * width == 65000 * 65000  # what decoding it would allocate, times 3 bytes


def test_control_a_name_that_is_not_utf8_cannot_be_written_as_text(tmp_path):
    from contrastive_transfer.paths import printable

    name = os.fsdecode(b"/data/cls/\xff\n.jpg")
    with pytest.raises(UnicodeEncodeError):  # what the listing of unreadable images did
        (tmp_path / "listing.txt").write_text(name + "\n", encoding="utf-8")
    assert printable(name) == "/data/cls/\\xff\\n.jpg"


def test_the_gate_refuses_special_files_without_opening_them(tmp_path):
    from contrastive_transfer.untrusted import KINDS, UnsafeFileError, read_untrusted

    for name, make in SPECIAL:
        make(tmp_path / name)
        start = time.monotonic()
        with pytest.raises(UnsafeFileError, match=f"{name}: is a .*expected weights as a regular file"):
            read_untrusted(tmp_path / name, "weights")
        assert time.monotonic() - start < 1
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(KINDS["config"].cap + 1)  # sparse: nothing is written, the size is what counts
    with pytest.raises(UnsafeFileError, match=r"big\.yaml: is 1048577 bytes, above the 1 MiB limit for a config"):
        read_untrusted(big, "config")
    shutil.rmtree(tmp_path / "directory")


@pytest.mark.parametrize("target", ["split", "xml", "image", "json"])
@pytest.mark.parametrize("special", ["fifo", "dev_zero"])
def test_detection_datasets_refuse_special_files_in_one_line(target, special, synthetic_root, tmp_path):
    """The detection readers (in process: detectron2's import is too slow to start per mutant)."""
    pytest.importorskip("detectron2")
    from transfer.detection.datasets import DatasetError, check_datasets, register_datasets

    voc = synthetic_root / "VOC2007"
    first = (voc / "ImageSets" / "Main" / "test.txt").read_text().split()[0]
    relative = {
        "split": Path("VOC2007/ImageSets/Main/test.txt"),
        "xml": Path(f"VOC2007/Annotations/{first}.xml"),
        "image": Path(f"VOC2007/JPEGImages/{first}.jpg"),
        "json": Path("coco/annotations/instances_val2017.json"),
    }[target]
    root = tmp_path / "data"
    path = _linked_copy(synthetic_root, root, relative)
    dict(SPECIAL)[special](path)
    dataset = "coco_2017_val" if target == "json" else "voc_2007_test"
    register_datasets(root)
    try:
        start = time.monotonic()
        with pytest.raises(DatasetError) as e:
            check_datasets([dataset], root, load=True)
        assert time.monotonic() - start < 30
    finally:
        register_datasets()
    assert "\n" not in str(e.value) and str(path) in str(e.value) and "expected" in str(e.value), str(e.value)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # refused just after
def test_detection_mapper_checks_the_pixel_count_before_detectron2_decodes(tmp_path):
    """The images detectron2 opens itself (its DatasetMapper's read_image) get the gate and the
    header check too. Control: Pillow's own guard only warns below twice its limit, so detectron2
    decodes a 69-byte PNG claiming 23000 x 23000 pixels into the memory cap."""
    pytest.importorskip("detectron2")
    from detectron2.config import get_cfg

    from transfer.detection.trainer import ImageCheckingMapper

    path = tmp_path / "big.png"
    path.write_bytes(bomb_png(23_000, 23_000))
    mapper = ImageCheckingMapper(get_cfg(), is_train=False)
    with pytest.raises(OSError) as e:
        mapper({"file_name": str(path), "height": 23_000, "width": 23_000, "image_id": 0})
    assert str(e.value).startswith(f"cannot read image {path}: its header claims 23000x23000 pixels"), str(e.value)
    assert "\n" not in str(e.value)
    script = f"""
import resource, warnings
resource.setrlimit(resource.RLIMIT_DATA, ({MEMORY_CAP}, {MEMORY_CAP}))
import contrastive_transfer.images  # Pillow's limit, as in detection's processes
from detectron2.data.detection_utils import read_image
warnings.simplefilter("ignore")
try:
    read_image({str(path)!r}, format="BGR")
    print("decoded")
except BaseException as e:
    print(type(e).__name__, str(e)[:200])
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIME_CAP, env=env)
    assert proc.stdout.startswith("MemoryError"), proc.stdout + proc.stderr[-2000:]


def test_control_the_peak_memory_measure_sees_a_child_above_the_limit_however_large_its_parent():
    """The per-case bound is live: a child holding 1.1 GiB is measured above PEAK_RSS_LIMIT, and
    one holding 50 MiB below it even while this process holds more than the limit (a child
    forked straight from it would report this process's memory as its own peak)."""
    ballast = bytearray(PEAK_RSS_LIMIT + (64 << 20))  # this process: above the limit
    big = run_measured([sys.executable, "-c", "x = bytearray(1100 << 20)"])
    small = run_measured([sys.executable, "-c", "x = bytearray(50 << 20)"])
    del ballast
    assert big[0] is not None and big[0].returncode == 0 and big[1] > PEAK_RSS_LIMIT, big
    assert small[0] is not None and 50 * MiB < small[1] < 200 * MiB, small


def test_benchmarks_read_their_files_through_the_gate(tmp_path):
    """The benchmarks' and the demo's JSON readers (contrastive_transfer.json_limits.read_json /
    read_json_lines): a FIFO is refused without a wait, deep nesting in one line naming the file
    and the line. Control: the plain reads they replaced end in a RecursionError."""
    from benchmarks.learning import read_runs
    from benchmarks.transfer import _json
    from contrastive_transfer.json_limits import JsonLimitError
    from contrastive_transfer.untrusted import UnsafeFileError

    fifo = tmp_path / "metrics.json"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeFileError, match=r"metrics\.json: is a named pipe"):
        _json(fifo)
    deep = tmp_path / "runs.jsonl"
    deep.write_bytes(b'{"step": 1}\n' + b"[" * 100_000 + b"\n")
    with pytest.raises(JsonLimitError, match=r"runs\.jsonl line 2 nests 100000 levels deep"):
        read_runs(deep)
    with pytest.raises(RecursionError):
        [json.loads(line) for line in deep.read_text().splitlines()]
