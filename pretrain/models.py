"""Encoders for contrastive pretraining: torchvision ResNets, projection heads, SplitBatchNorm, EMA.

The backbone is a torchvision ResNet whose ``fc`` is replaced by ``Identity``, so its
``state_dict`` keeps torchvision's names (``conv1.weight``, ``layer1.0.bn1.running_mean``, ...):
that is what ``checkpoint_final.pth`` exports and what the converters read.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_transfer.contract import resnet_backbone

HEADS = ("linear", "mlp", "mlp_bn", "mlp_hidden_bn")


class SplitBatchNorm(nn.BatchNorm2d):
    """BatchNorm over `num_splits` interleaved sub-batches, with shared affine parameters.

    Emulates per-GPU BN in one process (MoCo's CIFAR Colab), so that shuffle BN keeps its meaning
    on a single device: sample n belongs to sub-batch n % num_splits. Running statistics are the
    mean over sub-batches. With num_splits=1 it is plain BatchNorm2d; its state_dict names are
    BatchNorm2d's, so exported backbones load anywhere.
    """

    def __init__(self, num_features: int, num_splits: int, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        self.num_splits = num_splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        s = self.num_splits
        if not self.training or s == 1:
            return super().forward(x)
        if not x.is_contiguous():  # channels_last: the sub-batch view below needs NCHW memory
            return self.forward(x.contiguous()).contiguous(memory_format=torch.channels_last)
        if n % s:
            raise ValueError(
                f"SplitBatchNorm: batch of {n} is not divisible by num_splits={s} "
                "(set method.bn_splits to a divisor of the per-process batch)"
            )
        mean, var = self.running_mean.repeat(s), self.running_var.repeat(s)
        out = F.batch_norm(
            x.view(-1, c * s, h, w),
            mean,
            var,
            self.weight.repeat(s),
            self.bias.repeat(s),
            True,
            self.momentum if self.momentum is not None else 0.1,
            self.eps,
        )
        with torch.no_grad():
            self.running_mean.copy_(mean.view(s, c).mean(0))
            self.running_var.copy_(var.view(s, c).mean(0))
            self.num_batches_tracked.add_(1)
        return out.view(n, c, h, w)


def build_backbone(arch: str, stem: str = "imagenet", bn_splits: int = 1) -> tuple[nn.Module, int]:
    """A torchvision ResNet without its classifier; returns (backbone, feature dimension).

    stem="small" swaps the 7×7/2 conv and max-pool for a 3×3/1 conv (CIFAR-style), for 32–64 px
    images; bn_splits > 1 uses SplitBatchNorm everywhere.
    """
    norm = nn.BatchNorm2d if bn_splits == 1 else partial(SplitBatchNorm, num_splits=bn_splits)
    return resnet_backbone(arch, stem, norm)


def _bn_without_shift(dim: int) -> nn.BatchNorm1d:
    # SimCLR's output BN has a scale but no centering (TF center=False): freeze β at 0.
    bn = nn.BatchNorm1d(dim)
    bn.bias.requires_grad_(False)
    return bn


def build_head(kind: str, in_dim: int, hidden_dim: int, out_dim: int, out_bn: bool = False) -> nn.Module:
    """Projection heads of the papers.

    linear          MoCo v1: fc(in → out)
    mlp             MoCo v2: fc(in → hidden) → ReLU → fc(hidden → out), no BN
    mlp_bn          SimCLR v1: fc(no bias) → BN → ReLU → fc(no bias) → BN without shift
    mlp_hidden_bn   SiMo: fc → BN → ReLU → fc [→ BN if out_bn]
    """
    if kind == "linear":
        return nn.Linear(in_dim, out_dim)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, out_dim))
    if kind == "mlp_bn":
        return nn.Sequential(
            nn.Linear(in_dim, hidden_dim, bias=False),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim, bias=False),
            _bn_without_shift(out_dim),
        )
    if kind == "mlp_hidden_bn":
        layers = [
            nn.Linear(in_dim, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim),
        ]
        return nn.Sequential(*layers, *([nn.BatchNorm1d(out_dim)] if out_bn else []))
    raise ValueError(f"head {kind!r}: expected one of {HEADS}")


class Encoder(nn.Module):
    """backbone → head; forward returns the (unnormalized) projection."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def build_encoder(
    arch: str, stem: str, head: str, dim: int, hidden_dim: int | None = None, bn_splits: int = 1, out_bn: bool = False
) -> Encoder:
    """hidden_dim defaults to the backbone's feature dimension (2048 for ResNet-50), as in the papers."""
    backbone, feat_dim = build_backbone(arch, stem, bn_splits)
    return Encoder(backbone, build_head(head, feat_dim, hidden_dim or feat_dim, dim, out_bn))


def embed(encoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """normalize(encoder(x)) in at least fp32: under autocast the head's output may be fp16/bf16,
    and the similarities of normalized embeddings need fp32 (fp64 models stay fp64, for tests)."""
    z = encoder(x)
    return F.normalize(z.to(torch.promote_types(z.dtype, torch.float32)), dim=1)


_M = TypeVar("_M", bound=nn.Module)


def momentum_copy(encoder: _M) -> _M:
    """A frozen deep copy (a real copy: aliases would be de-duplicated by safetensors)."""
    target = copy.deepcopy(encoder)
    for p in target.parameters():
        p.requires_grad_(False)
    return target


@torch.no_grad()
def momentum_update(online: nn.Module, target: nn.Module, m: float) -> None:
    """target ← m·target + (1−m)·online for parameters only; buffers (BN statistics) are not
    averaged, as in MoCo: the target runs its own train-mode forwards."""
    targets = list(target.parameters())
    # One fused kernel per op for all tensors instead of two per tensor (~330 launches a step for
    # ResNet-50 on a GPU); the same arithmetic, so the same bits.
    torch._foreach_mul_(targets, m)
    torch._foreach_add_(targets, [p.detach() for p in online.parameters()], alpha=1.0 - m)
