"""Contrastive losses as pure functions on similarities, plus thin nn.Module wrappers.

``LOSSES`` is what ``method.loss`` chooses on every InfoNCE host: a new loss is one class
(a ``ContrastiveLoss`` declaring its config keys, checks and construction) plus one line here."""

from .adversarial import AdversarialBank, adversary_gradient
from .dcl import DCLLoss, DCLWLoss, dclw_weights, decoupled_nce
from .dual_temperature import DualTemperatureLoss, dual_temperature_nce, dual_temperature_weights
from .infonce import (
    SAMPLING_MODES,
    ContrastiveLoss,
    InfoNCELoss,
    eqco_margin,
    in_batch_similarities,
    info_nce,
    mi_lower_bound,
    nt_xent_similarities,
    positive_number,
    sample_negatives,
    similarities,
)

LOSSES: dict[str, type[ContrastiveLoss]] = {
    "infonce": InfoNCELoss,
    "dcl": DCLLoss,
    "dclw": DCLWLoss,
    "dual_temperature": DualTemperatureLoss,
}
# Every loss's own keys with their defaults: a host declares them all, so that method.loss can be
# switched from the command line without other edits.
LOSS_CONFIG_KEYS = {key: default for loss in LOSSES.values() for key, default in loss.config_keys.items()}

__all__ = [
    "LOSSES",
    "LOSS_CONFIG_KEYS",
    "ContrastiveLoss",
    "DCLWLoss",
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
    "positive_number",
    "sample_negatives",
    "similarities",
]
