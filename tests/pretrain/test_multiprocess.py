"""Process-count invariance: every method that communicates, on 2 gloo processes on CPU, against
1-process references on the whole batch; and the engine end to end under torchrun.

* Every communicating method (``CASES``: SimCLR with DCL/DCLW/EqCo, SiMo with K = B−1 and sampled
  K, SimMoCo, SimCo, MoCo, AdCo single/symmetric/multi-crop), with a tiny conv encoder and the
  method's own head: each rank its half of the batch, gradients averaged as DDP does, plain SGD
  for a few steps. The loss of every step, the gradients of step 0, the parameters after the
  last step and the method's state (queue, bank) equal one process on the concatenated batch
  within float64 rounding, and the state is identical on both ranks. BN as in the engine: global
  statistics for the SyncBN methods (the CPU converter); per-process statistics for MoCo and
  AdCo, whose reference runs each of the W slices of its batch through BN separately, so that
  shuffle BN is part of the comparison. Each case also runs a control, a known way to get it
  wrong (the gather without the summed backward, DCLW's per-process softmax, the local rank
  offset, no shuffle), which must differ from the reference: the comparison can fail.
* SimCLR with a real ResNet-18 (``resnet18_0.25x``: its blocks at a quarter of the width): once
  with BN statistics frozen (torch's SyncBN; loss and gather-with-grad path only) and once with the
  engine's cross-process BN in train mode (also the BN running statistics).
* MoCo with the same ResNet-18: the queue stays identical on both ranks and holds the gathered
  keys in rank order; ``keys(x)`` equals the key encoder run on each rank's slice of the permuted
  global batch (BN statistics of that slice), normalized and unshuffled.
* ``torchrun --nproc_per_node 2 -m pretrain`` with the tiny MoCo v2 and SimCLR recipes (SimCLR
  converts its BN for several processes, which torch's SyncBatchNorm cannot do on CPU).

All 2-process checks run in one spawn (tests/multiprocess_harness.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
import torchvision
from torch import nn

from contrastive_transfer.sync_bn import convert_sync_batchnorm
from pretrain import dist
from pretrain.config import load_config
from pretrain.losses import LOSSES, sample_negatives
from pretrain.methods import METHODS
from pretrain.methods import base as methods_base

from ..method_cases import NARROW, assert_tiny, loss_host, method_recipe, tiny_encoders
from ..multiprocess_harness import WORLD, NaiveGather, Workers, assert_check_passed, ddp_average, rel_err

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "configs/pretrain"
SIMCLR_RECIPE = RECIPES / "tiny_simclr.yaml"
MOCO_RECIPE = RECIPES / "tiny_mocov2.yaml"
N = 4  # per-rank batch
B = WORLD * N  # global batch
SIZE = 8  # image side: with the small stem layer4 is 1×1 (BN statistics still span the N samples)
# Quarter-width ResNet-18 (small stem) and the global batch B in the config (split over processes).
OVERRIDES = [NARROW, "model.stem=small", f"train.batch_size={B}", f"data.image_size={SIZE}"]
MOCO_OVERRIDES = OVERRIDES + [f"method.queue_size={2 * B}"]  # wraps around after 2 steps
MOCO_STEPS = 3
RTOL = 1e-5


def _global_batch(seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views of a global batch of B images, identical on every rank (and in the parent)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, 3, SIZE, SIZE, generator=g, dtype=dtype) for _ in range(2))


def _local(x: torch.Tensor, r: int) -> torch.Tensor:
    return x[r * N : (r + 1) * N]


# ---------------------------------------------------------------- SimCLR: 2 processes = 1 process


def _freeze_bn_stats(method: nn.Module) -> nn.Module:
    """BatchNorm (and SyncBatchNorm) in eval mode: normalize with the running statistics.

    SyncBN cannot run in train mode on CPU (torch raises "SyncBatchNorm expected input tensor to
    be on GPU or XPU or privateuseone", and DDP refuses SyncBN modules on CPU), and without it the
    BN statistics of two local batches of 2N differ from those of one batch of 4N. With the
    statistics frozen in BOTH runs, the comparison isolates the loss and the gather-with-grad path.
    Train-mode BN across processes is checked separately with the engine's CPU converter
    (:func:`_check_simclr_global_bn`).
    """
    method.train()
    for m in method.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return method


def _simclr(num_processes: int) -> nn.Module:
    cfg = load_config(SIMCLR_RECIPE, OVERRIDES, num_processes)
    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    return METHODS["simclr"](cfg, num_processes).double()


def _simclr_grads(method: nn.Module, views) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    method.zero_grad(set_to_none=True)
    loss = method(views)["loss"]
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in method.named_parameters() if p.grad is not None}


def _check_simclr(r, out_dir):
    # torch's SyncBN, as the engine uses on CUDA; frozen statistics (see _freeze_bn_stats).
    method = _freeze_bn_stats(nn.SyncBatchNorm.convert_sync_batchnorm(_simclr(WORLD)))
    x1, x2 = _global_batch(7, torch.float64)
    views = [_local(x1, r), _local(x2, r)]
    loss, grads = _simclr_grads(method, views)
    ddp_average(loss, *grads.values())
    # Negative control: a gather without the summed backward must not match the reference.
    original = dist.gather_with_grad
    dist.gather_with_grad = NaiveGather.apply
    try:
        naive_loss, naive_grads = _simclr_grads(method, views)
    finally:
        dist.gather_with_grad = original
    ddp_average(naive_loss, *naive_grads.values())
    if r == 0:
        torch.save({"loss": loss, "grads": grads, "naive_grads": naive_grads}, os.path.join(out_dir, "simclr.pt"))


def _bn_buffers(method: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in method.state_dict().items() if "running_" in k}


def _check_simclr_global_bn(r, out_dir):
    """Train-mode BN converted as the engine does for several CPU processes (global statistics)."""
    from contrastive_transfer.sync_bn import convert_sync_batchnorm

    method = convert_sync_batchnorm(_simclr(WORLD), torch.device("cpu")).train()
    x1, x2 = _global_batch(7, torch.float64)
    loss, grads = _simclr_grads(method, [_local(x1, r), _local(x2, r)])
    ddp_average(loss, *grads.values())
    buffers = _bn_buffers(method)
    buffers_equal = all(dist.all_ranks_equal(v) for v in buffers.values())
    # Negative control: per-process BN (no conversion) sees 2N samples, not 4N: gradients differ.
    local_bn_loss, local_bn_grads = _simclr_grads(_simclr(WORLD).train(), [_local(x1, r), _local(x2, r)])
    ddp_average(local_bn_loss, *local_bn_grads.values())
    if r == 0:
        torch.save(
            {
                "loss": loss,
                "grads": grads,
                "buffers": buffers,
                "buffers_equal": buffers_equal,
                "local_bn_grads": local_bn_grads,
                "bn_types": sorted({type(m).__name__ for m in method.modules() if "Norm" in type(m).__name__}),
            },
            os.path.join(out_dir, "simclr_global_bn.pt"),
        )


# ---------------------------------------------------------------- MoCo: queue and shuffle BN


def _moco() -> nn.Module:
    cfg = load_config(MOCO_RECIPE, MOCO_OVERRIDES, WORLD)
    torch.manual_seed(0)  # identical weights and initial queue on every rank (the engine's set_seed)
    return METHODS["moco"](cfg, WORLD).train()


def _rank0_perm(rng_state: torch.Tensor) -> torch.Tensor:
    """The permutation shuffle_batch draws: torch.randperm(B) from rank 0's global RNG in the given
    state, broadcast to all ranks (by the test itself, not by pretrain.dist)."""
    perm = torch.empty(B, dtype=torch.long)
    if torch_dist.get_rank() == 0:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng_state)
            perm = torch.randperm(B)
    torch_dist.broadcast(perm, src=0)
    return perm


@torch.no_grad()
def _reference_keys(encoder_k: nn.Module, x_all: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Keys of the global batch (rows in global order) with per-process BN after shuffling.

    In this one process: permute the global batch, run a copy of the key encoder (train-mode BN)
    separately on each rank's slice of it, normalize, and put the rows back in the original order.
    """
    enc = copy.deepcopy(encoder_k).train()
    shuffled = x_all[perm]
    k_shuffled = torch.cat([F.normalize(enc(chunk).float(), dim=1) for chunk in shuffled.chunk(WORLD)])
    keys = torch.empty_like(k_shuffled)
    keys[perm] = k_shuffled  # row perm[j] of the batch was processed at position j
    return keys


def _check_moco_queue(r, out_dir):
    method = _moco()
    optimizer = torch.optim.SGD(method.parameters(), lr=0.5)  # weights move: keys change every step
    queue_size = method.queue.shape[1]
    torch.manual_seed(1000 + r)  # different RNG streams: only rank 0's permutation may be used
    records = []
    for step in range(MOCO_STEPS):
        x1, x2 = _global_batch(100 + step)
        ptr_before, queue_before = int(method.queue_ptr), method.queue.clone()
        rng_before = torch.get_rng_state()
        loss = method([_local(x1, r), _local(x2, r)])["loss"]
        # The key encoder was updated at the start of forward, before the keys: use it as is.
        expected_keys = _reference_keys(method.encoder_k, x2, _rank0_perm(rng_before))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ddp_average(*(p.grad for p in method.parameters() if p.grad is not None))
        optimizer.step()
        records.append(
            {
                "ptr_before": ptr_before,
                "ptr_after": int(method.queue_ptr),
                "queue_before": queue_before,
                "queue_after": method.queue.clone(),
                "expected_keys": expected_keys,
                "queue_equal": dist.all_ranks_equal(method.queue),
                "ptr_equal": dist.all_ranks_equal(method.queue_ptr),
                "queues_gathered": dist.gather_no_grad(method.queue.unsqueeze(0)),
            }
        )

    for step, rec in enumerate(records):
        where = f"step {step}"
        assert rec["queue_equal"] and rec["ptr_equal"], f"{where}: queue or queue_ptr differ between ranks"
        q0, q1 = rec["queues_gathered"]
        assert torch.equal(q0, q1) and torch.equal(q0, rec["queue_after"]), f"{where}: gathered queues differ"
        ptr = rec["ptr_before"]
        assert ptr == (step * B) % queue_size, f"{where}: queue_ptr {ptr}"
        assert rec["ptr_after"] == (ptr + B) % queue_size, f"{where}: queue_ptr after {rec['ptr_after']}"
        written = rec["queue_after"][:, ptr : ptr + B].T  # (B, d): rows in rank order
        torch.testing.assert_close(
            written,
            rec["expected_keys"],
            rtol=RTOL,
            atol=RTOL,
            msg=lambda m, where=where: f"{where}: enqueued keys differ from the reference: {m}",
        )
        untouched = torch.ones(queue_size, dtype=torch.bool)
        untouched[ptr : ptr + B] = False
        assert torch.equal(rec["queue_after"][:, untouched], rec["queue_before"][:, untouched]), (
            f"{where}: columns outside [{ptr}, {ptr + B}) changed"
        )


def _check_shuffle_bn(r, out_dir):
    method = _moco()
    x_all, _ = _global_batch(200)
    torch.manual_seed(2000 + r)
    rng_before = torch.get_rng_state()
    got = method.keys(_local(x_all, r))
    got_all = dist.gather_no_grad(got)
    perm = _rank0_perm(rng_before)
    expected = _reference_keys(method.encoder_k, x_all, perm)
    # Without the shuffle each rank's BN would see its own slice: the keys must differ from that.
    no_shuffle = _reference_keys(method.encoder_k, x_all, torch.arange(B))

    assert not torch.equal(perm, torch.arange(B)), "identity permutation (seeded: should not happen)"
    assert not torch.equal(perm[:N].sort().values, torch.arange(N)), "rank 0's slice kept its own samples"
    torch.testing.assert_close(got, _local(expected, r), rtol=RTOL, atol=RTOL)
    torch.testing.assert_close(got_all, expected, rtol=RTOL, atol=RTOL)
    assert (got_all - no_shuffle).abs().max() > 1e-3, "shuffle BN made no difference: the check is vacuous"


# ---------------------------------------------------------------- every communicating method
# A tiny conv encoder under each method's own head keeps these cheap; what is compared is the
# method's communication (gathers, rank offsets, shuffle BN, queue and bank updates), not the
# backbone. Images are SIZE_TINY px, everything fp32 as in training.

SIZE_TINY = 6
STEPS = 3
LR = 0.1  # plain SGD: the parameters move enough for a wrong gradient to show
# The cases run in float64, so that a difference tells a real one from rounding. Two processes sum
# in another order than one (global BN from sums, per-rank losses); STEPS steps amplify that
# rounding by up to ~700 ε here (AdCo's bank ascent, lr 3 and τ 0.02, and SimCo). In fp32 that is
# 9e-5 of the bank's scale on an AMD EPYC and 1.5e-3 to 2.3e-3 (~2e4 ε) on an Intel Xeon: noise that
# passes for a bug. In float64 every case agrees to ≤ 1.5e-13 on the AMD EPYC (ε = 2.2e-16); 1e-10
# (4.5e5 ε) leaves room for 20× the Xeon's amplification, while the controls are off by ≥ 1e-3.
CASE_DTYPE = torch.float64
CASE_RTOL = 1e-10


class _PerProcessBatchNorm(nn.modules.batchnorm._BatchNorm):
    """What the W processes' own BN layers compute, in one process: train-mode BN statistics of
    each of the W contiguous slices of the batch (slice r = rank r's samples)."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [F.batch_norm(chunk, None, None, self.weight, self.bias, True, 0.0, self.eps) for chunk in x.chunk(WORLD)]
        )


def _per_process_bn(method: nn.Module) -> None:
    for m in method.modules():
        if type(m) in (nn.BatchNorm1d, nn.BatchNorm2d):
            m.__class__ = _PerProcessBatchNorm  # in place: parameter names and values unchanged


def _gather_positives_naively(x: torch.Tensor) -> torch.Tensor:
    """Embeddings (2-d) through the right gather, DCLW's positives (1-d) through the naive one."""
    return NaiveGather.apply(x) if x.dim() == 1 else _REAL_GATHER_WITH_GRAD(x)


_REAL_GATHER_WITH_GRAD = dist.gather_with_grad

# A control: (extra config overrides, patch active around forward and after_step).
CONTROLS: dict[str, tuple[tuple[str, ...], Callable[[], contextlib.AbstractContextManager]]] = {
    # lightly before PR #1531: the backward keeps only the local slice of the local gradient.
    "naive_gather": ((), lambda: mock.patch.object(dist, "gather_with_grad", NaiveGather.apply)),
    # the same for DCLW's gathered positives only (their weights' gradient across ranks is lost)
    "naive_weight_gather": ((), lambda: mock.patch.object(dist, "gather_with_grad", _gather_positives_naively)),
    # lightly's DCLW: the weights' softmax over each process's anchors
    "per_process_weights": (("method.loss.per_process=true",), contextlib.nullcontext),
    # the official AdCo on several nodes: the positive's column from the local index only
    "local_offset": ((), lambda: mock.patch.object(dist, "rank_offset", lambda n_local: 0)),
    # each rank draws choices for its own rows only: with a shared seed both ranks draw the same ones
    "draw_per_process": (
        (),
        lambda: mock.patch.object(
            methods_base,
            "sample_negatives",
            lambda neg, k, mode, row_offset=0, total_rows=None: sample_negatives(neg, k, mode),
        ),
    ),
    # shuffle BN that never leaves the process: each key encoder normalizes its own samples
    "no_shuffle": (
        (),
        lambda: mock.patch.object(dist, "shuffle_batch", lambda x: (x, torch.arange(WORLD * x.shape[0]))),
    ),
}


@dataclass(frozen=True)
class Case:
    recipe: str
    overrides: tuple[str, ...] = ()
    controls: tuple[str, ...] = ()
    view_sizes: tuple[int, ...] = (SIZE_TINY, SIZE_TINY)  # key crop first for AdCo's multi-crop


ADCO = ("method.bank_init=fill", f"method.bank_size={B}", "method.bn_splits=1")  # step 1 fills, then adversarial
CASES = {
    "simclr_dcl": Case("tiny_dcl", controls=("naive_gather",)),
    "simclr_dclw": Case("tiny_dclw", controls=("per_process_weights",)),
    "simclr_dclw_undetached": Case(
        "tiny_dclw", ("method.loss.detach=false",), controls=("per_process_weights", "naive_weight_gather")
    ),
    "simclr_eqco": Case("tiny_simclr_eqco", ("method.loss.eqco_alpha=64",), controls=("naive_gather",)),
    "simo_eqco": Case("tiny_simo", controls=("local_offset",)),  # K = B − 1
    # per-query sampling: every rank draws the global batch's choices and keeps its own rows
    "simo_sampled": Case(
        "tiny_simo",
        ("method.num_negatives=3", "method.negative_sampling=per_query"),
        controls=("local_offset", "draw_per_process"),
    ),
    "simmoco": Case("tiny_simmoco", controls=("local_offset",)),
    "simco": Case("tiny_simco", controls=("naive_gather",)),
    "moco": Case("tiny_mocov2", (f"method.queue_size={2 * B}", "method.bn_splits=1"), controls=("no_shuffle",)),
    "adco": Case("tiny_adco", ADCO, controls=("local_offset",)),
    "adco_symmetric": Case("tiny_adco_sym", ADCO, controls=("local_offset",)),
    "adco_multicrop": Case(
        "tiny_adco_multicrop",
        (
            *ADCO,
            "method.query_crops=[224,160]",
            "method.query_crop_min_scales=[0.2,0.2]",
            "method.query_crop_max_scales=[1,1]",
        ),
        controls=("local_offset",),
        view_sizes=(SIZE_TINY, SIZE_TINY, 4),
    ),
}


def _case_config(case: Case, num_processes: int, extra: tuple[str, ...] = ()):
    recipe = RECIPES / f"{case.recipe}.yaml"
    dim = ["method.dim=8"] if "dim" in METHODS[load_config(recipe).method.name].defaults else []
    overrides = [f"train.batch_size={B}", f"data.image_size={SIZE_TINY}", *dim, *case.overrides, *extra]
    return load_config(recipe, overrides, num_processes)


def _registered_cases() -> dict[str, Case]:
    """A plain case (no control) for every registered method and loss that CASES leaves out."""
    methods, losses = set(), set()
    for case in CASES.values():
        m = _case_config(case, WORLD).method
        methods.add(m.name)
        losses |= {m.loss.name} if "loss" in m else set()
    cases = {f"method_{name}": Case(method_recipe(name).stem) for name in sorted(set(METHODS) - methods)}
    host = loss_host().stem
    cases.update({f"loss_{name}": Case(host, (f"method.loss.name={name}",)) for name in LOSSES if name not in losses})
    return cases


CASES.update(_registered_cases())


def _build(case: Case, num_processes: int, extra: tuple[str, ...] = ()) -> nn.Module:
    cfg = _case_config(case, num_processes, extra)
    torch.manual_seed(0)  # the engine's set_seed: the same weights, queue and bank on every rank
    with tiny_encoders():
        method = METHODS[cfg.method.name](cfg, num_processes).train()
    assert_tiny(method)
    if method.sync_bn and num_processes > 1:
        convert_sync_batchnorm(method, torch.device("cpu"))  # as the engine: global BN statistics
    if not method.sync_bn and num_processes == 1:
        _per_process_bn(method)
    return method.to(CASE_DTYPE)


def _case_views(case: Case, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return [torch.randn(B, 3, s, s, generator=g, dtype=CASE_DTYPE) for s in case.view_sizes]


def _labels(rank: int | None) -> torch.Tensor:
    """Class indices of the global batch (a method with ``needs_labels``), this rank's slice."""
    labels = torch.arange(B) % 3
    return labels if rank is None else labels[rank * N : (rank + 1) * N]


def _run(case: Case, rank: int | None, control: str | None = None) -> dict:
    """STEPS training steps, on the whole batch in one process (rank None) or on this rank's slice.

    Returns the loss of every step, the gradients of step 0, the parameters and their
    displacement after the last step, and the method's buffers other than BN statistics
    (queue, bank, counters), all averaged over ranks as DDP would."""
    extra, patch = CONTROLS[control] if control else ((), contextlib.nullcontext)
    method = _build(case, 1 if rank is None else WORLD, extra)
    optimizer = torch.optim.SGD(method.parameters(), lr=LR)
    initial = {k: p.detach().clone() for k, p in method.named_parameters()}
    losses, grads = [], None
    for step in range(STEPS):
        views = _case_views(case, step)
        if rank is not None:
            views = [v[rank * N : (rank + 1) * N] for v in views]
        torch.manual_seed(100 + step)  # every rank as the reference: shuffle BN keeps rank 0's draw
        with patch():
            loss = (method(views, _labels(rank)) if method.needs_labels else method(views))["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach().clone()
        step_grads = {k: p.grad for k, p in method.named_parameters() if p.grad is not None}
        if rank is not None:
            ddp_average(loss, *step_grads.values())
        optimizer.step()
        with patch():
            method.after_step()
        losses.append(loss)
        if step == 0:
            grads = {k: g.clone() for k, g in step_grads.items()}
    state = {k: v.clone() for k, v in method.named_buffers() if "running_" not in k and "num_batches" not in k}
    return {
        "losses": torch.stack(losses),
        "grads": grads,
        "state": state,
        "params": {k: p.detach().clone() for k, p in method.named_parameters()},
        "moved": {k: p.detach() - initial[k] for k, p in method.named_parameters() if p.requires_grad},
    }


def _check_case(name: str, r: int, out_dir: str) -> None:
    case = CASES[name]
    run = _run(case, r)
    state_equal = {k: dist.all_ranks_equal(v) for k, v in run["state"].items()}
    controls = {c: _run(case, r, control=c) for c in case.controls}
    if r == 0:
        torch.save({"run": run, "state_equal": state_equal, "controls": controls}, os.path.join(out_dir, f"{name}.pt"))


def _differences(got: dict, ref: dict) -> dict[str, float]:
    """Error of each compared tensor (losses, step-0 gradients, parameters, their displacement,
    state buffers) relative to the largest reference entry of its group: a gradient that vanishes
    analytically (a bias followed by BN) is pure rounding noise, which its own scale would blow up."""
    errors = {"losses": rel_err(got["losses"], ref["losses"])}
    for part in ("grads", "params", "moved", "state"):
        assert got[part].keys() == ref[part].keys(), (part, sorted(got[part].keys() ^ ref[part].keys()))
        scale = max([v.double().abs().max().item() for v in ref[part].values() if v.numel()] or [0.0])
        errors.update(
            {
                f"{part}:{k}": (got[part][k].double() - v.double()).abs().max().item() / max(scale, 1e-30)
                for k, v in ref[part].items()
                if v.numel()
            }
        )
    return errors


CHECKS = {
    "simclr": _check_simclr,
    "simclr_global_bn": _check_simclr_global_bn,
    "moco_queue": _check_moco_queue,
    "shuffle_bn": _check_shuffle_bn,
    **{name: functools.partial(_check_case, name) for name in CASES},
}


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Start the 2 gloo workers and the 2-process engine runs together, as far as the selected
    tests need them: each is mostly process start-up on one core, so overlapping them roughly
    halves the wall time on 2 cores. Yields (workers, engine runs)."""
    mine = [item for item in request.session.items if item.module is request.module]
    workers = engine = None
    try:
        if any("two_process_results" in item.fixturenames for item in mine):
            workers = Workers(CHECKS, tmp_path_factory.mktemp("multiprocess"))
        if any("engine_runs" in item.fixturenames for item in mine):
            engine = _start_engine_runs(request.getfixturevalue("synthetic_root"), tmp_path_factory)
        yield workers, engine
    finally:
        for proc, log, _ in (engine or {}).values():
            if proc.poll() is None:  # only if a test did not wait for it (e.g. an error above)
                _kill_run(proc)
            log.close()
        if workers is not None:
            workers.terminate()


@pytest.fixture(scope="module")
def two_process_results(launched):
    """Per-check tracebacks of each rank (None = passed) and the workers' output folder."""
    workers = launched[0]
    return workers.results(), workers.out_dir


def _assert_check_passed(two_process_results, check):
    assert_check_passed(two_process_results[0], check)


def _assert_matches_reference(got, ref_loss, ref_grads, method):
    assert abs(got["loss"].item() - ref_loss.item()) <= RTOL * abs(ref_loss.item()), (got["loss"], ref_loss)
    assert got["grads"].keys() == ref_grads.keys()
    assert len(ref_grads) == sum(p.requires_grad for p in method.parameters())
    errors = {k: rel_err(got["grads"][k], ref) for k, ref in ref_grads.items()}
    bad = {k: e for k, e in errors.items() if not e <= RTOL}
    assert not bad, f"{len(bad)} of {len(errors)} gradients differ from the 1-process run: {bad}"


def test_simclr_two_processes_equal_one_process(two_process_results):
    """Loss and gather-with-grad path, BN statistics frozen in both runs."""
    _assert_check_passed(two_process_results, "simclr")
    got = torch.load(two_process_results[1] / "simclr.pt", weights_only=True)

    # Reference: one process (torch.distributed not initialized here), the concatenated batch.
    assert not torch_dist.is_initialized()
    method = _freeze_bn_stats(_simclr(1))
    x1, x2 = _global_batch(7, torch.float64)
    ref_loss, ref_grads = _simclr_grads(method, [x1, x2])

    _assert_matches_reference(got, ref_loss, ref_grads, method)
    # The comparison can fail: without the summed backward the gradients are wrong.
    naive = max(rel_err(got["naive_grads"][k], ref) for k, ref in ref_grads.items())
    assert naive > 1e-3, naive


def test_simclr_global_bn_two_processes_equal_one_process(two_process_results):
    """Train-mode BN converted as the engine does on CPU: global statistics over both ranks, so
    loss, gradients and running statistics equal one process with plain BN on the whole batch."""
    _assert_check_passed(two_process_results, "simclr_global_bn")
    got = torch.load(two_process_results[1] / "simclr_global_bn.pt", weights_only=True)

    method = _simclr(1).train()
    x1, x2 = _global_batch(7, torch.float64)
    ref_loss, ref_grads = _simclr_grads(method, [x1, x2])

    assert got["bn_types"] and "BatchNorm2d" not in got["bn_types"], got["bn_types"]
    _assert_matches_reference(got, ref_loss, ref_grads, method)
    ref_buffers = _bn_buffers(method)
    assert got["buffers_equal"], "BN running statistics differ between the ranks"
    assert got["buffers"].keys() == ref_buffers.keys()
    bad = {k: e for k, v in ref_buffers.items() if not (e := rel_err(got["buffers"][k], v)) <= RTOL}
    assert not bad, f"BN running statistics differ from the 1-process run: {bad}"
    # The comparison can fail: per-process BN statistics give other gradients.
    local_bn = max(rel_err(got["local_bn_grads"][k], ref) for k, ref in ref_grads.items())
    assert local_bn > 1e-3, local_bn


def test_moco_queue_identical_and_holds_gathered_keys(two_process_results):
    _assert_check_passed(two_process_results, "moco_queue")


def test_moco_shuffle_bn_keys_equal_per_slice_reference(two_process_results):
    _assert_check_passed(two_process_results, "shuffle_bn")


@pytest.mark.parametrize("name", list(CASES))
def test_method_two_processes_equal_one_process(two_process_results, name):
    """Loss, gradients, parameters after STEPS steps and state equal one process on the whole
    batch; the state is identical on both ranks; every control differs from the reference."""
    _assert_check_passed(two_process_results, name)
    got = torch.load(two_process_results[1] / f"{name}.pt", weights_only=True)
    assert not torch_dist.is_initialized()
    reference = _run(CASES[name], rank=None)

    assert all(got["state_equal"].values()), f"state differs between the ranks: {got['state_equal']}"
    bad = {k: e for k, e in _differences(got["run"], reference).items() if not e <= CASE_RTOL}
    assert not bad, (
        f"{len(bad)} quantities differ from the 1-process run in float64, beyond rounding "
        f"({CASE_RTOL:g} of their scale): a real difference, not float noise: {bad}"
    )
    for control, result in got["controls"].items():
        worst = max(_differences(result, reference).values())
        assert worst > 1e-3, f"control {control!r} matches the reference ({worst:.2g}): the comparison cannot fail"


# ---------------------------------------------------------------- engine end to end (torchrun)

ENGINE_RECIPES = ("tiny_mocov2", "tiny_simclr")


def _start_engine_runs(synthetic_root: Path, tmp_path_factory) -> dict:
    """Both 2-process runs at once; recipe -> (Popen, log file, output_dir)."""
    data = synthetic_root / "imagenet" / "train"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for recipe in ENGINE_RECIPES:
        out = tmp_path_factory.mktemp(recipe)
        log = open(out.parent / f"{recipe}.log", "w+")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(WORLD),
            "-m",
            "pretrain",
            "--config",
            f"configs/pretrain/{recipe}.yaml",
            f"data.root={data}",
            f"train.output_dir={out}",
            "train.max_steps=2",
            "train.resume=none",
        ]
        # A session of its own: torchrun and its workers can be killed together (by process group).
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs[recipe] = (proc, log, out)
    return procs


def _kill_run(proc: subprocess.Popen) -> None:
    """Kill one torchrun that this module started, with its workers (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module")
def engine_runs(launched):
    """recipe -> (exit code, log, output_dir) of `torchrun --nproc_per_node 2 -m pretrain`."""
    runs = {}
    for recipe, (proc, log, out) in launched[1].items():
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            _kill_run(proc)
            rc = "killed after 300 s"
        log.seek(0)
        runs[recipe] = (rc, log.read(), out)
    return runs


def _torchvision_resnet18() -> nn.Module:
    net = torchvision.models.resnet18(weights=None)
    net.fc = nn.Identity()
    return net


def _check_engine_run(rc, log, out, method_name, has_momentum):
    assert rc == 0, f"torchrun exited with {rc}:\n{log[-4000:]}"
    final = out / "checkpoint_final.pth"
    assert final.is_file(), f"no {final}:\n{log[-2000:]}"
    ckpt = torch.load(final, map_location="cpu", weights_only=False)
    assert (ckpt["arch"], ckpt["stem"], ckpt["method"], ckpt["step"]) == ("resnet18", "imagenet", method_name, 2)
    for key in ["backbone"] + (["momentum_backbone"] if has_momentum else []):
        net = _torchvision_resnet18()  # the tiny recipes keep torchvision's stem
        net.load_state_dict(ckpt[key], strict=True)  # torchvision names, nothing missing or extra
        with torch.no_grad():
            y = net.eval()(torch.randn(2, 3, 64, 64))
        assert y.shape == (2, 512) and torch.isfinite(y).all()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    assert all(math.isfinite(x) for x in losses), losses


def test_engine_two_processes_mocov2(engine_runs):
    _check_engine_run(*engine_runs["tiny_mocov2"], method_name="moco", has_momentum=True)


def test_engine_two_processes_simclr(engine_runs):
    # With torch's SyncBatchNorm this fails on CPU at DDP wrapping ("SyncBatchNorm layers only work
    # with GPU modules") or at the first forward ("SyncBatchNorm expected input tensor to be on GPU").
    _check_engine_run(*engine_runs["tiny_simclr"], method_name="simclr", has_momentum=False)
