"""Write a dataset as tar shards in the WebDataset layout (contrastive_transfer/shards.py, docs/datasets.md).

    python -m transfer.shards SRC OUT [--layout imagefolder|voc07|places205] [--split NAME] [--shard-size N]

* ``imagefolder`` (the default): SRC is an ImageFolder (``SRC/<class>/<image>``) or a flat folder of
  images, as pretraining and kNN read it; the shards are ``OUT/NAME-NNNNNN.tar`` with NAME the
  ``--split`` (default: SRC's folder name, e.g. ``train``).
* ``voc07``: SRC is a VOC2007 folder; ``--split`` (e.g. ``trainval``, ``test``) names the
  classification lists ``ImageSets/Main/<class>_<split>.txt`` read; each image's key is its id.
* ``places205``: SRC is the Places205 root; ``--split`` is ``train`` or ``val``.

Samples keep the dataset's order (sorted class folders and names, or the list's order), so that
shards and folder are the same samples at the same indices: the same pretraining losses and the
same features. Each sample is ``KEY.<image extension>`` (the file's bytes as they are, through the
gate), ``KEY.cls`` (its class) and for VOC ``KEY.labels`` (its value per class); ``OUT/NAME.json``
names the classes and counts each shard's samples. The same input writes the same bytes.

Read them by naming them where a folder goes: ``data.root=OUT/train-{000000..000127}.tar`` (or
``OUT/train``), ``--train-dir OUT/train --val-dir OUT/val``, ``--data-root OUT`` for the probes
(``OUT/train-*``, ``OUT/val-*``), ``--voc-root OUT`` for the SVM (``OUT/trainval-*``, ``OUT/test-*``).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from contrastive_transfer.cli import UserError, command
from contrastive_transfer.images import read_image_bytes
from contrastive_transfer.shards import IMAGE_FIELDS, ShardWriter

logger = logging.getLogger(__name__)

LAYOUTS = ("imagefolder", "voc07", "places205")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m transfer.shards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("src", help="the dataset: an image folder, a VOC2007 folder or the Places205 root")
    p.add_argument("out", help="folder the shards and NAME.json go to")
    p.add_argument("--layout", choices=LAYOUTS, default="imagefolder")
    p.add_argument("--split", default=None, help="voc07/places205: the split read; the shards' NAME (default: SRC's)")
    p.add_argument("--shard-size", type=int, default=10_000, help="samples per shard")
    return p


def _field(path: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


def _samples(args: argparse.Namespace):
    """(name, classes, [(key, image path, label or None, VOC row or None)]) of the source."""
    from pretrain.data import scan_index
    from transfer.datasets.readers import DatasetError, read_places205, read_voc_labels

    if args.layout == "imagefolder":
        index = scan_index(args.src)
        name = args.split or Path(args.src).resolve().name
        rows = ((f"{i:08d}", path, label if label >= 0 else None, None) for i, (path, label) in enumerate(index))
        return name, index.classes, rows
    if not args.split:
        raise DatasetError(f"--layout {args.layout} needs --split (the list read, e.g. trainval or train)")
    if args.layout == "voc07":
        voc = read_voc_labels(args.src, args.split)
        paths = (path for path, _ in voc.images.index)
        return args.split, voc.classes, ((i, p, None, row) for i, p, row in zip(voc.ids, paths, voc.labels))
    places = read_places205(args.src, args.split)
    return args.split, places.classes, ((f"{i:08d}", p, y, None) for i, (p, y) in enumerate(places.index))


@command
def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    name, classes, samples = _samples(args)
    writer = ShardWriter(args.out, name, args.shard_size, classes, args.layout)
    count = 0
    for key, path, label, row in samples:
        field = _field(path)
        if field not in IMAGE_FIELDS:
            raise UserError(f"{path}: not an image extension ({', '.join(IMAGE_FIELDS)})")
        fields = {field: read_image_bytes(path)}  # the gate: a regular file within the image cap
        if label is not None:
            fields["cls"] = str(int(label)).encode()
        if row is not None:
            fields["labels"] = " ".join(str(int(v)) for v in row).encode()
        writer.add(str(key), fields)
        count += 1
    manifest = writer.close()
    logger.info("%d samples in %d shards under %s (%s)", count, len(writer.counts), args.out, manifest)


if __name__ == "__main__":
    main()
