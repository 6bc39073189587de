"""Dual-temperature InfoNCE, the loss of SimMoCo and SimCo (``pretrain/methods/simco.py``).

Paper: Chaoning Zhang, Kang Zhang, Trung X. Pham, Axi Niu, Zhinan Qiao, Chang D. Yoo, In So Kweon,
"Dual Temperature Helps Contrastive Learning Without Many Negative Samples: Towards Understanding and
Simplifying MoCo", CVPR 2022, arXiv:2203.17248 (code: ChaoningZhang/Dual-temperature
``dual_temperature_loss_func``).

InfoNCE's gradient on the positive logit of anchor i scales with 1 − p_i (the inter-anchor
hardness); its distribution over the negatives is the intra-anchor hardness. Dual temperature
keeps the intra-anchor part at τ_α and swaps the inter-anchor scale for the one at τ_β:

    p_τ,i = e^{s₀,i/τ} / (e^{s₀,i/τ} + Σ_k e^{s_k,i/τ})
    w_i   = sg[(1 − p_τβ,i) / (1 − p_τα,i)]                  (sg = stop-gradient)
    L     = mean_i  w_i · (−log p_τα,i)

τ_α = 0.1 and τ_β = τ_α·dt_m = 1.0 in the paper; with τ_β = τ_α, w ≡ 1 and L is InfoNCE.

Numerics: 1 − p_α rounds to 0 in fp32 for near-one-hot logits, and the official ratio then gives
inf·0 = NaN. Here log(1 − p_τ) = logsumexp(s_k/τ) − logsumexp([s₀, s_k]/τ), exact in fp32, and
w is capped at the largest finite float so that it never becomes inf; the product w·(1 − p_α) = 1 − p_β that
reaches the gradient is unaffected wherever 1 − p_α is representable.
"""

from __future__ import annotations

import torch

from .infonce import ContrastiveLoss, reduce_loss
from .precision import fp32, no_autocast

__all__ = ["dual_temperature_weights", "dual_temperature_nce", "DualTemperatureLoss"]


def _log_one_minus_p(logits: torch.Tensor) -> torch.Tensor:
    """log(1 − softmax(logits)[:, 0]) per row, without forming 1 − p."""
    return torch.logsumexp(logits[:, 1:], dim=1) - torch.logsumexp(logits, dim=1)


@torch.no_grad()
def dual_temperature_weights(
    pos: torch.Tensor, neg: torch.Tensor, temperature: float, inter_temperature: float
) -> torch.Tensor:
    """w = (1 − p_τβ)/(1 − p_τα) per anchor, (N,), detached and finite. pos (N,), neg (N, K ≥ 1)."""
    with no_autocast(pos):
        logits = torch.cat([fp32(pos).unsqueeze(1), fp32(neg)], dim=1)
        log_w = _log_one_minus_p(logits / inter_temperature) - _log_one_minus_p(logits / temperature)
        return log_w.exp().clamp(max=torch.finfo(log_w.dtype).max)  # inf → the largest finite value


def dual_temperature_nce(
    pos: torch.Tensor, neg: torch.Tensor, temperature: float, inter_temperature: float, reduction: str = "mean"
) -> torch.Tensor:
    """mean_i w_i·(−log p_τα,i) with the detached weights of :func:`dual_temperature_weights`.

    Args: pos (N,) and neg (N, K) cosines; temperature τ_α (intra-anchor); inter_temperature τ_β.
    reduction: "mean" | "sum" | "none".
    """
    w = dual_temperature_weights(pos, neg, temperature, inter_temperature)
    with no_autocast(pos):
        logits = torch.cat([fp32(pos).unsqueeze(1), fp32(neg)], dim=1) / temperature
        loss = w * (torch.logsumexp(logits, dim=1) - logits[:, 0])
    return reduce_loss(loss, reduction)


class DualTemperatureLoss(ContrastiveLoss):
    """Dual-temperature InfoNCE on (pos (N,), neg (N, K)) cosines; τ_α = temperature, τ_β = inter_temperature.

    Example (with τ_β = τ_α the weights are 1 and the loss is InfoNCE)::

        >>> import torch
        >>> from pretrain.losses import InfoNCELoss
        >>> g = torch.Generator().manual_seed(0)
        >>> pos, neg = torch.rand(4, generator=g), torch.rand(4, 16, generator=g)
        >>> DualTemperatureLoss(temperature=0.1, inter_temperature=1.0)(pos, neg).shape
        torch.Size([])
        >>> torch.allclose(DualTemperatureLoss(0.1, 0.1)(pos, neg), InfoNCELoss(0.1)(pos, neg))
        True
    """

    def __init__(self, temperature: float, inter_temperature: float) -> None:
        super().__init__()
        self.temperature = temperature
        self.inter_temperature = inter_temperature

    def forward(self, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return dual_temperature_nce(pos, neg, self.temperature, self.inter_temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, inter_temperature={self.inter_temperature}"
