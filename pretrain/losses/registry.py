"""What ``method.loss.name`` names on every InfoNCE host, the options each loss reads under its own
key ``method.loss`` (with their defaults), their checks and how the loss is built from them.

A run's ``method.loss`` holds the chosen loss's name and that loss's options only, so adding a loss,
or an option to one, changes nothing for the runs of the others: what they print, save and compare
on resume. The losses themselves take plain arguments and know nothing of the config. A new loss is
one module: its class, and its ``from_config`` decorated with ``register_loss`` (any module of this
package is imported with it, so the decorator runs; a module elsewhere registers when imported).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contrastive_transfer.errors import ConfigError

from .dcl import DCLLoss, DCLWLoss
from .dual_temperature import DualTemperatureLoss
from .eqco import EqCoLoss
from .infonce import ContrastiveLoss, InfoNCELoss

__all__ = ["LossSpec", "LOSSES", "positive_number", "register_loss"]


def positive_number(section, key: str, where: str = "method") -> None:
    """ConfigError naming ``<where>.<key>`` unless it is a positive number."""
    value = section[key]
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ConfigError(f"{where}.{key}={value}: expected a positive number")


def _no_check(options) -> None:
    pass


@dataclass(frozen=True)
class LossSpec:
    """One choice of ``method.loss.name``. ``from_config(m)`` builds the loss from the ``method:``
    section (``m.temperature``, and the options in ``m.loss``); ``config_keys`` are the options with
    their defaults; ``check(options)`` raises ConfigError naming ``method.loss.<key>`` for
    impossible values."""

    from_config: Callable[[Any], ContrastiveLoss]
    config_keys: Mapping[str, Any] = field(default_factory=dict)
    check: Callable[[Any], None] = _no_check


def _infonce(m) -> ContrastiveLoss:
    if m.loss.eqco_alpha is None:
        return InfoNCELoss(float(m.temperature))
    return EqCoLoss(float(m.temperature), alpha=m.loss.eqco_alpha)


def _check_eqco(options) -> None:
    if options.eqco_alpha is not None:
        positive_number(options, "eqco_alpha", "method.loss")


LOSSES: dict[str, LossSpec] = {
    "infonce": LossSpec(
        _infonce,
        {"eqco_alpha": None},  # EqCo: margin τ·log(α/K) on the positive; None = plain InfoNCE
        _check_eqco,
    ),
    "dcl": LossSpec(lambda m: DCLLoss(float(m.temperature))),
    "dclw": LossSpec(
        lambda m: DCLWLoss(float(m.temperature), m.loss.sigma, bool(m.loss.detach), bool(m.loss.per_process)),
        {
            "sigma": 0.5,  # σ of the weights
            "detach": True,  # weights from detached similarities (lightly); False: they carry gradient
            "per_process": False,  # softmax over each process's anchors (lightly's form); default: global batch
        },
        lambda options: positive_number(options, "sigma", "method.loss"),
    ),
    "dual_temperature": LossSpec(
        lambda m: DualTemperatureLoss(float(m.temperature), float(m.loss.inter_temperature)),
        {"inter_temperature": 1.0},  # τ_β
        lambda options: positive_number(options, "inter_temperature", "method.loss"),
    ),
}


def register_loss(
    name: str, config_keys: Mapping[str, Any] | None = None, check: Callable[[Any], None] = _no_check
) -> Callable[[Callable[[Any], ContrastiveLoss]], Callable[[Any], ContrastiveLoss]]:
    """Decorates a loss's ``from_config(m)``: ``method.loss.name=<name>`` then builds the loss with
    it, ``config_keys`` (with their defaults) are the options allowed under ``method.loss`` and
    ``check(options)`` refuses impossible values (see ``LossSpec``). A name already taken by another
    loss is refused: two modules cannot silently replace each other's loss."""

    def register(from_config: Callable[[Any], ContrastiveLoss]) -> Callable[[Any], ContrastiveLoss]:
        spec = LossSpec(from_config, dict(config_keys or {}), check)
        if name in LOSSES and LOSSES[name].from_config is not from_config:
            raise ValueError(f"loss {name!r} is already registered (by {LOSSES[name].from_config.__module__})")
        LOSSES[name] = spec
        return from_config

    return register
