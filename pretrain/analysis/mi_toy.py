"""EqCo's toy mutual-information experiment (EqCo paper, appendix C, Table 9).

X ~ N(0, I_d), Y = ρX + √(1−ρ²)·ε with d = 20, so the true MI is I(X;Y) = −(d/2)·log(1−ρ²) and
ρ = √(1 − e^{−2I/d}). Following Poole et al. (2019), two MLPs g, h (d → 256 → ReLU → 32) give the
separable critic f(x, y) = g(x)·h(y); a batch of K pairs (x_i, y_i) gives each x_i its positive
y_i and K−1 negatives y_{j≠i}. The critics minimize (Adam, lr 5e-4, 5000 steps)

    InfoNCE  L = −E log e^{f(x_i,y_i)} / Σ_j e^{f(x_i,y_j)}                  estimate log K − L
    EqCo     the same with the margin m = log(α/(K−1)) on the positive      estimate log(1+α) − L

(τ = 1: the critic's scale is learned; K − 1 negatives: log(1 + (K−1)) = log K is Oord et al.'s
bound), i.e. ``info_nce`` with ``eqco_margin(1, α, K−1)`` and ``mi_lower_bound(L, K−1 or α)``.
After training the critics are frozen and the estimate is averaged over 1000 fresh batches.
InfoNCE's estimate cannot exceed log K, so it grows with K; EqCo's should not depend on K.

All (true MI, loss) critics of one K train together: their weights are stacked
(``torch.func.stack_module_state``) and one vmapped forward runs them all; Adam is elementwise,
so this is exactly independent training.

Writes mi_toy.csv (true_mi, k, loss, estimate, ceiling, paper), mi_toy.json (config, rows, the
spread of the estimate across K per loss) and mi_toy.png (estimate vs K, ours and the paper's).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from contrastive_transfer.progress import progress
from pretrain.analysis.common import AnalysisError, pyplot, save_figure, write_csv, write_summary
from pretrain.losses import eqco_margin, info_nce, mi_lower_bound

LOSSES = ("infonce", "eqco")
LABELS = {"infonce": "InfoNCE", "eqco": "EqCo"}

# EqCo paper, Table 9 (α = 512): estimates at K = 64, 128, 256, 512 for each true MI.
PAPER_K = (64, 128, 256, 512)
PAPER_TABLE9 = {
    2.0: {"infonce": (1.7, 1.8, 1.9, 1.9), "eqco": (1.9, 1.9, 1.9, 1.9)},
    4.0: {"infonce": (2.9, 3.2, 3.4, 3.6), "eqco": (3.8, 3.7, 3.6, 3.6)},
    6.0: {"infonce": (3.6, 4.1, 4.5, 4.9), "eqco": (5.1, 5.0, 4.9, 4.9)},
    8.0: {"infonce": (3.9, 4.6, 5.1, 5.6), "eqco": (5.8, 5.7, 5.7, 5.6)},
    10.0: {"infonce": (4.1, 4.7, 5.4, 6.0), "eqco": (6.1, 6.0, 6.0, 6.0)},
}


@dataclass
class ToyConfig:
    true_mi: tuple[float, ...] = (2.0, 4.0, 6.0, 8.0, 10.0)
    ks: tuple[int, ...] = PAPER_K  # pairs per batch (K − 1 negatives per query)
    alpha: float = 512.0
    steps: int = 5000
    eval_batches: int = 1000
    lr: float = 5e-4
    dim: int = 20
    hidden: int = 256
    embed_dim: int = 32  # Poole et al.'s separable critic
    seed: int = 0
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")


# --quick (tests, smoke runs, ~15 s on one CPU core): smaller K, 300 steps, 3 true MIs. Enough for
# InfoNCE's log K ceiling to bite at large MI while EqCo's estimate does not follow K.
QUICK = dict(true_mi=(2.0, 6.0, 10.0), ks=(16, 32, 64), steps=300, eval_batches=20)


def correlation(true_mi: float, dim: int) -> float:
    """ρ with −(d/2)·log(1 − ρ²) = I."""
    return math.sqrt(1.0 - math.exp(-2.0 * true_mi / dim))


def gaussian_mi(rho: float, dim: int) -> float:
    return -0.5 * dim * math.log1p(-rho * rho)


def critic_mlp(dim: int, hidden: int, embed_dim: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim))


class StackedCritics:
    """M separable critics f_m(x, y) = g_m(x)·h_m(y), evaluated together with vmap."""

    def __init__(self, m: int, cfg: ToyConfig, generator_seed: int) -> None:
        with torch.random.fork_rng(devices=[]):  # seeded initialization, the caller's RNG untouched
            torch.manual_seed(generator_seed)
            nets = [critic_mlp(cfg.dim, cfg.hidden, cfg.embed_dim).to(cfg.device) for _ in range(2 * m)]
        self.base = copy.deepcopy(nets[0]).to("meta")
        self.g, _ = stack_module_state(nets[:m])
        self.h, _ = stack_module_state(nets[m:])

    def parameters(self) -> list[torch.Tensor]:
        return [*self.g.values(), *self.h.values()]

    def _apply(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        return vmap(lambda p, xm: functional_call(self.base, p, (xm,)))(params, x)

    def scores(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y (M, K, d) → (M, K, K) critic values f_m(x_i, y_j)."""
        return self._apply(self.g, x) @ self._apply(self.h, y).transpose(1, 2)


def sample_pairs(rho: torch.Tensor, k: int, dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K, d) draws of X and Y = ρ_m X + √(1−ρ_m²) ε, one correlation per critic."""
    shape = (rho.shape[0], k, dim)
    x = torch.randn(shape, generator=generator, device=rho.device)
    noise = torch.randn(shape, generator=generator, device=rho.device)
    r = rho.view(-1, 1, 1)
    return x, r * x + (1.0 - r * r).sqrt() * noise


def batch_losses(critics: StackedCritics, x: torch.Tensor, y: torch.Tensor, margins: torch.Tensor) -> torch.Tensor:
    """(M,) InfoNCE of each critic on its batch (positive = diagonal, K−1 off-diagonal negatives)."""
    scores = critics.scores(x, y)
    m, k, _ = scores.shape
    off_diagonal = ~torch.eye(k, dtype=torch.bool, device=scores.device)
    pos = scores.diagonal(dim1=1, dim2=2).reshape(m * k)
    neg = scores[:, off_diagonal].reshape(m * k, k - 1)
    per_anchor = info_nce(pos, neg, 1.0, margins.repeat_interleave(k), reduction="none")
    return per_anchor.view(m, k).mean(dim=1)


def run_k(cfg: ToyConfig, k: int, advance: Callable[[int], object] | None = None) -> list[dict]:
    """Train and evaluate every (true MI, loss) critic at K pairs per batch; ``advance(1)`` after each step."""
    grid = [(mi, loss) for mi in cfg.true_mi for loss in LOSSES]
    device = torch.device(cfg.device)
    rho = torch.tensor([correlation(mi, cfg.dim) for mi, _ in grid], device=device)
    margins = torch.tensor(
        [eqco_margin(1.0, cfg.alpha, k - 1) if loss == "eqco" else 0.0 for _, loss in grid], device=device
    )
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 100003 + k)
    critics = StackedCritics(len(grid), cfg, cfg.seed * 100003 + k)
    optimizer = torch.optim.Adam(critics.parameters(), lr=cfg.lr)
    for _ in range(cfg.steps):
        x, y = sample_pairs(rho, k, cfg.dim, generator)
        loss = batch_losses(critics, x, y, margins).sum()  # a sum: each critic gets its own gradient
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if advance is not None:
            advance(1)
    with torch.no_grad():
        total = torch.zeros(len(grid), dtype=torch.float64, device=device)
        for _ in range(cfg.eval_batches):
            total += batch_losses(critics, *sample_pairs(rho, k, cfg.dim, generator), margins).double()
        mean_loss = (total / cfg.eval_batches).tolist()
    rows = []
    for (mi, loss_name), loss_value in zip(grid, mean_loss):
        n_equivalent = cfg.alpha if loss_name == "eqco" else k - 1
        paper = PAPER_TABLE9.get(mi, {}).get(loss_name)
        rows.append(
            {
                "true_mi": mi,
                "k": k,
                "loss": loss_name,
                "estimate": mi_lower_bound(loss_value, n_equivalent),
                "ceiling": math.log1p(n_equivalent),  # the estimate's maximum (loss → 0)
                "paper": paper[PAPER_K.index(k)] if paper and k in PAPER_K else None,
            }
        )
    return rows


def spread_across_k(rows: list[dict]) -> dict[str, float]:
    """Per loss: the standard deviation of the estimate across K, averaged over the true MIs."""
    out = {}
    for loss_name in LOSSES:
        stds = []
        for mi in sorted({r["true_mi"] for r in rows}):
            values = torch.tensor([r["estimate"] for r in rows if r["loss"] == loss_name and r["true_mi"] == mi])
            stds.append(values.std(unbiased=False).item())
        out[loss_name] = sum(stds) / len(stds)
    return out


def format_table(rows: list[dict], ks: tuple[int, ...]) -> str:
    """Table 9 layout: one row per (true MI, loss), ours (paper) per K."""
    lines = [f"{'true MI':>7}  {'loss':<8}" + "".join(f"{'K=' + str(k):>14}" for k in ks)]
    for mi in sorted({r["true_mi"] for r in rows}):
        for loss_name in LOSSES:
            cells = []
            for k in ks:
                r = next(r for r in rows if r["true_mi"] == mi and r["k"] == k and r["loss"] == loss_name)
                paper = f" ({r['paper']:.1f})" if r["paper"] is not None else "      "
                cells.append(f"{r['estimate']:>8.2f}{paper}")
            lines.append(f"{mi:>7.1f}  {LABELS[loss_name]:<8}" + "".join(f"{c:>14}" for c in cells))
    return "\n".join(lines) + "\n(paper's Table 9 values in parentheses)"


def plot(rows: list[dict], cfg: ToyConfig, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    colors = plt.cm.viridis([i / max(1, len(cfg.true_mi) - 1) for i in range(len(cfg.true_mi))])
    for ax, loss_name in zip(axes, LOSSES):
        for mi, color in zip(cfg.true_mi, colors):
            mine = sorted(
                (r["k"], r["estimate"], r["paper"]) for r in rows if r["true_mi"] == mi and r["loss"] == loss_name
            )
            ax.plot([m[0] for m in mine], [m[1] for m in mine], "o-", color=color, label=f"true MI {mi:g}")
            paper = [(m[0], m[2]) for m in mine if m[2] is not None]
            if paper:
                ax.plot(*zip(*paper), "x--", color=color, alpha=0.6)
            ax.axhline(mi, color=color, lw=0.6, ls=":")
        ks = sorted(cfg.ks)
        if loss_name == "infonce":
            ax.plot(ks, [math.log(k) for k in ks], "k-.", lw=1, label="log K (ceiling)")
        else:
            ax.axhline(math.log1p(cfg.alpha), color="k", ls="-.", lw=1, label=f"log(1+α), α={cfg.alpha:g}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("K (pairs per batch)")
        ax.set_title(f"{LABELS[loss_name]} estimate (o ours, x paper Table 9)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MI estimate (nats)")
    axes[0].legend(fontsize=8, loc="upper left")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"EqCo toy MI: d={cfg.dim}, {cfg.steps} steps, {cfg.eval_batches} eval batches")
    return save_figure(fig, path)


def run(cfg: ToyConfig, out_dir: Path) -> dict:
    if not cfg.ks or min(cfg.ks) < 2:
        raise AnalysisError(f"--k {list(cfg.ks)}: expected batch sizes of at least 2 pairs")
    if not cfg.true_mi or min(cfg.true_mi) <= 0:
        raise AnalysisError(f"--mi {list(cfg.true_mi)}: expected positive true MI values (nats)")
    if cfg.alpha <= 0 or cfg.steps < 1 or cfg.eval_batches < 1:
        raise AnalysisError(
            f"alpha={cfg.alpha}, steps={cfg.steps}, eval_batches={cfg.eval_batches}: expected positive values"
        )
    start = time.perf_counter()
    rows = []
    with progress(total=cfg.steps * len(cfg.ks), desc="mi-toy", unit="step") as bar:
        for k in cfg.ks:
            bar.set_postfix(K=k)
            rows.extend(run_k(cfg, k, bar.update))
    summary = {
        "config": asdict(cfg),
        "spread_across_k": spread_across_k(rows),
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    out_dir = Path(out_dir)
    write_csv(out_dir / "mi_toy.csv", ["true_mi", "k", "loss", "estimate", "ceiling", "paper"], rows)
    write_summary(out_dir / "mi_toy.json", summary)
    plot(rows, cfg, out_dir / "mi_toy.png")
    summary["table"] = format_table(rows, tuple(cfg.ks))
    return summary


# ------------------------------------------------------------------------------------ command line


def add_arguments(parser) -> None:
    d = ToyConfig()
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"small grid for tests and smoke runs: {QUICK} (explicit options still win)",
    )
    parser.add_argument("--mi", type=float, nargs="+", help=f"true MI values in nats (default {list(d.true_mi)})")
    parser.add_argument("--k", type=int, nargs="+", help=f"pairs per batch K (default {list(d.ks)})")
    parser.add_argument("--alpha", type=float, default=d.alpha, help="EqCo's α (default %(default)s)")
    parser.add_argument("--steps", type=int, help=f"Adam steps per critic (default {d.steps})")
    parser.add_argument("--eval-batches", type=int, help=f"evaluation batches (default {d.eval_batches})")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", default=d.device, help="cpu | cuda (default %(default)s)")
    parser.add_argument(
        "--out",
        "--output-dir",
        type=Path,
        default=Path("outputs/analysis/mi_toy"),
        help="output folder for mi_toy.{csv,json,png} (default %(default)s)",
    )


def cli(args) -> None:
    chosen = {"true_mi": args.mi, "ks": args.k, "steps": args.steps, "eval_batches": args.eval_batches}
    base = QUICK if args.quick else {}
    values = {**base, **{k: v for k, v in chosen.items() if v is not None}}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    cfg = ToyConfig(**values, alpha=args.alpha, seed=args.seed, device=args.device)
    summary = run(cfg, args.out)
    print(summary["table"])
    spread = summary["spread_across_k"]
    print(
        f"std of the estimate across K, mean over true MIs: InfoNCE {spread['infonce']:.3f}, "
        f"EqCo {spread['eqco']:.3f} nats ({summary['seconds']:.0f} s)"
    )
    print(f"wrote {args.out}/mi_toy.csv, mi_toy.json, mi_toy.png")
