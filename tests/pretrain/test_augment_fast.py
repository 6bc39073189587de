"""The fast view backend (pretrain/augment/fast.py, data.backend: fast) against the exact torchvision
reference on the same drawn parameters: the draws themselves are the reference's; geometry within a
stated PSNR of the antialiased reference; every colour op equal up to the one uint8 rounding (blur:
plus its truncated kernel); each op's parameter distribution checked by a fixed-seed statistical
test; and the dataset contract (a sample's views depend only on (seed, epoch, index))."""

from __future__ import annotations

import math
import shutil

import cv2
import numpy as np
import pytest
import torch
from scipy import stats
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from pretrain.augment import build_view_transforms
from pretrain.augment import fast as F
from pretrain.augment import pipeline as A
from pretrain.data import ImageDataset, build_loader, collate, finish_views, set_loader_epoch

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CPU = torch.device("cpu")


@pytest.fixture
def train_root(synthetic_root):
    return synthetic_root / "imagenet" / "train"


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image, on the 0–255 scale."""
    mse = (a.double() - b.double()).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(255**2 / mse.clamp(min=1e-12))


def levels(view: torch.Tensor) -> torch.Tensor:
    """A normalised float view back on the 0–255 scale."""
    return (view * torch.tensor(STD).reshape(1, 3, 1, 1) + torch.tensor(MEAN).reshape(1, 3, 1, 1)) * 255


# -------------------------------------------------------------------------------- same draws


@pytest.mark.parametrize("preset", ["mocov2", "simclr", "byol"])
def test_the_fast_backend_draws_the_references_parameters_and_its_crops_are_close(train_root, preset):
    """Crops left for the device: the uniforms are the reference's bit for bit, the crops within
    the stated PSNR (synthetic shapes: sharp edges, the worst case for a non-antialiased resize)."""
    views = build_view_transforms(preset, 40)
    indices = list(range(0, 400, 9))
    ref, fast = (
        collate(ImageDataset(train_root, views, seed=3, colour_on_device=True, backend=b).__getitems__(indices))[0]
        for b in ("torchvision", "fast")
    )
    for (ref_crops, ref_u), (crops, u) in zip(ref, fast):
        assert torch.equal(u, ref_u) and crops.dtype == torch.uint8 and crops.shape == ref_crops.shape
        quality = psnr(crops, ref_crops)
        assert quality.min() > 25 and quality.median() > 35, (quality.min(), quality.median())


@pytest.mark.parametrize("scale", [(0.08, 1.0), (0.2, 1.0), (0.9, 1.0)])
def test_the_crop_box_and_flips_are_torchvisions_draws_exactly(scale):
    """FastView's own crop box and flip test against RandomResizedCrop.make_params and
    RandomHorizontalFlip on the same RNG state, fallback included (a strip that no aspect ratio
    fits), and the RNG left in the same state."""
    view = build_view_transforms("mocov2", 32, views=[{"crop": {"scale": list(scale)}, "hflip": {"p": 0.3}}])[0]
    fv = F.FastView(view)
    for k, (h, w) in enumerate([(375, 500), (460, 350), (33, 32), (20, 400), (400, 20)] * 40):
        torch.manual_seed(k)
        got = fv._crop_box(h, w)
        got_flip, got_next = torch.rand(1).item() < fv.flips[0][1], torch.rand(1)
        torch.manual_seed(k)
        box = fv.crop.make_params([torch.empty((3, h, w))])
        want_flip, want_next = not bool(torch.rand(1) >= 0.3), torch.rand(1)
        assert got == (box["top"], box["left"], box["height"], box["width"]), (h, w, k)
        assert got_flip == want_flip and torch.equal(got_next, want_next)


def test_geometry_within_the_stated_psnr_of_the_antialiased_resize():
    """Natural-looking content (smooth shading and a few edges), crops from 0.6× to 4× the output:
    bilinear without antialiasing up to 2×, area above (docs/augmentation.md)."""
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 300), torch.linspace(0, 1, 400), indexing="ij")
    base = torch.stack([xx, yy, (xx + yy) / 2]) * 200 + 20
    base += 25 * torch.sin(12 * xx + 7 * yy) + TF.gaussian_blur(torch.rand(3, 300, 400, generator=g), [9, 9]) * 40
    image = base.clamp(0, 255).round().to(torch.uint8)
    fv = F.FastView(build_view_transforms("mocov2", 64)[0])
    hwc = image.permute(1, 2, 0).numpy().copy()
    # measured 57.2, 56.6, 55.0, 53.5 dB; bilinear without the area filter at 4×: 49.6 dB
    for side, floor in ((40, 54), (90, 53), (125, 52), (256, 51)):  # factor 0.6, 1.4, 1.95, 4
        got = torch.from_numpy(fv._resized_crop(hwc, 10, 20, side, side)).permute(2, 0, 1)
        want = TF.resized_crop(image, 10, 20, side, side, [64, 64], antialias=True)
        assert psnr(got[None], want[None]).item() > floor, side


# -------------------------------------------------------------------------------- colour ops


def _crops(b=12, side=20, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (b, 3, side, side), generator=g, dtype=torch.uint8)
    x[:, :, :2] = x[:, :1, :2]  # gray rows: hue's chroma 0
    return x


def _fast_and_reference(ops, crops, seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    """(fast uint8 views, reference views on the 0–255 scale) of one view of ``ops``, same uniforms."""
    t = A.ViewTransform(ops, MEAN, STD)
    u = torch.rand(len(crops), t.n_uniforms, generator=torch.Generator().manual_seed(seed))
    drawn = [(c.permute(1, 2, 0).numpy().copy(), u[i]) for i, c in enumerate(crops)]
    return F.FastView(t).batch(drawn, colour=True), levels(t.finish(crops, u))


@pytest.mark.parametrize(
    "ops",
    [
        [v2.ColorJitter(brightness=0.8)],
        [v2.ColorJitter(contrast=0.8)],
        [v2.ColorJitter(saturation=0.8)],
        [v2.ColorJitter(hue=0.5)],
        [v2.ColorJitter(0.8, 0.8, 0.8, 0.2)],  # the four in each sample's order
        [v2.RandomGrayscale(p=0.5)],
        [v2.RandomSolarize(threshold=128, p=0.5)],
        [v2.ColorJitter(0.4, 0.4, 0.4, 0.1), v2.RandomGrayscale(p=0.5), v2.RandomSolarize(128, p=0.5)],
    ],
    ids=["brightness", "contrast", "saturation", "hue", "jitter", "grayscale", "solarize", "chain"],
)
def test_colour_ops_equal_the_reference_up_to_uint8_rounding(ops):
    """One rounding at the end: |fast − reference| ≤ 0.5 level (+ float32 slack)."""
    got, want = _fast_and_reference(ops, _crops())
    err = (got.double() - want.double()).abs()
    assert err.max() <= 0.5 + 2e-3, err.max()
    assert (got.double() - _crops().double()).abs().mean() > 2  # the op did change the images


def test_blur_equals_the_reference_up_to_rounding_and_its_truncated_kernel():
    """Kernel radius ⌈3σ⌉ instead of the declared kernel's: ≤ 1 level on random pixels (the worst
    case for a truncated tail), σ over the whole range."""
    crops = _crops(b=16, side=32)
    got, want = _fast_and_reference([v2.GaussianBlur(23, sigma=(0.1, 2.0))], crops)
    assert (got.double() - want.double()).abs().max() <= 1.0
    assert F.blur_kernel(2.0, 23).shape == (13, 1) and F.blur_kernel(0.3, 23).shape == (3, 1)
    assert F.blur_kernel(2.0, 7).shape == (7, 1)  # never wider than declared


@pytest.mark.parametrize("sigma", [0.1, 0.7, 1.3, 2.0, 3.0, 3.7])  # radius 1, 3, 4, 6, 9; 12: OpenCV's
@pytest.mark.parametrize("shape", [(3, 40, 33), (3, 9, 50), (3, 5, 5)])  # last: radius ≥ a side → OpenCV
def test_blur_is_opencvs_separable_filter_to_float_rounding(sigma, shape):
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    k = F.blur_kernel(sigma, 25)
    want = np.stack([cv2.sepFilter2D(p, -1, k, k, borderType=cv2.BORDER_REFLECT_101) for p in x])
    rounded = np.empty(shape, np.uint8)
    F.blur(x.copy(), k, out=rounded)  # the view's last op: rounded straight into the uint8 view
    F.blur(x, k)
    assert np.abs(x - want).max() < 1e-6
    separate = np.empty(shape, np.uint8)
    F._to_uint8(x.reshape(3, -1), separate.reshape(3, -1))
    assert np.array_equal(rounded, separate)


def test_whole_views_of_the_presets_match_the_reference_on_the_same_crops():
    crops = _crops(b=24, side=24, seed=5)
    for preset in ("mocov1", "mocov2", "simclr", "byol"):
        for view in build_view_transforms(preset, 24):
            got, want = _fast_and_reference(view.transforms[1:-2], crops, seed=2)  # the colour ops
            err = (got.double() - want.double()).abs()
            # blur's truncated kernel, and solarize flipping a pixel that sits on its threshold
            assert (err > 1).double().mean() < 1e-3 and err.mean() < 0.3, (preset, err.max())


# --------------------------------------------------------------------------- distributions


def test_each_ops_parameter_distribution_is_the_declared_one():
    """Fixed seed (cannot flake): what the fast backend applies, op by op, against the declared
    distribution: crop area and log aspect ratio uniform (KS), flips and every p binomial, jitter
    factors and blur σ uniform (KS), jitter orders uniform over the 24 permutations (χ²)."""
    n = 3000
    view = build_view_transforms("mocov2", 16, views=[{"crop": {"scale": [0.2, 0.5]}, "hflip": {}}])[0]
    fv = F.FastView(view)
    boxes = []
    ramp = np.broadcast_to(np.arange(16, dtype=np.uint8)[None, :, None], (16, 16, 3))  # brighter to the right
    fv._resized_crop = lambda image, top, left, h, w: (boxes.append((h, w)), ramp)[1]
    image = np.zeros((1000, 1000, 3), np.uint8)
    torch.manual_seed(0)
    flips = [int(fv.sample(image)[0][0, 0, 0] > 0) for _ in range(n)]  # mirrored: brighter to the left
    h, w = np.array(boxes, dtype=float).T
    assert stats.kstest(h * w / 1e6, stats.uniform(0.2, 0.3).cdf).pvalue > 1e-3
    assert stats.kstest(np.log(w / h), stats.uniform(math.log(3 / 4), math.log(16 / 9)).cdf).pvalue > 1e-3
    assert stats.binomtest(sum(flips), n, 0.5).pvalue > 1e-3

    colour = F.FastView(build_view_transforms("byol", 16)[1])
    p_jitter, p_gray, p_blur, p_solarize = colour.numpy_params(torch.rand(n, colour.transform.n_uniforms))
    for params, p in ((p_jitter, 0.8), (p_gray, 0.2), (p_blur, 0.1), (p_solarize, 0.2)):
        assert stats.binomtest(int(params["apply"].sum()), n, p).pvalue > 1e-3
    for j, (lo, hi) in enumerate(((0.6, 1.4), (0.6, 1.4), (0.8, 1.2), (-0.1, 0.1))):
        assert stats.kstest(p_jitter["factors"][:, j], stats.uniform(lo, hi - lo).cdf).pvalue > 1e-3
    orders = np.unique(p_jitter["order"], axis=0, return_counts=True)[1]
    assert len(orders) == 24 and stats.chisquare(orders).pvalue > 1e-3
    assert stats.kstest(p_blur["sigma"], stats.uniform(0.1, 1.9).cdf).pvalue > 1e-3


# ------------------------------------------------------------------------------ the dataset


def test_fast_views_are_uint8_and_finish_views_normalises_them(train_root):
    views = build_view_transforms("simclr", 24)
    ds = ImageDataset(train_root, views, seed=0, backend="fast")
    items = ds.__getitems__([3, 1, 4])
    batch, _, _ = collate(items)
    assert batch[0].dtype == torch.uint8 and batch[0].shape == (3, 3, 24, 24)
    assert batch[0].data_ptr() == items[0][0][0].data_ptr()  # collate takes the batch without a copy
    out = finish_views(batch, views, CPU)
    expected = TF.normalize(batch[1].float() / 255, list(MEAN), list(STD))
    assert out[1].dtype == torch.float32 and torch.allclose(out[1], expected, atol=1e-6)


def test_colour_left_for_a_cpu_device_gives_the_workers_views_bit_for_bit(train_root):
    views, indices = build_view_transforms("byol", 24), [4, 0, 77, 123]
    in_worker, left = (
        collate(ImageDataset(train_root, views, seed=1, backend="fast", colour_on_device=c).__getitems__(indices))[0]
        for c in (False, True)
    )
    assert isinstance(left[0], F.FastCrops) and left[0].crops.dtype == torch.uint8
    got, want = finish_views(left, views, CPU), finish_views(in_worker, views, CPU)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_fast_views_depend_only_on_seed_epoch_and_index(train_root, tmp_path):
    ds = ImageDataset(train_root, build_view_transforms("byol", 24), seed=5, backend="fast")
    ds.set_epoch(3)
    alone = ds[7][0]
    for batch in ([2, 7, 9], [9, 11, 7, 0, 1]):
        assert all(torch.equal(a, b) for a, b in zip(ds.__getitems__(batch)[batch.index(7)][0], alone))
    ds.set_epoch(4)
    assert not torch.equal(ds[7][0][0], alone[0])
    for cls in sorted(p.name for p in train_root.iterdir())[:2]:
        shutil.copytree(train_root / cls, tmp_path / cls)
    small = ImageDataset(tmp_path, build_view_transforms("mocov2", 16), seed=0, backend="fast")
    runs = []
    for batch, workers, start in ((4, 0, 0), (8, 2, 0), (4, 0, 2)):  # the last one resumes at batch 2
        loader = build_loader(small, batch, seed=1, num_workers=workers)
        set_loader_epoch(loader, 1, start)
        runs.append(torch.cat([b[0][0] for b in loader]))
    n = min(len(runs[0]), len(runs[1]))
    assert n >= 16 and torch.equal(runs[0][:n], runs[1][:n])
    assert torch.equal(runs[2], runs[0][8:])


def test_corrupt_and_non_jpeg_files_take_the_references_paths(train_root, tmp_path):
    from PIL import Image

    files = sorted(train_root.rglob("*.JPEG"))[:4]
    (tmp_path / "a").mkdir()
    for f in files:
        shutil.copy(f, tmp_path / "a" / f.name)
    truncated = tmp_path / "a" / files[1].name
    truncated.write_bytes(truncated.read_bytes()[: len(truncated.read_bytes()) // 2])
    Image.open(files[2]).save(tmp_path / "a" / "x.png")  # decoded by Pillow
    Image.open(files[2]).convert("L").save(tmp_path / "a" / "y.jpg")  # grayscale JPEG: libjpeg-turbo
    Image.open(files[3]).convert("CMYK").save(tmp_path / "a" / "z.jpg")  # CMYK JPEG: Pillow
    views = build_view_transforms("mocov2", 16)
    fast = ImageDataset(tmp_path, views, backend="fast", colour_on_device=True)
    ref = ImageDataset(tmp_path, views, colour_on_device=True, backend="torchvision")
    _, _, bad = fast[1]
    assert bad == [str(truncated)] == ref[1][2]
    for i in range(len(fast) - 3, len(fast)):  # x.png, y.jpg, z.jpg: the same pixels as Pillow's
        got, u = fast[i][0][0]
        want, ref_u = ref[i][0][0]
        assert torch.equal(u, ref_u) and psnr(got[None], want[None]).item() > 30


def test_views_made_as_each_jpeg_is_decoded_equal_the_staged_ones_bad_files_included(train_root, tmp_path):
    """Colour in the worker decodes each JPEG only when its views are made (the draws from the
    header's size): the same views, labels and bad paths as the staged path (colour left for the
    device, finished on CPU), with a truncated JPEG (good header, corrupt data), a PNG, a grayscale
    and a CMYK JPEG in the batch."""
    from PIL import Image

    files = sorted(train_root.rglob("*.JPEG"))[:6]
    (tmp_path / "a").mkdir()
    for f in files:
        shutil.copy(f, tmp_path / "a" / f.name)
    truncated = tmp_path / "a" / files[1].name
    truncated.write_bytes(truncated.read_bytes()[: len(truncated.read_bytes()) // 2])
    Image.open(files[2]).save(tmp_path / "a" / "x.png")
    Image.open(files[2]).convert("L").save(tmp_path / "a" / "y.jpg")
    Image.open(files[3]).convert("CMYK").save(tmp_path / "a" / "z.jpg")
    views = build_view_transforms("byol", 24)
    indices = list(range(9))[::-1]
    deferred, staged = (
        ImageDataset(tmp_path, views, seed=2, backend="fast", colour_on_device=c).__getitems__(indices)
        for c in (False, True)
    )
    got, labels, bad = collate(deferred)
    want, want_labels, want_bad = collate(staged)
    assert bad == want_bad == [str(truncated)] and torch.equal(labels, want_labels)
    assert all(torch.equal(a, b) for a, b in zip(finish_views(got, views, CPU), finish_views(want, views, CPU)))
