"""Launch a command on SLURM's nodes through torchrun, Accelerate or detectron2's launcher, the
rendezvous read from SLURM's variables.

    srun --ntasks-per-node 1 python -m contrastive_transfer.slurm torchrun -- -m pretrain --config ...
    srun --ntasks-per-node 1 python -m contrastive_transfer.slurm accelerate -- -m pretrain --config ...
    srun --ntasks-per-node 1 python -m contrastive_transfer.slurm detectron2 -- -m transfer.detection ...

One task per node (``srun --ntasks-per-node 1``); each starts the launcher, which starts one process
per GPU of its node. Everything the launcher needs comes from the variables SLURM sets in each task:
the node count (``SLURM_NNODES``), this node's rank (``SLURM_NODEID``), the first host of
``SLURM_JOB_NODELIST`` as the rendezvous address, a port derived from ``SLURM_JOB_ID`` (so that two
jobs sharing a node do not collide; ``MASTER_PORT`` wins when set) and the GPUs of the node
(``SLURM_GPUS_ON_NODE``, else ``--nproc-per-node``, else 1). The scripts in ``tools/slurm/`` use it;
docs/gpu.md explains them with requeueing on a signal.

The launcher replaces this process (``exec``): the signals ``srun`` forwards reach torchrun, which
passes SIGTERM on to its workers; pretraining then saves a checkpoint and exits (docs/failsafe.md).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from contrastive_transfer.cli import UserError, command

__all__ = ["Rendezvous", "expand_hostlist", "launcher_command", "rendezvous"]

PORT_BASE, PORT_SPAN = 20000, 20000  # ports 20000-39999, below Linux's ephemeral range (32768+ only in part)


MAX_HOSTS = 100_000  # far above any cluster; bounds what a host list may expand to before it is expanded


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list in order: ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Written here because the one tool that expands it, ``scontrol show hostnames``, exists only where
    SLURM is installed: the launcher must also run in containers and tests without it. Zero padding
    follows the range's first bound, as in SLURM; several bracket groups (``r[1-2]n[1-2]``) multiply,
    so the hosts are counted from the parsed groups (a product of range lengths) before any is made."""
    items = [_parse_item(item, hostlist) for item in _top_level_items(hostlist)]
    count = sum(math.prod(sum(hi - lo + 1 for lo, hi, _ in ranges) for _, ranges in groups) for groups, _ in items)
    if count > MAX_HOSTS:
        raise UserError(f"SLURM_JOB_NODELIST={hostlist[:200]!r}: expands to {count} hosts, above {MAX_HOSTS}")
    hosts = [host for groups, tail in items for host in _expand(groups, tail)]
    if not hosts:
        raise UserError(f"SLURM_JOB_NODELIST={hostlist!r}: expected a host list such as node[01-04]")
    return hosts


def _top_level_items(hostlist: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    items.append(hostlist[start:])
    return [item.strip() for item in items if item.strip()]


_Groups = list[tuple[str, list[tuple[int, int, int]]]]  # (text before a bracket, its ranges (lo, hi, width))


def _parse_item(item: str, whole: str) -> tuple[_Groups, str]:
    """``r[1-2]n[08-09]x`` -> ([("r", [(1, 2, 1)]), ("n", [(8, 9, 2)])], "x"): nothing expanded."""
    groups: _Groups = []
    while (match := re.match(r"^([^\[\]]*)\[([^\[\]]+)\](.*)$", item)) is not None:
        prefix, ranges, item = match.groups()
        groups.append((prefix, [_parse_range(part, whole) for part in ranges.split(",")]))
    if re.search(r"[\[\]]", item):
        raise UserError(f"SLURM_JOB_NODELIST={whole!r}: unbalanced brackets in {item!r}")
    return groups, item


def _parse_range(part: str, whole: str) -> tuple[int, int, int]:
    bounds = part.split("-")
    if len(bounds) > 2 or not all(re.fullmatch(r"[0-9]{1,18}", b) for b in bounds):
        raise UserError(f"SLURM_JOB_NODELIST={whole!r}: {part!r} is not a number or a range a-b")
    lo, hi = int(bounds[0]), int(bounds[-1])
    if hi < lo:
        raise UserError(f"SLURM_JOB_NODELIST={whole!r}: range {part!r} is empty")
    return lo, hi, len(bounds[0])


def _expand(groups: _Groups, tail: str) -> list[str]:
    hosts = [""]
    for prefix, ranges in groups:
        names = [prefix + str(n).zfill(width) for lo, hi, width in ranges for n in range(lo, hi + 1)]
        hosts = [head + name for head in hosts for name in names]
    return [head + tail for head in hosts]


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc_per_node: int
    job_id: str


MAX_PROCESSES_PER_NODE = 1024


def _int(env: Mapping[str, str], key: str, default: int | None = None, high: int = MAX_HOSTS, low: int = 0) -> int:
    """``env[key]`` as an integer in [low, high], the whole value (``1234; ...`` is not 1234)."""
    value = env.get(key)
    if value is None:
        if default is None:
            raise UserError(f"{key} is not set: run this inside a SLURM job step (srun), one task per node")
        return default
    # SLURM_GPUS_ON_NODE may read "4(x2)" on some versions: that form, and only for it
    pattern = r"\s*([0-9]{1,9})(\(x[0-9]{1,9}\))?\s*" if key == "SLURM_GPUS_ON_NODE" else r"\s*([0-9]{1,9})\s*"
    match = re.fullmatch(pattern, value)
    if match is None or not low <= int(match.group(1)) <= high:
        raise UserError(f"{key}={value[:80]!r}: expected an integer from {low} to {high}")
    return int(match.group(1))


def rendezvous(env: Mapping[str, str], nproc_per_node: int | None = None) -> Rendezvous:
    """The launch of this node, from SLURM's variables in ``env`` (see the module docstring)."""
    nnodes, node_rank = _int(env, "SLURM_NNODES"), _int(env, "SLURM_NODEID")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"SLURM_NODEID={node_rank}: expected a node rank below SLURM_NNODES={nnodes}")
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    if len(hosts) != nnodes:
        raise UserError(f"SLURM_JOB_NODELIST lists {len(hosts)} hosts but SLURM_NNODES={nnodes}")
    job = _int(env, "SLURM_JOB_ID", 0, high=10**9 - 1)
    job_id = env.get("SLURM_JOB_ID", "0").strip()
    port = _int(env, "MASTER_PORT", PORT_BASE + job % PORT_SPAN, high=65535, low=1)
    if nproc_per_node is None:
        nproc_per_node = _int(env, "SLURM_GPUS_ON_NODE", 1, high=MAX_PROCESSES_PER_NODE) or 1
    return Rendezvous(nnodes, node_rank, hosts[0], port, nproc_per_node, job_id)


def launcher_command(launcher: str, rdzv: Rendezvous, python: str, args: list[str]) -> list[str]:
    """The command line that runs ``python args`` on this node through ``launcher``.

    Both get a static rendezvous (the first host, a fixed node rank): the node ranks SLURM assigns
    are the ones every file and log names, and a restarted job meets at the same address."""
    nodes, procs = rdzv.nnodes, rdzv.nproc_per_node
    if launcher == "torchrun":
        head = [python, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(rdzv.node_rank)]
        head += ["--nproc_per_node", str(procs), "--master_addr", rdzv.master_addr]
        return head + ["--master_port", str(rdzv.master_port)] + args
    if launcher == "accelerate":
        head = [python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", str(nodes)]
        head += ["--machine_rank", str(rdzv.node_rank), "--num_processes", str(nodes * procs)]
        head += ["--main_process_ip", rdzv.master_addr, "--main_process_port", str(rdzv.master_port)]
        return head + args
    if launcher == "detectron2":  # detectron2's launch() starts the node's processes itself
        if args[:1] != ["-m"] or len(args) < 2:
            raise UserError("the detectron2 launcher runs a module: give -- -m transfer.detection ...")
        # Right after the module: detectron2's parser takes everything after its options as `opts`.
        flags = ["--num-gpus", str(procs), "--num-machines", str(nodes), "--machine-rank", str(rdzv.node_rank)]
        flags += ["--dist-url", f"tcp://{rdzv.master_addr}:{rdzv.master_port}"]
        return [python, *args[:2], *flags, *args[2:]]
    raise UserError(f"launcher {launcher!r}: expected torchrun, accelerate or detectron2")


@command
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m contrastive_transfer.slurm", description=__doc__.split("\n\n")[0])
    p.add_argument("launcher", choices=("torchrun", "accelerate", "detectron2"))
    p.add_argument("--nproc-per-node", type=int, default=None, help="processes per node (default: its GPUs)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.usage = f"{p.prog} {{torchrun,accelerate,detectron2}} [--nproc-per-node N] [--dry-run] -- -m MODULE ARGS..."
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)  # what follows -- is the launched command's
    a, args = p.parse_args(argv[:split]), argv[split + 1 :]
    if not args:
        raise UserError("nothing to launch: give the command after --, e.g. -- -m pretrain --config ...")
    rdzv = rendezvous(os.environ, a.nproc_per_node)
    cmd = launcher_command(a.launcher, rdzv, sys.executable, args)
    print(
        f"slurm job {rdzv.job_id}: node {rdzv.node_rank} of {rdzv.nnodes}, {rdzv.nproc_per_node} process(es), "
        f"rendezvous {rdzv.master_addr}:{rdzv.master_port}",
        file=sys.stderr,
        flush=True,
    )
    if a.dry_run:
        print(shlex.join(cmd))
        return
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
