"""An ImageFolder of ImageNet-like JPEGs for timing a real-size step, fast to make on a new machine.

    python -m benchmarks.jpeg_folder OUT [--unique 32] [--images 8192] [--classes 8]

``--unique`` textured JPEGs of ImageNet's sides and bytes (``benchmarks.data.write_images``: sides
350–460 px, ~110 KB, the slow part: ~0.3 s each), then ``--images`` entries in ``--classes`` class
folders that are hard links to them, so that an epoch is long enough for a timed window (every epoch
ends in a checkpoint) without generating thousands of images. The decoders see real JPEG bytes; the
page cache holds the few distinct files, as a node's memory holds a hot dataset.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.data import write_images


def make_folder(out: Path, unique: int, images: int, classes: int) -> Path:
    if out.exists():
        raise SystemExit(f"error: {out} exists; remove it or choose another folder")
    out.mkdir(parents=True)
    entries = [out / f"class{i % classes:03d}" / f"{i:07d}.JPEG" for i in range(images)]
    with tempfile.TemporaryDirectory() as tmp:
        photos, _ = write_images(Path(tmp), unique)  # the light variant it also writes is not used
        for path, entry in zip(photos, entries):
            entry.parent.mkdir(exist_ok=True)
            shutil.move(str(path), entry)
    for i, entry in enumerate(entries[unique:], start=unique):
        entry.parent.mkdir(exist_ok=True)
        os.link(entries[i % unique], entry)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.jpeg_folder", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--unique", type=int, default=32)
    parser.add_argument("--images", type=int, default=8192)
    parser.add_argument("--classes", type=int, default=8)
    args = parser.parse_args(argv)
    make_folder(args.out, args.unique, args.images, args.classes)
    print(f"wrote {args.images} entries ({args.unique} distinct JPEGs) in {args.classes} classes under {args.out}")


if __name__ == "__main__":
    main()
