"""Older spellings and meanings of the pretraining config, translated in this one place.

A recipe, a command-line override or the config a checkpoint saved may come from an older version of
this code. ``upgrade`` rewrites any such tree (a plain dict) into today's spelling before anything
reads it; ``upgrade_saved`` also brings a checkpoint's complete config to what today's
``load_config`` derives, so that a resume compares like with like; ``upgrade_overrides`` does
the renames on ``key=value`` strings. When a key is renamed or changes
meaning, its one step goes here, never elsewhere.

The steps:

* **Loss options under their loss** (issue 37): ``method.loss`` was the loss's name and every loss's
  options sat directly under ``method:`` at once (``eqco_alpha``, ``dclw_sigma``, ``dclw_detach``,
  ``dclw_per_process``, ``inter_temperature``). Now ``method.loss`` is ``{name, the chosen loss's
  options}``: a name becomes ``{name: ...}`` and each old key moves into it under ``MOVED_TO_LOSS``.
* **The crop scale in the views**: ``data.min_crop_scale`` was applied when the views were built;
  now ``data.views`` carries it (``with_min_crop_scale``). Saved configs from before ``data.views``
  existed get the preset's views, which is what ran.
"""

from __future__ import annotations

import copy
from typing import Any

from pretrain.augment.views import ViewError, resolve, with_min_crop_scale
from pretrain.losses import LOSSES

# old key directly under `method:` → its key under `method.loss`
MOVED_TO_LOSS = {
    "eqco_alpha": "eqco_alpha",
    "dclw_sigma": "sigma",
    "dclw_detach": "detach",
    "dclw_per_process": "per_process",
    "inter_temperature": "inter_temperature",
}


def upgrade(tree: dict) -> dict:
    """``tree`` (a recipe, the overrides, or a saved config, as plain containers) in today's
    spelling; a copy. An old key given beside its new spelling wins: project recipes use the new
    one, so the old one comes from the user's own file, which is the more specific."""
    tree = copy.deepcopy(tree)
    method = tree.get("method")
    if isinstance(method, dict):
        loss = method.get("loss")
        if isinstance(loss, str):
            method["loss"] = {"name": loss}
        moved = {new: method.pop(old) for old, new in MOVED_TO_LOSS.items() if old in method}
        if moved:
            section = method.get("loss") if isinstance(method.get("loss"), dict) else {}
            method["loss"] = {**section, **moved}
    return tree


def upgrade_overrides(overrides: list[str]) -> list[str]:
    """Command-line ``key=value`` overrides in today's spelling, before they are parsed: the old
    ``method.loss=dcl`` beside a new ``method.loss.sigma=0.3`` would otherwise replace each other."""
    renamed = {
        "method.loss": "method.loss.name",
        **{f"method.{o}": f"method.loss.{n}" for o, n in MOVED_TO_LOSS.items()},
    }
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if key.strip() in renamed and not value.lstrip().startswith("{"):
            override = f"{renamed[key.strip()]}{sep}{value}"
        out.append(override)
    return out


def drop_other_losses_defaults(loss: dict, chosen: str) -> dict:
    """The ``method.loss`` section of a run of loss ``chosen`` without the options that belong to
    other losses and hold their defaults (a recipe of one loss switched to another with
    ``method.loss.name=...``; a config saved when every loss's options were present). Any other
    foreign option stays, for the config's check to name."""
    options = LOSSES[chosen].config_keys if isinstance(chosen, str) and chosen in LOSSES else {}

    def foreign_default(key: str, value: Any) -> bool:
        return key not in options and any(
            key in spec.config_keys and spec.config_keys[key] == value for spec in LOSSES.values()
        )

    return {key: value for key, value in loss.items() if key == "name" or not foreign_default(key, value)}


def upgrade_saved(config: dict) -> dict:
    """A checkpoint's saved config (complete, resolved) as today's ``load_config`` would give it."""
    if not isinstance(config, dict):
        return config
    config = upgrade(config)
    method = config.get("method")
    loss = method.get("loss") if isinstance(method, dict) else None
    if isinstance(loss, dict):
        config["method"]["loss"] = drop_other_losses_defaults(loss, loss.get("name"))
    data = config.get("data")
    if isinstance(data, dict) and "augmentation" in data:
        try:  # a file from elsewhere may hold anything here: what cannot be upgraded is compared as it is
            views = resolve(data["augmentation"], data.get("views"))
            scale = data.get("min_crop_scale")
            data["views"] = with_min_crop_scale(views, scale if isinstance(scale, (int, float)) else None)
        except (ViewError, TypeError, ValueError, AttributeError):
            pass
    return config
