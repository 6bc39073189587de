"""python -m pretrain --config configs/pretrain/<recipe>.yaml [key=value ...]

One process: ``python -m pretrain ...``; several: ``accelerate launch -m pretrain ...`` (or
torchrun). ``train.batch_size`` is the global batch, split over the processes.
"""

from __future__ import annotations

import argparse
import os
import sys

from pretrain.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. configs/pretrain/mocov2.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.batch_size=64")
    args = parser.parse_args(argv)
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch and torchrun
    try:
        cfg = load_config(args.config, args.overrides, num_processes)
    except ConfigError as e:
        sys.exit(f"error: {e}")

    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from pretrain.engine import train

    accelerator = Accelerator(
        cpu=cfg.train.cpu,
        mixed_precision=cfg.train.mixed_precision,
        log_with="tensorboard",
        project_dir=cfg.train.output_dir,
        # Buffers (queues, BN statistics) are never re-broadcast from rank 0: queues are kept
        # identical by gathered enqueues, and per-process BN statistics are part of shuffle BN.
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
    )
    if accelerator.num_processes != num_processes:
        sys.exit(f"error: WORLD_SIZE={num_processes} but Accelerate runs {accelerator.num_processes} processes")
    train(cfg, accelerator)


if __name__ == "__main__":
    main()
