"""Dual-temperature InfoNCE against the official formula, InfoNCE at τ_β = τ_α, fp32 extremes, and
the SimCo / SimMoCo wiring against per-anchor loops over the encoders' outputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import load_config
from pretrain.losses import dual_temperature_nce, dual_temperature_weights, info_nce
from pretrain.methods import METHODS

from .test_engine import RECIPES


def _cosines(n, k, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g, dtype=dtype) * 2 - 1, torch.rand(n, k, generator=g, dtype=dtype) * 2 - 1)


def _official(pos, neg, tau, dt_m):
    """dual_temperature_loss_func's arithmetic on (pos, neg): the probabilities, not logs."""
    logits = torch.cat([pos.unsqueeze(1), neg], dim=1)
    p_intra, p_inter = F.softmax(logits / tau, dim=1)[:, 0], F.softmax(logits / (tau * dt_m), dim=1)[:, 0]
    w = ((1 - p_inter) / (1 - p_intra)).detach()
    return (w * -F.log_softmax(logits / tau, dim=1)[:, 0]).mean(), w


def test_matches_the_official_formula_values_weights_and_gradients():
    pos, neg = _cosines(8, 7, seed=0)
    pos.requires_grad_(True)
    got = dual_temperature_nce(pos, neg, 0.1, 1.0)
    (g_got,) = torch.autograd.grad(got, pos)
    ref, w_ref = _official(pos, neg, 0.1, 10)
    (g_ref,) = torch.autograd.grad(ref, pos)
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(dual_temperature_weights(pos, neg, 0.1, 1.0), w_ref, rtol=1e-10, atol=0)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-10, atol=1e-14)
    # The weight is a constant for autograd: ∂L/∂pos_i = −w_i·(1 − p_α,i)/(N·τ_α).
    p_alpha = F.softmax(torch.cat([pos.detach().unsqueeze(1), neg], 1) / 0.1, dim=1)[:, 0]
    torch.testing.assert_close(g_got, -w_ref * (1 - p_alpha) / (8 * 0.1), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("tau", [0.07, 0.1, 0.5])
def test_equal_temperatures_give_infonce(tau):
    pos, neg = _cosines(6, 9, seed=1, dtype=torch.float32)
    pos.requires_grad_(True)
    dt, nce = dual_temperature_nce(pos, neg, tau, tau), info_nce(pos, neg, tau)
    torch.testing.assert_close(dt, nce, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(dt, pos)[0], torch.autograd.grad(nce, pos)[0], rtol=1e-5, atol=1e-8)
    assert torch.equal(dual_temperature_weights(pos, neg, tau, tau), torch.ones(6))


@pytest.mark.parametrize("tau_alpha", [0.1, 0.02, 0.005])
def test_weights_stay_finite_for_near_one_hot_logits(tau_alpha):
    """Positive at cosine 1, negatives at −1: 1 − p_α rounds to 0 in fp32 (the official ratio gives
    NaN); here the weights, the loss and its gradient stay finite, and where float64 can represent
    the weight the fp32 value matches it."""
    pos = torch.ones(4, requires_grad=True)
    neg = -torch.ones(4, 3)
    loss = dual_temperature_nce(pos, neg, tau_alpha, 1.0)
    (grad,) = torch.autograd.grad(loss, pos)
    w = dual_temperature_weights(pos, neg, tau_alpha, 1.0)
    assert torch.isfinite(w).all() and torch.isfinite(loss) and torch.isfinite(grad).all()
    official_loss, official_w = _official(pos.detach(), neg, tau_alpha, 1.0 / tau_alpha)
    assert not torch.isfinite(official_w).all() or not torch.isfinite(official_loss)  # the control fails
    # Exact: log w = log(1 − p_β) − log(1 − p_α) with 1 − p_τ = 3e^{−2/τ} / (1 + 3e^{−2/τ}).
    log_w = sum(s * (math.log(3) - 2 / t - math.log1p(3 * math.exp(-2 / t))) for s, t in ((1, 1.0), (-1, tau_alpha)))
    if log_w < math.log(torch.finfo(torch.float32).max):
        assert w[0].item() == pytest.approx(math.exp(log_w), rel=1e-5)
    else:
        assert w[0].item() == torch.finfo(torch.float32).max


def _dt_loop(q, keys, tau_a, tau_b):
    """Per-anchor loop: anchor i's positive is keys[i], its negatives the other keys."""
    losses = []
    for i in range(len(q)):
        s = [(q[i] @ keys[j]).item() for j in range(len(keys))]
        pos, neg = s[i], s[:i] + s[i + 1 :]
        p = {t: math.exp(pos / t) / (math.exp(pos / t) + sum(math.exp(x / t) for x in neg)) for t in (tau_a, tau_b)}
        losses.append((1 - p[tau_b]) / (1 - p[tau_a]) * -math.log(p[tau_a]))
    return sum(losses) / len(losses)


def _tiny(recipe):
    cfg = load_config(RECIPES / f"{recipe}.yaml", ["data.image_size=8", "train.batch_size=6"])
    torch.manual_seed(0)
    return cfg, METHODS[cfg.method.name](cfg, 1).double().eval()  # eval: BN per sample, comparable forwards


def test_simco_is_symmetric_dual_temperature_between_the_two_views_with_gradient_on_both():
    cfg, method = _tiny("tiny_simco")
    g = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(6, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = method([x1, x2])
    with torch.no_grad():
        z1, z2 = (F.normalize(method.encoder(x), dim=1) for x in (x1, x2))
    tau_a, tau_b = cfg.method.temperature, cfg.method.loss.inter_temperature
    assert (tau_a, tau_b) == (0.1, 1.0)
    ref = 0.5 * (_dt_loop(z1, z2, tau_a, tau_b) + _dt_loop(z2, z1, tau_a, tau_b))
    assert out["loss"].item() == pytest.approx(ref, rel=1e-6)  # methods cast embeddings to fp32
    # Keys carry gradient: dropping the key side's gradient changes the parameter gradients.
    full = torch.autograd.grad(out["loss"], [p for p in method.encoder.parameters() if p.requires_grad])
    z1, z2 = (F.normalize(method.encoder(x), dim=1) for x in (x1, x2))
    half = torch.autograd.grad(
        0.5
        * (
            dual_temperature_nce(*_pairs(z1, z2.detach()), tau_a, tau_b)
            + dual_temperature_nce(*_pairs(z2, z1.detach()), tau_a, tau_b)
        ),
        [p for p in method.encoder.parameters() if p.requires_grad],
    )
    assert max((a - b).abs().max().item() for a, b in zip(full, half)) > 1e-6


def _pairs(q, keys):
    sim = q @ keys.T
    off = ~torch.eye(len(q), dtype=torch.bool)
    return sim.diagonal(), sim[off].view(len(q), -1)


def test_simmoco_contrasts_queries_with_momentum_keys_of_the_batch():
    cfg, method = _tiny("tiny_simmoco")
    assert (dict(cfg.method.loss), cfg.method.momentum, cfg.method.head) == (
        {"name": "dual_temperature", "inter_temperature": 1.0},
        0.9,  # the tiny momentum recipes' (benchmarks/tiny_recipes.md; simmoco.yaml keeps the paper's 0.99)
        "mlp_bn",  # the tiny recipe's CPU-scale head (simmoco.yaml keeps the paper's BN-free mlp)
    )
    g = torch.Generator().manual_seed(2)
    x1, x2 = (torch.randn(6, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():  # perturb the online encoder so that the EMA step is visible
        for p in method.encoder_q.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        ema = {
            k: 0.9 * v + 0.1 * dict(method.encoder_q.named_parameters())[k]
            for k, v in method.encoder_k.named_parameters()
        }
    out = method([x1, x2])
    for k, v in method.encoder_k.named_parameters():
        torch.testing.assert_close(v, ema[k], rtol=1e-12, atol=1e-14)
        assert not v.requires_grad
    with torch.no_grad():
        q, k = F.normalize(method.encoder_q(x1), dim=1), F.normalize(method.encoder_k(x2), dim=1)
    assert out["loss"].item() == pytest.approx(_dt_loop(q, k, 0.1, 1.0), rel=1e-6)
