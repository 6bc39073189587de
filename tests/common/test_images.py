"""Every image Pillow can write, in every mode and format it writes, through every reader of the
project: the pretraining decoders (``open_rgb``, the fast backend's ``decode_rgb`` and its
fallback) and detection's (``ImageCheckingMapper``: ``check_image``, then detectron2's mapper). The cases are found
by asking Pillow which modes and formats it has, not listed, so a Pillow that adds one is tested
without an edit."""

from __future__ import annotations

import io
import itertools
import warnings

import numpy as np
import pytest
from PIL import Image

from contrastive_transfer.images import open_rgb, read_image_bytes


def _every_image_pillow_writes(folder) -> list[tuple[str, str, object]]:
    """(mode, format, path) for each mode Pillow knows and each format that saves it."""
    rng = np.random.default_rng(0)
    base = Image.fromarray(rng.integers(0, 256, (17, 23, 3), dtype=np.uint8))
    made = []
    Image.init()
    for mode, fmt in itertools.product(sorted(Image.MODES), sorted(set(Image.SAVE))):
        try:
            image = base.convert(mode)
        except ValueError:  # no conversion from RGB (e.g. the I;16 family): a blank image of the mode
            image = Image.new(mode, base.size)
        data = io.BytesIO()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                image.save(data, format=fmt)
        except (OSError, ValueError, KeyError, TypeError):  # Pillow cannot write this mode as fmt
            continue
        path = folder / f"{mode.replace(';', '_')}.{fmt.lower()}"
        path.write_bytes(data.getvalue())
        made.append((mode, fmt, path))
    return made


@pytest.mark.filterwarnings("ignore")  # Pillow and detectron2 warn about the odd modes on purpose here
def test_every_mode_and_format_pillow_writes_reads_as_pillows_rgb_or_one_line(tmp_path):
    """Each reader gives Pillow's own RGB conversion of the file (the judge: Pillow, opened
    directly), as H×W×3 uint8 (within 2 levels for a JPEG, which libjpeg-turbo decodes in the fast
    backend with its own upsampling), or one OSError line naming the file; a file Pillow writes but
    cannot read is that line from every reader. Never another error."""
    from pretrain.augment.fast import decode_rgb
    from transfer.detection.trainer import ImageCheckingMapper

    mapper = ImageCheckingMapper(is_train=False, augmentations=[], image_format="RGB")

    made = _every_image_pillow_writes(tmp_path)
    formats = {fmt for _, fmt, _ in made}
    assert {"PNG", "JPEG", "TIFF", "BMP", "GIF"} <= formats and len(made) > 60, formats  # the generator reaches them
    readers = {
        "open_rgb": lambda p: np.asarray(open_rgb(p)),
        "fast": lambda p: (lambda a: np.asarray(open_rgb(p)) if a is None else a)(decode_rgb(read_image_bytes(p))),
        "detection": lambda p: mapper({"file_name": str(p), "image_id": 0})["image"].permute(1, 2, 0).numpy(),
    }
    for mode, fmt, path in made:
        try:
            with Image.open(path) as im:
                want = np.asarray(im.convert("RGB"))
        except OSError:  # a format Pillow writes and cannot read (PDF, Palm): every reader refuses it
            want = None
        for name, read in readers.items():
            try:
                got = read(path)
            except OSError as e:
                assert "\n" not in str(e) and str(path) in str(e), (name, str(e))
                continue
            assert want is not None, (mode, fmt, name, "read what Pillow cannot")
            assert got.dtype == np.uint8 and got.shape == want.shape, (mode, fmt, name, got.shape)
            tolerance = 2 if fmt == "JPEG" and name == "fast" else 0
            diff = np.abs(got.astype(int) - want.astype(int)).max()
            assert diff <= tolerance, (mode, fmt, name, diff)
