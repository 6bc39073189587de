"""AdCo: MoCo v2 whose queue is replaced by K learned negative adversaries that maximize the
contrastive loss the network minimizes.

Paper: Qianjiang Hu, Xiao Wang, Wei Hu, Guo-Jun Qi, "AdCo: Adversarial Contrast for Efficient
Learning of Unsupervised Representations from Self-Trained Negative Adversaries", CVPR 2021,
arXiv:2011.08435 (code: maple-research-lab/AdCo).

Per step, for N local images (B over all processes), offset = rank·N (the global rank: the
official code's local-GPU offset is wrong on several nodes):

    f_k ← m·f_k + (1−m)·f_q                                      (parameters, before the keys)
    q = normalize(f_q(x_q)),  k_all = gather(unshuffle(normalize(f_k(shuffle(x_k)))))
    L = Σ_pairs w·CE([q·k_allᵀ | q·n̂] / τ, offset + i)          every batch key is a logit,
                                                                   n̂ = normalize(W, dim 0)
    optimizer step on the network, then (``after_step``, same forward's q and k_all)
    W ← ascent on the same L at τ_m with SGD(lr 3, momentum 0.9, wd 1e-4), gradient averaged
        over processes                                            (``losses/adversarial.py``)

Pairs (query view, key view, weight): single crop [(x1, x2, 1)]; ``symmetric`` [(x1, x2, ½),
(x2, x1, ½)]; multi-crop (``query_crops``) the key is crop 0 and each query crop c is a pair
(x_c, x_0, 1), so the loss and the adversary gradient are **sums** over the query crops.

Initialization (``bank_init: fill``, the official ``ad_init``): the first ⌈K/B⌉ steps train the
network MoCo-style against the (partly random) bank, CE([⟨q,k⟩ | q·n̂]/τ, 0), and write each
step's gathered keys into the next B columns of W; once W is full, f_k restarts as a copy of
f_q. The official code runs this as an extra pass before epoch 0; here these steps are the first
steps of epoch 0 (256 of 1.25M at the ImageNet recipe), so resume and the schedule need nothing
special. Multi-crop filling pairs query crop 1 with the key crop 0 (the official code, oddly,
takes the key from the last, smallest crop).
"""

from __future__ import annotations

import functools
import operator

import torch
from omegaconf import OmegaConf

from contrastive_transfer.errors import ConfigError
from pretrain import dist
from pretrain.augment import build_multicrop_transforms
from pretrain.diagnostics import contrastive_stats
from pretrain.losses import (
    AdversarialBank,
    adversary_gradient,
    in_batch_similarities,
    info_nce,
    positive_number,
    similarities,
)
from pretrain.methods.base import Method, QueryKeyEncoders, check_bn_splits
from pretrain.models import build_encoder, embed, momentum_copy, momentum_update

BANK_INITS = ("fill", "random")


class AdCo(QueryKeyEncoders, Method):
    filled: torch.Tensor  # a buffer (register_buffer), typed for mypy
    defaults = {
        "dim": 128,
        "head": "mlp",
        "hidden_dim": None,  # default: the backbone's feature dimension
        "temperature": 0.12,  # τ of the network's loss
        "momentum": 0.999,
        "bn_splits": 8,  # one process only: SplitBatchNorm sub-batches emulating per-GPU BN
        "symmetric": False,
        "bank_size": 65536,  # K adversaries ("cluster")
        "bank_temperature": 0.02,  # τ_m of the adversaries' ascent ("mem_t")
        "bank_lr": 3.0,  # "memory_lr"; constant
        "bank_momentum": 0.9,
        "bank_weight_decay": 1.0e-4,  # "mem_wd"
        "bank_init": "fill",  # fill (keys of the first K/B steps) | random (randn)
        # Multi-crop: query crop sizes in px at a 224 px key crop (scaled with data.image_size),
        # with their RandomResizedCrop scale ranges; [] = the two views of data.augmentation.
        "query_crops": [],
        "query_crop_min_scales": [0.2, 0.172, 0.143, 0.114, 0.086],
        "query_crop_max_scales": [1.0, 0.86, 0.715, 0.571, 0.429],
    }

    @classmethod
    def check(cls, cfg, num_processes: int) -> None:
        m = cfg.method
        for key in ("temperature", "bank_temperature", "bank_size"):
            positive_number(m, key)
        if m.bank_init not in BANK_INITS:
            raise ConfigError(f"method.bank_init={m.bank_init!r}: expected one of {list(BANK_INITS)}")
        crops = len(m.query_crops)
        if crops and m.symmetric:
            raise ConfigError(
                "method.symmetric=true with method.query_crops: AdCo's symmetric loss is single-crop "
                "only; set one of them off"
            )
        if crops and not crops == len(m.query_crop_min_scales) == len(m.query_crop_max_scales):
            raise ConfigError(
                f"method.query_crops has {crops} sizes but method.query_crop_min_scales/"
                f"query_crop_max_scales have {len(m.query_crop_min_scales)}/"
                f"{len(m.query_crop_max_scales)}: expected one scale range per crop"
            )
        check_bn_splits(cfg, num_processes)

    @classmethod
    def view_transforms(cls, cfg):
        m = cfg.method
        if not m.query_crops:
            return super().view_transforms(cfg)
        size = cfg.data.image_size
        sizes = [max(1, round(s * size / 224)) for s in m.query_crops]
        return build_multicrop_transforms(
            size,
            sizes,
            m.query_crop_min_scales,
            m.query_crop_max_scales,
            cfg.data.min_crop_scale,
            view=OmegaConf.to_container(cfg.data.views)[0],
        )

    def __init__(self, cfg, num_processes: int) -> None:
        super().__init__(cfg, num_processes)
        m = cfg.method
        self.temperature = float(m.temperature)
        self.momentum = float(m.momentum)
        self.symmetric = bool(m.symmetric)
        self.num_query_crops = len(m.query_crops)
        self.bank_temperature = float(m.bank_temperature)
        self.bank_lr, self.bank_momentum = float(m.bank_lr), float(m.bank_momentum)
        self.bank_weight_decay = float(m.bank_weight_decay)
        splits = m.bn_splits if num_processes == 1 else 1
        self.encoder_q = build_encoder(cfg.model.arch, cfg.model.stem, m.head, m.dim, m.hidden_dim, splits)
        self.encoder_k = momentum_copy(self.encoder_q)
        self.bank = AdversarialBank(m.dim, m.bank_size)
        # Columns of W written so far by the filling steps (all of them with bank_init=random).
        self.register_buffer("filled", torch.tensor(0 if m.bank_init == "fill" else m.bank_size))
        # Its host copy, used by the step (reading the buffer would wait for the GPU); a loaded
        # state sets it once.
        self.filled_count = int(self.filled)
        self.register_load_state_dict_post_hook(lambda module, _: setattr(module, "filled_count", int(module.filled)))
        self.pending: list[tuple[torch.Tensor, torch.Tensor, float]] | None = None

    @property
    def filling(self) -> bool:
        return self.filled_count < self.bank.size

    def view_pairs(self) -> list[tuple[int, int, float]]:
        """(query view, key view, loss weight) of every contrasted pair."""
        if self.symmetric:
            return [(0, 1, 0.5), (1, 0, 0.5)]
        if self.num_query_crops:
            return [(c, 0, 1.0) for c in range(1, self.num_query_crops + 1)]
        return [(0, 1, 1.0)]

    @torch.no_grad()
    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """Gathered keys (B×d) of the key encoder with shuffle BN."""
        x, idx_unshuffle = dist.shuffle_batch(x)
        k = embed(self.encoder_k, x)
        return dist.gather_no_grad(dist.unshuffle_batch(k, idx_unshuffle))

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        momentum_update(self.encoder_q, self.encoder_k, self.momentum)
        pairs = self.view_pairs()[: 1 if self.filling else None]
        keys = {j: self.keys(views[j]) for j in dict.fromkeys(j for _, j, _ in pairs)}
        encoded = [(embed(self.encoder_q, views[i]), keys[j], w) for i, j, w in pairs]
        self.watch(encoded[0][0])
        offset = dist.rank_offset(views[0].shape[0])
        loss, logs = self.fill_loss(*encoded[0][:2], offset) if self.filling else self.adversarial_loss(encoded, offset)
        self.pending = [(q.detach(), k_all, w) for q, k_all, w in encoded]
        return {"loss": loss, **logs, "bank_filled": self.filled.float() / self.bank.size}

    def fill_loss(self, q: torch.Tensor, k_all: torch.Tensor, offset: int):
        """MoCo-style CE([⟨q_i,k_i⟩ | q_i·n̂]/τ, 0) of the filling steps."""
        pos = (q * k_all[offset : offset + q.shape[0]]).sum(dim=1)
        neg = self.bank.logits(q)
        loss = info_nce(pos, neg, self.temperature)
        return loss, contrastive_stats(pos, neg, self.temperature, 0.0, loss, neg.shape[1])

    def adversarial_loss(self, encoded, offset: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        weighted: list[torch.Tensor] = []
        logs: dict[str, torch.Tensor] = {}
        for q, k_all, w in encoded:
            pos, batch_neg = in_batch_similarities(q, k_all, offset)
            neg = torch.cat([batch_neg, self.bank.logits(q)], dim=1)  # B−1 other keys, then K adversaries
            loss = info_nce(pos, neg, self.temperature)
            weighted.append(w * loss)
            if not logs:  # diagnostics of the first pair, as the official logs
                logs = contrastive_stats(pos, neg, self.temperature, 0.0, loss, neg.shape[1])
        return functools.reduce(operator.add, weighted), logs

    @torch.no_grad()
    def after_step(self, skipped: bool = False) -> None:
        """Fill the bank with this step's keys, or move the adversaries up the loss of this step's
        forward (pre-step queries, same bank), the gradients of the pairs summed. When the gradient
        scaler skipped the network's step (fp16 overflow), the adversaries stay too: the two are
        one min-max step."""
        pending, self.pending = self.pending, None
        if pending is None or (skipped and not self.filling):
            return
        if self.filling:
            self.filled_count = self.bank.fill(pending[0][1], self.filled_count)
            self.filled.fill_(self.filled_count)
            if not self.filling:  # full: the key encoder restarts from the query encoder
                for p_q, p_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
                    p_k.copy_(p_q)
            return
        grad = functools.reduce(
            operator.add,
            (
                w * adversary_gradient(q, similarities(q, k_all.T), self.bank.weight, self.bank_temperature)
                for q, k_all, w in pending
            ),
        )
        self.bank.ascend(grad, self.bank_lr, self.bank_momentum, self.bank_weight_decay)
