"""benchmarks/transfer.py without the hours of runs: rows are kept by config hash and seed count,
the baseline is measured first, each cell is mean ± sample std over the seeds, and a gain is marked
only where it exceeds twice its standard error."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import learning, transfer
from contrastive_transfer.synthetic.digits import PRETRAIN_OVERRIDES


@pytest.fixture(autouse=True)
def _no_data_generation(monkeypatch):
    """The runs are faked (``measure``): the generator would write the whole small preset (30-80 s)
    for the placeholder manifest, which no longer matches today's config."""
    monkeypatch.setattr(transfer, "ensure_data", lambda *a, **k: None)


def _values(shift: float, spread: float) -> dict[str, list[float]]:
    seeds = [shift - spread, shift, shift + spread]
    return {"knn": [50.0 + shift], "svm": [12.0 + shift], "probe": [40 + s for s in seeds],
            "AP50": [5 + s for s in seeds], "AP": [1 + s / 10 for s in seeds]}  # fmt: skip


def test_cells_and_gains_follow_their_formulas():
    assert transfer.cell([1.0, 2.0, 4.0]) == f"2.3 ± {statistics.stdev([1.0, 2.0, 4.0]):.1f}"
    assert transfer.cell([3.0]) == "3.0"
    base = [5.0, 6.0, 7.0]  # std 1: SE of two such means = sqrt(2/3) = 0.816
    assert transfer.gain([6.5, 7.5, 8.5], base) == "+1.5"  # 1.5 < 2 × 0.816
    assert transfer.gain([6.8, 7.8, 8.8], base) == "+1.8 ✓"  # 1.8 > 1.63
    assert transfer.gain([51.0], [50.0]) == "+1.0 ✓"  # deterministic figures: any gain is one
    assert transfer.gain([49.0], [50.0]) == "-1.0"


def test_rows_are_kept_by_hash_and_the_table_marks_clear_gains(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    calls = []

    def fake_measure(row, data, work, seeds, fresh, **_):
        calls.append((row, fresh))
        shift, spread = {"random": (0.0, 1.0), "tiny_simclr": (10.0, 1.0), "tiny_mocov2": (1.0, 3.0)}[row]
        return {"row": row, "values": _values(shift, spread), "seeds": seeds, "config_hash": transfer.row_hash(row)}

    monkeypatch.setattr(transfer, "measure", fake_measure)
    monkeypatch.setattr(transfer, "_chart", lambda rows, path, *_: path.write_bytes(b"png"))
    hashes = {"tiny_simclr": "a", "tiny_mocov2": "b"}
    monkeypatch.setattr(transfer, "row_hash", lambda row, table=None: hashes.get(row, "random"))
    out = tmp_path / "transfer.md"
    argv = ["--rows", "tiny_simclr,tiny_mocov2", "--data", str(tmp_path / "data"), "--work", str(tmp_path / "w")]
    transfer.main([*argv, "--out", str(out)])
    assert calls == [("random", False), ("tiny_simclr", False), ("tiny_mocov2", False)]  # the baseline first
    transfer.main([*argv, "--out", str(out)])
    assert len(calls) == 3  # all kept
    hashes["tiny_mocov2"] = "edited"
    transfer.main([*argv, "--out", str(out)])
    assert calls[3:] == [("tiny_mocov2", True)]  # the recipe changed: measured again from a clean run

    table = out.read_text()
    simclr = next(line for line in table.splitlines() if line.startswith("| tiny_simclr |"))
    mocov2 = next(line for line in table.splitlines() if line.startswith("| tiny_mocov2 |"))
    assert "| 60.0 | 22.0 | 50.0 ± 1.0 | 15.0 ± 1.0 |" in simclr and "+10.0 ✓ | +10.0 ✓ |" in simclr
    assert "| +1.0 ✓ | +1.0 ✓ | +1.0 | +1.0 | +0.1 |" in mocov2  # within 2 SE of random init's seeds
    assert "Not measured yet: tiny_dclw" in table


def test_the_curve_takes_its_last_point_from_the_final_evaluation(tmp_path, monkeypatch):
    # detectron2 writes periodic evaluations into training_metrics.json, but the one after the last
    # iteration only into metrics.json: the curve's last point must come from there.
    out = tmp_path / "detection_600it_2seeds_every300"
    per_seed = {}
    for seed, (mid, final) in {"1": (3.0, 9.0), "2": (5.0, 11.0)}.items():
        (out / f"seed_{seed}").mkdir(parents=True)
        rows = [{"iteration": 299, "bbox/AP50": mid}, {"iteration": 599, "total_loss": 1.0}]
        (out / f"seed_{seed}" / "training_metrics.json").write_text("\n".join(json.dumps(r) for r in rows))
        per_seed[seed] = {"voc_2007_test": {"bbox": {"AP50": final, "AP": final / 2}}}
    (out / "metrics.json").write_text(json.dumps({"per_seed": per_seed}))
    (tmp_path / "detectron2.pkl").write_bytes(b"")
    result = transfer.detection(tmp_path / "w.pth", tmp_path, tmp_path, seeds=2, iters=600, every=300)
    assert result["curve"] == {"300": [3.0, 5.0], "600": [9.0, 11.0]}
    assert result["AP50"] == [9.0, 11.0] and result["AP"] == [4.5, 5.5]
    table = transfer.curve_table({"tiny_simclr": result, "random": {"curve": {"300": [1.0], "600": [2.0, 4.0]}}})
    assert "| 300 | 4.0 ± 1.4 | 1.0 |" in table and "| 600 | 10.0 ± 1.4 | 3.0 ± 1.4 |" in table


def _saved_checkpoint(path, recipe: str, overrides: list[str]) -> None:
    """A checkpoint_final.pth whose saved config is the recipe resolved with ``overrides`` as pretrain
    saves it (the paths of another machine included)."""
    import torch
    from omegaconf import OmegaConf

    from pretrain.config import load_config

    paths = [f"data.root={path.parent}/elsewhere", f"train.output_dir={path.parent}"]
    cfg = OmegaConf.to_container(load_config(learning.RECIPES / f"{recipe}.yaml", [*paths, *overrides]))
    cfg["train"]["mixed_precision"] = "no"  # pretrain saves what ran: a plain launch's "no" for the recipe's null
    path.parent.mkdir(parents=True)
    torch.save({"config": cfg}, path)


def test_digits_rows_take_the_learning_tables_checkpoint_only_with_their_config(tmp_path, monkeypatch):
    table = transfer.TABLES["digits"]
    assert table.rows == (*learning.tiny_recipes(), "random") and table.budget == learning.DIGITS_EPOCHS
    # the row's hash is the learning table's for its seed-0 run on the digits
    assert transfer.row_hash("tiny_simclr", table) == learning.config_hash(
        "tiny_simclr", learning.DIGITS_EPOCHS, 0, PRETRAIN_OVERRIDES
    )
    budget = ["train.epochs=20", "train.seed=0", "train.log_with=none", *PRETRAIN_OVERRIDES]
    lw = tmp_path / "bench_learning"
    kept = lw / "digits_20ep" / "runs" / "tiny_simclr" / "seed0" / "pretrain" / "checkpoint_final.pth"
    _saved_checkpoint(kept, "tiny_simclr", budget)
    edited = lw / "digits_20ep" / "runs" / "tiny_mocov2" / "seed0" / "pretrain" / "checkpoint_final.pth"
    _saved_checkpoint(edited, "tiny_mocov2", [*budget, "train.batch_size=8"])  # not the row's config
    pretrained = []
    monkeypatch.setattr(transfer, "pretrain_run", lambda *a: pretrained.append(a))
    assert transfer.pretrain("tiny_simclr", tmp_path, tmp_path / "runs" / "tiny_simclr", table, lw) == kept
    own = transfer.pretrain("tiny_mocov2", tmp_path / "data", tmp_path / "runs" / "tiny_mocov2", table, lw)
    assert own == tmp_path / "runs" / "tiny_mocov2" / "pretrain" / "checkpoint_final.pth"
    assert pretrained == [
        ("tiny_mocov2", 20, 0, tmp_path / "data", tmp_path / "runs" / "tiny_mocov2", PRETRAIN_OVERRIDES)
    ]
    assert transfer.learning_checkpoint("tiny_simclr", transfer.SMALL, lw) is None  # another table's budget


def test_the_digits_table_keeps_its_rows_beside_the_synthetic_ones(tmp_path, monkeypatch, digits_root):
    # the preset's default data root (no --data), relative to the working directory
    monkeypatch.chdir(tmp_path)
    (tmp_path / "datasets").mkdir()
    (tmp_path / "datasets" / "digits").symlink_to(digits_root)
    monkeypatch.setattr(transfer, "ensure_data", lambda data, preset: None)
    calls = []

    def fake_measure(row, data, work, seeds, fresh, table, learning, iters):
        calls.append((row, work, table.data.name, learning, iters))
        return {"row": row, "values": _values(10.0 if row != "random" else 0.0, 1.0), "seeds": seeds,
                "config_hash": transfer.row_hash(row, table), "detection_iters": iters}  # fmt: skip

    monkeypatch.setattr(transfer, "measure", fake_measure)
    monkeypatch.setattr(transfer, "_chart", lambda rows, path, *_: path.write_bytes(b"png"))
    monkeypatch.setattr(transfer, "row_hash", lambda row, table=None: f"{row}-{table.data.name}")
    out = tmp_path / "transfer_digits.md"
    argv = ["--preset", "digits", "--rows", "tiny_simclr,random", "--work", str(tmp_path / "w"),
            "--learning-work", str(tmp_path / "lw"), "--out", str(out), "--detection-iters", "20"]  # fmt: skip
    transfer.main(argv)
    work = tmp_path / "w" / "digits_20ep"
    assert [c[0] for c in calls] == ["random", "tiny_simclr"]
    assert all(c[1:] == (work, "digits", tmp_path / "lw", 20) for c in calls)
    assert sorted(p.name for p in (work / "rows").iterdir()) == ["random.json", "tiny_simclr.json"]
    transfer.main(argv)
    assert len(calls) == 2  # kept
    transfer.main([*argv[:-1], "600"])
    assert len(calls) == 4  # another detection budget: measured again
    table = out.read_text()
    assert table.startswith("# What pretraining buys: transfer of every method family, supervised and random "
                            "init on the real handwritten digits")  # fmt: skip
    assert "`python -m benchmarks.transfer --preset digits`" in table and "| tiny_simclr |" in table
    assert "Not measured yet: tiny_adco" in table
    assert "Read the SVM column against its floor" in table  # the default data's VOC test split
    assert (tmp_path / "w" / "rows").exists() is False  # the synthetic table's rows untouched


def test_one_fine_tune_seed_reads_the_runs_own_metrics(tmp_path):
    # transfer.detection with --seeds 1 writes that run's metrics.json in OUTPUT_DIR, without per_seed
    out = tmp_path / "detection_10it_1seeds_every5"
    out.mkdir()
    (out / "training_metrics.json").write_text(json.dumps({"iteration": 4, "bbox/AP50": 1.0}))
    results = {"voc_2007_test": {"bbox": {"AP50": 7.0, "AP": 3.0}}}
    (out / "metrics.json").write_text(json.dumps({"seed": 0, "results": results}))
    (tmp_path / "detectron2.pkl").write_bytes(b"")
    result = transfer.detection(tmp_path / "w.pth", tmp_path, tmp_path, seeds=1, iters=10, every=5)
    assert result == {"AP50": [7.0], "AP": [3.0], "curve": {"5": [1.0], "10": [7.0]}}
