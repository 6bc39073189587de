"""benchmarks/eqco_k.py without pretraining: the grid's runs (EqCo at K = α is the InfoNCE run),
resumable rows, and its table living after the learning table in one file, each tool rewriting
only its own part."""

from __future__ import annotations

import pytest

from benchmarks import eqco_k, learning

from .test_bench_learning import _row


@pytest.fixture(autouse=True)
def _no_data_generation(monkeypatch):
    """The runs are faked (``measure``): the generator would write the whole small preset (30-80 s)
    for the placeholder manifest, which no longer matches today's config."""
    monkeypatch.setattr(eqco_k, "ensure_small_synthetic", lambda *a, **k: None)
    monkeypatch.setattr(learning, "ensure_data", lambda *a, **k: None)  # the learning table's rewrite


def test_grid_rows_resume_and_both_tables_share_the_file(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    calls = []

    def fake_measure(loss, k, seed, epochs, data_root, work):
        calls.append((loss, k, seed))
        knn = {"infonce": 40.0 + k / 16, "eqco": 55.0}[loss] + seed
        return {
            "loss": "infonce" if k == eqco_k.ALPHA else loss,
            "k": k,
            "seed": seed,
            "epochs": epochs,
            "knn_top1": knn,
            "random_knn_top1": 49.7,
            "final_loss": 1.0,
            "seconds": 1.0,
            "config_hash": eqco_k.config_hash(eqco_k.HOST, epochs, seed, tuple(eqco_k.overrides(loss, k))),
        }

    monkeypatch.setattr(eqco_k, "measure", fake_measure)
    out = tmp_path / "learning.md"
    out.write_text("# learning table\n\nrows\n")
    argv = ["--data", str(data), "--work", str(tmp_path / "w"), "--out", str(out), "--seeds", "0,1"]
    eqco_k.main(argv)
    eqco_k.main(argv)  # everything measured: nothing redone
    grid = {(loss, k, s) for s in (0, 1) for k in (16, 64) for loss in ("infonce", "eqco")}
    assert sorted(calls) == sorted(grid | {("infonce", 256, 0), ("infonce", 256, 1)})  # EqCo at K = α: no run
    text = out.read_text()
    assert text.startswith("# learning table") and learning.SECTION_MARK in text
    assert "| 16 | 41.5 ± 0.7 (n 2: 41.0, 42.0) | 55.5 ± 0.7 (n 2: 55.0, 56.0) | +14.0 |" in text
    assert "| 256 | 56.5 ± 0.7 (n 2: 56.0, 57.0) | 56.5 ± 0.7 (n 2: 56.0, 57.0) | - |" in text
    # The learning table, rewritten, keeps the EqCo section.
    monkeypatch.setattr(learning, "measure", lambda recipe, epochs, seed, *a, **kw: _row(recipe, 66.0, seed))
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs, seed=0, *a, **kw: "abc")
    argv = ["--recipes", "tiny_simclr", "--data", str(data), "--work", str(tmp_path / "l"), "--out", str(out)]
    learning.main([*argv, "--seeds", "1", "--runs", str(tmp_path / "runs.jsonl")])  # never the committed file
    text = out.read_text()
    assert text.startswith("# Does every method learn?") and "| 16 | 41.5 ± 0.7" in text
    assert text.count(learning.SECTION_MARK) == 1
