"""The DCL / dual-temperature / AdCo recipes: paper values, one-line config errors, and every tiny
recipe trains a few steps through the engine without NaN (shrunk further: 16 px, batch 8)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from contrastive_transfer.errors import ConfigError
from pretrain.config import load_config
from pretrain.engine import train

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "pretrain"
PAPER = ["dcl", "dclw", "mocov2_dcl", "simmoco", "simco", "adco", "adco_sym", "adco_multicrop"]
SHRINK = {  # per method: what keeps its own divisibility rules at batch 8
    "moco": ["method.queue_size=16", "method.bn_splits=2"],
    "adco": ["method.bank_size=8", "method.bn_splits=2"],  # 1 filling step, then adversarial steps
}


# What a tiny recipe may change under method: (each says why in its comment); the loss, its
# temperatures and the method's own switches stay the paper's.
CPU_SCALE_METHOD_KEYS = {"head", "momentum", "bn_splits", "queue_size", "bank_size"}


def _cfg(recipe: str, *overrides: str):
    return load_config(RECIPES / f"{recipe}.yaml", list(overrides))


def test_paper_recipes_carry_the_paper_values_and_have_tiny_versions():
    for recipe in PAPER:
        assert (RECIPES / f"tiny_{recipe}.yaml").is_file(), recipe
        tiny, paper = _cfg(f"tiny_{recipe}").method, _cfg(recipe).method
        changed = {key for key in tiny if tiny[key] != paper.get(key)}
        assert changed <= CPU_SCALE_METHOD_KEYS, f"tiny_{recipe} changes {sorted(changed - CPU_SCALE_METHOD_KEYS)}"
    dcl, dclw = _cfg("dcl"), _cfg("dclw")
    assert (
        dcl.method.name,
        dcl.method.loss.name,
        dcl.method.temperature,
        dcl.train.batch_size,
        dcl.train.epochs,
        dcl.data.augmentation,
    ) == ("simclr", "dcl", 0.1, 256, 200, "simclr")
    assert dict(dclw.method.loss) == {"name": "dclw", "sigma": 0.5, "detach": True, "per_process": False}
    moco_dcl = _cfg("mocov2_dcl")
    assert (
        moco_dcl.method.name,
        moco_dcl.method.loss.name,
        moco_dcl.method.temperature,
        moco_dcl.method.queue_size,
    ) == (
        "moco",
        "dcl",
        0.2,
        65536,
    )
    for recipe in ("simmoco", "simco"):
        m = _cfg(recipe).method
        assert (m.name, m.loss.name, m.temperature, m.loss.inter_temperature, m.head) == (
            recipe,
            "dual_temperature",
            0.1,
            1.0,
            "mlp",
        )
    assert _cfg("simmoco").method.momentum == 0.99 and not _cfg("simmoco").method.symmetric


@pytest.mark.parametrize(
    "recipe,overrides,expected",
    [
        (
            "dcl",
            ["method.loss.name=dcll"],
            "method.loss.name='dcll': expected one of ['infonce', 'dcl', 'dclw', 'dual_temperature']",
        ),
        (
            "dcl",
            ["method.loss.eqco_alpha=4096"],
            "method.loss.eqco_alpha=4096: an option of method.loss.name=infonce only (this run's loss is dcl); "
            "remove it or set method.loss.eqco_alpha=null",
        ),
        ("dclw", ["method.loss.sigma=0"], "method.loss.sigma=0: expected a positive number"),
        ("dcl", ["method.loss.sigma=0.3"], "method.loss.sigma=0.3: an option of method.loss.name=dclw only"),
        ("dcl", ["method.loss.bogus=1"], "unknown key 'method.loss.bogus' (method simclr, loss dcl)"),
        ("simco", ["method.momentum=0.99"], "unknown key 'method.momentum' (method simco)"),
        ("simco", ["method.loss.inter_temperature=-1"], "method.loss.inter_temperature=-1: expected a positive number"),
        ("adco", ["method.loss=dcl"], "unknown key 'method.loss' (method adco)"),
    ],
)
def test_bad_configs_fail_with_one_clear_line(recipe, overrides, expected):
    with pytest.raises(ConfigError) as e:
        _cfg(recipe, *overrides)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


@pytest.mark.parametrize("recipe", [f"tiny_{r}" for r in PAPER])
def test_tiny_recipe_trains_without_nan(accelerator, synthetic_root, tmp_path, recipe):
    method = _cfg(recipe).method.name
    cfg = _cfg(
        recipe,
        f"data.root={synthetic_root / 'imagenet' / 'train'}",
        f"train.output_dir={tmp_path}",
        "train.max_steps=3",
        "train.batch_size=8",
        "data.image_size=16",
        "train.diagnostics_every=2",
        *SHRINK.get(method, []),
    )
    final = torch.load(train(cfg, accelerator), weights_only=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(v) for r in rows for k, v in r.items() if isinstance(v, float)), rows
    assert {"mi_bound", "npc_mean", "npc_cv", "pos_cos", "neg_cos"} <= rows[-1].keys()
    assert rows[1].get("grad_q_norm_mean", 0) > 0
    assert final["method"] == method and final["step"] == 3
    assert all(torch.isfinite(v).all() for v in final["backbone"].values() if v.is_floating_point())
