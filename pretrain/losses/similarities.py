"""What every loss of this package consumes: (N,) positive and (N, K) negative cosines of
L2-normalized embeddings, the positive at logit index 0, and the choice of K negatives per query.

N local anchors, K negatives per anchor, d embedding size. Similarities are computed in (at least)
fp32 with autocast off (``precision``).
"""

from __future__ import annotations

import torch

from .precision import fp32, no_autocast

__all__ = ["SAMPLING_MODES", "similarities", "sample_negatives", "in_batch_similarities"]

SAMPLING_MODES = ("per_query", "per_batch")


def similarities(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in (at least) fp32 with autocast off: (N, d) @ (d, M) -> (N, M) cosines when both
    are normalized (e.g. queries against MoCo's (d, K) queue)."""
    with no_autocast(a):
        return fp32(a) @ fp32(b)


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
    with no_autocast(q):
        sim = fp32(q) @ fp32(keys).T
    n, m = sim.shape
    rows = torch.arange(n, device=sim.device)
    # Column j of row i's negatives is key j, or j + 1 past the positive: an index gather, not a
    # boolean mask, whose result size the device would have to report to the host.
    cols = torch.arange(m - 1, device=sim.device).expand(n, -1)
    cols = cols + (cols >= (rows + offset).unsqueeze(1))
    return sim[rows, rows + offset], sim.gather(1, cols)
