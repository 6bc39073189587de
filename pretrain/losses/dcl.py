"""Decoupled contrastive learning: DCL and DCLW.

Paper: Chun-Hsiao Yeh, Cheng-Yao Hong, Yen-Chi Hsu, Tyng-Luh Liu, Yubei Chen, Yann LeCun, "Decoupled
Contrastive Learning", ECCV 2022, arXiv:2110.06848.

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
(lightly's choice, PR #793; the paper is silent and raminnakhli's port does not detach).

The softmax runs over the anchors of the **global** batch: the positives are gathered across
processes first, so W processes with N anchors each give the weights, loss and gradients of one
process with the W·N anchors (a softmax over the local batch would make them depend on the
process count). lightly's
DCLWLoss computes the weights over each process's local batch, even with
``gather_distributed=True`` (only the negatives are gathered); ``per_process=True`` reproduces
that form.

Inputs are cosines; logits are computed in (at least) fp32 with autocast off, like ``info_nce``.
"""

from __future__ import annotations

import torch

from pretrain import dist

from .infonce import ContrastiveLoss, reduce_loss
from .precision import fp32, no_autocast

__all__ = ["decoupled_nce", "dclw_weights", "DCLLoss", "DCLWLoss"]


def dclw_weights(pos: torch.Tensor, sigma: float = 0.5, detach: bool = True, per_process: bool = False) -> torch.Tensor:
    """w = 2 − M·softmax(pos/σ) over the M anchors of all processes; returns this process's (N,).

    pos: (N,) positive cosines of the local anchors, the same N on every process. The weights
    have mean 1 over the global batch (not over each process's slice). ``per_process=True``:
    softmax over the local N anchors only (lightly's form; depends on the process count).

    Duplicated anchors (SimCLR's [z1; z2] rows share their positive) give the same weights as
    the distinct pairs: 2 − 2M·e_i/(2Σe) = 2 − M·e_i/Σe.
    """
    with no_autocast(pos):
        pos = fp32(pos.detach() if detach else pos)
        if per_process:
            return 2.0 - pos.shape[0] * torch.softmax(pos / sigma, dim=0)
        # With undetached weights every rank's loss depends on every rank's positives: the
        # differentiable gather sums those gradients back (see dist.gather_with_grad).
        pos_all = dist.gather_no_grad(pos) if detach else dist.gather_with_grad(pos)
        w_all = 2.0 - pos_all.shape[0] * torch.softmax(pos_all / sigma, dim=0)
        return w_all.narrow(0, dist.rank_offset(pos.shape[0]), pos.shape[0])


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
    with no_autocast(pos):
        pos, neg = fp32(pos), fp32(neg)
        positive = pos / temperature if pos_weight is None else fp32(pos_weight) * pos / temperature
        loss = torch.logsumexp(neg / temperature, dim=1) - positive
    return reduce_loss(loss, reduction)


class DCLLoss(ContrastiveLoss):
    """DCL (``weight_sigma=None``) or DCLW (weights with σ = ``weight_sigma``) on (pos (N,), neg (N, K)).

    DCLW's weights are over the global batch unless ``per_process_weights`` (see :func:`dclw_weights`).

    Example (the positive's gradient is −1/(τ·N) whatever the negatives: decoupled)::

        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> pos, neg = torch.rand(4, generator=g).requires_grad_(), torch.rand(4, 16, generator=g)
        >>> loss = DCLLoss(temperature=0.5)(pos, neg)
        >>> loss.backward()
        >>> loss.shape, torch.allclose(pos.grad, torch.full((4,), -1 / (0.5 * 4)))
        (torch.Size([]), True)
    """

    def __init__(
        self,
        temperature: float,
        weight_sigma: float | None = None,
        detach_weights: bool = True,
        per_process_weights: bool = False,
    ) -> None:
        super().__init__()
        self.temperature = temperature
        self.weight_sigma = weight_sigma
        self.detach_weights = detach_weights
        self.per_process_weights = per_process_weights

    def forward(self, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        w = (
            None
            if self.weight_sigma is None
            else dclw_weights(pos, self.weight_sigma, self.detach_weights, self.per_process_weights)
        )
        return decoupled_nce(pos, neg, self.temperature, w)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, weight_sigma={self.weight_sigma}, "
            f"detach_weights={self.detach_weights}, per_process_weights={self.per_process_weights}"
        )


class DCLWLoss(DCLLoss):
    """DCLW: DCL with the positive weighted by w = 2 − N·softmax(⟨z1,z2⟩/σ) (see :func:`dclw_weights`).

    Example (the weights average to 1 over the batch; with equal positives DCLW is DCL)::

        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> pos, neg = torch.rand(4, generator=g), torch.rand(4, 16, generator=g)
        >>> round(dclw_weights(pos, sigma=0.5).mean().item(), 5)
        1.0
        >>> same = torch.full((4,), 0.3)
        >>> torch.allclose(DCLWLoss(0.5, weight_sigma=0.5)(same, neg), DCLLoss(0.5)(same, neg))
        True
    """

    def __init__(
        self,
        temperature: float,
        weight_sigma: float = 0.5,
        detach_weights: bool = True,
        per_process_weights: bool = False,
    ) -> None:
        super().__init__(temperature, weight_sigma, detach_weights, per_process_weights)
