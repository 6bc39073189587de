"""benchmarks/data.py's device section (``--device``), on the CPU at toy size: every row it states
is timed in the same run, the ratios are to the batched decode, the verdict follows the goal's
rule, and a GPU-sized batch is filled from fewer images."""

from __future__ import annotations

import torch

from benchmarks import data
from pretrain.augment import build_view_transforms
from pretrain.augment.on_device import JPEG_DECODER
from pretrain.data import ImageDataset


def test_the_device_section_times_both_geometries_against_the_batched_decode(tmp_path):
    threads = torch.get_num_threads()
    try:
        args = ["--device", "cpu", "--device-only", "--images", "3", "--device-batch", "4", "--runs", "1"]
        data.main([*args, "--out", str(tmp_path / "device.md")])
    finally:
        torch.set_num_threads(threads)  # main pins the process to one thread
    text = (tmp_path / "device.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows[f"{data.DECODE} ({JPEG_DECODER})"].endswith("| 100% |")
    assert data.EXACT in rows and data.BATCHED in rows and "batches of 4" in text
    ratio = {name: float(line.rstrip("% |").rsplit("| ", 1)[1]) / 100 for name, line in rows.items() if "%" in line}
    verdict = "Goal met" if ratio[data.BATCHED] >= 0.5 else "Goal not met"
    assert f"{verdict}: decode + two views at {ratio[data.BATCHED]:.0%}" in text
    assert "torchvision::roi_align" in text.split("torch.profiler")[1]  # the profile is device_batched's


def test_the_verdict_is_the_goals_rule():
    def rows(batched: float) -> list[tuple[str, float, float]]:
        return [(data.DECODE, 1000.0, 1.0), (data.EXACT, 110.0, 0.11), (data.BATCHED, 1000.0 * batched, batched)]

    assert data.device_verdict(rows(0.5)).startswith("Goal met: decode + two views at 50%")
    assert data.device_verdict(rows(0.49)).startswith("Goal not met")
    assert "4.5×" in data.device_verdict(rows(0.5))  # 0.5 / 0.11


def test_a_batch_larger_than_the_images_repeats_them(synthetic_root, tmp_path):
    (tmp_path / "c").mkdir()
    for f in sorted((synthetic_root / "imagenet" / "train").rglob("*.JPEG"))[:3]:
        (tmp_path / "c" / f.name).write_bytes(f.read_bytes())
    files = ImageDataset(tmp_path, build_view_transforms("mocov2", 24), backend="device")
    (batch,) = data.device_batches(files, 5)
    assert len(batch.data) == 5
    assert torch.equal(batch.data[3], batch.data[0]) and torch.equal(batch.data[4], batch.data[1])
