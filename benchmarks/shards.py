"""Reading one epoch of images from tar shards against the same images as a folder, on this machine.

    python -m benchmarks.shards [--images 4000] [--side 320] [--shard-size 500] [--out benchmarks/shards.md]

Writes an ImageFolder of ``--images`` JPEGs (10 classes, ``--side`` px, smooth random content: about
the bytes of an ImageNet photo at that side), writes it as shards with ``python -m transfer.shards``,
and then, per layout, reads every image's bytes once in a training epoch's order (the sampler's
permutation) as the data backends do (``read_image_bytes``, through the gate): images and MiB per
second, and the files opened (``os.open`` calls: the gate opens every file it reads). "Cold" evicts
the files from the page cache first (``posix_fadvise(DONTNEED)``, which needs no privilege), so the
disk is read; "warm" reads them again from the cache. It also times what each layout costs before
the first epoch: the folder's scan against one pass over the shards' headers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks import cpu_name
from contrastive_transfer import members
from contrastive_transfer.cli import atomic_write, write_text
from contrastive_transfer.images import read_image_bytes
from contrastive_transfer.shards import index_shards
from pretrain.data import ShardedSampler, scan_index
from transfer import shards as write_shards


def write_folder(root: Path, images: int, side: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(images):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        small = rng.integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)  # upscaled: photo-like bytes
        image = Image.fromarray(small).resize((side, side), Image.BILINEAR)
        atomic_write(folder / f"{i:07d}.JPEG", lambda f, im=image: im.save(f, format="JPEG", quality=90))


def evict(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # files it wrote itself; never through a link
        try:
            os.fdatasync(fd)  # written pages are dropped only once on disk
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _CountOpens:
    """Counts ``os.open`` calls while active (the gate's ``open_untrusted`` opens with it)."""

    def __enter__(self):
        self.count, self._open = 0, os.open

        def counting(*args, **kwargs):
            self.count += 1
            return self._open(*args, **kwargs)

        os.open = counting
        return self

    def __exit__(self, *exc):
        os.open = self._open


def epoch(index, files: list[str], cold: bool) -> dict:
    """One epoch's reads in the sampler's order: seconds, images, bytes, files opened."""
    members.forget(index.shards)  # a process's first epoch: no shard open yet
    if cold:
        evict(files)
    order = list(ShardedSampler(len(index), seed=0))
    total = 0
    with _CountOpens() as opens:
        t = time.perf_counter()
        for i in order:
            total += len(read_image_bytes(index[i][0]))
        seconds = time.perf_counter() - t
    return {"seconds": seconds, "images": len(order), "bytes": total, "opens": opens.count}


def measure(images: int, side: int, shard_size: int, tmp: Path) -> dict:
    folder, out = tmp / "train", tmp / "shards"
    write_folder(folder, images, side)
    write_shards.main([str(folder), str(out), "--shard-size", str(shard_size)])
    t = time.perf_counter()
    folder_index = scan_index(folder)
    scan_s = time.perf_counter() - t
    t = time.perf_counter()
    shard_index = index_shards(out / "train").index
    index_s = time.perf_counter() - t
    folder_files = [path for path, _ in folder_index]
    results = {}
    for name, index, files in [("folder", folder_index, folder_files), ("shards", shard_index, shard_index.shards)]:
        epoch(index, files, cold=False)  # a first pass: the interpreter's and the allocator's warm-up
        for cache in ("cold", "warm"):
            results[(name, cache)] = epoch(index, files, cold=cache == "cold")
    return {
        "images": images,
        "side": side,
        "shard_size": shard_size,
        "shards": len(shard_index.shards),
        "mib": sum(os.path.getsize(p) for p in folder_files) / 2**20,
        "scan_s": scan_s,
        "index_s": index_s,
        "results": results,
        "fs": _filesystem(tmp),
    }


def _filesystem(path: Path) -> str:
    best = ("", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fs, *_ = line.split()
        if str(path.resolve()).startswith(mount) and len(mount) >= len(best[0]):
            best = (mount, fs)
    return best[1]


def report(m: dict) -> str:
    rows = []
    for (name, cache), r in m["results"].items():
        rate, mib_s = r["images"] / r["seconds"], r["bytes"] / 2**20 / r["seconds"]
        rows.append(f"| {name} | {cache} | {r['seconds']:.2f} | {rate:,.0f} | {mib_s:.0f} | {r['opens']:,} |")
    return "\n".join(
        [
            "# Reading an epoch from tar shards against the same images as a folder",
            "",
            f"`python -m benchmarks.shards --images {m['images']} --side {m['side']} --shard-size {m['shard_size']}`; "
            f"{cpu_name()}, {os.cpu_count()} cores, temporary files on {m['fs']}, torch {torch.__version__}. "
            f"{m['images']:,} JPEGs of {m['side']}×{m['side']} px ({m['mib']:.0f} MiB) in 10 class folders, and "
            f"the same as {m['shards']} shards of {m['shard_size']}. One process reads every image's bytes once "
            "in an epoch's order (the sampler's permutation), through the gate; one run, on a machine shared "
            "with other jobs: the times are one measurement, the counts exact.",
            "",
            "| layout | page cache | epoch (s) | images/s | MiB/s | files opened |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Before the first epoch the folder is scanned in {m['scan_s']:.2f} s; the shards' headers are "
            f"read into the index in {m['index_s']:.2f} s ({1e6 * m['index_s'] / m['images']:.0f} µs an image, "
            f"two members each: about {m['index_s'] / m['images'] * 1_281_167 / 60:.0f} min for ImageNet's "
            "1.28 M, pure-Python tar headers; pretraining does this once per run in its main process and "
            "the other processes and a resumed run read the saved index). "
            "A folder opens one file per image per epoch; shards open each shard once per process "
            "(each DataLoader worker opens the shards it reads once, and keeps them open: "
            "`contrastive_transfer/members.py`), so an epoch of ImageNet in 1,024 shards opens 1,024 files "
            "per worker instead of 1,281,167. The random order reads the shards at random offsets: the "
            "gain is in opens and metadata lookups (what network and parallel file systems charge for), "
            "not in sequential bandwidth.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--side", type=int, default=320)
    p.add_argument("--shard-size", type=int, default=500)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("shards.md"))
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        text = report(measure(a.images, a.side, a.shard_size, Path(tmp)))
    write_text(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
