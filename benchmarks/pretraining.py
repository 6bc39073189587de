"""python -m benchmarks.pretraining [--recipes tiny_mocov2,...] [--steps N] [--out benchmarks/pretrain.md]

Figures, not pass/fail. Per recipe (each in a fresh process, so peak memory and Accelerate's
process-wide state are its own):

* engine step: steady-state wall time per step of the real loop (``pretrain.engine.train``), from
  two runs of W and W+N steps, minus the data time the engine itself logs; images/s; peak memory
  (peak RSS on CPU, peak allocated on CUDA);
* bare step: the same method, optimizer and batch in a plain ``forward → backward → step →
  after_step`` loop on an in-memory batch; the ratio engine / bare is the engine's overhead
  (goal ≤ 1.05);
* backbone step: forward + backward of the backbone alone on every view, for scale: bare /
  backbone is what the method itself adds (heads, key encoders, queues, gathers, losses).

Then, per augmentation recipe, two-view throughput of our pipeline (decode once to uint8, crop and
flip per sample, colour ops batched over AUG_BATCH images with per-sample parameters, as the
DataLoader fetches a batch; collate included) against a plain torchvision PIL pipeline of the same
recipe (transforms v1, decode once per image, ToTensor + Normalize), on the configured image folder
(goal ≥ 1.5×).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from contrastive_transfer.cli import write_text
from contrastive_transfer.json_limits import read_json_lines

RECIPES_DIR = Path(__file__).resolve().parents[1] / "configs" / "pretrain"
AUG_BATCH = 32  # images per DataLoader fetch in the augmentation benchmark (a small per-process batch)


# ------------------------------------------------------------------------------- one recipe
def _median_time(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _engine_seconds(recipe: str, overrides: list[str], warmup: int, steps: int, log_every: int) -> tuple[float, float]:
    """Per-step wall time of the real loop without data loading, and the data time per step: the
    medians of the engine's own ``step_time`` and ``data_time`` (means over each row's window of
    ``log_every`` steps) over the rows after ``warmup`` steps. A row step ends in a read of the
    device, so the time is the device's too, not only the launch.

    Not the difference of two whole runs minus their data time: on a GPU the data time of a tiny
    recipe (num_workers 0) is seconds per step against milliseconds of compute, and that
    difference came out negative on an H200."""
    from accelerate import Accelerator

    from pretrain.config import load_config
    from pretrain.engine import train

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            RECIPES_DIR / f"{recipe}.yaml",
            [
                *overrides,
                f"train.output_dir={out}",
                f"train.max_steps={warmup + steps}",
                f"train.log_every={log_every}",
                "train.checkpoint_every=1000000",
                "train.resume=none",
                "knn.train_dir=null",
            ],
        )
        train(cfg, Accelerator(cpu=cfg.train.cpu, mixed_precision=cfg.train.mixed_precision))
        rows = read_json_lines(Path(out, "metrics.jsonl"))
    rows = [r for r in rows if "loss" in r and r["step"] > warmup]
    return statistics.median(r["step_time"] for r in rows), statistics.median(r["data_time"] for r in rows)


def largest_batch(step_at, sizes: list[int]) -> int:
    """The first of ``sizes`` (largest first) at which ``step_at(size)`` runs without running out of
    device memory: the largest per-GPU batch that fits."""
    for size in sizes:
        try:
            step_at(size)
            return size
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    raise SystemExit(f"error: not even a batch of {sizes[-1]} fits in the device's memory")


def batch_sizes(max_batch: int) -> list[int]:
    """max_batch, then down by quarters of the next power of two: 256, 192, 128, 96, 64, 48, ..."""
    sizes, b = [max_batch], max_batch
    while b > 1:
        b = b * 3 // 4 if b & (b - 1) == 0 else 1 << (b.bit_length() - 1)
        sizes.append(b)
    return sorted(set(sizes), reverse=True)


def _fit_batch(recipe: str, overrides: list[str], max_batch: int) -> int:
    """--batch auto: the largest per-process batch up to max_batch whose bare step fits."""
    from pretrain.config import load_config
    from pretrain.methods import METHODS
    from pretrain.optim import build_optimizer

    cfg = load_config(RECIPES_DIR / f"{recipe}.yaml", overrides)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.train.cpu else "cpu")
    if device.type != "cuda":
        return max_batch  # the host's memory is not what limits a CPU run's batch
    method = METHODS[cfg.method.name](cfg, 1).to(device, memory_format=torch.channels_last).train()
    optimizer, size = build_optimizer(method, cfg), cfg.data.image_size
    labels = torch.zeros(max_batch, dtype=torch.long, device=device)

    def step_at(batch: int) -> None:
        views = [torch.randn(batch, 3, size, size, device=device) for _ in method.view_transforms(cfg)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = method(views, labels[:batch]) if method.needs_labels else method(views)
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    return largest_batch(step_at, batch_sizes(max_batch))  # the caches are emptied when this returns


def bench_recipe(recipe: str, overrides: list[str], warmup: int, steps: int, log_every: int = 1) -> dict:
    from pretrain.config import load_config
    from pretrain.data import ImageDataset, build_loader, collate, finish_views
    from pretrain.engine import gpu_settings
    from pretrain.methods import METHODS
    from pretrain.optim import build_optimizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    cfg = load_config(RECIPES_DIR / f"{recipe}.yaml", overrides)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.train.cpu else "cpu")
    torch.manual_seed(0)
    method = METHODS[cfg.method.name](cfg, 1).to(device).train()
    speed = gpu_settings(cfg, method, device)  # the engine's channels_last / cudnn / compile settings
    optimizer = build_optimizer(method, cfg)
    dataset = ImageDataset(cfg.data.root, method.view_transforms(cfg), seed=0, backend="torchvision")  # float views
    views, labels, _ = next(iter(build_loader(dataset, cfg.train.batch_size)))
    views = [v.to(device, memory_format=speed.memory_format) for v in views]
    labels = labels.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # the engine's precision in the reference too, so that engine/bare compares loops, not dtypes
    # (fp16 without the engine's loss scaling: a timing, whose gradients nobody reads)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)

    def engine_precision():
        return torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None)

    def bare_step():
        with engine_precision():
            loss = (method(views, labels) if method.needs_labels else method(views))["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        method.after_step(skipped=False)
        sync()

    backbone = method.backbone

    def backbone_step():  # in the engine's precision too, like bare_step
        with engine_precision():
            loss = sum(backbone(v).float().pow(2).mean() for v in views)
        loss.backward()
        sync()

    # The data path alone, in this one process (a worker's share per core: decode, views, collate)
    # plus finish_views on the device, with the recipe's data.backend: images/s beside the step's.
    data_set = ImageDataset(cfg.data.root, method.view_transforms(cfg), seed=0, backend=cfg.data.backend)
    batch = cfg.train.batch_size
    starts = range(0, min(len(data_set), 2 * batch) - batch + 1, batch)

    def data_path():
        for start in starts:
            views_b = collate(data_set.__getitems__(list(range(start, start + batch))))[0]
            finish_views(views_b, data_set.views, device, speed.memory_format)
        sync()

    data_s = _median_time(data_path, 1, 3)
    bare = _median_time(bare_step, warmup, steps)
    backbone_only = _median_time(backbone_step, warmup, steps)
    engine, data_wait = _engine_seconds(recipe, overrides, warmup, steps, log_every)
    images = cfg.train.batch_size
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "recipe": recipe,
        "method": cfg.method.name,
        "arch": cfg.model.arch,
        "image_size": cfg.data.image_size,
        "batch": images,
        "views": len(views),
        "device": device.type,
        "channels_last": speed.channels_last,
        "compiled": speed.compiled,
        "engine_s": engine,
        "data_wait_s": data_wait,
        "data_backend": cfg.data.backend,
        "workers": cfg.data.num_workers,
        "bare_s": bare,
        "backbone_s": backbone_only,
        "images_per_s": images / engine,
        "data_images_per_s": len(starts) * batch / data_s,
        "peak_mib": peak,
        "engine_over_bare": engine / bare,
        "bare_over_backbone": bare / backbone_only,
    }


# ------------------------------------------------------------------------------- augmentations
def _pil_pipelines(recipe: str, size: int) -> list:
    """The same recipe's two view transforms with torchvision transforms v1 on PIL images (the
    common baseline)."""
    from torchvision import transforms as T

    from contrastive_transfer.contract import IMAGENET_MEAN, IMAGENET_STD
    from pretrain.augment import SIGMA, blur_kernel_size

    blur = T.GaussianBlur(blur_kernel_size(size), sigma=SIGMA)
    tail = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if recipe == "byol":
        byol = [
            T.RandomResizedCrop(size, scale=(0.08, 1.0), interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(),
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], 0.8),
            T.RandomGrayscale(0.2),
        ]
        return [
            T.Compose([*byol, T.RandomApply([blur], 1.0), *tail]),
            T.Compose([*byol, T.RandomApply([blur], 0.1), T.RandomSolarize(128, 0.2), *tail]),
        ]
    ops = {
        "mocov1": [
            T.RandomResizedCrop(size, scale=(0.2, 1.0)),
            T.RandomGrayscale(0.2),
            T.ColorJitter(0.4, 0.4, 0.4, 0.4),
            T.RandomHorizontalFlip(),
        ],
        "mocov2": [
            T.RandomResizedCrop(size, scale=(0.2, 1.0)),
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], 0.8),
            T.RandomGrayscale(0.2),
            T.RandomApply([blur], 0.5),
            T.RandomHorizontalFlip(),
        ],
        "simclr": [
            T.RandomResizedCrop(size, scale=(0.08, 1.0)),
            T.RandomHorizontalFlip(),
            T.RandomApply([T.ColorJitter(0.8, 0.8, 0.8, 0.2)], 0.8),
            T.RandomGrayscale(0.2),
            T.RandomApply([blur], 0.5),
        ],
    }[recipe]
    return [T.Compose([*ops, *tail])] * 2


def bench_augmentation(recipe: str, root: str, size: int, n_images: int) -> dict:
    from PIL import Image

    from pretrain.augment import build_view_transforms
    from pretrain.data import ImageDataset, collate

    torch.manual_seed(0)
    ours = ImageDataset(root, build_view_transforms(recipe, size), seed=0, backend="torchvision")
    paths = [p for p, _ in ours.samples[:n_images]]
    plain = _pil_pipelines(recipe, size)

    def run_ours():  # what a DataLoader worker does per batch: __getitems__, then collate
        for start in range(0, len(paths), AUG_BATCH):
            collate(ours.__getitems__(list(range(start, min(start + AUG_BATCH, len(paths))))))

    def run_plain():  # MoCo's TwoCropsTransform: one PIL decode, each view transform applied to it
        # (a plain Image.open, as MoCo's loader does: the baseline timed, on images this benchmark
        # rendered itself; the project's own loader above goes through the gate)
        for p in paths:
            with Image.open(p) as im:
                image = im.convert("RGB")
            for view in plain:
                view(image)

    deferred = ImageDataset(
        root, build_view_transforms(recipe, size), seed=0, colour_on_device=True, backend="torchvision"
    )

    def run_deferred():  # a worker that leaves the colour stage to the GPU (data.colour_on_device)
        for start in range(0, len(paths), AUG_BATCH):
            collate(deferred.__getitems__(list(range(start, min(start + AUG_BATCH, len(paths))))))

    def sent_bytes(dataset) -> float:  # per image, all views, as the worker hands them to the main process
        views, _, _ = collate(dataset.__getitems__(list(range(AUG_BATCH))))
        return (
            sum(sum(t.numel() * t.element_size() for t in (v if isinstance(v, tuple) else (v,))) for v in views)
            / AUG_BATCH
        )

    t_ours = _median_time(run_ours, 1, 3)
    t_plain = _median_time(run_plain, 1, 3)
    t_deferred = _median_time(run_deferred, 1, 3)
    return {
        "augmentation": recipe,
        "image_size": size,
        "images": len(paths),
        "ours_per_s": len(paths) / t_ours,
        "plain_per_s": len(paths) / t_plain,
        "speedup": t_plain / t_ours,
        "worker_ms": 1e3 * t_ours / len(paths),
        "deferred_worker_ms": 1e3 * t_deferred / len(paths),
        "bytes": sent_bytes(ours),
        "deferred_bytes": sent_bytes(deferred),
    }


# ------------------------------------------------------------------------------- report
def _report(rows: list[dict], aug: list[dict], args) -> str:
    lines = [
        "# Pretraining benchmark",
        "",
        f"`python -m benchmarks.pretraining {' '.join(sys.argv[1:])}` on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}; "
        f"median of {args.steps} steps after {args.warmup} warm-up steps"
        + (f"; GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "; no GPU")
        + ".",
        "",
        "Engine = the real loop (`pretrain.engine.train`) minus its logged data time; bare = the method's "
        "forward/backward/step/after_step on an in-memory batch; backbone = the backbone's forward/backward "
        "on every view. Goal: engine / bare ≤ 1.05. Data img/s: the data path alone in one process "
        "(`data.backend` of the recipe: decode, views, collate, then the device's share), per core.",
        "",
        "| recipe | method | arch | px | batch | views | device | channels_last | compiled | data backend, "
        "workers | engine ms/step | images/s | data wait ms/step | data img/s | bare ms | engine/bare | "
        "backbone ms | bare/backbone | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['method']} | {r['arch']} | {r['image_size']} | {r['batch']} | {r['views']} | "
            f"{r['device']} | {r['channels_last']} | {r['compiled']} | {r.get('data_backend', '-')}, "
            f"{r.get('workers', '-')} | {1e3 * r['engine_s']:.1f} | {r['images_per_s']:.1f} | "
            f"{1e3 * r.get('data_wait_s', float('nan')):.1f} | {r.get('data_images_per_s', float('nan')):.1f} | "
            f"{1e3 * r['bare_s']:.1f} | {r['engine_over_bare']:.3f} | {1e3 * r['backbone_s']:.1f} | "
            f"{r['bare_over_backbone']:.2f} | {r['peak_mib']:.0f} |"
        )
    lines += against_supervised(rows)
    if not aug:  # --no-augmentation: no empty tables
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "Two-view augmentation throughput (images/s, each image giving two views; decode included; "
        f"ours fetched in batches of {AUG_BATCH} and collated). Goal: ours / plain PIL ≥ 1.5.",
        "",
        "| augmentation | px | images | ours img/s | plain PIL img/s | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for a in aug:
        lines.append(
            f"| {a['augmentation']} | {a['image_size']} | {a['images']} | {a['ours_per_s']:.1f} | "
            f"{a['plain_per_s']:.1f} | {a['speedup']:.2f}× |"
        )
    lines += [
        "",
        "Worker cost per image (two views) with the colour stage in the worker (the CPU path) or left "
        "to the GPU (`data.colour_on_device`, default on CUDA), and the bytes per image a worker sends "
        "(float32 views vs uint8 crops + random draws).",
        "",
        "| augmentation | px | worker ms/img | worker ms/img, colour on device | bytes/img | "
        "bytes/img, colour on device |",
        "|---|---|---|---|---|---|",
    ]
    for a in aug:
        lines.append(
            f"| {a['augmentation']} | {a['image_size']} | {a['worker_ms']:.2f} | "
            f"{a['deferred_worker_ms']:.2f} | {a['bytes']:.0f} | {a['deferred_bytes']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def against_supervised(rows: list[dict]) -> list[str]:
    """Each method's images/s over the supervised step's on the same device and data backend, bare
    and through the engine: the share of the ceiling the method reaches."""
    ceiling = {(r["device"], r.get("data_backend")): r for r in rows if r["method"] == "supervised"}
    lines = []
    for r in rows:
        sup = ceiling.get((r["device"], r.get("data_backend")))
        if sup is None or r is sup:
            continue
        bare = (r["batch"] / r["bare_s"]) / (sup["batch"] / sup["bare_s"])
        engine = r["images_per_s"] / sup["images_per_s"]
        lines.append(f"| {r['recipe']} | {r.get('data_backend', '-')} | {bare:.3f} | {engine:.3f} |")
    if not lines:
        return []
    return [
        "",
        "Images/s of each method over the plain supervised step's (the same arch, size and device, in the "
        "same run): the ceiling any method can reach.",
        "",
        "| recipe | data backend | method/supervised, bare | method/supervised, engine |",
        "|---|---|---|---|",
        *lines,
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pretraining",
        description=__doc__.splitlines()[0],
        epilog="`python -m benchmarks.learning --help`: the table of what each tiny recipe learns "
        "(benchmarks/learning.md)",
    )
    parser.add_argument("--recipes", default=None, help="comma-separated recipe names (default: every tiny_*)")
    parser.add_argument("--data-root", default="datasets/synthetic/imagenet/train")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--batch",
        default=None,
        help="images per step: a number, or auto (the largest up to --max-batch whose step fits the GPU's memory); "
        "default: the recipe's train.batch_size",
    )
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument(
        "--log-every", type=int, default=1, help="the engine's row interval (a row step reads the device)"
    )
    parser.add_argument("--aug-sizes", default="64,224", help="augmentation benchmark output sizes")
    parser.add_argument("--aug-images", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/pretrain.md")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the steps run, whatever the recipe's train.cpu (auto: CUDA when available)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every recipe, e.g. train.channels_last=true (repeatable)",
    )
    parser.add_argument("--no-augmentation", action="store_true", help="skip the augmentation throughput part")
    parser.add_argument(
        "--host-reads",
        action="store_true",
        help="instead of timing: count the reads of tensor values per step that logs no row, on the CPU, for the "
        "tiny recipe of every registered method (benchmarks/host_reads.py); exit 1 unless all are 0",
    )
    parser.add_argument(
        "--optimizer-ops",
        action="store_true",
        help="instead of timing: the operators one optimizer step dispatches, per-tensor loop against ours, on "
        "the CPU (benchmarks/optimizer_ops.py)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode: one recipe, JSON out
    return parser


def device_override(device: str, cuda_available: bool) -> str:
    """The ``train.cpu`` override that makes the steps run where ``--device`` says, whatever the
    recipe sets: the tiny recipes set ``train.cpu: true``, and without this ``--device cuda`` timed
    them on the host's CPU (found on an H200: 3.4 s per step)."""
    on_gpu = device == "cuda" or (device == "auto" and cuda_available)
    return f"train.cpu={'false' if on_gpu else 'true'}"


def _bench_in_child(recipe: str, args: argparse.Namespace) -> dict:
    """bench_recipe of one recipe in a fresh process (its own peak memory and Accelerate state)."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.pretraining",
            "--one",
            recipe,
            "--data-root",
            args.data_root,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--device",
            args.device,
            "--max-batch",
            str(args.max_batch),
            "--log-every",
            str(args.log_every),
            *(["--batch", args.batch] if args.batch else []),
            *(f"--set={kv}" for kv in args.set),
        ],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0 or "RESULT=" not in res.stdout:
        sys.exit(f"error: benchmark of {recipe} failed:\n{res.stderr[-2000:]}")
    r = json.loads(res.stdout.rsplit("RESULT=", 1)[1])
    print(
        f"{recipe}: engine {1e3 * r['engine_s']:.1f} ms/step ({r['images_per_s']:.1f} img/s), bare "
        f"{1e3 * r['bare_s']:.1f} ms, engine/bare {r['engine_over_bare']:.3f}, peak {r['peak_mib']:.0f} MiB",
        flush=True,
    )
    return r


def _bench_augmentations(args: argparse.Namespace) -> list[dict]:
    aug = []
    for size in [] if args.no_augmentation else (int(s) for s in args.aug_sizes.split(",")):
        for recipe in ("mocov1", "mocov2", "simclr", "byol"):
            aug.append(bench_augmentation(recipe, args.data_root, size, args.aug_images))
            a = aug[-1]
            print(
                f"augmentation {recipe} @{size}px: ours {a['ours_per_s']:.1f} img/s, plain PIL "
                f"{a['plain_per_s']:.1f} img/s, {a['speedup']:.2f}×; worker {a['worker_ms']:.2f} ms/img, "
                f"{a['deferred_worker_ms']:.2f} with colour on device; {a['bytes']:.0f} vs "
                f"{a['deferred_bytes']:.0f} bytes/img",
                flush=True,
            )
    return aug


def recipe_overrides(recipe: str, args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """What one recipe needs on the benchmark's data: the supervised ceiling as many classes as the
    folder has, and the batch --batch asks for."""
    from pretrain.config import load_config

    extra = []
    if load_config(RECIPES_DIR / f"{recipe}.yaml", overrides).method.name == "supervised":
        classes = sum(1 for p in Path(args.data_root).iterdir() if p.is_dir())
        extra.append(f"method.num_classes={classes}")
    if args.batch == "auto":
        extra.append(f"train.batch_size={_fit_batch(recipe, overrides + extra, args.max_batch)}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the search's method and optimizer are gone: their memory too
    elif args.batch:
        extra.append(f"train.batch_size={int(args.batch)}")
    return extra


def host_reads(args: argparse.Namespace, overrides: list[str]) -> None:
    """The --host-reads table; every registered method must have a tiny recipe to be counted."""
    from benchmarks.host_reads import count_reads, report
    from pretrain.config import load_config
    from pretrain.methods import METHODS

    tiny = sorted(RECIPES_DIR.glob("tiny_*.yaml"))
    recipes = [RECIPES_DIR / f"{r}.yaml" for r in args.recipes.split(",")] if args.recipes else tiny
    uncovered = sorted(set(METHODS) - {load_config(p).method.name for p in tiny})
    if uncovered:
        sys.exit(f"error: no configs/pretrain/tiny_*.yaml trains {', '.join(uncovered)}: its reads cannot be counted")
    results = []
    for recipe in recipes:
        cuda = "train.cpu=false" in overrides  # --device says where (device_override)
        results.append(count_reads(recipe, [o for o in overrides if not o.startswith("train.cpu=")], cuda=cuda))
        print(f"{recipe.stem}: {results[-1].reads_per_quiet_step:g} host reads per step without a row", flush=True)
    print(report(results))
    if any(r.reads_per_quiet_step for r in results):
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no CUDA device is visible")
    overrides = [f"data.root={args.data_root}", "data.num_workers=0", *args.set]
    overrides.append(device_override(args.device, torch.cuda.is_available()))
    if args.host_reads:
        return host_reads(args, overrides)
    if args.optimizer_ops:
        from benchmarks.optimizer_ops import main as optimizer_ops

        return optimizer_ops()
    if args.one:
        overrides += recipe_overrides(args.one, args, overrides)
        print("RESULT=" + json.dumps(bench_recipe(args.one, overrides, args.warmup, args.steps, args.log_every)))
        return
    if not Path(args.data_root).is_dir():
        sys.exit(
            f"error: --data-root {args.data_root} does not exist (generate it: "
            "python -m contrastive_transfer.synthetic --out datasets/synthetic --preset small)"
        )
    recipes = args.recipes.split(",") if args.recipes else sorted(p.stem for p in RECIPES_DIR.glob("tiny_*.yaml"))
    rows = [_bench_in_child(recipe, args) for recipe in recipes]
    aug = _bench_augmentations(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text(args.out, _report(rows, aug, args))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
