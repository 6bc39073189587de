"""The command line every converter shares (no torch import: ``--help`` answers at once)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from contrastive_transfer.cli import DEBUG_HELP, UserError, atomic_write, describe
from converters.layouts import ENCODERS, LAYOUTS

if TYPE_CHECKING:  # imported by convert_backbone, so that --help answers at once
    from converters.checkpoint_io import Backbone


# Every file a converter writes gets this mode, less the umask: torch.save and pickle create files
# the usual way (0666 less the umask), but safetensors creates its own 0600, so the same weights
# were private as .safetensors and readable as .pth or .pkl.
OUTPUT_MODE = 0o644


def write_output(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """``contrastive_transfer.cli.atomic_write`` with the file's mode set to ``OUTPUT_MODE`` less
    the umask before it takes its name."""
    umask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(umask)

    def write_with_mode(tmp: Path) -> None:
        write(tmp)
        os.chmod(tmp, OUTPUT_MODE & ~umask)

    return atomic_write(path, write_with_mode)


def add_arguments(parser: argparse.ArgumentParser, output_help: str) -> None:
    """The command-line arguments every converter shares."""
    parser.add_argument("input", help="checkpoint of any supported layout")
    parser.add_argument("output", help=output_help)
    parser.add_argument(
        "--encoder",
        choices=ENCODERS,
        default="query",
        help="query = the online encoder (default); key = the momentum (key/teacher) encoder",
    )
    parser.add_argument(
        "--layout",
        choices=["auto", *LAYOUTS],
        default="auto",
        help="force a layout instead of detecting it: "
        + "; ".join(f"{name} = {lay.description}" for name, lay in LAYOUTS.items()),
    )


def converter_main(
    module: str, doc: str, output_help: str, convert: Callable[..., dict], report: Callable[[dict], str]
) -> Callable[..., int]:
    """The ``main(argv)`` of the converter ``module`` (``python -m <module>``, described by the
    first line of its ``doc``): see ``run_converter``."""

    def main(argv: list[str] | None = None) -> int:
        return run_converter(argv, f"python -m {module}", doc.split("\n")[0], output_help, convert, report)

    return main


def run_converter(
    argv: list[str] | None,
    prog: str,
    description: str,
    output_help: str,
    convert: Callable[..., dict],
    report: Callable[[dict], str],
) -> int:
    """The whole command line of a converter: parse, ``convert(input, output, encoder, layout)``,
    print the summary's lines and ``report(summary)``; 0, or 1 after one ``error: ...`` line on
    stderr for a bad input or an unusable path (``--debug`` shows the traceback instead)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=DEBUG_HELP)
    add_arguments(parser, output_help)
    parser.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        summary = convert(args.input, args.output, args.encoder, args.layout)
    except (UserError, OSError) as e:
        if args.debug:
            raise
        print(f"error: {describe(e)}", file=sys.stderr)
        return 1
    print(*summary["lines"], report(summary), sep="\n")
    return 0


def convert_backbone(
    in_path: str | os.PathLike,
    out_path: Path,
    encoder: str,
    layout: str,
    write: Callable[[Backbone, Path], int],
) -> tuple[Backbone, dict]:
    """What every converter does around its format: refuse to overwrite the input, read the
    backbone, ``write(backbone, out_path)`` (atomically; it returns the number of tensors written),
    and the summary the CLI prints. Returns (backbone, summary) for the converter to add its own."""
    from converters.checkpoint_io import CheckpointError, load_backbone, summary_lines

    if out_path.exists() and Path(in_path).exists() and out_path.samefile(in_path):
        raise CheckpointError(f"{out_path}: the output would overwrite the input")
    backbone = load_backbone(in_path, encoder, layout)
    tensors = write(backbone, out_path)
    summary = {
        "input": str(in_path),
        "output": str(out_path),
        "layout": backbone.layout,
        "encoder": encoder,
        "arch": backbone.arch,
        "depth": backbone.depth,
        "stem": backbone.stem,
        "tensors": tensors,
        "weights_sha256": backbone.weights_sha256,
        "dropped": backbone.dropped,
        "lines": summary_lines(backbone),
    }
    return backbone, summary
