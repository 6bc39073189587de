"""What the three frozen-feature evaluators (``transfer.knn``, ``transfer.voc07_svm``,
``transfer.linear``) share on their command line: the checkpoint options, the image size
(``--crop auto`` = the size the checkpoint was pretrained at), and third-party warnings summarised
once instead of repeated per fit.

This module imports nothing heavy: each evaluator parses its arguments with it first, so that
``--help`` and argument errors return at once, and imports torch afterwards.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import re
import warnings
from typing import Iterable

from contrastive_transfer.cli import DEBUG_HELP, UserError
from converters.layouts import LAYOUTS

logger = logging.getLogger(__name__)

# The protocols' sizes for ImageNet-scale backbones: shorter side 256, 224 crop.
PROTOCOL_RESIZE, PROTOCOL_CROP = 256, 224
# A checkpoint pretrained at a size this far (either way) from the evaluation crop gets a warning.
SIZE_MISMATCH_FACTOR = 2.0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default shown after its help, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or action.required or "default" in text:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


@contextlib.contextmanager
def launched_processes(module: str):
    """The evaluator's process group while the block runs, when a launcher started several
    processes (``torchrun --nproc_per_node N -m transfer.knn ...``, ``accelerate launch``,
    ``srun``): NCCL on GPUs, gloo on CPUs, left again at the end. Ranks other than 0 log warnings
    only, so that the log reads as one run's. Nothing happens in one process."""
    import torch.distributed as dist

    from contrastive_transfer.ranks import init_from_launcher, is_main

    created = init_from_launcher(module)
    if not is_main():
        logging.getLogger().setLevel(logging.WARNING)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def make_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=prog, description=doc.split("\n\n")[0], epilog=DEBUG_HELP, formatter_class=HelpFormatter
    )


def crop_value(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--crop {text!r}: expected a positive integer or 'auto'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--crop {text!r}: expected a positive integer or 'auto'")
    return value


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", required=True, help="checkpoint in any layout the converters read")
    parser.add_argument(
        "--encoder",
        default="query",
        choices=["query", "key"],
        help="key: the momentum (teacher) encoder of a two-encoder checkpoint",
    )
    parser.add_argument(
        "--layout",
        default="auto",
        choices=["auto", *LAYOUTS],
        help="force a checkpoint layout (see python -m converters.to_detectron2 --help)",
    )


def add_size_args(parser: argparse.ArgumentParser, resize_help: str, crop_help: str) -> None:
    parser.add_argument(
        "--resize",
        type=int,
        default=None,
        help=f"{resize_help} (default: {PROTOCOL_RESIZE}, or crop·256/224 with --crop auto)",
    )
    parser.add_argument(
        "--crop",
        type=crop_value,
        default=PROTOCOL_CROP,
        help=f"{crop_help}; 'auto': the image size the checkpoint was pretrained at",
    )


def resolve_size(resize: int | None, crop: int | str, trained_at: int | None) -> tuple[int, int]:
    """(resize, crop) to evaluate at, and one warning line when the checkpoint was pretrained at a
    size far from the evaluation crop.

    ``crop == "auto"``: the pretraining size (the protocol's 224 when the checkpoint does not record
    it), with the resize scaled as 256/224 scales the protocol's crop."""
    if crop == "auto":
        if trained_at is None:
            logger.warning(
                "--crop auto: the checkpoint does not record its pretraining image size; "
                "evaluating at the protocol's %d",
                PROTOCOL_CROP,
            )
            crop = PROTOCOL_CROP
        else:
            crop = trained_at
            logger.info("--crop auto: evaluating at the pretraining size %d px", crop)
        resize = resize or round(crop * PROTOCOL_RESIZE / PROTOCOL_CROP)
    else:
        resize = resize or PROTOCOL_RESIZE
    if crop > resize:
        raise UserError(f"--crop {crop} is larger than --resize {resize}; the crop must fit in the resized image")
    if trained_at is not None and max(crop / trained_at, trained_at / crop) > SIZE_MISMATCH_FACTOR:
        logger.warning(
            "the checkpoint was pretrained at %d px but is evaluated at %d px: pass --crop auto (or "
            "--resize %d --crop %d) to evaluate at its own size",
            trained_at,
            crop,
            round(trained_at * PROTOCOL_RESIZE / PROTOCOL_CROP),
            trained_at,
        )
    return resize, crop


def source_record(weights, encoder: str, backbone) -> dict:
    """What every evaluator's metrics.json says about the weights it evaluated."""
    return {
        "checkpoint": str(weights),
        "encoder": encoder,
        "weights_sha256": backbone.weights_sha256,  # contract.weights_sha256: checkpoint_final records the same
        "backbone": {
            "arch": backbone.arch,
            "stem": backbone.stem,
            "layout": backbone.layout,
            "pretraining_image_size": backbone.image_size,
        },
    }


def add_loader_args(parser: argparse.ArgumentParser, batch_size: int | None, workers: int = 4) -> None:
    parser.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help="images per batch" + (" (default: the preset's)" if batch_size is None else ""),
    )
    parser.add_argument("--workers", type=int, default=workers, help="data loading processes")


# Messages that repeat with different numbers collapse into one entry of the summary.
_NUMBERS = re.compile(r"\d+(\.\d+)?")


@contextlib.contextmanager
def summarised_warnings(context: str):
    """Collect the warnings raised inside (and those handed to ``record``) and log each kind once,
    with how often it occurred, when the block ends."""
    counts: collections.Counter[str] = collections.Counter()
    first: dict[str, str] = {}

    def record(category: str, message: str) -> None:
        key = f"{category}: {_NUMBERS.sub('N', message)}"
        counts[key] += 1
        first.setdefault(key, f"{category}: {message}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = WarningSummary(record)
        yield summary
    for w in caught:
        record(w.category.__name__, str(w.message))
    for key, n in counts.items():
        logger.warning(
            "%s: %s%s", context, " ".join(first[key].split()), f" (and {n - 1} more like it)" if n > 1 else ""
        )


class WarningSummary:
    """Handle of ``summarised_warnings``: ``add(records)`` takes (category, message) pairs caught
    elsewhere, e.g. in worker processes."""

    def __init__(self, record) -> None:
        self._record = record

    def add(self, records: Iterable[tuple[str, str]]) -> None:
        for category, message in records:
            self._record(category, message)
