"""Synthetic datasets in the real on-disk layouts, deterministic for a seed.

    python -m contrastive_transfer.synthetic --out DIR [--seed S] [--preset tiny|small|voc07|digits]

writes, under DIR:

* ``imagenet/{train,val}/<class>/*.JPEG``             torchvision ImageFolder (10 shape classes)
* ``VOC2007/``, ``VOC2012/``                           VOC devkit: Annotations, JPEGImages,
  ImageSets/Main/{split}.txt and <cls>_<split>.txt (VOC2012: trainval only; 20 VOC class names)
* ``coco/{train2017,val2017}/*.jpg``, ``coco/annotations/instances_{train,val}2017.json``
  (the 80 COCO categories with their real non-contiguous ids; objects use 20 of them)
* ``places205/trainvalsplit_places205/{train,val}_places205.csv`` and images under
  ``places205/data/vision/torralba/deeplearning/images256/``
* ``manifest.json``: what was written (counts, classes, per-image VOC objects, the COCO annotations
  of objects nothing hides), written last.

Detection class i (VOC order, and its COCO counterpart) is drawn as ``SHAPES[i]``; ImageNet class i
is the same shape, so pretraining on ``imagenet`` transfers to the detection sets as it should.
Images are seeded per (seed, dataset, split, index), so the bytes do not depend on the number of
worker processes. ``--preset digits`` writes real images instead: scikit-learn's bundled UCI
handwritten digits in the ImageNet and VOC layouts (``digits.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from contrastive_transfer.cli import UserError, atomic_write, write_bytes, write_text
from contrastive_transfer.json_limits import read_json
from contrastive_transfer.progress import progress
from contrastive_transfer.synthetic.shapes import (
    SCENE_LAYOUTS,
    SHAPE_NAMES,
    SHAPES,
    Canvas,
    clip_to_image,
    place,
    scene,
)
from contrastive_transfer.synthetic.voc import VOC_CLASSES, voc_xml

FORMAT_VERSION = 3  # bump whenever the images change, so old outputs are regenerated

# The 80 COCO 2017 detection categories with their official ids (1..90, with gaps).
COCO_CATEGORIES = (
    (1, "person"),
    (2, "bicycle"),
    (3, "car"),
    (4, "motorcycle"),
    (5, "airplane"),
    (6, "bus"),
    (7, "train"),
    (8, "truck"),
    (9, "boat"),
    (10, "traffic light"),
    (11, "fire hydrant"),
    (13, "stop sign"),
    (14, "parking meter"),
    (15, "bench"),
    (16, "bird"),
    (17, "cat"),
    (18, "dog"),
    (19, "horse"),
    (20, "sheep"),
    (21, "cow"),
    (22, "elephant"),
    (23, "bear"),
    (24, "zebra"),
    (25, "giraffe"),
    (27, "backpack"),
    (28, "umbrella"),
    (31, "handbag"),
    (32, "tie"),
    (33, "suitcase"),
    (34, "frisbee"),
    (35, "skis"),
    (36, "snowboard"),
    (37, "sports ball"),
    (38, "kite"),
    (39, "baseball bat"),
    (40, "baseball glove"),
    (41, "skateboard"),
    (42, "surfboard"),
    (43, "tennis racket"),
    (44, "bottle"),
    (46, "wine glass"),
    (47, "cup"),
    (48, "fork"),
    (49, "knife"),
    (50, "spoon"),
    (51, "bowl"),
    (52, "banana"),
    (53, "apple"),
    (54, "sandwich"),
    (55, "orange"),
    (56, "broccoli"),
    (57, "carrot"),
    (58, "hot dog"),
    (59, "pizza"),
    (60, "donut"),
    (61, "cake"),
    (62, "chair"),
    (63, "couch"),
    (64, "potted plant"),
    (65, "bed"),
    (67, "dining table"),
    (70, "toilet"),
    (72, "tv"),
    (73, "laptop"),
    (74, "mouse"),
    (75, "remote"),
    (76, "keyboard"),
    (77, "cell phone"),
    (78, "microwave"),
    (79, "oven"),
    (80, "toaster"),
    (81, "sink"),
    (82, "refrigerator"),
    (84, "book"),
    (85, "clock"),
    (86, "vase"),
    (87, "scissors"),
    (88, "teddy bear"),
    (89, "hair drier"),
    (90, "toothbrush"),
)
_VOC_TO_COCO_NAME = {
    "aeroplane": "airplane",
    "diningtable": "dining table",
    "motorbike": "motorcycle",
    "pottedplant": "potted plant",
    "sofa": "couch",
    "tvmonitor": "tv",
}
_COCO_ID = {name: cid for cid, name in COCO_CATEGORIES}
COCO_IDS_USED = tuple(_COCO_ID[_VOC_TO_COCO_NAME.get(c, c)] for c in VOC_CLASSES)

IMAGENET_CLASSES = SHAPE_NAMES[:10]
PLACES_CLASSES = (
    "a/abbey",
    "a/alley",
    "b/beach",
    "b/bedroom",
    "c/canyon",
    "c/corridor",
    "f/forest_path",
    "h/highway",
    "k/kitchen",
    "m/mountain",
)
PLACES_IMAGE_DIR = "data/vision/torralba/deeplearning/images256"
# A VOC object is "difficult" when most of it is hidden or it is tiny, as in the VOC guidelines.
DIFFICULT_VISIBLE_FRACTION = 0.45
DIFFICULT_MAX_SIDE = 16
OWNED_DIRS = ("imagenet", "VOC2007", "VOC2012", "coco", "places205")


@dataclass(frozen=True)
class Preset:
    imagenet_per_class: tuple[int, int]  # train, val
    imagenet_side: tuple[int, int]  # min, max side in pixels
    voc07_trainval: int
    voc07_test: int
    voc12_trainval: int
    coco_train: int
    coco_val: int
    detection_width: tuple[int, int]
    detection_height: tuple[int, int]
    places_per_class: tuple[int, int]
    places_side: int


PRESETS = {
    "tiny": Preset((40, 10), (64, 96), 40, 40, 24, 32, 16, (128, 176), (96, 144), (6, 3), 64),
    "small": Preset((150, 30), (80, 128), 400, 400, 300, 500, 200, (160, 224), (128, 192), (60, 20), 96),
}
# small, with VOC2007 at the real split sizes: the VOC07 SVM benchmark's features at the protocol's scale
PRESETS["voc07"] = replace(PRESETS["small"], voc07_trainval=5011, voc07_test=4952)


# ----------------------------------------------------------------------------------- rendering
def _rng(key: tuple[int, ...]) -> np.random.Generator:
    return np.random.default_rng(list(key))


def _save_jpeg(image, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: image.save(f, format="JPEG", quality=90), durable=False)


def render_classification(key: tuple[int, ...], cls: int, side: tuple[int, int], path: Path) -> None:
    """One large object of class `cls` near the centre (mostly inside the centre crop that
    classifiers see), possibly truncated and partly occluded by light clutter."""
    rng = _rng(key)
    h, w = (int(v) for v in rng.integers(side[0], side[1] + 1, 2))
    canvas = Canvas.new(rng, h, w)
    size = min(h, w) * rng.uniform(0.6, 0.9)
    cx, cy = w / 2 + rng.uniform(-0.2, 0.2) * (w - size), h / 2 + rng.uniform(-0.2, 0.2) * (h - size)
    canvas.paint(rng, place(SHAPES[SHAPE_NAMES[cls]], rng, cx, cy, size), owner=0)
    canvas.clutter(rng, n_lines=int(rng.integers(0, 3)), n_blobs=int(rng.integers(0, 2)), blob_size=min(h, w) * 0.18)
    _save_jpeg(canvas.image(), path)


def render_detection(
    key: tuple[int, ...], first_class: int, width: tuple[int, int], height: tuple[int, int], path: Path
) -> dict:
    """1–4 objects (the first of class `first_class`, so classes stay balanced), clutter on top,
    and every fifth image one tiny extra object. Boxes are tight around each object's visible
    pixels; returns the image size and its objects."""
    rng = _rng(key)
    w, h = int(rng.integers(width[0], width[1] + 1)), int(rng.integers(height[0], height[1] + 1))
    canvas = Canvas.new(rng, h, w)
    n_objects = int(rng.choice([1, 2, 3, 4], p=[0.3, 0.35, 0.2, 0.15]))
    classes = [first_class] + [int(c) for c in rng.integers(0, len(VOC_CLASSES), n_objects - 1)]
    sizes = list(min(h, w) * rng.uniform(0.22, 0.6, n_objects))
    if key[-1] % 5 == 0:
        classes.append(int(rng.choice([c for c in range(len(VOC_CLASSES)) if c not in classes])))
        sizes.append(float(rng.uniform(8, 14)))
    drawn = []
    for j, (cls, size) in enumerate(zip(classes, sizes)):
        cx, cy = rng.uniform(size * 0.2, w - size * 0.2), rng.uniform(size * 0.2, h - size * 0.2)
        pts = place(SHAPES[SHAPE_NAMES[cls]], rng, cx, cy, size)
        drawn.append((cls, pts, canvas.paint(rng, pts, owner=j)))
    canvas.clutter(rng, n_lines=int(rng.integers(0, 5)), n_blobs=int(rng.integers(0, 3)), blob_size=min(h, w) * 0.22)
    _save_jpeg(canvas.image(), path)

    objects = []
    for j, (cls, pts, painted) in enumerate(drawn):
        ys, xs = np.nonzero(canvas.owner == j)
        if len(xs) == 0:
            continue  # fully hidden: nothing to annotate
        x0, y0, x1, y1 = int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())
        visible = len(xs) / max(painted, 1)
        clipped = clip_to_image(pts, w, h)
        objects.append(
            {
                "class": cls,
                "box": [x0, y0, x1, y1],  # 0-based inclusive pixel indices
                "area": len(xs),
                "difficult": int(
                    visible < DIFFICULT_VISIBLE_FRACTION or max(x1 - x0, y1 - y0) + 1 < DIFFICULT_MAX_SIDE
                ),
                "truncated": int(bool((pts < 0).any() or (pts[:, 0] > w - 1).any() or (pts[:, 1] > h - 1).any())),
                "polygon": [round(float(v), 3) for v in clipped.reshape(-1)],
                "fully_visible": len(xs) == painted,
            }
        )
    return {"width": w, "height": h, "objects": objects}


def render_scene(key: tuple[int, ...], cls: int, side: int, path: Path) -> None:
    rng = _rng(key)
    shape = SHAPE_NAMES[(3 * cls + 1) % len(SHAPE_NAMES)]
    _save_jpeg(scene(rng, cls % SCENE_LAYOUTS, shape, side, side), path)


def _run(job: tuple):
    fn, args = job
    return fn(*args)


def _render_all(jobs: list[tuple], desc: str, workers: int) -> list:
    """Render jobs (in parallel when workers > 1) in order, with a progress bar."""
    if workers <= 1:
        return [_run(j) for j in progress(jobs, len(jobs), desc, unit="img")]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(progress(pool.map(_run, jobs, chunksize=8), len(jobs), desc, unit="img"))


# ----------------------------------------------------------------------------------- writers
def write_imagenet(root: Path, preset: Preset, seed: int, workers: int) -> dict:
    summary = {"classes": list(IMAGENET_CLASSES)}
    for split_id, (split, per_class) in enumerate(zip(("train", "val"), preset.imagenet_per_class)):
        jobs = [
            (
                render_classification,
                (
                    (seed, 1, split_id, c * 100_000 + i),
                    c,
                    preset.imagenet_side,
                    root / split / name / f"{name}_{i:05d}.JPEG",
                ),
            )
            for c, name in enumerate(IMAGENET_CLASSES)
            for i in range(per_class)
        ]
        _render_all(jobs, f"imagenet/{split}", workers)
        summary[split] = {"images": len(jobs), "per_class": {n: per_class for n in IMAGENET_CLASSES}}
    return summary


def voc_image_labels(objects: list[dict]) -> dict[str, int]:
    """VOC classification labels of one image: 1 present, 0 present only as difficult, -1 absent."""
    labels = {c: -1 for c in VOC_CLASSES}
    for obj in objects:
        name = VOC_CLASSES[obj["class"]]
        labels[name] = max(labels[name], 0 if obj["difficult"] else 1)
    return labels


def write_voc(root: Path, year: int, splits: dict[str, int], preset: Preset, seed: int, workers: int) -> dict:
    """`splits` maps the generated split ('trainval', 'test') to its size; VOC2007's trainval is
    divided into disjoint train/val halves as in the devkit."""
    main = root / "ImageSets" / "Main"
    main.mkdir(parents=True, exist_ok=True)
    (root / "Annotations").mkdir(parents=True, exist_ok=True)
    summary: dict = {"classes": list(VOC_CLASSES), "splits": {}}
    ids_of: dict[str, list[str]] = {}
    anns: dict[str, dict] = {}
    start = 1
    for split_id, (split, n) in enumerate(splits.items()):
        ids = [f"{year}_{i:06d}" if year != 2007 else f"{i:06d}" for i in range(start, start + n)]
        start += n
        jobs = [
            (
                render_detection,
                (
                    (seed, year, split_id, i),
                    i % len(VOC_CLASSES),
                    preset.detection_width,
                    preset.detection_height,
                    root / "JPEGImages" / f"{image_id}.jpg",
                ),
            )
            for i, image_id in enumerate(ids)
        ]
        for image_id, ann in zip(ids, _render_all(jobs, f"{root.name}/{split}", workers)):
            write_bytes(root / "Annotations" / f"{image_id}.xml", voc_xml(root.name, image_id, ann), durable=False)
            anns[image_id] = ann
        ids_of[split] = ids
        if split == "trainval" and "test" in splits:
            ids_of["train"], ids_of["val"] = ids[0::2], ids[1::2]
    for split, ids in ids_of.items():
        write_text(main / f"{split}.txt", "".join(f"{i}\n" for i in ids))
        labels = {i: voc_image_labels(anns[i]["objects"]) for i in ids}
        for cls in VOC_CLASSES:
            write_text(main / f"{cls}_{split}.txt", "".join(f"{i} {labels[i][cls]:2d}\n" for i in ids))
        summary["splits"][split] = {
            "ids": ids,
            "objects": {i: [[VOC_CLASSES[o["class"]], o["difficult"]] for o in anns[i]["objects"]] for i in ids},
        }
    return summary


def write_coco(root: Path, preset: Preset, seed: int, workers: int) -> dict:
    categories = [{"id": cid, "name": name, "supercategory": "synthetic"} for cid, name in COCO_CATEGORIES]
    summary: dict = {"categories_used": list(COCO_IDS_USED)}
    next_image_id = 1
    for split_id, (split, n) in enumerate((("train2017", preset.coco_train), ("val2017", preset.coco_val))):
        image_ids = list(range(next_image_id, next_image_id + n))
        next_image_id += n
        jobs = [
            (
                render_detection,
                (
                    (seed, 2017, split_id, i),
                    i % len(VOC_CLASSES),
                    preset.detection_width,
                    preset.detection_height,
                    root / split / f"{image_id:012d}.jpg",
                ),
            )
            for i, image_id in enumerate(image_ids)
        ]
        images, annotations, fully_visible = [], [], []
        for image_id, ann in zip(image_ids, _render_all(jobs, f"coco/{split}", workers)):
            images.append(
                {"id": image_id, "file_name": f"{image_id:012d}.jpg", "height": ann["height"], "width": ann["width"]}
            )
            for obj in ann["objects"]:
                x0, y0, x1, y1 = obj["box"]
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": image_id,
                        "category_id": COCO_IDS_USED[obj["class"]],
                        "bbox": [float(x0), float(y0), float(x1 - x0 + 1), float(y1 - y0 + 1)],
                        "area": float(obj["area"]),
                        "iscrowd": 0,
                        "segmentation": [obj["polygon"]],
                    }
                )
                if obj["fully_visible"]:
                    fully_visible.append(annotations[-1]["id"])
        dataset = {
            "info": {"description": "synthetic shapes in the COCO 2017 layout", "version": "1.0"},
            "licenses": [],
            "images": images,
            "annotations": annotations,
            "categories": categories,
        }
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        write_text(root / "annotations" / f"instances_{split}.json", json.dumps(dataset))
        per_category: dict[int, int] = {}
        for a in annotations:
            per_category[a["category_id"]] = per_category.get(a["category_id"], 0) + 1
        summary[split] = {
            "images": len(images),
            "annotations": len(annotations),
            "per_category": {str(k): v for k, v in sorted(per_category.items())},
            "fully_visible_annotation_ids": fully_visible,
        }
    return summary


def write_places205(root: Path, preset: Preset, seed: int, workers: int) -> dict:
    summary = {"classes": list(PLACES_CLASSES)}
    lists = root / "trainvalsplit_places205"
    lists.mkdir(parents=True, exist_ok=True)
    for split_id, (split, per_class) in enumerate(zip(("train", "val"), preset.places_per_class)):
        rel = [
            f"{name}/{split_id * 10_000_000 + c * 100_000 + i:08d}.jpg"
            for c, name in enumerate(PLACES_CLASSES)
            for i in range(per_class)
        ]
        labels = [c for c in range(len(PLACES_CLASSES)) for _ in range(per_class)]
        jobs = [
            (render_scene, ((seed, 205, split_id, k), c, preset.places_side, root / PLACES_IMAGE_DIR / r))
            for k, (r, c) in enumerate(zip(rel, labels))
        ]
        _render_all(jobs, f"places205/{split}", workers)
        write_text(lists / f"{split}_places205.csv", "".join(f"{r} {c}\n" for r, c in zip(rel, labels)))
        summary[split] = {"images": len(rel), "per_class": {n: per_class for n in PLACES_CLASSES}}
    return summary


# ----------------------------------------------------------------------------------- main
PRESET_NAMES = (*PRESETS, "digits")  # digits: the real UCI digits of scikit-learn (digits.py)


def _claim(out: Path, config: dict, force: bool) -> dict | None:
    """The manifest already at ``out`` when it was written with ``config`` (nothing to do); else
    None after removing what this generator wrote before. Folders it did not write (no manifest)
    are refused without ``force``."""
    manifest_path = out / "manifest.json"
    previous = read_json(manifest_path) if os.path.lexists(manifest_path) else None
    if previous is not None and not isinstance(previous, dict):
        raise UserError(f"{manifest_path}: a {type(previous).__name__}, expected the generator's manifest (an object)")
    if previous is not None and previous.get("config") == json.loads(json.dumps(config)):
        return previous
    existing = [d for d in OWNED_DIRS if (out / d).exists()]
    if existing and previous is None and not force:
        raise FileExistsError(
            f"{out}: {', '.join(existing)} exist but {manifest_path} does not, so they "
            "were not written (completely) by this generator; pass --force to overwrite"
        )
    for d in existing:
        shutil.rmtree(out / d)
    manifest_path.unlink(missing_ok=True)
    return None


def _write_manifest(out: Path, manifest: dict) -> dict:
    # last: its presence means the datasets are complete
    write_text(out / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def generate(
    out: str | os.PathLike, seed: int = 0, preset: str = "tiny", workers: int = 1, force: bool = False
) -> dict:
    """Write every dataset under `out` and return the manifest. Re-running with the same seed and
    preset on a complete output does nothing; a different seed/preset replaces what this
    generator wrote before; folders it did not write are never deleted without `force`.
    ``preset="digits"`` writes the real digits (``digits.py``) instead of the drawn shapes."""
    if preset not in PRESET_NAMES:
        raise ValueError(f"--preset {preset!r}: expected one of {sorted(PRESET_NAMES)}")
    out = Path(out)
    if preset == "digits":
        from contrastive_transfer.synthetic import digits

        config = {"format_version": FORMAT_VERSION, **digits.config(seed)}
        previous = _claim(out, config, force)
        return previous or _write_manifest(out, {"config": config, **digits.write_digits(out, seed)})
    config = {"format_version": FORMAT_VERSION, "seed": seed, "preset": preset, **asdict(PRESETS[preset])}
    previous = _claim(out, config, force)
    if previous is not None:
        return previous
    p = PRESETS[preset]
    manifest = {"config": config}
    manifest["imagenet"] = write_imagenet(out / "imagenet", p, seed, workers)
    manifest["VOC2007"] = write_voc(
        out / "VOC2007", 2007, {"trainval": p.voc07_trainval, "test": p.voc07_test}, p, seed, workers
    )
    manifest["VOC2012"] = write_voc(out / "VOC2012", 2012, {"trainval": p.voc12_trainval}, p, seed, workers)
    manifest["coco"] = write_coco(out / "coco", p, seed, workers)
    manifest["places205"] = write_places205(out / "places205", p, seed, workers)
    return _write_manifest(out, manifest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m contrastive_transfer.synthetic", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", "--output-dir", required=True, help="output root (becomes DETECTRON2_DATASETS-style root)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESET_NAMES),
        help="tiny, small, voc07: drawn shapes; digits: scikit-learn's real handwritten digits, no download",
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--force", action="store_true", help="overwrite dataset folders not written by this tool")
    args = parser.parse_args(argv)
    try:
        m = generate(args.out, args.seed, args.preset, args.workers, args.force)
    except (FileExistsError, ValueError, UserError) as e:
        sys.exit(f"error: {e}")
    out = Path(args.out).resolve()
    voc07 = m["VOC2007"]["splits"]
    if args.preset == "digits":
        print(f"UCI handwritten digits (scikit-learn's copy, seed {args.seed}) in {out}")
    else:
        print(f"synthetic datasets (preset {args.preset}, seed {args.seed}) in {out}")
    print(
        f"  imagenet   {out / 'imagenet'}: {m['imagenet']['train']['images']} train / "
        f"{m['imagenet']['val']['images']} val images, {len(m['imagenet']['classes'])} classes"
    )
    print(
        f"  VOC2007    {out / 'VOC2007'}: {len(voc07['trainval']['ids'])} trainval / {len(voc07['test']['ids'])} test"
    )
    print(f"  VOC2012    {out / 'VOC2012'}: {len(m['VOC2012']['splits']['trainval']['ids'])} trainval")
    if args.preset == "digits":
        return
    print(
        f"  coco       {out / 'coco'}: {m['coco']['train2017']['images']} train2017 / "
        f"{m['coco']['val2017']['images']} val2017 images"
    )
    print(
        f"  places205  {out / 'places205'}: {m['places205']['train']['images']} train / "
        f"{m['places205']['val']['images']} val images, {len(PLACES_CLASSES)} classes"
    )


if __name__ == "__main__":
    main()
