"""What docs/methods.md and docs/pretraining.md say about the logged diagnostics and the
checkpoints, held against the code: the MI bound's formula, which pair a symmetric run's
diagnostics describe, and when checkpoint_last.pth is written."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from pretrain.config import load_config
from pretrain.losses import mi_lower_bound
from pretrain.methods import METHODS

from ..method_cases import TINY_IMAGE, tiny_encoders

REPO = Path(__file__).resolve().parents[2]


def test_the_mi_bound_the_docs_state_is_the_one_logged():
    """EqCo paper Eq. 4 and 6: log(1 + K·e^{m/τ}) − L, i.e. log(1 + K) − L, and log(1 + α) − L
    with the margin m = τ·log(α/K)."""
    text = " ".join((REPO / "docs" / "methods.md").read_text().split())
    assert "`log(1 + K) − L_InfoNCE`" in text and "`log(1 + α) − L_InfoNCE`" in text
    assert "log(α or K)" not in text
    loss, k, alpha, tau = 2.5, 64, 4096.0, 0.2
    assert math.isclose(mi_lower_bound(loss, k), math.log(1 + k) - loss, rel_tol=1e-12)
    margin = tau * math.log(alpha / k)  # the paper's form, by hand
    assert math.isclose(mi_lower_bound(loss, alpha), math.log(1 + k * math.exp(margin / tau)) - loss, rel_tol=1e-9)


def test_simco_logs_the_diagnostics_of_the_first_pair_as_documented():
    text = " ".join((REPO / "docs" / "methods.md").read_text().split())
    assert "logs these diagnostics, and the cosines and ‖∂L/∂q‖, of the first pair only" in text
    cfg = load_config(REPO / "configs" / "pretrain" / "tiny_simco.yaml", ["train.batch_size=8"])
    torch.manual_seed(0)
    with tiny_encoders():
        method = METHODS["simco"](cfg, 1)
    views = [torch.randn(8, 3, TINY_IMAGE, TINY_IMAGE) for _ in range(2)]
    logs = method(views)
    z1, z2 = (torch.nn.functional.normalize(method.encoder(x), dim=1) for x in views)
    first, second = method.contrast_in_batch(z1, z2)[1], method.contrast_in_batch(z2, z1)[1]
    for key in ("mi_bound", "npc_mean", "pos_cos", "neg_cos"):
        assert torch.allclose(logs[key], first[key]), key
    assert not torch.allclose(logs["mi_bound"], second["mi_bound"])  # the other pair differs: one is reported


def test_checkpoint_last_is_written_at_every_epoch_end_as_documented(monkeypatch):
    text = " ".join((REPO / "docs" / "pretraining.md").read_text().split())
    said = re.search(r"`OUTPUT/checkpoint_last\.pth` \(([^)]*)\)", text)
    assert said and "every `train.checkpoint_every` steps, at the end of every epoch" in said.group(1)
    from types import SimpleNamespace

    from pretrain import engine

    saved = []
    monkeypatch.setattr(engine, "save_checkpoint", lambda run, step: saved.append(step))
    cfg = SimpleNamespace(knn=SimpleNamespace(train_dir=None))
    run = SimpleNamespace(cfg=cfg, steps_per_epoch=4, last_step=12, laps=SimpleNamespace(lap=lambda name: None))
    for step in range(1, 13):  # train.checkpoint_every plays no part here
        engine.end_of_epoch(run, step, None)
    assert saved == [4, 8]  # the last step's checkpoint is the end of the run's own
