"""Files from anywhere (issue 27): a crafted pickle whose loading would run a shell command that
leaves a marker file is given to every entry point that reads weights, states or configs. Each must
refuse it with one line naming the file, exit non-zero, and leave no marker; the control shows the
same bytes DO run the command under plain pickle, so the tests are alive."""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from contrastive_transfer import safe_load
from contrastive_transfer.cli import UserError
from contrastive_transfer.errors import ConfigError
from contrastive_transfer.paths import PathEscapeError
from converters import legacy_to_safe, to_detectron2, to_torchvision

REPO = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this runs `touch MARKER` (what a hostile checkpoint would do, harmlessly)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "MARKER_code_ran"


def _resnet18_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v for k, v in torchvision.models.resnet18().state_dict().items() if not k.startswith("fc.")}


@pytest.fixture(scope="module")
def resnet18_state() -> dict[str, torch.Tensor]:
    return _resnet18_state()


def evil_moco(path: Path, marker: Path, state: dict) -> Path:
    """A valid MoCo checkpoint with one payload entry (converted with exit 0 before issue 27)."""
    sd = {f"module.encoder_q.{k}": v for k, v in state.items()}
    torch.save({"state_dict": sd, "epoch": 200, "arch": "resnet18", "payload": Payload(marker)}, path)
    return path


def evil_pickle(path: Path, marker: Path, protocol: int = pickle.HIGHEST_PROTOCOL) -> Path:
    """A detectron2-shaped .pkl (numpy arrays) carrying the payload."""
    data = {"model": {"stem.conv1.weight": np.zeros((2, 3), np.float32)}, "__author__": Payload(marker)}
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    return path


def one_line(text: str, path: Path) -> str:
    text = text.strip()
    assert "\n" not in text, text
    assert text.startswith("error: "), text
    assert str(path) in text, text
    return text


def exit_line(call, path: Path) -> str:
    """Run a @command main: it must end in SystemExit with one `error:` line naming `path`."""
    with pytest.raises(SystemExit) as e:
        call()
    assert isinstance(e.value.code, str), e.value.code  # a message, hence exit status 1
    return one_line(e.value.code, path)


# ------------------------------------------------------------------------------------- control


def test_control_the_crafted_files_do_run_code_under_plain_pickle(tmp_path, marker, resnet18_state):
    evil_pickle(tmp_path / "x.pkl", marker)
    with open(tmp_path / "x.pkl", "rb") as f:
        pickle.load(f)  # noqa: S301 - the control: what every entry point used to do
    assert marker.exists()
    marker.unlink()
    evil_moco(tmp_path / "x.pth", marker, {"conv1.weight": torch.zeros(1)})
    torch.load(tmp_path / "x.pth", weights_only=False)  # the converters' old fallback
    assert marker.exists()


def test_static_scan_names_the_globals_without_running_them(tmp_path, marker):
    for protocol in (2, 4, 5):
        data = evil_pickle(tmp_path / f"p{protocol}.pkl", marker, protocol).read_bytes()
        assert "posix.system" in safe_load.pickle_globals(data) or "nt.system" in safe_load.pickle_globals(data)
    assert not marker.exists()


# ------------------------------------------------------------------------------------ converters


@pytest.mark.parametrize("module", [to_detectron2, to_torchvision])
def test_converters_refuse_a_moco_checkpoint_with_a_payload(module, tmp_path, marker, resnet18_state, capsys):
    src = evil_moco(tmp_path / "moco_v2_800ep.pth.tar", marker, resnet18_state)
    out = tmp_path / ("out.pkl" if module is to_detectron2 else "out.pth")
    assert module.main([str(src), str(out)]) == 1
    line = one_line(capsys.readouterr().err, src)
    assert "posix.system" in line or "nt.system" in line
    assert "legacy_to_safe" in line
    assert not marker.exists() and not out.exists()


def test_to_torchvision_refuses_a_plain_pickle(tmp_path, marker, capsys):
    src = evil_pickle(tmp_path / "weights.pth", marker)
    assert to_torchvision.main([str(src), str(tmp_path / "out.pth")]) == 1
    one_line(capsys.readouterr().err, src)
    assert not marker.exists()


def test_a_clean_moco_checkpoint_still_converts(tmp_path, resnet18_state):
    src = tmp_path / "moco.pth"
    torch.save({"state_dict": {f"module.encoder_q.{k}": v for k, v in resnet18_state.items()}, "epoch": 1}, src)
    assert to_torchvision.main([str(src), str(tmp_path / "out.pth")]) == 0
    out = torch.load(tmp_path / "out.pth", weights_only=True)
    assert all(torch.equal(out[k], resnet18_state[k].float()) for k in resnet18_state)


# ------------------------------------------------------------------------------------ evaluators


def test_knn_refuses_the_weights_before_anything_else(tmp_path, marker, resnet18_state):
    from transfer import knn

    src = evil_moco(tmp_path / "w.pth", marker, resnet18_state)
    argv = ["--weights", str(src), "--train-dir", str(tmp_path), "--val-dir", str(tmp_path), "--out", str(tmp_path)]
    exit_line(lambda: knn.main(argv), src)
    assert not marker.exists()


def test_linear_refuses_the_weights(tmp_path, marker, resnet18_state):
    from transfer import linear

    src = evil_moco(tmp_path / "w.pth", marker, resnet18_state)
    out = tmp_path / "probe"
    argv = ["--weights", str(src), "--dataset", "imagenet", "--data-root", str(tmp_path)]
    exit_line(lambda: linear.main([*argv, "--preset", "moco", "--out", str(out)]), src)
    assert not marker.exists() and not (out / "metrics.json").exists()


def test_voc07_svm_refuses_the_weights(synthetic_root, tmp_path, marker, resnet18_state):
    from transfer import voc07_svm

    src = evil_moco(tmp_path / "w.pth", marker, resnet18_state)
    argv = ["--weights", str(src), "--voc-root", str(synthetic_root / "VOC2007"), "--out", str(tmp_path / "svm")]
    exit_line(lambda: voc07_svm.main(argv), src)
    assert not marker.exists() and not (tmp_path / "svm").exists()


def _probe_argv(weights: Path, root: Path, out: Path) -> list[str]:
    return [
        *("--weights", str(weights), "--dataset", "places205", "--data-root", str(root / "places205")),
        *("--preset", "places205", "--output-dir", str(out), "--epochs", "1", "--batch-size", "16"),
        *("--resize", "36", "--crop", "32", "--workers", "0", "--resume"),
    ]


def test_linear_resume_refuses_a_planted_probe_state(synthetic_root, tmp_path, marker, resnet18_state):
    from transfer import linear
    from transfer.probe_presets import PROBE_STATE

    weights = tmp_path / "w.pth"  # a small-stem ResNet-18 (3x3 conv1): the 32 px crops keep a 4x4 res5
    torch.save({**resnet18_state, "conv1.weight": torch.randn(64, 3, 3, 3) * 0.1}, weights)
    out = tmp_path / "probe"
    out.mkdir()
    state = out / PROBE_STATE
    torch.save({"identity": {}, "head": {}, "optimizer": {}, "history": [], "epoch": Payload(marker)}, state)
    exit_line(lambda: linear.main(_probe_argv(weights, synthetic_root, out)), state)
    assert not marker.exists() and not (out / "metrics.json").exists()
    state.write_bytes(b"truncated")  # not hostile, just broken: one line too, not a traceback
    exit_line(lambda: linear.main(_probe_argv(weights, synthetic_root, out)), state)


# -------------------------------------------------------------------------------------- pretrain


@pytest.mark.parametrize("command", ["npc", "negatives"])
def test_analysis_refuses_a_crafted_checkpoint(command, tmp_path, marker):
    from pretrain.analysis.__main__ import main

    src = tmp_path / "checkpoint_last.pth"
    torch.save({"method": {}, "config": {}, "x": Payload(marker)}, src)
    argv = [command, str(src)] if command == "npc" else [command, str(tmp_path), "--checkpoint", str(src)]
    exit_line(lambda: main(argv), src)
    assert not marker.exists()


def _resume(root: Path, out: Path, *overrides: str):
    from accelerate import Accelerator

    from contrastive_transfer.cli import command
    from pretrain.config import load_config
    from pretrain.engine import train

    recipe = REPO / "configs" / "pretrain" / "tiny_simclr.yaml"
    cfg = load_config(recipe, [f"data.root={root}", f"train.output_dir={out}", "train.max_steps=1", *overrides])
    return command(lambda argv: train(cfg, Accelerator(cpu=True)))([])


def test_pretrain_resume_refuses_a_crafted_file_and_a_planted_run_folder(synthetic_root, tmp_path, marker):
    root = synthetic_root / "imagenet" / "train"
    src = tmp_path / "downloaded.pth"
    torch.save({"method": {}, "step": 3, "rng": [Payload(marker)]}, src)
    exit_line(lambda: _resume(root, tmp_path / "a", f"train.resume={src}"), src)
    assert not marker.exists()
    planted = tmp_path / "b"  # a run folder copied from elsewhere, resumed with resume=auto
    planted.mkdir()
    torch.save({"method": {}, "x": Payload(marker)}, planted / "checkpoint_last.pth")
    exit_line(lambda: _resume(root, planted, "train.resume=auto"), planted / "checkpoint_last.pth")
    assert not marker.exists() and not (planted / "checkpoint_final.pth").exists()


def test_resume_reads_a_training_state_of_the_earlier_format_weights_only(tmp_path):
    """checkpoint_last.pth written before issue 27 held numpy's RNG key as an ndarray: it still
    resumes (only numpy's array globals are allowed), and new files need no global at all."""
    from pretrain.checkpoint import read_training_state, rng_state, set_rng_state

    old = {"method": {}, "optimizer": {}, "step": 1, "steps_per_epoch": 1, "scaler": None, "config": {}}
    np.random.seed(5)
    torch.save({**old, "rng": [{"numpy": np.random.get_state()}]}, tmp_path / "old.pth")
    assert set(read_training_state(tmp_path / "old.pth")) >= {"rng", "method_state"}
    state = rng_state()
    torch.save({**old, "rng": [state]}, tmp_path / "new.pth")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "new.pth") == []
    expected = np.random.rand(3)
    set_rng_state(read_training_state(tmp_path / "new.pth")["rng"][0])
    assert np.array_equal(np.random.rand(3), expected)  # the restored key continues bit-exactly


# ------------------------------------------------------------------------------------- detection


@pytest.fixture(scope="module")
def detection():
    pytest.importorskip("detectron2")
    from transfer.detection import config, trainer
    from transfer.detection.__main__ import main

    return config, trainer, main


def _detection_argv(synthetic_root: Path, out: Path, config: Path, *opts: str) -> list[str]:
    return ["--config-file", str(config), "--data-root", str(synthetic_root), "OUTPUT_DIR", str(out), *opts]


TINY_VOC = REPO / "configs" / "detection" / "tiny_voc0712_R_18_FPN_syncbn.yaml"


@pytest.mark.parametrize("suffix", [".pkl", ".pth"])
def test_detection_weights_are_refused(detection, suffix, synthetic_root, tmp_path, marker):
    *_, main = detection
    src = tmp_path / f"R-18{suffix}"
    if suffix == ".pkl":
        evil_pickle(src, marker)
    else:
        torch.save({"model": {"a": torch.zeros(1)}, "x": Payload(marker)}, src)
    out = tmp_path / "out"
    exit_line(lambda: main(_detection_argv(synthetic_root, out, TINY_VOC, "MODEL.WEIGHTS", str(src))), src)
    assert not marker.exists() and not (out / "metrics.json").exists()


def test_the_checkpointer_inside_training_uses_the_restricted_unpickler(detection, tmp_path, marker):
    """Checking MODEL.WEIGHTS before training is not enough: detectron2's DetectionCheckpointer
    unpickles .pkl files again inside the training processes."""
    _, trainer, _ = detection
    checkpointer = trainer.BackboneCheckingCheckpointer(torch.nn.Linear(2, 2))
    with pytest.raises(safe_load.UnsafeFileError, match="posix.system|nt.system"):
        checkpointer._load_file(str(evil_pickle(tmp_path / "w.pkl", marker)))
    assert not marker.exists()
    good = tmp_path / "good.pkl"
    good.write_bytes(pickle.dumps({"model": {"w": np.ones((2, 2), np.float32)}, "__author__": "x"}, protocol=2))
    assert checkpointer._load_file(str(good))["model"]["w"].sum() == 4


EVIL_YAML = "SEED: !!python/object/apply:os.system [{}]\n"


@pytest.mark.parametrize("through_base", [False, True])
def test_detection_yaml_with_a_python_tag_is_refused(detection, through_base, synthetic_root, tmp_path, marker):
    *_, main = detection
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"_BASE_: {TINY_VOC}\n" + EVIL_YAML.format(shlex.quote(f"touch {marker}")))
    config = evil
    if through_base:
        config = tmp_path / "innocent.yaml"
        config.write_text("_BASE_: evil.yaml\nSEED: 1\n")
    exit_line(lambda: main(_detection_argv(synthetic_root, tmp_path / "out", config)), evil)
    assert not marker.exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- the opt-in converter


def test_legacy_to_safe_needs_the_flag_then_writes_a_file_that_loads_weights_only(tmp_path, marker, capsys):
    src = tmp_path / "legacy.pth"
    np.random.seed(0)
    torch.save({"state_dict": {"w": torch.ones(2)}, "rng": np.random.get_state(), "x": Payload(marker)}, src)
    out = tmp_path / "safe.pth"
    exit_line(lambda: legacy_to_safe.main([str(src), str(out)]), src)
    assert not marker.exists() and not out.exists()
    legacy_to_safe.main([str(src), str(out), "--i-trust-this-file"])  # the user's explicit choice
    safe = safe_load.torch_load(out)
    assert torch.equal(safe["state_dict"]["w"], torch.ones(2)) and isinstance(safe["rng"][1], torch.Tensor)
    assert "wrote" in capsys.readouterr().out


def test_the_refusal_names_the_command_that_converts(tmp_path, marker):
    src = evil_pickle(tmp_path / "w.pkl", marker)
    with pytest.raises(safe_load.UnsafeFileError) as e:
        safe_load.load_pickle(src)
    assert f"{safe_load.LEGACY_COMMAND} {src} OUT --i-trust-this-file" in str(e.value)
    assert not marker.exists()


def test_no_unrestricted_loader_is_left_in_the_project():
    """Every weights_only=False / plain pickle.load / unsafe YAML load lives only in the opt-in."""
    pattern = r"weights_only=False\)|pickle\.loads?\(|yaml\.unsafe_load\(|yaml\.load\(|allow_unsafe=True"
    grep = ["git", "grep", "--untracked", "-nE", pattern, "--", "*.py", ":!tests"]
    found = subprocess.run(grep, cwd=REPO, capture_output=True, text=True).stdout.splitlines()
    assert all(line.startswith("converters/legacy_to_safe.py:") for line in found), found
    assert len(found) == 2  # its torch.load and its pickle.load: the grep is alive


# ---------------------------------------------------------------------------- nothing escapes its folder


def _recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "recipes" / "downloaded.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"_base_: {REPO / 'configs' / 'pretrain' / 'tiny_simclr.yaml'}\n{body}")
    return path


@pytest.mark.parametrize(
    "body, expected",
    [
        ("name: ../../../escaped_run\n", "must be one folder name"),
        ("train:\n  output_dir: /tmp/escaped_run\n", "is an absolute path"),
        ("train:\n  output_dir: outputs/${name}/../../../escaped_run\n", "is a '..' component"),
        ("data:\n  root: ${oc.env:SECRET_TOKEN}\n", "calls a resolver"),
    ],
)
def test_a_recipe_cannot_write_outside_or_store_the_environment(body, expected, tmp_path, monkeypatch):
    from pretrain.__main__ import main

    monkeypatch.setenv("SECRET_TOKEN", "s3cr3t-value")
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path, body)
    line = exit_line(lambda: main(["--config", str(recipe), "--print-config"]), recipe)
    assert expected in line and "s3cr3t-value" not in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["downloaded.yaml", "recipes"]  # nothing written
    assert not Path("/tmp/escaped_run").exists()


def test_an_augmentation_preset_is_a_name_not_a_path(tmp_path):
    from pretrain.config import load_config

    (tmp_path / "evil.yaml").write_text("views: []\n")
    relative = f"../../../../../../..{tmp_path}/evil"  # configs/augment/<this>.yaml is tmp_path/evil.yaml
    with pytest.raises(ConfigError, match="expected a preset name in .*, not a path") as e:
        load_config(REPO / "configs" / "pretrain" / "tiny_simclr.yaml", [f"data.augmentation={relative}"])
    assert "\n" not in str(e.value) and relative in str(e.value)


def test_an_override_may_not_call_the_environment_either(tmp_path, monkeypatch):
    from pretrain.config import load_config

    monkeypatch.setenv("SECRET_TOKEN", "s3cr3t-value")
    with pytest.raises(ConfigError, match="calls a resolver"):
        load_config(REPO / "configs" / "pretrain" / "tiny_simclr.yaml", ["data.root=${oc.env:SECRET_TOKEN}"])


def _places(synthetic_root: Path, tmp_path: Path, line: str) -> Path:
    from transfer.datasets.readers import PLACES205_LISTS

    root = tmp_path / "places205"
    shutil.copytree(synthetic_root / "places205", root)
    listing = root / PLACES205_LISTS / "train_places205.csv"
    listing.write_text(listing.read_text() + line + "\n")
    return root


@pytest.mark.parametrize("listed", ["../../../../etc/hostname 0", "/etc/hostname 0"])
def test_places205_lists_stay_inside_their_root(listed, synthetic_root, tmp_path):
    from transfer.datasets.readers import read_places205

    root = _places(synthetic_root, tmp_path, listed)
    with pytest.raises(PathEscapeError) as e:
        read_places205(root, "train")
    assert "\n" not in str(e.value) and "train_places205.csv" in str(e.value) and listed.split()[0] in str(e.value)


def test_voc_split_ids_stay_inside_their_root(synthetic_root, tmp_path):
    from transfer.datasets.readers import read_voc_labels

    voc = tmp_path / "VOC2007"
    shutil.copytree(synthetic_root / "VOC2007", voc)
    for f in (voc / "ImageSets" / "Main").glob("*_trainval.txt"):
        f.write_text(f.read_text() + "../../../etc/passwd -1\n")
    with pytest.raises(PathEscapeError, match=r"'\.\./\.\./\.\./etc/passwd'.*'\.\.' component"):
        read_voc_labels(voc, "trainval")


def test_detection_lists_stay_inside_their_root(detection, synthetic_root, tmp_path):
    from transfer.detection.datasets import check_datasets, register_datasets

    root = tmp_path / "data"
    shutil.copytree(synthetic_root / "coco", root / "coco")
    shutil.copytree(synthetic_root / "VOC2007", root / "VOC2007")
    coco = root / "coco" / "annotations" / "instances_val2017.json"
    data = json.loads(coco.read_text())
    data["images"][0]["file_name"] = "/etc/hostname"  # accepted as a COCO image before issue 27
    coco.write_text(json.dumps(data))
    split = root / "VOC2007" / "ImageSets" / "Main" / "test.txt"
    split.write_text(split.read_text() + "../../../../etc/hostname\n")
    register_datasets(root)
    try:
        with pytest.raises(PathEscapeError, match="'/etc/hostname' is an absolute path"):
            check_datasets(["coco_2017_val"], root, load=True)
        with pytest.raises(PathEscapeError, match=r"test\.txt: image id '\.\./\.\./\.\./\.\./etc/hostname'"):
            check_datasets(["voc_2007_test"], root, load=True)
    finally:
        register_datasets()


def test_a_detection_config_cannot_send_its_output_outside(detection, synthetic_root, tmp_path):
    *_, main = detection
    config = tmp_path / "downloaded.yaml"
    config.write_text(f"_BASE_: {TINY_VOC}\nOUTPUT_DIR: ../../../escaped_detection\n")
    exit_line(lambda: main(["--config-file", str(config), "--data-root", str(synthetic_root)]), config)
    assert not (tmp_path.parents[2] / "escaped_detection").exists()


# ------------------------------------------------------------------------------ nothing silently wrong


def _convert(src: Path, tmp_path: Path, capsys) -> str:
    out = tmp_path / "out.pth"
    assert to_torchvision.main([str(src), str(out)]) == 1
    assert not out.exists()
    return one_line(capsys.readouterr().err, src)


def test_non_finite_weights_are_refused(tmp_path, resnet18_state, capsys):
    state = dict(resnet18_state)
    state["layer3.0.conv1.weight"] = torch.full_like(state["layer3.0.conv1.weight"], float("nan"))
    torch.save(state, tmp_path / "nan.pth")
    assert "layer3.0.conv1.weight holds 294912 non-finite values" in _convert(tmp_path / "nan.pth", tmp_path, capsys)


def test_a_wrapped_and_a_plain_copy_of_one_key_are_a_collision(tmp_path, resnet18_state, capsys):
    state = {**resnet18_state, **{f"module.{k}": torch.zeros_like(v) for k, v in resnet18_state.items()}}
    torch.save({"state_dict": state}, tmp_path / "two_copies.pth")
    line = _convert(tmp_path / "two_copies.pth", tmp_path, capsys)
    assert "both read as 'conv1.weight'" in line and "two copies" in line


@pytest.mark.parametrize("kind", ["sparse", "sparse_legacy", "meta", "integer"])
def test_tensors_must_be_dense_floating_point(kind, tmp_path, resnet18_state, capsys):
    # sparse_legacy: the legacy format's dry run rebuilds the sparse tensor on meta storages, and
    # must not leave it queued for torch's validation of the real load
    state = dict(resnet18_state)
    w = state["layer1.0.conv1.weight"]
    state["layer1.0.conv1.weight"] = {
        "sparse": w.to_sparse(),
        "sparse_legacy": w.to_sparse(),
        "meta": torch.empty(w.shape, device="meta"),
        "integer": w.to(torch.int32),
    }[kind]
    torch.save(state, tmp_path / f"{kind}.pth", _use_new_zipfile_serialization=kind != "sparse_legacy")
    line = _convert(tmp_path / f"{kind}.pth", tmp_path, capsys)
    assert "layer1.0.conv1.weight" in line and ("dense" in line or "floating point" in line)


def test_detection_weights_with_nan_are_refused(detection, tmp_path):
    config, *_ = detection
    path = tmp_path / "nan.pkl"
    path.write_bytes(pickle.dumps({"model": {"w": np.full(3, np.nan, np.float32)}, "__author__": "x"}))
    with pytest.raises(ConfigError, match="w holds 3 non-finite values"):
        config.read_weights(str(path))


def test_an_image_folder_with_a_symlink_loop_is_scanned_once(tmp_path):
    from pretrain.data import _scan
    from transfer.datasets.readers import read_image_folder

    for cls in ("a", "b"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for i in range(2):
            (tmp_path / "data" / cls / f"{i}.jpg").write_bytes(b"x")
    (tmp_path / "data" / "a" / "loop").symlink_to(tmp_path / "data" / "a")  # a/loop/loop/... without end
    (tmp_path / "data" / "b" / "again").symlink_to(tmp_path / "data" / "a")  # a's images a second time
    assert len(read_image_folder(tmp_path / "data")) == 4
    samples, classes = _scan(tmp_path / "data")
    assert len(samples) == 4 and classes == ["a", "b"]


# ------------------------------------------------------------------------ one line for each bad input


def bomb_png(path: Path) -> Path:
    """69 bytes whose header claims 100000 x 100000 pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )
    return path


def test_a_decompression_bomb_is_one_line_in_process_and_from_a_worker(tmp_path):
    from torch.utils.data import DataLoader

    from contrastive_transfer.cli import describe
    from transfer.datasets.readers import read_image_folder

    (tmp_path / "data" / "cls").mkdir(parents=True)
    bomb = bomb_png(tmp_path / "data" / "cls" / "bomb.png")
    images = read_image_folder(tmp_path / "data")
    with pytest.raises(OSError) as e:
        images[0]
    assert "\n" not in describe(e.value) and str(bomb) in describe(e.value) and "pixels" in describe(e.value)
    with pytest.raises(OSError) as e:  # the 17-line "error" of a worker, collapsed to its own line
        next(iter(DataLoader(images, num_workers=1, collate_fn=lambda batch: batch)))
    assert "\n" in str(e.value)  # torch puts the worker's traceback in the message...
    line = describe(e.value)  # ...and the one line of `error: ...` is the worker's own
    assert "\n" not in line and line.startswith(f"cannot read image {bomb}"), line


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>
<annotation><size><width>10</width><height>10</height></size><object><name>&lol2;</name></object></annotation>
"""


@pytest.mark.parametrize(
    "xml, expected",
    [
        (BILLION_LAUGHS, "refused (EntitiesForbidden"),
        ("<annotation><object><name>dog</name></object></annotation>", "no <size> with integer"),
        (
            "<annotation><size><width>9</width><height>9</height></size><object><name>unicorn</name>"
            "<bndbox><xmin>1</xmin><ymin>1</ymin><xmax>5</xmax><ymax>5</ymax></bndbox></object></annotation>",
            "object class 'unicorn' is not one of the 20 VOC classes",
        ),
        ("<annotation><size><width>9</width>", "refused (ParseError"),
    ],
)
def test_bad_voc_xml_is_one_line(detection, xml, expected, synthetic_root, tmp_path):
    from transfer.detection.datasets import DatasetError, check_datasets, register_datasets

    voc = tmp_path / "data" / "VOC2007"
    shutil.copytree(synthetic_root / "VOC2007", voc)
    first = (voc / "ImageSets" / "Main" / "test.txt").read_text().split()[0]
    (voc / "Annotations" / f"{first}.xml").write_text(xml)
    register_datasets(tmp_path / "data")
    try:
        with pytest.raises(DatasetError) as e:
            check_datasets(["voc_2007_test"], tmp_path / "data", load=True)
    finally:
        register_datasets()
    assert "\n" not in str(e.value) and f"{first}.xml" in str(e.value) and expected in str(e.value), str(e.value)


def test_a_voc_split_of_one_id_loads(detection, synthetic_root, tmp_path):
    from detectron2.data import DatasetCatalog

    from transfer.detection.datasets import register_datasets

    voc = tmp_path / "data" / "VOC2007"
    shutil.copytree(synthetic_root / "VOC2007", voc)
    split = voc / "ImageSets" / "Main" / "test.txt"
    split.write_text(split.read_text().split()[0] + "\n")  # np.loadtxt made this a 0-d array
    register_datasets(tmp_path / "data")
    try:
        assert len(DatasetCatalog.get("voc_2007_test")) == 1
    finally:
        register_datasets()


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda d: [d], "holds a list, expected a COCO instances object"),
        (lambda d: d["images"][0].pop("height") and d, "images[0] lacks 'height'"),
        (lambda d: d["annotations"][0].pop("bbox") and d, "annotations[0] lacks 'bbox'"),
        (lambda d: d["categories"].append({"id": 999, "name": "unicorn"}) or d, "category ids [999]"),
        (lambda d: d["annotations"].insert(0, "x") or d, "annotations[0] not an object"),
    ],
)
def test_bad_coco_json_is_one_line(detection, change, expected, synthetic_root, tmp_path):
    from transfer.detection.datasets import DatasetError, check_datasets, register_datasets

    root = tmp_path / "data"
    shutil.copytree(synthetic_root / "coco", root / "coco")
    path = root / "coco" / "annotations" / "instances_val2017.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    register_datasets(root)
    try:
        with pytest.raises(DatasetError) as e:
            check_datasets(["coco_2017_val"], root, load=True)
    finally:
        register_datasets()
    assert "\n" not in str(e.value) and str(path) in str(e.value) and expected in str(e.value), str(e.value)


def test_coco_json_that_is_not_utf8_is_one_line(detection, synthetic_root, tmp_path):
    from transfer.detection.datasets import DatasetError, check_datasets, register_datasets

    root = tmp_path / "data"
    shutil.copytree(synthetic_root / "coco", root / "coco")
    path = root / "coco" / "annotations" / "instances_val2017.json"
    path.write_bytes(b'{"images": "\xff\xfe"}')
    register_datasets(root)
    try:
        with pytest.raises(DatasetError, match="is not UTF-8 text") as e:
            check_datasets(["coco_2017_val"], root, load=True)
    finally:
        register_datasets()
    assert "\n" not in str(e.value)


ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(7)
)


def test_nested_yaml_aliases_are_refused_before_they_expand(detection, tmp_path):
    import time

    from pretrain.__main__ import main as pretrain_main

    recipe = tmp_path / "aliases.yaml"
    recipe.write_text(
        f"_base_: {REPO / 'configs' / 'pretrain' / 'tiny_simclr.yaml'}\nmethod:\n  x:\n"
        + "".join(f"    {line}\n" for line in ALIAS_BOMB.splitlines())
    )
    start = time.perf_counter()
    line = exit_line(lambda: pretrain_main(["--config", str(recipe), "--print-config"]), recipe)
    assert "anchors and aliases" in line and time.perf_counter() - start < 5
    *_, main = detection
    evil = tmp_path / "evil_base.yaml"
    evil.write_text(ALIAS_BOMB)
    config = tmp_path / "innocent.yaml"
    config.write_text(f"_BASE_: [{TINY_VOC}, evil_base.yaml]\n")
    exit_line(lambda: main(["--config-file", str(config), "--data-root", str(tmp_path)]), evil)


def test_files_that_are_not_utf8_are_one_line(synthetic_root, tmp_path):
    from pretrain.analysis.__main__ import main as analysis
    from transfer.datasets.readers import read_places205, read_voc_labels

    places = _places(synthetic_root, tmp_path, "")
    listing = next((places / "trainvalsplit_places205").glob("train_*.csv"))
    listing.write_bytes(b"a/abbey/\xff.jpg 0\n")
    with pytest.raises(UserError, match="Places205 list is not UTF-8 text") as e:
        read_places205(places, "train")
    assert str(listing) in str(e.value)
    voc = tmp_path / "VOC2007"
    shutil.copytree(synthetic_root / "VOC2007", voc)
    (voc / "ImageSets" / "Main" / "dog_trainval.txt").write_bytes(b"\xfe\xff 1\n")
    with pytest.raises(UserError, match="dog_trainval.txt: the VOC class file is not UTF-8"):
        read_voc_labels(voc, "trainval")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": \xff}\n')
    exit_line(lambda: analysis(["curves", str(tmp_path / "run")]), tmp_path / "run" / "metrics.jsonl")


def test_npc_on_a_checkpoint_whose_config_lacks_keys_is_one_line(tmp_path):
    from pretrain.analysis.__main__ import main as analysis

    src = tmp_path / "checkpoint_last.pth"
    torch.save({"method": {}, "optimizer": {}, "step": 1, "config": {"method": {"name": "simclr"}}}, src)
    line = exit_line(lambda: analysis(["npc", str(src)]), src)
    assert "cannot rebuild simclr" in line


def test_the_defusedxml_voc_reader_builds_detectron2s_records(detection, synthetic_root):
    from detectron2.data.datasets.pascal_voc import CLASS_NAMES, load_voc_instances

    from transfer.detection.datasets import _voc_record

    voc = synthetic_root / "VOC2007"
    reference = load_voc_instances(str(voc), "test", CLASS_NAMES)
    ours = [_voc_record("voc_2007_test", voc, str(r["image_id"]), list(CLASS_NAMES)) for r in reference]
    assert ours == reference and sum(len(r["annotations"]) for r in ours) > 0


def test_the_legacy_torch_format_is_refused_naming_the_global_too(tmp_path, marker):
    """torch.save(_use_new_zipfile_serialization=False) writes several pickles one after another:
    get_unsafe_globals_in_checkpoint cannot read it, the opcode scan names the payload."""
    src = tmp_path / "legacy.pth"
    torch.save({"w": torch.ones(2), "x": Payload(marker)}, src, _use_new_zipfile_serialization=False)
    with pytest.raises(safe_load.UnsafeFileError, match=r"refers to (posix|nt)\.system beyond plain data"):
        safe_load.torch_load(src)
    assert not marker.exists()
