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

import sys

from detectron2.engine import default_argument_parser

from transfer.detection.config import ConfigError
from transfer.detection.datasets import DatasetError
from transfer.detection.run import run
from transfer.detection.trainer import BackboneNotLoaded


def parser():
    p = default_argument_parser(epilog=__doc__.split("\n\n", 2)[2])
    p.prog = "python -m transfer.detection"
    p.add_argument("--seeds", type=int, default=1, metavar="S",
                   help="run S seeds and report mean ± std (VOC: the MoCo protocol averages 5)")
    p.add_argument("--data-root", default=None, metavar="DIR",
                   help="folder with VOC2007/, VOC2012/, coco/ (default: $DETECTRON2_DATASETS or ./datasets)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if not args.config_file:
        sys.exit("error: --config-file is required")
    try:
        return run(args)
    except (ConfigError, DatasetError, BackboneNotLoaded) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
