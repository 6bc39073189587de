"""One line for every failure of input (issue 48, item 5): what Python and the config libraries
raise while a file, a key or a value is read or checked ends as the command's one ``error:`` line,
naming what it was reading where the project reads it; a bug keeps its traceback; detectron2's
trainer logs no traceback before the line."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from contrastive_transfer.cli import command, is_input_error

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "pretrain" / "tiny_simclr.yaml"


def _fails_with(error: BaseException, *argv: str):
    @command
    def main(args):
        raise error

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code


def _library_errors() -> list[BaseException]:
    """What the libraries really raise for bad input (each made by calling them)."""
    found = []
    for attempt in (
        lambda: OmegaConf.from_dotlist(["train.seed=" + "1" * 5000]),  # ValueError: over 4,300 digits
        lambda: yaml.compose("[" * 100_000),  # RecursionError in PyYAML's composer
        lambda: OmegaConf.create({("a", 1): 2}),  # OmegaConf's own error, several lines
        lambda: yaml.safe_load("a: [1"),  # PyYAML's
        lambda: bytearray(1 << 62),  # MemoryError: a size believed
    ):
        try:
            attempt()
        except Exception as e:
            found.append(e)
    return found


def test_every_failure_of_input_is_one_line_and_a_bug_keeps_its_traceback():
    errors = _library_errors()
    assert [type(e).__name__ for e in errors][:2] == ["ValueError", "RecursionError"]
    assert isinstance(errors[2], OmegaConfBaseException) and "\n" in str(errors[2])  # the control: not one line
    assert isinstance(errors[3], yaml.YAMLError) and isinstance(errors[4], MemoryError)
    for error in errors:
        assert is_input_error(error)
        line = _fails_with(error)
        assert line.startswith("error: ") and "\n" not in line, line
    assert _fails_with(errors[0]).startswith("error: ValueError: Exceeds the limit (4300 digits)")
    assert "nests too deeply" in _fails_with(errors[1])
    for bug in (ZeroDivisionError("bug"), TypeError("bug"), KeyError("bug"), AttributeError("bug")):
        assert not is_input_error(bug)
        with pytest.raises(type(bug)):
            _fails_with(bug)
    with pytest.raises(ValueError):  # --debug shows the traceback
        _fails_with(errors[0], "--debug")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.seed=" + "1" * 5000, "override 'train.seed=1111"),
        ("x=" + "[" * 100_000, "override 'x=[[[["),
        (".".join(["a"] * 1000) + "=1", "a key 1000 levels deep"),
    ],
)
def test_a_bad_override_is_one_line_naming_it(override, expected):
    from pretrain.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--config", str(RECIPE), override, "--print-config"])
    assert e.value.code.startswith(f"error: {RECIPE}: ") and expected in e.value.code and "\n" not in e.value.code


def test_a_config_nested_100000_levels_is_one_line_naming_the_file(tmp_path):
    from pretrain.__main__ import main

    deep = tmp_path / "deep.yaml"
    deep.write_text(f"_base_: {RECIPE}\nx: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(RecursionError):  # the control: what composing it does
        yaml.compose(deep.read_text())
    with pytest.raises(SystemExit) as e:
        main(["--config", str(deep), "--print-config"])
    assert e.value.code == f"error: {deep}: nests more than 64 levels deep (line 2); a config is far shallower"
    shallow = tmp_path / "shallow.yaml"  # 60 levels: read (the key is unknown, named in its one line)
    shallow.write_text(f"_base_: {RECIPE}\nx: " + "[" * 60 + "]" * 60 + "\n")
    with pytest.raises(SystemExit, match="unknown key 'x'"):
        main(["--config", str(shallow), "--print-config"])


def test_tuple_keys_in_a_saved_config_read_by_the_analyses_are_one_line(tmp_path):
    import torch

    from pretrain.analysis.__main__ import main as analysis
    from pretrain.config import load_config

    config = OmegaConf.to_container(load_config(RECIPE))
    config["optim"][("lr", 2)] = 0.1
    with pytest.raises(OmegaConfBaseException):  # the control: OmegaConf's multi-line refusal
        OmegaConf.create(config)
    src = tmp_path / "checkpoint_last.pth"
    torch.save({"method": {}, "optimizer": {}, "step": 1, "config": config}, src)
    with pytest.raises(SystemExit) as e:
        analysis(["npc", str(src)])
    assert e.value.code == (
        f"error: checkpoint {src}: its config has the key ('lr', 2) under optim, expected text keys "
        "(a config from YAML has no other)"
    )


def test_a_benchmark_run_row_missing_its_keys_is_one_line(tmp_path):
    from benchmarks import claims, learning

    committed = REPO / "benchmarks" / "learning_runs.jsonl"
    rows = learning.read_runs(committed)  # the control: every committed row is a run
    assert len(rows) > 50 and all(learning._key(r) for r in rows[:3])
    runs = tmp_path / "runs.jsonl"
    for n, (change, expected) in enumerate(
        [
            (lambda r: r.pop("seed"), "run 2: seed is missing, expected an integer"),
            (lambda r: r.update(knn_top1="high"), "run 2: knn_top1 is 'high', expected a number"),
            (lambda r: [r.pop("config"), r.pop("config_hash")], "run 2: neither a config"),
        ]
    ):
        bad = dict(rows[1])
        change(bad)
        runs.write_text("".join(json.dumps(r) + "\n" for r in (rows[0], bad)))
        with pytest.raises(KeyError if n == 0 else Exception):  # the control: what the tables did with it
            [learning._key(r) and r["knn_top1"] - r["random_knn_top1"] for r in (rows[0], bad)]
        with pytest.raises(learning.BenchmarkInputError, match=re.escape(f"{runs} {expected}")):
            learning.read_runs(runs)
    runs.write_text(json.dumps([1, 2]) + "\n")
    with pytest.raises(SystemExit) as e:
        claims.main(["--learning-runs", str(runs), "--runs", str(runs), "--plan"])
    assert e.value.code == f"error: {runs} run 1: a list, expected an object (one run)"


def test_detectron2s_trainer_logs_no_traceback_before_the_line_of_a_failure_of_input(caplog):
    pytest.importorskip("detectron2")
    from detectron2.engine import TrainerBase

    import transfer.detection.trainer  # noqa: F401  (its filter on detectron2's training loop)

    class Stops(TrainerBase):
        def __init__(self, error):
            super().__init__()
            self.error = error

        def run_step(self):
            raise self.error

    for error, logged in [
        (OSError("cannot read image x.jpg: Mismatched image shape for image x.jpg"), False),
        (ValueError("Mismatched image shape"), False),
        (ZeroDivisionError("a bug"), True),  # the control: a bug's traceback is logged as before
    ]:
        caplog.clear()
        with caplog.at_level(logging.ERROR), pytest.raises(type(error)):
            Stops(error).train(0, 1)
        records = [r for r in caplog.records if "Exception during training" in r.getMessage()]
        assert bool(records) == logged, (error, records)


@pytest.mark.slow
def test_a_voc_size_that_is_not_the_images_is_one_line_through_detection(synthetic_root, tmp_path, capfd):
    """End to end: every trainval annotation's <size> 8 pixels wider than its image. detectron2's
    mapper refuses it inside training; the command ends with one line, no traceback before it."""
    pytest.importorskip("detectron2")
    from transfer.detection.__main__ import main

    root = tmp_path / "data"
    shutil.copytree(synthetic_root, root, symlinks=True)
    for xml in (root / "VOC2007" / "Annotations").glob("*.xml"):
        text = xml.read_text()
        width = int(re.search(r"<width>(\d+)</width>", text).group(1))
        xml.write_text(re.sub(r"<width>\d+</width>", f"<width>{width + 8}</width>", text, count=1))
    config = REPO / "configs" / "detection" / "tiny_voc0712_R_18_FPN_syncbn.yaml"
    argv = ["--config-file", str(config), "--data-root", str(root), "OUTPUT_DIR", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        main([*argv, "DATALOADER.NUM_WORKERS", "0", "SOLVER.MAX_ITER", "2"])
    assert str(e.value.code).startswith("error: cannot read image ") and "Mismatched image shape" in e.value.code
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception during training" not in out + err, (out + err)[-3000:]
