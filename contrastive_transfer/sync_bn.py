"""Batch normalization with statistics over all processes, on any device and backend: used by
pretraining (global BN, ``train.sync_bn``) and by the linear probe's BN head on N processes."""

from __future__ import annotations

import torch
from torch import nn

from contrastive_transfer.ranks import all_reduce_with_grad, world_size


class ProcessGroupBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch normalization with statistics over all processes, on any device and backend.

    torch's SyncBatchNorm runs only on CUDA; this one all-reduces (Σx, Σx², n) with a
    differentiable all-reduce, so CPU runs with several gloo processes normalize exactly like one
    process on the global batch (SimCLR's "global BN"). Works for (N, C) and (N, C, ...) inputs.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-d input (N, C, ...), got {x.dim()}-d")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or world_size() == 1:
            return super().forward(x)
        c, dims = x.shape[1], [0, *range(2, x.dim())]
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        count = torch.full((1,), xf.numel() // c, dtype=xf.dtype, device=x.device)
        stats = all_reduce_with_grad(torch.cat([xf.sum(dims), (xf * xf).sum(dims), count]))
        n = stats[-1]
        mean = stats[:c] / n
        var = (stats[c : 2 * c] / n - mean * mean).clamp_min(0)
        assert self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None
        with torch.no_grad():
            m = self.momentum if self.momentum is not None else 0.1
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            self.running_var.mul_(1 - m).add_(var.detach() * n / (n - 1).clamp_min(1), alpha=m)
            self.num_batches_tracked.add_(1)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """BN → SyncBatchNorm on CUDA (torch's, fastest), → ProcessGroupBatchNorm elsewhere (CPU/gloo)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, ProcessGroupBatchNorm):
        bn = ProcessGroupBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        bn.load_state_dict(module.state_dict())
        if module.affine:
            bn.weight.requires_grad_(module.weight.requires_grad)
            bn.bias.requires_grad_(module.bias.requires_grad)
        return bn
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, device))
    return module
