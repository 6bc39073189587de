"""The kNN vote at ImageNet's size: time and peak memory of the chunked vote
(``contrastive_transfer.contract.knn_vote``) against a bank of random features, checked against the
formula computed by brute force on a subset of the queries.

    python -m benchmarks.knn_scale [--banks 1281167] [--queries 10000] [--dim 2048] [--device auto]
                                   [--out benchmarks/knn_scale.md]

No images: the bank is standard normal features, L2-normalised (``knn_bank``: float16 on CUDA,
float32 on a CPU), with labels of 1000 classes. Each (bank, queries) pair runs in a fresh process,
so that its peak memory is its own: the growth of the process's peak resident memory (CPU) or of
torch's peak allocation (CUDA) during the vote, over what the bank itself holds. The vote holds at
most ``KNN_SIMILARITIES`` similarities at once, so that growth stays flat when the queries grow;
the full matrix (queries × bank float32 values) is shown beside it for scale.
The check: for the first ``--check`` queries, the k nearest by a float64 product sorted in full,
and the formula's scores Σ_j exp(s_j / t) per class from them; reported are the queries whose
neighbour sets agree and the largest relative difference of their scores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import cpu_name
from contrastive_transfer.cli import write_text
from contrastive_transfer.contract import KNN_K, KNN_SIMILARITIES, KNN_TEMPERATURE, knn_bank, knn_vote

IMAGENET_TRAIN = 1_281_167
CLASSES = 1000


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset the process's peak resident memory (VmHWM) to its current size (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _random_bank(n: int, dim: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, dim) normalised random features built block by block on ``device``, and their labels."""
    g = torch.Generator().manual_seed(seed)
    bank = torch.empty(n, dim, dtype=torch.float16 if device.type == "cuda" else torch.float32, device=device)
    for start in range(0, n, 1 << 16):
        block = torch.randn(min(1 << 16, n - start), dim, generator=g)
        bank[start : start + len(block)] = knn_bank(block, device)
    return bank, torch.randint(0, CLASSES, (n,), generator=g).to(device)


def brute_force(query: torch.Tensor, bank: torch.Tensor, labels: torch.Tensor, k: int, t: float):
    """Per query: (the set of its k nearest by a float64 product sorted in full, the formula's
    class scores in float64) — no topk, no chunks."""
    out = []
    for q in query.double():
        sims = torch.cat([b.double() @ q for b in bank.split(1 << 14)])  # 256 MiB of float64 at a time
        nearest = torch.argsort(sims, descending=True)[:k]
        scores = np.zeros(CLASSES)
        np.add.at(scores, labels[nearest].cpu().numpy(), np.exp(sims[nearest].cpu().numpy() / t))
        out.append((set(nearest.tolist()), scores))
    return out


def one(bank_rows: int, queries: int, dim: int, device: torch.device, check: int, k: int, t: float) -> dict:
    """One (bank, queries) measurement in this process."""
    bank, labels = _random_bank(bank_rows, dim, device, seed=0)
    query = knn_bank(torch.randn(queries, dim, generator=torch.Generator().manual_seed(1)), device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        reset, before = _reset_peak(), _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    scores = knn_vote(query, bank, labels, CLASSES, k, t)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status_kib("VmHWM") * 1024 - (before if reset else 0)
    agree, worst = 0, 0.0
    for i, (nearest, expected) in enumerate(brute_force(query[:check], bank, labels, k, t)):
        idx = (query[i : i + 1].to(bank.dtype) @ bank.T).float().topk(k).indices
        if set(idx[0].tolist()) == nearest:
            agree += 1
            worst = max(worst, float(np.abs(scores[i].double().cpu().numpy() - expected).max() / expected.max()))
    return {
        "bank": bank_rows,
        "queries": queries,
        "dim": dim,
        "device": str(device),
        "bank_dtype": str(bank.dtype).removeprefix("torch."),
        "bank_gib": bank.numel() * bank.element_size() / 2**30,
        "seconds": seconds,
        "peak_growth_mib": peak / 2**20,
        "peak_is_growth": device.type == "cuda" or reset,
        "full_matrix_gib": queries * bank_rows * 4 / 2**30,
        "checked": min(check, queries),
        "agree": agree,
        "max_rel_diff": worst,
    }


def report(rows: list[dict], argv: list[str]) -> str:
    lines = [
        "# The kNN vote at ImageNet's size: time and memory",
        "",
        f"`python -m benchmarks.knn_scale {' '.join(argv)}`; {cpu_name()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}. k {KNN_K}, t {KNN_TEMPERATURE}, {CLASSES} classes, random normalised features; "
        f"the vote holds at most {KNN_SIMILARITIES:,} similarities at once "
        f"({KNN_SIMILARITIES * 4 / 2**20:.0f} MiB in float32). One run each, on a machine shared with other jobs: "
        "the times are one measurement.",
        "",
        "| bank × dim | device (bank dtype) | bank (GiB) | queries | vote (s) | queries/s "
        "| peak memory growth during the vote (MiB) | full similarity matrix (GiB) | brute-force check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        check = f"{r['agree']}/{r['checked']} neighbour sets equal, scores within {r['max_rel_diff']:.1e}"
        lines.append(
            f"| {r['bank']:,} × {r['dim']} | {r['device']} ({r['bank_dtype']}) | {r['bank_gib']:.2f} | "
            f"{r['queries']:,} | {r['seconds']:.1f} | {r['queries'] / r['seconds']:.0f} | "
            f"{r['peak_growth_mib']:.0f}{'' if r['peak_is_growth'] else ' (process peak)'} | "
            f"{r['full_matrix_gib']:.1f} | {check} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--banks", default=str(IMAGENET_TRAIN), help="bank sizes, comma-separated")
    p.add_argument("--queries", default="10000", help="query counts, comma-separated (each with each bank)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--check", type=int, default=20, help="queries checked against the brute-force formula")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("knn_scale.md"))
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one pair, JSON out
    a = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    if a.one:
        print(json.dumps(one(int(a.banks), int(a.queries), a.dim, device, a.check, KNN_K, KNN_TEMPERATURE)))
        return
    rows = []
    for bank in (int(b) for b in a.banks.split(",")):
        for queries in (int(q) for q in a.queries.split(",")):
            child = [sys.executable, "-m", "benchmarks.knn_scale", "--one", "--banks", str(bank)]
            child += ["--queries", str(queries), "--dim", str(a.dim), "--check", str(a.check), "--device", str(device)]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    text = report(rows, sys.argv[1:] if argv is None else argv)
    write_text(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
