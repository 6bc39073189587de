"""python -m benchmarks.detection_speed [--device cuda|cpu] [--iters N] [--warmup W] [--configs A,B]
    [--data datasets/synthetic] [--weights FILE.pkl] [--ims-per-batch B] [--eval-images K] [--tiny]
    [--out FILE.md]

Figures, not pass/fail, in one process on one device (benchmarks/detection_speed.md says more):

* per config (default: the VOC R50-FPN and R50-C4 configs at their real input size), the project's
  detection trainer (``transfer.detection.trainer.Trainer``: the image-checking mapper, the
  preemption hook, the backbone-checking checkpointer) and plain ``detectron2.engine.DefaultTrainer``
  built from the same config, with the same initial weights, the same data and seeds, on the same
  device, for W + N iterations each; seconds per iteration over the N after the warm-up (medians):
  the whole iteration (from one iteration's start to the next, every hook included), detectron2's
  own ``time`` (its IterationTimer: data, step and the hooks' ``before_step``) and its
  ``data_time``; the ratio ours / plain (goal <= 1.02);
* the weights ours trained for the first config, evaluated on the first K images of its test set
  on the device and on the CPU: COCO-style AP, AP50, AP75 on each (detectron2's COCOEvaluator; the
  score threshold at 0 so that every image has detections) and their difference, and how far the
  detections themselves differ.

``--tiny`` is the CPU dry run (tools/gpu_check.sh --dry-run): 64 px inputs, few proposals, 2 warm-up
+ 2 iterations, 2 evaluation images. The figures then say nothing about speed; the report's shape
and the CPU-vs-CPU equality of the evaluation are what it checks.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import math
import platform
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import torch

from benchmarks import cpu_name
from contrastive_transfer.cli import UserError, command, write_text

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "detection"
DEFAULT_CONFIGS = "voc0712_R_50_FPN_24k_syncbn,voc0712_R_50_C4_24k_syncbn"
GOAL = 1.02
# The CPU dry run: small inputs and few proposals, so that two ResNet-50 detectors train twice each
# and evaluate twice in seconds. Speed figures at this size mean nothing.
TINY_OVERRIDES = [
    *("INPUT.MIN_SIZE_TRAIN", "(64,)", "INPUT.MAX_SIZE_TRAIN", "96"),
    *("INPUT.MIN_SIZE_TEST", "64", "INPUT.MAX_SIZE_TEST", "96"),
    *("MODEL.RPN.PRE_NMS_TOPK_TRAIN", "100", "MODEL.RPN.POST_NMS_TOPK_TRAIN", "50"),
    *("MODEL.RPN.PRE_NMS_TOPK_TEST", "100", "MODEL.RPN.POST_NMS_TOPK_TEST", "50"),
    *("MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", "4", "TEST.DETECTIONS_PER_IMAGE", "20"),
    *("DATALOADER.NUM_WORKERS", "0"),
]
TINY_DEFAULTS = {"iters": 2, "warmup": 2, "eval_images": 2, "ims_per_batch": 1}
FULL_DEFAULTS = {"iters": 100, "warmup": 20, "eval_images": 8, "ims_per_batch": 2}


# ------------------------------------------------------------------------------ the figures
def median_after(values: list[tuple[float, int]], warmup: int) -> float:
    """The median of the values logged at iterations >= `warmup` (detectron2's history pairs:
    (value, iteration))."""
    kept = [v for v, it in values if it >= warmup]
    if not kept:
        raise ValueError(f"no values after the {warmup} warm-up iterations")
    return statistics.median(kept)


def iteration_seconds(starts: list[float], warmup: int) -> float:
    """Median whole-iteration time: iteration i lasts from its start to the start of i + 1, so
    the last iteration (whose end holds the final checkpoint) has none."""
    return median_after([(b - a, i) for i, (a, b) in enumerate(zip(starts, starts[1:]))], warmup)


def ratio(ours: float, plain: float) -> float:
    """ours / plain; a plain time of 0 cannot be compared (inf), not silently 1."""
    return ours / plain if plain > 0 else math.inf


def ap_difference(device: dict[str, float], cpu: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per AP metric both evaluations report: the device's, the CPU's and device - CPU (COCO
    reports NaN for a metric without ground truth: NaN on both sides counts as equal, 0)."""
    rows = {}
    for key in ("AP", "AP50", "AP75"):
        if key not in device or key not in cpu:
            continue
        a, b = device[key], cpu[key]
        diff = 0.0 if math.isnan(a) and math.isnan(b) else a - b
        rows[key] = {"device": a, "cpu": b, "difference": diff}
    return rows


def detection_difference(device: dict, cpu: dict) -> dict:
    """How far two evaluations' detections differ, image by image: (boxes, scores, classes) per
    image id. Images whose detections differ in number or classes (a score near a tie can reorder
    them on another device) are counted; over the others, the largest box-corner and score
    differences."""
    same, box, score = 0, 0.0, 0.0
    for image_id, (boxes, scores, classes) in device.items():
        other = cpu.get(image_id)
        if other is None or len(classes) != len(other[2]) or not torch.equal(classes, other[2]):
            continue
        same += 1
        if len(classes):
            box = max(box, (boxes - other[0]).abs().max().item())
            score = max(score, (scores - other[1]).abs().max().item())
    return {
        "images": len(device),
        "detections": sum(len(d[2]) for d in device.values()),
        "images_same_classes": same,
        "max_box_difference": box,
        "max_score_difference": score,
    }


@dataclass
class Timing:
    trainer: str
    iteration_s: float  # whole iteration, every hook included
    d2_time_s: float  # detectron2's IterationTimer `time`
    data_s: float  # detectron2's `data_time`
    weights_sha256: str  # the model's state before the first step


# ------------------------------------------------------------------------------ the runs
def build_cfg(config: str, args: argparse.Namespace, out: Path):
    """The config as ``python -m transfer.detection`` builds it for one process on `args.device`
    (linear scaling to the batch, SyncBN -> BN, the head sized by the data), with the benchmark's
    schedule: W + N iterations, no PreciseBN. Returns (cfg, test set name, notices)."""
    from transfer.detection.config import build_config, fit_num_classes, read_weights
    from transfer.detection.datasets import check_datasets, dataset_classes

    opts = [
        *("MODEL.WEIGHTS", args.weights or "", "MODEL.DEVICE", args.device),
        *("SOLVER.IMS_PER_BATCH", str(args.ims_per_batch), "SOLVER.MAX_ITER", str(args.warmup + args.iters)),
        *("TEST.PRECISE_BN.ENABLED", "False", "SEED", str(args.seed), "OUTPUT_DIR", str(out)),
        *(TINY_OVERRIDES if args.tiny else []),
    ]
    cfg, notes = build_config(str(CONFIG_DIR / f"{config}.yaml"), opts, world_size=1)
    out.mkdir(parents=True, exist_ok=True)  # the writers' folder (transfer.detection's default_setup makes it)
    names = list(cfg.DATASETS.TRAIN) + list(cfg.DATASETS.TEST)
    check_datasets(names, args.data, load=True)
    cfg, sized = fit_num_classes(cfg, dataset_classes(names), opts)
    if cfg.MODEL.WEIGHTS:
        read_weights(cfg.MODEL.WEIGHTS)
    return cfg, cfg.DATASETS.TEST[0], notes + sized


@contextmanager
def writers_without_tensorboard():
    """Both trainers write detectron2's default events, one writer of them TensorBoard's, which
    needs the tensorboard package at its first write. Where it is missing (the GPU machine carries
    only the wheels it needs), that writer is replaced in both trainers by one that writes nothing;
    yields the notice for the report, or None."""
    if importlib.util.find_spec("tensorboard") is not None:
        yield None
        return
    from detectron2.engine import defaults
    from detectron2.utils.events import EventWriter

    from transfer.detection import trainer

    class NoTensorboard(EventWriter):
        def __init__(self, *args, **kwargs) -> None:
            pass

        def write(self) -> None:
            pass

    with mock.patch.object(defaults, "TensorboardXWriter", NoTensorboard):
        with mock.patch.object(trainer, "TensorboardXWriter", NoTensorboard):
            yield "tensorboard is not installed: both trainers ran without their TensorBoard writer"


def sync_bn_difference(cfg) -> dict:
    """The config's model with BN (what one process gets) against the same with detectron2's SyncBN
    where the config file has it (every NORM that is BN here: the configs use no plain BN), one
    training forward each from the same seed on the same input, on the config's device: how many
    SyncBatchNorm layers the second has, and the largest differences of the losses and of the BN
    running statistics. nn.SyncBatchNorm without a process group runs batch_norm, so on the CPU
    both are 0; on CUDA, kernels chosen per call may differ in the last bits."""
    from detectron2.modeling import build_model
    from detectron2.structures import Boxes, Instances
    from detectron2.utils.events import EventStorage

    from transfer.detection.config import _norm_keys, _set

    sync = cfg.clone()
    sync.defrost()
    changed = [key for key, norm in _norm_keys(sync) if norm == "BN"]
    for key in changed:
        _set(sync, key, "SyncBN")
    image = torch.randint(0, 256, (3, 64, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    boxes = Boxes(torch.tensor([[10.0, 8.0, 50.0, 40.0]]))
    instances = Instances((64, 96), gt_boxes=boxes, gt_classes=torch.tensor([0]))
    runs = []
    for c in (cfg, sync):
        torch.manual_seed(0)
        model = build_model(c).train()
        with EventStorage():  # where the RPN and ROI heads log their sampling
            losses = model([{"image": image, "instances": instances}])
        stats = {k: v for k, v in model.state_dict().items() if k.endswith(("running_mean", "running_var"))}
        layers = sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
        runs.append((losses, stats, layers))
        del model
    (losses, stats, _), (sync_losses, sync_stats, layers) = runs
    return {
        "keys": changed,
        "sync_bn_layers": layers,
        "bn_statistics": len(stats),
        "max_loss_difference": max((losses[k] - sync_losses[k]).abs().item() for k in losses),
        "max_statistic_difference": max((stats[k] - sync_stats[k]).abs().max().item() for k in stats),
    }


def _weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_trainer(trainer_cls, cfg, warmup: int) -> tuple[Timing, dict]:
    """Train `cfg` with `trainer_cls` from the seeded initial weights; returns its timing and the
    trained weights (on the CPU). The final checkpoint and evaluation are dropped from both
    trainers alike: they are no part of an iteration (DATASETS.TEST is emptied, the checkpointer
    hook removed), and at the real size they would cost the GPU window seconds for nothing."""
    from detectron2.engine import hooks
    from detectron2.utils.env import seed_all_rng

    cfg = cfg.clone()
    cfg.defrost()
    cfg.DATASETS.TEST = ()
    cfg.freeze()
    seed_all_rng(cfg.SEED)  # the same initial weights, sampler order and worker seeds for both
    trainer = trainer_cls(cfg)
    trainer.resume_or_load(resume=False)
    digest = _weights_digest(trainer.model)

    class IterationStarts(hooks.HookBase):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def before_step(self) -> None:
            self.starts.append(time.perf_counter())

    starts = IterationStarts()
    # the hooks list is detectron2's private attribute: the only way to remove two of its own hooks
    kept = [h for h in trainer._hooks if not isinstance(h, (hooks.PeriodicCheckpointer, hooks.EvalHook))]
    trainer._hooks = []
    trainer.register_hooks([starts, *kept])  # first: its before_step opens the iteration
    trainer.train()
    _sync(cfg.MODEL.DEVICE)
    storage = trainer.storage
    timing = Timing(
        trainer=trainer_cls.__name__,
        iteration_s=iteration_seconds(starts.starts, warmup),
        d2_time_s=median_after(storage.history("time").values(), warmup),
        data_s=median_after(storage.history("data_time").values(), warmup),
        weights_sha256=digest,
    )
    weights = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    del trainer, storage
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return timing, weights


def _register_subset(test_name: str, count: int) -> str:
    """The first `count` images of `test_name`, registered as a set of their own (its classes,
    no json file: COCOEvaluator converts the records). The VOC evaluator would score the whole
    split's image list, counting every image left out as missed."""
    from detectron2.data import DatasetCatalog, MetadataCatalog

    name = f"{test_name}_first{count}"
    if name in DatasetCatalog.list():
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)
    DatasetCatalog.register(name, lambda: DatasetCatalog.get(test_name)[:count])
    MetadataCatalog.get(name).set(thing_classes=MetadataCatalog.get(test_name).thing_classes)
    return name


def evaluate_on(cfg, weights: dict, device: str, dataset: str, out: Path) -> tuple[dict, dict]:
    """`weights` evaluated on `device` over `dataset`: (COCO bbox metrics, detections per image)."""
    from detectron2.evaluation import COCOEvaluator, DatasetEvaluator, DatasetEvaluators, inference_on_dataset

    from transfer.detection.trainer import _HAS_C_EXTENSION, Trainer

    class Detections(DatasetEvaluator):
        def reset(self) -> None:
            self.found: dict = {}

        def process(self, inputs, outputs) -> None:
            for image, output in zip(inputs, outputs):
                found = output["instances"].to("cpu")
                self.found[image["image_id"]] = (found.pred_boxes.tensor, found.scores, found.pred_classes)

        def evaluate(self) -> dict:
            return {}

    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.DEVICE = device
    cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST = 0.0  # detections on every image, even from a brief training
    cfg.freeze()
    model = Trainer.build_model(cfg)
    model.load_state_dict(weights)
    model.eval()
    detections = Detections()
    coco = COCOEvaluator(dataset, output_dir=str(out), use_fast_impl=_HAS_C_EXTENSION)
    results = inference_on_dataset(
        model, Trainer.build_test_loader(cfg, dataset), DatasetEvaluators([coco, detections])
    )
    return dict(results["bbox"]), detections.found


# ------------------------------------------------------------------------------ the report
def versions() -> str:
    import detectron2

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name() or platform.machine()
    return f"{where}, torch {torch.__version__}, detectron2 {detectron2.__version__}"


def report(result: dict) -> str:
    a = result["args"]
    lines = [
        f"# Detection on {a['device']}: the project's trainer against plain detectron2",
        "",
        f"{result['machine']}, {result['date']}{' (--tiny: the CPU dry run, no speed figure)' if a['tiny'] else ''}. "
        f"{a['iters']} iterations after {a['warmup']} warm-up ones per trainer, SOLVER.IMS_PER_BATCH "
        f"{a['ims_per_batch']}, weights {a['weights'] or 'random (seeded)'}, data {a['data']}. Medians over "
        "the iterations after the warm-up; `whole`: one iteration's start to the next's, every hook "
        "included; `time`, `data_time`: detectron2's own.",
        "",
        "| config | trainer | whole s/iter | `time` s/iter | `data_time` s/iter | same initial weights |",
        "|---|---|---|---|---|---|",
    ]
    for config, run in result["configs"].items():
        same = "yes" if run["ours"]["weights_sha256"] == run["plain"]["weights_sha256"] else "NO"
        for key, label in (("ours", "ours (transfer.detection)"), ("plain", "plain DefaultTrainer")):
            t = run[key]
            lines.append(
                f"| {config} | {label} | {t['iteration_s']:.4f} | {t['d2_time_s']:.4f} | {t['data_s']:.4f} | {same} |"
            )
    lines += ["", "| config | ours/plain, whole | ours/plain, `time` | goal |", "|---|---|---|---|"]
    for config, run in result["configs"].items():
        lines.append(f"| {config} | {run['ratio_whole']:.3f} | {run['ratio_time']:.3f} | <= {GOAL} |")
    lines += [
        "",
        "SyncBN: one process turns the configs' SyncBN into BN, for both trainers. detectron2's own SyncBN on "
        "one process (nn.SyncBatchNorm, no process group), one training forward against BN from the same seed:",
        "",
        "| config | keys | SyncBatchNorm layers | largest loss difference | largest BN statistic difference |",
        "|---|---|---|---|---|",
    ]
    for config, run in result["configs"].items():
        b = run["sync_bn"]
        lines.append(
            f"| {config} | {', '.join(b['keys'])} | {b['sync_bn_layers']} | {b['max_loss_difference']:.3g} "
            f"| {b['max_statistic_difference']:.3g} |"
        )
    lines += _eval_lines(result["evaluation"], a["device"])
    if result["notes"]:
        lines += ["", "Notices (both trainers):", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def _eval_lines(ev: dict, device: str) -> list[str]:
    d = ev["detections"]
    lines = [
        "",
        f"## Evaluation on {device} against the CPU",
        "",
        f"{ev['config']}, the weights ours trained above, on {ev['dataset']} ({d['images']} image(s), "
        f"{d['detections']} detections on {device}; score threshold 0), COCO-style AP:",
        "",
        f"| metric | {device} | cpu | difference |",
        "|---|---|---|---|",
    ]
    for key, row in ev["ap"].items():
        lines.append(f"| {key} | {row['device']:.4f} | {row['cpu']:.4f} | {row['difference']:+.2e} |")
    lines += [
        "",
        f"Detections: {d['images_same_classes']} of {d['images']} images with the same classes in the same "
        f"order on both; over those, largest box-corner difference {d['max_box_difference']:.3g} px, "
        f"largest score difference {d['max_score_difference']:.3g}.",
    ]
    return lines


# ------------------------------------------------------------------------------ the command
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.detection_speed",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per trainer (default 100; --tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="iterations before them (>= 2; default 20; --tiny 2)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated names in configs/detection/")
    p.add_argument("--data", default="datasets/synthetic", help="data root with VOC2007/, VOC2012/ (synthetic)")
    p.add_argument("--weights", default=None, help="a detectron2 .pkl (converters.to_detectron2); default: random")
    p.add_argument(
        "--ims-per-batch",
        type=int,
        default=None,
        help="images per iteration (default 2: the per-GPU batch of the configs' 16 on 8 GPUs; --tiny 1)",
    )
    p.add_argument("--eval-images", type=int, default=None, help="test images evaluated (default 8; --tiny 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the CPU dry run: 64 px inputs, few iterations")
    p.add_argument("--out", default=None, help="write the report here (and its figures as .json beside it)")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in (TINY_DEFAULTS if args.tiny else FULL_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible (use --device cpu)")
    if args.iters < 2 or args.eval_images < 1:
        raise UserError("--iters must be >= 2 and --eval-images >= 1")
    if args.warmup < 2:  # so that the three medians are over the same iterations
        raise UserError("--warmup must be >= 2: detectron2's IterationTimer logs `time` from the third iteration on")
    return args


def bench_config(config: str, args: argparse.Namespace, work: Path) -> tuple[dict, dict, object, str, list[str]]:
    from detectron2.engine import DefaultTrainer

    from transfer.detection.trainer import Trainer

    cfg, test_name, notes = build_cfg(config, args, work / config)
    ours, weights = time_trainer(Trainer, cfg, args.warmup)
    plain, _ = time_trainer(DefaultTrainer, cfg, args.warmup)
    run = {
        "sync_bn": sync_bn_difference(cfg),
        "ours": asdict(ours),
        "plain": asdict(plain),
        "ratio_whole": ratio(ours.iteration_s, plain.iteration_s),
        "ratio_time": ratio(ours.d2_time_s, plain.d2_time_s),
    }
    return run, weights, cfg, test_name, notes


@command
def main(argv: list[str] | None = None) -> dict:
    args = _resolve(_parser().parse_args(argv))
    from transfer.detection.datasets import register_datasets
    from transfer.detection.run import _fresh_logging

    register_datasets(args.data)
    _fresh_logging()
    result = {"args": vars(args), "machine": versions(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    result["configs"], result["notes"] = {}, []
    with tempfile.TemporaryDirectory(prefix="detection_speed-") as tmp, writers_without_tensorboard() as missing:
        result["notes"] += [missing] if missing else []
        first = None
        for config in args.configs.split(","):
            run, weights, cfg, test_name, notes = bench_config(config, args, Path(tmp))
            result["configs"][config] = run
            result["notes"] += [f"{config}: {n}" for n in notes]
            first = first or (config, weights, cfg, test_name)
        config, weights, cfg, test_name = first
        subset = _register_subset(test_name, args.eval_images)
        ap_device, found_device = evaluate_on(cfg, weights, args.device, subset, Path(tmp) / "eval_device")
        ap_cpu, found_cpu = evaluate_on(cfg, weights, "cpu", subset, Path(tmp) / "eval_cpu")
    result["evaluation"] = {
        "config": config,
        "dataset": subset,
        "ap": ap_difference(ap_device, ap_cpu),
        "detections": detection_difference(found_device, found_cpu),
    }
    text = report(result)
    print(text, end="")
    if args.out:
        write_text(args.out, text)
        write_text(Path(args.out).with_suffix(".json"), json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
