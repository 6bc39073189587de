"""One fine-tuning job: check inputs, run each seed through detectron2's ``launch``, write
``metrics.json`` (final AP figures) per run and, for several seeds, their mean ± std.

Layout of ``OUTPUT_DIR``: one seed -> the run's files directly; ``--seeds S`` with S > 1 ->
``seed_<s>/`` per seed (seeds ``SEED, SEED+1, ...``, or ``0..S-1`` when ``SEED`` is -1) and
``metrics.json`` with ``mean`` and ``std`` (sample standard deviation, n - 1) of every metric.
With ``--resume``, seeds whose ``metrics.json`` exists are not run again.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from pathlib import Path

import torch
from detectron2.config import CfgNode
from detectron2.engine import launch
from detectron2.utils import comm
from detectron2.utils.collect_env import collect_env_info
from detectron2.utils.env import seed_all_rng
from detectron2.utils.logger import setup_logger
from torch.multiprocessing.spawn import ProcessExitedException

from contrastive_transfer.cli import OutputLock, UserError, open_append, write_json, write_text
from contrastive_transfer.errors import ConfigError
from contrastive_transfer.json_limits import read_json
from contrastive_transfer.preempt import PREEMPTED_EXIT_CODE, Preempted
from contrastive_transfer.ranks import decided_by_rank0
from transfer.detection.config import build_config, fit_num_classes, read_weights
from transfer.detection.datasets import check_datasets, dataset_classes, register_datasets
from transfer.detection.trainer import BackboneCheckingCheckpointer, Trainer
from transfer.features import file_digest

HEADLINE = ("AP50", "AP", "AP75", "APs", "APm", "APl")


def _finite(value):
    """COCO reports NaN for categories without ground truth; JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def seed_list(config_seed: int, count: int) -> list[int]:
    if count < 1:
        raise ConfigError(f"--seeds {count}: expected at least 1")
    if count == 1:
        return [config_seed]
    start = config_seed if config_seed >= 0 else 0
    return list(range(start, start + count))


def _weights_digest(weights: str) -> str | None:
    return file_digest(weights) if weights and os.path.isfile(weights) else None


def _fresh_logging() -> None:
    # setup_logger is lru-cached and adds handlers per output dir; seeds run one after another
    # in one process would otherwise also log into the previous seed's log.txt.
    setup_logger.cache_clear()
    for name in ("detectron2", "fvcore", "d2"):
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            handler.close()  # a log file's handler closes its file; the console's leaves stdout open
        logger.handlers.clear()


class _LogFile(logging.StreamHandler):
    """A handler writing to a log opened by ``open_append``, closing it when closed."""

    def close(self) -> None:
        self.stream.close()
        super().close()


def setup(cfg: CfgNode, args) -> None:
    """detectron2's ``default_setup`` with its two files written by the project's writer: it opens
    ``log.txt`` (``log.txt.rank<r>`` beside it) and ``config.yaml`` with PathManager, which
    follows a link planted there; here the log is ``open_append``'s (a link: one line naming it)
    and the config ``write_text``'s (a link is replaced)."""
    out, rank = Path(cfg.OUTPUT_DIR), comm.get_rank()
    out.mkdir(parents=True, exist_ok=True)
    log_file = _LogFile(open_append(out / ("log.txt" if rank == 0 else f"log.txt.rank{rank}")))
    log_file.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s: %(message)s", "%m/%d %H:%M:%S"))
    for name in ("fvcore", "detectron2"):
        setup_logger(None, distributed_rank=rank, name=name).addHandler(log_file)
    log = logging.getLogger("detectron2")
    log.info(f"Rank of current process: {rank}. World size: {comm.get_world_size()}")
    log.info("Environment info:\n" + collect_env_info())
    log.info(f"Command line arguments: {args}")
    log.info(f"Running with full config:\n{cfg.dump()}")
    if comm.is_main_process():
        write_text(out / "config.yaml", cfg.dump())
        log.info(f"Full config saved to {out / 'config.yaml'}")
    seed_all_rng(None if cfg.SEED < 0 else cfg.SEED + rank)
    if not args.eval_only:  # detectron2's choice: benchmarking costs more than it saves on small test sets
        torch.backends.cudnn.benchmark = cfg.CUDNN_BENCHMARK


def worker(cfg: CfgNode, notes: list[str], args, skip_if_done: bool = False) -> None:
    """Runs in every process (``launch``): train + evaluate, or evaluate only. With
    ``skip_if_done``, a run whose ``metrics.json`` rank 0 already has is skipped by every process."""
    if skip_if_done and decided_by_rank0((Path(cfg.OUTPUT_DIR) / "metrics.json").is_file()):
        return
    register_datasets(args.data_root)
    _fresh_logging()
    setup(cfg, args)
    log = logging.getLogger("detectron2")
    for note in notes:
        log.warning(f"notice: {note}")
    if args.eval_only:
        model = Trainer.build_model(cfg)
        checkpointer = BackboneCheckingCheckpointer(model, save_dir=cfg.OUTPUT_DIR)
        checkpointer.resume_or_load(cfg.MODEL.WEIGHTS, resume=args.resume)
        results, iteration = Trainer.test(cfg, model), None
    else:
        trainer = Trainer(cfg)
        trainer.resume_or_load(resume=args.resume)
        try:
            trainer.train()
        except Preempted:  # saved at the iteration reached; the hook logged what to do
            raise SystemExit(PREEMPTED_EXIT_CODE) from None  # a launched process's exit code
        results, iteration = getattr(trainer, "_last_eval_results", {}), trainer.iter  # == MAX_ITER when done
    if comm.is_main_process():
        if len(cfg.DATASETS.TEST) == 1:  # DefaultTrainer.test unwraps a single dataset's results
            results = {cfg.DATASETS.TEST[0]: results}
        write_json(
            Path(cfg.OUTPUT_DIR) / "metrics.json",
            {
                "config_file": args.config_file,
                "weights": cfg.MODEL.WEIGHTS,
                # the bytes measured (to_detectron2 renames the tensors, so this is the file's digest,
                # not contract.weights_sha256 of a checkpoint_final)
                "weights_file_sha256": _weights_digest(cfg.MODEL.WEIGHTS),
                "seed": cfg.SEED,
                "eval_only": bool(args.eval_only),
                "iterations": iteration,
                "world_size": comm.get_world_size(),
                "ims_per_batch": cfg.SOLVER.IMS_PER_BATCH,
                "base_lr": cfg.SOLVER.BASE_LR,
                "notices": notes,
                "results": _finite({name: {task: dict(m) for task, m in r.items()} for name, r in results.items()}),
            },
        )


def _dataset_names(cfg: CfgNode, args) -> list[str]:
    return list(cfg.DATASETS.TEST) + ([] if args.eval_only else list(cfg.DATASETS.TRAIN))


def check_inputs(cfg: CfgNode, args) -> None:
    """Everything that can be checked before any process starts training."""
    names = _dataset_names(cfg, args)
    check_datasets(names, args.data_root)
    # Read (and validate) every set now: a broken test set would otherwise surface after training,
    # a broken training set inside the launched processes as a traceback.
    check_datasets(names, args.data_root, load=True)
    if cfg.MODEL.WEIGHTS:  # a local file here: build_config refused or fetched a URL (docs/security.md)
        read_weights(cfg.MODEL.WEIGHTS)
    elif not cfg.MODEL.WEIGHTS:
        logging.getLogger("detectron2").warning("MODEL.WEIGHTS is empty: the backbone starts from random weights")
    if cfg.MODEL.DEVICE.startswith("cuda") and args.num_gpus > torch.cuda.device_count():
        raise ConfigError(f"--num-gpus {args.num_gpus}: only {torch.cuda.device_count()} CUDA devices visible")


def read_seed_metrics(path: Path) -> dict:
    """A seed's metrics.json, through the gate and the JSON limits (a finished seed's file is read
    back by ``--resume``, and a shared folder may hold anything): an object whose ``results`` map
    each dataset to tasks to metrics that are numbers or null; one line naming the file otherwise."""
    data = read_json(path)
    results = data.get("results") if isinstance(data, dict) else None
    ok = isinstance(results, dict) and all(
        isinstance(tasks, dict)
        and all(
            isinstance(m, dict) and all(v is None or (type(v) in (int, float)) for v in m.values())
            for m in tasks.values()
        )
        for tasks in results.values()
    )
    if not ok:
        raise UserError(
            f"{path}: expected a seed's metrics (an object with results: dataset -> task -> metric -> number); "
            "remove the seed's folder to run it again"
        )
    return data


def aggregate(runs: dict[int, dict]) -> dict:
    """mean and sample std (n - 1; null for one run) of every metric present in all runs."""
    first = next(iter(runs.values()))["results"]
    mean, std = {}, {}
    for name, tasks in first.items():
        for task, metrics in tasks.items():
            for metric in metrics:
                values = [r["results"].get(name, {}).get(task, {}).get(metric) for r in runs.values()]
                if any(v is None for v in values):
                    continue
                mean.setdefault(name, {}).setdefault(task, {})[metric] = statistics.fmean(values)
                std.setdefault(name, {}).setdefault(task, {})[metric] = (
                    statistics.stdev(values) if len(values) > 1 else None
                )
    return {"mean": mean, "std": std}


def summary_lines(metrics: dict) -> list[str]:
    """Headline figures, 'AP50 81.50 ± 0.20' for several seeds."""
    lines = []
    results = metrics.get("mean") or metrics["results"]
    for name, tasks in results.items():
        for task, m in tasks.items():
            parts = []
            for key in HEADLINE:
                if m.get(key) is None:
                    continue
                s = metrics.get("std", {}).get(name, {}).get(task, {}).get(key)
                parts.append(f"{key} {m[key]:.2f}" + (f" ± {s:.2f}" if s is not None else ""))
            lines.append(f"{name} {task}: " + ", ".join(parts))
    return lines


def run(args) -> dict:
    """The whole job (all seeds); returns what it wrote to ``OUTPUT_DIR/metrics.json``. The output
    directory is locked on each machine for the job (a second job into it stops at once)."""
    world_size = args.num_gpus * args.num_machines
    cfg, notes = build_config(args.config_file, args.opts, world_size, allow_network=args.allow_network)
    register_datasets(args.data_root)
    # the head sized by the data's classes (the digits' 10, VOC's 20) before anything is built
    cfg, sized = fit_num_classes(cfg, dataset_classes(_dataset_names(cfg, args)), args.opts or [])
    notes = notes + sized
    check_inputs(cfg, args)
    with OutputLock(cfg.OUTPUT_DIR, "OUTPUT_DIR"):
        refuse_replacing_finished(Path(cfg.OUTPUT_DIR), seed_list(cfg.SEED, args.seeds), args.resume)
        return _run_seeds(cfg, notes, args)


FINISHED = ("metrics.json", "model_final.pth")  # what a finished seed leaves in its folder


def refuse_linked_folder(folder: Path) -> None:
    """Every file a run writes in its folder goes through the project's writer (a link at one is
    replaced, or one line for a log) but detectron2's TensorBoard events, named by time, host
    and pid; a seed's folder that is itself a symbolic link would send them all outside, so the
    job does not start."""
    if folder.is_symlink():
        raise UserError(f"{folder} is a symbolic link, expected a seed's folder: not followed; remove it")


def refuse_replacing_finished(out: Path, seeds: list[int], resume: bool) -> None:
    """A job never replaces a finished run's output (``metrics.json``, ``model_final.pth``) that
    it does not continue: without ``--resume`` any of them in OUTPUT_DIR (or a seed's folder) is
    one line, before anything is written; with it, a seed's folder must hold detectron2's record
    of its last checkpoint (``last_checkpoint``, what the resume continues from) or its
    ``metrics.json`` (a finished seed, skipped), else the seed would start afresh over it."""
    folders = [out] + ([out / f"seed_{seed}" for seed in seeds] if len(seeds) > 1 else [])
    for folder in folders[1:]:
        refuse_linked_folder(folder)
    for folder in folders:
        found = [folder / name for name in FINISHED if os.path.lexists(folder / name)]
        if not found:
            continue
        if not resume:
            why = "this job starts afresh (no --resume)"
        elif folder == out and len(seeds) > 1:
            continue  # the seeds' aggregate: recomputed from the seeds, which are checked below
        elif os.path.lexists(folder / "last_checkpoint") or (len(seeds) > 1 and found[0].name == "metrics.json"):
            continue
        else:
            why = "this job has no last_checkpoint there to resume from"
        raise UserError(
            f"{found[0]} is a finished run's output, and {why}, so it would replace it; nothing was written. "
            "Choose another OUTPUT_DIR, or move the folder's files away to run there again"
        )


def _run_seeds(cfg: CfgNode, notes: list[str], args) -> dict:
    seeds = seed_list(cfg.SEED, args.seeds)
    out = Path(cfg.OUTPUT_DIR)
    runs = {}
    for seed in seeds:
        run_cfg = cfg.clone()
        run_cfg.defrost()
        run_cfg.SEED = seed
        run_cfg.OUTPUT_DIR = str(out / f"seed_{seed}") if len(seeds) > 1 else str(out)
        run_cfg.freeze()
        metrics_path = Path(run_cfg.OUTPUT_DIR) / "metrics.json"
        # Whether a seed is finished is decided inside the launched processes, by global rank 0.
        try:
            launch(
                worker,
                args.num_gpus,
                num_machines=args.num_machines,
                machine_rank=args.machine_rank,
                dist_url=args.dist_url,
                args=(run_cfg, notes, args, len(seeds) > 1 and args.resume),
            )
        except ProcessExitedException as e:  # several processes: spawn reports the first exit code
            if e.exit_code == PREEMPTED_EXIT_CODE:
                raise SystemExit(PREEMPTED_EXIT_CODE) from None
            raise
        if args.machine_rank == 0:  # global rank 0 lives on machine 0 and wrote the file
            runs[seed] = read_seed_metrics(metrics_path)
    if args.machine_rank != 0:
        return {}
    empty = sorted(
        {f"seed {seed}: {name}" for seed, r in runs.items() for name, res in r["results"].items() if not res}
        | {f"seed {seed}" for seed, r in runs.items() if not r["results"]}
    )
    if empty:
        raise UserError(
            f"the evaluation produced no results ({', '.join(empty)}); see {out}/log.txt "
            "(a test set without annotations, or DATASETS.TEST empty)"
        )
    if len(seeds) == 1:
        metrics = runs[seeds[0]]
    else:
        metrics = {
            "config_file": args.config_file,
            "weights": cfg.MODEL.WEIGHTS,
            "seeds": seeds,
            "runs": {str(s): str(out / f"seed_{s}") for s in seeds},
            **aggregate(runs),
            "per_seed": {str(s): r["results"] for s, r in runs.items()},
        }
        write_json(out / "metrics.json", metrics)
    for line in summary_lines(metrics):
        print(line, flush=True)
    return metrics
