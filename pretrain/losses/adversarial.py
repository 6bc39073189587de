"""AdCo's negative adversaries: a bank of learned negatives that ascends the contrastive loss.

Paper: Qianjiang Hu, Xiao Wang, Wei Hu, Guo-Jun Qi, "AdCo: Adversarial Contrast for Efficient
Learning of Unsupervised Representations from Self-Trained Negative Adversaries", CVPR 2021,
arXiv:2011.08435 (code: maple-research-lab/AdCo ``training/train.py``, ``model/AdCo.py``).

The bank is a raw matrix W ∈ R^{d×K} that is never renormalized in place; every use takes
n̂_k = W_k/‖W_k‖. The network minimizes, for local queries q_i (N×d) against the gathered keys
k_all (B×d, all of them logits; the positive is column ``offset + i``) and the bank,

    L = (1/N) Σ_i CE([q_i·k_allᵀ | q_i·n̂] / τ, offset + i)

and the adversaries *maximize* the same loss at a sharper temperature τ_m (0.02 vs 0.12). With
P = softmax([q·k_allᵀ | q·n̂]/τ_m)[:, B:] (N×K) and l_ik = ⟨q_i, n̂_k⟩:

    ∂L/∂n̂_k = (1/(N·τ_m)) Σ_i P_ik q_i
    ∂L/∂W_k = (I − n̂_k n̂_kᵀ) ∂L/∂n̂_k / ‖W_k‖
            = [(1/N) Σ_i P_ik q_i − ((1/N) Σ_i P_ik l_ik)·n̂_k] / (‖W_k‖·τ_m)

(the second term is the projection through the normalization, AdCo issue #8). The update is
SGD with momentum and weight decay on −L, i.e. gradient *ascent* on L, with the gradient
averaged over processes so that every rank holds the same W:

    g ← mean over ranks of (−∂L/∂W);   v ← μ·v + g + wd·W;   W ← W − lr·v

which is torch.optim.SGD(momentum=μ, weight_decay=wd, maximize=True) applied to ∂L/∂W. Written
by hand (as in the official code) because τ_m differs from the network's τ: autograd would need
a second loss graph over the N×K logits; the tests check it against autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain import dist

from .precision import fp32, no_autocast

__all__ = ["adversary_gradient", "AdversarialBank"]


@torch.no_grad()
def adversary_gradient(
    q: torch.Tensor, batch_logits: torch.Tensor, bank: torch.Tensor, temperature: float
) -> torch.Tensor:
    """∂L/∂W (d×K) of the mean cross-entropy over the N local queries at temperature τ_m.

    Args:
        q: (N, d) normalized queries (as used in the forward, before the network step).
        batch_logits: (N, B) cosines of the queries with all gathered keys (the positive among
            them); they only enter the softmax normalization, so their order does not matter.
        bank: (d, K) raw (un-normalized) adversaries W.
        temperature: τ_m.
    """
    with no_autocast(q):
        q, bank = fp32(q), fp32(bank)
        norms = bank.norm(dim=0)
        unit = bank / norms
        bank_logits = q @ unit  # N×K
        logits = torch.cat([fp32(batch_logits), bank_logits], dim=1) / temperature
        p = torch.softmax(logits, dim=1)[:, -bank.shape[1] :]
        n = q.shape[0]
        grad_unit = q.T @ p / n  # (1/N) Σ_i P_ik q_i, d×K
        along_unit = (p * bank_logits).sum(dim=0) / n  # (1/N) Σ_i P_ik l_ik, K
        return (grad_unit - along_unit * unit) / (norms * temperature)


class AdversarialBank(nn.Module):
    """K learned negatives W (d×K, raw) with their momentum v; both are buffers, so the method's
    state_dict (and every checkpoint) holds them. Not a parameter: the network optimizer and DDP
    must never touch it (its lr is 100× the network's).

    Example (8-dimensional queries against 32 adversaries; one ascent step moves the bank)::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> _ = torch.manual_seed(0)
        >>> bank = AdversarialBank(dim=8, size=32)
        >>> q = F.normalize(torch.randn(4, 8), dim=1)
        >>> bank.logits(q).shape
        torch.Size([4, 32])
        >>> before = bank.weight.clone()
        >>> bank.ascend(adversary_gradient(q, q @ q.T, bank.weight, 0.02), lr=3.0, momentum=0.9, weight_decay=1e-4)
        >>> bool((bank.weight != before).any())
        True
    """

    weight: torch.Tensor
    momentum_buffer: torch.Tensor

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randn(dim, size))
        self.register_buffer("momentum_buffer", torch.zeros(dim, size))

    @property
    def size(self) -> int:
        return int(self.weight.shape[1])

    def logits(self, q: torch.Tensor) -> torch.Tensor:
        """(N, K) cosines ⟨q_i, n̂_k⟩ in fp32, differentiable in q (and in W if it requires grad)."""
        with no_autocast(q):
            return fp32(q) @ F.normalize(fp32(self.weight), dim=0)

    @torch.no_grad()
    def fill(self, keys: torch.Tensor, start: int) -> int:
        """Write gathered keys (B×d) into columns start.. (as many as fit); returns the next column."""
        end = min(start + keys.shape[0], self.size)
        self.weight[:, start:end] = keys[: end - start].T.to(self.weight.dtype)
        return end

    @torch.no_grad()
    def ascend(self, grad: torch.Tensor, lr: float, momentum: float, weight_decay: float) -> None:
        """One ascent step on L from this process's ∂L/∂W, averaged over processes first."""
        grad = dist.all_reduce_with_grad(grad.to(self.weight.dtype)) / dist.world_size()
        self.momentum_buffer.mul_(momentum).sub_(grad).add_(self.weight, alpha=weight_decay)
        self.weight.sub_(self.momentum_buffer, alpha=lr)
