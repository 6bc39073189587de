"""tools/gpu_equivalence.py, which tools/gpu_check.sh uses to compare a 1-GPU and a 2-GPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_equivalence.py"


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
