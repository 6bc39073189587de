"""benchmarks/learning.py without the hours of pretraining: runs already measured are kept in the
runs file (the table builds across sessions and machines, the run folders lost), --fresh redoes
them, and the table lists every tiny recipe, measured or not, as mean ± std over its seeds, flagging
rows below the 5-point kNN margin and rows whose gain is within one standard deviation of it; the
digits table is written beside the synthetic one from its own rows."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import learning


@pytest.fixture(autouse=True)
def _no_data_generation(monkeypatch):
    """The runs are faked (``measure``): the generator would write the whole small preset (30-80 s)
    for the placeholder manifest, which no longer matches today's config."""
    monkeypatch.setattr(learning, "ensure_data", lambda *a, **k: None)


def _row(recipe: str, knn: float, seed: int = 0) -> dict:
    return {
        "recipe": recipe,
        "seed": seed,
        "method": "simclr",
        "knn_top1": knn,
        "random_knn_top1": 49.7,
        "linear_top1": 60.0,
        "random_linear_top1": 30.0,
        "seconds": 180.0,
        "images_per_s": 50.0,
        "peak_mib": 900.0,
        "config_hash": "abc",
        "git_sha": "def" if seed < 2 else "0a1",  # a third seed measured at a later commit
    }


def started_run(pid_file: Path, parent: subprocess.Popen) -> psutil.Process:
    """The benchmark's run, once it has written its pid. A generous start-up: two Pythons importing
    torch on cores busy with the rest of the suite took over a minute once (beside the sweep)."""
    deadline = time.time() + 600
    while not (pid_file.is_file() and pid_file.read_text()) and time.time() < deadline and parent.poll() is None:
        time.sleep(0.1)
    assert pid_file.is_file() and pid_file.read_text(), f"the benchmark's run did not start (exit {parent.poll()})"
    return psutil.Process(int(pid_file.read_text()))


def test_rows_are_kept_unless_fresh_and_the_table_lists_every_recipe(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    calls = []

    def fake_measure(recipe, epochs, seed, data_root, work, fresh=False, extra=()):
        calls.append((recipe, seed))
        # simclr gains 16.3 ± 1 (clear), mocov1 loses 23.7 ± 1, and dcl gains 5.3 ± 3 (within spread).
        knn = {"tiny_simclr": 65.0, "tiny_mocov1": 25.0, "tiny_dcl": 52.0}[recipe] + 2 * seed
        return _row(recipe, knn + (3 * seed if recipe == "tiny_dcl" else 0), seed)

    monkeypatch.setattr(learning, "measure", fake_measure)
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs, seed=0, extra=(): "abc")
    out = tmp_path / "learning.md"
    argv = [
        "--recipes",
        "tiny_simclr,tiny_mocov1,tiny_dcl",
        "--data",
        str(data),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--runs",
        str(tmp_path / "runs.jsonl"),
    ]
    learning.main([*argv, "--seeds", "2"])
    learning.main([*argv, "--seeds", "2"])  # every run measured: nothing is redone
    recipes = ("tiny_simclr", "tiny_mocov1", "tiny_dcl")
    assert calls == [(r, s) for s in (0, 1) for r in recipes]  # every recipe's seed 0 first
    learning.main(argv[:1] + ["tiny_simclr"] + argv[2:] + ["--fresh", "--seeds", "1"])
    assert calls[-1] == ("tiny_simclr", 0) and len(calls) == 7
    learning.main([*argv, "--seeds", "3"])  # a third seed: only the new runs
    assert calls[7:] == [(r, 2) for r in recipes]
    table = out.read_text()
    for recipe in learning.tiny_recipes():
        assert f"| {recipe} |" in table
    # mean ± sample std over seeds 0, 1, 2 (kNN 65, 67, 69; gains 15.3, 17.3, 19.3; 2 SE of the gain 2.3)
    assert "| tiny_simclr | simclr | 0, 1, 2 | 67.0 ± 2.0 | 49.7 ± 0.0 | +17.3 ± 2.0 | yes | ✓ |" in table
    assert "| tiny_mocov1 | simclr | 0, 1, 2 | 27.0 ± 2.0 | 49.7 ± 0.0 | -22.7 ± 2.0 | no | below the margin |" in table
    assert "| +7.3 ± 5.0 | yes | ✓ (within spread) |" in table  # dcl: 52, 57, 62 (2 SE: 5.8)
    assert "| tiny_simco | seeds 0, 1, 2 not measured yet |" in table
    assert "| `abc` | `def`, `0a1` |" in table  # every commit a row was measured at
    assert (
        "2 of 3 measured rows clear the 5-point kNN margin (1 of them within spread); 1 are below it (0 of them "
        "within spread). The mean linear-probe gain over random init lies between +30.0 and +30.0 points"
    ) in table
    assert out.with_suffix(".png").stat().st_size > 1000


def test_unknown_recipe_is_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit, match="--recipes tiny_byol: expected tiny recipes"):
        learning.main(
            ["--recipes", "tiny_byol", "--data", str(data), "--work", str(tmp_path), "--runs", str(tmp_path / "r")]
        )


def test_a_row_whose_recipe_changed_is_measured_again_from_a_clean_run(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    calls = []
    monkeypatch.setattr(
        learning,
        "measure",
        lambda recipe, epochs, seed, d, w, fresh=False, extra=(): (
            calls.append(fresh) or {**_row(recipe, 66.0), "config_hash": recipe_now["hash"]}
        ),
    )
    recipe_now = {"hash": "abc"}
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs, seed=0, extra=(): recipe_now["hash"])
    argv = [
        "--recipes",
        "tiny_simclr",
        "--data",
        str(data),
        "--work",
        str(tmp_path / "w"),
        "--out",
        str(tmp_path / "t.md"),
        "--seeds",
        "1",
        "--runs",
        str(tmp_path / "runs.jsonl"),
    ]
    learning.main(argv)  # measured (row hash "abc")
    learning.main(argv)  # current hash "abc": kept
    recipe_now["hash"] = "edited"
    learning.main(argv)  # current hash "edited": measured again, fresh
    assert calls == [False, True]


def test_the_config_hash_follows_the_recipe_not_the_paths():
    a = learning.config_hash("tiny_simclr", 6)
    assert a == learning.config_hash("tiny_simclr", 6) != learning.config_hash("tiny_simclr", 3)
    assert a != learning.config_hash("tiny_dcl", 6)
    elsewhere = ("data.root=/elsewhere", "train.output_dir=/tmp/x", "knn.temperature=0.2", "knn.k=5")
    assert a == learning.config_hash("tiny_simclr", 6, extra=elsewhere)  # paths and the monitor's settings
    assert a != learning.config_hash("tiny_simclr", 6, extra=("method.temperature=0.3",))  # what trains
    assert a != learning.config_hash("tiny_simclr", 6, seed=1)


def test_a_benchmark_stopped_with_sigterm_stops_the_run_it_started(tmp_path):
    """`kill` (SIGTERM) on the benchmark must not leave its pretraining running on into a run folder
    that the next benchmark resumes or deletes."""
    pid_file = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent_code = (
        "import sys; from pathlib import Path; from benchmarks.learning import run_logged; "
        f"run_logged([sys.executable, '-c', {child_code!r}], Path({str(tmp_path / 'run.log')!r}))"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=learning.ROOT)
    child = started_run(pid_file, parent)
    assert child.is_running()  # control: the benchmark's run is live before the signal
    parent.terminate()
    parent.wait(timeout=60)
    gone, alive = psutil.wait_procs([child], timeout=10)
    for proc in alive:
        proc.kill()
    assert not alive, "the benchmark's child outlived it"


def test_rows_of_a_recipe_no_longer_listed_stay_out_of_the_summary(tmp_path):
    runs = {"tiny_simclr": [_row("tiny_simclr", 66.0)], "tiny_deleted": [_row("tiny_deleted", 20.0)]}
    out = tmp_path / "learning.md"
    args = argparse.Namespace(seeds=1, epochs=6)
    learning.write_table(runs, ["tiny_simclr"], out, args)
    text = out.read_text()
    assert "1 of 1 measured rows clear the 5-point kNN margin" in text and "tiny_deleted" not in text


def test_runs_carry_over_to_another_machine_and_the_digits_table_is_written_beside(tmp_path, monkeypatch):
    """The run folders (--work) lost, as on another machine: the runs file alone keeps every measured
    run. The digits runs take the digits overrides, go to their own table, and leave the synthetic
    table's rows alone."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    calls = []

    def fake_measure(recipe, epochs, seed, data_root, work, fresh=False, extra=()):
        calls.append((recipe, seed, epochs, extra))
        return _row(recipe, {(): 60.0}.get(extra, 90.0) + seed, seed)

    monkeypatch.setattr(learning, "measure", fake_measure)
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs, seed=0, extra=(): "abc")
    runs, synthetic, digits = tmp_path / "runs.jsonl", tmp_path / "learning.md", tmp_path / "learning_digits.md"
    common = ["--recipes", "tiny_simclr", "--data", str(data), "--runs", str(runs), "--seeds", "2"]
    learning.main([*common, "--work", str(tmp_path / "machine1"), "--out", str(synthetic)])
    before = synthetic.read_text()
    learning.main([*common, "--work", str(tmp_path / "machine2"), "--out", str(synthetic)])  # nothing redone
    assert calls == [("tiny_simclr", 0, 6, ()), ("tiny_simclr", 1, 6, ())] and synthetic.read_text() == before
    learning.main([*common, "--preset", "digits", "--work", str(tmp_path / "machine2"), "--out", str(digits)])
    overrides = learning.PRESETS["digits"].overrides
    assert "data.augmentation=digits" in overrides
    assert calls[2:] == [("tiny_simclr", s, learning.DIGITS_EPOCHS, overrides) for s in (0, 1)]
    lines = [json.loads(line) for line in runs.read_text().splitlines()]
    assert [(r["preset"], r["seed"], r["knn_top1"]) for r in lines] == [
        ("small", 0, 60.0), ("small", 1, 61.0), ("digits", 0, 90.0), ("digits", 1, 91.0)
    ]  # fmt: skip
    # kNN 60, 61 vs 49.7: gain +10.8 ± 0.7; digits 90, 91: +40.8 ± 0.7
    assert "| tiny_simclr | simclr | 0, 1 | 60.5 ± 0.7 | 49.7 ± 0.0 | +10.8 ± 0.7 | yes | ✓ |" in synthetic.read_text()
    table = digits.read_text()
    assert table.startswith("# Does every method learn? Tiny recipes on the real handwritten digits")
    assert "| tiny_simclr | simclr | 0, 1 | 90.5 ± 0.7 | 49.7 ± 0.0 | +40.8 ± 0.7 | yes | ✓ |" in table
    assert "1 of 1 measured rows clear the 20-point kNN margin" in table  # the real digits' target
    assert f"--preset digits --epochs {learning.DIGITS_EPOCHS} --seeds 2" in table
    learning.main([*common, "--work", str(tmp_path / "machine3"), "--out", str(synthetic)])
    assert synthetic.read_text() == before and len(calls) == 4  # the digits lines left the synthetic table alone


def test_the_table_shows_each_runs_latest_line_of_the_current_config():
    rows = [
        {**_row("tiny_simclr", 50.0), "preset": "small", "config_hash": "old"},  # the recipe before an edit
        {**_row("tiny_simclr", 60.0), "preset": "small"},
        {**_row("tiny_simclr", 62.0), "preset": "small"},  # measured again with --fresh: this one counts
        {**_row("tiny_simclr", 90.0), "preset": "digits"},
        {**_row("tiny_dcl", 55.0, seed=1), "preset": "small"},
    ]
    hashes = {("tiny_simclr", 0): "abc", ("tiny_dcl", 0): "abc", ("tiny_dcl", 1): "abc"}
    runs = learning.current_runs(rows, "small", hashes)
    assert runs == {"tiny_simclr": [rows[2]], "tiny_dcl": [rows[4]]}
    assert learning.current_runs(rows, "small", {("tiny_simclr", 0): "old"}) == {"tiny_simclr": [rows[0]]}


def test_rows_kept_only_in_the_old_run_folders_are_carried_into_the_runs_file(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    legacy = tmp_path / "work" / "6ep" / "rows" / "tiny_simclr" / "seed0.json"
    legacy.parent.mkdir(parents=True)
    legacy.write_text(json.dumps(_row("tiny_simclr", 64.0)))
    monkeypatch.setattr(learning, "measure", lambda *a, **k: pytest.fail("a run kept in the old layout was redone"))
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs, seed=0, extra=(): "abc")
    runs = tmp_path / "runs.jsonl"
    argv = ["--recipes", "tiny_simclr", "--seeds", "1", "--data", str(data), "--work", str(tmp_path / "work")]
    learning.main([*argv, "--runs", str(runs), "--out", str(tmp_path / "t.md")])
    learning.main([*argv, "--runs", str(runs), "--out", str(tmp_path / "t.md")])  # carried once
    assert [json.loads(line) for line in runs.read_text().splitlines()] == [
        {"preset": "small", **_row("tiny_simclr", 64.0)}
    ]
    assert "| tiny_simclr | simclr | 0 | 64.0 |" in (tmp_path / "t.md").read_text()


@pytest.mark.parametrize("recipe", ["tiny_simclr_eqco", "tiny_adco"])  # a loss section, and none
def test_a_measured_row_is_one_json_line_keyed_by_its_experiment(tmp_path, monkeypatch, recipe):
    """measure() around a faked pretraining and evaluation: the row it returns is plain JSON (a
    config section in it failed only after a real pretraining) and its stored experiment gives
    back the key the table looks it up by."""

    def fake_pretrain(cmd, log):
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("train.output_dir="))
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        (tmp_path / out / "checkpoint_final.pth").write_bytes(b"")
        (tmp_path / out / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
        return 1.0, 100.0

    monkeypatch.setattr(learning, "run_logged", fake_pretrain)
    monkeypatch.setattr(learning, "evaluate", lambda final, data, run: {"knn_top1": 60.0, "linear_top1": 50.0})
    monkeypatch.setattr(learning, "random_baseline", lambda *a, **k: {"knn_top1": 40.0, "linear_top1": 30.0})
    row = learning.measure(recipe, 3, 1, tmp_path / "data", tmp_path / "work")
    row = json.loads(json.dumps(row))
    assert row["loss"] == ("infonce" if recipe == "tiny_simclr_eqco" else "-")
    assert row["steps"] == 7
    assert learning.row_hash(row) == row["config_hash"] == learning.config_hash(recipe, 3, 1)
    assert learning.row_hash({**row, "config_hash": "stale"}) == row["config_hash"]  # the stored experiment wins


def test_plan_writes_the_table_from_the_runs_file_and_trains_nothing(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs.jsonl"
    learning.append_run(runs, {**_row("tiny_simclr", 70.0), "preset": "digits"})
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs, seed=0, extra=(): "abc")
    monkeypatch.setattr(learning, "measure", lambda *a, **k: pytest.fail("--plan trained"))
    monkeypatch.setattr(learning, "ensure_data", lambda *a, **k: pytest.fail("--plan made data"))
    out = tmp_path / "digits.md"
    learning.main(["--preset", "digits", "--plan", "--seeds", "2", "--runs", str(runs), "--out", str(out),
                   "--data", str(tmp_path / "none"), "--work", str(tmp_path / "w")])  # fmt: skip
    assert "| tiny_simclr | simclr | 0 | 70.0 | 49.7 | +20.3 | - | ✓ |" in out.read_text()
    printed = capsys.readouterr().out
    assert "tiny_simclr: missing seeds [1]" in printed and "tiny_dcl: missing seeds [0, 1]" in printed


def test_another_budget_gets_its_own_table_beside_the_presets(tmp_path, monkeypatch):
    runs = tmp_path / "runs.jsonl"
    learning.append_run(runs, {**_row("tiny_simclr", 70.0), "preset": "digits"})
    monkeypatch.setattr(learning, "config_hash", lambda recipe, epochs, seed=0, extra=(): f"h{epochs}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    argv = ["--preset", "digits", "--plan", "--seeds", "1", "--runs", str(runs), "--work", str(tmp_path / "w")]
    learning.main([*argv, "--epochs", "40"])
    assert sorted(p.name for p in (tmp_path / "benchmarks").glob("*.md")) == ["learning_digits_40ep.md"]
    assert "--preset digits --epochs 40 --seeds 1" in (tmp_path / "benchmarks" / "learning_digits_40ep.md").read_text()
    learning.main(argv)  # the preset's own budget: its own table
    assert (tmp_path / "benchmarks" / "learning_digits.md").is_file()
