"""InfoNCE family: every check compares against an independent brute-force reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.losses import (
    EqCoLoss,
    InfoNCELoss,
    eqco_margin,
    in_batch_similarities,
    info_nce,
    mi_lower_bound,
    nt_xent_similarities,
    sample_negatives,
)


def _cosines(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    pos = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
    neg = torch.rand(n, k, generator=g, dtype=torch.float64) * 2 - 1
    return pos.to(dtype), neg.to(dtype)


def _unit(n, d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=1)


def _loop_info_nce(pos, neg, tau, margins):
    """−log(e^{(s0−m)/τ} / (e^{(s0−m)/τ} + Σ e^{s_i/τ})) per row, in Python floats."""
    out = []
    for s0, row, m in zip(pos.tolist(), neg.tolist(), margins):
        num = math.exp((s0 - m) / tau)
        out.append(-math.log(num / (num + sum(math.exp(s / tau) for s in row))))
    return torch.tensor(out, dtype=torch.float64)


def _scaled_negative_sum_loss(pos, neg, tau, alpha):
    """EqCo's defining form: −log(e^{s0/τ} / (e^{s0/τ} + (α/K) Σ e^{s_i/τ})), in float64."""
    pos, neg = pos.double(), neg.double()
    num = torch.exp(pos / tau)
    return -torch.log(num / (num + alpha / neg.shape[1] * torch.exp(neg / tau).sum(1))).mean()


# ---------------------------------------------------------------- info_nce


@pytest.mark.parametrize("margin", [0.0, 0.3, -0.2])
def test_info_nce_matches_loop(margin):
    pos, neg = _cosines(6, 9)
    ref = _loop_info_nce(pos, neg, 0.2, [margin] * 6)
    got = info_nce(pos, neg, 0.2, margin=margin, reduction="none")
    assert got.shape == (6,)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(info_nce(pos, neg, 0.2, margin).double(), ref.mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(info_nce(pos, neg, 0.2, margin, "sum").double(), ref.sum(), rtol=1e-5, atol=1e-6)


def test_info_nce_per_row_margin_tensor():
    pos, neg = _cosines(5, 7, seed=1)
    margins = torch.linspace(-0.5, 0.5, 5)
    ref = _loop_info_nce(pos, neg, 0.1, margins.tolist())
    got = info_nce(pos, neg, 0.1, margin=margins, reduction="none")
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alpha,k", [(65536, 16), (256, 255), (16, 4096), (7.5, 3)])
def test_eqco_margin_form_equals_scaled_negative_sum(alpha, k):
    pos, neg = _cosines(8, k, seed=2, dtype=torch.float64)
    tau = 0.2
    got = info_nce(pos, neg, tau, margin=eqco_margin(tau, alpha, k))
    torch.testing.assert_close(got, _scaled_negative_sum_loss(pos, neg, tau, alpha), rtol=1e-10, atol=1e-10)
    assert (eqco_margin(tau, alpha, k) > 0) == (k < alpha)


def test_eqco_with_k_equal_alpha_is_plain_infonce():
    pos, neg = _cosines(8, 32, seed=3)
    assert eqco_margin(0.07, 32, 32) == 0.0
    plain = info_nce(pos, neg, 0.07)
    torch.testing.assert_close(EqCoLoss(0.07, alpha=32)(pos, neg), plain)
    # ...and differs for another alpha, so the module really applies the margin.
    assert not torch.allclose(EqCoLoss(0.07, alpha=4096)(pos, neg), plain)


@pytest.mark.parametrize("bad", [dict(alpha=0, k=4), dict(alpha=-1.0, k=4), dict(alpha=4, k=0)])
def test_eqco_margin_validates(bad):
    name = "alpha" if bad["alpha"] <= 0 else "k"
    with pytest.raises(ValueError, match=name):
        eqco_margin(0.2, **bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_give_fp32_loss(dtype):
    pos32, neg32 = _cosines(16, 256, seed=4)
    pos, neg = pos32.to(dtype), neg32.to(dtype)
    got = info_nce(pos, neg, 0.07, margin=0.1, reduction="none")
    assert got.dtype == torch.float32
    # Same rounded inputs computed in fp32: must agree to fp32 precision.
    torch.testing.assert_close(got, info_nce(pos.float(), neg.float(), 0.07, 0.1, "none"), rtol=1e-6, atol=1e-6)
    # Original fp32 inputs: only input rounding differs (≈ 2^-8 relative of a cosine / τ).
    torch.testing.assert_close(got, info_nce(pos32, neg32, 0.07, 0.1, "none"), rtol=0, atol=0.1)


def test_autocast_does_not_lower_precision():
    z = _unit(8, 32, seed=5, dtype=torch.float32)
    keys = _unit(8, 32, seed=6, dtype=torch.float32)
    ref_pos, ref_neg = in_batch_similarities(z, keys, 0)
    ref = info_nce(ref_pos, ref_neg, 0.07)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pos, neg = in_batch_similarities(z, keys, 0)
        loss = info_nce(pos, neg, 0.07)
    assert pos.dtype == neg.dtype == loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- sample_negatives


def test_sample_negatives_without_replacement_and_from_own_row():
    n, k_all, k = 8, 50, 20
    neg = torch.arange(n * k_all, dtype=torch.float32).view(n, k_all)  # value -> (row, column)
    for mode in ("per_query", "per_batch"):
        sel = sample_negatives(neg, k, mode, generator=torch.Generator().manual_seed(0))
        assert sel.shape == (n, k)
        for i, row in enumerate(sel.long().tolist()):
            assert len(set(row)) == k, "duplicate column"
            assert all(v // k_all == i for v in row), "value taken from another row"


def test_sample_negatives_full_k_is_a_permutation():
    neg = torch.randn(4, 10)
    sel = sample_negatives(neg, 10, "per_query", generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sel.sort(1).values, neg.sort(1).values)


def test_sample_negatives_per_batch_shared_per_query_independent():
    n, k_all, k = 16, 40, 8
    cols = torch.arange(k_all, dtype=torch.float32).expand(n, k_all)  # value = column index
    shared = sample_negatives(cols, k, "per_batch", generator=torch.Generator().manual_seed(2))
    assert (shared == shared[0]).all()
    indep = sample_negatives(cols, k, "per_query", generator=torch.Generator().manual_seed(2))
    assert len({tuple(sorted(r)) for r in indep.tolist()}) > n // 2


def test_sample_negatives_generator_makes_it_reproducible():
    neg = torch.randn(6, 30)
    a = sample_negatives(neg, 5, generator=torch.Generator().manual_seed(3))
    b = sample_negatives(neg, 5, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode,draws,tol", [("per_query", 200, 0.02), ("per_batch", 3000, 0.04)])
def test_sample_negatives_uniform(mode, draws, tol):
    n, k_all, k = 64, 20, 5
    cols = torch.arange(k_all, dtype=torch.float32).expand(n, k_all)
    g = torch.Generator().manual_seed(4)
    counts = torch.zeros(k_all)
    for _ in range(draws):
        counts += torch.bincount(sample_negatives(cols, k, mode, g).long().flatten(), minlength=k_all)
    freq = counts / (draws * n)  # P(column chosen for a row); k/K = 0.25 if uniform
    assert (freq - k / k_all).abs().max() < tol, freq


def test_sample_negatives_errors():
    neg = torch.randn(3, 7)
    with pytest.raises(ValueError, match=r"k=8.*7 available"):
        sample_negatives(neg, 8)
    with pytest.raises(ValueError, match=r"per_query.*per_batch.*'per_row'"):
        sample_negatives(neg, 2, mode="per_row")
    with pytest.raises(ValueError, match="sampling"):
        InfoNCELoss(0.2, num_negatives=2, sampling="random")


def test_module_uses_sampled_k_in_eqco_margin():
    pos, neg = _cosines(8, 100, seed=6)
    tau, alpha, k = 0.2, 65536, 16
    torch.manual_seed(7)
    got = EqCoLoss(tau, alpha=alpha, num_negatives=k, sampling="per_query")(pos, neg)
    torch.manual_seed(7)
    sampled = sample_negatives(neg, k, "per_query")
    torch.testing.assert_close(got.double(), _scaled_negative_sum_loss(pos, sampled, tau, alpha), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- similarities


def test_in_batch_similarities_match_loop():
    n, m, d, offset = 4, 12, 16, 4
    q, keys = _unit(n, d, seed=8), _unit(m, d, seed=9)
    pos, neg = in_batch_similarities(q, keys, offset)
    assert pos.shape == (n,) and neg.shape == (n, m - 1)
    for i in range(n):
        assert math.isclose(pos[i].item(), torch.dot(q[i], keys[offset + i]).item(), abs_tol=1e-12)
        ref = [torch.dot(q[i], keys[j]).item() for j in range(m) if j != offset + i]
        torch.testing.assert_close(neg[i], torch.tensor(ref, dtype=torch.float64))


def test_nt_xent_similarities_match_loop():
    world, n, d, r = 3, 4, 8, 1  # this "rank" holds rows 4..7 of the B=12 global batch
    b, offset = world * n, r * n
    z1_all, z2_all = _unit(b, d, seed=10), _unit(b, d, seed=11)
    z1, z2 = z1_all[offset : offset + n], z2_all[offset : offset + n]
    pos, neg = nt_xent_similarities(z1, z2, z1_all, z2_all, offset)
    assert pos.shape == (2 * n,) and neg.shape == (2 * n, 2 * b - 2)
    for view, (own, other) in enumerate([(z1_all, z2_all), (z2_all, z1_all)]):
        for i in range(n):
            g = offset + i
            a = view * n + i
            ref_neg = [own[g] @ other[j] for j in range(b) if j != g]
            ref_neg += [own[g] @ own[j] for j in range(b) if j != g]
            assert math.isclose(pos[a].item(), (own[g] @ other[g]).item(), abs_tol=1e-12)
            torch.testing.assert_close(neg[a], torch.stack(ref_neg))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nt_xent_loss_equals_full_matrix_reference(dtype):
    # Independent single-process NT-Xent (lightly/solo-style): a (2B, 2B) cosine matrix with
    # the diagonal masked, label of row i is its other view, mean over the 2B anchors.
    b, d, tau = 6, 16, 0.5
    z1, z2 = _unit(b, d, seed=12, dtype=dtype), _unit(b, d, seed=13, dtype=dtype)
    z = torch.cat([z1, z2])
    logits = (z @ z.T / tau).masked_fill(torch.eye(2 * b, dtype=torch.bool), float("-inf"))
    ref = F.cross_entropy(logits, (torch.arange(2 * b) + b) % (2 * b))
    pos, neg = nt_xent_similarities(z1, z2, z1, z2, 0)
    torch.testing.assert_close(info_nce(pos, neg, tau), ref)


# ---------------------------------------------------------------- MI bound


def test_mi_lower_bound():
    tau, alpha, k = 0.2, 65536, 16
    # Paper Eq. 4: f = log(1 + K e^{m/τ}) − L; with the EqCo margin it depends on α only.
    paper = math.log(1 + k * math.exp(eqco_margin(tau, alpha, k) / tau)) - 3.0
    assert math.isclose(mi_lower_bound(3.0, alpha), paper, rel_tol=1e-12)
    assert math.isclose(mi_lower_bound(3.0, k), math.log(k + 1) - 3.0)
    loss = torch.tensor(2.5)
    assert math.isclose(EqCoLoss(tau, alpha=alpha).mi_lower_bound(loss).item(), math.log1p(alpha) - 2.5, rel_tol=1e-6)
    assert math.isclose(InfoNCELoss(tau).mi_lower_bound(2.5, k=255), math.log(256) - 2.5)
    with pytest.raises(ValueError, match="needs k"):
        InfoNCELoss(tau).mi_lower_bound(2.5)
