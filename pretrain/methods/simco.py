"""SimMoCo and SimCo: MoCo v2 without its queue, and without its momentum encoder too.

Paper: Chaoning Zhang, Kang Zhang, Trung X. Pham, Axi Niu, Zhinan Qiao, Chang D. Yoo, In So Kweon,
"Dual Temperature Helps Contrastive Learning Without Many Negative Samples: Towards Understanding and
Simplifying MoCo", CVPR 2022, arXiv:2203.17248 (code: ChaoningZhang/Dual-temperature, solo-learn
based).

Both contrast a query with the *current batch* only (no queue) under the dual-temperature
InfoNCE (``losses/dual_temperature.py``: τ_α = ``temperature`` 0.1 within an anchor, τ_β =
``loss.inter_temperature`` 1.0 across anchors). Per step, for N local images with views x1, x2:

SimMoCo = MoCo v2 − queue:
    f_k ← m·f_k + (1−m)·f_q                                      (m = 0.99)
    q = normalize(f_q(x1)),  K_all = gather(normalize(f_k(x2)))  B keys, no gradient
    L = DT(⟨q_i, K_all[r·N+i]⟩, {⟨q_i, K_all[j]⟩}_{j≠r·N+i})       asymmetric; ``symmetric``
                                                                   averages both directions
SimCo = SimMoCo − momentum encoder:
    z1, z2 = normalize(f(x1)), normalize(f(x2))                  one encoder, both with gradient
    L = ½·[DT(z1 vs gather_with_grad(z2)) + DT(z2 vs gather_with_grad(z1))]

Negatives: the B−1 other samples of the other view. The official code runs on one GPU, where its
local batch is the whole batch; gathering over processes (and SyncBN, ``sync_bn``) keeps that
meaning for any number of processes. The head is MoCo v2's MLP without BN. The repo's EMA runs
after the optimizer step; SimMoCo inherits SiMo's update before the keys of the next step, which
is the same sequence of key encoders.
"""

from __future__ import annotations

import torch

from pretrain import dist
from pretrain.methods.base import INFONCE_DEFAULTS, InBatchHost
from pretrain.methods.simo import SiMo
from pretrain.models import build_encoder, embed

DUAL_TEMPERATURE = {"loss": {"name": "dual_temperature", "inter_temperature": 1.0}, "temperature": 0.1}


class SimMoCo(SiMo):
    defaults = {**SiMo.defaults, **DUAL_TEMPERATURE, "head": "mlp", "momentum": 0.99}

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().forward(views)
        if self.symmetric:  # SiMo sums the two directions; the repo's --plus_version averages them
            out["loss"] = 0.5 * out["loss"]
        return out


class SimCo(InBatchHost):
    defaults = {**INFONCE_DEFAULTS, **DUAL_TEMPERATURE, "dim": 128, "head": "mlp", "hidden_dim": None}

    def __init__(self, cfg, num_processes: int) -> None:
        super().__init__(cfg, num_processes)
        m = cfg.method
        self.encoder = build_encoder(cfg.model.arch, cfg.model.stem, m.head, m.dim, m.hidden_dim)

    @property
    def backbone(self):
        return self.encoder.backbone

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        # One forward per view (BN statistics per view), as solo-learn does.
        z1, z2 = (embed(self.encoder, x) for x in views[:2])
        self.watch(z1)
        loss_12, logs = self.contrast_in_batch(z1, dist.gather_with_grad(z2))
        loss_21, _ = self.contrast_in_batch(z2, dist.gather_with_grad(z1))
        return {**logs, "loss": 0.5 * (loss_12 + loss_21)}
