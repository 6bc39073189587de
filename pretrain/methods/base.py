"""The interface between a contrastive method and the engine.

A method is an ``nn.Module`` that owns all of its state (encoders, momentum encoders, queues and
pointers as buffers), so one ``state_dict`` resumes it. The engine only relies on:

* ``defaults``: the method's config keys (under ``method:``) with their default values;
* ``check(cfg, num_processes)``: raise ``ConfigError`` for impossible settings, before anything runs;
* ``sync_bn``: convert BN to SyncBN when several processes run (SimCLR, SiMo); MoCo-style methods
  keep per-process BN with shuffle BN instead;
* ``forward(views) -> dict``: ``"loss"`` (scalar with gradient) plus detached scalars to log;
* ``backbone`` / ``momentum_backbone``: the torchvision ResNets exported in ``checkpoint_final.pth``;
* ``watch_grad``: when the engine sets it, the method keeps its queries' gradient (``watched``)
  for the ‖∂L/∂q‖ diagnostic.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pretrain.config import ConfigError
from pretrain.diagnostics import contrastive_stats
from pretrain.losses import SAMPLING_MODES, eqco_margin, info_nce, sample_negatives


class Method(nn.Module):
    defaults: ClassVar[dict[str, Any]] = {}
    sync_bn: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.watch_grad = False
        self.watched: torch.Tensor | None = None

    @classmethod
    def check(cls, cfg, num_processes: int) -> None:
        """Raise ConfigError naming the key and the allowed values for impossible settings."""

    @property
    def backbone(self) -> nn.Module:
        raise NotImplementedError

    @property
    def momentum_backbone(self) -> nn.Module | None:
        return None

    def watch(self, q: torch.Tensor) -> None:
        if self.watch_grad and q.requires_grad:
            q.retain_grad()
            self.watched = q


# Keys shared by every InfoNCE host; EqCo is `eqco_alpha` (+ `num_negatives` to contrast fewer).
INFONCE_DEFAULTS: dict[str, Any] = {
    "temperature": 0.2,
    "eqco_alpha": None,  # EqCo: margin τ·log(α/K) on the positive; None = plain InfoNCE
    "num_negatives": None,  # K negatives drawn per query without replacement; None = all available
    "negative_sampling": "per_query",  # per_query | per_batch
}


class InfoNCEHost(Method):
    """A method whose loss is InfoNCE over (positive, negatives), with EqCo as an option."""

    @classmethod
    def available_negatives(cls, cfg, num_processes: int) -> int:
        """Negatives per query before sampling (queue length, B−1, 2B−2)."""
        raise NotImplementedError

    @classmethod
    def check(cls, cfg, num_processes: int) -> None:
        m = cfg.method
        if m.temperature is None or m.temperature <= 0:
            raise ConfigError(f"method.temperature={m.temperature}: expected a positive number")
        if m.negative_sampling not in SAMPLING_MODES:
            raise ConfigError(f"method.negative_sampling={m.negative_sampling!r}: expected one of {list(SAMPLING_MODES)}")
        if m.eqco_alpha is not None and m.eqco_alpha <= 0:
            raise ConfigError(f"method.eqco_alpha={m.eqco_alpha}: expected a positive number or null")
        available = cls.available_negatives(cfg, num_processes)
        if m.num_negatives is not None and not 0 < m.num_negatives <= available:
            raise ConfigError(f"method.num_negatives={m.num_negatives}: expected 1..{available} "
                              f"(negatives available per query with train.batch_size={cfg.train.batch_size}) or null")

    def __init__(self, method_cfg) -> None:
        super().__init__()
        self.temperature = float(method_cfg.temperature)
        self.eqco_alpha = method_cfg.eqco_alpha
        self.num_negatives = method_cfg.num_negatives
        self.negative_sampling = method_cfg.negative_sampling

    def contrast(self, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """InfoNCE of (N,) positive and (N, K) negative cosines, with EqCo's margin m = τ·log(α/K)
        computed from the K negatives actually contrasted per query; returns (loss, diagnostics)."""
        if self.num_negatives is not None:
            neg = sample_negatives(neg, self.num_negatives, self.negative_sampling)
        k = neg.shape[1]
        margin = 0.0 if self.eqco_alpha is None else eqco_margin(self.temperature, self.eqco_alpha, k)
        loss = info_nce(pos, neg, self.temperature, margin)
        stats = contrastive_stats(pos, neg, self.temperature, margin, loss, self.eqco_alpha or k)
        return loss, stats
