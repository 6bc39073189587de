"""Contrastive losses as pure functions on similarities, plus thin nn.Module wrappers: one loss per
module (``infonce``, ``eqco``, ``nt_xent``, ``dcl``, ``dual_temperature``, AdCo's ``adversarial``
bank), the similarities they consume (``similarities``) and their fp32 discipline (``precision``).

``LOSSES`` (``registry``) is what ``method.loss.name`` chooses on every InfoNCE host, with the
options each loss reads from its own key ``method.loss``; the loss modules themselves know
nothing of the config, except a module that registers its own loss (``register_loss``): every
module of this package is imported here, so that a new one needs no line elsewhere."""

import importlib
import pkgutil

from .adversarial import AdversarialBank, adversary_gradient
from .dcl import DCLLoss, DCLWLoss, dclw_weights, decoupled_nce
from .dual_temperature import DualTemperatureLoss, dual_temperature_nce, dual_temperature_weights
from .eqco import EqCoLoss, eqco_margin
from .infonce import ContrastiveLoss, InfoNCELoss, info_nce, mi_lower_bound
from .nt_xent import NTXentLoss, nt_xent_similarities
from .registry import LOSSES, LossSpec, positive_number, register_loss
from .similarities import SAMPLING_MODES, in_batch_similarities, sample_negatives, similarities

__all__ = [
    "LOSSES",
    "LossSpec",
    "ContrastiveLoss",
    "DCLWLoss",
    "SAMPLING_MODES",
    "AdversarialBank",
    "DCLLoss",
    "DualTemperatureLoss",
    "EqCoLoss",
    "InfoNCELoss",
    "NTXentLoss",
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
    "register_loss",
    "sample_negatives",
    "similarities",
]

for _module in pkgutil.iter_modules(__path__):  # a loss module dropped in registers itself
    importlib.import_module(f"{__name__}.{_module.name}")
