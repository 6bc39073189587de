"""DCL / DCLW against brute-force loops, the paper's weight formula and hand-derived gradients."""

import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import load_config
from pretrain.diagnostics import contrastive_stats
from pretrain.losses import DCLLoss, dclw_weights, decoupled_nce, info_nce, nt_xent_similarities
from pretrain.methods import METHODS

from .test_engine import RECIPES


def _unit(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)


def _dcl_loop(z1_all, z2_all, rows, tau, weights=None):
    """Eq. 6 per anchor, both directions, as Python floats: for anchor z_i^(k),
    −w_i⟨z_i^(1), z_i^(2)⟩/τ + log Σ_{l∈{1,2}, j≠i} exp(⟨z_i^(k), z_j^(l)⟩/τ); mean over anchors."""
    views = (z1_all.tolist(), z2_all.tolist())
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    losses = []
    for k in (0, 1):
        for n, i in enumerate(rows):
            anchor = views[k][i]
            negatives = [views[v][j] for v in (0, 1) for j in range(len(views[0])) if j != i]
            w = 1.0 if weights is None else weights[n]
            positive = dot(views[0][i], views[1][i])
            losses.append(-w * positive / tau + math.log(sum(math.exp(dot(anchor, v) / tau) for v in negatives)))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("offset", [0, 3])
def test_dcl_equals_brute_force_per_anchor_loop(offset):
    """One logsumexp over the 2B−2 negatives (same view and other view), positive excluded; local
    anchors are rows offset..offset+N of the gathered batch, as on rank > 0."""
    n, b, tau = 3, 6, 0.1
    z1_all, z2_all = _unit(b, 8, 0), _unit(b, 8, 1)
    rows = list(range(offset, offset + n))
    pos, neg = nt_xent_similarities(z1_all[rows], z2_all[rows], z1_all, z2_all, offset)
    assert neg.shape == (2 * n, 2 * b - 2)
    got = decoupled_nce(pos, neg, tau)
    assert got.item() == pytest.approx(_dcl_loop(z1_all, z2_all, rows, tau), rel=1e-12)
    # Negative values are possible (no positive in the denominator): well separated pairs.
    z = _unit(b, 8, 2)
    pos, neg = nt_xent_similarities(z, z, z, z, 0)  # positives at cosine 1
    assert decoupled_nce(pos, neg, 0.1).item() < 0


def test_mocov2_dcl_is_minus_positive_plus_logsumexp_over_the_queue():
    cfg = load_config(RECIPES / "tiny_mocov2_dcl.yaml", ["method.queue_size=32"])
    method = METHODS["moco"](cfg, 1).double()
    q, k = _unit(4, 128, 3), _unit(4, 128, 4)
    loss, logs = method.contrast_with_queue(q, k)
    queue, tau = method.queue.T.tolist(), cfg.method.temperature
    ref = [
        -(qi @ ki).item() / tau
        + math.log(sum(math.exp(sum(a * c for a, c in zip(qi.tolist(), col)) / tau) for col in queue))
        for qi, ki in zip(q, k)
    ]
    assert loss.item() == pytest.approx(sum(ref) / 4, rel=1e-12)
    assert logs["infonce"].item() > loss.item()  # InfoNCE adds the positive to the denominator


def test_dclw_weights_follow_the_paper_formula_and_have_mean_one():
    n, d, sigma = 6, 16, 0.5
    z1_all, z2_all = _unit(n, d, 5), _unit(n, d, 6)
    s = (z1_all * z2_all).sum(1)
    w = dclw_weights(s, sigma)
    e = torch.exp(s / sigma)
    torch.testing.assert_close(w, 2 - e / e.mean(), rtol=1e-12, atol=1e-12)
    assert w.mean().item() == pytest.approx(1.0, abs=1e-12)
    # SimCLR's anchors [z1; z2] repeat each positive: same weights as the N pairs.
    torch.testing.assert_close(dclw_weights(torch.cat([s, s]), sigma), torch.cat([w, w]), rtol=1e-12, atol=1e-12)
    pos, neg = nt_xent_similarities(z1_all, z2_all, z1_all, z2_all, 0)
    dclw = DCLLoss(0.1, weight_sigma=sigma)(pos, neg)
    assert dclw.item() == pytest.approx(_dcl_loop(z1_all, z2_all, range(n), 0.1, w.tolist()), rel=1e-12)


def test_dclw_reduces_to_dcl_when_the_weight_is_one():
    pos, neg = _unit(5, 4, 7) @ _unit(1, 4, 8).T, _unit(5, 4, 9) @ _unit(7, 4, 10).T
    pos = pos.squeeze(1)
    dcl = decoupled_nce(pos, neg, 0.2)
    assert decoupled_nce(pos, neg, 0.2, pos_weight=torch.ones(5, dtype=torch.float64)).item() == dcl.item()
    # σ → ∞ makes the softmax uniform: w → 1.
    assert DCLLoss(0.2, weight_sigma=1e12)(pos, neg).item() == pytest.approx(dcl.item(), rel=1e-9)
    assert abs(DCLLoss(0.2, weight_sigma=0.5)(pos, neg).item() - dcl.item()) > 1e-3


def test_dclw_detach_option_controls_the_weight_gradient():
    pos = torch.tensor([0.9, 0.1, -0.3, 0.5], dtype=torch.float64, requires_grad=True)
    neg = _unit(4, 3, 11) @ _unit(6, 3, 12).T
    tau, sigma = 0.1, 0.5
    DCLLoss(tau, sigma, detach_weights=True)(pos, neg).backward()
    w = dclw_weights(pos, sigma)
    torch.testing.assert_close(pos.grad, -w / (4 * tau), rtol=1e-12, atol=1e-12)  # w is a constant
    pos.grad = None
    DCLLoss(tau, sigma, detach_weights=False)(pos, neg).backward()
    assert (pos.grad - (-w / (4 * tau))).abs().max() > 1e-3


def test_dcl_gradient_has_no_npc_multiplier():
    """DCL paper, Prop. 1 on a small case: for one anchor u with positive v and negatives n_j,
    ∂L_InfoNCE/∂v = −q_B·u/τ with q_B = 1 − e^{⟨u,v⟩/τ}/(e^{⟨u,v⟩/τ} + Σ_j e^{⟨u,n_j⟩/τ}), which
    depends on the negatives; DCL's ∂L/∂v = −u/τ does not."""
    tau = 0.2
    u = torch.tensor([[0.6, 0.8, 0.0]], dtype=torch.float64)
    grads = {}
    for name, negatives in {
        "far": [[0.0, -1.0, 0.0], [-1.0, 0.0, 0.0]],
        "near": [[0.8, 0.6, 0.0], [0.0, 0.6, 0.8]],
    }.items():
        v = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
        n = torch.tensor(negatives, dtype=torch.float64)
        neg = u @ n.T
        (g_dcl,) = torch.autograd.grad(decoupled_nce((u * v).sum(1), neg, tau), v)
        (g_nce,) = torch.autograd.grad(info_nce((u * v).sum(1), neg, tau), v)
        pos = (u * v).sum(1).detach()
        s0, s = 0.6, neg.squeeze(0).tolist()  # ⟨u,v⟩ = 0.6
        q_b = 1 - math.exp(s0 / tau) / (math.exp(s0 / tau) + sum(math.exp(x / tau) for x in s))
        torch.testing.assert_close(g_dcl, -u / tau, rtol=0, atol=1e-15)
        torch.testing.assert_close(g_nce, -q_b * u / tau, rtol=1e-12, atol=1e-15)
        # The engine's logged NPC multiplier is this q_B.
        npc = contrastive_stats(pos, neg, tau, 0.0, info_nce(pos, neg, tau), 2)["npc_mean"]
        assert npc.item() == pytest.approx(q_b, rel=1e-4)  # diagnostics run in fp32
        grads[name] = g_nce
    assert (grads["far"] - grads["near"]).abs().max() > 0.1  # InfoNCE's does depend on the negatives


def test_dclw_weights_are_global_unless_the_per_process_flag_asks():
    """One process: both forms are the softmax over the same anchors. The 2-process equality with
    one process (and the per-process control) is in test_dist.py and test_multiprocess.py."""
    from pretrain.losses import LOSSES

    pos = _unit(6, 4, 13) @ _unit(1, 4, 14).T
    torch.testing.assert_close(
        dclw_weights(pos.squeeze(1), 0.5, per_process=True), dclw_weights(pos.squeeze(1), 0.5), rtol=0, atol=0
    )
    flags = {}
    for overrides in ([], ["method.loss.per_process=true"]):
        criterion = LOSSES["dclw"].from_config(load_config(RECIPES / "tiny_dclw.yaml", overrides).method)
        flags[tuple(overrides)] = criterion.per_process_weights
    assert flags == {(): False, ("method.loss.per_process=true",): True}
