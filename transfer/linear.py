"""Linear probes on a frozen backbone: ImageNet (MoCo, AdCo protocols) and Places205.

    python -m transfer.linear --weights CKPT --dataset imagenet|places205 --data-root DIR
                              --preset bn|moco|adco|places205 --output-dir OUT [--resume]

The backbone stays in eval mode with frozen weights (BN statistics never move); only the head
learns. After the run every backbone tensor is compared bit for bit with the checkpoint's.

Presets: ``transfer.probe_presets``. The probe itself (torch): ``transfer.linear_probe``.

Train images: RandomResizedCrop(crop) + horizontal flip; val: shorter side `resize`, center crop.
``--epochs`` rescales the step milestones in proportion (60/80 of 100 → 3/4 of 5).
Reported: top-1/top-5 of the last epoch and the best top-1 over epochs (MoCo reports the best).

On N processes (``torchrun --nproc_per_node N -m transfer.linear ...``, ``accelerate launch``,
``tools/slurm/probe.sbatch``): the same global batch and lr, each process a slice of every batch,
the head under DDP (its BatchNorm synchronised); rank 0 holds the lock and writes.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path

from contrastive_transfer.cli import OutputLock, command
from contrastive_transfer.preempt import PREEMPTED_EXIT_CODE, Preempted
from transfer import eval_cli
from transfer.layers import LAYERS
from transfer.probe_presets import PRESETS, PROBE_STATE, ProbeSettings

logger = logging.getLogger(__name__)


def parser():
    p = eval_cli.make_parser("python -m transfer.linear", __doc__)
    eval_cli.add_checkpoint_args(p)
    p.add_argument("--dataset", required=True, choices=["imagenet", "places205"])
    p.add_argument(
        "--data-root",
        required=True,
        help="imagenet: train/ and val/ ImageFolders; places205: trainvalsplit_places205/ and data/vision/...",
    )
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--output-dir", "--out", required=True, help=f"metrics.json and {PROBE_STATE} go here")
    p.add_argument("--resume", action="store_true", help=f"continue from OUT/{PROBE_STATE}")
    p.add_argument("--epochs", type=int, default=None, help="override the preset's (milestones rescale)")
    p.add_argument("--lr", type=float, default=None, help="override the preset's base lr")
    p.add_argument("--layer", default=None, choices=sorted(LAYERS), help="override the preset's feature")
    eval_cli.add_size_args(p, "val: shorter side before the center crop", "network input side")
    eval_cli.add_loader_args(p, batch_size=None)
    p.add_argument("--seed", type=int, default=0, help="the head's initialization and the data order")
    return p


def settings(args: argparse.Namespace) -> ProbeSettings:
    """The run's settings from the parsed command line: the preset with its overrides applied."""
    preset = PRESETS[args.preset]
    if args.epochs:
        preset = preset.with_epochs(args.epochs)
    preset = replace(
        preset,
        lr=args.lr or preset.lr,
        batch_size=args.batch_size or preset.batch_size,
        layer=args.layer or preset.layer,
    )
    return ProbeSettings(
        weights=args.weights,
        dataset=args.dataset,
        data_root=args.data_root,
        preset_name=args.preset,
        preset=preset,
        output_dir=Path(args.output_dir),
        encoder=args.encoder,
        layout=args.layout,
        resume=args.resume,
        resize=args.resize,
        crop=args.crop,
        workers=args.workers,
        seed=args.seed,
    )


@command
def main(argv: list[str] | None = None) -> None:
    probe = settings(parser().parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with eval_cli.launched_processes("transfer.linear"):
        metrics = _run_locked(probe)
    if metrics is not None:
        print(json.dumps({k: round(metrics[k], 2) for k in ("top1", "top5", "best_top1")}))


def _run_locked(probe: ProbeSettings) -> dict | None:
    """The probe, holding the output directory: one probe per directory, since a second would
    interleave its epochs into the same files. Under a launcher rank 0 alone takes the lock and
    writes; every process stops with rank 0's one line when the directory is taken. The metrics on
    rank 0, None on the others."""
    from contrastive_transfer.cli import write_json
    from contrastive_transfer.ranks import done_by_rank0, is_main
    from transfer.linear_probe import run

    lock = OutputLock(probe.output_dir, "--output-dir")
    done_by_rank0(lambda: bool(lock.acquire()))
    try:
        try:
            metrics = run(probe)
        except Preempted:  # saved where it stopped; the probe logged what to do
            raise SystemExit(PREEMPTED_EXIT_CODE) from None
        if not is_main():
            return None
        write_json(probe.output_dir / "metrics.json", metrics)
        return metrics
    finally:
        lock.release()  # a no-op where it was not taken


if __name__ == "__main__":
    main()
