"""The optimizers in few launches (``pretrain.optim``): a step's operators do not grow with the number
of parameter tensors, torch's fused SGD equals its per-tensor loop bit for bit, and an update that
``found_inf`` skips leaves weights and momentum exactly as they were, NaN gradients included."""

from __future__ import annotations

import pytest
import torch

from benchmarks.optimizer_ops import DispatchedOps, lars_loop
from pretrain.optim import LARS, skip_on_device


def _params(n: int, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 4, 3, 3), (8,), (5, 8)]
    params = [torch.nn.Parameter(torch.randn(shapes[i % 3], generator=g)) for i in range(n)]
    params[0].data = params[0].data.contiguous(memory_format=torch.channels_last)  # a conv under channels_last
    for p in params:
        p.grad = _like(p, torch.randn(p.shape, generator=g))
    return params


def _like(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in ``p``'s memory layout, as autograd lays out a gradient. (torch's fused SGD on the
    CPU computes wrong values for a gradient whose strides differ from its parameter's; autograd's
    layout contract never hands it one.)"""
    return torch.empty_like(p).copy_(values)


def _groups(params):
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": 1e-4, "lars": True},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "lars": False},
    ]


def _ops(optimizer) -> int:
    optimizer.step()
    with DispatchedOps() as counter:
        optimizer.step()
    return counter.count


@pytest.mark.parametrize("make", ["lars", "sgd"])
def test_a_step_dispatches_as_many_operators_for_30_tensors_as_for_6(make):
    def build(n):
        groups = _groups(_params(n))
        if make == "lars":
            return LARS(groups, lr=0.1)
        return torch.optim.SGD([{k: v for k, v in g.items() if k != "lars"} for g in groups], lr=0.1, fused=True)

    few, many = _ops(build(6)), _ops(build(30))
    assert few == many < 30, (few, many)
    looped = DispatchedOps()  # the control: the loop's operators grow with the tensors
    params = _params(30)
    with looped:
        lars_loop(_groups(params), {}, 0.1, 0.9, 1e-3)
    assert looped.count > 5 * 30


def test_lars_with_channels_last_weights_equals_the_loop_bit_for_bit():
    ours, loop = _params(6), _params(6)
    optimizer, state = LARS(_groups(ours), lr=0.3, momentum=0.9, eta=1e-3), {}
    for step in range(3):
        for a, b in zip(ours, loop):
            a.grad = _like(a, torch.randn(a.shape, generator=torch.Generator().manual_seed(step)))
            b.grad = a.grad.clone()
        optimizer.step()
        lars_loop(_groups(loop), state, 0.3, 0.9, 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(ours, loop))
    assert ours[0].is_contiguous(memory_format=torch.channels_last)


def test_fused_sgd_equals_torchs_per_tensor_loop_bit_for_bit():
    ours, loop = _params(6), _params(6)

    def sgd(params, **kw):
        return torch.optim.SGD(
            [{k: v for k, v in g.items() if k != "lars"} for g in _groups(params)], lr=0.03, momentum=0.9, **kw
        )

    a, b = sgd(ours, fused=True), sgd(loop, foreach=False)
    for step in range(3):
        for x, y in zip(ours, loop):
            x.grad = _like(x, torch.randn(x.shape, generator=torch.Generator().manual_seed(step)))
            y.grad = x.grad.clone()
        for opt in (a, b):
            opt.param_groups[0]["lr"] = 0.03 * (step + 1)
            opt.step()
    assert all(torch.equal(x, y) for x, y in zip(ours, loop))


@pytest.mark.parametrize("make", ["lars", "sgd"])
def test_an_update_skipped_on_the_device_changes_nothing(make):
    params = _params(6)
    groups = _groups(params)
    if make == "lars":
        optimizer = LARS(groups, lr=0.1)
    else:
        optimizer = torch.optim.SGD(
            [{k: v for k, v in g.items() if k != "lars"} for g in groups], lr=0.1, momentum=0.9, fused=True
        )
    skip = torch.zeros(())
    skip_on_device(optimizer, skip)
    optimizer.step()  # a real step first: momentum buffers hold values
    before = [p.detach().clone() for p in params]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    skip.fill_(1.0)  # in place, as the engine's guard does: no new attribute, no host read
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], m) for p, m in zip(params, momentum))
    skip.fill_(0.0)  # the control: the same NaN step, not skipped, is applied
    optimizer.step()
    assert all(torch.isnan(p).all() for p in params)
