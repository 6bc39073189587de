"""python -m pretrain --config configs/pretrain/<recipe>.yaml [key=value ...]

One process: ``python -m pretrain ...``; several: ``accelerate launch --multi_gpu --num_processes N -m
pretrain ...`` or ``torchrun --nproc_per_node N -m pretrain ...`` (both also start N CPU processes with
gloo on a machine without GPUs). ``train.batch_size`` is the global batch, split over the processes.
"""

from __future__ import annotations

import argparse
import os

from contrastive_transfer.cli import DEBUG_HELP, UserError, command
from contrastive_transfer.preempt import PREEMPTED_EXIT_CODE, Preempted
from contrastive_transfer.ranks import check_launch
from pretrain.augment.views import PRESETS
from pretrain.config import load_config
from pretrain.data_backends import BACKENDS
from pretrain.losses import LOSSES
from pretrain.methods import METHODS


def launched_processes() -> int:
    """The number of processes this launch runs, from the launchers' environment (WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_mixed_precision(cfg) -> tuple[str, str | None]:
    """(precision to train with, a one-line note when config and launcher disagree).

    ``train.mixed_precision: null`` takes the launcher's (``accelerate launch --mixed_precision``,
    or its config file, via ACCELERATE_MIXED_PRECISION); an explicit value wins over it."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    chosen = cfg.train.mixed_precision
    if chosen is None:
        return launcher or "no", None
    if launcher is not None and launcher != chosen:
        return chosen, (
            f"note: train.mixed_precision={chosen} overrides the launcher's --mixed_precision "
            f"{launcher}; set train.mixed_precision=null to use the launcher's"
        )
    return chosen, None


def trackers(cfg) -> list[str] | None:
    """train.log_with as Accelerate's log_with; a tracker that is not installed stops the run here."""
    name = cfg.train.log_with
    if name == "none":
        return None
    from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available

    available = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available, "mlflow": is_mlflow_available}
    if not available[name]():
        raise UserError(
            f"train.log_with={name}: the {name} package is not installed; `pip install {name}` "
            "or choose tensorboard or none"
        )
    return [name]


def parser() -> argparse.ArgumentParser:
    from pathlib import Path

    recipes = sorted(
        p.stem
        for p in (Path(__file__).resolve().parents[1] / "configs" / "pretrain").glob("*.yaml")
        if not p.stem.startswith("_")
    )
    return argparse.ArgumentParser(
        prog="python -m pretrain",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            f"recipes (configs/pretrain/): {', '.join(recipes)}\n"
            f"methods (method.name): {' | '.join(METHODS)}\n"
            f"losses of an InfoNCE host (method.loss.name): {' | '.join(LOSSES)}\n"
            f"augmentation presets (data.augmentation): {' | '.join(PRESETS)}\n"
            f"data backends (data.backend): {' | '.join(BACKENDS)}\n"
            "keys and their defaults: pretrain/config.py (engine), each method's `defaults` in "
            "pretrain/methods/ and each loss's options (method.loss) in pretrain/losses/registry.py; "
            "docs/methods.md explains them.\n" + DEBUG_HELP
        ),
    )


@command
def main(argv: list[str] | None = None) -> None:
    p = parser()
    p.add_argument("--config", required=True, help="recipe YAML, e.g. configs/pretrain/mocov2.yaml")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.batch_size=64")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as the run saves it in config.yaml (YAML, loadable as a recipe), then "
        "as comments what the run resolves from it on this machine (every view as built, the scaled lr, "
        "the automatic settings), and exit",
    )
    args = p.parse_args(argv)
    if not args.print_config:
        check_launch("pretrain")
    num_processes = launched_processes()
    cfg = load_config(args.config, args.overrides, num_processes)
    precision, note = resolve_mixed_precision(cfg)
    cfg.train.mixed_precision = precision  # what runs: in config.yaml, the checkpoints and --print-config
    if args.print_config:
        from pretrain.resolved import config_text, run_device

        print(config_text(cfg, run_device(cfg), num_processes), end="")  # as the run writes config.yaml
        return

    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    from pretrain.engine import train

    accelerator = Accelerator(
        cpu=cfg.train.cpu,
        mixed_precision=precision,
        log_with=trackers(cfg),
        project_dir=cfg.train.output_dir,
        # Buffers (queues, BN statistics) are never re-broadcast from rank 0: queues are kept
        # identical by gathered enqueues, and per-process BN statistics are part of shuffle BN.
        kwargs_handlers=[
            DistributedDataParallelKwargs(broadcast_buffers=False),
            InitProcessGroupKwargs(timeout=timedelta(minutes=cfg.train.dist_timeout_minutes)),
        ],
    )
    if accelerator.num_processes != num_processes:
        raise UserError(
            f"WORLD_SIZE={num_processes} but Accelerate runs {accelerator.num_processes} processes; "
            "launch with torchrun or accelerate launch"
        )
    if note:
        accelerator.print(note)
    try:
        train(cfg, accelerator)
    except Preempted:  # saved at the step reached; the engine printed what to do
        raise SystemExit(PREEMPTED_EXIT_CODE) from None


if __name__ == "__main__":
    main()
