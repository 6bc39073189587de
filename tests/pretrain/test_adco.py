"""AdCo: the hand-written adversary update against autograd (projection term included) and torch's
SGD, for the single, symmetric and multi-crop variants; the filling initialization; exact resume
of the bank. On 2 processes (identical banks that equal a 1-process run on the whole batch, for the
three variants): tests/pretrain/test_multiprocess.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from contrastive_transfer.errors import ConfigError
from pretrain.config import load_config
from pretrain.losses import adversary_gradient
from pretrain.methods import METHODS

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "pretrain"
SIZE = 8  # image side (small stem: layer4 is 1×1)


def _method(recipe: str, *overrides: str, batch: int = 4, num_processes: int = 1):
    cfg = load_config(
        RECIPES / f"{recipe}.yaml",
        [f"data.image_size={SIZE}", f"train.batch_size={batch}", "method.bn_splits=1", "method.dim=16", *overrides],
        num_processes,
    )
    torch.manual_seed(0)  # the engine's set_seed: identical weights and bank on every rank
    return cfg, METHODS["adco"](cfg, num_processes).double()


def _views(n_views: int, batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, SIZE, SIZE, generator=g, dtype=torch.float64) for _ in range(n_views)]


def _ce(q, k_all, bank, tau, offset=0):
    """The network's loss written out: CE([q·k_allᵀ | q·normalize(W)]/τ, offset + i), mean over q."""
    logits = torch.cat([q @ k_all.T, q @ F.normalize(bank, dim=0)], dim=1) / tau
    return F.cross_entropy(logits, torch.arange(offset, offset + len(q)))


# ----------------------------------------------------------------------------- the gradient formula
def test_manual_gradient_equals_autograd_wrt_the_raw_bank():
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(5, 8, generator=g, dtype=torch.float64), dim=1)
    k_all = F.normalize(torch.randn(10, 8, generator=g, dtype=torch.float64), dim=1)
    bank = (3 * torch.rand(8, 12, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True)  # ‖W_k‖ ≠ 1
    (ref,) = torch.autograd.grad(_ce(q, k_all, bank, 0.02, offset=5), bank)
    got = adversary_gradient(q, q @ k_all.T, bank.detach(), 0.02)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    # Without the projection through the normalization (AdCo issue #8) it would not match.
    unit = F.normalize(bank.detach(), dim=0)
    p = torch.softmax(torch.cat([q @ k_all.T, q @ unit], 1) / 0.02, 1)[:, 10:]
    no_projection = q.T @ p / 5 / (bank.detach().norm(dim=0) * 0.02)
    assert (no_projection - ref).abs().max() > 1e-3 * ref.abs().max()


@pytest.mark.parametrize(
    "variant,overrides,n_views",
    [
        ("single", [], 2),
        ("symmetric", ["method.symmetric=true"], 2),
        (
            "multicrop",
            [
                "method.query_crops=[224,192,160]",
                "method.query_crop_min_scales=[0.2,0.2,0.2]",
                "method.query_crop_max_scales=[1,1,1]",
            ],
            4,
        ),
    ],
)
def test_adversary_update_equals_sgd_ascent_on_the_network_loss_at_bank_temperature(variant, overrides, n_views):
    """Reference: the method's own loss with τ = τ_m and W a leaf, autograd, then
    torch.optim.SGD(lr 3, momentum 0.9, wd 1e-4, maximize=True); two steps (momentum)."""
    cfg, method = _method("tiny_adco", "method.bank_init=random", "method.bank_size=12", *overrides)
    method.train()
    reference = copy.deepcopy(method)
    reference.temperature = cfg.method.bank_temperature
    bank = reference.bank.weight.requires_grad_(True)
    sgd = torch.optim.SGD([bank], lr=3.0, momentum=0.9, weight_decay=1e-4, maximize=True)
    for step in range(2):
        views = _views(n_views, 4, seed=step)
        if variant == "multicrop":  # query crops are smaller than the key crop
            views = views[:1] + [F.interpolate(v, size=s) for v, s in zip(views[1:], (8, 7, 6))]
        with torch.random.fork_rng(devices=[]):  # same shuffle-BN permutations in both runs
            torch.manual_seed(100 + step)
            method(views)
        method.after_step()  # (no network step: the encoders stay put, the update uses this forward)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(100 + step)
            loss = reference(views)["loss"]
        sgd.zero_grad()
        (bank.grad,) = torch.autograd.grad(loss, bank)
        sgd.step()
        where = f"{variant}, step {step}"
        torch.testing.assert_close(method.bank.weight, bank.detach(), rtol=1e-5, atol=1e-7, msg=where)
        torch.testing.assert_close(
            method.bank.momentum_buffer, sgd.state[bank]["momentum_buffer"], rtol=1e-5, atol=1e-7, msg=where
        )
    moved = (method.bank.weight - _method("tiny_adco", "method.bank_size=12")[1].bank.weight).abs().max()
    assert moved > 1e-2, "the bank did not move: the comparison is vacuous"


def test_bf16_autocast_keeps_logits_and_the_bank_in_fp32():
    _, method = _method("tiny_adco", "method.bank_init=random", "method.bank_size=12")
    method = method.float().train()
    q = F.normalize(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = method([v.float() for v in _views(2, 4, seed=5)])
        logits = method.bank.logits(q)
    assert out["loss"].dtype == logits.dtype == torch.float32
    torch.testing.assert_close(logits, q @ F.normalize(method.bank.weight, dim=0), rtol=1e-6, atol=1e-6)
    method.after_step()
    assert method.bank.weight.dtype == torch.float32 and torch.isfinite(method.bank.weight).all()


# ----------------------------------------------------------------------------- initialization
def test_filling_writes_the_keys_then_restarts_the_key_encoder():
    """K = 6, B = 4: step 1 writes 4 key columns, step 2 the first 2 keys of its batch; then
    f_k = f_q. The filling loss is MoCo's CE([⟨q,k⟩ | q·n̂]/τ, 0) against the partly random bank."""
    cfg, method = _method("tiny_adco", "method.bank_size=6")
    method.eval()  # BN per sample: the keys are f_k(x) whatever the shuffle
    initial = method.bank.weight.clone()
    optimizer = torch.optim.SGD(method.parameters(), lr=0.5)
    for step, written in enumerate([(0, 4), (4, 6)]):
        x1, x2 = _views(2, 4, seed=10 + step)
        bank_before = method.bank.weight.clone()
        out = method([x1, x2])
        with torch.no_grad():
            q = F.normalize(method.encoder_q(x1), dim=1)
            k = F.normalize(method.encoder_k(x2), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ F.normalize(bank_before, dim=0)], 1) / 0.12
        assert out["loss"].item() == pytest.approx(
            F.cross_entropy(logits, torch.zeros(4, dtype=torch.long)).item(), rel=1e-5
        )
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        method.after_step()
        lo, hi = written
        torch.testing.assert_close(method.bank.weight[:, lo:hi], k[: hi - lo].T.float().double(), rtol=1e-6, atol=1e-7)
        assert torch.equal(method.bank.weight[:, hi:], initial[:, hi:])
        assert int(method.filled) == hi
        same = all(torch.equal(a, b) for a, b in zip(method.encoder_q.parameters(), method.encoder_k.parameters()))
        assert same == (step == 1), f"step {step}: f_k should equal f_q exactly when the bank is full"
    assert not method.filling and torch.equal(method.bank.momentum_buffer, torch.zeros_like(initial))


# ----------------------------------------------------------------------------- configs and views
def test_recipes_carry_the_paper_values_and_multicrop_scales_with_the_image():
    single, sym, multi = (load_config(RECIPES / f"{r}.yaml") for r in ("adco", "adco_sym", "adco_multicrop"))
    m = single.method
    assert (
        m.temperature,
        m.bank_temperature,
        m.bank_size,
        m.bank_lr,
        m.bank_momentum,
        m.bank_weight_decay,
        m.momentum,
        m.bank_init,
    ) == (0.12, 0.02, 65536, 3.0, 0.9, 1e-4, 0.999, "fill")
    assert (single.optim.lr, single.optim.weight_decay, single.train.batch_size, single.train.epochs) == (
        0.03,
        1e-4,
        256,
        200,
    )
    assert sym.method.symmetric and not single.method.symmetric
    assert list(multi.method.query_crops) == [224, 192, 160, 128, 96]
    image = torch.zeros(3, 300, 300, dtype=torch.uint8)
    sizes = [t(image).shape[-1] for t in METHODS["adco"].view_transforms(multi)]
    assert sizes == [224, 224, 192, 160, 128, 96]
    tiny = load_config(RECIPES / "tiny_adco_multicrop.yaml", ["data.image_size=64"])
    assert [t(image).shape[-1] for t in METHODS["adco"].view_transforms(tiny)] == [64, 64, 55, 46, 37, 27]
    assert len(METHODS["adco"].view_transforms(single)) == 2


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["method.symmetric=true", "method.query_crops=[224,96]"], "method.symmetric=true with method.query_crops"),
        (["method.bank_init=zeros"], "method.bank_init='zeros': expected one of"),
        (["method.bank_temperature=0"], "method.bank_temperature=0: expected a positive number"),
        (["method.query_crops=[224,192,160,128,96,64]"], "method.query_crops has 6 sizes but"),
    ],
)
def test_bad_adco_configs_fail_with_one_clear_line(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        load_config(RECIPES / "adco.yaml", overrides)


# ----------------------------------------------------------------------------- exact resume
def test_resume_reproduces_the_bank_and_its_momentum_exactly(synthetic_root, tmp_path):
    """K = B: step 1 fills, steps 2-4 are adversarial; 2 steps + resume + 2 steps = 4 steps."""
    from accelerate import Accelerator

    from pretrain.engine import train

    accelerator = Accelerator(cpu=True)
    common = [
        f"data.root={synthetic_root / 'imagenet' / 'train'}",
        "data.image_size=16",
        "train.batch_size=8",
        "method.bank_size=8",
        "method.bn_splits=2",
    ]

    def run(out, steps):
        cfg = load_config(RECIPES / "tiny_adco.yaml", [*common, f"train.output_dir={out}", f"train.max_steps={steps}"])
        train(cfg, accelerator)
        return torch.load(out / "checkpoint_last.pth", weights_only=False)["method_state"]

    straight = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed = run(tmp_path / "b", 4)
    assert {"bank.weight", "bank.momentum_buffer", "filled"} <= straight.keys()
    assert straight["bank.momentum_buffer"].abs().max() > 0 and int(straight["filled"]) == 8
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
