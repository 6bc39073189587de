"""The InfoNCE family as pure functions, plus a thin module (MoCo, SimCLR, EqCo, SiMo).

Conventions: N local anchors, K negatives per anchor, d embedding size, inputs are cosine
similarities of L2-normalized embeddings. The positive sits at logit index 0.

Logits and similarities are computed in (at least) fp32 with autocast disabled: with
temperatures of 0.07-0.2 and 65536-column queues, fp16/bf16 logits lose the positive's
margin in rounding. float64 inputs stay float64 (tests use it).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "similarities",
    "info_nce",
    "eqco_margin",
    "mi_lower_bound",
    "sample_negatives",
    "in_batch_similarities",
    "nt_xent_similarities",
    "ContrastiveLoss",
    "InfoNCELoss",
    "SAMPLING_MODES",
    "positive_number",
]

SAMPLING_MODES = ("per_query", "per_batch")


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


@contextlib.contextmanager
def _no_autocast(x: torch.Tensor):
    """Exact fp32 for similarities and logits, whatever the run's precision settings.

    Explicit casts are not enough: CUDA autocast would run a matmul on fp32 inputs in fp16, and
    with TF32 allowed (a common global setting for speed) an fp32 matmul keeps only 10 mantissa
    bits, which moves logits at τ = 0.07 by more than EqCo's margins. Both are switched off here
    only, and restored after."""
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        with torch.autocast(device_type=x.device.type, enabled=False):
            yield
    finally:
        matmul.allow_tf32 = allowed


def reduce_loss(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-anchor losses (N,) reduced as F.cross_entropy does: "mean" | "sum" | "none"."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.mean()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def similarities(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in (at least) fp32 with autocast off: (N, d) @ (d, M) -> (N, M) cosines when both
    are normalized (e.g. queries against MoCo's (d, K) queue)."""
    with _no_autocast(a):
        return _fp32(a) @ _fp32(b)


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
    with _no_autocast(pos):
        pos, neg = _fp32(pos), _fp32(neg)
        if isinstance(margin, torch.Tensor):
            margin = _fp32(margin)
        logits = torch.cat([(pos - margin).unsqueeze(1), neg], dim=1) / temperature
        labels = torch.zeros(pos.shape[0], dtype=torch.long, device=pos.device)
        return F.cross_entropy(logits, labels, reduction=reduction)


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


def mi_lower_bound(loss: float | torch.Tensor, alpha_or_k: float) -> float | torch.Tensor:
    """Empirical mutual-information lower bound log(1 + n) − loss (EqCo paper, Eq. 4 and 6).

    The paper's bound is log(1 + K·e^{m/τ}) − L. Pass n = α when the EqCo margin
    m = τ·log(α/K) is used (then K·e^{m/τ} = α and the bound no longer depends on K), and
    n = K for plain InfoNCE (m = 0: Oord et al.'s log(K + 1) − L). Uses log(1 + α), not the
    log α of the approximation in the spec sheet; the two differ by < 1/α.
    """
    return math.log1p(alpha_or_k) - loss


def sample_negatives(
    neg: torch.Tensor,
    k: int,
    mode: str = "per_query",
    generator: torch.Generator | None = None,
    row_offset: int = 0,
    total_rows: int | None = None,
) -> torch.Tensor:
    """Choose k of the K negative columns uniformly without replacement: (N, K) -> (N, k).

    mode="per_query": an independent choice for each row (EqCo's "K negatives per query").
    mode="per_batch": one choice shared by all rows (cheaper).
    With several processes, pass this process's rows of the global batch (``row_offset``,
    ``total_rows``) and a random state shared by all processes: each draws the choices of all
    ``total_rows`` rows and keeps its own, so the result does not depend on the process count.
    ``generator`` must live on ``neg.device``. Gradients flow to the selected entries.
    """
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
    n, available = neg.shape
    if not 0 < k <= available:
        raise ValueError(f"cannot sample k={k} negatives without replacement from {available} available")
    if mode == "per_batch":
        return neg[:, torch.randperm(available, generator=generator, device=neg.device)[:k]]
    # The top-k of i.i.d. uniforms is a uniformly random k-subset, one per row.
    scores = torch.rand(total_rows or n, available, generator=generator, device=neg.device)[row_offset : row_offset + n]
    return neg.gather(1, scores.topk(k, dim=1).indices)


def in_batch_similarities(q: torch.Tensor, keys: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positive and in-batch negative cosines of local queries against gathered keys.

    Args:
        q: (N, d) normalized local queries. keys: (M, d) normalized candidates (usually the
            gathered batch, M = B) whose row ``offset + i`` is the positive of q[i].
        offset: ``dist.rank_offset(N)`` for gathered keys, 0 in one process.
    Returns: pos (N,), neg (N, M-1): all other keys, in key order (positive column removed).
    Used by SiMo (keys from the momentum encoder) and SimCLR-style hosts.
    """
    with _no_autocast(q):
        sim = _fp32(q) @ _fp32(keys).T
    n, m = sim.shape
    rows = torch.arange(n, device=sim.device)
    # Column j of row i's negatives is key j, or j + 1 past the positive: an index gather, not a
    # boolean mask, whose result size the device would have to report to the host.
    cols = torch.arange(m - 1, device=sim.device).expand(n, -1)
    cols = cols + (cols >= (rows + offset).unsqueeze(1))
    return sim[rows, rows + offset], sim.gather(1, cols)


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


def positive_number(m, key: str) -> None:
    """ConfigError naming ``method.<key>`` unless it is a positive number."""
    from pretrain.config import ConfigError  # late: the config module imports the methods

    value = m[key]
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ConfigError(f"method.{key}={value}: expected a positive number")


class ContrastiveLoss(nn.Module):
    """A loss on (N,) positive and (N, K) negative cosines that a host method selects with
    ``method.loss``. The loss owns its options: ``config_keys`` (read under ``method:``, with their
    defaults), ``check`` (one-line errors for impossible values) and ``from_config``; the host only
    supplies the similarities and the shared ``temperature``."""

    config_keys: ClassVar[dict[str, Any]] = {}
    temperature: float

    @classmethod
    def check(cls, m) -> None:
        """Raise ConfigError naming the key for impossible values of ``config_keys``."""

    @classmethod
    def from_config(cls, m) -> ContrastiveLoss:
        raise NotImplementedError

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
    """InfoNCE / EqCo loss on precomputed similarities: forward(pos (N,), neg (N, K)) -> loss.

    Args:
        temperature: τ.
        alpha: EqCo's equivalent negative count; None for plain InfoNCE. The margin
            τ·log(α/K) uses the K actually contrasted per query (after sampling).
        num_negatives: if set, sample this many of the K negatives per step (``sampling``).
        sampling: "per_query" | "per_batch" (see :func:`sample_negatives`).
        reduction: "mean" | "sum" | "none".
    """

    config_keys = {"eqco_alpha": None}  # EqCo: margin τ·log(α/K) on the positive; None = plain InfoNCE

    @classmethod
    def check(cls, m) -> None:
        if m.eqco_alpha is not None:
            positive_number(m, "eqco_alpha")

    @classmethod
    def from_config(cls, m) -> InfoNCELoss:
        return cls(float(m.temperature), alpha=m.eqco_alpha)

    def __init__(
        self,
        temperature: float,
        alpha: float | None = None,
        num_negatives: int | None = None,
        sampling: str = "per_query",
        reduction: str = "mean",
    ) -> None:
        super().__init__()
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {sampling!r}")
        if alpha is not None and not alpha > 0:
            raise ValueError(f"EqCo alpha must be > 0, got alpha={alpha}")
        self.temperature = temperature
        self.alpha = alpha
        self.num_negatives = num_negatives
        self.sampling = sampling
        self.reduction = reduction

    def margin(self, k: int) -> float:
        return 0.0 if self.alpha is None else eqco_margin(self.temperature, self.alpha, k)

    def equivalent_negatives(self, k: int) -> float:
        return k if self.alpha is None else self.alpha

    def forward(self, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        if self.num_negatives is not None:
            neg = sample_negatives(neg, self.num_negatives, self.sampling)
        return info_nce(pos, neg, self.temperature, self.margin(neg.shape[1]), self.reduction)

    def with_infonce(self, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self(pos, neg)
        return loss, loss

    def mi_lower_bound(self, loss: float | torch.Tensor, k: int | None = None) -> float | torch.Tensor:
        """log(1 + α) − loss with EqCo, else log(1 + k) − loss (k = negatives per query)."""
        if self.alpha is None and k is None:
            raise ValueError("mi_lower_bound needs k (negatives per query) when alpha is None")
        n_equivalent = self.alpha if self.alpha is not None else k
        assert n_equivalent is not None  # checked above
        return mi_lower_bound(loss, n_equivalent)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, alpha={self.alpha}, "
            f"num_negatives={self.num_negatives}, sampling={self.sampling!r}, reduction={self.reduction!r}"
        )
