"""EqCo: InfoNCE with a margin on the positive that makes K negatives per query behave like α.

Paper: Benjin Zhu, Junqiang Huang, Zeming Li, Xiangyu Zhang, Jian Sun, "EqCo: Equivalent Rules for
Self-supervised Contrastive Learning", 2020, arXiv:2010.01929 (also the source of SiMo,
``pretrain/methods/simo.py``).

Scaling the negative sum of InfoNCE by α/K keeps the mutual-information bound log(1 + α) − L and
the gradient magnitude independent of K; as a margin on the positive cosine this is
m = τ·log(α/K) (Eq. 5), so EqCo is :func:`info_nce` with that margin and the bound uses α.
"""

from __future__ import annotations

import math

import torch

from .infonce import InfoNCELoss, mi_lower_bound

__all__ = ["eqco_margin", "EqCoLoss"]


def eqco_margin(temperature: float, alpha: float, k: int) -> float:
    """EqCo margin m = τ·log(α/K) for K physical negatives "equivalent" to α (paper Eq. 5).

    Margin form of scaling the negative sum by α/K: multiplying numerator and denominator of
    -log( e^{s0/τ} / (e^{s0/τ} + (α/K) Σ e^{s_i/τ}) ) by e^{-m/τ} gives :func:`info_nce` with
    margin m. m > 0 (positive penalized) when K < α; m = 0 when K = α.
    """
    if not alpha > 0:
        raise ValueError(f"EqCo alpha must be > 0, got alpha={alpha}")
    if not k > 0:
        raise ValueError(f"EqCo needs k > 0 negatives per query, got k={k}")
    return temperature * math.log(alpha / k)


class EqCoLoss(InfoNCELoss):
    """EqCo on precomputed similarities: forward(pos (N,), neg (N, K)) -> loss.

    Args:
        temperature: τ.
        alpha: the equivalent negative count α. The margin τ·log(α/K) uses the K actually
            contrasted per query (after sampling).
        num_negatives, sampling, reduction: as for :class:`InfoNCELoss`.

    Example (with K = α the margin is 0 and EqCo is InfoNCE; with fewer negatives than α the
    positive is penalized)::

        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> pos, neg = torch.rand(4, generator=g), torch.rand(4, 16, generator=g)
        >>> torch.equal(EqCoLoss(0.2, alpha=16)(pos, neg), InfoNCELoss(0.2)(pos, neg))
        True
        >>> bool(EqCoLoss(0.2, alpha=65536)(pos, neg) > InfoNCELoss(0.2)(pos, neg))
        True
    """

    def __init__(
        self,
        temperature: float,
        alpha: float,
        num_negatives: int | None = None,
        sampling: str = "per_query",
        reduction: str = "mean",
    ) -> None:
        super().__init__(temperature, num_negatives, sampling, reduction)
        if not alpha > 0:
            raise ValueError(f"EqCo alpha must be > 0, got alpha={alpha}")
        self.alpha = alpha

    def margin(self, k: int) -> float:
        return eqco_margin(self.temperature, self.alpha, k)

    def equivalent_negatives(self, k: int) -> float:
        return self.alpha

    def mi_lower_bound(self, loss: float | torch.Tensor, k: int | None = None) -> float | torch.Tensor:
        """log(1 + α) − loss, whatever the negatives per query ``k``."""
        return mi_lower_bound(loss, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, {super().extra_repr()}"
