"""Weighted kNN classification on frozen, L2-normalized backbone features (InstDisc protocol).

Each validation image takes its k most cosine-similar training images; neighbour j votes for its
class with weight exp(sim_j / t); the prediction is the class with the largest summed weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from pretrain.data import eval_transform


@torch.no_grad()
def extract_features(backbone: nn.Module, root: str, image_size: int, device: torch.device,
                     batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(N, D) L2-normalized features, (N,) labels and class names of an ImageFolder."""
    dataset = ImageFolder(root, transform=eval_transform(image_size))
    was_training = backbone.training
    backbone.eval()
    feats, labels = [], []
    for x, y in DataLoader(dataset, batch_size=batch_size):
        feats.append(F.normalize(backbone(x.to(device)).float(), dim=1).cpu())
        labels.append(y)
    backbone.train(was_training)
    return torch.cat(feats), torch.cat(labels), dataset.classes


@torch.no_grad()
def knn_predict(query: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor, num_classes: int,
                k: int = 200, t: float = 0.1, chunk: int = 1024) -> torch.Tensor:
    """Class scores (Nq, C) of normalized queries (Nq, D) against a normalized bank (Nb, D)."""
    k = min(k, bank.shape[0])
    scores = []
    for q in query.split(chunk):
        sim, idx = (q @ bank.T).topk(k, dim=1)
        votes = F.one_hot(bank_labels[idx], num_classes).float() * (sim / t).exp().unsqueeze(-1)
        scores.append(votes.sum(dim=1))
    return torch.cat(scores)


def knn_accuracy(backbone: nn.Module, train_dir: str, val_dir: str, image_size: int, device: torch.device,
                 k: int = 200, t: float = 0.1) -> float:
    """Top-1 accuracy (%) of weighted kNN on val_dir with train_dir as the bank."""
    bank, bank_labels, classes = extract_features(backbone, train_dir, image_size, device)
    query, labels, val_classes = extract_features(backbone, val_dir, image_size, device)
    if classes != val_classes:
        raise ValueError(f"kNN: class folders differ between {train_dir} and {val_dir}")
    pred = knn_predict(query, bank, bank_labels, len(classes), k, t).argmax(dim=1)
    return 100.0 * (pred == labels).float().mean().item()
