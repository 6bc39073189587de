"""Contrastive losses as pure functions on similarities, plus thin nn.Module wrappers."""

from .adversarial import AdversarialBank, adversary_gradient
from .dcl import DCLLoss, dclw_weights, decoupled_nce
from .dual_temperature import DualTemperatureLoss, dual_temperature_nce, dual_temperature_weights
from .infonce import (
    SAMPLING_MODES,
    InfoNCELoss,
    eqco_margin,
    in_batch_similarities,
    info_nce,
    mi_lower_bound,
    nt_xent_similarities,
    sample_negatives,
    similarities,
)

__all__ = [
    "SAMPLING_MODES",
    "AdversarialBank",
    "DCLLoss",
    "DualTemperatureLoss",
    "InfoNCELoss",
    "adversary_gradient",
    "dclw_weights",
    "decoupled_nce",
    "dual_temperature_nce",
    "dual_temperature_weights",
    "eqco_margin",
    "in_batch_similarities",
    "info_nce",
    "mi_lower_bound",
    "nt_xent_similarities",
    "sample_negatives",
    "similarities",
]
