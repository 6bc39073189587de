"""python -m pretrain.analysis {mi-toy,npc,curves,negatives} ...

The papers' diagnostics; each writes a PNG plus CSV/JSON into its output folder.

    mi-toy              EqCo appendix C / Table 9 (InfoNCE vs EqCo MI estimates across K)
    npc CHECKPOINT      DCL Figure 1 (NPC multiplier q_B over a dataset for several batch sizes)
    curves RUN_DIR      loss, lr, MI bound, gradient norm and kNN curves from metrics.jsonl
    negatives RUN_DIR   AdCo Figure 2 (2-D projection of the MoCo queue / AdCo adversaries and queries)
"""

from __future__ import annotations

import argparse
import importlib
import sys

from contrastive_transfer.cli import DEBUG_HELP, command

# subcommand -> (module of pretrain.analysis with add_arguments(parser) and cli(args), its help).
# Only the chosen subcommand's module is imported (they import torch), so --help answers at once.
COMMANDS = {
    "mi-toy": ("mi_toy", "EqCo appendix C / Table 9: InfoNCE vs EqCo MI estimates on correlated Gaussians across K"),
    "npc": ("npc", "DCL Figure 1: the NPC multiplier q_B of a checkpoint over a dataset for several batch sizes"),
    "curves": ("curves", "loss, lr, MI bound, gradient-norm and kNN curves of a run from RUN_DIR/metrics.jsonl"),
    "negatives": (
        "negatives",
        "AdCo Figure 2: 2-D projection of the MoCo queue / AdCo adversaries next to recent queries",
    ),
}


@command
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.analysis",
        description=__doc__.splitlines()[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[4:]) + "\n" + DEBUG_HELP,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((arg for arg in argv if arg in COMMANDS), None)
    modules = {}
    for name, (module_name, text) in COMMANDS.items():
        subparser = sub.add_parser(name, help=text, description=text)
        if name == chosen:
            modules[name] = importlib.import_module(f"pretrain.analysis.{module_name}")
            modules[name].add_arguments(subparser)
    args = parser.parse_args(argv)
    modules[args.command].cli(args)


if __name__ == "__main__":
    main()
