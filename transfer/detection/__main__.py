"""Fine-tune a detector from a converted backbone (detectron2 train_net conventions).

    python -m transfer.detection --config-file configs/detection/<cfg>.yaml --num-gpus N \
        [--num-machines M --machine-rank R --dist-url URL] [--eval-only] [--resume] \
        [--seeds S] [--data-root DIR] KEY VALUE ...

Trains with detectron2's DefaultTrainer, evaluates after the final checkpoint and writes
``OUTPUT_DIR/metrics.json`` with the AP figures (``--seeds S``: S runs and their mean ± std).
``--num-gpus N`` starts N processes per machine (NCCL on GPUs; on a CPU-only machine gloo, with
SyncBN replaced by detectron2's NaiveSyncBatchNorm). Input errors exit with one line.
"""

from __future__ import annotations

import argparse
import os
import sys

from contrastive_transfer.cli import DEBUG_HELP, command


def parser() -> argparse.ArgumentParser:
    """detectron2's ``default_argument_parser`` options, restated: importing detectron2 to build
    them takes seconds and prints FutureWarnings, and ``--help`` should answer at once."""
    port = 2**15 + 2**14 + hash(os.getuid() if sys.platform != "win32" else 1) % 2**14  # detectron2's
    p = argparse.ArgumentParser(
        prog="python -m transfer.detection",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2] + "\n" + DEBUG_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config-file", default="", metavar="FILE", help="path to config file")
    p.add_argument(
        "--resume", action="store_true", help="continue from OUTPUT_DIR's last checkpoint (and skip finished seeds)"
    )
    p.add_argument("--eval-only", action="store_true", help="perform evaluation only")
    p.add_argument("--num-gpus", type=int, default=1, help="processes per machine (default: 1)")
    p.add_argument("--num-machines", type=int, default=1, help="total number of machines (default: 1)")
    p.add_argument("--machine-rank", type=int, default=0, help="the rank of this machine (default: 0)")
    p.add_argument(
        "--dist-url",
        default=f"tcp://127.0.0.1:{port}",
        help="initialization URL for pytorch distributed backend (default: %(default)s)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="S",
        help="run S seeds and report mean ± std (VOC: the MoCo protocol averages 5; default: 1)",
    )
    p.add_argument(
        "--data-root",
        default=None,
        metavar="DIR",
        help="folder with VOC2007/, VOC2012/, coco/ (default: $DETECTRON2_DATASETS or ./datasets)",
    )
    p.add_argument(
        "--allow-network",
        action="store_true",
        help="fetch a _BASE_ or MODEL.WEIGHTS given as a URL (http(s)://, detectron2:// model-zoo names); "
        "off by default: a URL is refused (docs/security.md)",
    )
    p.add_argument(
        "opts",
        default=None,
        nargs=argparse.REMAINDER,
        help="config KEY VALUE pairs overriding the config file, e.g. SOLVER.IMS_PER_BATCH 16",
    )
    return p


@command
def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if not args.config_file:
        from contrastive_transfer.cli import UserError

        raise UserError("--config-file is required (e.g. configs/detection/coco_R_50_FPN_1x_syncbn.yaml)")
    from transfer.detection.run import run

    return run(args)


if __name__ == "__main__":
    main()
