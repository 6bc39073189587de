"""Where a run's stored negatives sit among its queries (AdCo paper, Figure 2).

AdCo plots a t-SNE of its learned negative adversaries and of MoCo v2's queue next to the
queries of the last six minibatches: MoCo's queue has more outliers (small isolated clusters
that contribute little to the loss), AdCo's adversaries track the queries.

From a run's ``checkpoint_last.pth`` (the final export holds only the backbone) this takes the
stored negatives (``NEGATIVE_BANKS``: MoCo's ``queue``, AdCo's ``bank.weight``; both d×K, one
negative per column, L2-normalized here as the losses use them) and embeds ``--queries`` images
(default six training minibatches) through the query encoder with the run's query-view
augmentation, in train mode on batches of ``train.batch_size``, i.e. as the loss saw queries.
Both sets are projected together to 2-D with PCA (default) or t-SNE (scikit-learn).
Besides the picture, the JSON reports each negative's cosine to its nearest query (and each
query's to its nearest other query, for scale): isolated negatives have a low one.

Writes negatives.png, negatives.csv (kind, minibatch, x, y of every plotted point) and
negatives.json (bank, counts, nearest-query cosines; AdCo's ``filled`` count while the bank fills).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from contrastive_transfer.contract import METHOD_STATE
from pretrain.analysis import common
from pretrain.analysis.common import AnalysisError, write_csv, write_summary
from pretrain.data import ImageDataset

# state_dict key of the method -> what it is. Each holds d×K negatives, one per column.
NEGATIVE_BANKS = {
    "queue": "MoCo queue",
    "bank.weight": "AdCo adversaries",
}
PROJECTIONS = ("pca", "tsne")


def find_negatives(method_state: dict, path: Path) -> tuple[str, torch.Tensor]:
    """(key, K×d L2-normalized negatives) of the first known bank in a method state_dict."""
    for key in NEGATIVE_BANKS:
        if key in method_state:
            bank = method_state[key]
            if bank.dim() != 2:
                raise AnalysisError(f"{path}: method state {key!r} has shape {tuple(bank.shape)}, expected (d, K)")
            return key, F.normalize(bank.float().T, dim=1)
    raise AnalysisError(
        f"{path}: no stored negatives in the method state (expected one of {list(NEGATIVE_BANKS)}; "
        "SimCLR-style methods keep none)"
    )


@torch.no_grad()
def embed_queries(
    encoder: torch.nn.Module, views, root: str, n: int, batch_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n', d) normalized queries of n' = ⌊n/batch⌋·batch images, train-mode BN per batch, and the
    minibatch index of each."""
    # the exact reference's float32 views, which embed_dataset gives the network as they come
    dataset = ImageDataset(root, views[:1], seed=seed, backend="torchvision")
    n = min(n, len(dataset)) // batch_size * batch_size
    if n == 0:
        raise AnalysisError(f"{root} has {len(dataset)} images, fewer than one batch of {batch_size}")
    keep = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:n]
    encoder.train()  # the statistics the loss saw: this batch's (a throwaway copy is updated)
    (queries,) = common.embed_dataset(encoder, dataset, keep.tolist(), batch_size, "negatives embed")
    return queries, torch.arange(n) // batch_size


def project(points: torch.Tensor, how: str, seed: int):
    if how == "pca":
        from sklearn.decomposition import PCA

        return PCA(n_components=2, random_state=seed).fit_transform(points.numpy())
    from sklearn.manifold import TSNE

    perplexity = min(30.0, max(2.0, (points.shape[0] - 1) / 3))
    return TSNE(n_components=2, init="pca", perplexity=perplexity, random_state=seed).fit_transform(points.numpy())


def nearest_cosine(a: torch.Tensor, b: torch.Tensor, exclude_self: bool = False) -> torch.Tensor:
    sim = a @ b.T
    if exclude_self:
        sim.fill_diagonal_(-2.0)
    return sim.max(dim=1).values


def quantiles(x: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(x.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    return {"mean": x.double().mean().item(), "p05": q[0], "p50": q[1], "p95": q[2]}


def plot(xy, n_neg: int, batch_of_query: torch.Tensor, title: str, label: str, path: Path) -> Path:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 6.5))
    ax.scatter(xy[:n_neg, 0], xy[:n_neg, 1], s=4, c="0.6", alpha=0.5, label=f"{label} ({n_neg})", rasterized=True)
    batches = batch_of_query.tolist()
    colors = plt.cm.tab10
    for b in sorted(set(batches)):
        rows = [n_neg + i for i, bb in enumerate(batches) if bb == b]
        ax.scatter(xy[rows, 0], xy[rows, 1], s=14, color=colors(b % 10), label=f"queries, minibatch {b + 1}")
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(fontsize=8, markerscale=1.5, loc="best")
    return common.save_figure(fig, path)


def run(
    run_dir: Path,
    out_dir: Path | None = None,
    checkpoint: Path | None = None,
    data: str | None = None,
    num_queries: int | None = None,
    projection: str = "pca",
    max_negatives: int = 8192,
    seed: int = 0,
) -> dict:
    run_dir = Path(run_dir)
    checkpoint = Path(checkpoint) if checkpoint is not None else run_dir / "checkpoint_last.pth"
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "analysis"
    if projection not in PROJECTIONS:
        raise AnalysisError(f"--projection {projection!r}: expected one of {list(PROJECTIONS)}")
    if not checkpoint.is_file():
        raise AnalysisError(
            f"{checkpoint} does not exist: negatives needs the training checkpoint (the queue or "
            "adversaries live there; checkpoint_final.pth holds only the backbone)"
        )
    state = common.load_checkpoint(checkpoint)
    if not common.is_training_checkpoint(state):
        raise AnalysisError(
            f"{checkpoint} is not a training checkpoint (expected the keys method_state and config, "
            "as in checkpoint_last.pth)"
        )
    key, negatives = find_negatives(state[METHOD_STATE], checkpoint)
    method, cfg = common.rebuild_method(state, checkpoint)
    batch_size = int(cfg.train.batch_size)
    num_queries = num_queries or 6 * batch_size
    data = data or cfg.data.root
    queries, batch_of_query = embed_queries(
        common.query_encoder(method), type(method).view_transforms(cfg), data, num_queries, batch_size, seed
    )
    if queries.shape[1] != negatives.shape[1]:
        raise AnalysisError(f"{checkpoint}: queries have {queries.shape[1]} dimensions, {key!r} {negatives.shape[1]}")

    shown = negatives
    if negatives.shape[0] > max_negatives:  # t-SNE is quadratic and a 65536-point cloud hides the queries
        keep = torch.randperm(negatives.shape[0], generator=torch.Generator().manual_seed(seed))[:max_negatives]
        shown = negatives[keep.sort().values]
    xy = project(torch.cat([shown, queries]), projection, seed)
    n_neg = shown.shape[0]
    label = NEGATIVE_BANKS[key]
    rows = [{"kind": "negative", "batch": "", "x": float(x), "y": float(y)} for x, y in xy[:n_neg]]
    rows += [
        {"kind": "query", "batch": int(b), "x": float(x), "y": float(y)}
        for (x, y), b in zip(xy[n_neg:], batch_of_query.tolist())
    ]
    write_csv(out_dir / "negatives.csv", ["kind", "batch", "x", "y"], rows)
    summary = {
        "checkpoint": str(checkpoint),
        "step": state.get("step"),
        "method": cfg.method.name,
        "negatives_key": key,
        "negatives": label,
        "num_negatives": negatives.shape[0],
        "num_plotted_negatives": n_neg,
        "num_queries": queries.shape[0],
        "projection": projection,
        "data": str(data),
        "seed": seed,
        "negative_to_nearest_query_cos": quantiles(nearest_cosine(negatives, queries)),
        "query_to_nearest_other_query_cos": quantiles(nearest_cosine(queries, queries, exclude_self=True)),
    }
    if "filled" in state[METHOD_STATE]:  # AdCo: columns still random before the bank is filled
        summary["bank_filled"] = int(state[METHOD_STATE]["filled"])
    write_summary(out_dir / "negatives.json", summary)
    plot(
        xy,
        n_neg,
        batch_of_query,
        f"{label} and recent queries ({projection.upper()}), {checkpoint.parent.name} step {state.get('step')}",
        label,
        out_dir / "negatives.png",
    )
    summary["out_dir"] = str(out_dir)
    return summary


# ------------------------------------------------------------------------------------ command line


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a pretraining output folder (train.output_dir)")
    parser.add_argument("--checkpoint", type=Path, help="training checkpoint (default RUN_DIR/checkpoint_last.pth)")
    parser.add_argument("--data", help="images for the queries (default: the run's data.root)")
    parser.add_argument(
        "--queries",
        type=int,
        dest="num_queries",
        help="number of query images (default: six minibatches of train.batch_size)",
    )
    parser.add_argument("--projection", choices=PROJECTIONS, default="pca", help="default %(default)s")
    parser.add_argument(
        "--max-negatives",
        type=int,
        default=8192,
        help="plot a seeded random subset of at most this many negatives (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", "--output-dir", dest="out_dir", type=Path, help="output folder (default RUN_DIR/analysis)"
    )


def cli(args) -> None:
    s = common.run_with_args(run, args)
    near = s["negative_to_nearest_query_cos"]
    ref = s["query_to_nearest_other_query_cos"]
    print(
        f"{s['negatives']} ({s['negatives_key']}, {s['num_negatives']}) vs {s['num_queries']} queries of "
        f"{s['checkpoint']} (step {s['step']}): cosine to the nearest query median {near['p50']:.3f} "
        f"(p05 {near['p05']:.3f}); query to nearest other query median {ref['p50']:.3f}"
    )
    print(f"wrote {s['out_dir']}/negatives.png, negatives.csv, negatives.json")
