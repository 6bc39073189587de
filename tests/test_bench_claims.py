"""benchmarks/claims.py without the hours of pretraining: the verdict rule and the document against
hand-computed effects, runs kept by their config hash across sessions and machines (extra seeds
only for effects smaller than their spread), and every planned run of the real grid resolving
through load_config with the override it names."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest
import yaml
from omegaconf import OmegaConf

from benchmarks import claims as bench
from pretrain.config import load_config

from .test_bench_learning import started_run


@pytest.fixture(autouse=True)
def _no_data_generation(monkeypatch):
    """The runs are faked (``measure``): the generator would write the whole small preset (30-80 s)
    for the placeholder manifest, which no longer matches today's config."""
    monkeypatch.setattr(bench, "ensure_data", lambda *a, **k: None)


@pytest.mark.parametrize(
    ("effects", "direction", "expected"),
    [
        # mean 3, std 1, 2 SE = 2/√3 = 1.15: significant
        ([2.0, 3.0, 4.0], "greater", "reproduced"),
        ([-2.0, -3.0, -4.0], "greater", "opposite"),
        # mean 1, std 2, 2 SE = 2.31 > 1: within the spread
        ([1.0, -1.0, 3.0], "greater", "not at this scale"),
        ([-2.0, -3.0, -4.0], "not_below", "opposite"),
        ([-1.0, 1.0, -3.0], "not_below", "reproduced"),  # −1 within 2 SE of 0: a match
        ([2.0, 3.0, 4.0], "not_below", "reproduced"),
        ([5.0, 6.0], "greater", "pending (2 of 3 seeds)"),
    ],
)
def test_the_verdict_follows_the_mean_effect_and_its_standard_error(effects, direction, expected):
    assert bench.verdict(effects, direction) == expected


def test_an_effect_smaller_than_its_spread_asks_for_more_seeds():
    assert bench.needs_more_seeds([1.0, -1.0, 3.0])  # |1| < std 2
    assert not bench.needs_more_seeds([2.0, 3.0, 4.0])  # |3| > std 1
    assert not bench.needs_more_seeds([1.0, -1.0])  # too few seeds to say


A = bench.Arm("A", "tiny_simclr")
B = bench.Arm("B", "tiny_dcl", ("train.batch_size=32",))
TOY = bench.Claim("toy", "Toy: B beats A", "B beats A by 5.", "toy scale.", (A, B),
                  (bench.Comparison("B − A", (B,), (A,), "greater", "+5"),))  # fmt: skip


def _row(arm: bench.Arm, seed: int, knn: float, config: str = "h") -> dict:
    return {
        "preset": "digits",
        "arm": arm.label,
        "recipe": arm.recipe,
        "seed": seed,
        "knn_top1": knn,
        "random_knn_top1": 40.0,
        "linear_top1": 70.0,
        "seconds": 120.0,
        "config_hash": f"{config}{seed}",
        "machine": "test cpu, 2 cores",
    }


@pytest.fixture
def fake_hash(monkeypatch):
    """Config hashes without load_config: '<version><seed>', the version settable."""
    version = {"v": "h"}
    monkeypatch.setattr(bench, "config_hash", lambda recipe, epochs, seed=0, extra=(): f"{version['v']}{seed}")
    return version


def test_the_document_shows_each_configuration_and_effect_with_its_verdict(tmp_path, fake_hash):
    # A 50, 52, 54; B 55, 56, 60: effects +5, +4, +6 → mean +5.0 ± 1.0, 2 SE 1.2 → reproduced
    rows = [_row(A, s, k) for s, k in enumerate((50.0, 52.0, 54.0))]
    rows += [_row(B, s, k) for s, k in enumerate((55.0, 56.0, 60.0))]
    rows.append(_row(B, 0, 99.0, config="old"))  # a line of an older config: not shown
    out = tmp_path / "claims.md"
    bench.write_document({"toy": TOY}, [0, 1, 2, 3], rows, out)
    text = out.read_text()
    assert "## Toy: B beats A: reproduced" in text
    assert "| B − A | +5 | +5.0 ± 1.0 | 1.2 | +5.0, +4.0, +6.0 | reproduced |" in text
    assert "| A | `tiny_simclr` | - | 20 | 0, 1, 2 (missing 3) | 52.0 ± 2.0 | +12.0 ± 2.0 | 70.0 ± 0.0 | 2.0 |" in text
    assert "| B | `tiny_dcl` | `train.batch_size=32` | 20 | 0, 1, 2 (missing 3) | 57.0 ± 2.6 |" in text
    assert "| [toy](#toy-b-beats-a-reproduced) | B − A | +5.0 ± 1.0 (n 3) | reproduced |" in text
    assert "- A (`tiny_simclr` -, 20 epochs): seeds 3" in text and "runs measured so far 6," in text
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_claim_with_no_runs_is_listed_as_pending_and_missing(tmp_path, fake_hash):
    out = tmp_path / "claims.md"
    bench.write_document({"toy": TOY}, [0, 1, 2], [], out)
    text = out.read_text()
    assert "## Toy: B beats A: pending (0 of 3 seeds)" in text and "| A | `tiny_simclr` | - | 20 | not measured" in text
    assert "- B (`tiny_dcl` `train.batch_size=32`, 20 epochs): seeds 0, 1, 2" in text


def test_the_extra_seeds_an_effect_within_its_spread_is_owed_are_listed_as_missing(tmp_path, fake_hash):
    # B − A: +1, −1, +3 over seeds 0-2, mean +1.0 below its std 2.0: seeds 3 and 4 are owed
    rows = [_row(A, s, 50.0) for s in range(3)] + [_row(B, s, k) for s, k in enumerate((51.0, 49.0, 53.0))]
    out = tmp_path / "claims.md"
    bench.write_document({"toy": TOY}, [0, 1, 2, 3, 4], rows + [_row(A, 3, 50.0)], out, [0, 1, 2])
    text = out.read_text()
    assert "- A (`tiny_simclr` -, 20 epochs; toy: an effect within its spread): seeds 4" in text
    assert "- B (`tiny_dcl` `train.batch_size=32`, 20 epochs; toy: an effect within its spread): seeds 3, 4" in text
    rows = [_row(A, s, 50.0) for s in range(3)] + [_row(B, s, 55.0 + s) for s in range(3)]  # decided: none owed
    bench.write_document({"toy": TOY}, [0, 1, 2, 3, 4], rows, out, [0, 1, 2])
    assert "Every planned run is measured." in out.read_text()


def test_runs_are_kept_by_config_hash_and_extra_seeds_go_to_undecided_effects(tmp_path, monkeypatch, fake_hash):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    knn = {"A": [50.0, 50.0, 50.0, 50.0, 50.0], "B": [51.0, 49.0, 53.0, 50.0, 50.0]}  # +1, −1, +3: within spread
    calls = []

    def fake_measure(recipe, epochs, seed, data_root, work, fresh=False, extra=(), run=None):
        label = "A" if recipe == "tiny_simclr" else "B"
        calls.append((label, seed, extra, run.name))
        row = _row(A if label == "A" else B, seed, knn[label][seed], fake_hash["v"])
        return {k: v for k, v in row.items() if k not in ("preset", "arm")}

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "claims", lambda: {"toy": TOY})
    runs, out = tmp_path / "runs.jsonl", tmp_path / "claims.md"
    common = ["--data", str(data), "--runs", str(runs), "--out", str(out), "--learning-runs", str(tmp_path / "no")]
    bench.main([*common, "--work", str(tmp_path / "machine1")])
    base = [(label, s) for s in (0, 1, 2) for label in ("A", "B")]
    assert [c[:2] for c in calls] == [*base, ("B", 3), ("A", 3), ("B", 4), ("A", 4)]
    assert calls[1][2] == (*bench.PRETRAIN_OVERRIDES, "train.batch_size=32")  # the digits + the claim's override
    assert calls[1][3] == "tiny_dcl-h0"  # the run's folder is named by its config hash
    lines = [json.loads(line) for line in runs.read_text().splitlines()]
    assert [(r["arm"], r["seed"], r["preset"]) for r in lines][:2] == [("A", 0, "digits"), ("B", 0, "digits")]
    bench.main([*common, "--work", str(tmp_path / "machine2")])  # another machine: the runs file suffices
    assert len(calls) == 10
    assert "| B − A | +5 | +0.6 ± 1.5 | 1.4 | +1.0, -1.0, +3.0, +0.0, +0.0 | not at this scale |" in out.read_text()
    fake_hash["v"] = "edited"  # the recipe changed: every run is measured again, in a new folder
    bench.main([*common, "--work", str(tmp_path / "machine2"), "--seeds", "0", "--extra-seeds", ""])
    assert calls[10:] == [("A", 0, bench.PRETRAIN_OVERRIDES, "tiny_simclr-edited0"),
                          ("B", 0, calls[1][2], "tiny_dcl-edited0")]  # fmt: skip


def test_a_configuration_the_learning_table_measured_is_not_measured_again(tmp_path, monkeypatch, fake_hash):
    """A is tiny_simclr at the table's budget: the learning table's lines of the digits (same recipe,
    seed and key) stand for it; a line of the synthetic preset or of another key does not."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    learning_rows = [{k: v for k, v in _row(A, s, 60.0).items() if k != "arm"} for s in (0, 1, 2)]
    learning_rows[2]["preset"] = "small"
    learning_rows.append({**learning_rows[0], "seed": 2, "config_hash": "other2"})
    (tmp_path / "learning.jsonl").write_text("".join(json.dumps(r) + "\n" for r in learning_rows))
    calls = []

    def fake_measure(recipe, epochs, seed, data_root, work, fresh=False, extra=(), run=None):
        calls.append((recipe, seed))
        return {k: v for k, v in _row(A if recipe == "tiny_simclr" else B, seed, 55.0).items() if k != "arm"}

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "claims", lambda: {"toy": TOY})
    out = tmp_path / "claims.md"
    argv = ["--data", str(data), "--runs", str(tmp_path / "runs.jsonl"), "--out", str(out), "--extra-seeds", ""]
    bench.main([*argv, "--work", str(tmp_path / "w"), "--learning-runs", str(tmp_path / "learning.jsonl")])
    assert calls == [("tiny_dcl", 0), ("tiny_dcl", 1), ("tiny_simclr", 2), ("tiny_dcl", 2)]
    assert "| A | `tiny_simclr` | - | 20 | 0, 1, 2 | 58.3 ± 2.9 |" in out.read_text()


def test_unknown_claim_is_one_line():
    with pytest.raises(SystemExit, match="--claims nope: expected claims from"):
        bench.main(["--claims", "nope"])


def test_every_planned_run_resolves_through_load_config_with_its_override():
    every = bench.claims()
    assert list(every) == ["adco", "eqco", "moco", "simco", "dcl"]  # cheapest first
    arms = dict.fromkeys(a for c in every.values() for a in c.arms)
    hashes = {}
    for arm in arms:
        cfg = load_config(bench.ROOT / "configs" / "pretrain" / f"{arm.recipe}.yaml", list(arm.extra()))
        for override in arm.extra():  # each override reaches the config as the value it names
            key, value = override.split("=", 1)
            assert OmegaConf.select(cfg, key) == yaml.safe_load(value), (arm.label, override)
        hashes.setdefault(arm.hash(0), []).append(arm.label)
    assert all(len(labels) == 1 for labels in hashes.values()), hashes  # no two arms are one run
    comparisons = [c for claim in every.values() for c in claim.comparisons]
    assert all(set(c.plus) | set(c.minus) <= set(arms) for c in comparisons)


@pytest.mark.slow  # a Python start-up and the grid's imports under the signal: about 15 s on 2 shared cores
def test_sigterm_stops_the_run_in_progress_and_keeps_every_line(tmp_path):
    """`kill` on the benchmark mid-run: its child ends with it, and the lines measured before stay."""
    data, runs, pid_file = tmp_path / "data", tmp_path / "runs.jsonl", tmp_path / "child.pid"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    kept = json.dumps(_row(A, 0, 50.0)) + "\n"
    runs.write_text(kept)
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = "\n".join([
        "import sys; from pathlib import Path",
        "from benchmarks import claims as b, learning",
        "from tests.test_bench_claims import TOY",
        "b.claims = lambda: {'toy': TOY}",
        "b.config_hash = lambda recipe, epochs, seed=0, extra=(): 'h1'",  # A seed 0 ('h0') is measured again
        f"log = Path({str(tmp_path / 'run.log')!r})",
        f"b.measure = lambda *a, **k: learning.run_logged([sys.executable, '-c', {child!r}], log)",
        f"b.main(['--data', {str(data)!r}, '--runs', {str(runs)!r}, '--out', {str(tmp_path / 'claims.md')!r}, "
        f"'--work', {str(tmp_path / 'work')!r}, '--seeds', '0', '--extra-seeds', ''])",
    ])  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=bench.ROOT)
    run = started_run(pid_file, proc)
    assert run.is_running()  # control: the benchmark's run is live before the signal
    proc.terminate()
    assert proc.wait(timeout=60) != 0
    gone, alive = psutil.wait_procs([run], timeout=10)
    for p in alive:
        p.kill()
    assert not alive, "the benchmark's run outlived it"
    assert runs.read_text() == kept
