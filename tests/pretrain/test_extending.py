"""docs/extending.md's template method, taken from the page as written: its loss equals a
brute-force cross-entropy, and its recipes train for one step through the engine."""

from __future__ import annotations

import re
import shutil
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from contrastive_transfer.safe_load import torch_load
from pretrain import methods
from pretrain.config import load_config
from pretrain.engine import train

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "extending.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE, re.S)


@pytest.fixture
def template(monkeypatch):
    (source,) = _blocks("python")
    module = types.ModuleType("two_view")
    exec(compile(source, "docs/extending.md", "exec"), module.__dict__)
    monkeypatch.setitem(methods.METHODS, "two_view", module.TwoViewInfoNCE)
    return module.TwoViewInfoNCE


@pytest.fixture
def recipes(tmp_path):
    shutil.copy(REPO / "configs" / "pretrain" / "_tiny.yaml", tmp_path)
    for block in _blocks("yaml"):
        name = re.match(r"# (\S+\.yaml)", block).group(1)
        (tmp_path / name).write_text(block)
    return tmp_path


def test_the_page_holds_one_method_and_both_recipes(recipes):
    assert len(_blocks("python")) == 1
    assert {p.name for p in recipes.glob("*two_view.yaml")} == {"two_view.yaml", "tiny_two_view.yaml"}
    assert len(_blocks("python")[0].splitlines()) <= 60  # a template one reads at once


def test_template_loss_is_cross_entropy_over_the_batch(template, recipes):
    cfg = load_config(recipes / "tiny_two_view.yaml", ["train.batch_size=6"])
    torch.manual_seed(0)
    method = template(cfg, 1).double().eval()
    x1, x2 = torch.randn(2, 6, 3, 32, 32, dtype=torch.float64)
    out = method([x1, x2])
    # By hand: row i's positive is the second view of image i, its negatives the other 5 images'.
    with torch.no_grad():
        q = F.normalize(method.encoder(x1), dim=1)
        k = F.normalize(method.encoder(x2), dim=1)
        expected = F.cross_entropy(q @ k.T / cfg.method.temperature, torch.arange(6))
    torch.testing.assert_close(out["loss"].detach(), expected, rtol=1e-10, atol=1e-12)
    shuffled = F.cross_entropy(q @ k.T / cfg.method.temperature, torch.arange(6).roll(1))
    assert not torch.isclose(expected, shuffled)  # control: a wrong pairing gives another loss


def test_template_trains_one_step_through_the_engine(template, recipes, synthetic_root, tmp_path):
    out = tmp_path / "run"
    overrides = [f"data.root={synthetic_root / 'imagenet' / 'train'}", f"train.output_dir={out}", "train.max_steps=1"]
    cfg = load_config(recipes / "tiny_two_view.yaml", overrides)
    torch.manual_seed(0)
    init = template(cfg, 1).backbone.state_dict()
    final = torch_load(train(cfg, Accelerator(cpu=True)))
    assert final["method"] == "two_view" and final["step"] == 1
    moved = [k for k, v in final["backbone"].items() if v.is_floating_point() and not torch.equal(v, init[k])]
    assert moved, "one optimizer step left every backbone tensor unchanged"
