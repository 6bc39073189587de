"""The demo: its stage loop (a failed stage stops only the stages that need it) and the pipeline end
to end at the tiny preset (a smoke run of every stage, not the full demo): every stage's result
exists, the report's table holds exactly the figures of the stages' metrics.json files, a second
run only rebuilds the report, and a stage made to fail leaves the report written, the other stages
run and the exit status non-zero with the stage named."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "tools" / "demo.py"


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_failed_stage_stops_only_the_stages_that_need_it(tmp_path):
    demo = _demo_module()

    def write(name):
        return [sys.executable, "-c", f"open({str(tmp_path / name)!r}, 'w').write('ok')"]

    def broken():
        raise ValueError("bad input, some.file")

    stages = [
        demo.Stage("a", tmp_path / "a", write("a")),
        demo.Stage("b", tmp_path / "b", [sys.executable, "-c", "print('first'); print('why it failed'); exit(3)"]),
        demo.Stage("c", tmp_path / "c", write("c"), needs=("b",)),  # needs the failed stage: not run
        demo.Stage("d", tmp_path / "d", write("d"), needs=("a",)),  # runs after the failure
        demo.Stage("e", tmp_path / "e", broken),
        demo.Stage("f", tmp_path / "f", [sys.executable, "-c", "pass"]),  # exit 0 without its result
        demo.Stage("g", tmp_path / "g", write("g"), needs=("c",)),  # needs a stage that did not run
        # a child's one-line error, then more lines (as `accelerate launch` prints its traceback after it)
        demo.Stage(
            "h", tmp_path / "h", [sys.executable, "-c", "print('error: the real reason'); raise SystemExit('boom')"]
        ),
    ]
    outcome = demo.run_stages(stages, tmp_path / "logs", env={})
    assert list(outcome.failed) == ["b", "c", "e", "f", "g", "h"]
    assert outcome.failed["b"].startswith("exit 3; why it failed (log: ")
    assert outcome.failed["h"].startswith("exit 1; error: the real reason (log: ")  # not the launcher's tail
    assert outcome.failed["c"] == "not run: needs b" and outcome.failed["g"] == "not run: needs c"
    assert outcome.failed["e"].startswith("ValueError: bad input, some.file")
    assert outcome.failed["f"].startswith(f"finished without writing {tmp_path / 'f'}")
    assert (tmp_path / "a").is_file() and (tmp_path / "d").is_file() and not (tmp_path / "c").exists()
    assert all("\n" not in line for line in outcome.failed.values())
    line = demo.failure_line(outcome.failed)  # the demo's last line: each failure's reason, then what did not run
    assert line.startswith("6 stage(s) failed; b: exit 3; why it failed (log: ") and "\n" not in line
    assert line.endswith("; not run: c, g") and "h: exit 1; error: the real reason" in line
    again = demo.run_stages(stages[:1], tmp_path / "logs", env={})  # a stage whose result exists is skipped
    assert not again.failed and "a" not in again.seconds


def test_a_link_planted_at_a_result_is_not_a_finished_stage(tmp_path):
    """A stage is skipped only for its own file: a link at its result (to a file that exists) runs
    the stage again, whose writer replaces the link. Control: the same stage with a real file at its
    result is skipped."""
    demo = _demo_module()
    outside = tmp_path / "outside"
    outside.write_text("not the stage's")
    result = tmp_path / "out" / "metrics.json"
    result.parent.mkdir()
    result.symlink_to(outside)
    # The stage's own writer: it replaces the link (a rename) and never writes through it.
    r = repr(str(result))
    replace = f"import os; open({r} + '.tmp', 'w').write('ok'); os.replace({r} + '.tmp', {r})"
    stages = [demo.Stage("s", result, [sys.executable, "-c", replace])]
    outcome = demo.run_stages(stages, tmp_path / "logs", env={})
    assert not outcome.failed and "s" in outcome.seconds  # it ran
    assert not result.is_symlink() and result.read_text() == "ok"
    assert outside.read_text() == "not the stage's"
    again = demo.run_stages(stages, tmp_path / "logs", env={})  # control: its own file is a finished stage
    assert not again.failed and "s" not in again.seconds


def _table(report: str) -> dict[str, tuple[str, str]]:
    return {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"^\| (.+?) \| ([^|]+?) \| ([^|]+?) \| [^|]+ \| [^|]+ \|$", report, re.M)
        if m.group(1) != "metric"
    }


@pytest.mark.slow
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
    table = _table(report)
    knn = [json.loads((out / b / "knn" / "metrics.json").read_text())["top1"] for b in ("pretrained", "random")]
    svm = [
        json.loads((out / b / "voc07_svm" / "metrics.json").read_text())["layers"]["res5avg"]["mAP"]
        for b in ("pretrained", "random")
    ]
    det = [json.loads((out / b / "detection" / "metrics.json").read_text()) for b in ("pretrained", "random")]
    assert table["kNN top-1 (%)"] == tuple(f"{v:.2f}" for v in knn)
    assert table["VOC07 SVM mAP (%)"] == tuple(f"{v:.2f}" for v in svm)
    ap50 = [
        (next(iter(d["mean"].values()))["bbox"]["AP50"], next(iter(d["std"].values()))["bbox"]["AP50"]) for d in det
    ]
    assert table["FPN AP50 on VOC07 test"] == tuple(f"{m:.2f} ± {s:.2f}" for m, s in ap50)
    assert len(det[0]["seeds"]) == 2 and "mean ± std of 2 fine-tune seeds" in report
    assert len(table) == 5 and "![curves](plots/curves.png)" in report and "Failed stages" not in report

    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.count("already done") == 14, again.stdout[-2000:]

    # A stage made to fail: the VOC07 split lists are missing from a copy of the data. The random
    # backbone's SVM fails; its linear probe (removed, so it runs again) still runs after it.
    data = tmp_path / "data"
    shutil.copytree(synthetic_root, data)
    shutil.rmtree(data / "VOC2007" / "ImageSets")
    for stage in ("voc07_svm", "linear"):
        shutil.rmtree(out / "random" / stage)
    res = subprocess.run([*cmd[:3], str(data), *cmd[4:]], capture_output=True, text=True)
    # OUT holds the demo of the other data: refused in one line, nothing run
    assert res.returncode == 2 and res.stderr.strip() == (
        f"error: {out} holds another demo (data {synthetic_root} (now {data})); pass --fresh (FRESH=1) to redo it, "
        "or another --out"
    ), res.stderr
    settings = json.loads((out / "demo.json").read_text())  # as if OUT had been made from the copy
    (out / "demo.json").write_text(json.dumps({**settings, "data": str(data)}))
    res = subprocess.run([*cmd[:3], str(data), *cmd[4:]], capture_output=True, text=True)
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]  # the stage, and the child's own line saying why
    assert re.fullmatch(r"error: 1 stage\(s\) failed; random-voc07-svm: exit 1; error: .*Main: missing.*", last), last
    assert (out / "random" / "linear" / "metrics.json").is_file()
    report = (out / "report.md").read_text()
    assert _table(report)["VOC07 SVM mAP (%)"] == (f"{svm[0]:.2f}", "—")
    assert re.search(
        r"^- `random-voc07-svm`: exit [1-9]\d*; error: .*ImageSets.* \(log: .*random-voc07-svm\.log\)$",
        report,
        re.M,
    )


def test_the_recipe_must_be_a_tiny_one(tmp_path, capsys):
    demo = _demo_module()
    assert demo.main(["--recipe", "simclr", "--out", str(tmp_path / "out")]) == 2  # the ImageNet-scale recipe
    line = capsys.readouterr().out.strip()
    assert line.startswith("error: RECIPE=simclr: expected a tiny recipe") and "tiny_mocov2" in line
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_digits_demo_plans_the_digits_data_their_budget_and_folders(tmp_path, monkeypatch):
    """`make demo DATA=digits`: the real digits generated into datasets/digits, the recipe pretrained
    at 32 px with the digits augmentation for the learning table's digits budget, kNN and the probe
    at 32 px, the demo in outputs/demo_digits (beside the synthetic one)."""
    from benchmarks.learning import DIGITS_EPOCHS

    planned = _planned_stages(["--preset", "digits"], tmp_path, monkeypatch)
    stages = {s.name: s for s in planned}
    data, out = tmp_path / "datasets" / "digits", tmp_path / "outputs" / "demo_digits"
    assert stages["data"].command[2:] == [
        "contrastive_transfer.synthetic",
        "--out",
        str(data),
        "--preset",
        "digits",
        "--seed",
        "0",
    ]
    pretrain = stages["pretrain"].command
    assert f"data.root={data / 'imagenet' / 'train'}" in pretrain and f"train.epochs={DIGITS_EPOCHS}" in pretrain
    assert pretrain[-2:] == ["data.augmentation=digits", "data.image_size=32"]
    for name in ("pretrained-knn", "random-linear"):
        command = stages[name].command
        assert command[command.index("--resize") + 1 : command.index("--crop") + 2] == ["37", "--crop", "32"]
    assert json.loads((out / "demo.json").read_text())["data"] == str(data)
    assert (out / "report.md").read_text().startswith("# Demo report: tiny_simclr on the real handwritten digits")
    # detection never mirrors a digit: every fine-tune's config, built by transfer.detection and
    # judged by detectron2's own training augmentation list, has no flip
    fine_tunes = [c for s in planned if s.name.endswith("-detection") for c in (s.command, *s.side_by_side)]
    assert len(fine_tunes) == 2 * 3, [s.name for s in planned]  # 2 backbones x (aggregate + 2 seeds)
    assert all(_detection_augmentations(c) == ["ResizeShortestEdge"] for c in fine_tunes)


def _planned_stages(argv: list[str], tmp_path, monkeypatch) -> list:
    """The stages ``tools/demo.py argv`` plans in ``tmp_path``, none of them run."""
    demo = _demo_module()
    planned: list = []
    monkeypatch.setattr(
        demo, "run_stages", lambda stages, logs, env, fresh=False: planned.extend(stages) or demo.Outcome()
    )
    monkeypatch.chdir(tmp_path)
    assert demo.main(argv) == 0
    return planned


def _detection_augmentations(command: list[str]) -> list[str]:
    """The training augmentations detectron2 builds for a transfer.detection command line."""
    pytest.importorskip("detectron2")
    from detectron2.data.detection_utils import build_augmentation

    from transfer.detection.config import build_config

    pairs = command[command.index("MODEL.WEIGHTS") :]
    opts = [x for k, v in zip(pairs[::2], pairs[1::2]) if k not in ("MODEL.WEIGHTS", "OUTPUT_DIR") for x in (k, v)]
    cfg, _ = build_config(command[command.index("--config-file") + 1], opts)
    return [type(a).__name__ for a in build_augmentation(cfg, True)]


def test_control_the_synthetic_demo_fine_tunes_with_detectron2s_flip(tmp_path, monkeypatch):
    """The synthetic shapes keep detectron2's default horizontal flip (the VOC protocol's)."""
    planned = _planned_stages(["--preset", "small"], tmp_path, monkeypatch)
    (stage,) = [s for s in planned if s.name == "pretrained-detection"]
    assert _detection_augmentations(stage.command) == ["ResizeShortestEdge", "RandomFlip"]


def test_make_demo_data_digits_runs_the_digits_preset():
    """DATA names the data (digits, the default; synthetic) or is a folder; a synthetic PRESET picks
    the synthetic data."""

    def demo_line(*variables):
        res = subprocess.run(["make", "-n", "demo", *variables], cwd=DEMO.parents[1], capture_output=True, text=True)
        return next(line for line in res.stdout.splitlines() if "tools/demo.py" in line)

    assert "tools/demo.py --data datasets/digits --preset digits " in demo_line("DATA=digits")
    assert "tools/demo.py --data datasets/digits --preset digits " in demo_line()
    assert "tools/demo.py --data datasets/synthetic --preset small " in demo_line("DATA=synthetic")
    assert "tools/demo.py --data datasets/synthetic --preset tiny " in demo_line("PRESET=tiny")
    assert "tools/demo.py --data some/folder --preset tiny " in demo_line("DATA=some/folder", "PRESET=tiny")
