"""pretrain.dist in one process, and with 2 gloo processes on CPU against 1-process references."""

import pytest
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from pretrain import dist
from pretrain.losses import DCLLoss, info_nce, nt_xent_similarities

from ..multiprocess_harness import WORLD, NaiveGather, Workers, assert_check_passed

N = 4  # per-rank batch
TAU = 0.5

# ---------------------------------------------------------------- single process


def test_single_process_basics():
    assert not torch_dist.is_initialized()
    assert (dist.world_size(), dist.rank(), dist.rank_offset(7)) == (1, 0, 0)
    t = torch.randn(3, 2)
    assert dist.broadcast_(t) is t
    assert dist.all_ranks_equal(t)


def test_single_process_gathers_are_identity():
    x = torch.randn(5, 3, requires_grad=True)
    g = dist.gather_no_grad(x)
    torch.testing.assert_close(g, x.detach())
    assert not g.requires_grad

    w = torch.randn(5, 3)
    (dist.gather_with_grad(x) * w).sum().backward()
    torch.testing.assert_close(x.grad, w)


def test_single_process_shuffle_unshuffle():
    torch.manual_seed(0)
    x = torch.arange(16, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    shuffled, idx = dist.shuffle_batch(x)
    assert sorted(shuffled[:, 0].tolist()) == x[:, 0].tolist(), "not a permutation of the rows"
    assert not torch.equal(shuffled, x), "identity permutation (seeded: should not happen)"
    torch.testing.assert_close(dist.unshuffle_batch(shuffled, idx), x)
    # A row-wise "encoder" between the two: outputs come back in the input order.
    torch.testing.assert_close(dist.unshuffle_batch(shuffled * 3 + 1, idx), x * 3 + 1)


# ---------------------------------------------------------------- two processes (gloo)
# One spawn for all checks (tests/multiprocess_harness.py); each check asserts after its collectives.


def _global_views(d_in=6):
    # The same global batch and weights on every rank (same seed), like DDP after wrapping.
    g = torch.Generator().manual_seed(123)
    x1, x2 = (torch.randn(WORLD * N, d_in, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(d_in, 5, generator=g, dtype=torch.float64)
    return x1, x2, w


def _nt_xent_grad(x1, x2, w, gather, offset):
    w = w.clone().requires_grad_(True)
    z1, z2 = F.normalize(x1 @ w, dim=1), F.normalize(x2 @ w, dim=1)
    pos, neg = nt_xent_similarities(z1, z2, gather(z1), gather(z2), offset)
    loss = info_nce(pos, neg, TAU)
    loss.backward()
    return loss.detach(), w.grad


def _check_gather_with_grad(r, out_dir):
    x1, x2, w = _global_views()
    local = slice(r * N, (r + 1) * N)
    loss, grad = _nt_xent_grad(x1[local], x2[local], w, dist.gather_with_grad, dist.rank_offset(N))
    _, naive_grad = _nt_xent_grad(x1[local], x2[local], w, NaiveGather.apply, dist.rank_offset(N))
    for t in (loss, grad, naive_grad):  # what DDP does: average over ranks
        torch_dist.all_reduce(t)
        t /= WORLD
    # Reference: one process, the concatenated batch 2N, no gather.
    ref_loss, ref_grad = _nt_xent_grad(x1, x2, w, lambda z: z, 0)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
    # The test can fail: the gather without the summed backward misses cross-rank terms.
    assert (naive_grad - ref_grad).abs().max() > 1e-3


def _dclw_loss_and_grad(pos, neg, detach, per_process=False):
    pos = pos.clone().requires_grad_(True)
    loss = DCLLoss(TAU, weight_sigma=0.5, detach_weights=detach, per_process_weights=per_process)(pos, neg)
    loss.backward()
    return loss.detach(), pos.grad


def _check_dclw_global_weights(r, out_dir):
    """DCLW on each rank's N anchors, averaged as DDP does, equals DCLW on the 2N anchors of one
    process: loss and the gradient of every positive, with the weights detached or not. Negatives
    are per-anchor inputs here, so only the weights communicate."""
    g = torch.Generator().manual_seed(5)
    pos_all = torch.rand(WORLD * N, generator=g, dtype=torch.float64) * 2 - 1
    neg_all = torch.rand(WORLD * N, 6, generator=g, dtype=torch.float64) * 2 - 1
    local = slice(r * N, (r + 1) * N)
    got = {}
    for detach in (True, False):
        for per_process in (False, True):
            loss, grad = _dclw_loss_and_grad(pos_all[local], neg_all[local], detach, per_process)
            torch_dist.all_reduce(loss)
            grad_all = dist.gather_no_grad(grad)
            got[detach, per_process] = (loss / WORLD, grad_all / WORLD)  # DDP: mean of the rank losses
    for detach in (True, False):
        ref_loss, ref_grad = _dclw_loss_and_grad(pos_all, neg_all, detach)
        loss, grad = got[detach, False]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
        # The control: lightly's per-process softmax gives another loss and other gradients.
        local_loss, local_grad = got[detach, True]
        assert abs(local_loss - ref_loss) > 1e-3 and (local_grad - ref_grad).abs().max() > 1e-3


def _check_shuffle(r, out_dir):
    torch.manual_seed(1000 + r)  # different RNG streams: only the broadcast makes perms agree
    ids = torch.arange(r * N, (r + 1) * N, dtype=torch.float64)
    x = torch.stack([ids, -ids, ids * 10], dim=1)
    shuffled, idx = dist.shuffle_batch(x)
    back_identity = dist.unshuffle_batch(shuffled, idx)
    back_encoded = dist.unshuffle_batch(shuffled * 3 + 1, idx)
    same_perm = dist.all_ranks_equal(idx)
    all_shuffled = dist.gather_no_grad(shuffled)
    all_x = dist.gather_no_grad(x)

    assert same_perm, "ranks use different permutations"
    torch.testing.assert_close(back_identity, x, rtol=0, atol=0)
    torch.testing.assert_close(back_encoded, x * 3 + 1, rtol=0, atol=0)
    got_ids = all_shuffled[:, 0]
    assert sorted(got_ids.tolist()) == list(range(WORLD * N)), "slices do not tile the batch"
    assert not torch.equal(got_ids, all_x[:, 0]), "identity permutation (seeded: should not happen)"
    assert sorted(idx.tolist()) == list(range(WORLD * N))
    torch.testing.assert_close(all_shuffled[idx], all_x, rtol=0, atol=0)  # idx inverts the perm


def _check_collectives(r, out_dir):
    assert (dist.world_size(), dist.rank(), dist.rank_offset(N)) == (WORLD, r, r * N)
    x = torch.full((N, 3), float(r), requires_grad=True)
    gathered = dist.gather_no_grad(x)
    with_grad = dist.gather_with_grad(x)
    queue = torch.arange(12.0).view(3, 4)  # identical on all ranks
    equal_same = dist.all_ranks_equal(queue)
    differs = queue.clone()
    differs[1, 2] += r  # one element differs on rank 1 only
    equal_diff = dist.all_ranks_equal(differs)
    b = dist.broadcast_(torch.full((2,), float(r)), src=1)

    expected = torch.cat([torch.full((N, 3), float(i)) for i in range(WORLD)])
    torch.testing.assert_close(gathered, expected)
    assert not gathered.requires_grad
    torch.testing.assert_close(with_grad.detach(), expected)
    assert with_grad.requires_grad
    assert equal_same is True and equal_diff is False  # on every rank, rank 0 included
    torch.testing.assert_close(b, torch.full((2,), 1.0))


def _check_process_group_batchnorm(r, out_dir):
    """Each rank normalizes its half; outputs, input and parameter gradients (summed over ranks,
    as DDP's average of per-rank mean losses times W) equal plain BatchNorm on the whole batch."""
    from contrastive_transfer.sync_bn import ProcessGroupBatchNorm

    torch.manual_seed(0)  # same data and weights on every rank
    x_all = torch.randn(WORLD * N, 3, 2, 2, dtype=torch.float64) * 3 + 1
    w, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    target = torch.randn_like(x_all)

    ref = torch.nn.BatchNorm2d(3).double()
    ref.weight.data, ref.bias.data = w.clone(), b.clone()
    x_ref = x_all.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    ((y_ref * target).sum() / WORLD).backward()

    bn = ProcessGroupBatchNorm(3).double()
    bn.weight.data, bn.bias.data = w.clone(), b.clone()
    x = x_all[r * N : (r + 1) * N].clone().requires_grad_(True)
    y = bn(x)
    ((y * target[r * N : (r + 1) * N]).sum() / WORLD).backward()
    grad_w = bn.weight.grad.clone()
    torch_dist.all_reduce(grad_w)
    torch.testing.assert_close(y.detach(), y_ref.detach()[r * N : (r + 1) * N])
    torch.testing.assert_close(x.grad, x_ref.grad[r * N : (r + 1) * N])
    torch.testing.assert_close(grad_w, ref.weight.grad)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)


CHECKS = {
    "process_group_batchnorm": _check_process_group_batchnorm,
    "gather_with_grad": _check_gather_with_grad,
    "dclw_global_weights": _check_dclw_global_weights,
    "shuffle": _check_shuffle,
    "collectives": _check_collectives,
}


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    return Workers(CHECKS, tmp_path_factory.mktemp("dist"), timeout_s=30).results()


@pytest.mark.multiprocess
@pytest.mark.parametrize("check", list(CHECKS))
def test_two_processes(two_process_results, check):
    assert_check_passed(two_process_results, check)
