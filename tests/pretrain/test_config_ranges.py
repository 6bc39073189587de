"""Every numeric key of a pretraining config has a range, enforced when the config resolves
(issue 48): the schema is walked (the engine's keys, every method's and every loss's), not listed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from contrastive_transfer.errors import ConfigError
from pretrain.config import _NULLABLE, RANGES, _leaves, config_defaults, load_config, range_of, saved_config
from pretrain.losses import LOSSES
from pretrain.methods import METHODS

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "configs" / "pretrain"


def schemas() -> list[tuple[str, str | None, dict]]:
    """(method, loss, defaults) for every method and, for an InfoNCE host, every loss."""
    out = []
    for method, cls in METHODS.items():
        for loss in [None, *LOSSES] if "loss" in cls.defaults else [None]:
            out.append((method, loss, OmegaConf.to_container(config_defaults(method, loss))))
    return out


def numeric_keys(defaults: dict) -> dict[str, object]:
    """Every key of the schema that holds a number: by its default, or by the kinds a null default
    takes (``_NULLABLE``)."""
    found = {}
    for key, value in _leaves(defaults):
        numeric_default = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric_default or (value is None and {"int", "float"} & set(_NULLABLE.get(key, ()))):
            found[key] = value
    return found


def keys_without_range(defaults: dict) -> list[str]:
    return sorted(key for key in numeric_keys(defaults) if range_of(key) is None)


def test_every_numeric_key_of_every_method_and_loss_has_a_range_holding_its_default():
    seen = set()
    for method, loss, defaults in schemas():
        assert keys_without_range(defaults) == [], (method, loss)
        for key, value in numeric_keys(defaults).items():
            seen.add(range_of(key))
            assert value is None or range_of(key).holds(value), (method, loss, key, value, range_of(key))
    assert len(numeric_keys(schemas()[0][2])) > 20  # the walk reaches the engine's keys
    assert set(RANGES.values()) <= seen, "a range for a key no schema has"


def test_control_a_numeric_key_without_a_range_is_found():
    defaults = OmegaConf.to_container(config_defaults("simclr"))
    defaults["method"]["new_knob"] = 3
    defaults["optim"]["betas"] = [0.9, 0.999]
    assert keys_without_range(defaults) == ["method.new_knob", "optim.betas.0", "optim.betas.1"]


def _recipe_with(key: str) -> Path:
    """A tiny recipe whose method and loss have ``key`` (the first, by name)."""
    for recipe in sorted(RECIPES.glob("tiny_*.yaml")):
        cfg = load_config(recipe)
        defaults = OmegaConf.to_container(config_defaults(cfg.method.name, OmegaConf.select(cfg, "method.loss.name")))
        if key.replace(".N", ".0") in numeric_keys(defaults):
            return recipe
    raise AssertionError(f"no tiny recipe has {key}")


@pytest.mark.parametrize("key", sorted(RANGES))
def test_a_value_beyond_each_range_is_one_line_naming_the_key_the_value_and_the_range(key):
    allowed = RANGES[key]
    recipe = _recipe_with(key)
    high = allowed.high + 1 if isinstance(allowed.high, int) else allowed.high * 2
    dotted = key.replace(".N", ".0")
    below = allowed.low if allowed.above else allowed.low - 1
    # no value lies above an unbounded range (a learning rate): inf is refused as not finite
    for value in (below,) if allowed.high == math.inf else (high, below):
        override = f"{dotted}={value}"
        if key.endswith(".N"):  # a list is given whole on the command line: its first item changed
            items = list(OmegaConf.select(load_config(recipe), key[:-2]))
            override = f"{key[:-2]}=[{', '.join(map(str, [value, *items[1:]]))}]"
        with pytest.raises(ConfigError) as e:
            load_config(recipe, [override])
        message = str(e.value)
        assert f"{dotted}={value}" in message and str(allowed) in message and "\n" not in message, message


def test_a_million_loader_processes_is_refused_and_the_recipes_value_loads():
    recipe = RECIPES / "tiny_simclr.yaml"
    with pytest.raises(ConfigError, match=r"data\.num_workers=1000000: expected a value in \[0, \d+\]"):
        load_config(recipe, ["data.num_workers=1000000"])
    assert load_config(recipe, ["data.num_workers=8"]).data.num_workers == 8  # the control


def test_a_saved_config_is_held_to_the_ranges_except_the_machines_own():
    config = OmegaConf.to_container(load_config(RECIPES / "tiny_simclr.yaml"))
    config["data"]["num_workers"] = RANGES["data.num_workers"].high + 1  # another machine's: read
    assert saved_config(config, "c.pth").data.num_workers == config["data"]["num_workers"]
    config["train"]["seed"] = 2**40
    with pytest.raises(ConfigError, match=r"c\.pth: train\.seed=1099511627776: expected a value in \[0, 4294967295\]"):
        saved_config(config, "c.pth")
    config["train"]["seed"] = 10**5000  # Python refuses to print it: the message says its size
    with pytest.raises(ConfigError, match=r"train\.seed=<an integer of 16610 bits>"):
        saved_config(config, "c.pth")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("data.views.0.crop.size=100000", "data.views.0.crop.size=100000: expected an integer from 1 to 4096"),
        ("data.views.1.blur.kernel=1000001", "data.views.1.blur.kernel=1000001: expected an integer from 1 to 1023"),
        ("data.views.0.crop.size=1.5", "data.views.0.crop.size=1.5: expected an integer from 1 to 4096"),
    ],
)
def test_the_view_parameters_that_size_memory_are_bounded(override, expected):
    recipe = RECIPES / "tiny_simclr.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(recipe, [override])
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert load_config(recipe, ["data.views.0.crop.size=64"]).data.views[0]["crop"]["size"] == 64  # the control


def test_the_number_of_views_is_bounded(tmp_path):
    from pretrain.augment.views import MAX_VIEWS

    recipe = tmp_path / "many_views.yaml"
    view = "  - {crop: {size: 16}}\n"
    recipe.write_text(f"_base_: {RECIPES / 'tiny_simclr.yaml'}\ndata:\n views:\n" + view * (MAX_VIEWS + 1))
    with pytest.raises(ConfigError, match=f"data.views: {MAX_VIEWS + 1} views, expected at most {MAX_VIEWS}"):
        load_config(recipe)
