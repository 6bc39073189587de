"""The evaluators' command lines: --help without torch, the image size read from the checkpoint
(--crop auto and the mismatch warning), the linear probe's divergence stop, outputs checked before
any work, progress lines in logs, and third-party warnings summarised once."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torchvision

import transfer.features as features
from contrastive_transfer.cli import UserError
from contrastive_transfer.progress import progress
from transfer import eval_cli, knn, linear, voc07_svm

REPO = Path(__file__).resolve().parents[2]
EVALUATORS = {"transfer.knn": "--k", "transfer.voc07_svm": "--costs", "transfer.linear": "--workers"}


@pytest.mark.parametrize("module", sorted(EVALUATORS))
def test_help_shows_defaults_without_importing_torch_or_sklearn(module):
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['{module}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('{module}', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'torchvision', 'sklearn') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out[-300:]
    option = EVALUATORS[module]
    line = " ".join(out.split(option, 2)[-1].split())  # the option's help entry, wrapped lines joined
    assert "(default:" in line.split(" --")[0], f"{option}: no default shown in {line[:200]!r}"


# ------------------------------------------------------------------------------------- image size


def test_resolve_size_hand_computed(caplog):
    caplog.set_level(logging.INFO)
    assert eval_cli.resolve_size(None, "auto", 64) == (73, 64)  # 64 · 256/224 = 73.1
    assert eval_cli.resolve_size(None, "auto", 224) == (256, 224)
    assert eval_cli.resolve_size(80, "auto", 64) == (80, 64)  # an explicit resize is kept
    assert eval_cli.resolve_size(None, 224, 160) == (256, 224)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # 160 vs 224 is within 2x
    assert eval_cli.resolve_size(None, 224, 64) == (256, 224)  # protocol defaults stay...
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "pretrained at 64 px" in warned[0] and "--crop auto" in warned[0]
    assert "--resize 73 --crop 64" in warned[0]
    caplog.clear()
    assert eval_cli.resolve_size(None, "auto", None) == (256, 224)  # not recorded: the protocol's size
    assert "does not record" in caplog.records[0].getMessage()
    with pytest.raises(UserError, match="--crop 300 is larger than --resize 256"):
        eval_cli.resolve_size(None, 300, None)


@pytest.fixture(scope="module")
def project_checkpoint(tmp_path_factory):
    """A checkpoint_final.pth as `pretrain` writes it, of a random ResNet-18 pretrained at 32 px."""
    torch.manual_seed(0)
    state = {k: v for k, v in torchvision.models.resnet18().state_dict().items() if not k.startswith("fc.")}
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint_final.pth"
    torch.save(
        {
            "backbone": state,
            "arch": "resnet18",
            "stem": "imagenet",
            "method": "simclr",
            "step": 1,
            "config": {"data": {"image_size": 32}},
        },
        path,
    )
    return path


def test_knn_crop_auto_evaluates_at_the_pretraining_size(synthetic_root, project_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    args = [
        "--weights",
        str(project_checkpoint),
        "--train-dir",
        str(synthetic_root / "imagenet" / "train"),
        "--val-dir",
        str(synthetic_root / "imagenet" / "val"),
        "--workers",
        "0",
        "--k",
        "5",
    ]
    knn.main(args + ["--crop", "auto", "--output-dir", str(tmp_path / "auto")])
    metrics = json.loads((tmp_path / "auto" / "metrics.json").read_text())
    assert (metrics["preprocessing"]["resize"], metrics["preprocessing"]["crop"]) == (37, 32)  # 32 · 256/224
    assert metrics["backbone"]["pretraining_image_size"] == 32
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The protocol default is kept for a --crop given explicitly, with one line saying what to pass.
    caplog.clear()
    knn.main(args + ["--crop", "96", "--resize", "110", "--output-dir", str(tmp_path / "explicit")])
    metrics = json.loads((tmp_path / "explicit" / "metrics.json").read_text())
    assert metrics["preprocessing"]["crop"] == 96
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "--crop auto" in warned[0]


# ------------------------------------------------------------------------------------ linear probe


def test_linear_probe_stops_on_divergence_naming_the_lr_flag(synthetic_root, project_checkpoint, tmp_path):
    out = tmp_path / "probe"
    with pytest.raises(SystemExit) as stop:
        linear.main(
            [
                "--weights",
                str(project_checkpoint),
                "--dataset",
                "imagenet",
                "--data-root",
                str(synthetic_root / "imagenet"),
                "--preset",
                "moco",
                "--epochs",
                "2",
                "--batch-size",
                "16",
                "--lr",
                "1e9",
                "--crop",
                "auto",
                "--workers",
                "0",
                "--output-dir",
                str(out),
            ]
        )
    message = str(stop.value)
    assert message.startswith("error: the linear probe diverged") and "--lr" in message and "\n" not in message
    assert not (out / "metrics.json").exists()


def test_divergence_rule_hand_cases():
    from transfer.linear_probe import check_divergence

    assert check_divergence(2.3, None, 30.0) == 2.3  # the first loss becomes the reference
    assert check_divergence(200.0, 2.3, 30.0) == 2.3  # 87x: still allowed
    with pytest.raises(UserError, match="--lr 3"):
        check_divergence(231.0, 2.3, 30.0)  # > 100x
    with pytest.raises(UserError, match="loss nan"):
        check_divergence(float("nan"), 2.3, 30.0)


# ------------------------------------------------------------------------- outputs before the work


@pytest.mark.parametrize("evaluator", ["knn", "voc07_svm", "linear"])
def test_unwritable_output_fails_before_any_feature_is_extracted(
    evaluator, synthetic_root, project_checkpoint, tmp_path, monkeypatch
):
    extracted = []
    monkeypatch.setattr(features, "extract", lambda *a, **k: extracted.append(1) or {})
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = str(blocker / "out")
    module, argv = _evaluator(evaluator, synthetic_root, project_checkpoint, out)
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    assert str(stop.value).startswith("error: --output-dir") and out in str(stop.value)
    assert "\n" not in str(stop.value) and not extracted


@pytest.mark.parametrize("evaluator", ["knn", "voc07_svm", "linear"])
def test_accelerates_cpu_launcher_running_one_of_n_processes_is_stopped(
    evaluator, synthetic_root, project_checkpoint, tmp_path, monkeypatch
):
    """What ``accelerate launch --cpu --num_processes 2 -m transfer.X`` leaves in the one process it
    starts (seen from the real launcher): the rendezvous address without WORLD_SIZE. The control: a
    real N-process launch (WORLD_SIZE) is not stopped by the check."""
    from contrastive_transfer.ranks import check_launch

    extracted = []
    monkeypatch.setattr(features, "extract", lambda *a, **k: extracted.append(1) or {})
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    module, argv = _evaluator(evaluator, synthetic_root, project_checkpoint, str(tmp_path / "out"))
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    line = str(stop.value)
    assert "starts ONE process" in line and f"torchrun --nproc_per_node N -m transfer.{evaluator} " in line
    assert "\n" not in line and not extracted and not (tmp_path / "out").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launch(f"transfer.{evaluator}")


def _evaluator(evaluator: str, synthetic_root: Path, checkpoint: Path, out: str):
    """The evaluator's module and a command line for it on the synthetic data."""
    common = ["--weights", str(checkpoint), "--workers", "0", "--output-dir", out]
    argv = {
        "knn": [
            "--train-dir",
            str(synthetic_root / "imagenet" / "train"),
            "--val-dir",
            str(synthetic_root / "imagenet" / "val"),
        ],
        "voc07_svm": ["--voc-root", str(synthetic_root / "VOC2007")],
        "linear": ["--dataset", "imagenet", "--data-root", str(synthetic_root / "imagenet"), "--preset", "moco"],
    }
    return {"knn": knn, "voc07_svm": voc07_svm, "linear": linear}[evaluator], common + argv[evaluator]


# ------------------------------------------------------------------------- progress and warnings


def test_progress_prints_lines_when_not_a_terminal(capsys):
    assert list(progress(range(3), 3, "features", every=0.0)) == [0, 1, 2]
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" [")[0] for line in lines] == [f"features: {i}/3" for i in (1, 2, 3)]


def test_repeated_warnings_are_summarised_once(caplog):
    with eval_cli.summarised_warnings("svm") as caught:
        for n in (1, 2, 3):
            warnings.warn(f"The least populated class in y has only {n} members", UserWarning, stacklevel=1)
        caught.add([("UserWarning", "The least populated class in y has only 4 members")])
        warnings.warn("something else", RuntimeWarning, stacklevel=1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("svm: UserWarning: The least populated class in y has only")
    assert lines[0].endswith("(and 3 more like it)")
    assert lines[1] == "svm: RuntimeWarning: something else"


def test_voc07_svm_on_the_tiny_voc_prints_each_warning_once(
    synthetic_root, project_checkpoint, tmp_path, capfd, caplog
):
    caplog.set_level(logging.INFO)
    voc07_svm.main(
        [
            "--weights",
            str(project_checkpoint),
            "--voc-root",
            str(synthetic_root / "VOC2007"),
            "--output-dir",
            str(tmp_path),
            "--crop",
            "auto",
            "--workers",
            "2",
            "--jobs",
            "2",
            "--costs",
            "0.1,1,10",
        ]
    )
    captured = capfd.readouterr()
    assert "Warning" not in captured.err  # nothing reached stderr unsummarised, workers included
    summaries = [r.getMessage() for r in caplog.records if "Warning:" in r.getMessage()]
    assert len(summaries) == len({s.split(" (and")[0].split(" only")[0] for s in summaries})
    assert json.loads((tmp_path / "metrics.json").read_text())["layers"]["res5avg"]["mAP"] > 0


# ------------------------------------------------------------------------- the model's device


def test_probe_and_batches_follow_the_models_device_and_dtype():
    """Every tensor fed to the model is created where the model lives: a float64 model gets float64
    inputs, and a model on the meta device (no data anywhere) can still be described. A probe made
    with a bare torch.zeros(...) on the CPU fails both."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18().double().eval()
    extractor = features.LayerFeatures(model, ["res5avg", "res4"])
    described = extractor.describe(64)
    assert described["res5avg"]["dim"] == 512 and described["res4"]["dim"] == 256 * 9
    images = [(torch.rand(3, 64, 64), 0) for _ in range(3)]  # float32, as the transforms produce
    feats = features.extract(extractor, images, batch_size=2, device=torch.device("cpu"))
    expected = model.avgpool(extractor.body(torch.stack([x for x, _ in images]).double())["layer4"]).flatten(1)
    torch.testing.assert_close(torch.as_tensor(feats["res5avg"]).double(), expected.float().double())
    with torch.device("meta"):
        meta = torchvision.models.resnet18()
    assert features.LayerFeatures(meta, ["res5"]).describe(96)["res5"]["map"] == [512, 3, 3]
