"""The engine's guards and optional paths end to end on CPU: unreadable images stop the run and
name the files, resumes that do not fit the run fail clearly, bf16 autocast trains with fp32
logits, and the kNN monitor logs what an independent weighted-kNN loop computes."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from contrastive_transfer.cli import UserError
from contrastive_transfer.paths import printable
from pretrain.config import load_config
from pretrain.engine import train
from pretrain.knn import extract_features

from ..method_cases import NARROW

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "pretrain"


def _cfg(recipe: str, root: Path, out: Path, *overrides: str):
    return load_config(RECIPES / f"{recipe}.yaml", [f"data.root={root}", f"train.output_dir={out}", NARROW, *overrides])


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


@pytest.fixture()
def small_copy(synthetic_root, tmp_path) -> Path:
    """Two classes of the tiny train split, 12 images each, copied so that a test may corrupt them."""
    train_root = synthetic_root / "imagenet" / "train"
    for cls in sorted(p.name for p in train_root.iterdir())[:2]:
        (tmp_path / "data" / cls).mkdir(parents=True)
        for f in sorted((train_root / cls).iterdir())[:12]:
            shutil.copy(f, tmp_path / "data" / cls / f.name)
    return tmp_path / "data"


def test_unreadable_images_above_the_limit_stop_the_run_naming_them(accelerator, small_copy, tmp_path):
    files = sorted(small_copy.rglob("*.JPEG"))
    for f in files[:3]:
        f.write_bytes(b"not an image" * 10)
    # A name that is not UTF-8 and a FIFO among the images: the FIFO is refused by the gate (not
    # waited on), the name is listed escaped (writing it raised UnicodeEncodeError after the final
    # checkpoint before issue 38).
    files[1].unlink()
    os.mkfifo(files[1])
    odd = files[2].parent / os.fsdecode(files[2].stem.encode() + b"\xff.JPEG")
    files[2].rename(odd)
    out = tmp_path / "run"
    cfg = _cfg("tiny_simclr", small_copy, out, "train.batch_size=8", "train.epochs=1", "data.max_bad_fraction=0.01")
    with pytest.raises(UserError, match="unreadable images") as e:
        train(cfg, accelerator)
    assert any(printable(f.name) in str(e.value) for f in (files[0], files[1], odd)), str(e.value)
    assert not (out / "checkpoint_final.pth").exists()
    # Under the limit the same data trains to the end and reports the count.
    cfg = _cfg(
        "tiny_simclr",
        small_copy,
        tmp_path / "loose",
        "train.batch_size=8",
        "train.epochs=1",
        "data.max_bad_fraction=0.5",
    )
    assert train(cfg, accelerator).is_file()
    listed = (tmp_path / "loose" / "unreadable_images.txt").read_text().splitlines()
    expected = [str(files[0]), str(files[1]), f"{files[2].parent / files[2].stem}\\xff.JPEG"]
    assert sorted(listed) == sorted(expected)  # skip mode names every skipped file


def test_resume_that_does_not_fit_the_run_fails_clearly(accelerator, synthetic_root, tmp_path):
    root, out = synthetic_root / "imagenet" / "train", tmp_path / "run"
    train(_cfg("tiny_simclr", root, out, "train.max_steps=1"), accelerator)
    with pytest.raises(UserError, match=r"written with optim\.name=lars, this run has optim\.name=sgd"):
        train(_cfg("tiny_simclr", root, out, "train.max_steps=2", "optim.name=sgd"), accelerator)
    with pytest.raises(UserError, match=r"written with method\.dim=128, this run has method\.dim=64"):
        train(_cfg("tiny_simclr", root, out, "train.max_steps=2", "method.dim=64"), accelerator)
    with pytest.raises(UserError, match="is not a training checkpoint"):
        train(
            _cfg(
                "tiny_simclr",
                root,
                tmp_path / "other",
                "train.max_steps=2",
                f"train.resume={out / 'checkpoint_final.pth'}",
            ),
            accelerator,
        )
    # A fitting resume still continues.
    train(_cfg("tiny_simclr", root, out, "train.max_steps=2"), accelerator)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != ".lock"}


def test_a_finished_run_is_never_replaced_by_a_run_that_does_not_continue_it(accelerator, synthetic_root, tmp_path):
    """A folder holding a finished run's checkpoint_final.pth: a run that would not continue that
    run's own state (``train.resume=none``, ``auto`` with no checkpoint_last.pth or
    checkpoint_prev.pth left, a state from elsewhere) is one line naming the file, and nothing in
    the folder changes. Before, each started afresh and replaced the final checkpoint. The control:
    the same command over the folder without its final checkpoint trains and writes one."""
    from contrastive_transfer.contract import FINAL_NAME, LAST_NAME, PREV_NAME

    root, out = synthetic_root / "imagenet" / "train", tmp_path / "run"
    train(_cfg("tiny_simclr", root, out, "train.max_steps=1"), accelerator)
    shutil.copy(out / LAST_NAME, tmp_path / "elsewhere.pth")
    cases = [("train.resume=none",), (f"train.resume={tmp_path / 'elsewhere.pth'}",), ()]
    for overrides in cases:
        if not overrides:  # auto, once the folder's own training states are gone
            for name in (LAST_NAME, PREV_NAME):
                (out / name).unlink(missing_ok=True)
        before = _files(out)
        with pytest.raises(UserError) as e:
            train(_cfg("tiny_simclr", root, out, "train.max_steps=2", *overrides), accelerator)
        line = str(e.value)
        assert "\n" not in line and f"{out / FINAL_NAME} is a finished run's output" in line, line
        assert _files(out) == before, overrides
    (out / FINAL_NAME).rename(tmp_path / "kept.pth")
    assert train(_cfg("tiny_simclr", root, out, "train.max_steps=2"), accelerator).is_file()


BF16_RUN = """
import json, sys, torch
import pretrain.losses.infonce as infonce
from pretrain.__main__ import main
seen, original = [], infonce.info_nce
def spy(pos, neg, *args, **kwargs):
    seen.append([str(pos.dtype), str(neg.dtype), torch.is_autocast_enabled("cpu")])
    return original(pos, neg, *args, **kwargs)
infonce.info_nce = spy  # what InfoNCELoss, the hosts' criterion, calls
main(sys.argv[1:])
print("SEEN=" + json.dumps(seen))
"""


def test_bf16_autocast_trains_with_fp32_logits(synthetic_root, tmp_path):
    # A process of its own: Accelerate keeps one process-wide state, fixed at the first Accelerator.
    out = tmp_path / "bf16"
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            BF16_RUN,
            "--config",
            str(RECIPES / "tiny_mocov2.yaml"),
            f"data.root={synthetic_root / 'imagenet' / 'train'}",
            f"train.output_dir={out}",
            "train.max_steps=2",
            "train.mixed_precision=bf16",
            # Small, because without bf16 units a CPU computes a bf16 convolution's backward on its
            # slow path (7 s a step at 16 px, 16 s at the recipe's 64 px). Not 16 px: there layer4
            # sees 1x1 maps, where oneDNN's AVX-512 kernels sometimes return NaN in the weight
            # gradient of a padded 3x3 conv (taps that see only padding; 6 runs of 15 on a Zen 4,
            # none at 32 px in 20), and the engine rightly stops (docs/pretraining.md)
            *("data.image_size=32", "train.batch_size=8", "method.queue_size=64", "method.bn_splits=2", NARROW),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.rsplit("SEEN=", 1)[1])
    assert seen and all(p == n == "torch.float32" for p, n, _ in seen), seen
    assert all(autocast for _, _, autocast in seen), "the forward did not run under bf16 autocast"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "loss" in r]) == 2 and all(math.isfinite(r["loss"]) for r in rows if "loss" in r)


def test_knn_monitor_logs_the_weighted_knn_of_the_backbone(accelerator, synthetic_root, tmp_path, monkeypatch):
    """The monitor's figure at the last epoch is the weighted kNN of the exported backbone (a
    per-query loop as the reference); its folders are scanned at the first monitor only."""
    import pretrain.knn

    train_dir, val_dir = synthetic_root / "imagenet" / "train", synthetic_root / "imagenet" / "val"
    out = tmp_path / "knn"
    k, t = 5, 0.1
    cfg = _cfg(
        "tiny_mocov2",
        train_dir,
        out,
        "train.epochs=2",
        # Nothing needs to be learnt: the smallest side, and batches of 64 (6 steps an epoch, not 25)
        "data.image_size=16",
        "train.batch_size=64",
        "knn.every_epochs=1",
        f"knn.train_dir={train_dir}",
        f"knn.val_dir={val_dir}",
        f"knn.k={k}",
        f"knn.temperature={t}",
    )
    scanned = []
    real_scan = pretrain.knn.scan_index
    monkeypatch.setattr(pretrain.knn, "scan_index", lambda root: scanned.append(str(root)) or real_scan(root))
    final = torch.load(train(cfg, accelerator), weights_only=False)
    monkeypatch.undo()
    logged = [
        json.loads(line)["knn_top1"] for line in (out / "metrics.jsonl").read_text().splitlines() if "knn_top1" in line
    ]
    assert len(logged) == 2 and scanned == [str(train_dir), str(val_dir)]  # two monitors, one scan each

    # Reference: the exported backbone, and a per-query loop of weighted voting.
    from pretrain.models import build_backbone

    backbone, _ = build_backbone(cfg.model.arch, cfg.model.stem)
    backbone.load_state_dict(final["backbone"])
    bank, bank_labels, _ = extract_features(backbone, str(train_dir), cfg.data.image_size, torch.device("cpu"))
    query, labels, classes = extract_features(backbone, str(val_dir), cfg.data.image_size, torch.device("cpu"))
    correct = 0
    for q, y in zip(query, labels):
        sims = torch.stack([torch.dot(q, b) for b in bank])
        top = sims.argsort(descending=True)[:k]
        votes = torch.zeros(len(classes))
        for j in top:
            votes[bank_labels[j]] += torch.exp(sims[j] / t)
        correct += int(votes.argmax() == y)
    # The monitor's percentage is an fp32 division (30.000001 for 12 of 40); one image is 100/len(labels) points.
    assert logged[-1] == pytest.approx(100.0 * correct / len(labels), abs=1e-4)
    assert torch.allclose(bank.norm(dim=1), torch.ones(len(bank)), atol=1e-5)


def test_resume_reads_its_metrics_log_through_the_gate_and_never_adopts_a_link(tmp_path):
    """``trim_metrics`` (a resume drops the rows past its step) reads metrics.jsonl through the gate
    and the JSON limits: a link there is refused in one line, not adopted (before, the linked
    file's rows became the run's log); a row that is not an object with an integer step is one line
    naming the line (before: AttributeError on a list); the rows past the step are dropped, the
    others kept byte for byte."""
    from pretrain.engine import trim_metrics

    log = tmp_path / "metrics.jsonl"
    rows = [b'{"step": 1, "loss": 2.5}\n', b"\n", b'{"step": 2, "loss": 2.0}\n', b'{"step": 3, "loss": 1.5}\n']
    log.write_bytes(b"".join(rows))
    trim_metrics(log, 2)
    assert log.read_bytes() == rows[0] + rows[2]
    for bad, what in ((b"[1, 2]\n", "[1, 2]"), (b'{"step": "2"}\n', '"2"'), (b'{"step": 1.5}\n', "1.5")):
        log.write_bytes(rows[0] + bad)
        with pytest.raises(UserError) as e:
            trim_metrics(log, 2)
        assert str(e.value).startswith(f"{log} line 2: {what}, expected a row of metrics"), str(e.value)
    log.write_bytes(rows[0] + b"[" * 100_000 + b"\n")
    with pytest.raises(UserError, match=r"line 2 nests 100000 levels"):
        trim_metrics(log, 2)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_bytes(rows[3])
    log.unlink()
    log.symlink_to(elsewhere)
    with pytest.raises(UserError, match=r"metrics\.jsonl is a symbolic link"):
        trim_metrics(log, 5)
    assert log.is_symlink() and elsewhere.read_bytes() == rows[3]
    assert log.read_text() == rows[3].decode()  # the control: a plain read takes the linked file's rows
