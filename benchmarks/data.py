"""The data path per core: two augmented views per JPEG against the bare decode rate, in one run.

    python -m benchmarks.data [--images 64] [--runs 5] [--out benchmarks/data.md]
        [--device cuda [--device-batch 256] [--device-only]]

A fixed set of generated JPEGs with ImageNet's sides and bytes (the synthetic classification scenes,
sides drawn in 350–460 px, under a 1/f texture, quality 90, ~110 KB; count, sizes and bytes in the
report), one pinned core
(``sched_setaffinity``, OMP_NUM_THREADS=1, ``torch.set_num_threads(1)``, OpenCV one thread), each
pipeline's images per second and its ratio to the bare decode rate measured in the same run
(median of ``--runs`` after a warm-up): bare decode, torchvision v2 per sample, the exact backend
(``data.backend: torchvision``), the fast backend (``data.backend: fast``), for MoCo v2 and SimCLR
at 224 px and MoCo v2 at 64 px; the decodes and the fast backend again on the same scenes without
the texture (the light set, ~35 KB: decodes faster, so a lower ratio); then the fast backend through
a DataLoader with 1 and 2 workers.

``--device DEV`` adds the device backends' section (``bench_device``), in the same run: the batched
JPEG decode alone on DEV, decode + two views with ``data.backend: device`` (the reference's crops
one image at a time) and with ``device_batched`` (roi_align over the batch), each as a ratio to the
decode, and the goal's verdict (two views at ≥ 50 % of the decode); ``--device-only`` skips the
per-core tables (a GPU machine's short window).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torchvision.io import decode_image, decode_jpeg  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from benchmarks import cpu_name  # noqa: E402
from contrastive_transfer.cli import atomic_write, write_text  # noqa: E402
from contrastive_transfer.images import check_image, open_rgb, read_image_bytes  # noqa: E402
from contrastive_transfer.synthetic.generate import render_classification  # noqa: E402
from pretrain.augment import build_view_transforms  # noqa: E402
from pretrain.data import ImageDataset, build_loader, collate, set_loader_epoch  # noqa: E402

OUT = Path(__file__).with_name("data.md")
SUFFIX = "(__getitems__ + collate)"


# The texture that brings the synthetic scenes to ImageNet's bytes: a 1/f amplitude spectrum (that of
# natural images), luma-dominated with weaker colour, its contrast drawn per image so that the bytes
# spread as photos' do. Constants chosen for a mean of ~110 KB at quality 90 (ImageNet's average).
TEXTURE_LUMA, TEXTURE_CHROMA, TEXTURE_SPREAD = 58.0, 15.0, (0.6, 1.4)


def pink_noise(rng: np.random.Generator, h: int, w: int, planes: int = 3) -> np.ndarray:
    """planes × h × w noise with amplitude ∝ 1/f, each plane of unit standard deviation."""
    fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
    f = np.hypot(fy, fx)
    f[0, 0] = np.inf  # no DC: the scene keeps its mean
    shape = (planes, h, w // 2 + 1)
    spectrum = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) / f
    noise = np.fft.irfft2(spectrum, s=(h, w), axes=(-2, -1))
    return noise / noise.std(axis=(1, 2), keepdims=True)


def write_images(root: Path, n: int) -> tuple[list[Path], list[Path]]:
    """n JPEGs of ImageNet's typical size (sides 350–460 px, quality 90), twice, one class folder
    each: ``root/light`` the synthetic scenes as rendered (flat shading: ~35 KB, which decodes
    about 1.6× faster than photos), ``root/photo`` the same scenes under 1/f texture, ImageNet's
    bytes (~110 KB). Deterministic: image i depends on i only."""
    from PIL import Image

    light = [root / "light" / "c" / f"{i:04d}.JPEG" for i in range(n)]
    photo = [root / "photo" / "c" / f"{i:04d}.JPEG" for i in range(n)]
    for i, (plain, textured) in enumerate(zip(light, photo)):
        render_classification((29, i), i % 10, (350, 460), plain)
        scene = np.asarray(open_rgb(plain), dtype=np.float32)
        rng = np.random.default_rng([29, i, 1])
        gain = rng.uniform(*TEXTURE_SPREAD)
        luma, c1, c2 = pink_noise(rng, *scene.shape[:2])
        texture = TEXTURE_LUMA * luma[..., None] + TEXTURE_CHROMA * np.stack([c1, c2, -c1 - c2], axis=-1)
        textured.parent.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(scene + gain * texture, 0, 255).round().astype(np.uint8)
        atomic_write(textured, lambda f, p=pixels: Image.fromarray(p).save(f, format="JPEG", quality=90))
    return photo, light


def rate(fn, n_images: int, runs: int) -> float:
    """Median images per second of fn() (which handles n_images), after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return n_images / statistics.median(times)


def interleaved(pipelines: list[tuple[str, object, int]], runs: int) -> list[tuple[str, float, float]]:
    """(name, median img/s, median ratio to pipelines[0]'s rate in the same round): every round
    times each pipeline once, so a load that comes and goes on a shared machine hits all of them."""
    for _, fn, _ in pipelines:
        fn()  # warm-up (numba's compiled kernels load, caches fill)
    rates: list[list[float]] = [[] for _ in pipelines]
    for _ in range(runs):
        for k, (_, fn, n) in enumerate(pipelines):
            t0 = time.perf_counter()
            fn()
            rates[k].append(n / (time.perf_counter() - t0))
    return [
        (name, statistics.median(r), statistics.median(x / d for x, d in zip(r, rates[0])))
        for (name, _, _), r in zip(pipelines, rates)
    ]


def v2_pipeline(recipe: str, size: int) -> v2.Compose:
    """The preset's view as plain torchvision v2 ops per sample (the views' transforms list)."""
    return v2.Compose(build_view_transforms(recipe, size)[0].transforms)


def bench_pipelines(root: Path, paths: list[Path], runs: int, full: bool = True) -> list[tuple[str, float, float]]:
    """The table's rows on the images of ``root``; ``full`` False: the decodes and the fast backend
    at 224 px only (the light set's block)."""
    from pretrain.augment.fast import decode_rgb

    data = [read_image_bytes(p) for p in paths]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    pipelines = [
        ("decode only: `torchvision.io.decode_jpeg`", lambda: [decode_jpeg(t) for t in tensors], len(data)),
        ("decode only: simplejpeg (the fast backend's)", lambda: [decode_rgb(d) for d in data], len(data)),
    ]
    few = tensors[:12]  # torchvision v2 per sample is slow: fewer images
    for recipe, size in (
        (("mocov2", 224), ("simclr", 224), ("mocov2", 64)) if full else (("mocov2", 224), ("simclr", 224))
    ):
        views = build_view_transforms(recipe, size)
        pipe = v2_pipeline(recipe, size)

        def per_sample(pipe=pipe):  # one decode, two views
            return [(pipe(image), pipe(image)) for image in map(decode_image, few)]

        if full:
            pipelines.append((f"{recipe} {size} px: torchvision v2 per sample", per_sample, len(few)))
        for backend in ("torchvision", "fast") if full else ("fast",):
            ds = ImageDataset(root, views, seed=0, backend=backend)
            batches = [list(range(i, min(i + 32, len(ds)))) for i in range(0, len(ds), 32)]
            pipelines.append(
                (
                    f"{recipe} {size} px: `data.backend: {backend}` {SUFFIX}",
                    lambda ds=ds, batches=batches: [collate(ds.__getitems__(b)) for b in batches],
                    len(ds),
                )
            )
    return interleaved(pipelines, runs)


def bench_workers(root: Path, runs: int) -> list[tuple[str, float]]:
    out = []
    for workers in (1, 2):
        ds = ImageDataset(root, build_view_transforms("mocov2", 224), seed=0, backend="fast")
        loader = build_loader(ds, min(16, len(ds)), num_workers=workers)

        def epoch(loader=loader):
            set_loader_epoch(loader, 0)
            for _ in loader:
                pass

        out.append(
            (
                f"mocov2 224 px, fast backend, DataLoader, {workers} worker(s), end to end",
                rate(epoch, len(loader) * loader.batch_size, runs),
            )
        )
    return out


# The device section's rows (its table and its verdict look them up by these names).
DECODE, EXACT, BATCHED = (
    "batched JPEG decode alone",
    "decode + two views, `data.backend: device` (the reference's crops, per image)",
    "decode + two views, `data.backend: device_batched` (roi_align, per batch)",
)


def device_batches(dataset: ImageDataset, batch: int) -> list:
    """The dataset's EncodedBatches of ``batch`` samples, its images repeated to fill the last (a
    GPU's batch may hold more images than the benchmark writes; the decode costs the same)."""
    count = max(1, -(-len(dataset) // batch))
    return [
        collate(dataset.__getitems__([(k * batch + j) % len(dataset) for j in range(batch)]))[0] for k in range(count)
    ]


def profile_ops(fn, device: torch.device, rows: int = 10) -> str:
    """torch.profiler's table of the ops of one ``fn()`` that take the most time on ``device``
    (self time: each op's own kernels): where the time of the path goes, from the same run."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def bench_device(root: Path, runs: int, device: torch.device, batch: int) -> tuple[list[tuple[str, float, float]], str]:
    """MoCo v2 at 224 px on ``device``, batches of ``batch``: the batched decode alone (the reference
    of the ratios; then each other decoder here), decode + two views with the per-image crops
    (``data.backend: device``) and with the batched ones (``device_batched``), the batched crops
    and flips without the colour stage, and the workers' share (read, JPEG header, draws) per core;
    then the profile of one batch of ``device_batched`` (``profile_ops``)."""
    from pretrain.augment.on_device import JPEG_DECODER, batched_crops, decode_images, decode_views, jpeg_decoders

    views = build_view_transforms("mocov2", 224)
    ds = ImageDataset(root, views, seed=0, backend="device")
    batches = device_batches(ds, batch)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def each_batch(fn):
        def run():
            for encoded in batches:
                fn(encoded)
            sync()

        return run

    decoders = sorted(jpeg_decoders().items(), key=lambda item: item[0] != JPEG_DECODER)  # the default first
    n = len(batches) * batch
    sizes = [tuple(t.geometric[0].size) for t in views]
    everything = list(range(len(ds)))
    batched = each_batch(lambda b: decode_views(b, views, device, geometry="batched"))
    rows = interleaved(
        [
            *(
                (
                    f"{DECODE} ({name})" if name == JPEG_DECODER else f"{DECODE} ({name}, not the default)",
                    each_batch(lambda b, decode=decode: decode([d for d in b.data if d.dim() == 1], device)),
                    n,
                )
                for name, decode in decoders
            ),
            (EXACT, each_batch(lambda b: decode_views(b, views, device, geometry="exact")), n),
            (BATCHED, batched, n),
            (
                "decode + the two views' crops and flips alone, `device_batched` (no colour stage)",
                each_batch(lambda b: batched_crops(decode_images(b, device), b.boxes, b.flips, sizes)),
                n,
            ),
            ("the workers' share (read, JPEG header, draws), one core", lambda: ds.__getitems__(everything), len(ds)),
        ],
        runs,
    )
    return rows, profile_ops(batched, device)


def device_verdict(rows) -> str:
    """The goal of the device path: two views at ≥ 50 % of the batched decode rate of the same run."""
    ratio = {name: r for name, _, r in rows}
    met = ratio[BATCHED] >= 0.5
    return (
        f"Goal {'met' if met else 'not met'}: decode + two views at {ratio[BATCHED]:.0%} of the batched decode "
        f"rate with `device_batched` (goal ≥ 50 %), {ratio[EXACT]:.0%} with `device`; batched over per-image "
        f"crops: {ratio[BATCHED] / ratio[EXACT]:.1f}×."
    )


def device_report(rows, profile: str, device: torch.device, batch: int, paths: list[Path], peak: str) -> list[str]:
    return [
        f"## Decode and views on {device} (`data.backend: device` and `device_batched`)",
        "",
        f"MoCo v2, two 224 px views per image, batches of {batch} ({describe(paths)}, repeated to fill",
        "a batch); a warm-up, then rounds that time every pipeline once (each ends in a device",
        f"synchronisation); the median rate and the median ratio to the batched decode of the same round.{peak}",
        "",
        "| pipeline | img/s | of the batched decode rate |",
        "|---|---|---|",
        *(f"| {name} | {r:,.0f} | {ratio:.0%} |" for name, r, ratio in rows),
        "",
        device_verdict(rows),
        "",
        f"Where `device_batched`'s time on {device} goes (one round of its batches, torch.profiler, ops by self time):",
        "",
        "```",
        *profile.rstrip().splitlines(),
        "```",
    ]


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores; load average before/after: {{load}}"


def describe(paths: list[Path]) -> str:
    """Count, sides and bytes of an image set."""

    sizes = [p.stat().st_size for p in paths]
    dims = [check_image(p) for p in paths]
    per_pixel = sum(sizes) / sum(w * h for w, h in dims)
    return (
        f"{len(paths)} JPEGs (quality 90), {min(w for w, _ in dims)}–{max(w for w, _ in dims)} × "
        f"{min(h for _, h in dims)}–{max(h for _, h in dims)} px, {min(sizes) / 1000:.0f}–{max(sizes) / 1000:.0f} KB "
        f"(mean {sum(sizes) / len(sizes) / 1000:.0f} KB, {per_pixel:.2f} bytes per pixel)"
    )


def verdict(results) -> str:
    """Whether the fast backend's two views at 224 px reach half the bare decode rate here."""
    ratios = {name.split(":")[0]: ratio for name, _, ratio in results if "224 px: `data.backend: fast`" in name}
    met = all(r >= 0.5 for r in ratios.values())
    return f"Goal {'met' if met else 'not met'} here: " + ", ".join(f"{k} {r:.0%}" for k, r in ratios.items()) + "."


def table(results) -> list[str]:
    lines = ["| pipeline | img/s | of the bare decode rate |", "|---|---|---|"]
    return lines + [f"| {name} | {r:,.0f} | {ratio:.0%} |" for name, r, ratio in results]


def report(results, light, workers, paths, light_paths, machine_line: str) -> str:
    lines = [
        "# The data path per core (`python -m benchmarks.data`)",
        "",
        f"Machine: {machine_line}. The machine was shared with other jobs while this ran: absolute rates",
        "are noisy, the ratios (measured in the same run, interleaved) are the figures to compare.",
        "One pinned core (sched_setaffinity, OMP_NUM_THREADS=1, torch.set_num_threads(1), OpenCV one thread);",
        "two views per image, collated batches of 32; a warm-up, then rounds that time every pipeline once;",
        "the median rate, and the median over rounds of the ratio to the bare decode rate of the same round.",
        "",
        "## ImageNet-like bytes",
        "",
        f"Images: {describe(paths)}: the synthetic classification scenes under a 1/f texture (the",
        "amplitude spectrum of natural images), so that the JPEGs have ImageNet's sides and bytes (its",
        "average JPEG is ~110 KB at ~470 × 390 px, 0.6 bytes per pixel). Decoding cost grows with the bytes:",
        "these decode at the rate photos do, which is the rate the goal is stated against.",
        "",
        *table(results),
    ]
    by_name = {name: ratio for name, _, ratio in results}

    def speedup(key: str) -> float:
        return (
            by_name[f"{key}: `data.backend: fast` {SUFFIX}"] / by_name[f"{key}: `data.backend: torchvision` {SUFFIX}"]
        )

    speedups = [f"{key}: {speedup(key):.1f}×" for key in ("mocov2 224 px", "simclr 224 px", "mocov2 64 px")]
    lines += [
        "",
        "Goal (issue 29): two views at 224 px ≥ 50 % of the bare decode rate per core; at 64 px no slower "
        f"than the exact backend. {verdict(results)} The fast backend over the exact one, same rounds: "
        f"{', '.join(speedups)}.",
        "",
        "## The light set (flat synthetic scenes)",
        "",
        f"Images: {describe(light_paths)}: the same scenes without the texture. Flat JPEGs decode much",
        "faster than photos while the augmentation costs the same per view, so the ratio is lower here;",
        "it is kept to show how much of the ratio the bytes account for.",
        "",
        *table(light),
        "",
        verdict(light),
        "",
        "End to end (ImageNet-like bytes; DataLoader workers, the main process only iterating):",
        "",
        "| pipeline | img/s |",
        "|---|---|",
    ]
    lines += [f"| {name} | {r:,.0f} |" for name, r in workers]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--device", help="also time data.backend=device on this device (cuda: tools/gpu_check.sh)")
    parser.add_argument(
        "--device-batch", type=int, help="--device's batch size (default: 256 on CUDA, a ResNet-50's; else --images)"
    )
    parser.add_argument("--device-only", action="store_true", help="with --device: that section alone")
    args = parser.parse_args(argv)
    if args.device_only and not args.device:
        parser.error("--device-only needs --device")
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths, light_paths = write_images(root, args.images)
        lines = []
        if not args.device_only:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core; workers inherit it
            results = bench_pipelines(root / "photo", paths, args.runs)
            light = bench_pipelines(root / "light", light_paths, args.runs, full=False)
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))  # workers: one core each
            workers = bench_workers(root / "photo", args.runs)
        if args.device:
            device = torch.device(args.device)
            batch = args.device_batch or (256 if device.type == "cuda" else args.images)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            rows, profile = bench_device(root / "photo", args.runs, device, batch)
            peak = (
                f" Peak device memory: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB."
                if device.type == "cuda"
                else ""
            )
            lines = device_report(rows, profile, device, batch, paths, peak)
        load = f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}"
        if args.device_only:
            text = (
                "\n".join(
                    [
                        "# The data path on the device (`python -m benchmarks.data --device-only`)",
                        "",
                        f"Machine: {machine().format(load=load)}.",
                        "",
                        *lines,
                    ]
                )
                + "\n"
            )
        else:
            text = report(results, light, workers, paths, light_paths, machine().format(load=load))
            text += "\n".join(["", *lines, ""]) if lines else ""
    write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
