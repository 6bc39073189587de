"""Decoupled contrastive learning: DCL and DCLW (Yeh et al., "Decoupled Contrastive Learning").

InfoNCE's gradient for anchor i is scaled by the negative-positive coupling (NPC) multiplier
q_B,i = 1 − e^{s₀/τ} / (e^{s₀/τ} + Σ_k e^{s_k/τ}) (DCL paper, Prop. 1). DCL removes the positive
from the denominator, which removes the multiplier:

    L_i = −w_i·s₀,i/τ + log Σ_{k=1..K} e^{s_k,i/τ}          (Eq. 6; w ≡ 1 for DCL)

so ∂L_i/∂s₀,i = −w_i/τ whatever the negatives are. On the SimCLR host the K = 2B−2 negatives
of an anchor are the same-view *and* cross-view others in **one** logsumexp (lightly before
PR #1827 used two separate ones, which is wrong). The loss can be negative: that is expected.

DCLW weights the positive term by a von Mises–Fisher weighting over the batch (σ = 0.5):

    w_i = 2 − exp(s₀,i/σ) / mean_j exp(s₀,j/σ) = 2 − N·softmax_j(s₀,j/σ)_i,  mean_i w_i = 1

Easy positives (large s₀) get less weight, hard ones more; w can be negative when one pair
dominates (softmax > 2/N). The weights are computed from detached similarities by default
(lightly's choice, PR #793; the paper is silent and raminnakhli's port does not detach), over
the anchors this process holds.

Inputs are cosines; logits are computed in (at least) fp32 with autocast off, like ``info_nce``.
"""

from __future__ import annotations

import torch
from torch import nn

from .infonce import _fp32, _no_autocast, reduce_loss

__all__ = ["decoupled_nce", "dclw_weights", "DCLLoss"]


def dclw_weights(pos: torch.Tensor, sigma: float = 0.5, detach: bool = True) -> torch.Tensor:
    """w = 2 − N·softmax(pos/σ) over the N anchors (dim 0); mean 1. pos: (N,) positive cosines.

    Duplicated anchors (SimCLR's [z1; z2] rows share their positive) give the same weights as
    the N distinct pairs: 2 − 2N·e_i/(2Σe) = 2 − N·e_i/Σe.
    """
    with _no_autocast(pos):
        pos = _fp32(pos.detach() if detach else pos)
        return 2.0 - pos.shape[0] * torch.softmax(pos / sigma, dim=0)


def decoupled_nce(
    pos: torch.Tensor,
    neg: torch.Tensor,
    temperature: float,
    pos_weight: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """L_n = −w_n·pos[n]/τ + logsumexp_k(neg[n, k]/τ): the positive is not in the denominator.

    Args:
        pos: (N,) positive cosines. neg: (N, K) negative cosines (K ≥ 1).
        pos_weight: (N,) DCLW weights w (see :func:`dclw_weights`); None means w ≡ 1 (DCL).
        reduction: "mean" | "sum" | "none".
    """
    with _no_autocast(pos):
        pos, neg = _fp32(pos), _fp32(neg)
        positive = pos / temperature if pos_weight is None else _fp32(pos_weight) * pos / temperature
        loss = torch.logsumexp(neg / temperature, dim=1) - positive
    return reduce_loss(loss, reduction)


class DCLLoss(nn.Module):
    """DCL (``weight_sigma=None``) or DCLW (weights with σ = ``weight_sigma``) on (pos (N,), neg (N, K))."""

    def __init__(self, temperature: float, weight_sigma: float | None = None, detach_weights: bool = True) -> None:
        super().__init__()
        self.temperature = temperature
        self.weight_sigma = weight_sigma
        self.detach_weights = detach_weights

    def forward(self, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        w = None if self.weight_sigma is None else dclw_weights(pos, self.weight_sigma, self.detach_weights)
        return decoupled_nce(pos, neg, self.temperature, w)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, weight_sigma={self.weight_sigma}, detach_weights={self.detach_weights}"
