"""Optimizers and the learning-rate schedule as a pure function of training progress.

The lr is computed from the global step (never a prepared scheduler, whose steps Accelerate
multiplies by the number of processes), so resuming and changing the number of processes keep
the schedule exact.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pretrain.config import scaled_lr


def param_groups(model: nn.Module, weight_decay: float, exclude_norm_bias: bool) -> list[dict]:
    """Trainable parameters (momentum encoders are frozen and left out); with exclude_norm_bias,
    1-d parameters (BN scales/shifts, biases) get no weight decay and no LARS adaptation."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not exclude_norm_bias:
        return [{"params": params, "weight_decay": weight_decay, "lars": True}]
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay, "lars": True},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "lars": False},
    ]


class LARS(torch.optim.Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling, as in SimCLR's TF code:

        g ← ∇w + wd·w;  trust = η‖w‖/‖g‖ (1 if either norm is 0);  v ← μv + lr·trust·g;  w ← w − v

    Groups with ``lars=False`` (BN, biases) skip the adaptation. Written here because neither
    torch nor torchvision ships LARS.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 1e-3):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, lars=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # torch._foreach_* ops: one fused kernel per op over all tensors of the group instead
            # of a Python loop of several kernels per tensor; the arithmetic is the loop's.
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            else:
                grads = [g.clone() for g in grads]
            if group["lars"]:
                w_norm = torch.stack(torch._foreach_norm(params))
                g_norm = torch.stack(torch._foreach_norm(grads))
                trust = torch.where(
                    (w_norm > 0) & (g_norm > 0), group["eta"] * w_norm / g_norm, torch.ones_like(w_norm)
                )
                torch._foreach_mul_(grads, list(trust.unbind()))
            bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, grads, alpha=group["lr"])
            torch._foreach_sub_(params, bufs)
        return loss


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    o = cfg.optim
    groups = param_groups(model, o.weight_decay, o.exclude_norm_bias)
    if o.name == "lars":
        return LARS(groups, lr=scaled_lr(cfg), momentum=o.momentum, eta=o.lars_eta)
    for g in groups:
        g.pop("lars")
    return torch.optim.SGD(groups, lr=scaled_lr(cfg), momentum=o.momentum)


def lr_at(cfg, step: int, steps_per_epoch: int) -> float:
    """The lr for global step `step`: warmup, then cosine / step / constant over train.epochs.

    With optim.per_step=False (MoCo) the lr changes only at epoch boundaries, as in the official
    code; with per_step=True (SimCLR) every step.
    """
    o = cfg.optim
    epoch = step / steps_per_epoch if o.per_step else float(step // steps_per_epoch)
    base = scaled_lr(cfg)
    if epoch < o.warmup_epochs:
        done = (step + 1) / steps_per_epoch if o.per_step else epoch + 1
        return base * min(1.0, done / o.warmup_epochs)
    if o.schedule == "cosine":  # from base to final: final + ½(1 + cos(π·progress))·(base − final)
        span = max(cfg.train.epochs - o.warmup_epochs, 1e-12)
        final = scaled_lr(cfg, o.final_lr)
        return final + 0.5 * (1.0 + math.cos(math.pi * min(1.0, (epoch - o.warmup_epochs) / span))) * (base - final)
    if o.schedule == "step":
        return base * 0.1 ** sum(epoch >= m for m in o.milestones)
    return base
