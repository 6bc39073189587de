"""The recipes beyond plain InfoNCE (DCL, dual temperature, AdCo): paper values and one-line config
errors. Every tiny recipe trains in test_engine.py, every method and loss in test_registered.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from contrastive_transfer.errors import ConfigError
from pretrain.config import load_config
from pretrain.losses import LOSSES

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "pretrain"


# What a tiny recipe may change under method: (each says why in its comment); the loss, its
# temperatures and the method's own switches stay the paper's.
CPU_SCALE_METHOD_KEYS = {"head", "momentum", "bn_splits", "queue_size", "bank_size", "num_classes"}


def _cfg(recipe: str, *overrides: str):
    return load_config(RECIPES / f"{recipe}.yaml", list(overrides))


def _loss(recipe: str) -> str | None:
    method = _cfg(recipe).method
    return method.loss.name if "loss" in method else None  # AdCo and the supervised baseline: their own


# The paper recipes whose loss is not plain InfoNCE (another registered loss, or a method's own).
PAPER = [
    r
    for r in sorted(p.stem for p in RECIPES.glob("*.yaml") if not p.stem.startswith(("_", "tiny_")))
    if _loss(r) != "infonce"
]


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
            f"method.loss.name='dcll': expected one of {list(LOSSES)}",
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
