"""``data.backend: device``: JPEGs decoded on the device, batched (``decode_jpeg(list, device=...)``:
nvJPEG on CUDA), then the crops and the colour stage there too. The decoder is TorchCodec's where it
is installed and torchvision's otherwise (``JPEG_DECODER``): torchvision deprecated its image
decoding in 0.29 in favour of TorchCodec; both take the same batched call and give the same pixels.

The workers only read each file and its JPEG header (the size), and draw every random parameter
exactly as the reference does for the same ``(seed, epoch, index)`` (``RandomResizedCrop.make_params``
on the image size, the flips' ``torch.rand(1)``, the view's uniforms); what crosses the pipe is the
file's bytes and the draws. On the device, per batch: one batched decode, per image and view the
reference's antialiased ``resized_crop`` on uint8 and the flips, then ``ViewTransform.finish`` (the
colour stage and normalisation, batched). On CPU the same code runs (tests): it gives the
reference's views (libjpeg-turbo decode, the same resize and colour ops).

Only views whose geometric ops are a crop followed by flips can run this way (what the presets
declare). Images that are not JPEGs (or CMYK JPEGs) are decoded by the worker with Pillow and sent
decoded. A JPEG whose header reads but whose data is corrupt fails the run at the device decode
(the fast and torchvision backends skip it as an unreadable file).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, NamedTuple, Sequence

import torch
from torchvision.io import ImageReadMode
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from pretrain.augment.fast import FastView
from pretrain.augment.pipeline import ViewTransform

__all__ = ["Encoded", "EncodedBatch", "DeviceView", "jpeg_size", "decode_views", "JPEG_DECODER", "jpeg_decoders"]

Decoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


def _torchvision_decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import decode_jpeg

    with warnings.catch_warnings():  # deprecated for TorchCodec, which is used whenever installed
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


@functools.cache
def jpeg_decoders() -> dict[str, Decoder]:
    """The batched RGB JPEG decoders available here, preferred first: TorchCodec, then torchvision."""
    decoders: dict[str, Decoder] = {}
    try:
        from torchcodec.decoders import decode_jpeg as codec_decode

        decoders["torchcodec"] = lambda data, device: codec_decode(data, mode="RGB", device=device)
    except Exception:  # not installed, or its native library does not load beside this torch
        pass
    decoders["torchvision"] = _torchvision_decode
    return decoders


JPEG_DECODER: str = next(iter(jpeg_decoders()))


class Encoded(NamedTuple):
    """One sample out of a worker: the file (1-D uint8 bytes; or a decoded C×H×W uint8 image when
    it is no JPEG) and, per view, its crop box (top, left, height, width), flips and uniforms."""

    data: torch.Tensor
    boxes: torch.Tensor  # V×4 int64
    flips: torch.Tensor  # V×2 bool: horizontal, vertical
    uniforms: list[torch.Tensor]
    backend = "device"  # the data backend that made it (pretrain/data_backends.py)


class EncodedBatch(NamedTuple):
    """A collated batch of Encoded samples (what ``finish_views`` decodes on the device)."""

    data: list[torch.Tensor]
    boxes: torch.Tensor  # B×V×4
    flips: torch.Tensor  # B×V×2
    uniforms: list[torch.Tensor]  # per view, B×U
    backend = "device"  # the data backend that made it (pretrain/data_backends.py)

    @staticmethod
    def collate(items: Sequence[Encoded]) -> EncodedBatch:
        return EncodedBatch(
            [e.data for e in items],
            torch.stack([e.boxes for e in items]),
            torch.stack([e.flips for e in items]),
            [torch.stack(u) for u in zip(*(e.uniforms for e in items))],
        )


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG's header, or None when ``data`` is no JPEG libjpeg-turbo can
    turn into RGB. Raises ValueError on a corrupt header or one above the pixel limit."""
    import simplejpeg

    from contrastive_transfer.images import MAX_IMAGE_PIXELS

    if not simplejpeg.is_jpeg(data):
        return None
    height, width, colourspace, _ = simplejpeg.decode_jpeg_header(data)
    if height * width > MAX_IMAGE_PIXELS:
        raise ValueError(f"its header claims {width}x{height} pixels, above the limit of {MAX_IMAGE_PIXELS}")
    return (height, width) if colourspace in ("Gray", "YCbCr", "RGB") else None


class DeviceView:
    """The draws of one view, made from the image size alone."""

    def __init__(self, transform: ViewTransform):
        fast = FastView(transform)
        if not fast.fast_geometry or fast.crop is None:
            raise ValueError(
                "data.backend=device: each view must start with crop and have no geometric op but "
                f"flips after it; got {[type(op).__name__ for op in transform.geometric]}"
            )
        self.transform, self.crop, self.flips = transform, fast.crop, fast.flips

    def sample(self, height: int, width: int) -> tuple[list[int], list[bool], torch.Tensor]:
        """(box, [hflip, vflip], uniforms) from the global RNG, the draws of ViewTransform.sample."""
        shape_only = torch.empty(1, dtype=torch.uint8).expand(3, height, width)  # make_params reads the size
        box = self.crop.make_params([shape_only])
        flip = [False, False]  # horizontal, vertical
        for axis, p in self.flips:
            if not bool(torch.rand(1) >= p):
                flip[1 - axis] = not flip[1 - axis]
        u = torch.rand(self.transform.n_uniforms)
        return [box["top"], box["left"], box["height"], box["width"]], flip, u


def decode_views(
    batch: EncodedBatch, transforms: Sequence[ViewTransform], device: torch.device, decoder: str | None = None
) -> list[torch.Tensor]:
    """The normalised float32 views of a batch, decoded (``decoder``: a name of ``jpeg_decoders``,
    default ``JPEG_DECODER``) and augmented on ``device``."""
    jpegs = [i for i, d in enumerate(batch.data) if d.dim() == 1]
    images: list[torch.Tensor] = [d.to(device, non_blocking=True) if d.dim() == 3 else d for d in batch.data]
    if jpegs:  # one batched call: nvJPEG decodes the batch together
        if device.type == "cuda":
            # torchvision's CUDA decoder allocates its outputs on the current stream but decodes on
            # a stream of its own that does not wait for it: a block freed by kernels still queued
            # here could be written under them (pytorch/vision#9606). Nothing may be in flight.
            torch.cuda.current_stream(device).synchronize()
        decode = jpeg_decoders()[decoder or JPEG_DECODER]
        decoded = decode([batch.data[i] for i in jpegs], device)
        for i, image in zip(jpegs, decoded):
            images[i] = image
    boxes, flips = batch.boxes.tolist(), batch.flips.tolist()
    views = []
    for v, transform in enumerate(transforms):
        crop_op = next(op for op in transform.geometric if isinstance(op, v2.RandomResizedCrop))
        crops = []
        for i, image in enumerate(images):
            top, left, height, width = boxes[i][v]
            crop = TF.resized_crop(
                image, top, left, height, width, list(crop_op.size), interpolation=crop_op.interpolation, antialias=True
            )
            hflip, vflip = flips[i][v]
            dims = [d for d, on in ((-1, hflip), (-2, vflip)) if on]
            crops.append(crop.flip(dims) if dims else crop)
        views.append(transform.finish(torch.stack(crops), batch.uniforms[v].to(device, non_blocking=True)))
    return views
