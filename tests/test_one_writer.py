"""One writer (issue 48, item 2): every file the project writes goes through
``contrastive_transfer.cli.atomic_write`` (a temporary it creates itself with ``O_EXCL |
O_NOFOLLOW``, flushed, renamed over the target) or ``open_append`` (a log written in place, never
through a link). The source is parsed (``tests/io_scan.py``) and any other write fails the test,
with an allowlist naming each exception and why; its control plants raw writes in a copy of the
packages. Then each command that writes an output folder is run once to learn what it writes, and
again with a link planted at every one of those paths: nothing outside the folder may change."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from .io_scan import PACKAGES, REPO, raw_io, scan_project
from .method_cases import NARROW

WRITE_ALLOWED = {
    ("contrastive_transfer/cli.py", "os.replace"): "atomic_write's own rename of the temporary it created",
    ("pretrain/checkpoint.py", "os.link"): (
        "keep_previous: a second name for checkpoint_last.pth in the run's folder; making a link never follows "
        "the new name (EEXIST), and follow_symlinks=False keeps a linked source a link"
    ),
    ("pretrain/checkpoint.py", "os.replace"): "keep_previous: renames that name over checkpoint_prev.pth (a rename "
    "replaces a link there, never follows it)",
    ("pretrain/data.py", "scan_index(root).save"): "FileIndex.save writes through atomic_write",
    ("benchmarks/file_index.py", "index.save"): "FileIndex.save writes through atomic_write",
    ("benchmarks/knn_scale.py", "Path('/proc/self/clear_refs').write_text"): (
        "resets the kernel's peak-memory counter of this process (a /proc control file): no file is written"
    ),
    ("benchmarks/jpeg_folder.py", "shutil.move"): (
        "moves the JPEGs write_images made in its own temporary folder into the new folder it created (it "
        "refuses one that exists): nothing there to follow"
    ),
    ("benchmarks/jpeg_folder.py", "os.link"): "hard links, in the new folder it created, to the files it moved there",
    ("tools/install_detectron2_pypi.py", "pth.write_text"): (
        "make setup's installer writes a .pth into the virtual environment's own site-packages: no output "
        "folder, nothing from elsewhere"
    ),
    ("transfer/detection/trainer.py", "trainer.checkpointer.save"): (
        "BackboneCheckingCheckpointer.save: model_*.pth and last_checkpoint through atomic_write"
    ),
}


def test_every_write_in_the_project_goes_through_the_writer():
    assert scan_project("write", WRITE_ALLOWED) == []


# Each kind of raw write the scan must find, and the writer's own forms it must let pass.
RAW_WRITES = [
    "open(path, 'w')",
    "open(path, mode='ab')",
    "open(path, 'x')",
    "open(path, 'r+')",
    "open(path, mode)",  # a mode the scan cannot read counts as a write
    "Path(path).open('w')",
    "Path(path).write_text('x')",
    "path.write_bytes(b'x')",
    "torch.save(obj, path)",
    "np.save(path, a)",
    "np.savez(path, a=a)",
    "plt.savefig(path)",
    "fig.savefig(str(path))",
    "json.dump(obj, open(path, 'w'))",
    "save_file(tensors, path)",
    "Image.fromarray(a).save(path)",
    "os.open(path, os.O_WRONLY | os.O_CREAT)",
    "shutil.copy(src, path)",
    "os.rename(src, path)",
    "Path(src).replace(path)",
    "src.rename(path)",
    "Path(path).touch()",
    "path.chmod(0o600)",
]
THE_WRITERS_FORMS = [
    "atomic_write(path, lambda f: torch.save(obj, f))",
    "atomic_write(path, lambda f: np.savez(f, **arrays))",
    "atomic_write(path, lambda f: fig.savefig(f, format='png'))",
    "write_text(path, 'x')",
    "write_json(path, obj)",
    "f = open_append(path)",
    "os.open(path, os.O_RDWR | os.O_NOFOLLOW)",
    "data = save(tensors)",  # safetensors' bytes
    "name = str(path).replace('.pth', '.pkl')",  # a string's replace
]


@pytest.mark.parametrize("line", RAW_WRITES)
def test_the_scan_finds_each_kind_of_raw_write(line):
    found = raw_io(f"def f(path, src, obj, a, tensors, mode):\n    {line}\n")
    assert [kind for _, kind, _ in found] == ["write"] * len(found) and found, (line, found)


@pytest.mark.parametrize("line", THE_WRITERS_FORMS)
def test_the_scan_passes_the_writers_own_forms(line):
    assert raw_io(f"def f(path, obj, arrays, fig, tensors):\n    {line}\n") == []


def _copy_of_the_packages(root: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("*.pyc", "*.png", "*.jsonl"))


def test_control_a_raw_write_planted_in_a_copy_of_the_packages_fails_the_scan(tmp_path):
    _copy_of_the_packages(tmp_path)
    assert scan_project("write", WRITE_ALLOWED, tmp_path) == []  # the copy as it is: clean
    with open(tmp_path / "pretrain" / "checkpoint.py", "a") as f:
        f.write("\n\ndef planted(obj, path):\n    torch.save(obj, path)\n")
    with open(tmp_path / "transfer" / "knn.py", "a") as f:
        f.write("\n\ndef planted(path):\n    Path(path).write_text('x')\n")
    found = scan_project("write", WRITE_ALLOWED, tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == ["torch.save", "Path(path).write_text"], found
    assert found[0].startswith("pretrain/checkpoint.py:") and found[1].startswith("transfer/knn.py:")
    # an allowlist entry that excuses nothing is reported too: it may not outlive its exception
    stale = {**WRITE_ALLOWED, ("transfer/knn.py", "open"): "no longer there"}
    assert "allowlist entry ('transfer/knn.py', 'open') matches nothing" in scan_project("write", stale, tmp_path)


# ------------------------------------------------------------------ links at every path a command writes


def _tree(root: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every entry under ``root``: a link's target, a file's bytes (the folder's own lock aside)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_file():
                found[rel] = ("file", path.read_bytes())
    return found


def _written(run, out: Path) -> list[str]:
    """The files ``run(out)`` writes into a fresh ``out``, the lock aside (its own test plants it)."""
    run(out)
    # TensorBoard's event files (accelerate's tracker) are named by time, host and pid: a later run
    # writes another name, so a link at this one's is never reached
    return sorted(
        rel for rel, (kind, _) in _tree(out).items() if kind == "file" and rel != ".lock" and "tfevents" not in rel
    )


def _one_line_or_success(run, out: Path) -> str:
    try:
        run(out)
    except SystemExit as e:
        if e.code in (0, None):
            return "ran"
        message = str(e.code)
        assert "\n" not in message, message
        return message
    except Exception as e:  # an expected failure raised by the in-process entry point (UserError)
        from contrastive_transfer.cli import UserError

        assert isinstance(e, UserError), repr(e)
        assert "\n" not in str(e), str(e)
        return str(e)
    return "ran"


def _command(name, synthetic_root, weights, request):
    from benchmarks import knn_scale
    from benchmarks import shards as bench_shards
    from contrastive_transfer.synthetic.generate import main as synthetic
    from converters import legacy_to_safe, to_detectron2, to_torchvision
    from pretrain.analysis.__main__ import main as analysis
    from transfer import knn, linear, shards, voc07_svm

    from .transfer.test_features_probes import probe_args

    imagenet = synthetic_root / "imagenet"
    commands = {
        "to_torchvision": lambda out: to_torchvision.main([str(weights), str(out / "w.safetensors")]) or None,
        "to_detectron2": lambda out: to_detectron2.main([str(weights), str(out / "w.pkl")]) or None,
        "knn": lambda out: knn.main(
            ["--weights", str(weights), "--train-dir", str(imagenet / "train"), "--val-dir", str(imagenet / "val")]
            + ["--workers", "0", "--k", "5", "--crop", "32", "--resize", "36", "--output-dir", str(out)]
        ),
        "linear": lambda out: linear.main(
            probe_args(weights, synthetic_root, out, "--epochs", "1", "--resize", "72", "--crop", "64")
        ),
        "pretrain": lambda out: _pretrain(synthetic_root, out),
        "legacy_to_safe": lambda out: legacy_to_safe.main([str(weights), str(out / "safe.pth"), "--i-trust-this-file"]),
        "curves": _curves,
        "voc07_svm": lambda out: voc07_svm.main(
            ["--weights", str(weights), "--voc-root", str(synthetic_root / "VOC2007"), "--output-dir", str(out)]
            + ["--resize", "18", "--crop", "16", "--workers", "0", "--batch-size", "16", "--costs", "0.1,1"]
        ),
        "npc": lambda out: analysis(
            ["npc", str(request.getfixturevalue("tiny_moco") / "checkpoint_final.pth"), "--out", str(out)]
            + ["--data", str(imagenet / "train"), "--batch-sizes", "4", "--max-images", "8"]
        ),
        "negatives": lambda out: analysis(
            ["negatives", str(request.getfixturevalue("tiny_moco")), "--queries", "8", "--out", str(out)]
            + ["--data", str(imagenet / "train")]
        ),
        "benchmarks.learning": lambda out: _learning_plan(out, request),
        "shards": lambda out: shards.main([str(imagenet / "train"), str(out), "--shard-size", "40"]),
        "synthetic": lambda out: synthetic(["--out", str(out), "--preset", "tiny", "--workers", "1", "--force"]),
        "benchmarks.knn_scale": lambda out: knn_scale.main(
            ["--banks", "300", "--queries", "20", "--dim", "16", "--check", "3", "--device", "cpu"]
            + ["--out", str(out / "knn_scale.md")]
        ),
        "benchmarks.shards": lambda out: bench_shards.main(
            ["--images", "12", "--side", "16", "--shard-size", "5", "--out", str(out / "shards.md")]
        ),
        "detection": lambda out: _detection(synthetic_root, weights, out),
        "demo": lambda out: _demo(synthetic_root, out),
    }
    return commands[name]


def _learning_plan(out: Path, request) -> None:
    """``benchmarks.learning --plan``: its table and chart from a runs file of one row (the
    configs' hashes, half a second each with load_config, replaced by the row's)."""
    from benchmarks import learning

    from .test_bench_learning import _row

    runs = request.getfixturevalue("tmp_path_factory").mktemp("runs") / "runs.jsonl"
    learning.append_run(runs, {**_row("tiny_simclr", 70.0), "preset": "digits"})
    request.getfixturevalue("monkeypatch").setattr(learning, "config_hash", lambda *a, **k: "abc")
    learning.main(["--preset", "digits", "--plan", "--seeds", "1", "--runs", str(runs), "--out", str(out / "t.md")]
                  + ["--work", str(out.parent / "work")])  # fmt: skip


def _detection(synthetic_root: Path, weights: Path, out: Path) -> None:
    """Two iterations of the tiny VOC detection config, then its evaluation (on VOC07 val, half the
    test split: the run's writes are the same)."""
    pytest.importorskip("detectron2")
    from converters.to_detectron2 import convert
    from transfer.detection.__main__ import main

    pkl = weights.with_suffix(".pkl")
    if not pkl.exists():
        convert(weights, pkl)
    main(
        ["--config-file", str(REPO / "configs" / "detection" / "tiny_voc0712_R_18_FPN_syncbn.yaml")]
        + ["--data-root", str(synthetic_root), "MODEL.WEIGHTS", str(pkl), "OUTPUT_DIR", str(out)]
        + ["SOLVER.MAX_ITER", "2", "SOLVER.STEPS", "(1,)", "TEST.PRECISE_BN.ENABLED", "False"]
        + ["DATASETS.TEST", "('voc_2007_val',)"]
    )


def _demo(synthetic_root: Path, out: Path) -> None:
    """``tools/demo.py`` at the tiny preset; its exit status and last line of error as a command's."""
    from .test_demo import _demo_module

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = _demo_module().main(["--data", str(synthetic_root), "--preset", "tiny", "--out", str(out)])
    if code:
        raise SystemExit(err.getvalue().strip().splitlines()[-1])


def _curves(out: Path) -> None:
    """``pretrain.analysis curves`` over a run folder's log (the input, written here unless a link
    is planted in its place)."""
    from pretrain.analysis.__main__ import main

    out.mkdir(parents=True, exist_ok=True)
    log = out / "metrics.jsonl"
    if not os.path.lexists(log):
        rows = [{"step": s, "epoch": s / 2, "lr": 0.1, "loss": 3.0 - s / 10} for s in range(1, 5)]
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["curves", str(out)])


def _pretrain(synthetic_root: Path, out: Path) -> None:
    from pretrain.__main__ import main

    main(
        ["--config", str(REPO / "configs" / "pretrain" / "tiny_simclr.yaml")]
        + [f"data.root={synthetic_root / 'imagenet' / 'train'}", f"train.output_dir={out}", "train.max_steps=2"]
        + ["knn.train_dir=null", "train.resume=none", NARROW]
    )


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    import torchvision

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "resnet18.pth"
    torch.save({k: v for k, v in torchvision.models.resnet18().state_dict().items() if "fc." not in k}, path)
    return path


@pytest.mark.parametrize(
    "name",
    ["to_torchvision", "to_detectron2", "legacy_to_safe", "knn", "linear", "curves", "voc07_svm", "npc"]
    + ["negatives", "benchmarks.learning", "shards", "synthetic", "benchmarks.knn_scale", "benchmarks.shards"]
    + [pytest.param("pretrain", marks=pytest.mark.slow)]  # four tiny runs
    + [pytest.param("detection", marks=pytest.mark.slow)]
    + [pytest.param("demo", marks=pytest.mark.sweep)],  # every stage again for each link it stops at
)
def test_a_link_at_every_path_a_command_writes_changes_nothing_outside(
    name, synthetic_root, weights, tmp_path, request
):
    """The command is run once into a fresh folder to learn what it writes; then, that folder moved
    aside, the same path gets a link at each of those paths, to a file of its own outside, and the
    command runs there.
    Where it stops with one line naming a planted link (a finished output it will not replace, a
    log it will not adopt), that link is taken away and it runs again, until it runs through: then
    every link it wrote is its own file. At every step the files outside stay as they were. The
    control: a plain write through one of the links changes its file."""
    run = _command(name, synthetic_root, weights, request)
    # Every run in the same folder, moved aside after it: what a command writes may depend on the
    # folder's path (a pretraining checkpoint records its output folder), so a link planted at
    # another folder's paths might never be reached.
    out = tmp_path / "run"
    paths = _written(run, out)
    assert paths, name
    out.rename(tmp_path / "first")
    outside = tmp_path / "outside"
    planted = list(paths)
    stops = []
    for attempt in range(len(paths) + 1):
        for i, rel in enumerate(planted):
            (outside / rel).parent.mkdir(parents=True, exist_ok=True)
            (outside / rel).write_text(f"outside {i}")
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).symlink_to(outside / rel)
        before = _tree(outside)
        outcome = _one_line_or_success(run, out)
        assert _tree(outside) == before, (name, outcome)
        if outcome == "ran":
            break
        named = [rel for rel in planted if str(out / rel) in outcome]
        assert named, f"{name} stopped without naming a planted link: {outcome}"
        stops.append(outcome)
        planted = [rel for rel in planted if rel not in named]
        out.rename(tmp_path / f"planted{attempt}")  # kept for reading; the next attempt starts afresh
    assert outcome == "ran", (name, stops)
    assert [rel for rel in planted if (out / rel).is_symlink()] == [], name  # each replaced by its file
    control = out / "control" / paths[0]
    control.parent.mkdir(parents=True, exist_ok=True)
    control.symlink_to(outside / paths[0])
    control.write_text("control")  # a plain write follows the link
    assert (outside / paths[0]).read_text() == "control"
