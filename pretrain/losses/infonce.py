"""InfoNCE, the loss every host method of this package contrasts with (MoCo, SimCLR, SiMo, AdCo).

Paper: Aaron van den Oord, Yazhe Li, Oriol Vinyals, "Representation Learning with Contrastive
Predictive Coding", 2018, arXiv:1807.03748 (the loss and its bound log(K + 1) − L on the mutual
information).

Conventions: N local anchors, K negatives per anchor; inputs are cosine similarities of
L2-normalized embeddings (``similarities``), the positive at logit index 0. Logits are computed in
(at least) fp32 with autocast off (``precision``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .precision import fp32, no_autocast
from .similarities import SAMPLING_MODES, sample_negatives

__all__ = ["info_nce", "mi_lower_bound", "reduce_loss", "ContrastiveLoss", "InfoNCELoss"]


def reduce_loss(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-anchor losses (N,) reduced as F.cross_entropy does: "mean" | "sum" | "none"."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.mean()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def info_nce(
    pos: torch.Tensor,
    neg: torch.Tensor,
    temperature: float,
    margin: float | torch.Tensor = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """InfoNCE with an optional additive margin on the positive (EqCo paper, Eq. 1).

    Per anchor n, with s0 = pos[n] and s_i = neg[n, i]:
        L_n = -log( e^{(s0 - m)/τ} / ( e^{(s0 - m)/τ} + Σ_{i=1..K} e^{s_i/τ} ) )
    computed as cross-entropy of logits = cat([pos - m, neg]) / τ with label 0.

    Args:
        pos: (N,) positive cosines. neg: (N, K) negative cosines.
        margin: float or (N,) tensor m, subtracted from the positive cosine before dividing by τ.
        reduction: "mean" | "sum" | "none" (then returns (N,)).
    Returns: scalar (or (N,)) loss in fp32 (fp64 for fp64 inputs).
    """
    with no_autocast(pos):
        pos, neg = fp32(pos), fp32(neg)
        if isinstance(margin, torch.Tensor):
            margin = fp32(margin)
        logits = torch.cat([(pos - margin).unsqueeze(1), neg], dim=1) / temperature
        labels = torch.zeros(pos.shape[0], dtype=torch.long, device=pos.device)
        return F.cross_entropy(logits, labels, reduction=reduction)


def mi_lower_bound(loss: float | torch.Tensor, alpha_or_k: float) -> float | torch.Tensor:
    """Empirical mutual-information lower bound log(1 + n) − loss (EqCo paper, Eq. 4 and 6).

    The paper's bound is log(1 + K·e^{m/τ}) − L. Pass n = α when the EqCo margin
    m = τ·log(α/K) is used (then K·e^{m/τ} = α and the bound no longer depends on K), and
    n = K for plain InfoNCE (m = 0: Oord et al.'s log(K + 1) − L). Uses log(1 + α), not the
    log α of the approximation in the spec sheet; the two differ by < 1/α.
    """
    return math.log1p(alpha_or_k) - loss


class ContrastiveLoss(nn.Module):
    """A loss on (N,) positive and (N, K) negative cosines that a host method selects with
    ``method.loss.name`` (the options each loss reads from ``method.loss`` are bound in
    ``registry``); the host only supplies the similarities."""

    temperature: float

    def margin(self, k: int) -> float:
        """What is subtracted from the positive cosine at k negatives per query (EqCo); 0 here."""
        return 0.0

    def equivalent_negatives(self, k: int) -> float:
        """The negative count n of the MI bound log(1 + n) − L at k negatives per query."""
        return k

    def with_infonce(self, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this loss, InfoNCE at the same similarities without gradient): the diagnostics always
        describe InfoNCE, so that every loss compares with its InfoNCE host."""
        loss = self(pos, neg)
        with torch.no_grad():
            return loss, info_nce(pos, neg, self.temperature, self.margin(neg.shape[1]))


class InfoNCELoss(ContrastiveLoss):
    """InfoNCE on precomputed similarities: forward(pos (N,), neg (N, K)) -> loss.

    Args:
        temperature: τ.
        num_negatives: if set, sample this many of the K negatives per step (``sampling``).
        sampling: "per_query" | "per_batch" (see :func:`sample_negatives`).
        reduction: "mean" | "sum" | "none".

    Example (cross-entropy with the positive at index 0, so always positive)::

        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> pos, neg = torch.rand(4, generator=g), torch.rand(4, 16, generator=g)
        >>> loss = InfoNCELoss(temperature=0.2)(pos, neg)
        >>> loss.shape, bool(loss > 0)
        (torch.Size([]), True)
        >>> InfoNCELoss(0.2, reduction="none")(pos, neg).shape
        torch.Size([4])
    """

    def __init__(
        self,
        temperature: float,
        num_negatives: int | None = None,
        sampling: str = "per_query",
        reduction: str = "mean",
    ) -> None:
        super().__init__()
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {sampling!r}")
        self.temperature = temperature
        self.num_negatives = num_negatives
        self.sampling = sampling
        self.reduction = reduction

    def forward(self, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        if self.num_negatives is not None:
            neg = sample_negatives(neg, self.num_negatives, self.sampling)
        return info_nce(pos, neg, self.temperature, self.margin(neg.shape[1]), self.reduction)

    def with_infonce(self, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self(pos, neg)
        return loss, loss

    def mi_lower_bound(self, loss: float | torch.Tensor, k: int | None = None) -> float | torch.Tensor:
        """log(1 + k) − loss (k = negatives per query)."""
        if k is None:
            raise ValueError("mi_lower_bound needs k (negatives per query); only EqCoLoss's bound does without it")
        return mi_lower_bound(loss, k)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, num_negatives={self.num_negatives}, "
            f"sampling={self.sampling!r}, reduction={self.reduction!r}"
        )
