"""The interface between a contrastive method and the engine.

A method is an ``nn.Module`` that owns all of its state (encoders, momentum encoders, queues and
pointers as buffers), so one ``state_dict`` resumes it. The engine only relies on:

* ``defaults``: the method's config keys (under ``method:``) with their default values;
* ``check(cfg, num_processes)``: raise ``ConfigError`` for impossible settings, before anything runs;
* ``sync_bn``: convert BN to SyncBN when several processes run (SimCLR, SiMo); MoCo-style methods
  keep per-process BN with shuffle BN instead;
* ``view_transforms(cfg)``: the augmentation of each view the method consumes (two views of
  ``data.augmentation`` unless the method wants more, e.g. AdCo's multi-crop);
* ``forward(views) -> dict``: ``"loss"`` (scalar with gradient) plus detached scalars to log;
* ``after_step(skipped)``: called after every optimizer step, for state updates that must see the
  stepped network or the step's forward (e.g. AdCo's adversary ascent); a no-op by default;
* ``backbone`` / ``momentum_backbone``: the torchvision ResNets exported in ``checkpoint_final.pth``;
* ``watch_grad``: when the engine sets it, the method keeps its queries' gradient (``watched``)
  for the ‖∂L/∂q‖ diagnostic.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from pretrain import dist
from pretrain.config import ConfigError
from pretrain.data import build_view_transforms
from pretrain.diagnostics import contrastive_stats
from pretrain.losses import SAMPLING_MODES, DCLLoss, DualTemperatureLoss, eqco_margin, info_nce, sample_negatives


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

    @classmethod
    def view_transforms(cls, cfg) -> list[Callable]:
        return build_view_transforms(
            cfg.data.augmentation, cfg.data.image_size, cfg.data.min_crop_scale, cfg.data.views
        )

    def after_step(self, skipped: bool = False) -> None:
        """Called by the engine right after ``optimizer.step()`` (outside autocast); ``skipped``:
        the fp16 gradient scaler found inf/NaN gradients and left the network unchanged."""

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


class QueryKeyEncoders:
    """For methods with a query encoder ``encoder_q`` and its momentum copy ``encoder_k``: both
    backbones are exported (MoCo, SiMo/SimMoCo, AdCo)."""

    @property
    def backbone(self) -> nn.Module:
        return self.encoder_q.backbone

    @property
    def momentum_backbone(self) -> nn.Module:
        return self.encoder_k.backbone


# Keys shared by every InfoNCE host; EqCo is `eqco_alpha` (+ `num_negatives` to contrast fewer).
# `loss` swaps the objective on the same (positive, negatives) similarities: DCL/DCLW remove the
# positive from the denominator, dual_temperature reweights each anchor (τ_α = temperature).
INFONCE_DEFAULTS: dict[str, Any] = {
    "loss": "infonce",  # infonce | dcl | dclw | dual_temperature
    "temperature": 0.2,
    "eqco_alpha": None,  # EqCo: margin τ·log(α/K) on the positive; None = plain InfoNCE
    "num_negatives": None,  # K negatives drawn per query without replacement; None = all available
    "negative_sampling": "per_query",  # per_query | per_batch
    "dclw_sigma": 0.5,  # DCLW: w = 2 − N·softmax(⟨z1,z2⟩/σ) over the batch
    "dclw_detach": True,  # DCLW weights from detached similarities (lightly); False: they carry gradient
    "dclw_per_process": False,  # DCLW softmax over each process's anchors (lightly's form); default: global batch
    "inter_temperature": 1.0,  # dual_temperature: τ_β
}

# method.loss -> the criterion on (pos, neg) cosines; None is InfoNCE with EqCo's margin.
LOSSES: dict[str, Callable[[Any], nn.Module | None]] = {
    "infonce": lambda m: None,
    "dcl": lambda m: DCLLoss(m.temperature),
    "dclw": lambda m: DCLLoss(
        m.temperature, weight_sigma=m.dclw_sigma, detach_weights=m.dclw_detach, per_process_weights=m.dclw_per_process
    ),
    "dual_temperature": lambda m: DualTemperatureLoss(m.temperature, m.inter_temperature),
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
        if m.loss not in LOSSES:
            raise ConfigError(f"method.loss={m.loss!r}: expected one of {list(LOSSES)}")
        if m.eqco_alpha is not None and m.loss != "infonce":
            raise ConfigError(
                f"method.eqco_alpha={m.eqco_alpha}: EqCo's margin applies to method.loss=infonce only "
                f"(got {m.loss!r}); set method.eqco_alpha=null"
            )
        for key in ("dclw_sigma", "inter_temperature"):
            if not (isinstance(m[key], (int, float)) and m[key] > 0):
                raise ConfigError(f"method.{key}={m[key]}: expected a positive number")
        if m.negative_sampling not in SAMPLING_MODES:
            raise ConfigError(
                f"method.negative_sampling={m.negative_sampling!r}: expected one of {list(SAMPLING_MODES)}"
            )
        if m.eqco_alpha is not None and m.eqco_alpha <= 0:
            raise ConfigError(f"method.eqco_alpha={m.eqco_alpha}: expected a positive number or null")
        available = cls.available_negatives(cfg, num_processes)
        if m.num_negatives is not None and not 0 < m.num_negatives <= available:
            raise ConfigError(
                f"method.num_negatives={m.num_negatives}: expected 1..{available} "
                f"(negatives available per query with train.batch_size={cfg.train.batch_size}) or null"
            )

    def __init__(self, method_cfg) -> None:
        super().__init__()
        self.temperature = float(method_cfg.temperature)
        self.eqco_alpha = method_cfg.eqco_alpha
        self.num_negatives = method_cfg.num_negatives
        self.negative_sampling = method_cfg.negative_sampling
        self.criterion = LOSSES[method_cfg.loss](method_cfg)

    def contrast(self, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The configured loss of (N,) positive and (N, K) negative cosines; returns (loss, diagnostics).

        InfoNCE takes EqCo's margin m = τ·log(α/K) from the K negatives actually contrasted per
        query. The diagnostics always describe InfoNCE at these similarities (MI bound, NPC
        multiplier), so that DCL/dual-temperature runs compare with their InfoNCE hosts.
        """
        if self.num_negatives is not None:
            n = neg.shape[0]
            neg = sample_negatives(
                neg,
                self.num_negatives,
                self.negative_sampling,
                row_offset=dist.rank_offset(n),
                total_rows=n * dist.world_size(),
            )
        k = neg.shape[1]
        margin = 0.0 if self.eqco_alpha is None else eqco_margin(self.temperature, self.eqco_alpha, k)
        if self.criterion is None:
            loss = nce = info_nce(pos, neg, self.temperature, margin)
        else:
            loss = self.criterion(pos, neg)
            with torch.no_grad():
                nce = info_nce(pos, neg, self.temperature)
        stats = contrastive_stats(pos, neg, self.temperature, margin, nce, self.eqco_alpha or k)
        if self.criterion is not None:
            stats["infonce"] = nce
        return loss, stats
