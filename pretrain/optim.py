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

    A handful of multi-tensor launches per group whatever its number of tensors, with the per-tensor
    loop's arithmetic bit for bit (tests/pretrain/test_step_gpu_ready.py):
    * the norms in one ``_foreach_norm`` each; the trust ratios multiply the gradients through one
      broadcast buffer (``_per_tensor``), since a list of 0-dim factors sends ``_foreach_mul`` down
      its one-launch-per-tensor path on CUDA;
    * the new momentum v is computed out of place, then committed by torch's fused SGD kernel, whose
      first-step form copies it into the buffer and subtracts it from w, exactly. That kernel reads
      ``self.found_inf`` (``skip_on_device``): where it is 1, weights and momentum stay as they were,
      decided on the device (the gradients may be NaN then: nothing reads them).
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 1e-3):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, lars=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params]
        if group["weight_decay"]:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        if group["lars"]:
            w_norm = torch.stack(torch._foreach_norm(params))
            g_norm = torch.stack(torch._foreach_norm(grads))
            trust = torch.where((w_norm > 0) & (g_norm > 0), group["eta"] * w_norm / g_norm, torch.ones_like(w_norm))
            grads = torch._foreach_mul(grads, _per_tensor(trust, grads))
        for p in params:
            if "momentum_buffer" not in self.state[p]:  # not setdefault: its zeros_like would run every step
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        velocity = torch._foreach_mul(bufs, group["momentum"])
        torch._foreach_add_(velocity, grads, alpha=group["lr"])
        torch._fused_sgd_(  # buf ← velocity;  w ← w − 1·velocity;  nothing where found_inf is 1
            params,
            velocity,
            bufs,
            weight_decay=0.0,
            momentum=1.0,  # any nonzero value: the first-step form copies, never multiplies by it
            lr=1.0,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=True,
            grad_scale=None,
            found_inf=getattr(self, "found_inf", None),
        )


def _per_tensor(values: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values[i]`` broadcast to the shape and strides of ``like[i]``, for every i, in one copy:
    one flat buffer holding each value numel times, cut into views (a view that repeats one value
    can take any dense layout, channels_last included); same shapes and strides are what keeps a
    ``_foreach`` op on its multi-tensor path."""
    numels = [t.numel() for t in like]
    flat = torch.cat([v.expand(n) for v, n in zip(values.unbind(), numels)])  # views, then one copy
    dense = [t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) for t in like]
    return [
        chunk.as_strided(t.shape, t.stride()) if ok else chunk.view(t.shape)
        for chunk, t, ok in zip(flat.split(numels), like, dense)
    ]


def skip_on_device(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
    """Make ``optimizer.step()`` a no-op on the device wherever ``found_inf`` (a 0-dim float tensor on
    the parameters' device) is 1: the protocol of torch's fused optimizers and ``GradScaler``. The
    engine sets it once; the tensor is updated in place every step, so the host never reads it.

    Under fp16 the gradient scaler replaces the attribute by its own inf check for the step (and
    removes it after), which catches the same non-finite gradients; the engine sets it again."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper keeps torch's optimizer there
    inner.found_inf = found_inf


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    o = cfg.optim
    groups = param_groups(model, o.weight_decay, o.exclude_norm_bias)
    if o.name == "lars":
        return LARS(groups, lr=scaled_lr(cfg), momentum=o.momentum, eta=o.lars_eta)
    for g in groups:
        g.pop("lars")
    # fused: one kernel per group and dtype instead of several per tensor, and the found_inf skip
    return torch.optim.SGD(groups, lr=scaled_lr(cfg), momentum=o.momentum, fused=True)


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
