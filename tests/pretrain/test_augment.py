"""pretrain.augment: each batched photometric op against torchvision's functional op applied one
sample at a time with the same parameters; the stages' parameter draws against the recipes of
docs/methods.md (Augmentation recipes); a whole view against a torchvision-functional reference; and per-sample
reproducibility whatever the batch composition, batch size or number of workers."""

import itertools
import math
import shutil
from collections import Counter

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from pretrain.augment import blur_kernel_size, build_view_transforms
from pretrain.augment import pipeline as A
from pretrain.data import ImageDataset, build_loader, set_loader_epoch

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# Float32 ops done in another order than torchvision (separable vs 2-D blur kernel, closed-form
# vs table HSV→RGB, r·x + (1−r)·y vs x·r + y·(1−r)) differ by a few ulps of 1 (≈1e-7 each).
ATOL = 1e-5


def images(b=6, h=20, w=24, seed=0):
    """Random RGB in [0, 1] with the hue edge cases: gray pixels, ties for the max, pure colours."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, 3, h, w, generator=g)
    x[:, :, :2] = x[:, :1, :2]  # gray rows (chroma 0)
    x[:, 1, 2:4] = x[:, 0, 2:4]  # r == g
    x[:, 2, 4:6] = x[:, 1, 4:6]  # g == b
    x[:, :, 6, :3] = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]).T  # pure R, G, B
    x[:, :, 7] = torch.rand(b, 3, w, generator=g).round()  # corners of the cube
    return x


def per_sample(fn, x, *params):
    return torch.stack([fn(x[i], *(float(p[i]) for p in params)) for i in range(x.shape[0])])


@pytest.mark.parametrize(
    "ours, theirs, lo, hi",
    [
        (A.adjust_brightness, TF.adjust_brightness, 0.0, 1.8),
        (A.adjust_contrast, TF.adjust_contrast, 0.0, 1.8),
        (A.adjust_saturation, TF.adjust_saturation, 0.0, 1.8),
        (A.adjust_hue, TF.adjust_hue, -0.5, 0.5),
    ],
)
def test_color_ops_equal_torchvision_per_sample(ours, theirs, lo, hi):
    x = images()
    factor = torch.linspace(lo, hi, x.shape[0])  # includes the ends (0: black / gray; ±0.5 hue)
    got = ours(x, factor)
    torch.testing.assert_close(got, per_sample(theirs, x, factor), atol=ATOL, rtol=0)
    assert got.shape == x.shape and got.min() >= 0 and got.max() <= 1


def test_hue_shift_of_a_full_turn_or_zero_is_identity_and_hues_move_as_expected():
    x = images()
    torch.testing.assert_close(A.adjust_hue(x, torch.zeros(6)), x, atol=ATOL, rtol=0)
    # Pure red shifted by 1/3 of a turn is pure green, by 2/3 pure blue (HSV definition).
    red = torch.tensor([1.0, 0.0, 0.0]).reshape(1, 3, 1, 1).expand(3, 3, 2, 2)
    out = A.adjust_hue(red, torch.tensor([1 / 3, -1 / 3, 0.5]))[:, :, 0, 0]
    torch.testing.assert_close(out, torch.tensor([[0.0, 1, 0], [0, 0, 1], [0, 1, 1]]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("side", [16, 24, 64])
def test_gaussian_blur_equals_torchvision_per_sample(side):
    k = blur_kernel_size(side)
    x = images(4, side, side + 6)
    sigma = torch.tensor([0.1, 0.7, 1.3, 2.0])
    got = A.gaussian_blur(x, k, sigma)
    ref = torch.stack([TF.gaussian_blur(x[i], [k, k], [float(s), float(s)]) for i, s in enumerate(sigma)])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_grayscale_and_solarize_stages_apply_torchvision_to_the_chosen_samples():
    x = images()
    apply = torch.tensor([True, False, True, True, False, False])
    gray = A.GrayscaleStage(v2.RandomGrayscale(p=0.2)).apply(x.clone(), {"apply": apply})
    ref = torch.stack([TF.rgb_to_grayscale(x[i], 3) if a else x[i] for i, a in enumerate(apply)])
    torch.testing.assert_close(gray, ref, atol=0, rtol=0)
    # The uint8 threshold (128) means the same as on the uint8 image: compare with torchvision on uint8.
    u8 = (x * 255).round().to(torch.uint8)
    sol = A.SolarizeStage(v2.RandomSolarize(threshold=128)).apply(
        TF.to_dtype(u8, torch.float32, scale=True), {"apply": apply}
    )
    ref = torch.stack([TF.solarize(u8[i], 128) if a else u8[i] for i, a in enumerate(apply)])
    torch.testing.assert_close(sol * 255, ref.float(), atol=1e-4, rtol=0)
    assert (ref != u8).any() and (ref == u8).any()  # some pixels above, some below the threshold


@pytest.mark.parametrize("path", ["apply", "apply_per_op"])  # CPU kernel (pretrain/augment/jitter_cpu.py), torch ops
def test_color_jitter_stage_applies_the_four_ops_in_each_samples_order(path):
    x = images(b=8)
    stage = A.ColorJitterStage(v2.ColorJitter(0.8, 0.8, 0.8, 0.2), p=0.8)
    perms = list(itertools.permutations(range(4)))
    params = {
        "apply": torch.tensor([True] * 7 + [False]),
        "order": torch.tensor([perms[i] for i in (0, 5, 11, 17, 23, 7, 13, 2)]),
        "brightness": torch.tensor([0.3, 1.7, 1.2, 0.8, 1.5, 0.5, 1.0, 1.6]),
        "contrast": torch.tensor([1.6, 0.4, 0.9, 1.8, 0.2, 1.1, 1.3, 0.3]),
        "saturation": torch.tensor([0.5, 1.4, 0.0, 1.2, 1.8, 0.7, 0.2, 1.5]),
        "hue": torch.tensor([0.2, -0.1, 0.05, -0.2, 0.15, 0.0, -0.05, 0.1]),
    }
    fns = [
        (TF.adjust_brightness, "brightness"),
        (TF.adjust_contrast, "contrast"),
        (TF.adjust_saturation, "saturation"),
        (TF.adjust_hue, "hue"),
    ]
    ref = []
    for i in range(8):
        y = x[i]
        if params["apply"][i]:
            for fn_id in params["order"][i].tolist():
                fn, name = fns[fn_id]
                y = fn(y, float(params[name][i]))
        ref.append(y)
    apply = getattr(stage, path)
    got = apply(x.clone(), params)
    torch.testing.assert_close(got, torch.stack(ref), atol=ATOL, rtol=0)
    # The order matters for these factors, so the check above did test it.
    reversed_order = dict(params, order=params["order"].flip(1))
    assert (apply(x.clone(), reversed_order)[:7] - got[:7]).abs().amax() > 0.05


@pytest.mark.parametrize("jitter", [(0.4, 0.4, 0.4, 0.4), (0.8, 0.8, 0.8, 0.2), (0.4, 0.0, 0.4, 0.0), (0, 0, 0, 0.5)])
def test_cpu_jitter_kernel_equals_the_torch_path_for_every_order(jitter):
    """The fused kernel against the per-op torch path on all 24 orders, drawn factors (hue shifts up
    to half a turn either way), disabled components (range 0: torchvision skips them) and skipped
    samples; the kernel writes in place."""
    x = images(b=48, h=9, w=11, seed=3)
    stage = A.ColorJitterStage(v2.ColorJitter(*jitter), p=0.9)
    params = stage.params(torch.rand(48, stage.n_uniforms, generator=torch.Generator().manual_seed(1)))
    params["order"] = torch.tensor(list(itertools.permutations(range(4))) * 2)
    assert (~params["apply"]).any() and params["apply"].any()
    expected = stage.apply_per_op(x.clone(), params)
    y = x.clone()
    got = stage.apply(y, params)
    assert got.data_ptr() == y.data_ptr()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[~params["apply"]], x[~params["apply"]], atol=0, rtol=0)


# Recipe values written from docs/methods.md (Augmentation recipes) (jitter strengths, probabilities, σ range).
RECIPE_DRAWS = {
    ("mocov1", 0): {"gray": 0.2, "jitter": (1.0, 0.4, 0.4, 0.4, 0.4)},  # gray before jitter
    ("mocov2", 0): {"jitter": (0.8, 0.4, 0.4, 0.4, 0.1), "gray": 0.2, "blur": 0.5},
    ("simclr", 0): {"jitter": (0.8, 0.8, 0.8, 0.8, 0.2), "gray": 0.2, "blur": 0.5},
    ("byol", 0): {"jitter": (0.8, 0.4, 0.4, 0.2, 0.1), "gray": 0.2, "blur": 1.0, "solarize": 0.0},
    ("byol", 1): {"jitter": (0.8, 0.4, 0.4, 0.2, 0.1), "gray": 0.2, "blur": 0.1, "solarize": 0.2},
}
STAGE_NAMES = {
    A.ColorJitterStage: "jitter",
    A.GrayscaleStage: "gray",
    A.GaussianBlurStage: "blur",
    A.SolarizeStage: "solarize",
}


@pytest.mark.parametrize("recipe, view", sorted(RECIPE_DRAWS))
def test_parameter_draws_follow_the_recipe(recipe, view):
    t = build_view_transforms(recipe, 64)[view]
    expected = RECIPE_DRAWS[recipe, view]
    assert [STAGE_NAMES[type(s)] for s in t.stages] == list(expected)
    n = 20000
    u = torch.rand(n, t.n_uniforms, generator=torch.Generator().manual_seed(1))
    for stage, params in zip(t.stages, t.params(u)):
        name = STAGE_NAMES[type(stage)]
        p = expected[name][0] if name == "jitter" else expected[name]
        rate = params["apply"].double().mean().item()
        assert abs(rate - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-12, (name, rate, p)
        if name == "jitter":
            for key, strength in zip(("brightness", "contrast", "saturation"), expected[name][1:4]):
                v = params[key]
                assert v.min() >= 1 - strength and v.max() <= 1 + strength
                assert v.min() < 1 - 0.99 * strength and v.max() > 1 + 0.99 * strength
            hue = params["hue"]
            assert hue.abs().max() <= expected[name][4] and hue.abs().max() > 0.99 * expected[name][4]
            counts = Counter(tuple(o) for o in params["order"].tolist())
            assert set(counts) == set(itertools.permutations(range(4)))  # every order occurs,
            assert all(abs(c - n / 24) < 5 * math.sqrt(n / 24) for c in counts.values())  # equally often
        if name == "blur":
            assert params["sigma"].min() >= 0.1 and params["sigma"].max() <= 2.0
            assert stage.kernel_size == blur_kernel_size(64) == 7


@pytest.mark.parametrize("recipe, view", [("mocov1", 0), ("simclr", 0), ("byol", 1)])
def test_finish_equals_torchvision_functional_reference(recipe, view):
    """The batched stage 2 against torchvision's functional ops, one sample at a time, in the
    recipe's order, with the parameters the uniforms encode; then Normalize."""
    t = build_view_transforms(recipe, 24)[view]
    b = 64
    crops = (images(b, 24, 24, seed=3) * 255).round().to(torch.uint8)
    u = torch.rand(b, t.n_uniforms, generator=torch.Generator().manual_seed(2))
    fns = [
        (TF.adjust_brightness, "brightness"),
        (TF.adjust_contrast, "contrast"),
        (TF.adjust_saturation, "saturation"),
        (TF.adjust_hue, "hue"),
    ]
    ref = []
    for i in range(b):
        y = TF.to_dtype(crops[i], torch.float32, scale=True)
        for stage, params in zip(t.stages, t.params(u[i : i + 1])):
            if not params["apply"][0]:
                continue
            name = STAGE_NAMES[type(stage)]
            if name == "jitter":
                for fn_id in params["order"][0].tolist():
                    fn, key = fns[fn_id]
                    y = fn(y, float(params[key][0]))
            elif name == "gray":
                y = TF.rgb_to_grayscale(y, 3)
            elif name == "blur":
                s = float(params["sigma"][0])
                y = TF.gaussian_blur(y, [stage.kernel_size] * 2, [s, s])
            else:
                y = TF.solarize(y, 128 / 255)
        ref.append(TF.normalize(y, MEAN, STD))
    torch.testing.assert_close(t.finish(crops, u), torch.stack(ref), atol=ATOL / min(STD), rtol=0)


def test_flip_commutes_with_every_colour_op():
    """Why the recipes' trailing flip may run before the colour ops (stage 1)."""
    x, flip = images(4, 16, 20), lambda y: y.flip(-1)
    f = torch.tensor([0.3, 0.9, 1.4, 1.8])
    for op, p in [
        (A.adjust_brightness, f),
        (A.adjust_contrast, f),
        (A.adjust_saturation, f),
        (A.adjust_hue, f - 1.3),
        (lambda y, s: A.gaussian_blur(y, 5, s), f),
    ]:
        torch.testing.assert_close(op(flip(x), p), flip(op(x, p)), atol=ATOL, rtol=0)


def test_single_image_call_equals_batched_finish_of_its_draws():
    t = build_view_transforms("simclr", 24)[0]
    image = (images(1, 40, 50, seed=4)[0] * 255).to(torch.uint8)
    torch.manual_seed(7)
    single = t(image)
    torch.manual_seed(7)
    crop, u = t.sample(image)
    assert crop.dtype == torch.uint8 and crop.shape == (3, 24, 24) and u.shape == (t.n_uniforms,)
    others = torch.randint(0, 256, (5, 3, 24, 24), dtype=torch.uint8)
    batch = t.finish(
        torch.cat([others[:2], crop[None], others[2:]]),
        torch.cat([torch.rand(2, t.n_uniforms), u[None], torch.rand(3, t.n_uniforms)]),
    )
    assert type(single) is torch.Tensor and torch.equal(batch[2], single)


def test_view_transform_rejects_ops_it_cannot_split():
    with pytest.raises(ValueError, match="RandomErasing"):  # works on float images: no stage for it
        A.ViewTransform([v2.RandomErasing()], MEAN, STD)
    # Geometric ops listed after colour ops still run first, on uint8 (the declared semantics).
    t = A.ViewTransform([v2.RandomGrayscale(), v2.RandomResizedCrop(16)], MEAN, STD)
    assert [type(op) for op in t.geometric] == [v2.RandomResizedCrop]
    with pytest.raises(ValueError, match="square kernel"):
        A.ViewTransform([v2.GaussianBlur((3, 5))], MEAN, STD)


# ------------------------------------------------------------------ reproducibility in the data


@pytest.fixture
def train_root(synthetic_root):
    return synthetic_root / "imagenet" / "train"


def test_a_samples_views_do_not_depend_on_its_batch(train_root):
    ds = ImageDataset(train_root, build_view_transforms("byol", 24), seed=5, backend="torchvision")
    ds.set_epoch(3)
    alone = ds[7][0]
    for batch in ([7], [2, 7, 9], [9, 11, 7, 0, 1, 2, 3, 4]):
        views = ds.__getitems__(batch)[batch.index(7)][0]
        assert all(torch.equal(a, b) for a, b in zip(views, alone)), batch
    assert not torch.equal(ds.__getitems__([8])[0][0][0], alone[0])


def test_loader_views_are_the_same_for_any_batch_size_and_worker_count(train_root, tmp_path):
    for cls in sorted(p.name for p in train_root.iterdir())[:2]:  # two classes keep the test short
        shutil.copytree(train_root / cls, tmp_path / cls)
    ds = ImageDataset(tmp_path, build_view_transforms("simclr", 16), seed=0, backend="torchvision")
    runs = []
    for batch, workers in ((4, 0), (12, 2)):
        loader = build_loader(ds, batch, seed=1, num_workers=workers)
        set_loader_epoch(loader, 1)
        batches = list(loader)
        runs.append([torch.cat([b[0][v] for b in batches]) for v in range(2)] + [torch.cat([b[1] for b in batches])])
    # Both runs walk the same permutation; each keeps only whole batches, so compare the common prefix.
    n = min(len(r[2]) for r in runs)
    assert n >= 12 and runs[0][0].shape[1:] == (3, 16, 16)
    assert all(torch.equal(a[:n], b[:n]) for a, b in zip(runs[0], runs[1]))
