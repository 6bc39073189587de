"""The interface between a contrastive method and the engine.

A method is an ``nn.Module`` that owns all of its state (encoders, momentum encoders, queues and
pointers as buffers), so one ``state_dict`` resumes it. The engine only relies on:

* ``__init__(cfg, num_processes)``: every method is built from the whole config and the process count;
* ``defaults``: the method's config keys (under ``method:``) with their default values (an InfoNCE
  host's ``loss`` is a section: the chosen loss's name and options, see ``INFONCE_DEFAULTS``);
* ``check(cfg, num_processes)``: raise ``ConfigError`` for impossible settings, before anything runs;
* ``sync_bn``: convert BN to SyncBN when several processes run (SimCLR, SiMo); MoCo-style methods
  keep per-process BN with shuffle BN instead;
* ``view_transforms(cfg)``: the augmentation of each view the method consumes (two views of
  ``data.augmentation`` unless the method wants more, e.g. AdCo's multi-crop);
* ``forward(views) -> dict``: ``"loss"`` (scalar with gradient) plus detached scalars to log;
  a method with ``needs_labels`` gets ``forward(views, labels)``, the class indices of the
  ImageFolder (the ``supervised`` baseline), and ``check_classes`` sees the class folders first;
* ``after_step(skipped)``: called after every optimizer step, for state updates that must see the
  stepped network or the step's forward (e.g. AdCo's adversary ascent); a no-op by default;
* ``backbone`` / ``momentum_backbone``: the torchvision ResNets exported in ``checkpoint_final.pth``;
* ``watch_grad``: when the engine sets it, the method keeps its queries' gradient (``watched``)
  for the ‖∂L/∂q‖ diagnostic.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from contrastive_transfer.errors import ConfigError
from pretrain import dist
from pretrain.augment import ViewTransform, build_view_transforms
from pretrain.diagnostics import contrastive_stats
from pretrain.losses import LOSSES, SAMPLING_MODES, in_batch_similarities, positive_number, sample_negatives
from pretrain.models import Encoder


class Method(nn.Module):
    defaults: ClassVar[dict[str, Any]] = {}
    sync_bn: ClassVar[bool] = False
    needs_labels: ClassVar[bool] = False

    def __init__(self, cfg, num_processes: int) -> None:
        super().__init__()
        self.watch_grad = False
        self.watched: torch.Tensor | None = None

    @classmethod
    def check(cls, cfg, num_processes: int) -> None:
        """Raise ConfigError naming the key and the allowed values for impossible settings."""

    @classmethod
    def view_transforms(cls, cfg) -> list[ViewTransform]:
        return build_view_transforms(
            cfg.data.augmentation, cfg.data.image_size, cfg.data.min_crop_scale, cfg.data.views
        )

    def check_classes(self, classes: list[str], root) -> None:
        """Raise ConfigError when the dataset's class folders cannot serve this method (labels)."""

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

    encoder_q: Encoder  # set by the method's __init__
    encoder_k: Encoder

    @property
    def backbone(self) -> nn.Module:
        return self.encoder_q.backbone

    @property
    def momentum_backbone(self) -> nn.Module:
        return self.encoder_k.backbone


def check_bn_splits(cfg, num_processes: int) -> None:
    """``method.bn_splits`` (shuffle-BN emulation in one process) must divide the per-process batch."""
    m, per_process = cfg.method, cfg.train.batch_size // num_processes
    if num_processes == 1 and (m.bn_splits < 1 or per_process % m.bn_splits):
        raise ConfigError(
            f"method.bn_splits={m.bn_splits}: expected a divisor of the per-process batch "
            f"{per_process} (1 disables the single-process shuffle-BN emulation)"
        )


# Keys of every InfoNCE host. `loss` holds the objective on the same (positive, negatives)
# similarities, `loss.name` one of pretrain.losses.LOSSES, with that loss's own options beside its
# name (EqCo's `eqco_alpha`, DCLW's `sigma`, dual temperature's `inter_temperature`): a host's
# `loss` default may set them for its default loss (SiMo's α). Sampling fewer negatives applies to
# any loss.
INFONCE_DEFAULTS: dict[str, Any] = {
    "loss": {"name": "infonce"},  # infonce | dcl | dclw | dual_temperature, and its options
    "temperature": 0.2,
    "num_negatives": None,  # K negatives drawn per query without replacement; None = all available
    "negative_sampling": "per_query",  # per_query | per_batch
}


class InfoNCEHost(Method):
    """A method whose loss contrasts a positive with negatives: InfoNCE (or EqCo) unless
    ``method.loss.name`` picks another of ``pretrain.losses.LOSSES``."""

    @classmethod
    def available_negatives(cls, cfg, num_processes: int) -> int:
        """Negatives per query before sampling (queue length, B−1, 2B−2)."""
        raise NotImplementedError

    @classmethod
    def check(cls, cfg, num_processes: int) -> None:
        m = cfg.method
        positive_number(m, "temperature")
        LOSSES[m.loss.name].check(m.loss)  # the name itself is checked when the config is loaded
        if m.negative_sampling not in SAMPLING_MODES:
            raise ConfigError(
                f"method.negative_sampling={m.negative_sampling!r}: expected one of {list(SAMPLING_MODES)}"
            )
        available = cls.available_negatives(cfg, num_processes)
        if m.num_negatives is not None and not 0 < m.num_negatives <= available:
            raise ConfigError(
                f"method.num_negatives={m.num_negatives}: expected 1..{available} "
                f"(negatives available per query with train.batch_size={cfg.train.batch_size}) or null"
            )

    def __init__(self, cfg, num_processes: int) -> None:
        super().__init__(cfg, num_processes)
        m = cfg.method
        self.temperature = float(m.temperature)
        self.num_negatives = m.num_negatives
        self.negative_sampling = m.negative_sampling
        self.criterion = LOSSES[m.loss.name].from_config(m)

    def contrast(self, pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The configured loss of (N,) positive and (N, K) negative cosines; returns (loss, diagnostics).

        The K negatives are those actually contrasted per query (after sampling); EqCo's margin
        τ·log(α/K) uses them. The diagnostics always describe InfoNCE at these similarities (MI
        bound, NPC multiplier), so that DCL/dual-temperature runs compare with their InfoNCE hosts.
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
        loss, nce = self.criterion.with_infonce(pos, neg)
        stats = contrastive_stats(
            pos, neg, self.temperature, self.criterion.margin(k), nce, self.criterion.equivalent_negatives(k)
        )
        if nce is not loss:
            stats["infonce"] = nce
        return loss, stats


class InBatchHost(InfoNCEHost):
    """An InfoNCE host whose negatives are the other B − 1 samples of the global batch (SiMo,
    SimCo, and the template in docs/extending.md). BN is synchronized across processes, so that
    its statistics span the batch the negatives come from."""

    sync_bn = True

    @classmethod
    def available_negatives(cls, cfg, num_processes: int) -> int:
        return cfg.train.batch_size - 1

    def contrast_in_batch(self, q: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of this process's (N, d) queries against the (B, d) gathered keys, in rank order:
        key ``rank_offset + i`` is the positive of query i, the other B − 1 its negatives."""
        return self.contrast(*in_batch_similarities(q, keys, dist.rank_offset(q.shape[0])))
