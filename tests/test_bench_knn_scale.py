"""benchmarks/knn_scale.py on a small bank: the chunked vote agrees with its brute-force formula and
the report renders a row per measurement."""

from __future__ import annotations

import torch

from benchmarks import knn_scale


def test_one_measurement_agrees_with_the_brute_force_formula():
    row = knn_scale.one(3000, 120, 32, torch.device("cpu"), check=6, k=20, t=0.07)
    assert (row["checked"], row["agree"]) == (6, 6)
    assert row["max_rel_diff"] < 1e-5 and row["seconds"] > 0 and row["peak_growth_mib"] >= 0
    text = knn_scale.report([row], ["--banks", "3000"])
    assert "| 3,000 × 32 | cpu (float32) |" in text and "6/6 neighbour sets equal" in text
