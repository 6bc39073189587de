"""tools/gpu_equivalence.py, which tools/gpu_check.sh uses to compare a 1-GPU and a 2-GPU run, and
the script's dry run on the CPU (every section; the detection benchmark's report checked there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
TOOL = TOOLS / "gpu_equivalence.py"


def _run(path: Path, losses: list[float]) -> Path:
    path.mkdir()
    rows = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)] + [{"step": 2, "knn_top1": 50.0}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_and_different_runs(tmp_path):
    a = _run(tmp_path / "a", [4.0, 3.5, 3.2])
    b = _run(tmp_path / "b", [4.0, 3.5004, 3.2])  # 1.1e-4 relative
    c = _run(tmp_path / "c", [4.0, 3.6, 3.2])  # 2.8e-2 relative
    same = subprocess.run([sys.executable, str(TOOL), str(a), str(b)], capture_output=True, text=True)
    assert same.returncode == 0 and "EQUAL" in same.stdout and same.stdout.count("step ") == 3
    other = subprocess.run([sys.executable, str(TOOL), str(a), str(c)], capture_output=True, text=True)
    assert other.returncode == 1 and "DIFFERENT: worst relative difference 2.78e-02" in other.stdout


def test_the_benchmark_runs_where_device_says_whatever_the_recipe_sets():
    """tiny_* recipes set train.cpu: true; `benchmarks.pretraining --device cuda` once timed them on
    the CPU. Judged by the project's own config loader on the recipe gpu_check.sh times."""
    from benchmarks.pretraining import RECIPES_DIR, device_override
    from pretrain.config import load_config

    recipe = RECIPES_DIR / "tiny_mocov2.yaml"
    assert load_config(recipe, []).train.cpu is True  # the trap: the recipe itself asks for the CPU
    for device, available, cpu in (
        ("cuda", True, False),
        ("auto", True, False),
        ("auto", False, True),
        ("cpu", True, True),
    ):
        assert load_config(recipe, [device_override(device, available)]).train.cpu is cpu, (device, available)


# ------------------------------------------------------------------ tools/gpu_check.sh's pieces


def test_the_batch_search_takes_the_largest_size_that_fits():
    import torch

    from benchmarks.pretraining import batch_sizes, largest_batch

    assert batch_sizes(256) == [256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert batch_sizes(100)[:3] == [100, 64, 48]
    tried = []

    def step_at(size):  # a device whose memory holds 100 images
        tried.append(size)
        if size > 100:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert largest_batch(step_at, batch_sizes(256)) == 96 and tried == [256, 192, 128, 96]


def test_method_over_supervised_is_images_per_second_over_the_ceilings():
    from benchmarks.pretraining import against_supervised

    rows = [
        {"recipe": "mocov2", "method": "moco", "device": "cuda", "data_backend": "fast", "batch": 128,
         "bare_s": 0.2, "images_per_s": 500.0},
        {"recipe": "supervised", "method": "supervised", "device": "cuda", "data_backend": "fast", "batch": 256,
         "bare_s": 0.1, "images_per_s": 2000.0},
        {"recipe": "simclr", "method": "simclr", "device": "cuda", "data_backend": "device", "batch": 64,
         "bare_s": 0.1, "images_per_s": 600.0},  # no supervised row with this backend: not compared
    ]  # fmt: skip
    lines = against_supervised(rows)
    assert lines[-1] == "| mocov2 | fast | 0.250 | 0.250 |"  # (128/0.2)/(256/0.1), 500/2000
    assert not any("simclr" in line for line in lines)


def test_the_jpeg_folder_links_few_files_into_many_entries(tmp_path):
    from benchmarks.jpeg_folder import make_folder
    from contrastive_transfer.images import open_rgb

    out = make_folder(tmp_path / "jpegs", unique=2, images=7, classes=3)
    entries = sorted(out.glob("*/*.JPEG"))
    assert [p.parent.name for p in entries].count("class000") == 3 and len(entries) == 7
    assert {p.stat().st_ino for p in entries} == {(out / "class000/0000000.JPEG").stat().st_ino,
                                                   (out / "class001/0000001.JPEG").stat().st_ino}  # fmt: skip
    assert min(open_rgb(entries[0]).size) >= 350  # ImageNet's sides
    assert sorted(p.name for p in out.iterdir()) == ["class000", "class001", "class002"]  # nothing else


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_section_on_the_cpu(tmp_path):
    """`bash tools/gpu_check.sh --dry-run`: every section at toy sizes on the CPU, so that the script
    cannot rot between GPU runs; the report has each section's table and names no failed section."""
    env = os.environ | {"WORK": str(tmp_path / "work"), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True, text=True)
    report = (tmp_path / "work" / "gpu.md").read_text()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + report[-3000:]
    assert "failed" not in report, report
    for heading in ("Host reads per step without a row", "ResNet-50, data.backend fast",
                    "ResNet-50, data.backend device", "The device data path", "Detection on cpu"):  # fmt: skip
        assert f"### {heading}" in report, heading
    assert "| tiny_mocov2 | moco | 0 | 0 |" in report  # no host read without a row
    assert "method/supervised" in report
    _check_detection_dry_run(tmp_path / "work" / "detection.md")


def _check_detection_dry_run(out: Path) -> None:
    """The detection section's CPU dry run (`benchmarks.detection_speed --tiny`): both trainers
    from the same weights, the ratios computed from the two timings, SyncBN as BN to the bit, and
    the evaluation on the CPU against the CPU equal to the last bit."""
    import math

    from benchmarks import detection_speed as ds

    result = json.loads(out.with_suffix(".json").read_text())
    text = out.read_text()
    assert set(result["configs"]) == set(ds.DEFAULT_CONFIGS.split(","))
    for config, run in result["configs"].items():
        ours, plain = run["ours"], run["plain"]
        assert (ours["trainer"], plain["trainer"]) == ("Trainer", "DefaultTrainer")
        assert ours["weights_sha256"] == plain["weights_sha256"]  # the same initial weights
        for t in (ours, plain):
            assert all(math.isfinite(t[k]) and t[k] > 0 for k in ("iteration_s", "d2_time_s", "data_s"))
            assert t["data_s"] < t["d2_time_s"]  # detectron2's `time` includes fetching the data
        assert run["ratio_whole"] == ours["iteration_s"] / plain["iteration_s"]
        assert run["ratio_time"] == ours["d2_time_s"] / plain["d2_time_s"]
        assert f"| {config} | {run['ratio_whole']:.3f} | {run['ratio_time']:.3f} | <= 1.02 |" in text
        assert f"| {config} | ours (transfer.detection) | {ours['iteration_s']:.4f} |" in text
        assert run["sync_bn"]["max_loss_difference"] == 0.0 and run["sync_bn"]["sync_bn_layers"] > 50
    ev = result["evaluation"]
    assert ev["config"] == "voc0712_R_50_FPN_24k_syncbn" and ev["dataset"] == "voc_2007_test_first2"
    assert set(ev["ap"]) == {"AP", "AP50", "AP75"}
    assert all(row["difference"] == 0.0 for row in ev["ap"].values())  # CPU against CPU: bit-equal
    d = ev["detections"]
    assert d["images"] == 2 and d["detections"] > 0 and d["images_same_classes"] == 2
    assert d["max_box_difference"] == 0.0 and d["max_score_difference"] == 0.0
    assert "## Evaluation on cpu against the CPU" in text and "| AP50 |" in text
