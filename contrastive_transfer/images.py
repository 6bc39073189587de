"""Decoding images from files others made: one pixel limit, one kind of error (docs/security.md).

A 69-byte PNG header can claim 10^10 pixels. Pillow guards with ``Image.MAX_IMAGE_PIXELS`` (a
warning above it, ``DecompressionBombError``, which is no ``OSError``, above twice it); the limit
is set here, once, for every process that imports this module (the evaluators, pretraining and
detection, whose processes import it through ``transfer.detection.datasets``), and ``open_rgb``
refuses anything above it from the header alone, before a pixel is decoded.

Pixels are not the whole cost: Pillow stores a 16-bit or 4-band image at 2 or 4 bytes per pixel,
and the RGB conversion is a second image beside the decoded one (a 16-bit RGBA PNG at the pixel
limit decodes to 1 GiB and converts to another). ``check_decoded_bytes`` bounds what the mode and
size need, decoded and converted together, by ``MAX_DECODED_BYTES`` (what the fast backend's RGB
decode of an image at the pixel limit needs), before decoding.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from PIL import Image

from contrastive_transfer.members import Member, read_member
from contrastive_transfer.untrusted import UnsafeFileError, open_untrusted, read_untrusted

# 2^28 ≈ 268 M pixels: a 16k × 16k image; any real photo dataset is far below.
MAX_IMAGE_PIXELS = 1 << 28
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

# 768 MiB: an 8-bit RGB image at the pixel limit as one H x W x 3 array (the fast backend's decode).
MAX_DECODED_BYTES = 3 * MAX_IMAGE_PIXELS
RGB_STORAGE = 4  # bytes per pixel of Pillow's RGB image (stored as 32-bit pixels)

# What Pillow raises for a file it cannot decode (UnidentifiedImageError and truncation are OSErrors).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


@contextmanager
def decoding(path: str | os.PathLike) -> Iterator[None]:
    """What a decoder raises for ``path`` (one of DECODE_ERRORS) as the one-line OSError ``cannot
    read image PATH: reason``: Pillow's own errors do not name the file (an EPS without
    Ghostscript: "Unable to locate Ghostscript on paths")."""
    try:
        yield
    except DECODE_ERRORS as e:
        reason = e.reason if isinstance(e, UnsafeFileError) else " ".join(str(e).split()) or type(e).__name__
        raise OSError(f"cannot read image {path}: {reason}") from None


@contextmanager
def _opened(path: str | os.PathLike, extra_per_pixel: int = 0) -> Iterator[Image.Image]:
    """The image opened through the gate, its pixel count checked from the header (nothing is
    decoded yet); whatever fails here or in the caller's decoding is OSError ``cannot read image
    PATH: reason`` (one line)."""
    with decoding(path), _image_file(path) as f, Image.open(f) as im:
        check_pixels(im.width, im.height)
        check_decoded_bytes(im.width, im.height, im.mode, extra_per_pixel)
        yield im


@contextmanager
def _image_file(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """The image's file through the gate: a member of a tar shard (``Member``) is read from it."""
    if isinstance(path, Member):
        yield io.BytesIO(read_member(path))
    else:
        with open_untrusted(path, "image") as f:
            yield f


def open_rgb(path: str | os.PathLike) -> Image.Image:
    """The decoded RGB image; OSError ``cannot read image PATH: reason`` (one line) otherwise.
    The file goes through the gate (a regular file within the image cap: a FIFO in a class folder
    is refused, not waited on), and the pixel count and the bytes decoding needs are read from the
    header before decoding."""
    with _opened(path) as im:
        if im.mode == "RGB":  # decoded in place: convert() would copy it
            im.load()
            return im
        return im.convert("RGB")  # convert() decodes


def check_image(path: str | os.PathLike) -> tuple[int, int]:
    """For decoders that open the file themselves (detectron2's ``read_image``): the same gate
    and header check as ``open_rgb``, the same one-line OSError, without decoding; the image's
    (width, height). Pillow's own guard only warns up to twice its limit and then raises an error
    that is no OSError. detectron2 converts the image and copies it into an array (3 bytes a pixel)."""
    with _opened(path, extra_per_pixel=3) as im:
        return im.size


def check_pixels(width: int, height: int) -> None:
    """The one pixel limit, for any decoder, from the image's header (Pillow's size, simplejpeg's
    ``decode_jpeg_header``): Image.DecompressionBombError (one of DECODE_ERRORS) above it."""
    if width * height > MAX_IMAGE_PIXELS:
        raise Image.DecompressionBombError(
            f"its header claims {width}x{height} pixels, above the limit of {MAX_IMAGE_PIXELS}"
        )


def _storage(mode: str) -> int:
    """Bytes per pixel of Pillow's image in ``mode``: one byte for 1, L and P, two for the 16-bit
    integer modes, four for every other (multi-band modes are stored as 32-bit pixels, I and F as
    32-bit numbers). Pillow exposes no such table: this follows its storage (libImaging/Storage.c)."""
    if mode in ("1", "L", "P"):
        return 1
    return 2 if mode.startswith("I;16") else 4


def check_decoded_bytes(width: int, height: int, mode: str, extra_per_pixel: int = 0) -> None:
    """The bytes decoding (in ``mode``) and the RGB conversion beside it need, plus
    ``extra_per_pixel`` bytes of the caller's own copy, within MAX_DECODED_BYTES:
    Image.DecompressionBombError (one of DECODE_ERRORS) above it, before decoding."""
    per_pixel = _storage(mode) + (0 if mode == "RGB" else RGB_STORAGE) + extra_per_pixel
    if width * height * per_pixel > MAX_DECODED_BYTES:
        raise Image.DecompressionBombError(
            f"its header claims {width}x{height} pixels of mode {mode}, which decoding and its RGB conversion "
            f"need {width * height * per_pixel} bytes for, above the limit of {MAX_DECODED_BYTES}"
        )


def read_image_bytes(path: str | os.PathLike) -> bytes:
    """An image file's bytes through the gate (for decoders that take bytes, such as simplejpeg):
    UnsafeFileError (a ValueError, one of DECODE_ERRORS) for a special file or one above the cap.
    A member of a tar shard (``Member``) is read from its shard."""
    return read_member(path) if isinstance(path, Member) else read_untrusted(path, "image")
