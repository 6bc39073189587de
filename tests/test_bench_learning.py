"""benchmarks/learning.py without the hours of pretraining: rows already measured are kept (the
table builds across runs), --fresh redoes them, and the table lists every tiny recipe, measured
or not, flagging rows that do not beat their random init by 5 kNN points."""

from __future__ import annotations

import pytest

from benchmarks import learning


def _row(recipe: str, knn: float) -> dict:
    return {
        "recipe": recipe,
        "method": "simclr",
        "knn_top1": knn,
        "random_knn_top1": 49.7,
        "linear_top1": 60.0,
        "random_linear_top1": 30.0,
        "seconds": 180.0,
        "images_per_s": 50.0,
        "peak_mib": 900.0,
        "config_hash": "abc",
        "git_sha": "def",
    }


def test_rows_are_kept_unless_fresh_and_the_table_lists_every_recipe(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    calls = []

    def fake_measure(recipe, epochs, data_root, work, fresh=False):
        calls.append(recipe)
        return _row(recipe, 66.0 if recipe == "tiny_simclr" else 26.0)

    monkeypatch.setattr(learning, "measure", fake_measure)
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs: "abc")
    out = tmp_path / "learning.md"
    argv = [
        "--recipes",
        "tiny_simclr,tiny_mocov1",
        "--data",
        str(data),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    learning.main(argv)
    learning.main(argv)  # both rows measured: nothing is redone
    assert calls == ["tiny_simclr", "tiny_mocov1"]
    learning.main(argv[:1] + ["tiny_simclr"] + argv[2:] + ["--fresh"])
    assert calls[-1] == "tiny_simclr" and len(calls) == 3
    table = out.read_text()
    for recipe in learning.tiny_recipes():
        assert f"| {recipe} |" in table
    assert "| tiny_simclr | simclr | 66.0 | 49.7 | +16.3 |" in table
    assert "-23.7 (below the 5-point margin)" in table and "| tiny_simco | not measured yet |" in table
    assert out.with_suffix(".png").stat().st_size > 1000


def test_unknown_recipe_is_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit, match="--recipes tiny_byol: expected tiny recipes"):
        learning.main(["--recipes", "tiny_byol", "--data", str(data), "--work", str(tmp_path)])


def test_a_row_whose_recipe_changed_is_measured_again_from_a_clean_run(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    calls = []
    monkeypatch.setattr(
        learning, "measure", lambda recipe, epochs, d, w, fresh=False: calls.append(fresh) or _row(recipe, 66.0)
    )
    hashes = iter(["abc", "edited"])
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs: next(hashes))
    argv = [
        "--recipes",
        "tiny_simclr",
        "--data",
        str(data),
        "--work",
        str(tmp_path / "w"),
        "--out",
        str(tmp_path / "t.md"),
    ]
    learning.main(argv)  # measured (row hash "abc")
    learning.main(argv)  # current hash "abc": kept
    learning.main(argv)  # current hash "edited": measured again, fresh
    assert calls == [False, True]


def test_the_config_hash_follows_the_recipe_not_the_paths():
    a = learning.config_hash("tiny_simclr", 6)
    assert a == learning.config_hash("tiny_simclr", 6) != learning.config_hash("tiny_simclr", 3)
    assert a != learning.config_hash("tiny_dcl", 6)
    elsewhere = ("data.root=/elsewhere", "train.output_dir=/tmp/x", "knn.temperature=0.2", "knn.k=5")
    assert a == learning.config_hash("tiny_simclr", 6, extra=elsewhere)  # paths and the monitor's settings
    assert a != learning.config_hash("tiny_simclr", 6, extra=("method.temperature=0.3",))  # what trains
