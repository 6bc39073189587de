"""What an ImageNet-sized file list costs each loader worker: a list of ``(path, label)`` tuples (the
reference, what torchvision's ImageFolder holds) against the packed ``FileIndex``; and the same for
the linear probe's Places205 list, read from a list file by ``transfer.datasets.readers``.

    python -m benchmarks.file_index [--entries 1281167] [--places205 2448873] [--workers 2]
                                    [--out benchmarks/file_index.md]

No images are written: the names follow ImageNet's (``n01440764/n01440764_10026.JPEG``, 1000
classes). Per layout it reports the build time (from the sample list a folder scan returns), the
save and load time of the packed index, the parent's memory for the list, and the private memory
(USS: pages no other process shares) each DataLoader worker gained after one pass over every entry,
which is what 8 workers × 8 ranks multiply on a node.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks import cpu_name
from contrastive_transfer.cli import write_text
from contrastive_transfer.file_index import FileIndex

IMAGENET_TRAIN = 1_281_167
PLACES205_TRAIN = 2_448_873


def imagenet_like_samples(n: int, root: str = "/data/imagenet/train") -> list[tuple[str, int]]:
    """``n`` (absolute path, label) pairs named like ImageNet's training set."""
    per_class = -(-n // 1000)
    return [
        (f"{root}/n{1440764 + c:08d}/n{1440764 + c:08d}_{i}.JPEG", c) for c in range(1000) for i in range(per_class)
    ][:n]


class _Pass(Dataset):
    """Item i reads entry i of the file list (as a dataset's __getitem__ does), nothing else; the
    last item of each worker reports that worker's private memory."""

    def __init__(self, samples, workers: int):
        self.samples, self.workers = samples, workers

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        return len(path) + label

    def __getitems__(self, indices):
        out = [self[i] for i in indices]
        return out


def uss_mib(pid: int | None = None) -> float:
    return psutil.Process(pid).memory_full_info().uss / 2**20


def worker_growth(samples, workers: int, batch: int = 4096) -> list[float]:
    """MiB of private memory each of ``workers`` forked workers gained over one pass."""
    loader = DataLoader(
        _Pass(samples, workers),
        batch_size=batch,
        num_workers=workers,
        collate_fn=lambda items: sum(items),
        multiprocessing_context="fork",
        persistent_workers=True,
        prefetch_factor=1,
    )
    it = iter(loader)
    next(it)  # workers started and past their first batch
    pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    start = {pid: uss_mib(pid) for pid in pids}
    for _ in it:
        pass
    growth = [uss_mib(pid) - start[pid] for pid in pids]
    del it, loader
    return growth


def measure(entries: int, workers: int) -> dict:
    as_list = imagenet_like_samples(entries)  # what a folder scan returns
    # the list, its tuples and their strings (the labels are small ints, shared by the interpreter)
    list_mib = (sys.getsizeof(as_list) + sum(sys.getsizeof(t) + sys.getsizeof(t[0]) for t in as_list)) / 2**20
    t = time.perf_counter()
    classes = [f"n{1440764 + c:08d}" for c in range(1000)]
    index = FileIndex.from_samples("/data/imagenet/train", as_list, classes)
    build_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        index.save(Path(tmp) / "file_index.npz")
        save_s = time.perf_counter() - t
        t = time.perf_counter()
        loaded = FileIndex.load(Path(tmp) / "file_index.npz", "/data/imagenet/train")
        load_s = time.perf_counter() - t
    assert loaded[entries - 1] == as_list[-1]
    packed_mib = (index.blob.nbytes + index.offsets.nbytes + index.labels.nbytes) / 2**20
    return {
        "entries": entries,
        "list_mib": list_mib,
        "packed_mib": packed_mib,
        "build_s": build_s,
        "save_s": save_s,
        "load_s": load_s,
        "list_worker_mib": worker_growth(as_list, workers),
        "packed_worker_mib": worker_growth(index, workers),
    }


def report(m: dict, workers: int) -> str:
    lw, pw = m["list_worker_mib"], m["packed_worker_mib"]
    return "\n".join(
        [
            "# An ImageNet-sized file index: what each loader worker copies",
            "",
            f"`python -m benchmarks.file_index --entries {m['entries']} --workers {workers}`; {cpu_name()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}. One run, on a machine shared with other jobs: "
            "the figures are memory sizes, not timings, and do not vary between runs beyond a few pages; "
            "times are one measurement.",
            "",
            "| layout | held by the process (MiB) | each worker's private growth after one pass (MiB) |",
            "|---|---|---|",
            f"| list of (path, label) tuples (reference) | {m['list_mib']:.0f} | "
            + ", ".join(f"{x:.1f}" for x in lw)
            + " |",
            f"| packed `FileIndex` | {m['packed_mib']:.0f} | " + ", ".join(f"{x:.1f}" for x in pw) + " |",
            "",
            f"Packing {m['entries']:,} entries takes {m['build_s']:.2f} s after the folder scan; saving the "
            f"index takes {m['save_s']:.2f} s and loading it (with its checks) {m['load_s']:.2f} s, which is "
            "what the other processes of a run pay instead of scanning the folder themselves. Per worker the "
            f"packed index costs {max(pw):.1f} MiB at most against {min(lw):.0f} MiB or more for the list "
            f"({min(lw) / max(max(pw), 0.1):.0f}× less); with 8 workers on each of 8 ranks the list would be "
            f"copied up to 64 times ({64 * min(lw) / 1024:.1f} GiB).",
            "",
        ]
    )


class _Lists:
    """The probe's ImageList as it was: a list of path strings and a list of labels."""

    def __init__(self, paths: list[str], labels: list[int]):
        self.paths, self.labels = paths, labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        return self.paths[i], self.labels[i]


def measure_places205(entries: int, workers: int) -> dict:
    """A Places205-sized train list (``a/abbey/00000001.jpg 0`` lines, 205 classes) written to a
    file and read by the probe's reader (the packed ImageList), against the two Python lists the
    reader returned before."""
    from transfer.datasets.readers import PLACES205_LISTS, read_places205

    classes = [f"{chr(97 + c % 26)}/class{c:03d}" for c in range(205)]
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / PLACES205_LISTS / "train_places205.csv"
        listing.parent.mkdir()
        write_text(listing, "".join(f"{classes[i % 205]}/{i:08d}.jpg {i % 205}\n" for i in range(entries)))
        t = time.perf_counter()
        packed = read_places205(tmp, "train")
        read_s = time.perf_counter() - t
    lists = _Lists([path for path, _ in packed.index], packed.labels.tolist())
    list_mib = (sys.getsizeof(lists.paths) + sum(map(sys.getsizeof, lists.paths)) + sys.getsizeof(lists.labels)) / 2**20
    index = packed.index
    packed_mib = (index.blob.nbytes + index.offsets.nbytes + index.labels.nbytes + packed.labels.nbytes) / 2**20
    return {
        "entries": entries,
        "read_s": read_s,
        "list_mib": list_mib,
        "packed_mib": packed_mib,
        "list_worker_mib": worker_growth(lists, workers),
        "packed_worker_mib": worker_growth(index, workers),
    }


def report_places205(m: dict, workers: int) -> str:
    lw, pw = m["list_worker_mib"], m["packed_worker_mib"]
    return "\n".join(
        [
            "## The linear probe's Places205 list",
            "",
            f"`--places205 {m['entries']}`: a list file of {m['entries']:,} lines read by "
            "`transfer.datasets.readers.read_places205` (what `transfer.linear --dataset places205` reads), "
            "whose `ImageList` now holds the packed index, against the two Python lists (paths, labels) it "
            f"held before; each of {workers} DataLoader workers reads every entry once.",
            "",
            "| layout | held by the process (MiB) | each worker's private growth after one pass (MiB) |",
            "|---|---|---|",
            f"| lists of paths and labels (before) | {m['list_mib']:.0f} | " + ", ".join(f"{x:.1f}" for x in lw) + " |",
            f"| packed `ImageList` (now) | {m['packed_mib']:.0f} | " + ", ".join(f"{x:.1f}" for x in pw) + " |",
            "",
            f"Reading and checking the list takes {m['read_s']:.1f} s (every line's label and path checked, "
            "then packed). ImageNet's folders (`--dataset imagenet`, `transfer.knn`) are packed the same way "
            "(`read_image_folder`): the table above is their cost per worker.",
            "",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=IMAGENET_TRAIN)
    p.add_argument("--places205", type=int, default=PLACES205_TRAIN)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("file_index.md"))
    a = p.parse_args()
    text = report(measure(a.entries, a.workers), a.workers)
    text += "\n" + report_places205(measure_places205(a.places205, a.workers), a.workers)
    write_text(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
