"""The pretraining kNN monitor: features of a labelled ImageFolder (or its tar shards, as
``data.root`` takes them) extracted by every process (each a shard), then the vote of
``contrastive_transfer.contract.knn_vote`` (the one ``transfer.knn`` uses):
neighbour j votes for its class with weight exp(sim_j / t).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from contrastive_transfer.cli import UserError
from contrastive_transfer.contract import KNN_K, KNN_TEMPERATURE, knn_bank, knn_vote
from contrastive_transfer.image_list import ImageList
from contrastive_transfer.ranks import gather_in_order, shard_indices
from pretrain.data import eval_transform, scan_index


def labelled_images(root: str, image_size: int) -> ImageList:
    """The images of a class-folder tree or of its shards, through the same scan and gate as the
    pretraining data (``scan_index``, ``open_rgb``): each directory visited once, every file and
    member checked as it is read."""
    index = scan_index(root)
    if not index.classes:
        raise UserError(f"kNN monitor: {root} holds no class folders (expected <class>/<image> for the kNN labels)")
    return ImageList(index, eval_transform(image_size))


@torch.no_grad()
def extract_features(
    backbone: nn.Module,
    root: str | ImageList,
    image_size: int,
    device: torch.device,
    batch_size: int = 256,
    workers: int = 0,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    worker_init_fn: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(N, D) L2-normalized features, (N,) labels and class names of an ImageFolder (a path, or
    its ``labelled_images`` already scanned), on ``device``.

    With several processes each extracts every W-th batch (rank r: batches r, r+W, ...) and the
    shards are gathered back into the folder's order, so every process holds all N features in
    1/W of the time a single process would take, each image computed with the same batch mates."""
    dataset = root if isinstance(root, ImageList) else labelled_images(root, image_size)
    shard = Subset(dataset, shard_indices(len(dataset), batch_size))
    was_training = backbone.training
    backbone.eval()
    feats, labels = [], []
    loader = DataLoader(
        shard,
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=worker_init_fn,
    )
    for x, y in loader:
        with autocast():
            f = backbone(x.to(device, non_blocking=True))
        feats.append(F.normalize(f.float(), dim=1))
        labels.append(y.to(device))
    backbone.train(was_training)
    dim = feats[0].shape[1] if feats else backbone(torch.zeros(1, 3, image_size, image_size, device=device)).shape[1]
    local_feats = torch.cat(feats) if feats else torch.zeros(0, dim, device=device)
    local_labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=device)
    n = len(dataset)
    return gather_in_order(local_feats, n, batch_size), gather_in_order(local_labels, n, batch_size), dataset.classes


def knn_accuracy(
    backbone: nn.Module,
    train_dir: str | ImageList,
    val_dir: str | ImageList,
    image_size: int,
    device: torch.device,
    k: int = KNN_K,
    t: float = KNN_TEMPERATURE,
    workers: int = 0,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    worker_init_fn: Callable[[int], None] | None = None,
) -> float:
    """Top-1 accuracy (%) of weighted kNN on val_dir with train_dir as the bank (folders, or their
    ``labelled_images`` kept from an earlier call); called by every process (extraction sharded,
    the vote on ``device``), all get the same answer."""
    options = {"workers": workers, "autocast": autocast, "worker_init_fn": worker_init_fn}
    bank, bank_labels, classes = extract_features(backbone, train_dir, image_size, device, **options)
    query, labels, val_classes = extract_features(backbone, val_dir, image_size, device, **options)
    if classes != val_classes:
        train_root, val_root = (d.index.root if isinstance(d, ImageList) else d for d in (train_dir, val_dir))
        raise ValueError(f"kNN: class folders differ between {train_root} and {val_root}")
    pred = knn_vote(query, knn_bank(bank), bank_labels, len(classes), k, t).argmax(dim=1)  # float16 on CUDA
    return 100.0 * (pred == labels).float().mean().item()
