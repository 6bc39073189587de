"""Tiny FPN fine-tuning on the synthetic VOC, judged by detectron2's own PascalVOCDetectionEvaluator:
after training, AP50 on the synthetic test split clearly exceeds the AP50 of the same model before
training. The COCO config runs a few iterations through COCOEvaluator (pycocotools): the trainer is
the same, and its learning on the synthetic COCO is measured in benchmarks/tiny_recipes.md (200
iterations, about 170 s of CPU: as much as the rest of this module). Plus the multi-seed driver and
two CPU processes (gloo, NaiveSyncBatchNorm, DDP without device ids)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

pytest.importorskip("detectron2")
from converters.to_detectron2 import convert  # noqa: E402
from transfer.detection.__main__ import main  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs" / "detection"
# The tiny VOC config has BN in the new box-head layers, which is what makes a hundred iterations
# from a random backbone learn reliably (seed spreads: benchmarks/tiny_recipes.md).
VOC = "tiny_voc0712_R_18_FPN_syncbn.yaml"
COCO = "tiny_coco_R_18_FPN_4conv1fc_syncbn.yaml"
# The tests of the driver's mechanics (seeds, processes, resume) evaluate on VOC07 val, half the
# test split's 40 images: evaluation is most of a 4-iteration run.
ON_VAL = ("DATASETS.TEST", "('voc_2007_val',)")


@pytest.fixture(scope="module")
def resnet18_pkl(tmp_path_factory) -> Path:
    """A randomly initialized torchvision ResNet-18 (imagenet stem), converted for detectron2."""
    root = tmp_path_factory.mktemp("tiny_detection_weights")
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), root / "resnet18.pth")
    convert(root / "resnet18.pth", root / "resnet18.pkl")
    return root / "resnet18.pkl"


def _cli(config: str, data_root: Path, out: Path, weights: Path, *extra: str, overrides=()) -> list[str]:
    return [
        "--config-file",
        str(CONFIG_DIR / config),
        "--data-root",
        str(data_root),
        *extra,
        "MODEL.WEIGHTS",
        str(weights),
        "OUTPUT_DIR",
        str(out),
        *overrides,
    ]


@pytest.fixture(scope="module")
def voc_training(synthetic_root, resnet18_pkl, tmp_path_factory):
    """The tiny VOC training started as a `python -m transfer.detection` process (one thread), so
    that it runs beside this module's other tests; (process, output dir)."""
    out = tmp_path_factory.mktemp("tiny_detection_run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(out / "stdout.txt", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "transfer.detection", *_cli(VOC, synthetic_root, out, resnet18_pkl)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield process, out
    if process.poll() is None:
        process.kill()


def test_seeds_report_mean_and_std_and_resume_skips_finished_seeds(
    voc_training, synthetic_root, resnet18_pkl, tmp_path
):
    # requesting voc_training starts the background training first; this test runs beside it
    overrides = ["SOLVER.MAX_ITER", "4", "SOLVER.STEPS", "(3,)", "TEST.PRECISE_BN.ENABLED", "False", "SEED", "7"]

    def argv(*flags):
        return _cli(
            VOC, synthetic_root, tmp_path, resnet18_pkl, "--seeds", "2", *flags, overrides=[*overrides, *ON_VAL]
        )

    metrics = main(argv())
    per_seed = [json.loads((tmp_path / f"seed_{s}" / "metrics.json").read_text()) for s in (7, 8)]
    assert [r["seed"] for r in per_seed] == [7, 8] == metrics["seeds"]
    ap = [r["results"]["voc_2007_val"]["bbox"]["AP50"] for r in per_seed]
    assert metrics["mean"]["voc_2007_val"]["bbox"]["AP50"] == pytest.approx(sum(ap) / 2)
    assert metrics["std"]["voc_2007_val"]["bbox"]["AP50"] == pytest.approx(abs(ap[0] - ap[1]) / 2**0.5)
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    # --resume reuses finished seeds (their files are untouched) and re-aggregates
    stamps = [(tmp_path / f"seed_{s}" / "metrics.json").stat().st_mtime_ns for s in (7, 8)]
    assert main(argv("--resume"))["mean"] == metrics["mean"]
    assert [(tmp_path / f"seed_{s}" / "metrics.json").stat().st_mtime_ns for s in (7, 8)] == stamps


def test_two_cpu_processes_train_with_naive_sync_bn(voc_training, synthetic_root, resnet18_pkl, tmp_path):
    metrics = main(
        _cli(
            VOC,
            synthetic_root,
            tmp_path,
            resnet18_pkl,
            "--num-gpus",
            "2",
            "--dist-url",
            "auto",
            overrides=["SOLVER.MAX_ITER", "3", "SOLVER.STEPS", "(2,)", *ON_VAL],
        )
    )
    assert metrics["world_size"] == 2 and metrics["iterations"] == 3
    assert any("SyncBN -> naiveSyncBN" in n for n in metrics["notices"])
    assert "AP50" in metrics["results"]["voc_2007_val"]["bbox"]
    assert (tmp_path / "model_final.pth").is_file()


def test_tiny_fpn_fine_tuning_beats_the_untrained_model(voc_training, synthetic_root, resnet18_pkl, tmp_path):
    before = main(_cli(VOC, synthetic_root, tmp_path / "before", resnet18_pkl, "--eval-only"))
    process, out = voc_training
    assert process.wait(timeout=900) == 0, (out / "stdout.txt").read_text()[-3000:]
    after = json.loads((out / "metrics.json").read_text())

    ap50_before = before["results"]["voc_2007_test"]["bbox"]["AP50"]
    ap50_after = after["results"]["voc_2007_test"]["bbox"]["AP50"]
    print(
        f"\nvoc_2007_test AP50 before training {ap50_before:.2f}, "
        f"after {after['iterations']} iterations {ap50_after:.2f}"
    )
    assert ap50_after >= max(3 * ap50_before, ap50_before + 1.0)

    assert {"AP", "AP50", "AP75"} <= set(after["results"]["voc_2007_test"]["bbox"])
    assert after["iterations"] == 100 and after["world_size"] == 1
    assert any("SyncBN -> BN" in n for n in after["notices"])
    # evaluation ran after the final checkpoint; detectron2's per-iteration log kept apart
    assert (out / "model_final.pth").is_file() and (out / "training_metrics.json").is_file()


def test_the_coco_config_trains_and_is_judged_by_the_coco_evaluator(synthetic_root, resnet18_pkl, tmp_path):
    """The EqCo protocol's 4conv-1fc COCO config, a few iterations: COCOEvaluator's box metrics
    on the val split, the sizes' APs included (pycocotools computes them)."""
    overrides = ["SOLVER.MAX_ITER", "4", "SOLVER.STEPS", "(3,)"]
    metrics = main(_cli(COCO, synthetic_root, tmp_path, resnet18_pkl, overrides=overrides))
    assert metrics["iterations"] == 4 and metrics["world_size"] == 1
    assert any("SyncBN -> BN" in n for n in metrics["notices"])
    bbox = metrics["results"]["coco_2017_val"]["bbox"]
    assert {"AP", "AP50", "AP75", "APs", "APm", "APl"} <= set(bbox)
    assert all(0 <= bbox[k] <= 100 for k in ("AP", "AP50", "AP75"))  # APl: NaN, the val split has no large box
    assert (tmp_path / "model_final.pth").is_file() and (tmp_path / "training_metrics.json").is_file()


def test_resume_from_a_file_that_is_no_checkpoint_is_one_line_naming_it(synthetic_root, resnet18_pkl, tmp_path):
    """``--resume`` over an OUTPUT_DIR whose ``last_checkpoint`` names a ``model_*.pth`` that is not
    a checkpoint of this run (random bytes, a list, a model that is no dict, an optimizer's state
    of another shape) or names no file there: one line naming the file and what was expected
    (before: AttributeError, IndexError or fvcore's assert, with their tracebacks). The control:
    the run's own checkpoint, put back, resumes and finishes."""

    def argv(*flags):
        overrides = ["SOLVER.MAX_ITER", "2", "SOLVER.STEPS", "(1,)", "TEST.PRECISE_BN.ENABLED", "False", *ON_VAL]
        return _cli(VOC, synthetic_root, tmp_path, resnet18_pkl, *flags, overrides=overrides)

    main(argv())
    final = tmp_path / "model_final.pth"
    real = torch.load(final, weights_only=False)
    bad = {
        "random bytes": lambda: final.write_bytes(random.Random(0).randbytes(4096)),
        "a list": lambda: torch.save([torch.zeros(2)], final),
        "a model that is no dict": lambda: torch.save({**real, "model": 3}, final),
        "another optimizer's state": lambda: torch.save(
            {**real, "trainer": {**real["trainer"], "_trainer": {"iteration": 1, "optimizer": {"state": {}}}}}, final
        ),
    }
    for what, plant in bad.items():
        plant()
        with pytest.raises(SystemExit) as stop:
            main(argv("--resume"))
        message = str(stop.value.code)
        assert message.startswith("error: ") and str(final) in message and "\n" not in message, (what, message)
    torch.save(real, final)
    (tmp_path / "last_checkpoint").write_text("model_gone.pth")
    with pytest.raises(SystemExit, match=r"last_checkpoint: names 'model_gone\.pth', expected the name of a"):
        main(argv("--resume"))
    (tmp_path / "last_checkpoint").write_text("model_final.pth")
    assert main(argv("--resume"))["results"]["voc_2007_val"]["bbox"]  # the control: resumed at its end, evaluated
    assert "Starting training from iteration 2" in (tmp_path / "log.txt").read_text()
