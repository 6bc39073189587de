"""Contrastive losses as pure functions on similarities, plus thin nn.Module wrappers."""

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
    "InfoNCELoss",
    "eqco_margin",
    "in_batch_similarities",
    "info_nce",
    "mi_lower_bound",
    "nt_xent_similarities",
    "sample_negatives",
    "similarities",
]
