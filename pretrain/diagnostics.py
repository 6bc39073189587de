"""The papers' training diagnostics, computed from a step's similarities.

* EqCo's empirical mutual-information bound: log(1 + K·e^{m/τ}) − L = log(1 + α) − L with the
  EqCo margin, log(1 + K) − L without (EqCo paper, Eq. 4 and 6).
* DCL's negative-positive coupling (NPC) multiplier of each anchor,
  q_B = 1 − e^{(s₀−m)/τ} / (e^{(s₀−m)/τ} + Σ_k e^{s_k/τ}), i.e. the softmax mass off the positive;
  InfoNCE's gradient is scaled by it (DCL paper, Prop. 1). Logged as mean and coefficient of
  variation (std / mean).
* ‖∂L/∂q‖ per query, from the gradient the method kept (``Method.watch``).
"""

from __future__ import annotations

import torch

from pretrain.losses import mi_lower_bound


@torch.no_grad()
def contrastive_stats(
    pos: torch.Tensor, neg: torch.Tensor, temperature: float, margin: float, loss: torch.Tensor, n_equivalent: float
) -> dict[str, torch.Tensor]:
    """pos (N,), neg (N, K) cosines; n_equivalent = α with EqCo, else K."""
    pos, neg = pos.float(), neg.float()
    logits = torch.cat([(pos - margin).unsqueeze(1), neg], dim=1) / temperature
    npc = 1.0 - logits.softmax(dim=1)[:, 0]
    return {
        "mi_bound": mi_lower_bound(loss.detach(), n_equivalent),
        "npc_mean": npc.mean(),
        "npc_cv": npc.std(unbiased=False) / npc.mean().clamp_min(1e-12),
        "pos_cos": pos.mean(),
        "neg_cos": neg.mean(),
    }


@torch.no_grad()
def grad_norm_stats(q: torch.Tensor | None, loss_scale: float = 1.0) -> dict[str, float]:
    """Mean and std of ‖∂L/∂q_i‖ over the watched queries (empty when nothing was watched).
    ``loss_scale``: the fp16 gradient scaler's factor, which the retained gradient carries."""
    if q is None or q.grad is None:
        return {}
    norms = q.grad.float().flatten(1).norm(dim=1) / loss_scale
    return {"grad_q_norm_mean": norms.mean().item(), "grad_q_norm_std": norms.std(unbiased=False).item()}
