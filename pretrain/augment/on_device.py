"""``data.backend: device``: JPEGs decoded on the device, batched (``decode_jpeg(list, device=...)``:
nvJPEG on CUDA), then the crops and the colour stage there too. The decoder is TorchCodec's where it
is installed and torchvision's otherwise (``JPEG_DECODER``): torchvision deprecated its image
decoding in 0.29 in favour of TorchCodec; both take the same batched call and give the same pixels.

The workers only read each file and its JPEG header (the size), and draw every random parameter
exactly as the reference does for the same ``(seed, epoch, index)`` (``RandomResizedCrop.make_params``
on the image size, the flips' ``torch.rand(1)``, the view's uniforms); what crosses the pipe is the
file's bytes and the draws. On the device, per batch: one batched decode, then the crops and flips
(``geometry``), then ``ViewTransform.finish`` (the colour stage and normalisation, batched). The
geometry is ``exact`` (``data.backend: device``): per image and view the reference's antialiased
``resized_crop`` on uint8, a few launches each; or ``batched`` (``data.backend: device_batched``):
every crop of the batch by ``roi_align`` on padded canvases, a few launches per batch, within a
stated PSNR of the reference (``batched_crops``). On CPU the same code runs (tests): ``exact``
gives the reference's views (libjpeg-turbo decode, the same resize and colour ops).

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

__all__ = [
    "Encoded",
    "EncodedBatch",
    "DeviceView",
    "jpeg_size",
    "decode_images",
    "exact_crops",
    "batched_crops",
    "padded_canvas",
    "size_groups",
    "decode_views",
    "JPEG_DECODER",
    "jpeg_decoders",
]

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
    backend: str = "device"  # the data backend that made it (pretrain/data_backends.py)


class EncodedBatch(NamedTuple):
    """A collated batch of Encoded samples (what ``finish_views`` decodes on the device)."""

    data: list[torch.Tensor]
    boxes: torch.Tensor  # B×V×4
    flips: torch.Tensor  # B×V×2
    uniforms: list[torch.Tensor]  # per view, B×U
    backend: str = "device"  # the data backend that made it (pretrain/data_backends.py)

    @staticmethod
    def collate(items: Sequence[Encoded]) -> EncodedBatch:
        return EncodedBatch(
            [e.data for e in items],
            torch.stack([e.boxes for e in items]),
            torch.stack([e.flips for e in items]),
            [torch.stack(u) for u in zip(*(e.uniforms for e in items))],
            items[0].backend,
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


def decode_images(batch: EncodedBatch, device: torch.device, decoder: str | None = None) -> list[torch.Tensor]:
    """The batch's C×H×W uint8 RGB images on ``device``: its JPEGs in one batched decode
    (``decoder``: a name of ``jpeg_decoders``, default ``JPEG_DECODER``), the rest copied."""
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
    return images


def exact_crops(images: Sequence[torch.Tensor], boxes: list, flips: list, crop_op: v2.RandomResizedCrop, v: int):
    """View ``v``'s B×C×h×w uint8 crops, one image at a time: the reference's antialiased
    ``resized_crop``, then the flips (``data.backend: device``)."""
    crops = []
    for i, image in enumerate(images):
        top, left, height, width = boxes[i][v]
        crop = TF.resized_crop(
            image, top, left, height, width, list(crop_op.size), interpolation=crop_op.interpolation, antialias=True
        )
        hflip, vflip = flips[i][v]
        dims = [d for d, on in ((-1, hflip), (-2, vflip)) if on]
        crops.append(crop.flip(dims) if dims else crop)
    return torch.stack(crops)


def size_groups(shapes: Sequence[tuple[int, int]], waste: float = 2.0, limit: int = 2**27) -> list[list[int]]:
    """The images' indices in groups whose padded canvas (count × the largest height × the largest
    width, × 3 channels) is at most ``waste`` times the group's own pixels and at most ``limit``
    values (one image alone may exceed it): a batch of mixed sizes, or one panorama, cannot make
    the canvas of the whole batch many times its pixels. Sorted by size, so similar sizes group."""
    groups: list[list[int]] = []
    group: list[int] = []
    height = width = pixels = 0  # the current group's largest sides and its pixels
    for i in sorted(range(len(shapes)), key=lambda i: shapes[i]):
        h, w = shapes[i]
        padded = (len(group) + 1) * max(height, h) * max(width, w)
        if group and (padded > waste * (pixels + h * w) or 3 * padded > limit):
            groups.append(group)
            group, height, width, pixels = [], 0, 0, 0
        group.append(i)
        height, width, pixels = max(height, h), max(width, w), pixels + h * w
    return groups + [group] if group else groups


def padded_canvas(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """G×C×H×W float32: each C×h×w uint8 image in the top-left corner of a canvas of the largest
    sides, its last row and column repeated over the padding (what the reference's resize does
    past an edge: roi_align's bilinear samples reach half a pixel beyond the last pixel centre).
    One concatenation and one gather whatever the number of images (a copy per image would be a
    launch per image, the cost this path removes)."""
    device = images[0].device
    shapes = torch.tensor([im.shape for im in images])
    offsets = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
    # small host tensors, copied without waiting for the device (pageable memory is staged at once)
    offsets, h, w = (t.to(device, non_blocking=True).reshape(-1, 1, 1, 1) for t in (offsets, *shapes[:, 1:].T))
    channel = torch.arange(int(shapes[0, 0]), device=device).reshape(1, -1, 1, 1)
    y = torch.arange(int(shapes[:, 1].max()), device=device).reshape(1, 1, -1, 1)
    x = torch.arange(int(shapes[:, 2].max()), device=device).reshape(1, 1, 1, -1)
    # G×C×H×1 plus G×1×1×W: the one full-size index is made by the last addition
    index = offsets + channel * (h * w) + torch.minimum(y, h - 1) * w + torch.minimum(x, w - 1)
    flat = torch.cat([im.reshape(-1) for im in images]).to(torch.float32)
    return flat[index]


def batched_crops(images: Sequence[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, sizes: Sequence):
    """Per view, the B×C×h×w float32 crops (in [0, 1]) of a whole batch in a few launches
    (``data.backend: device_batched``): the images padded into canvases of similar sizes
    (``size_groups``, ``padded_canvas``), every view's boxes resized by one ``roi_align`` per canvas
    and view, then the flips as a batched select. ``roi_align`` averages ceil(box side / output
    side) bilinear samples per output pixel and axis (its adaptive sampling ratio): a box filter
    close to the reference's antialiased triangle filter (PSNR in docs/augmentation.md), and
    bilinear interpolation, the reference's, where the crop is enlarged. ``boxes`` B×V×4
    (top, left, height, width) and ``flips`` B×V×2 (horizontal, vertical) are on the host."""
    from torchvision.ops import roi_align

    device = images[0].device
    out = [torch.empty((len(images), images[0].shape[0], *size), device=device) for size in sizes]
    for group in size_groups([tuple(im.shape[-2:]) for im in images]):
        canvas = padded_canvas([images[i] for i in group])
        rows = torch.tensor(group)
        for v, size in enumerate(sizes):
            top, left, height, width = boxes[rows, v].to(torch.float32).unbind(1)
            rois = torch.stack([torch.arange(len(group)), left, top, left + width, top + height], dim=1)
            crops = roi_align(canvas, rois.to(device, non_blocking=True), list(size), sampling_ratio=-1, aligned=True)
            out[v].index_copy_(0, rows.to(device, non_blocking=True), crops)
    for v, view in enumerate(out):
        for axis, dim in ((0, -1), (1, -2)):  # horizontal: the width; vertical: the height
            if flips[:, v, axis].any():
                flip = flips[:, v, axis].to(device, non_blocking=True).reshape(-1, 1, 1, 1)
                view = torch.where(flip, view.flip(dim), view)
        out[v] = view.div_(255)
    return out


def decode_views(
    batch: EncodedBatch,
    transforms: Sequence[ViewTransform],
    device: torch.device,
    decoder: str | None = None,
    geometry: str = "exact",
) -> list[torch.Tensor]:
    """The normalised float32 views of a batch, decoded (``decoder``: a name of ``jpeg_decoders``,
    default ``JPEG_DECODER``) and augmented on ``device``. ``geometry``: ``exact``, the reference's
    crops one image at a time; ``batched``, all crops of the batch in a few launches
    (``batched_crops``), for the views that resize bilinearly (the others take the exact path)."""
    if geometry not in ("exact", "batched"):
        raise ValueError(f"geometry={geometry!r}: expected exact or batched")
    images = decode_images(batch, device, decoder)
    crop_ops = [next(op for op in t.geometric if isinstance(op, v2.RandomResizedCrop)) for t in transforms]
    bilinear = [v for v, op in enumerate(crop_ops) if op.interpolation == v2.InterpolationMode.BILINEAR]
    crops: dict[int, torch.Tensor] = {}
    if geometry == "batched" and bilinear:
        sizes = [crop_ops[v].size for v in bilinear]
        crops = dict(zip(bilinear, batched_crops(images, batch.boxes[:, bilinear], batch.flips[:, bilinear], sizes)))
    boxes, flips = batch.boxes.tolist(), batch.flips.tolist()
    views = []
    for v, transform in enumerate(transforms):
        view_crops = crops[v] if v in crops else exact_crops(images, boxes, flips, crop_ops[v], v)
        views.append(transform.finish(view_crops, batch.uniforms[v].to(device, non_blocking=True)))
    return views
