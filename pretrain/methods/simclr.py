"""SimCLR, optionally with EqCo's margin.

Paper: Ting Chen, Simon Kornblith, Mohammad Norouzi, Geoffrey Hinton, "A Simple Framework for
Contrastive Learning of Visual Representations", ICML 2020, arXiv:2002.05709.

Per step, for N local images with views x1, x2 on each of W processes (B = N·W):

    z1, z2 = split(normalize(g(f(cat[x1, x2]))))       one encoder for both views; BN over 2N
    Z1, Z2 = gather_with_grad(z1), gather_with_grad(z2) gradients summed back across processes
    anchor z1_i: positive Z2[r·N+i], negatives the other 2B−2 rows of Z1 and Z2 (and for z2_i)
    L = mean over the 2N anchors of InfoNCE(τ)          EqCo: margin τ·log(α/K), K = 2B−2

Loss reduction: "mean" over all 2N anchors (lightly/solo-learn convention, the default);
"sum_views" is TF SimCLR's loss_a + loss_b, twice as large (it interacts with the lr).
Head: Linear→BN→ReLU→Linear→BN without shift (``mlp_bn``); SyncBN with several processes.
"""

from __future__ import annotations

import torch

from contrastive_transfer.errors import ConfigError
from pretrain import dist
from pretrain.losses import nt_xent_similarities
from pretrain.methods.base import INFONCE_DEFAULTS, InfoNCEHost
from pretrain.models import build_encoder, embed

REDUCTIONS = ("mean", "sum_views")


class SimCLR(InfoNCEHost):
    defaults = {
        **INFONCE_DEFAULTS,
        "temperature": 0.1,
        "dim": 128,
        "head": "mlp_bn",
        "hidden_dim": None,
        "loss_reduction": "mean",
    }
    sync_bn = True

    @classmethod
    def available_negatives(cls, cfg, num_processes: int) -> int:
        return 2 * cfg.train.batch_size - 2

    @classmethod
    def check(cls, cfg, num_processes: int) -> None:
        super().check(cfg, num_processes)
        if cfg.method.loss_reduction not in REDUCTIONS:
            raise ConfigError(
                f"method.loss_reduction={cfg.method.loss_reduction!r}: expected one of {list(REDUCTIONS)}"
            )

    def __init__(self, cfg, num_processes: int) -> None:
        super().__init__(cfg, num_processes)
        m = cfg.method
        self.reduction_scale = 2.0 if m.loss_reduction == "sum_views" else 1.0
        self.encoder = build_encoder(cfg.model.arch, cfg.model.stem, m.head, m.dim, m.hidden_dim)

    @property
    def backbone(self):
        return self.encoder.backbone

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        x1, x2 = views[0], views[1]
        z = embed(self.encoder, torch.cat([x1, x2]))
        self.watch(z)
        z1, z2 = z.chunk(2)
        pos, neg = nt_xent_similarities(
            z1, z2, dist.gather_with_grad(z1), dist.gather_with_grad(z2), dist.rank_offset(z1.shape[0])
        )
        loss, logs = self.contrast(pos, neg)
        return {"loss": loss * self.reduction_scale, **logs}
