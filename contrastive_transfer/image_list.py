"""A labelled image list as a torch Dataset over the packed index: what the frozen-feature
evaluators (``transfer/datasets/readers.py``) and pretraining's kNN monitor (``pretrain/knn.py``)
read images through, files or members of tar shards alike, every one through the gate
(``contrastive_transfer.images.open_rgb``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np
from torch.utils.data import Dataset

from contrastive_transfer.file_index import FileIndex
from contrastive_transfer.images import open_rgb
from contrastive_transfer.members import Member

__all__ = ["ImageList"]


class ImageList(Dataset):
    """Images read as RGB PIL images, passed through ``transform``; item = (image, label).

    The list is a packed ``FileIndex`` (contrastive_transfer/file_index.py), as pretraining's: a
    Places205 or ImageNet list is three numpy arrays, not millions of Python strings that every
    DataLoader worker would copy page by page as it touches their reference counts
    (benchmarks/file_index.md). Its entries are files, or members of tar shards
    (contrastive_transfer/shards.py) read from their shard."""

    def __init__(self, index: FileIndex, transform: Callable | None = None):
        self.index = index
        self.transform = transform
        self.labels = index.labels.astype(np.int64)  # one array, shared with the workers as the index is

    @property
    def classes(self) -> list[str]:
        return self.index.classes

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        path, label = self.index[i]
        image = open_rgb(path)  # OSError naming the file (or shard and member), decompression bombs included
        return (self.transform(image) if self.transform is not None else image), label

    def fingerprint(self) -> str:
        """Identifies the list (paths, labels, file sizes) for feature caches."""
        h = hashlib.sha256()
        for p, y in self.index:
            size = p.size if isinstance(p, Member) else os.path.getsize(p)
            h.update(f"{p}\t{y}\t{size}\n".encode())
        return h.hexdigest()
