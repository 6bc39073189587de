"""The demo pipeline end to end at the tiny preset (a smoke run of every stage, not the full demo):
every stage's result exists, the report's table holds exactly the figures of the stages'
metrics.json files, and a second run only rebuilds the report."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[1] / "tools" / "demo.py"


def test_demo_pipeline_at_the_tiny_preset(synthetic_root, tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, str(DEMO), "--data", str(synthetic_root), "--preset", "tiny", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]

    for backbone in ("pretrained", "random"):
        for stage in ("knn", "voc07_svm", "linear", "detection"):
            assert (out / backbone / stage / "metrics.json").is_file(), (backbone, stage)
    assert (out / "pretrain" / "checkpoint_final.pth").is_file()
    for png in ("curves.png", "pretrained_vs_random.png"):
        assert (out / "plots" / png).stat().st_size > 10_000, png

    report = (out / "report.md").read_text()
    table = {
        m.group(1): (float(m.group(2)), float(m.group(3)))
        for m in re.finditer(r"^\| (.+?) \| ([-\d.]+) \| ([-\d.]+) \| [-+\d.]+ \|$", report, re.M)
    }
    knn = [json.loads((out / b / "knn" / "metrics.json").read_text())["top1"] for b in ("pretrained", "random")]
    svm = [
        json.loads((out / b / "voc07_svm" / "metrics.json").read_text())["layers"]["res5avg"]["mAP"]
        for b in ("pretrained", "random")
    ]
    assert table["kNN top-1 (synthetic ImageNet val, %)"] == tuple(round(v, 2) for v in knn)
    assert table["VOC07 SVM mAP (res5avg, %)"] == tuple(round(v, 2) for v in svm)
    assert len(table) == 5 and "![curves](plots/curves.png)" in report

    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.count("already done") == 13, again.stdout[-2000:]
