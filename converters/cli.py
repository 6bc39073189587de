"""The command line every converter shares (no torch import: ``--help`` answers at once)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from contrastive_transfer.cli import DEBUG_HELP, UserError, describe
from converters.layouts import ENCODERS, LAYOUTS


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


def run_converter(
    argv: list[str] | None,
    prog: str,
    description: str,
    output_help: str,
    convert: Callable[..., dict],
    report: Callable[[dict], None],
) -> int:
    """The whole command line of a converter: parse, ``convert(input, output, encoder, layout)``,
    ``report(summary)``; 0, or 1 after one ``error: ...`` line on stderr for a bad input or an
    unusable path (``--debug`` shows the traceback instead)."""
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
    report(summary)
    return 0
