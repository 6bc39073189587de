"""What ``method.loss`` names on every InfoNCE host, the options each loss reads under ``method:``
(with their defaults), their checks and how the loss is built from them.

The losses themselves take plain arguments and know nothing of the config; a new loss is one module
plus one entry here.
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

__all__ = ["LossSpec", "LOSSES", "LOSS_CONFIG_KEYS", "positive_number"]


def positive_number(m, key: str) -> None:
    """ConfigError naming ``method.<key>`` unless it is a positive number."""
    value = m[key]
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ConfigError(f"method.{key}={value}: expected a positive number")


def _no_check(m) -> None:
    pass


@dataclass(frozen=True)
class LossSpec:
    """One choice of ``method.loss``. ``from_config(m)`` builds the loss from the ``method:`` section
    (which always has ``temperature``); ``check(m)`` raises ConfigError naming the key for impossible
    values of ``config_keys``."""

    from_config: Callable[[Any], ContrastiveLoss]
    config_keys: Mapping[str, Any] = field(default_factory=dict)
    check: Callable[[Any], None] = _no_check


def _infonce(m) -> ContrastiveLoss:
    if m.eqco_alpha is None:
        return InfoNCELoss(float(m.temperature))
    return EqCoLoss(float(m.temperature), alpha=m.eqco_alpha)


def _check_eqco(m) -> None:
    if m.eqco_alpha is not None:
        positive_number(m, "eqco_alpha")


LOSSES: dict[str, LossSpec] = {
    "infonce": LossSpec(
        _infonce,
        {"eqco_alpha": None},  # EqCo: margin τ·log(α/K) on the positive; None = plain InfoNCE
        _check_eqco,
    ),
    "dcl": LossSpec(lambda m: DCLLoss(float(m.temperature))),
    "dclw": LossSpec(
        lambda m: DCLWLoss(float(m.temperature), m.dclw_sigma, bool(m.dclw_detach), bool(m.dclw_per_process)),
        {
            "dclw_sigma": 0.5,  # σ of the weights
            "dclw_detach": True,  # weights from detached similarities (lightly); False: they carry gradient
            "dclw_per_process": False,  # softmax over each process's anchors (lightly's form); default: global batch
        },
        lambda m: positive_number(m, "dclw_sigma"),
    ),
    "dual_temperature": LossSpec(
        lambda m: DualTemperatureLoss(float(m.temperature), float(m.inter_temperature)),
        {"inter_temperature": 1.0},  # τ_β
        lambda m: positive_number(m, "inter_temperature"),
    ),
}
# Every loss's own keys with their defaults: a host declares them all, so that method.loss can be
# switched from the command line without other edits.
LOSS_CONFIG_KEYS = {key: default for spec in LOSSES.values() for key, default in spec.config_keys.items()}
