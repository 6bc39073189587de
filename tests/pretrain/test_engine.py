"""The engine end to end on CPU: configs fail early and clearly, every tiny recipe trains, resume is
exact, a non-finite loss stops the run, and the optimizer/schedule/BN pieces match their formulas."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from contrastive_transfer.errors import ConfigError
from pretrain.config import load_config
from pretrain.engine import NonFiniteLossError, train
from pretrain.methods import METHODS
from pretrain.models import SplitBatchNorm, build_backbone
from pretrain.optim import LARS, lr_at

from ..method_cases import NARROW

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "pretrain"
TINY = sorted(p.stem for p in RECIPES.glob("tiny_*.yaml"))
PAPER = sorted(p.stem for p in RECIPES.glob("*.yaml") if not p.stem.startswith(("_", "tiny_")))


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def _cfg(recipe: str, *overrides: str, num_processes: int = 1):
    return load_config(RECIPES / f"{recipe}.yaml", list(overrides), num_processes)


def _run(accelerator, recipe, root, out, *overrides):
    cfg = _cfg(recipe, f"data.root={root / 'imagenet' / 'train'}", f"train.output_dir={out}", *overrides)
    return train(cfg, accelerator)


# ----------------------------------------------------------------------------------- configs
def test_every_paper_recipe_and_its_tiny_version_resolve():
    assert set(TINY) == {f"tiny_{r}" for r in PAPER}
    for recipe in PAPER + TINY:
        cfg = _cfg(recipe)
        assert cfg.method.name in METHODS
    v1, v2 = _cfg("mocov1"), _cfg("mocov2")
    assert (v1.method.head, v1.method.temperature, v1.data.augmentation, v1.optim.schedule) == (
        "linear",
        0.07,
        "mocov1",
        "step",
    )
    assert (v2.method.head, v2.method.temperature, v2.data.augmentation, v2.optim.schedule) == (
        "mlp",
        0.2,
        "mocov2",
        "cosine",
    )
    eqco = _cfg("mocov2_eqco")
    assert (eqco.method.loss.eqco_alpha, eqco.method.num_negatives, eqco.method.queue_size) == (65536, 256, 65536)
    simclr = _cfg("simclr")
    assert (simclr.optim.name, simclr.optim.exclude_norm_bias, simclr.optim.per_step, simclr.method.head) == (
        "lars",
        True,
        True,
        "mlp_bn",
    )
    assert _cfg("simo").method.loss.eqco_alpha == 256 and _cfg("simo_k16").method.num_negatives == 16
    tiny = _cfg("tiny_mocov1")  # inherits mocov1's method and _tiny's model
    assert (tiny.method.head, tiny.model.arch, tiny.model.stem, tiny.name) == (
        "linear",
        "resnet18",
        "imagenet",
        "tiny_mocov1",
    )


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["method.queue_sise=10"], "unknown key 'method.queue_sise'"),
        (["train.batchsize=8"], "allowed keys under train"),
        (["method.name=byol"], "method.name='byol': expected one of"),
        (["method.queue_size=100"], "method.queue_size=100: expected a positive multiple of the 256 keys"),
        (["method.num_negatives=70000"], "method.num_negatives=70000: expected 1..65536"),
        (["data.augmentation=randaug"], "data.augmentation='randaug': expected one of"),
        (["model.arch=vgg16"], "model.arch='vgg16'"),
        (["train.batch_size"], "expected key=value"),
        (["data.min_crop_scale=0"], "data.min_crop_scale=0: expected null"),
        (["data.min_crop_scale=1.5"], "data.min_crop_scale=1.5: expected null"),
    ],
)
def test_bad_configs_fail_with_one_clear_line(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        _cfg("mocov2", *overrides)


def test_batch_must_split_over_processes_and_cli_prints_one_line():
    with pytest.raises(ConfigError, match=r"train\.batch_size=256: expected a positive multiple of the 3 processes"):
        _cfg("mocov2", num_processes=3)
    with pytest.raises(ConfigError, match=r"method\.num_negatives=600: expected 1\.\.510"):
        _cfg("simclr_eqco", "method.num_negatives=600")
    res = subprocess.run(
        [sys.executable, "-m", "pretrain", "--config", str(RECIPES / "mocov2.yaml"), "method.queue_size=1000"],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and res.stderr.count("\n") == 1 and "method.queue_size=1000" in res.stderr


# ----------------------------------------------------------------------------------- training
@pytest.mark.parametrize("recipe", TINY)
def test_tiny_recipe_trains_without_nan_and_loss_moves(accelerator, synthetic_root, tmp_path, recipe):
    import json

    steps = ("train.max_steps=3", "train.diagnostics_every=2", "data.image_size=32", NARROW)  # 32 px: the
    final = _run(accelerator, recipe, synthetic_root, tmp_path, *steps)  # multi-crop's five query sizes fit
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 3 and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float)), rows
    assert max(losses) - min(losses) > 1e-4
    if METHODS[_cfg(recipe).method.name].needs_labels:  # trained on labels, no contrast: its own accuracy
        assert {"train_top1", "lr", "data_time"} <= set(rows[-1])
    else:
        assert {"mi_bound", "npc_mean", "npc_cv", "pos_cos", "neg_cos", "lr", "data_time"} <= set(rows[-1])
        assert "grad_q_norm_mean" in rows[1] and rows[1]["grad_q_norm_mean"] > 0
    ckpt = torch.load(final, weights_only=False)
    assert ckpt["method"] == _cfg(recipe).method.name and ckpt["arch"] == "resnet18_0.25x"
    net, _ = build_backbone("resnet18_0.25x", ckpt["stem"])
    net.load_state_dict(ckpt["backbone"])  # torchvision naming, nothing missing or extra


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# Every registered method resumes bit-exactly with the tiny encoder (test_registered.py); these two
# do it with a real ResNet-18 (NARROW): SplitBatchNorm (MoCo's bn_splits) and the SyncBN conversion.
@pytest.mark.parametrize("recipe", ["tiny_mocov2", "tiny_simclr"])
def test_two_steps_restart_two_steps_equals_four_steps(accelerator, synthetic_root, tmp_path, recipe):
    straight = torch.load(
        _run(accelerator, recipe, synthetic_root, tmp_path / "a", "train.max_steps=4", NARROW), weights_only=False
    )
    _run(accelerator, recipe, synthetic_root, tmp_path / "b", "train.max_steps=2", NARROW)
    resumed = torch.load(
        _run(accelerator, recipe, synthetic_root, tmp_path / "b", "train.max_steps=4", NARROW), weights_only=False
    )
    assert resumed["step"] == straight["step"] == 4
    for key, value in straight["backbone"].items():
        assert torch.equal(value, resumed["backbone"][key]), key
    a = torch.load(tmp_path / "a" / "checkpoint_last.pth", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoint_last.pth", weights_only=False)
    for key, value in a["method_state"].items():  # encoders, momentum encoder, queue and its pointer
        assert torch.equal(value, b["method_state"][key]), key


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(accelerator, synthetic_root, tmp_path):
    _run(accelerator, "tiny_simclr", synthetic_root, tmp_path, "train.max_steps=1", NARROW)
    last = tmp_path / "checkpoint_last.pth"
    before = _digest(last)
    with pytest.raises(
        NonFiniteLossError, match="non-finite loss .* at step [0-9]+ .*Last good checkpoint: .*checkpoint_last.pth"
    ):
        _run(
            accelerator,
            "tiny_simclr",
            synthetic_root,
            tmp_path,
            "train.max_steps=6",
            "optim.lr=1e38",
            "train.checkpoint_every=1000",
            NARROW,
        )
    assert _digest(last) == before


# ----------------------------------------------------------------------------------- pieces
def test_lr_schedule_matches_hand_computed_values():
    cfg = _cfg("mocov2", "train.epochs=10", "optim.lr=0.03", "train.batch_size=512")  # linear: 0.06
    assert lr_at(cfg, 0, 100) == pytest.approx(0.06)
    assert lr_at(cfg, 599, 100) == pytest.approx(0.06 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))  # per epoch
    v1 = _cfg("mocov1", "train.epochs=200")
    assert [lr_at(v1, e * 10, 10) for e in (0, 119, 120, 160)] == pytest.approx([0.03, 0.03, 0.003, 0.0003])
    simclr = _cfg("simclr", "train.epochs=100", "train.batch_size=4096")  # 0.3 × 16 = 4.8, warmup 10 ep
    assert lr_at(simclr, 0, 100) == pytest.approx(4.8 / 1000)
    assert lr_at(simclr, 499, 100) == pytest.approx(4.8 * 0.5)
    assert lr_at(simclr, 5500, 100) == pytest.approx(4.8 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    sqrt = _cfg(
        "simclr", "optim.lr_scaling=sqrt", "optim.lr=4.8", "optim.reference_batch=4096", "train.batch_size=1024"
    )
    assert lr_at(sqrt, 99, 10) == pytest.approx(0.075 * math.sqrt(1024))  # end of warmup: SimCLR's sqrt rule
    adco = _cfg("adco")  # AdCo's cosine ends at lr_final 0.0006: 0.0006 + ½(1 + cos(π·e/200))·(0.03 − 0.0006)
    assert [lr_at(adco, e * 10, 10) for e in (0, 100, 200)] == pytest.approx([0.03, 0.0153, 0.0006])
    assert lr_at(_cfg("adco", "train.batch_size=512"), 2000, 10) == pytest.approx(0.0012)  # scaled like optim.lr


def test_lars_step_matches_the_formula():
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    w.grad, b.grad = torch.randn(4, 3), torch.randn(3)
    w0, b0 = w.detach().clone(), b.detach().clone()
    opt = LARS(
        [{"params": [w], "weight_decay": 0.1, "lars": True}, {"params": [b], "weight_decay": 0.0, "lars": False}],
        lr=0.5,
        momentum=0.9,
        eta=0.01,
    )
    opt.step()
    g = w.grad + 0.1 * w0
    trust = 0.01 * w0.norm() / g.norm()
    assert torch.allclose(w.detach(), w0 - 0.5 * trust * g)
    assert torch.allclose(b.detach(), b0 - 0.5 * b.grad)


def test_split_batchnorm_matches_per_split_batchnorm():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4, 4)
    split, plain = SplitBatchNorm(3, num_splits=1), torch.nn.BatchNorm2d(3)
    assert torch.allclose(split(x), plain(x), atol=1e-6)
    assert torch.allclose(split.running_var, plain.running_var)
    two = SplitBatchNorm(3, num_splits=2)
    out = two(x)
    for s in range(2):  # sub-batch s holds samples s, s+2, ...
        ref = torch.nn.functional.batch_norm(x[s::2], None, None, training=True, eps=two.eps)
        assert torch.allclose(out[s::2], ref, atol=1e-5)
    with pytest.raises(ValueError, match="num_splits=3"):
        SplitBatchNorm(3, num_splits=3)(x)


def test_data_time_and_step_time_add_up_to_the_wall_time_between_rows(accelerator, synthetic_root, tmp_path, capsys):
    """data_time is the wait for the batch, step_time the rest of the step, checkpoint_time the save:
    consecutive rows' wall-clock ``time`` differ by their sum, within a few percent; the run ends
    by printing the fraction of wall time spent waiting for data."""
    import json

    _run(
        accelerator,
        "tiny_simclr",
        synthetic_root,
        tmp_path,
        "train.max_steps=8",
        "train.log_every=1",
        "train.checkpoint_every=3",
        "train.resume=none",
        "knn.train_dir=null",
    )
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    for before, row in zip(rows[1:], rows[2:]):  # rows[0]: the first batch's wait is before any row
        wall = row["time"] - before["time"]
        assert row["data_time"] > 0 and row["step_time"] > 0
        parts = row["data_time"] + row["step_time"] + row["checkpoint_time"]
        assert abs(wall - parts) <= 0.05 * wall + 2e-3, (row["step"], wall)
    assert "waited for data" in capsys.readouterr().out
