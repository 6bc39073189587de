"""SiMo, the EqCo paper's simplified MoCo v2 (§3 and appendix B).

Paper: Benjin Zhu, Junqiang Huang, Zeming Li, Xiangyu Zhang, Jian Sun, "EqCo: Equivalent Rules for
Self-supervised Contrastive Learning", 2020, arXiv:2010.01929.

MoCo v2 without a queue: the negatives of a query are the *current batch's* keys from the
momentum encoder, gathered over processes, with EqCo's margin so that a small batch behaves like
α negatives:

    f_k ← m·f_k + (1−m)·f_q
    q = normalize(f_q(x1)),  K_all = gather(normalize(f_k(x2)))          B keys, no gradient
    L = InfoNCE(⟨q_i, K_all[r·N+i]⟩, {⟨q_i, K_all[j]⟩}_{j≠r·N+i}; τ, margin τ·log(α/K))

K = B−1, or fewer drawn per query (``num_negatives``). SyncBN in both encoders replaces shuffle
BN, and the head has BN after its hidden FC (``mlp_hidden_bn``; ``head_out_bn`` adds one after
the output FC, which the paper leaves uncertain).
"""

from __future__ import annotations

import torch

from pretrain import dist
from pretrain.methods.base import INFONCE_DEFAULTS, InBatchHost, QueryKeyEncoders
from pretrain.models import build_encoder, embed, momentum_copy, momentum_update


class SiMo(QueryKeyEncoders, InBatchHost):
    defaults = {
        **INFONCE_DEFAULTS,
        "loss": {"name": "infonce", "eqco_alpha": 256},
        "dim": 128,
        "head": "mlp_hidden_bn",
        "head_out_bn": False,
        "hidden_dim": None,
        "momentum": 0.999,
        "symmetric": False,
    }

    def __init__(self, cfg, num_processes: int) -> None:
        super().__init__(cfg, num_processes)
        m = cfg.method
        self.momentum = float(m.momentum)
        self.symmetric = bool(m.symmetric)
        self.encoder_q = build_encoder(
            cfg.model.arch, cfg.model.stem, m.head, m.dim, m.hidden_dim, out_bn=m.head_out_bn
        )
        self.encoder_k = momentum_copy(self.encoder_q)

    def contrast_views(self, x_q: torch.Tensor, x_k: torch.Tensor):
        """(queries, loss, diagnostics) of the query view against the gathered momentum keys."""
        q = embed(self.encoder_q, x_q)
        with torch.no_grad():
            keys = dist.gather_no_grad(embed(self.encoder_k, x_k))
        return (q, *self.contrast_in_batch(q, keys))

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        x1, x2 = views[0], views[1]
        momentum_update(self.encoder_q, self.encoder_k, self.momentum)
        q, loss, logs = self.contrast_views(x1, x2)
        self.watch(q)
        if self.symmetric:
            loss = loss + self.contrast_views(x2, x1)[1]
        return {"loss": loss, **logs}
