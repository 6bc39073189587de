"""Real images offline: scikit-learn's bundled UCI handwritten digits in the layouts the project reads.

    python -m contrastive_transfer.synthetic --preset digits --out datasets/digits [--seed S]

``sklearn.datasets.load_digits`` ships 1,797 greyscale 8×8 digits (ink 0-16, 10 classes; the test
set of UCI's "Optical Recognition of Handwritten Digits", 13 writers), inside the wheel: no
download. One stratified split of them, deterministic for the seed, serves every layout:

* ``imagenet/{train,val}/<digit>/<index>.JPEG``: ImageFolder of 40-px RGB images, white ink on
  black: the digit upscaled (bilinear) to a side of 16-28 px, rotated by up to ±20° and placed
  anywhere inside the image, drawn once per image for the seed. Centred, the digits are too easy:
  kNN on a random-init ResNet-18's features scores 94 %, leaving a pretraining nothing to show;
  placed so, 40 % (docs/datasets.md).
* ``VOC2007/`` (trainval, its train/val halves, test) and ``VOC2012/`` (trainval): canvases of
  1-4 digits at 24-56 px on a noisy dark background. Trainval canvases hold digits of the train
  split only, test canvases digits of the val split only. Digit d is annotated with its own name
  (``"0"`` ... ``"9"``), and ``ImageSets/Main/<d>_<split>.txt`` (1 present, −1 absent) exist for
  those 10 classes: the VOC07 SVM's multi-label split and the class list detection reads
  (``transfer.detection.datasets``: a detector of 10 classes, AP averaged over the 10 digits).
  Boxes are tight around the digit's pixels brighter than ``INK_THRESHOLD``; no object is
  difficult or truncated.

Index ``i`` in file names is the digit's row in ``load_digits()``, so every image traces back to
its source. ``manifest.json`` lists the split and every canvas's objects.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from contrastive_transfer.cli import atomic_write, write_bytes, write_text
from contrastive_transfer.progress import progress
from contrastive_transfer.synthetic.voc import voc_xml

DIGIT_CLASSES = tuple(str(d) for d in range(10))  # the ImageFolder class folders and the VOC class names
INK_THRESHOLD = 32  # of 255: a box holds the digit's pixels above it (bilinear tails are fainter)
SOURCE = {
    "loader": "sklearn.datasets.load_digits",
    "origin": "UCI ML repository, Optical Recognition of Handwritten Digits (E. Alpaydin, C. Kaynak, 1998), "
    "its test set",
    "licence": "CC BY 4.0",
    "images": 1797,
}


@dataclass(frozen=True)
class DigitsPreset:
    val_fraction: float  # of each class, rounded per class
    digit_side: tuple[int, int]  # side of the upscaled 8×8 digit in the ImageFolder images, pixels
    rotation: float  # ± degrees of the digit in the ImageFolder images
    image_side: int  # the ImageFolder image (the digit placed in it, black around it)
    voc07_trainval: int
    voc07_test: int
    voc12_trainval: int
    detection_width: tuple[int, int]
    detection_height: tuple[int, int]
    digit_box_side: tuple[int, int]  # side of a digit on a canvas, pixels


DIGITS = DigitsPreset(0.3, (16, 28), 20.0, 40, 400, 400, 300, (128, 176), (96, 144), (24, 56))
# What a recipe needs to pretrain on these images: the digits augmentation (no flip, small affine)
# at 32 px, the digit's side (benchmarks/learning.py --data digits, tools/demo.py --preset digits).
PRETRAIN_OVERRIDES = ("data.augmentation=digits", "data.image_size=32")
# What detection fine-tuning needs on them (transfer.detection KEY VALUE options): no horizontal
# flip, detectron2's default in training; a mirrored digit is another glyph or none, which is why
# the pretraining augmentation does not flip them either.
DETECTION_OVERRIDES = ("INPUT.RANDOM_FLIP", "none")


def load() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) uint8 in 0..16, labels (1797,) int) from scikit-learn's own copy."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images.astype(np.uint8), digits.target.astype(np.int64)


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices, sorted: round(n_c · val_fraction) of each class c to val, drawn by a
    permutation seeded by (seed, c) (numpy's PCG64: the same on every machine and version)."""
    train, val = [], []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        order = np.random.default_rng([seed, 8, int(c)]).permutation(members)
        n_val = int(round(len(members) * val_fraction))
        val.append(order[:n_val])
        train.append(order[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def render_digit(image: np.ndarray, side: int) -> np.ndarray:
    """The 8×8 digit (ink 0..16) as a side×side uint8 patch, white ink on black, bilinear."""
    small = Image.fromarray((image.astype(np.float32) * (255 / 16)).round().astype(np.uint8), mode="L")
    return np.asarray(small.resize((side, side), Image.Resampling.BILINEAR))


def _save_rgb(gray: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(gray, mode="L").convert("RGB")
    atomic_write(path, lambda f: image.save(f, format="JPEG", quality=95), durable=False)


def placed_digit(image: np.ndarray, rng: np.random.Generator, p: DigitsPreset) -> tuple[np.ndarray, dict]:
    """The ImageFolder image of one digit (side, angle and position drawn from ``rng``) and its
    placement: side, angle (degrees, counter-clockwise) and the rotated patch's box [x, y, w, h]."""
    side = int(rng.integers(p.digit_side[0], p.digit_side[1] + 1))
    angle = float(rng.uniform(-p.rotation, p.rotation))
    patch = Image.fromarray(render_digit(image, side)).rotate(angle, Image.Resampling.BILINEAR, expand=True)
    h, w = patch.height, patch.width  # the rotated square's black corners may reach the border
    y, x = (int(rng.integers(0, p.image_side - n + 1)) for n in (h, w))
    canvas = np.zeros((p.image_side, p.image_side), dtype=np.uint8)
    canvas[y : y + h, x : x + w] = np.asarray(patch)
    return canvas, {"side": side, "angle": round(angle, 4), "box": [x, y, w, h]}


def write_imagefolder(
    root: Path, images: np.ndarray, labels: np.ndarray, splits: dict, p: DigitsPreset, seed: int
) -> dict:
    summary: dict = {"classes": list(DIGIT_CLASSES)}
    for split, indices in splits.items():
        placements = {}
        for i in progress(indices, len(indices), f"imagenet/{split}", unit="img"):
            canvas, placements[f"{i:04d}"] = placed_digit(images[i], np.random.default_rng([seed, 10, int(i)]), p)
            _save_rgb(canvas, root / split / DIGIT_CLASSES[labels[i]] / f"{i:04d}.JPEG")
        counts = np.bincount(labels[indices], minlength=len(DIGIT_CLASSES))
        summary[split] = {
            "images": len(indices),
            "per_class": {name: int(n) for name, n in zip(DIGIT_CLASSES, counts)},
            "indices": [int(i) for i in indices],
            "placements": placements,
        }
    return summary


class DigitDeck:
    """Draws digits of one split class by class, each class's digits in a seeded order, cycling:
    every digit of the split is used before any is used twice."""

    def __init__(self, indices: np.ndarray, labels: np.ndarray, seed: int, split_id: int):
        self.decks = {
            int(c): np.random.default_rng([seed, 9, split_id, int(c)]).permutation(indices[labels[indices] == c])
            for c in np.unique(labels[indices])
        }
        self.next = dict.fromkeys(self.decks, 0)

    def draw(self, cls: int) -> int:
        deck = self.decks[cls]
        index = int(deck[self.next[cls] % len(deck)])
        self.next[cls] += 1
        return index


def _place(rng: np.random.Generator, w: int, h: int, side: int, taken: list[tuple[int, int, int, int]]):
    """Top-left corner for a side×side digit inside the canvas, not overlapping ``taken`` (up to 50
    tries); None when there is no room."""
    for _ in range(50):
        x, y = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        if all(x + side <= a or a + s <= x or y + side <= b or b + s <= y for a, b, s, _ in taken):
            return x, y
    return None


def render_canvas(key: tuple[int, ...], first_class: int, deck: DigitDeck, images, labels, p: DigitsPreset, path):
    """1-4 non-overlapping digits (the first of ``first_class``, so classes stay balanced) on dark
    noise; returns the image size, its objects (VOC annotation fields) and the digits' indices."""
    rng = np.random.default_rng(list(key))
    w = int(rng.integers(p.detection_width[0], p.detection_width[1] + 1))
    h = int(rng.integers(p.detection_height[0], p.detection_height[1] + 1))
    canvas = rng.normal(24, 8, (h, w)).clip(0, 255)
    n = int(rng.choice([1, 2, 3, 4], p=[0.3, 0.35, 0.2, 0.15]))
    classes = [first_class] + [int(c) for c in rng.integers(0, 10, n - 1)]
    placed: list[tuple[int, int, int, int]] = []
    for cls in classes:
        side = int(rng.integers(p.digit_box_side[0], p.digit_box_side[1] + 1))
        spot = _place(rng, w, h, side, placed)
        if spot is not None:
            placed.append((*spot, side, deck.draw(cls)))
    objects, sources = [], []
    for x, y, side, index in placed:
        patch = render_digit(images[index], side)
        region = canvas[y : y + side, x : x + side]
        np.maximum(region, patch, out=region)
        ys, xs = np.nonzero(patch > INK_THRESHOLD)
        box = [x + int(xs.min()), y + int(ys.min()), x + int(xs.max()), y + int(ys.max())]  # 0-based inclusive
        objects.append({"class": int(labels[index]), "box": box, "difficult": 0, "truncated": 0})
        sources.append(index)
    _save_rgb(canvas.round().astype(np.uint8), path)
    return {"width": w, "height": h, "objects": objects}, sources


def write_voc_digits(root: Path, year: int, splits: dict, p: DigitsPreset, seed: int, data) -> dict:
    """``splits``: generated split name → (number of canvases, digit indices it draws from)."""
    images, labels = data
    main = root / "ImageSets" / "Main"
    main.mkdir(parents=True, exist_ok=True)
    (root / "Annotations").mkdir(parents=True, exist_ok=True)
    summary: dict = {"classes": list(DIGIT_CLASSES), "splits": {}}
    ids_of, anns, start = {}, {}, 1
    for split_id, (split, (n, pool)) in enumerate(splits.items()):
        ids = [f"{year}_{i:06d}" if year != 2007 else f"{i:06d}" for i in range(start, start + n)]
        start += n
        deck = DigitDeck(np.asarray(pool), labels, seed, year * 10 + split_id)
        for i, image_id in enumerate(progress(ids, len(ids), f"{root.name}/{split}", unit="img")):
            ann, sources = render_canvas(
                (seed, year, split_id, i), i % 10, deck, images, labels, p, root / "JPEGImages" / f"{image_id}.jpg"
            )
            write_bytes(
                root / "Annotations" / f"{image_id}.xml",
                voc_xml(
                    root.name, image_id, ann, "UCI handwritten digits (sklearn.datasets.load_digits)", DIGIT_CLASSES
                ),
                durable=False,
            )
            anns[image_id] = {**ann, "digits": sources}
        ids_of[split] = ids
        if split == "trainval" and "test" in splits:
            ids_of["train"], ids_of["val"] = ids[0::2], ids[1::2]
    for split, ids in ids_of.items():
        write_text(main / f"{split}.txt", "".join(f"{i}\n" for i in ids))
        for c, cls in enumerate(DIGIT_CLASSES):
            present = {i: any(o["class"] == c for o in anns[i]["objects"]) for i in ids}
            write_text(main / f"{cls}_{split}.txt", "".join(f"{i} {1 if present[i] else -1:2d}\n" for i in ids))
        summary["splits"][split] = {
            "ids": ids,
            "objects": {i: [[DIGIT_CLASSES[o["class"]], 0] for o in anns[i]["objects"]] for i in ids},
            "digits": {i: anns[i]["digits"] for i in ids},
        }
    return summary


def write_digits(out: Path, seed: int) -> dict:
    """Every layout under ``out``; returns the manifest's entries (without its config)."""
    p = DIGITS
    images, labels = load()
    train, val = stratified_split(labels, p.val_fraction, seed)
    manifest: dict = {"source": SOURCE}
    manifest["imagenet"] = write_imagefolder(out / "imagenet", images, labels, {"train": train, "val": val}, p, seed)
    manifest["VOC2007"] = write_voc_digits(
        out / "VOC2007", 2007, {"trainval": (p.voc07_trainval, train), "test": (p.voc07_test, val)}, p, seed,
        (images, labels),
    )  # fmt: skip
    manifest["VOC2012"] = write_voc_digits(
        out / "VOC2012", 2012, {"trainval": (p.voc12_trainval, train)}, p, seed, (images, labels)
    )
    return manifest


def config(seed: int) -> dict:
    # voc_classes: a folder written when the digits carried VOC names (aeroplane..cow) differs from
    # this config, so the generator rewrites it (the benchmarks run the generator every time; the
    # demo only where no manifest exists, or with FRESH=1)
    return {"seed": seed, "preset": "digits", **asdict(DIGITS), "voc_classes": list(DIGIT_CLASSES)}
