"""Pretraining data: a robust image dataset, a resumable sharded sampler, the loader.

Reproducibility contract: the augmentation of sample ``index`` in ``epoch`` depends only on
``(seed, epoch, index)``, never on the number of workers, the rank, the batch it is fetched in
or where a run was resumed. The permutation of an epoch depends only on ``(seed, epoch)``.
Views are declared as data (``pretrain/augment/views.py``, presets in ``configs/augment/``); each is a
``ViewTransform`` (``pretrain/augment/pipeline.py``): geometric ops per sample, colour ops batched
over the DataLoader's batch with per-sample parameters. Who runs them is ``data.backend``, one
class each in ``pretrain/data_backends.py`` (the seeding too: ``seeded_draws``).

Epochs: call ``set_loader_epoch(loader, epoch, start_batch)`` (or both ``dataset.set_epoch`` and
``sampler.set_epoch``) **before** ``iter(loader)``. DataLoader workers hold a copy of the dataset,
so the epoch lives in a shared-memory tensor that persistent workers also see; changing it while
an iterator is running would race with prefetching.

Do not pass the loader through ``accelerator.prepare``: Accelerate would replace the sampler.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, has_file_allowed_extension
from torchvision.transforms import v2

from contrastive_transfer.cli import UserError
from contrastive_transfer.contract import IMAGENET_MEAN, IMAGENET_STD
from contrastive_transfer.file_index import FileIndex
from contrastive_transfer.images import DECODE_ERRORS
from contrastive_transfer.paths import printable, scan_image_folder
from contrastive_transfer.seeding import stable_seed
from contrastive_transfer.shards import index_shards, is_sharded
from pretrain import dist
from pretrain.data_backends import DEFAULT_BACKEND, backend_named, backend_of

__all__ = [
    "eval_transform",
    "ImageDataset",
    "collate",
    "ShardedSampler",
    "build_loader",
    "set_loader_epoch",
    "BadImageTracker",
]


def eval_transform(image_size: int) -> v2.Compose:
    """Shorter side to round(size·256/224), center crop, normalize (kNN monitor, features)."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(round(image_size * 256 / 224), antialias=True),
            v2.CenterCrop(image_size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            v2.ToPureTensor(),
        ]
    )


# ------------------------------------------------------------------------------------ dataset


def _scan(root: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """ImageFolder layout (labels from sorted class folders) or else a flat folder (label -1)."""
    if not root.is_dir():
        raise FileNotFoundError(f"image root {root} does not exist or is not a directory")
    reason = ""
    if any(entry.is_dir() for entry in os.scandir(root)):
        try:  # torchvision's scan; raises when a class folder holds no image
            classes, class_to_idx = find_classes(root)
            return scan_image_folder(root, class_to_idx, IMG_EXTENSIONS), classes  # each directory once
        except FileNotFoundError as e:
            reason = f" ({e})"
    flat = sorted(
        e.path for e in os.scandir(root) if e.is_file() and has_file_allowed_extension(e.name, IMG_EXTENSIONS)
    )
    if not flat:
        raise FileNotFoundError(
            f"no images found in {root}: expected root/<class>/<image> or a flat folder of images "
            f"with extensions {', '.join(IMG_EXTENSIONS)} (any case){reason}"
        )
    return [(p, -1) for p in flat], []


def scan_index(root: str | os.PathLike) -> FileIndex:
    """The folder's images as a packed index (``_scan``: ImageFolder or a flat folder), or the
    images of tar shards (``data.root=shards/train-{000000..000127}.tar``, contrastive_transfer/shards.py):
    their members by offset, in the order they were written, so that the samplers, the augmentation
    seeds and a resume treat them as the folder's files."""
    if is_sharded(root):
        return index_shards(root).index
    samples, classes = _scan(Path(root))
    return FileIndex.from_samples(root, samples, classes)


def shared_index(root: str | os.PathLike, saved: Path, main: bool, fresh: bool) -> FileIndex:
    """The dataset's index, scanned once per run by the main process and saved at ``saved`` (beside
    the run); the other processes read that file instead of scanning the folder again, or scan it
    themselves on a machine that cannot see it. A resumed run reads the index it started with (the
    same files in the same order, whatever the folder gained since) unless ``fresh`` (a run that
    does not resume) or the index was made from another root."""
    error = None
    if main and (fresh or FileIndex.saved_root(saved) != os.fspath(root)):
        try:
            scan_index(root).save(saved)
        except (UserError, OSError) as e:  # every process stops with the same line
            error = str(e)
    error = dist.decided_by_rank0(error)
    if error:
        raise UserError(error)
    return FileIndex.load(saved, root) if saved.is_file() else scan_index(root)


class ImageDataset(Dataset):
    """Decodes each image once and applies every view transform to it.

    ``__getitem__`` returns ``(views, label, bad)``. An unreadable file does not crash the run:
    its path goes into ``bad`` and the next readable index is used instead, so batches keep
    their size (count the paths with ``BadImageTracker``).

    The DataLoader fetches whole batches through ``__getitems__``, which the data backend
    (``backend``: a name of ``pretrain.data_backends.BACKENDS``, the config's default) runs: the
    geometric ops and the random draws per sample, seeded by ``(seed, epoch, index)``; the colour
    ops of each ``ViewTransform`` then once on the batch. A sample's views are the same whichever
    batch it is fetched in (``ds[i]`` included). Other view callables run per sample.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        views: Sequence[Callable],
        seed: int = 0,
        colour_on_device: bool = False,
        backend: str = DEFAULT_BACKEND,
        index: FileIndex | None = None,
    ):
        self.root = Path(root)
        self.views = list(views)
        # True: the colour stage is left to the consumer (``finish_views``, on the GPU): items hold
        # (uint8 crop, uniforms) per view, a quarter of the bytes of a float32 view.
        self.colour_on_device = colour_on_device
        if not self.views:
            raise ValueError("ImageDataset needs at least one view transform")
        self.backend = backend
        self.data_backend = backend_named(backend)(self.views, colour_on_device)
        self.seed = int(seed)
        # (path, label) per image, packed so that workers share it (``shared_index`` builds it once
        # per run; without one given, the folder is scanned here)
        self.samples = index if index is not None else scan_index(self.root)
        self.classes = self.samples.classes
        # Shared memory: DataLoader workers (persistent ones too) see set_epoch made in the parent.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        """Call before creating the DataLoader iterator of that epoch (see module docstring)."""
        self._epoch.fill_(int(epoch))

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[Any, int, list[str]]:
        """The image as the backend decodes it (``DataBackend.decode``), its label, and the
        unreadable files passed over to reach it."""
        bad = []
        for k in range(len(self.samples)):  # deterministic substitute: the next readable file
            path, label = self.samples[(index + k) % len(self.samples)]
            try:
                return self.data_backend.decode(path), label, bad
            except DECODE_ERRORS:
                bad.append(path)
        raise UnreadableImagesError(
            f"no readable image in {self.root} ({len(bad)} files tried, e.g. {bad[0]}); check the files or data.root"
        )

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, int, list[str]]]:
        return self.data_backend.items(self, indices)

    def __getitem__(self, index: int) -> tuple[Any, int, list[str]]:
        return self.__getitems__([index])[0]


def collate(batch) -> tuple[Any, torch.Tensor, list[str]]:
    """[(views, label, bad)] → (the batch's views, labels (B,), all bad paths), collated by the
    backend that made the samples: one B×C×H×W tensor per view; a view left for the device
    (``colour_on_device``) becomes a pair (B×C×H×W uint8 crops, B×U uniforms); encoded samples
    (``data.backend: device``) become one EncodedBatch."""
    labels = torch.tensor([item[1] for item in batch], dtype=torch.int64)
    bad = [p for item in batch for p in item[2]]
    samples = [item[0] for item in batch]
    return backend_of(samples[0]).collate(samples), labels, bad


def finish_views(
    views,
    transforms: Sequence[Callable],
    device: torch.device,
    memory_format: torch.memory_format = torch.preserve_format,
) -> list[torch.Tensor]:
    """The float32 views on ``device`` of a batch from ``collate``, made by the backend that made
    the batch (``DataBackend.finish``): what the workers would have made (bit for bit on CPU, to
    float rounding on CUDA)."""
    return backend_of(views).finish(views, transforms, device, memory_format)


def tensors_in(obj) -> Iterator[torch.Tensor]:
    """Every tensor in nested lists, tuples and dicts, their subclasses included (torch's pytree
    takes a list subclass such as a batch's ``Views`` for a leaf, and would miss its tensors)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def prefetch(batches, move: Callable, device: torch.device | None = None):
    """Yield ``move(batch)`` one batch ahead: the next batch's (non-blocking, pinned) copy to the
    device, and what ``move`` computes there, is issued before the current batch is used.

    On CUDA it runs on a stream of its own, so that it overlaps the current step: on the step's
    stream a copy, however non-blocking for the host, waits for the kernels queued before it and
    delays those after it (an H200 spent 3 to 7 ms a step so, at 224 px and batch 128). The step
    waits for the batch on the device, not on the host (the same pattern as timm's
    PrefetchLoader)."""
    cuda = device is not None and torch.device(device).type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None

    def issue(batch):
        if side is None:
            return move(batch), None
        with torch.cuda.stream(side):
            moved = move(batch)
        return moved, side.record_event()

    def ready(moved, done):
        if done is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(done)
            for tensor in tensors_in(moved):
                if tensor.is_cuda:
                    tensor.record_stream(stream)  # made on the side stream, used and freed on this one
        return moved

    iterator = iter(batches)
    try:
        ahead = issue(next(iterator))
    except StopIteration:
        return
    for batch in iterator:
        current, ahead = ahead, issue(batch)
        yield ready(*current)
    yield ready(*ahead)


# ------------------------------------------------------------------------- sampler and loader


class ShardedSampler(Sampler[int]):
    """Per-epoch permutation seeded by (seed, epoch), cut to whole global batches (MoCo's queue
    needs equal full batches), interleaved: rank r takes ``perm[r::num_replicas]``, so global
    batch j is ``perm[j·R·B:(j+1)·R·B]`` whatever the world size. ``set_epoch(e, start_batch)``
    skips the batches a resumed run already consumed; ``len()`` counts what this rank yields.
    """

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0, seed: int = 0, batch_size: int = 1):
        if num_replicas < 1 or not 0 <= rank < num_replicas or batch_size < 1:
            raise ValueError(
                f"ShardedSampler: need num_replicas ≥ 1, 0 ≤ rank < num_replicas, "
                f"batch_size ≥ 1; got {num_replicas}, {rank}, {batch_size}"
            )
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.seed, self.batch_size = seed, batch_size
        self.epoch, self.start_batch = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.n // (self.num_replicas * self.batch_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch {start_batch} outside [0, {self.batches_per_epoch}]")
        self.epoch, self.start_batch = epoch, start_batch

    def __iter__(self):
        g = torch.Generator().manual_seed(stable_seed("sampler", self.seed, self.epoch))
        kept = self.batches_per_epoch * self.num_replicas * self.batch_size
        mine = torch.randperm(self.n, generator=g)[:kept][self.rank :: self.num_replicas]
        return iter(mine[self.start_batch * self.batch_size :].tolist())

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


def build_loader(
    dataset: ImageDataset,
    batch_size_per_process: int,
    num_replicas: int = 1,
    rank: int = 0,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """DataLoader over a ShardedSampler; equal full batches on every rank (drop_last)."""
    batch = batch_size_per_process
    if len(dataset) < batch * num_replicas:
        raise TooFewImagesError(
            f"dataset {getattr(dataset, 'root', '')} has {len(dataset)} images, fewer "
            f"than one global batch (batch_size {batch} × {num_replicas} processes); "
            f"lower batch_size"
        )
    sampler = ShardedSampler(len(dataset), num_replicas, rank, seed, batch)
    # A private generator: creating an iterator would otherwise draw from the global torch RNG,
    # so a resumed run (new iterator mid-epoch) would diverge from an uninterrupted one.
    return DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        collate_fn=collate,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


def set_loader_epoch(loader: DataLoader, epoch: int, start_batch: int = 0) -> None:
    """Set the epoch on both the dataset (augmentations) and the sampler (order, resume point)."""
    loader.dataset.set_epoch(epoch)
    loader.sampler.set_epoch(epoch, start_batch)


class UnreadableImagesError(UserError, RuntimeError):
    """Images that cannot be decoded, more than the run allows (or all of them)."""


class TooFewImagesError(UserError, ValueError):
    """A dataset smaller than one global batch."""


class BadImageTracker:
    """Counts unreadable files; ``check()`` fails the run when their fraction exceeds a limit."""

    def __init__(self, max_fraction: float = 0.001):
        self.max_fraction = max_fraction
        self.bad: list[str] = []
        self.seen = 0

    def update(self, bad_paths: Sequence[str], n_images: int) -> None:
        self.bad.extend(bad_paths)
        self.seen += n_images

    @property
    def fraction(self) -> float:
        return len(self.bad) / self.seen if self.seen else 0.0

    @property
    def exceeded(self) -> bool:
        return self.fraction > self.max_fraction

    def check(self) -> None:
        if self.exceeded:
            raise UnreadableImagesError(
                f"{self.summary()}, above data.max_bad_fraction {self.max_fraction:.4%}: "
                f"{', '.join(map(printable, self.bad[:5]))}{' ...' if len(self.bad) > 5 else ''}; "
                "fix or remove them, or raise data.max_bad_fraction to skip them"
            )

    def summary(self) -> str:
        return (
            f"unreadable images: {len(self.bad)} of {self.seen} loaded ({self.fraction:.4%}; "
            f"{len(set(self.bad))} distinct files)"
        )
