"""The data path per core: two augmented views per JPEG against the bare decode rate, in one run.

    python -m benchmarks.data [--images 64] [--runs 5] [--out benchmarks/data.md]

A fixed set of generated ImageNet-sized JPEGs (the synthetic classification renderer, sides drawn
in 350–460 px, quality 90; count, sizes and bytes in the report), one pinned core
(``sched_setaffinity``, OMP_NUM_THREADS=1, ``torch.set_num_threads(1)``, OpenCV one thread), each
pipeline's images per second and its ratio to the bare decode rate measured in the same run
(median of ``--runs`` after a warm-up): bare decode, torchvision v2 per sample, the exact backend
(``data.backend: torchvision``), the fast backend (``data.backend: fast``), for MoCo v2 and SimCLR
at 224 px and MoCo v2 at 64 px; then the fast backend through a DataLoader with 1 and 2 workers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import torch  # noqa: E402
from torchvision.io import decode_image, decode_jpeg  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from benchmarks import cpu_name  # noqa: E402
from contrastive_transfer.synthetic.generate import render_classification  # noqa: E402
from pretrain.augment import build_view_transforms  # noqa: E402
from pretrain.data import ImageDataset, build_loader, collate, set_loader_epoch  # noqa: E402

OUT = Path(__file__).with_name("data.md")
SUFFIX = "(__getitems__ + collate)"


def write_images(root: Path, n: int) -> list[Path]:
    """n JPEGs of ImageNet's typical size (sides 350–460 px, quality 90), one class folder."""
    paths = [root / "c" / f"{i:04d}.JPEG" for i in range(n)]
    for i, path in enumerate(paths):
        render_classification((29, i), i % 10, (350, 460), path)
    return paths


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


def bench_pipelines(root: Path, paths: list[Path], runs: int) -> list[tuple[str, float, float]]:
    from pretrain.augment.fast import decode_rgb

    data = [p.read_bytes() for p in paths]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    pipelines = [
        ("decode only: `torchvision.io.decode_jpeg`", lambda: [decode_jpeg(t) for t in tensors], len(data)),
        ("decode only: simplejpeg (the fast backend's)", lambda: [decode_rgb(d) for d in data], len(data)),
    ]
    few = tensors[:12]  # torchvision v2 per sample is slow: fewer images
    for recipe, size in (("mocov2", 224), ("simclr", 224), ("mocov2", 64)):
        views = build_view_transforms(recipe, size)
        pipe = v2_pipeline(recipe, size)

        def per_sample(pipe=pipe):  # one decode, two views
            return [(pipe(image), pipe(image)) for image in map(decode_image, few)]

        pipelines.append((f"{recipe} {size} px: torchvision v2 per sample", per_sample, len(few)))
        for backend in ("torchvision", "fast"):
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
        loader = build_loader(ds, 16, num_workers=workers)

        def epoch(loader=loader):
            set_loader_epoch(loader, 0)
            for _ in loader:
                pass

        out.append(
            (
                f"mocov2 224 px, fast backend, DataLoader, {workers} worker(s), end to end",
                rate(epoch, len(loader) * 16, runs),
            )
        )
    return out


def bench_device(root: Path, runs: int, device: torch.device) -> list[tuple[str, float, float]]:
    """``data.backend: device``, MoCo v2 at 224 px, batches of 32: the workers' share (read, JPEG
    header, draws) and the device's (batched decode, crops, colour, normalisation), each alone."""
    from pretrain.data import finish_views

    views = build_view_transforms("mocov2", 224)
    ds = ImageDataset(root, views, seed=0, backend="device")
    batches = [collate(ds.__getitems__(list(range(i, min(i + 32, len(ds)))))) for i in range(0, len(ds), 32)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def on_device():
        for batch in batches:
            finish_views(batch[0], views, device)
        sync()

    return interleaved(
        [
            (
                "mocov2 224 px, `data.backend: device`: workers' share",
                lambda: ds.__getitems__(list(range(len(ds)))),
                len(ds),
            ),
            (f"mocov2 224 px, `data.backend: device`: decode + views on {device}", on_device, len(ds)),
        ],
        runs,
    )


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores; load average before/after: {{load}}"


def report(results, workers, paths, machine_line: str) -> str:
    sizes = [p.stat().st_size for p in paths]
    from PIL import Image

    dims = [Image.open(p).size for p in paths]
    lines = [
        "# The data path per core (`python -m benchmarks.data`)",
        "",
        f"Machine: {machine_line}. The machine was shared with other jobs while this ran: absolute rates",
        "are noisy, the ratios (measured in the same run, interleaved) are the figures to compare.",
        f"Images: {len(paths)} generated JPEGs (synthetic shapes, quality 90), {min(w for w, _ in dims)}–"
        f"{max(w for w, _ in dims)} × {min(h for _, h in dims)}–{max(h for _, h in dims)} px, "
        f"{min(sizes) // 1000}–{max(sizes) // 1000} KB (mean {sum(sizes) // len(sizes) // 1000} KB; "
        "ImageNet's average is ~110 KB).",
        "One pinned core (sched_setaffinity, OMP_NUM_THREADS=1, torch.set_num_threads(1), OpenCV one thread);",
        "two views per image, collated batches of 32; a warm-up, then rounds that time every pipeline once;",
        "the median rate, and the median over rounds of the ratio to the bare decode rate of the same round.",
        "",
        "| pipeline | img/s | of the bare decode rate |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {r:,.0f} | {ratio:.0%} |" for name, r, ratio in results]
    by_name = {name: ratio for name, _, ratio in results}

    def speedup(key: str) -> float:
        return (
            by_name[f"{key}: `data.backend: fast` {SUFFIX}"] / by_name[f"{key}: `data.backend: torchvision` {SUFFIX}"]
        )

    speedups = [f"{key}: {speedup(key):.1f}×" for key in ("mocov2 224 px", "simclr 224 px", "mocov2 64 px")]
    lines += [
        "",
        "Goal (issue 29): two views at 224 px ≥ 50 % of the bare decode rate per core; at 64 px no slower "
        f"than the exact backend. The fast backend over the exact one, same rounds: {', '.join(speedups)}.",
        "",
        "End to end (DataLoader workers, the main process only iterating):",
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
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_images(root, args.images)
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core; workers inherit it
        results = bench_pipelines(root, paths, args.runs)
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))  # workers: one core each
        workers = bench_workers(root, args.runs)
        if args.device:
            workers += [(name, r) for name, r, _ in bench_device(root, args.runs, torch.device(args.device))]
        load = f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}"
        text = report(results, workers, paths, machine().format(load=load))
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
