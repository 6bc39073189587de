"""NT-Xent, SimCLR's normalized temperature-scaled cross-entropy: InfoNCE in which every image of
the batch is an anchor for each of its two views, and the negatives are all other views.

Paper: Ting Chen, Simon Kornblith, Mohammad Norouzi, Geoffrey Hinton, "A Simple Framework for
Contrastive Learning of Visual Representations", ICML 2020, arXiv:2002.05709.

The SimCLR host (``pretrain/methods/simclr.py``) builds these similarities with
:func:`nt_xent_similarities` and hands them to the loss ``method.loss.name`` names, so that DCL or
dual temperature also run on SimCLR's negatives; with ``infonce`` that is :class:`NTXentLoss`.
"""

from __future__ import annotations

import torch
from torch import nn

from .infonce import info_nce
from .similarities import in_batch_similarities

__all__ = ["nt_xent_similarities", "NTXentLoss"]


def nt_xent_similarities(
    z1: torch.Tensor,
    z2: torch.Tensor,
    z1_all: torch.Tensor,
    z2_all: torch.Tensor,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SimCLR NT-Xent similarities for local anchors against gathered candidates.

    Args:
        z1, z2: (N, d) normalized local embeddings of view 1 and view 2.
        z1_all, z2_all: (B, d) the same gathered over ranks (with gradient for SimCLR).
        offset: ``dist.rank_offset(N)``; z1[i] is row ``offset + i`` of z1_all.
    Returns: pos (2N,), neg (2N, 2B-2), anchors ordered [z1 rows; z2 rows].
        Anchor z1[i]: positive z2_all[offset+i]; negatives [other rows of z2_all, rows of
        z1_all except itself] (TF's [ab | aa] blocks). Symmetrically for z2[i].
    """
    pos_a, neg_ab = in_batch_similarities(z1, z2_all, offset)
    _, neg_aa = in_batch_similarities(z1, z1_all, offset)  # drops the self-similarity
    pos_b, neg_ba = in_batch_similarities(z2, z1_all, offset)
    _, neg_bb = in_batch_similarities(z2, z2_all, offset)
    neg = torch.cat([torch.cat([neg_ab, neg_aa], dim=1), torch.cat([neg_ba, neg_bb], dim=1)])
    return torch.cat([pos_a, pos_b]), neg


class NTXentLoss(nn.Module):
    """NT-Xent of two views' normalized embeddings: forward(z1 (N, d), z2 (N, d)) -> loss over the
    2N anchors, each with its other view as positive and the 2N − 2 other embeddings as negatives.

    With several processes pass the gathered views too (``z1_all``, ``z2_all``, (B, d)) and this
    process's ``offset`` in them (``dist.rank_offset(N)``); by default the local batch is the batch.

    Args:
        temperature: τ.
        reduction: "mean" | "sum" | "none" over the 2N anchors ([view-1 anchors; view-2 anchors]).

    Example (two views of 4 images)::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> g = torch.Generator().manual_seed(0)
        >>> z1 = F.normalize(torch.randn(4, 8, generator=g), dim=1)
        >>> z2 = F.normalize(z1 + 0.1 * torch.randn(4, 8, generator=g), dim=1)
        >>> loss = NTXentLoss(temperature=0.5)(z1, z2)
        >>> loss.shape, bool(loss > 0)
        (torch.Size([]), True)
        >>> NTXentLoss(0.5, reduction="none")(z1, z2).shape
        torch.Size([8])
    """

    def __init__(self, temperature: float, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.temperature = temperature
        self.reduction = reduction

    def forward(
        self,
        z1: torch.Tensor,
        z2: torch.Tensor,
        z1_all: torch.Tensor | None = None,
        z2_all: torch.Tensor | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        pos, neg = nt_xent_similarities(
            z1, z2, z1 if z1_all is None else z1_all, z2 if z2_all is None else z2_all, offset
        )
        return info_nce(pos, neg, self.temperature, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, reduction={self.reduction!r}"
