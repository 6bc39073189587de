"""Operators (views aside) one optimizer step dispatches, per-tensor loop against ours, on a ResNet-50's parameters.

On a GPU each operator is at least one kernel launch, and an update over a ResNet's 161 parameter
tensors launched tensor by tensor is bound by the launches, not by the arithmetic. Counted on the CPU
with a ``TorchDispatchMode`` (what the dispatcher sees, before any backend), so the figure is the
same on any machine:

    python -m benchmarks.pretraining --optimizer-ops

The references are the same updates written per tensor: SimCLR's LARS as a loop (the arithmetic
``pretrain.optim.LARS`` keeps bit for bit), and ``torch.optim.SGD(foreach=False)``.
"""

from __future__ import annotations

import torch
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.optim import LARS, param_groups, skip_on_device


class DispatchedOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view  # a view is metadata on the host: no kernel
        return func(*args, **(kwargs or {}))


def lars_loop(groups: list[dict], state: dict, lr: float, momentum: float, eta: float) -> None:
    """SimCLR's LARS, one tensor at a time (the loop ``pretrain.optim.LARS`` replaces)."""
    with torch.no_grad():
        for group in groups:
            for p in group["params"]:
                g = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad.clone()
                if group["lars"]:
                    w_norm, g_norm = p.norm(), g.norm()
                    g.mul_(torch.where((w_norm > 0) & (g_norm > 0), eta * w_norm / g_norm, torch.ones_like(w_norm)))
                buf = state.setdefault(p, torch.zeros_like(p))
                buf.mul_(momentum).add_(g, alpha=lr)
                p.sub_(buf)


def _ops(step) -> int:
    step()  # the first step creates the momentum buffers: count a steady one
    with DispatchedOps() as counter:
        step()
    return counter.count


def measure() -> list[dict]:
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    groups = param_groups(model, 1e-6, exclude_norm_bias=True)
    n = sum(len(g["params"]) for g in groups)
    lars = LARS(groups, lr=0.3, momentum=0.9, eta=1e-3)
    skip_on_device(lars, torch.zeros(()))  # as the engine runs it
    state: dict = {}

    def sgd_groups():  # each optimizer its own dicts: torch writes its defaults into them
        return [{k: v for k, v in g.items() if k != "lars"} for g in groups]

    looped_sgd = torch.optim.SGD(sgd_groups(), lr=0.03, momentum=0.9, foreach=False)
    fused_sgd = torch.optim.SGD(sgd_groups(), lr=0.03, momentum=0.9, fused=True)
    fused_sgd.found_inf = torch.zeros(())
    return [
        {
            "optimizer": "LARS",
            "tensors": n,
            "loop": _ops(lambda: lars_loop(groups, state, 0.3, 0.9, 1e-3)),
            "ours": _ops(lars.step),
        },
        {"optimizer": "SGD", "tensors": n, "loop": _ops(looped_sgd.step), "ours": _ops(fused_sgd.step)},
    ]


def main() -> list[dict]:
    rows = measure()
    print("| optimizer | parameter tensors | operators, per-tensor loop | operators, ours | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['tensors']} | {r['loop']} | {r['ours']} | {r['loop'] / r['ours']:.0f}× |")
    return rows


if __name__ == "__main__":
    main()
