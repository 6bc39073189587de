"""python -m pretrain.analysis {mi-toy,npc,curves,negatives} ...

The papers' diagnostics; each writes a PNG plus CSV/JSON into its output folder.

    mi-toy              EqCo appendix C / Table 9 (InfoNCE vs EqCo MI estimates across K)
    npc CHECKPOINT      DCL Figure 1 (NPC multiplier q_B over a dataset for several batch sizes)
    curves RUN_DIR      loss, lr, MI bound, gradient norm and kNN curves from metrics.jsonl
    negatives RUN_DIR   AdCo Figure 2 (2-D projection of the MoCo queue / AdCo adversaries and queries)
"""

from __future__ import annotations

import argparse
import sys

from pretrain.analysis import curves, mi_toy, negatives, npc
from pretrain.analysis.common import AnalysisError

# subcommand -> module with HELP, add_arguments(parser) and cli(args)
COMMANDS = {"mi-toy": mi_toy, "npc": npc, "curves": curves, "negatives": negatives}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.analysis", description=__doc__.splitlines()[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[4:]))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    try:
        COMMANDS[args.command].cli(args)
    except (AnalysisError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
