"""Detection fine-tuning preempted: a SIGUSR1 (sent by another process, as a cluster does) during an
iteration ends the run after it, with detectron2's checkpoint of that iteration tagged as the last
one and exit code 75; `--resume` continues at the next iteration and finishes the run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torchvision

pytest.importorskip("detectron2")
from detectron2.engine import SimpleTrainer  # noqa: E402

from converters.to_detectron2 import convert  # noqa: E402
from transfer.detection.__main__ import main  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "detection" / "tiny_voc0712_R_18_FPN_syncbn.yaml"
MAX_ITER, SIGNALLED = 6, 2  # the signal arrives in the third iteration (0-based 2)


def argv(root: Path, out: Path, weights: Path, *flags: str) -> list[str]:
    return [
        *("--config-file", str(CONFIG), "--data-root", str(root), *flags),
        *("MODEL.WEIGHTS", str(weights), "OUTPUT_DIR", str(out)),
        *("SOLVER.MAX_ITER", str(MAX_ITER), "SOLVER.STEPS", "(5,)", "TEST.PRECISE_BN.ENABLED", "False"),
    ]


def test_a_signal_saves_the_iteration_reached_and_resume_finishes(synthetic_root, tmp_path, monkeypatch):
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet18.pth")
    convert(tmp_path / "resnet18.pth", tmp_path / "resnet18.pkl")
    weights, out = tmp_path / "resnet18.pkl", tmp_path / "out"
    real_step = SimpleTrainer.run_step

    def run_step(self):
        if self.iter == SIGNALLED:
            subprocess.run(["kill", "-s", "USR1", str(os.getpid())], check=True)
        return real_step(self)

    monkeypatch.setattr(SimpleTrainer, "run_step", run_step)
    with pytest.raises(SystemExit) as stop:
        main(argv(synthetic_root, out, weights))
    assert stop.value.code == 75
    name = f"model_{SIGNALLED:07d}.pth"
    assert (out / "last_checkpoint").read_text().strip() == name
    assert torch.load(out / name, weights_only=False)["iteration"] == SIGNALLED
    assert not (out / "metrics.json").exists() and not (out / "model_final.pth").exists()
    monkeypatch.undo()
    metrics = main(argv(synthetic_root, out, weights, "--resume"))
    assert metrics["iterations"] == MAX_ITER and (out / "model_final.pth").is_file()
    log = (out / "log.txt").read_text()
    assert f"preempted (SIGUSR1): saved {name} at iteration {SIGNALLED + 1} of {MAX_ITER}" in log
    assert f"Starting training from iteration {SIGNALLED + 1}" in log
    rows = [json.loads(line) for line in (out / "training_metrics.json").read_text().splitlines()]
    # detectron2's writer logs at the end of each run: the preempted one's last iteration, the resumed one's
    assert [row["iteration"] for row in rows if "total_loss" in row] == [SIGNALLED, MAX_ITER - 1]
