"""The data backends (``data.backend``, docs/augmentation.md): what a DataLoader worker makes of a
batch of images, how its samples are collated, and what the device makes of the batch.

- ``fast`` (the default; pretrain/augment/fast.py): the reference's draws, run on uint8 with
  libjpeg-turbo, OpenCV and numba; uint8 views, normalised on the device.
- ``torchvision``: the exact reference; the workers run each ``ViewTransform`` (float32 views).
- ``device`` (pretrain/augment/on_device.py): the workers send each JPEG's bytes and the draws;
  the device decodes and augments, each image's crops by the reference's resize.
- ``device_batched``: the same, with the crops of a whole batch in a few launches (``roi_align``).

A backend is one ``DataBackend`` class, registered by its name in ``BACKENDS``: the one place a
name is turned into a pipeline. Every sample and every batch a backend makes carries that name
(``.backend``), because ``collate`` (a DataLoader's collate_fn) and ``finish_views`` (the training
loop) see the batch and not the dataset that made it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import torch
from torchvision.transforms import v2

from contrastive_transfer.images import DECODE_ERRORS, open_rgb, read_image_bytes
from contrastive_transfer.seeding import seeded_draws  # shared with the linear probe
from pretrain.augment import ViewTransform

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "DataBackend",
    "Views",
    "backend_named",
    "backend_of",
]

DEFAULT_BACKEND = "fast"  # ImageDataset's and the config's data.backend


class Views(list):
    """A sample's views, or a batch's (one entry per view), with the name of the backend that made
    them: what ``collate`` and ``finish_views`` look up in ``BACKENDS``."""

    def __init__(self, views, backend: str):
        super().__init__(views)
        self.backend = backend


def _stack(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.stack, without its copy when the rows are already the rows of one batch tensor, in
    order: what the backends hand over (the unbound output of a batched finish)."""
    base = rows[0]._base
    if base is not None and base.is_contiguous() and base.shape[0] == len(rows):
        step = base.stride(0) * base.element_size()
        if all(
            r._base is base and r.shape == base.shape[1:] and r.data_ptr() == base.data_ptr() + i * step
            for i, r in enumerate(rows)
        ):
            return base
    return torch.stack(rows)


class DataBackend(ABC):
    """One data backend. In a worker: ``decode`` reads a file, ``items`` makes a batch's samples
    (``ImageDataset.__getitems__``); ``collate`` makes them one batch; on the device ``finish``
    makes the batch's float32 views. A sample's draws are seeded by ``seeded_draws``."""

    name: ClassVar[str]

    def __init__(self, views: Sequence[Callable], colour_on_device: bool):
        self.views = list(views)
        # True: the colour stage is left to ``finish`` (on the GPU): samples hold (uint8 crop,
        # uniforms) per view, a quarter of the bytes of a float32 view.
        self.colour_on_device = colour_on_device

    @staticmethod
    def pair(crops: torch.Tensor, uniforms: torch.Tensor) -> tuple:
        """A view left for the device (data.colour_on_device), collated: (uint8 crops, uniforms)."""
        return crops, uniforms

    @abstractmethod
    def decode(self, path: str) -> Any:
        """The file decoded as ``items`` takes it; raises one of DECODE_ERRORS when unreadable."""

    @abstractmethod
    def items(self, dataset, indices: Sequence[int]) -> list[tuple[Any, int, list[str]]]:
        """Per index of ``dataset`` (an ImageDataset, which reads the files through ``decode``):
        (its views, label, the unreadable paths passed over)."""

    @abstractmethod
    def _sample(self, decoded: Any) -> Any:
        """A decoded file's random draws (and what is made of them in the worker, per sample)."""

    def _drawn(self, dataset, indices: Sequence[int]) -> tuple[list, list[int], list[list[str]]]:
        """Per index: ``_sample`` of its file, seeded by ``seeded_draws``; its label; the unreadable
        paths passed over to reach it."""
        epoch, drawn, labels, bads = dataset.epoch, [], [], []
        for index in indices:
            image, label, bad = dataset.load(int(index))
            drawn.append(seeded_draws(dataset.seed, epoch, index, self._sample, image))
            labels.append(label)
            bads.append(bad)
        return drawn, labels, bads

    def _samples(self, per_view: Sequence[Sequence], labels: list[int], bads: list[list[str]]) -> list[tuple]:
        """The batch's views, made per view, regrouped per sample: what ``items`` returns."""
        return [(Views([v[i] for v in per_view], self.name), labels[i], bads[i]) for i in range(len(labels))]

    @classmethod
    def collate(cls, samples: Sequence[Views]) -> Any:
        """The samples' views → per view one B×C×H×W tensor, or a ``pair`` for the device."""
        return Views(
            [
                cls.pair(torch.stack([c for c, _ in v]), torch.stack([u for _, u in v]))
                if isinstance(v[0], tuple)
                else _stack(v)
                for v in zip(*samples)
            ],
            cls.name,
        )

    @classmethod
    def finish(
        cls, views: Sequence, transforms: Sequence[Callable], device: torch.device, memory_format: torch.memory_format
    ) -> list[torch.Tensor]:
        """The batch's float32 views on ``device``: finished views are copied; (crops, uniforms)
        pairs are copied as uint8 and finished there (colour stage + normalisation, batched: the
        workers' views, bit for bit on CPU, to float rounding on CUDA); uint8 views are copied
        as uint8 and normalised there."""
        out = []
        for view, transform in zip(views, transforms):
            if isinstance(view, tuple):
                crops, uniforms = (t.to(device, non_blocking=True) for t in view)
                view = transform.finish(crops, uniforms)
            elif view.dtype == torch.uint8 and isinstance(transform, ViewTransform):
                x = v2.functional.to_dtype(view.to(device, non_blocking=True), torch.float32, scale=True)
                view = v2.functional.normalize(x, transform.normalize.mean, transform.normalize.std, inplace=True)
            out.append(view.to(device, non_blocking=True, memory_format=memory_format))
        return out


class TorchvisionBackend(DataBackend):
    """``data.backend: torchvision``, the exact reference: Pillow decodes, each ``ViewTransform``
    runs its geometric ops per sample, then its colour ops once on the batch (float32 views)."""

    name = "torchvision"

    def decode(self, path: str) -> torch.Tensor:
        return v2.functional.to_image(open_rgb(path))

    def _sample(self, image: torch.Tensor) -> list:
        return [t.sample(image) if isinstance(t, ViewTransform) else t(image) for t in self.views]

    def items(self, dataset, indices: Sequence[int]) -> list[tuple[Views, int, list[str]]]:
        drawn, labels, bads = self._drawn(dataset, indices)
        per_view = []
        for j, t in enumerate(self.views):
            if isinstance(t, ViewTransform) and not self.colour_on_device:
                crops, uniforms = zip(*(d[j] for d in drawn))
                per_view.append(t.finish(torch.stack(crops), torch.stack(uniforms)).unbind(0))
            else:
                per_view.append([d[j] for d in drawn])
        return self._samples(per_view, labels, bads)


class FastBackend(DataBackend):
    """``data.backend: fast`` (pretrain/augment/fast.py): the reference's draws for the same
    ``(seed, epoch, index)``, uint8 views (or, with colour_on_device, ``FastCrops`` pairs, which a
    CPU device finishes with this backend's kernels, bit for bit the workers' views)."""

    name = "fast"

    def __init__(self, views: Sequence[Callable], colour_on_device: bool):
        from pretrain.augment.fast import FastView

        super().__init__(views, colour_on_device)
        self.fast = [FastView(t) if isinstance(t, ViewTransform) else None for t in self.views]

    @staticmethod
    def pair(crops: torch.Tensor, uniforms: torch.Tensor) -> tuple:
        from pretrain.augment.fast import FastCrops

        return FastCrops(crops, uniforms)

    @classmethod
    def finish(
        cls, views: Sequence, transforms: Sequence[Callable], device: torch.device, memory_format: torch.memory_format
    ) -> list[torch.Tensor]:
        if device.type == "cpu":  # the workers' kernels, bit for bit (torch's colour ops round otherwise)
            from pretrain.augment.fast import FastView

            views = [FastView(t).finish_on_cpu(*v) if isinstance(v, tuple) else v for v, t in zip(views, transforms)]
        return super().finish(views, transforms, device, memory_format)

    def decode(self, path: str) -> np.ndarray:
        """H×W×3 uint8: libjpeg-turbo for a JPEG, Pillow for anything else."""
        from pretrain.augment.fast import decode_rgb

        image = decode_rgb(read_image_bytes(path))
        return image if image is not None else np.array(open_rgb(path))  # np.array: writable

    def _sample(self, image: np.ndarray) -> list:
        """Every view's (uint8 crop, uniforms) of a decoded image (other callables: their view)."""
        return [
            fv.sample(image) if fv is not None else t(torch.from_numpy(image).permute(2, 0, 1))
            for fv, t in zip(self.fast, self.views)
        ]

    def _draw(self, size: tuple[int, int]) -> list:
        """Every view's draws for an image of that size (FastView.draw)."""
        return [fv.draw(*size) for fv in self.fast]

    def items(self, dataset, indices: Sequence[int]) -> list[tuple[Views, int, list[str]]]:
        """Decoded, drawn, cropped per sample, then each view's colour stage over the batch."""
        if not self.colour_on_device and all(fv is not None and fv.fast_geometry and fv.crop for fv in self.fast):
            return self._items_deferred(dataset, indices)
        drawn, labels, bads = self._drawn(dataset, indices)
        per_view: list = []
        for j, fv in enumerate(self.fast):
            if fv is None:
                per_view.append([d[j] for d in drawn])
                continue
            views = fv.batch([d[j] for d in drawn], colour=not self.colour_on_device)
            if isinstance(views, tuple):
                per_view.append([self.pair(c, u) for c, u in zip(*(v.unbind(0) for v in views))])
            else:
                per_view.append(views.unbind(0))
        return self._samples(per_view, labels, bads)

    def _items_deferred(self, dataset, indices: Sequence[int]) -> list[tuple[Views, int, list[str]]]:
        """``items`` when every view is a crop (and flips) coloured in the worker, each JPEG decoded
        only when its views are made: the draws need the size alone (from the header), the batch's
        colour parameters need the draws, then per sample decode, crop and colour while its pixels
        are in cache (measured ~20 µs per view less than holding the batch's crops). The same views
        as ``items``: other files are decoded at once by ``dataset.load``; a JPEG whose data turns
        out corrupt behind a good header is replaced as ``load`` replaces it, drawn again."""
        from pretrain.augment.fast import batch_output, decode_rgb, jpeg_size

        epoch, staged, labels, bads = dataset.epoch, [], [], []
        for index in indices:
            path, label = dataset.samples[int(index) % len(dataset.samples)]
            try:
                data = read_image_bytes(path)  # the gate: a FIFO or device here is refused, not read
                size = jpeg_size(data)
            except DECODE_ERRORS:
                size = None
            bad: list[str] = []
            if size is None:  # decoded now, by load's paths (Pillow, the next file for a bad one)
                image, label, bad = dataset.load(int(index))
                staged.append((None, seeded_draws(dataset.seed, epoch, index, self._sample, image)))
            else:
                staged.append((data, seeded_draws(dataset.seed, epoch, index, self._draw, size)))
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
            except DECODE_ERRORS:
                image = None
            if image is None:  # what load gives instead, and its own draws
                image, labels[n], bads[n] = dataset.load(int(index))
                drawn = seeded_draws(dataset.seed, epoch, index, self._sample, image)
                for j, (fv, (crop, u)) in enumerate(zip(self.fast, drawn)):
                    fv.colour(crop, fv.list_params(u[None]), 0, outs[j][n].numpy())
                continue
            for j, fv in enumerate(self.fast):
                box, flip, _ = draws[j]
                fv.colour(fv.render(image, box, flip), params[j], n, outs[j][n].numpy())
        per_view = [out.unbind(0) for out in outs]
        return self._samples(per_view, labels, bads)


class DeviceBackend(DataBackend):
    """``data.backend: device`` (pretrain/augment/on_device.py): per sample an ``Encoded`` (the
    file's bytes and the draws, no pixels); the device decodes the batch and makes its views."""

    name = "device"
    geometry = "exact"  # the reference's crops one image at a time (pretrain/augment/on_device.py)

    def __init__(self, views: Sequence[Callable], colour_on_device: bool):
        from pretrain.augment.on_device import DeviceView

        super().__init__(views, colour_on_device)
        self.on_device = [DeviceView(t) for t in self.views]

    def decode(self, path: str) -> tuple[torch.Tensor, tuple[int, int]]:
        """(the JPEG's bytes, its size from the header); a decoded image and its size if no JPEG."""
        from pretrain.augment.on_device import jpeg_size

        data = read_image_bytes(path)
        size = jpeg_size(data)
        if size is not None:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), size
        image = v2.functional.to_image(open_rgb(path))
        return image, tuple(image.shape[-2:])

    def _sample(self, decoded: tuple[torch.Tensor, tuple[int, int]]) -> Any:
        """The sample's Encoded: the file as ``decode`` gives it and every view's draws, made from
        the size alone."""
        from pretrain.augment.on_device import Encoded

        data, (height, width) = decoded
        boxes, flips, uniforms = zip(*(view.sample(height, width) for view in self.on_device))
        return Encoded(data, torch.tensor(boxes), torch.tensor(flips), list(uniforms), self.name)

    def items(self, dataset, indices: Sequence[int]) -> list[tuple[Any, int, list[str]]]:
        return list(zip(*self._drawn(dataset, indices)))

    @classmethod
    def collate(cls, samples: Sequence) -> Any:
        from pretrain.augment.on_device import EncodedBatch

        return EncodedBatch.collate(samples)

    @classmethod
    def finish(
        cls, views: Any, transforms: Sequence[Callable], device: torch.device, memory_format: torch.memory_format
    ) -> list[torch.Tensor]:
        from pretrain.augment.on_device import decode_views

        views = decode_views(views, transforms, device, geometry=cls.geometry)
        return [v.to(memory_format=memory_format) for v in views]


class DeviceBatchedBackend(DeviceBackend):
    """``data.backend: device_batched``: the device backend with the crops and resizes of a whole
    batch in a few launches (``roi_align``), within a stated PSNR of the reference's antialiased
    resize instead of equal to it (docs/augmentation.md)."""

    name = "device_batched"
    geometry = "batched"


BACKENDS: dict[str, type[DataBackend]] = {
    b.name: b for b in (FastBackend, TorchvisionBackend, DeviceBackend, DeviceBatchedBackend)
}


def backend_of(views) -> type[DataBackend]:
    """The backend that made a sample's or a batch's ``views``; views made by hand (plain lists of
    tensors and pairs) are collated and finished as the reference's."""
    return BACKENDS[getattr(views, "backend", TorchvisionBackend.name)]


def backend_named(name: str) -> type[DataBackend]:
    """The backend registered as ``name``; ValueError naming the choices otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"data.backend={name!r}: expected one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
