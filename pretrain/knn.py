"""Weighted kNN classification on frozen, L2-normalized backbone features (InstDisc protocol).

Each validation image takes its k most cosine-similar training images; neighbour j votes for its
class with weight exp(sim_j / t); the prediction is the class with the largest summed weight.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder

from pretrain import dist
from pretrain.data import eval_transform


@torch.no_grad()
def extract_features(
    backbone: nn.Module,
    root: str,
    image_size: int,
    device: torch.device,
    batch_size: int = 256,
    workers: int = 0,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(N, D) L2-normalized features, (N,) labels and class names of an ImageFolder, on ``device``.

    With several processes each extracts every W-th image (rank r: images r, r+W, ...) and the
    shards are gathered back into the folder's order, so every process holds all N features in
    1/W of the time a single process would take."""
    dataset = ImageFolder(root, transform=eval_transform(image_size))
    world, rank = dist.world_size(), dist.rank()
    shard = Subset(dataset, range(rank, len(dataset), world))
    was_training = backbone.training
    backbone.eval()
    feats, labels = [], []
    loader = DataLoader(shard, batch_size=batch_size, num_workers=workers, pin_memory=device.type == "cuda")
    for x, y in loader:
        with autocast():
            f = backbone(x.to(device, non_blocking=True))
        feats.append(F.normalize(f.float(), dim=1))
        labels.append(y.to(device))
    backbone.train(was_training)
    dim = feats[0].shape[1] if feats else backbone(torch.zeros(1, 3, image_size, image_size, device=device)).shape[1]
    local = (
        torch.cat(feats) if feats else torch.zeros(0, dim, device=device),
        torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=device),
    )
    if world == 1:
        return local[0], local[1], dataset.classes
    # Shards differ in length by at most one: pad to the longest, gather, interleave back.
    longest = -(-len(dataset) // world)
    padded = [torch.cat([t, t.new_zeros((longest - len(t), *t.shape[1:]))]) for t in local]
    gathered = [dist.gather_no_grad(t).view(world, longest, *t.shape[1:]).transpose(0, 1).flatten(0, 1) for t in padded]
    order = torch.arange(longest * world, device=device).view(longest, world)
    keep = (order < len(dataset)).flatten()  # drop the padding rows
    return gathered[0][keep], gathered[1][keep], dataset.classes


@torch.no_grad()
def knn_predict(
    query: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    num_classes: int,
    k: int = 200,
    t: float = 0.1,
    chunk: int = 1024,
) -> torch.Tensor:
    """Class scores (Nq, C) of normalized queries (Nq, D) against a normalized bank (Nb, D)."""
    k = min(k, bank.shape[0])
    scores = []
    for q in query.split(chunk):
        sim, idx = (q @ bank.T).topk(k, dim=1)
        votes = F.one_hot(bank_labels[idx], num_classes).float() * (sim / t).exp().unsqueeze(-1)
        scores.append(votes.sum(dim=1))
    return torch.cat(scores)


def knn_accuracy(
    backbone: nn.Module,
    train_dir: str,
    val_dir: str,
    image_size: int,
    device: torch.device,
    k: int = 200,
    t: float = 0.1,
    workers: int = 0,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> float:
    """Top-1 accuracy (%) of weighted kNN on val_dir with train_dir as the bank; called by every
    process (extraction sharded, the vote on ``device``), all get the same answer."""
    bank, bank_labels, classes = extract_features(
        backbone, train_dir, image_size, device, workers=workers, autocast=autocast
    )
    query, labels, val_classes = extract_features(
        backbone, val_dir, image_size, device, workers=workers, autocast=autocast
    )
    if classes != val_classes:
        raise ValueError(f"kNN: class folders differ between {train_dir} and {val_dir}")
    pred = knn_predict(query, bank, bank_labels, len(classes), k, t).argmax(dim=1)
    return 100.0 * (pred == labels).float().mean().item()
