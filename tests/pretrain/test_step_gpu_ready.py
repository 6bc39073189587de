"""What makes a step GPU-ready, shown on CPU: no tensor value read on the host inside a step, the fused
(_foreach) updates equal the per-tensor loops bit for bit, negatives by index gather equal the
boolean-mask selection, SplitBatchNorm under channels_last, AdCo's ascent skipped with the network's
step, the gradient-norm diagnostic without the fp16 loss scale, and the speed settings in the engine."""

from __future__ import annotations

import contextlib
import json
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from contrastive_transfer.errors import ConfigError
from pretrain.config import load_config
from pretrain.diagnostics import grad_norm_stats
from pretrain.engine import train
from pretrain.losses.similarities import in_batch_similarities
from pretrain.methods import METHODS
from pretrain.models import SplitBatchNorm, momentum_update
from pretrain.optim import LARS

from ..method_cases import NARROW

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "pretrain"
B, SIZE = 8, 16


def _method(recipe: str, *overrides: str):
    cfg = load_config(
        RECIPES / f"{recipe}.yaml",
        [f"train.batch_size={B}", f"data.image_size={SIZE}", "method.dim=8", "model.stem=small", NARROW, *overrides],
    )
    torch.manual_seed(0)
    return METHODS[cfg.method.name](cfg, 1).train(), cfg


def _views(n_views: int = 2, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(B, 3, SIZE, SIZE, generator=g) for _ in range(n_views)]


@contextlib.contextmanager
def no_host_reads():
    """Fail on every way Python code reads a tensor's value on the host (each is a GPU sync)."""

    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"a step read a tensor on the host: Tensor.{name}")

        return method

    with contextlib.ExitStack() as stack:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, refuse(name)))
        yield


STEP_CASES = {
    "mocov2": ("tiny_mocov2", ("method.queue_size=32", "method.bn_splits=1")),
    "mocov2_eqco_sampled": (
        "tiny_mocov2_eqco",
        ("method.queue_size=32", "method.num_negatives=5", "method.bn_splits=1"),
    ),
    "simclr": ("tiny_simclr", ()),
    "simo_sampled": ("tiny_simo", ("method.num_negatives=3",)),
    "simco": ("tiny_simco", ()),
    "dclw": ("tiny_dclw", ()),
    "adco": ("tiny_adco", ("method.bank_init=fill", f"method.bank_size={B}", "method.bn_splits=1")),
}


@pytest.mark.parametrize("name", sorted(STEP_CASES))
def test_a_step_reads_no_tensor_on_the_host(name):
    recipe, overrides = STEP_CASES[name]
    method, _ = _method(recipe, *overrides)
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1)
    for step in range(3):  # AdCo: the filling step, then adversarial steps with the ascent
        views = _views(2, step)
        with no_host_reads():
            loss = method(views)["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            method.after_step(skipped=False)
    assert torch.isfinite(loss.detach()).all()


def test_the_host_read_detector_can_fail():
    with pytest.raises(AssertionError, match="Tensor.item"), no_host_reads():
        torch.ones(1).item()
    with pytest.raises(AssertionError, match="__int__"), no_host_reads():
        int(torch.zeros((), dtype=torch.long))


def test_host_counters_follow_a_loaded_state():
    method, _ = _method("tiny_mocov2", "method.queue_size=32", "method.bn_splits=1")
    for step in range(3):
        method(_views(2, step))
    assert method.ptr == 3 * B % 32 and int(method.queue_ptr) == method.ptr
    fresh, _ = _method("tiny_mocov2", "method.queue_size=32", "method.bn_splits=1")
    fresh.load_state_dict(method.state_dict())
    assert fresh.ptr == method.ptr
    adco, _ = _method("tiny_adco", "method.bank_init=fill", f"method.bank_size={2 * B}", "method.bn_splits=1")
    adco(_views(2))
    adco.after_step()
    other, _ = _method("tiny_adco", "method.bank_init=fill", f"method.bank_size={2 * B}", "method.bn_splits=1")
    other.load_state_dict(adco.state_dict())
    assert other.filled_count == adco.filled_count == B and other.filling


# ------------------------------------------------------------------------- fused updates


def test_foreach_momentum_update_equals_the_loop_bit_for_bit():
    torch.manual_seed(0)
    online = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Linear(4, 5))
    target = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Linear(4, 5))
    reference = [p.detach().clone() for p in target.parameters()]
    with torch.no_grad():
        momentum_update(online, target, 0.99)
        for p_t, p_o in zip(reference, online.parameters()):
            p_t.mul_(0.99).add_(p_o, alpha=1 - 0.99)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), reference))
    assert not torch.equal(next(target.parameters()), next(online.parameters()))


def _lars_loop(params, state, lr, momentum, weight_decay, eta, lars):
    """SimCLR's LARS written per tensor, as before the fused version."""
    with torch.no_grad():
        for p in params:
            g = p.grad.add(p, alpha=weight_decay) if weight_decay else p.grad.clone()
            if lars:
                w_norm, g_norm = p.norm(), g.norm()
                g.mul_(torch.where((w_norm > 0) & (g_norm > 0), eta * w_norm / g_norm, torch.ones_like(w_norm)))
            buf = state.setdefault(id(p), torch.zeros_like(p))
            buf.mul_(momentum).add_(g, alpha=lr)
            p.sub_(buf)


@pytest.mark.parametrize("lars,weight_decay", [(True, 1e-4), (True, 0.0), (False, 1e-6)])
def test_foreach_lars_equals_the_loop_bit_for_bit(lars, weight_decay):
    torch.manual_seed(0)
    shapes = [(16, 8, 3, 3), (16,), (5,), (7, 3)]
    fused = [torch.randn(s, requires_grad=True) for s in shapes]
    with torch.no_grad():
        fused[2].zero_()  # a zero-norm tensor takes trust 1
    looped = [p.detach().clone().requires_grad_() for p in fused]
    optimizer = LARS([{"params": fused, "weight_decay": weight_decay, "lars": lars}], lr=0.3, momentum=0.9, eta=1e-3)
    state = {}
    for _ in range(3):
        for a, b in zip(fused, looped):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        optimizer.step()
        _lars_loop(looped, state, 0.3, 0.9, weight_decay, 1e-3, lars)
    assert all(torch.equal(a, b) for a, b in zip(fused, looped))


def test_negatives_by_index_gather_equal_the_boolean_mask():
    torch.manual_seed(0)
    q, keys = F.normalize(torch.randn(4, 6), dim=1), F.normalize(torch.randn(12, 6), dim=1)
    for offset in (0, 4, 8):
        pos, neg = in_batch_similarities(q, keys, offset)
        sim = q @ keys.T
        keep = torch.ones_like(sim, dtype=torch.bool)
        keep[torch.arange(4), torch.arange(4) + offset] = False
        assert torch.equal(neg, sim[keep].view(4, 11))
        assert torch.equal(pos, sim[torch.arange(4), torch.arange(4) + offset])


def test_split_batchnorm_under_channels_last_equals_nchw():
    torch.manual_seed(0)
    x = torch.randn(8, 4, 5, 5)
    plain, nhwc = SplitBatchNorm(4, num_splits=4), SplitBatchNorm(4, num_splits=4)
    y = plain(x)
    y_nhwc = nhwc(x.contiguous(memory_format=torch.channels_last))
    assert y_nhwc.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y_nhwc, y, rtol=0, atol=1e-6)
    torch.testing.assert_close(nhwc.running_var, plain.running_var, rtol=0, atol=1e-7)


# ------------------------------------------------------------------------- mixed precision


def test_adco_ascent_is_skipped_with_the_networks_step():
    method, _ = _method("tiny_adco", "method.bank_init=fill", f"method.bank_size={B}", "method.bn_splits=1")
    method(_views(2, 0))
    method.after_step(skipped=True)  # filling is kept even on a skipped step: the keys are fine
    assert not method.filling
    bank = method.bank.weight.clone()
    method(_views(2, 1))
    method.after_step(skipped=True)
    assert torch.equal(method.bank.weight, bank)
    method(_views(2, 2))
    method.after_step(skipped=False)
    assert not torch.equal(method.bank.weight, bank)


def test_gradient_norm_diagnostic_divides_out_the_loss_scale():
    q = torch.zeros(2, 3, requires_grad=True)
    q.grad = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0]]) * 1024  # as scaled by a GradScaler at 1024
    stats = grad_norm_stats(q, loss_scale=1024.0)
    assert stats == pytest.approx({"grad_q_norm_mean": 3.5, "grad_q_norm_std": 1.5})


# ------------------------------------------------------------------------- engine settings


def test_speed_settings_are_validated():
    with pytest.raises(ConfigError, match="train.channels_last='fast': expected true, false or null"):
        load_config(RECIPES / "tiny_simclr.yaml", ["train.channels_last=fast"])


def test_engine_runs_channels_last_on_cpu(synthetic_root, tmp_path, capsys):
    cfg = load_config(
        RECIPES / "tiny_mocov2.yaml",
        [
            f"data.root={synthetic_root / 'imagenet' / 'train'}",
            f"train.output_dir={tmp_path}",
            "train.max_steps=2",
            "train.channels_last=true",
            "data.num_workers=0",
        ],
    )
    train(cfg, Accelerator(cpu=True))
    assert "channels_last True | cudnn.benchmark False" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2


# ------------------------------------------------------------------------- colour on the device


def test_colour_stage_on_the_device_equals_the_workers(synthetic_root):
    """Workers that send uint8 crops + draws, finished by the consumer, give the workers' views
    bit for bit (the device path runs here on CPU tensors)."""
    from pretrain.augment import build_multicrop_transforms, build_view_transforms
    from pretrain.data import ImageDataset, collate, finish_views

    root = synthetic_root / "imagenet" / "train"
    for views in (
        build_view_transforms("mocov2", 24),
        build_view_transforms("byol", 24),
        build_multicrop_transforms(32, [32, 16], [0.2, 0.1], [1.0, 0.5]),
    ):
        workers = ImageDataset(root, views, seed=4, backend="torchvision")
        deferred = ImageDataset(root, views, seed=4, colour_on_device=True, backend="torchvision")
        for ds in (workers, deferred):
            ds.set_epoch(3)
        indices = [2, 11, 40, 41]
        want, _, _ = collate(workers.__getitems__(indices))
        sent, _, _ = collate(deferred.__getitems__(indices))
        assert all(isinstance(v, tuple) and v[0].dtype == torch.uint8 for v in sent)
        sent_bytes = sum(c.numel() * c.element_size() + u.numel() * u.element_size() for c, u in sent)
        assert sent_bytes < 0.3 * sum(w.numel() * w.element_size() for w in want)  # ~1/4 of float32
        got = finish_views(sent, deferred.views, torch.device("cpu"))
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_prefetch_moves_one_batch_ahead_in_order():
    from pretrain.data import prefetch

    events = []

    def move(b):
        events.append(f"move {b}")
        return b * 10

    for item in prefetch(range(3), move):
        events.append(f"use {item}")
    assert events == ["move 0", "move 1", "use 0", "move 2", "use 10", "use 20"]
    assert list(prefetch([], move)) == []


def test_prefetch_finds_every_tensor_of_a_batch_for_its_stream_bookkeeping():
    """The tensors ``prefetch`` marks as used on the step's stream: all of them, also inside a
    batch's ``Views`` (a list subclass, which torch's pytree takes for one leaf: the control)."""
    import torch.utils._pytree as pytree

    from pretrain.data import tensors_in
    from pretrain.data_backends import Views

    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    batch = (Views([a, (b, c)], "fast"), {"labels": d}, ["bad.jpg"], None)
    assert [t is x for t, x in zip(tensors_in(batch), (a, b, c, d))] == [True] * 4
    assert len(list(tensors_in(batch))) == 4
    assert sum(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(batch)) == 1  # the control


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tools/gpu_check.sh runs it)")
def test_prefetch_on_its_own_stream_gives_the_batches_the_step_would_have_made():
    """On CUDA the next batch is moved on a side stream; the step must see exactly what moving it
    on its own stream gives (the judge), batch after batch. Each move is held back on the side
    stream (a GPU sleep before its copy), so a step that read the batch without waiting for it on
    the device would read it unwritten."""
    from pretrain.data import prefetch

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    batches = [
        ([torch.randint(0, 256, (16, 3, 64, 64), dtype=torch.uint8, generator=gen).pin_memory() for _ in range(2)], i)
        for i in range(5)
    ]

    def move(batch, hold=False):
        views, i = batch
        if hold:
            torch.cuda._sleep(10**8)  # ~50 ms of GPU clock cycles on the stream move runs on
        return [v.to(device, non_blocking=True).float().div(255).mul(i + 1) for v in views], i

    want = [move(b)[0] for b in batches]  # on the step's own stream
    torch.cuda.synchronize()
    seen = []
    for views, i in prefetch(batches, partial(move, hold=True), device):
        assert all(torch.equal(g, w) for g, w in zip(views, want[i])), i
        seen.append(i)
    assert seen == [0, 1, 2, 3, 4]


def test_engine_with_colour_on_device_trains_the_same_bits(synthetic_root, tmp_path):
    finals = []
    for flag in ("false", "true"):
        cfg = load_config(
            RECIPES / "tiny_simclr.yaml",
            [
                f"data.root={synthetic_root / 'imagenet' / 'train'}",
                f"train.output_dir={tmp_path / flag}",
                "train.max_steps=2",
                "data.num_workers=0",
                f"data.colour_on_device={flag}",
                "train.batch_size=8",
            ],
        )
        finals.append(torch.load(train(cfg, Accelerator(cpu=True)), weights_only=False)["backbone"])
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
