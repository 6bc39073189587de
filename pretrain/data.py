"""Pretraining data: a robust image dataset, a resumable sharded sampler, the loader.

Reproducibility contract: the augmentation of sample ``index`` in ``epoch`` depends only on
``(seed, epoch, index)``, never on the number of workers, the rank, the batch it is fetched in
or where a run was resumed. The permutation of an epoch depends only on ``(seed, epoch)``.
Views are declared as data (``pretrain/augment/views.py``, presets in ``configs/augment/``); each is a
``ViewTransform`` (``pretrain/augment/pipeline.py``): geometric ops per sample, colour ops batched
over the DataLoader's batch with per-sample parameters.

Epochs: call ``set_loader_epoch(loader, epoch, start_batch)`` (or both ``dataset.set_epoch`` and
``sampler.set_epoch``) **before** ``iter(loader)``. DataLoader workers hold a copy of the dataset,
so the epoch lives in a shared-memory tensor that persistent workers also see; changing it while
an iterator is running would race with prefetching.

Do not pass the loader through ``accelerator.prepare``: Accelerate would replace the sampler.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, has_file_allowed_extension
from torchvision.transforms import v2

from contrastive_transfer.cli import UserError
from contrastive_transfer.contract import IMAGENET_MEAN, IMAGENET_STD
from contrastive_transfer.file_index import FileIndex
from contrastive_transfer.images import DECODE_ERRORS, open_rgb, read_image_bytes
from contrastive_transfer.paths import printable, scan_image_folder
from pretrain import dist
from pretrain.augment import ViewTransform

__all__ = [
    "eval_transform",
    "ImageDataset",
    "collate",
    "ShardedSampler",
    "build_loader",
    "set_loader_epoch",
    "BadImageTracker",
]

# open_rgb turns Pillow's errors into OSError; simplejpeg raises ValueError (the fast backend).
_DECODE_ERRORS = DECODE_ERRORS
BACKENDS = ("fast", "torchvision", "device")  # data.backend (docs/augmentation.md)


def _seed(*parts) -> int:
    """A stable 64-bit seed from a tuple (Python's hash() of str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


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
    """The folder's images as a packed index (``_scan``: ImageFolder or a flat folder)."""
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

    The DataLoader fetches whole batches through ``__getitems__``: the geometric ops and the
    random draws run per sample, seeded by ``(seed, epoch, index)``; the colour ops of each
    ``ViewTransform`` then run once on the batch. A sample's views are the same whichever batch
    it is fetched in (``ds[i]`` included). Other view callables run per sample.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        views: Sequence[Callable],
        seed: int = 0,
        colour_on_device: bool = False,
        backend: str = "torchvision",
        index: FileIndex | None = None,
    ):
        self.root = Path(root)
        self.views = list(views)
        # True: the colour stage is left to the consumer (``finish_views``, on the GPU): items hold
        # (uint8 crop, uniforms) per view, a quarter of the bytes of a float32 view.
        self.colour_on_device = colour_on_device
        if not self.views:
            raise ValueError("ImageDataset needs at least one view transform")
        if backend not in BACKENDS:
            raise ValueError(f"data.backend={backend!r}: expected one of {', '.join(BACKENDS)}")
        # "fast" (pretrain/augment/fast.py): the same draws on uint8; its views are uint8, which
        # finish_views normalises on the device. "torchvision": the exact reference, float32 views.
        # "device" (pretrain/augment/on_device.py): the workers send the JPEG bytes and the draws;
        # finish_views decodes and augments on the device.
        self.backend = backend
        self.fast = None
        if backend == "fast":
            from pretrain.augment.fast import FastView

            self.fast = [FastView(t) if isinstance(t, ViewTransform) else None for t in self.views]
        if backend == "device":
            from pretrain.augment.on_device import DeviceView

            self.on_device = [DeviceView(t) for t in self.views]
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

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, index: int) -> tuple[torch.Tensor | np.ndarray, int, list[str]]:
        """The decoded image (C×H×W uint8 tensor; H×W×3 numpy for the fast backend), its label,
        and the unreadable files passed over to reach it."""
        bad = []
        for k in range(len(self.samples)):  # deterministic substitute: the next readable file
            path, label = self.samples[(index + k) % len(self.samples)]
            try:
                return self._decode(path), label, bad
            except _DECODE_ERRORS:
                bad.append(path)
        raise UnreadableImagesError(
            f"no readable image in {self.root} ({len(bad)} files tried, e.g. {bad[0]}); check the files or data.root"
        )

    def _decode(self, path: str):
        if self.backend == "device":  # the bytes and the size from the header; Pillow if no JPEG
            from pretrain.augment.on_device import jpeg_size

            data = read_image_bytes(path)
            size = jpeg_size(data)
            if size is not None:
                return torch.frombuffer(bytearray(data), dtype=torch.uint8), size
            image = v2.functional.to_image(open_rgb(path))
            return image, tuple(image.shape[-2:])
        if self.fast is not None:
            from pretrain.augment.fast import decode_rgb

            image = decode_rgb(read_image_bytes(path))
            if image is not None:
                return image
        rgb = open_rgb(path)
        return np.array(rgb) if self.fast is not None else v2.functional.to_image(rgb)  # writable

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[list[torch.Tensor], int, list[str]]]:
        if self.fast is not None:
            return self._getitems_fast(indices)
        if self.backend == "device":
            return self._getitems_encoded(indices)
        epoch, drawn, labels, bads = int(self._epoch), [], [], []
        for index in indices:
            image, label, bad = self._load(int(index))
            # Seed per sample, isolated from the global RNG (the caller's stream is left untouched).
            # default_generator only: torch.manual_seed would also seed every accelerator (≈0.6 ms).
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(_seed("augment", self.seed, epoch, int(index)))
                drawn.append([t.sample(image) if isinstance(t, ViewTransform) else t(image) for t in self.views])
            labels.append(label)
            bads.append(bad)
        per_view = []
        for j, t in enumerate(self.views):
            if isinstance(t, ViewTransform) and not self.colour_on_device:
                crops, uniforms = zip(*(d[j] for d in drawn))
                per_view.append(t.finish(torch.stack(crops), torch.stack(uniforms)).unbind(0))
            else:
                per_view.append([d[j] for d in drawn])
        return [([v[i] for v in per_view], labels[i], bads[i]) for i in range(len(indices))]

    def _seeded(self, index: int, epoch: int, draw: Callable, *args):
        """draw(*args) with the global RNG seeded by (seed, epoch, index), the caller's stream left as
        it was (fork_rng(devices=[]) by hand: its context manager cost as much as a view's flip draws)."""
        generator = torch.default_generator
        state = generator.get_state()
        try:
            generator.manual_seed(_seed("augment", self.seed, epoch, int(index)))
            return draw(*args)
        finally:
            generator.set_state(state)

    def _fast_sample(self, image: np.ndarray) -> list:
        """Every view's (uint8 crop, uniforms) of a decoded image (other callables: their view)."""
        return [
            fv.sample(image) if fv is not None else t(torch.from_numpy(image).permute(2, 0, 1))
            for fv, t in zip(self.fast, self.views)
        ]

    def _fast_draw(self, size: tuple[int, int]) -> list:
        """Every view's draws for an image of that size (FastView.draw)."""
        return [fv.draw(*size) for fv in self.fast]

    def _getitems_fast(self, indices: Sequence[int]) -> list[tuple[list, int, list[str]]]:
        """__getitems__ of the fast backend: the same seeding and draws, uint8 views (or, with
        colour_on_device, (uint8 crop, uniforms) pairs as the reference's, marked FastCrops)."""
        if not self.colour_on_device and all(fv is not None and fv.fast_geometry and fv.crop for fv in self.fast):
            return self._getitems_fast_deferred(indices)
        from pretrain.augment.fast import FastCrops

        epoch, drawn, labels, bads = int(self._epoch), [], [], []
        for index in indices:
            image, label, bad = self._load(int(index))
            drawn.append(self._seeded(index, epoch, self._fast_sample, image))
            labels.append(label)
            bads.append(bad)
        per_view: list = []
        for j, fv in enumerate(self.fast):
            if fv is None:
                per_view.append([d[j] for d in drawn])
                continue
            views = fv.batch([d[j] for d in drawn], colour=not self.colour_on_device)
            if isinstance(views, tuple):
                per_view.append([FastCrops(c, u) for c, u in zip(*(v.unbind(0) for v in views))])
            else:
                per_view.append(views.unbind(0))
        return [([v[i] for v in per_view], labels[i], bads[i]) for i in range(len(indices))]

    def _getitems_fast_deferred(self, indices: Sequence[int]) -> list[tuple[list, int, list[str]]]:
        """The fast backend's views when every view is a crop (and flips) coloured in the worker,
        each JPEG decoded only when its views are made: the draws need the size alone (from the
        header), the batch's colour parameters need the draws, then per sample decode, crop and
        colour while its pixels are in cache (measured ~20 µs per view less than holding the
        batch's crops). The same views as the staged path: other files are decoded at once by
        ``_load``; a JPEG whose data turns out corrupt behind a good header is replaced as
        ``_load`` replaces it, with the draws made again on the replacement."""
        from pretrain.augment.fast import batch_output, decode_rgb, jpeg_size

        epoch, staged, labels, bads = int(self._epoch), [], [], []
        for index in indices:
            path, label = self.samples[int(index) % len(self.samples)]
            try:
                data = read_image_bytes(path)  # the gate: a FIFO or device here is refused, not read
                size = jpeg_size(data)
            except _DECODE_ERRORS:
                size = None
            bad: list[str] = []
            if size is None:  # decoded now, by _load's paths (Pillow, the next file for a bad one)
                image, label, bad = self._load(int(index))
                staged.append((None, self._seeded(index, epoch, self._fast_sample, image)))
            else:
                staged.append((data, self._seeded(index, epoch, self._fast_draw, size)))
            labels.append(label)
            bads.append(bad)
        params = [fv.list_params(torch.stack([draws[j][-1] for _, draws in staged])) for j, fv in enumerate(self.fast)]
        outs = [batch_output((len(indices), 3, *fv.crop.size)) for fv in self.fast]
        for n, (index, (data, draws)) in enumerate(zip(indices, staged)):
            if data is None:  # its crops are made
                for j, fv in enumerate(self.fast):
                    fv.colour(draws[j][0], params[j], n, outs[j][n].numpy())
                continue
            try:
                image = decode_rgb(data)
            except _DECODE_ERRORS:
                image = None
            if image is None:  # what _load gives instead, and its own draws
                image, labels[n], bads[n] = self._load(int(index))
                drawn = self._seeded(index, epoch, self._fast_sample, image)
                for j, (fv, (crop, u)) in enumerate(zip(self.fast, drawn)):
                    fv.colour(crop, fv.list_params(u[None]), 0, outs[j][n].numpy())
                continue
            for j, fv in enumerate(self.fast):
                box, flip, _ = draws[j]
                fv.colour(fv.render(image, box, flip), params[j], n, outs[j][n].numpy())
        per_view = [out.unbind(0) for out in outs]
        return [([v[i] for v in per_view], labels[i], bads[i]) for i in range(len(indices))]

    def _getitems_encoded(self, indices: Sequence[int]) -> list[tuple]:
        """__getitems__ of the device backend: per sample an Encoded (bytes and draws), no pixels."""
        from pretrain.augment.on_device import Encoded

        epoch, out = int(self._epoch), []
        for index in indices:
            (data, (height, width)), label, bad = self._load(int(index))
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(_seed("augment", self.seed, epoch, int(index)))
                drawn = [view.sample(height, width) for view in self.on_device]
            boxes, flips, uniforms = zip(*drawn)
            encoded = Encoded(data, torch.tensor(boxes), torch.tensor(flips), list(uniforms))
            out.append((encoded, label, bad))
        return out

    def __getitem__(self, index: int) -> tuple[list[torch.Tensor], int, list[str]]:
        return self.__getitems__([index])[0]


def _stack(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.stack, without its copy when the rows are already the rows of one batch tensor, in
    order: what ImageDataset.__getitems__ hands over (the unbound output of a batched finish)."""
    base = rows[0]._base
    if base is not None and base.is_contiguous() and base.shape[0] == len(rows):
        step = base.stride(0) * base.element_size()
        if all(
            r._base is base and r.shape == base.shape[1:] and r.data_ptr() == base.data_ptr() + i * step
            for i, r in enumerate(rows)
        ):
            return base
    return torch.stack(rows)


def collate(batch) -> tuple[list, torch.Tensor, list[str]]:
    """[(views, label, bad)] → (one B×C×H×W tensor per view, labels (B,), all bad paths). A view
    left for the device (``colour_on_device``) becomes a pair (B×C×H×W uint8 crops, B×U uniforms);
    encoded samples (``data.backend: device``) become one EncodedBatch."""
    from pretrain.augment.fast import FastCrops
    from pretrain.augment.on_device import Encoded, EncodedBatch

    labels = torch.tensor([item[1] for item in batch], dtype=torch.int64)
    bad = [p for item in batch for p in item[2]]
    if isinstance(batch[0][0], Encoded):
        return EncodedBatch.collate([item[0] for item in batch]), labels, bad
    views = [
        (torch.stack([c for c, _ in v]), torch.stack([u for _, u in v])) if isinstance(v[0], tuple) else _stack(v)
        for v in zip(*(item[0] for item in batch))
    ]
    views = [FastCrops(*v) if isinstance(v0, FastCrops) else v for v, v0 in zip(views, batch[0][0])]  # keep the mark
    return views, labels, bad


def finish_views(
    views: list,
    transforms: Sequence[Callable],
    device: torch.device,
    memory_format: torch.memory_format = torch.preserve_format,
) -> list[torch.Tensor]:
    """The batch's views on ``device``: finished views are copied; (crops, uniforms) pairs are
    copied as uint8 and finished there (colour stage + normalisation, batched), which gives the
    views the workers would have made (bit for bit on CPU, to float rounding on CUDA; the fast
    backend's pairs by its own kernels on CPU, by torch's on CUDA); uint8 views (the fast backend's)
    are copied as uint8 and normalised there; an EncodedBatch (the device backend's) is decoded
    and augmented there."""
    from pretrain.augment.on_device import EncodedBatch, decode_views

    if isinstance(views, EncodedBatch):
        return [v.to(memory_format=memory_format) for v in decode_views(views, transforms, device)]
    out = []
    from pretrain.augment.fast import FastCrops, FastView

    for view, transform in zip(views, transforms):
        if isinstance(view, FastCrops) and device.type == "cpu":  # the workers' kernels, bit for bit
            view = FastView(transform).finish_on_cpu(*view)
        if isinstance(view, tuple):
            crops, uniforms = (t.to(device, non_blocking=True) for t in view)
            view = transform.finish(crops, uniforms)
        elif view.dtype == torch.uint8 and isinstance(transform, ViewTransform):
            x = v2.functional.to_dtype(view.to(device, non_blocking=True), torch.float32, scale=True)
            view = v2.functional.normalize(x, transform.normalize.mean, transform.normalize.std, inplace=True)
        out.append(view.to(device, non_blocking=True, memory_format=memory_format))
    return out


def prefetch(batches, move: Callable):
    """Yield ``move(batch)`` one batch ahead: the next batch's (non-blocking, pinned) copy to the
    device is issued before the current batch is used, so it overlaps the current step."""
    iterator = iter(batches)
    try:
        ahead = move(next(iterator))
    except StopIteration:
        return
    for batch in iterator:
        current, ahead = ahead, move(batch)
        yield current
    yield ahead


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
        g = torch.Generator().manual_seed(_seed("sampler", self.seed, self.epoch))
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
