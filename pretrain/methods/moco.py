"""MoCo v1/v2, optionally with EqCo's margin.

Papers: Kaiming He, Haoqi Fan, Yuxin Wu, Saining Xie, Ross Girshick, "Momentum Contrast for
Unsupervised Visual Representation Learning", CVPR 2020, arXiv:1911.05722 (v1); Xinlei Chen,
Haoqi Fan, Ross Girshick, Kaiming He, "Improved Baselines with Momentum Contrastive Learning",
2020, arXiv:2003.04297 (v2).

Per step, for a batch of N images with views x1, x2 (facebookresearch/moco ``builder.py``):

    f_k ← m·f_k + (1−m)·f_q                         (parameters only, before the keys)
    q   = normalize(f_q(x1))                        N×d, with gradient
    k   = unshuffle(normalize(f_k(shuffle(x2))))    N×d, no gradient (shuffle BN)
    L   = InfoNCE(⟨q,k⟩, q·queue; τ)               positive at index 0; EqCo: margin τ·log(α/K)
    enqueue(gather(k))                              every rank holds the same queue

v1 = linear head, τ 0.07, MoCo aug; v2 = MLP head, τ 0.2, aug+, cosine lr (recipes in configs).
Shuffle BN: with several processes the key batch is permuted across processes; with one, the
encoders use SplitBatchNorm over ``bn_splits`` sub-batches and the keys are permuted locally.
``symmetric`` (MoCo's CIFAR Colab) sums both directions and enqueues both key sets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from contrastive_transfer.errors import ConfigError
from pretrain import dist
from pretrain.losses import similarities
from pretrain.methods.base import INFONCE_DEFAULTS, InfoNCEHost, QueryKeyEncoders, check_bn_splits
from pretrain.models import build_encoder, embed, momentum_copy, momentum_update


class MoCo(QueryKeyEncoders, InfoNCEHost):
    queue: torch.Tensor  # buffers (register_buffer), typed for mypy
    queue_ptr: torch.Tensor
    defaults = {
        **INFONCE_DEFAULTS,
        "dim": 128,
        "head": "mlp",  # linear (v1) | mlp (v2)
        "hidden_dim": None,  # default: the backbone's feature dimension
        "queue_size": 65536,
        "momentum": 0.999,
        "symmetric": False,
        "bn_splits": 8,  # one process only: SplitBatchNorm sub-batches emulating per-GPU BN
    }

    @classmethod
    def keys_per_step(cls, cfg) -> int:
        return cfg.train.batch_size * (2 if cfg.method.symmetric else 1)

    @classmethod
    def available_negatives(cls, cfg, num_processes: int) -> int:
        return cfg.method.queue_size

    @classmethod
    def check(cls, cfg, num_processes: int) -> None:
        super().check(cfg, num_processes)
        m, keys = cfg.method, cls.keys_per_step(cfg)
        if m.queue_size <= 0 or m.queue_size % keys:
            raise ConfigError(
                f"method.queue_size={m.queue_size}: expected a positive multiple of the {keys} keys enqueued per "
                f"step (train.batch_size={cfg.train.batch_size}{' x2, symmetric' if m.symmetric else ''}), "
                f"e.g. {max(1, round(m.queue_size / keys)) * keys}"
            )
        check_bn_splits(cfg, num_processes)

    def __init__(self, cfg, num_processes: int) -> None:
        super().__init__(cfg, num_processes)
        m = cfg.method
        self.momentum = float(m.momentum)
        self.symmetric = bool(m.symmetric)
        splits = m.bn_splits if num_processes == 1 else 1
        self.encoder_q = build_encoder(cfg.model.arch, cfg.model.stem, m.head, m.dim, m.hidden_dim, splits)
        self.encoder_k = momentum_copy(self.encoder_q)
        self.register_buffer("queue", F.normalize(torch.randn(m.dim, m.queue_size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))  # what checkpoints hold
        # The pointer the step uses lives on the host: reading the buffer every step would wait for
        # the GPU. It is deterministic, so the copy is exact; a loaded state sets it once.
        self.ptr = 0
        self.register_load_state_dict_post_hook(lambda module, _: setattr(module, "ptr", int(module.queue_ptr)))

    @torch.no_grad()
    def keys(self, x: torch.Tensor) -> torch.Tensor:
        x, idx_unshuffle = dist.shuffle_batch(x)
        k = embed(self.encoder_k, x)
        return dist.unshuffle_batch(k, idx_unshuffle)

    def contrast_with_queue(self, q: torch.Tensor, k: torch.Tensor):
        pos = (q * k).sum(dim=1)  # N
        neg = similarities(q, self.queue.clone().detach())  # N×K; clone: the queue changes in place
        return self.contrast(pos, neg)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        keys = dist.gather_no_grad(keys)
        ptr, n = self.ptr, keys.shape[0]
        self.queue[:, ptr : ptr + n] = keys.T.to(self.queue.dtype)
        self.ptr = (ptr + n) % self.queue.shape[1]
        self.queue_ptr.fill_(self.ptr)

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        x1, x2 = views[0], views[1]
        momentum_update(self.encoder_q, self.encoder_k, self.momentum)
        q1 = embed(self.encoder_q, x1)
        k2 = self.keys(x2)
        loss, logs = self.contrast_with_queue(q1, k2)
        self.watch(q1)
        new_keys = k2
        if self.symmetric:
            q2 = embed(self.encoder_q, x2)
            k1 = self.keys(x1)
            loss = loss + self.contrast_with_queue(q2, k1)[0]  # a sum, as in the Colab
            new_keys = torch.cat([k2, k1])
        self.enqueue(new_keys)
        return {"loss": loss, **logs}
