"""DCL's negative-positive coupling (NPC) multiplier over a dataset (DCL paper, Figure 1).

For a SimCLR batch of B images with two views, anchor z_i^(1) has its positive z_i^(2) and the
2B − 2 negatives z_j^(1), z_j^(2) (j ≠ i); InfoNCE's gradient of that anchor is scaled by

    q_B,i = 1 − e^{⟨z_i^(1), z_i^(2)⟩/τ} / (e^{⟨z_i^(1), z_i^(2)⟩/τ} + Σ_{l∈{1,2}, j≠i} e^{⟨z_i^(1), z_j^(l)⟩/τ})

(DCL Prop. 1, Eq. 3; symmetrically for the anchors of view 2). Small batches push q_B towards 0
and spread it out; DCL plots its mean and coefficient of variation C_v = σ/μ per batch size,
and its histogram.

The embedding is the one the loss sees when the checkpoint allows it: a ``checkpoint_last.pth``
rebuilds the method, and its query encoder (backbone + projection head) embeds the images. Any
other checkpoint (``checkpoint_final.pth``, MoCo/torchvision/VISSL files) only holds a backbone,
so its (L2-normalized) backbone features are used, and the report says so. BN runs in eval mode:
an image's embedding then does not depend on its batch, so one pass over the data serves every
batch size and only the number of negatives changes between them, the effect the figure shows.
The batches are random partitions of the data (seeded); τ is the run's ``method.temperature``.

Writes npc.csv (per B: mean, std, C_v, quantiles), npc_values.csv (every anchor's q_B with its
batch, image index in ``ImageDataset(root)`` order and view), npc.json (summary, histogram) and
npc.png (mean and C_v vs B; histograms).
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf

from contrastive_transfer.shards import is_sharded
from pretrain.analysis import common
from pretrain.analysis.common import AnalysisError, write_csv, write_summary
from pretrain.augment import build_view_transforms
from pretrain.config import saved_config
from pretrain.data import ImageDataset
from pretrain.losses import nt_xent_similarities

DEFAULT_BATCH_SIZES = (32, 64, 128, 256, 512, 1024)
HISTOGRAM_BINS = 50


def npc_multipliers(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """q_B of the 2B anchors of one SimCLR batch, ordered [view-1 anchors; view-2 anchors]."""
    pos, neg = nt_xent_similarities(z1, z2, z1, z2, 0)
    logits = torch.cat([pos.unsqueeze(1), neg], dim=1) / temperature
    return 1.0 - logits.softmax(dim=1)[:, 0]


def npc_by_batch_size(
    z1: torch.Tensor, z2: torch.Tensor, batch_sizes, temperature: float, seed: int = 0
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """For each B: (batches (n_b, B) image indices, q (n_b, 2B)) over a seeded random partition of
    the images into ⌊n/B⌋ batches (the remainder is left out, as with drop_last)."""
    n = z1.shape[0]
    out = {}
    for b in batch_sizes:
        g = torch.Generator().manual_seed(seed * 7919 + b)
        batches = torch.randperm(n, generator=g)[: (n // b) * b].view(-1, b)
        out[b] = (batches, torch.stack([npc_multipliers(z1[idx], z2[idx], temperature) for idx in batches]))
    return out


def load_embedder(path: Path) -> tuple[torch.nn.Module, dict | None, str, int | None]:
    """(network in eval mode, the run's config if the file has one, what the embedding is, the
    pretraining image size: a weights file's as every evaluator reads it, ``load_backbone``'s record)."""
    state = common.load_checkpoint(path)
    if common.is_training_checkpoint(state):
        method, cfg = common.rebuild_method(state, path)
        return (
            common.query_encoder(method).eval(),
            OmegaConf.to_container(cfg),
            "projection (query encoder: backbone + head)",
            int(cfg.data.image_size),
        )
    from converters.checkpoint_io import CheckpointError, build_resnet, load_backbone

    try:
        backbone = load_backbone(path)
    except CheckpointError as e:
        raise AnalysisError(str(e)) from None
    cfg = state.get("config") if isinstance(state.get("config"), dict) else None
    what = f"backbone features ({backbone.arch}; the file holds no projection head)"
    return build_resnet(backbone), cfg, what, backbone.image_size


@torch.no_grad()
def embed_views(
    net: torch.nn.Module,
    root: str,
    augmentation: str,
    image_size: int,
    seed: int,
    max_images: int | None = None,
    batch_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two augmented views of the images (epoch 0 of the per-sample seeded augmentation), embedded
    and L2-normalized: (n, d) each, and the images' indices in ``ImageDataset(root)``."""
    # the exact reference's float32 views, which embed_dataset gives the network as they come
    dataset = ImageDataset(root, build_view_transforms(augmentation, image_size), seed=seed, backend="torchvision")
    indices = torch.arange(len(dataset))
    if max_images is not None and max_images < len(dataset):
        indices = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:max_images].sort().values
    z1, z2 = common.embed_dataset(net, dataset, indices.tolist(), batch_size, "npc embed")
    return z1, z2, indices


def summarize(q: torch.Tensor) -> dict[str, float]:
    q = q.double().flatten()
    mean, std = q.mean().item(), q.std(unbiased=False).item()
    quantiles = torch.quantile(q, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    return {
        "mean": mean,
        "std": std,
        "cv": std / mean if mean > 0 else float("nan"),
        "p05": quantiles[0],
        "p50": quantiles[1],
        "p95": quantiles[2],
    }


def histogram_edges(values: dict[int, torch.Tensor]) -> torch.Tensor:
    """Common bins from the smallest q_B (rounded down to 0.01) to 1: trained models put q_B near 1,
    where fixed [0, 1] bins would merge every batch size into one bar."""
    low = min(q.min().item() for q in values.values())
    return torch.linspace(min(0.99, int(low * 100) / 100), 1.0, HISTOGRAM_BINS + 1, dtype=torch.float64)


def plot(stats: list[dict], values: dict[int, torch.Tensor], path: Path, title: str) -> Path:
    plt = common.pyplot()
    fig, (ax_mean, ax_hist) = plt.subplots(1, 2, figsize=(12, 4.5))
    bs = [s["batch_size"] for s in stats]
    ax_mean.plot(bs, [s["mean"] for s in stats], "o-", color="tab:blue", label="mean ⟨q_B⟩")
    ax_mean.set_xscale("log", base=2)
    ax_mean.set_xticks(bs, [str(b) for b in bs])
    ax_mean.set_xlabel("batch size B")
    ax_mean.set_ylabel("mean ⟨q_B⟩", color="tab:blue")
    ax_cv = ax_mean.twinx()
    ax_cv.plot(bs, [s["cv"] for s in stats], "s--", color="tab:red", label="C_v = σ/μ")
    ax_cv.set_ylabel("coefficient of variation C_v", color="tab:red")
    ax_mean.set_title("(a) NPC multiplier vs batch size")
    ax_mean.grid(alpha=0.3)
    colors = plt.cm.viridis([i / max(1, len(bs) - 1) for i in range(len(bs))])
    edges = histogram_edges(values).numpy()
    for b, color in zip(bs, colors):
        ax_hist.hist(
            values[b].flatten().double().numpy(),
            bins=edges,
            density=True,
            histtype="step",
            lw=1.5,
            color=color,
            label=f"B={b}",
        )
    ax_hist.set_xlabel("q_B")
    ax_hist.set_ylabel("density")
    ax_hist.set_title("(b) distribution of q_B")
    ax_hist.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return common.save_figure(fig, path)


def setting_or_config(value, dotted: str, flag: str, default=None, *, cfg: dict, checkpoint: Path):
    """``value`` if given, else the checkpoint config's ``dotted``, else ``default``."""
    if value is not None:
        return value
    found = OmegaConf.select(saved_config(cfg, str(checkpoint)), dotted) if cfg else None
    if found is None and default is None:
        raise AnalysisError(f"{checkpoint} has no {dotted} in its config: pass {flag}")
    return found if found is not None else default


def npc_tables(results: dict, image_index: torch.Tensor) -> tuple[list[dict], list[dict]]:
    """The rows of npc.csv (one per batch size) and of npc_values.csv (one per anchor)."""
    stats, per_anchor = [], []
    for b, (batches, q) in results.items():
        stats.append({"batch_size": b, "batches": batches.shape[0], "anchors": q.numel(), **summarize(q)})
        for j, (idx, qb) in enumerate(zip(image_index[batches].tolist(), q.tolist())):
            for a, value in enumerate(qb):  # anchors: view 1 of idx[0..B-1], then view 2
                per_anchor.append({"batch_size": b, "batch": j, "image": idx[a % b], "view": 1 + a // b, "q": value})
    return stats, per_anchor


def run(
    checkpoint: Path,
    out_dir: Path | None = None,
    data: str | None = None,
    batch_sizes=DEFAULT_BATCH_SIZES,
    temperature: float | None = None,
    augmentation: str | None = None,
    image_size: int | None = None,
    max_images: int | None = None,
    seed: int = 0,
) -> dict:
    checkpoint = Path(checkpoint)
    out_dir = Path(out_dir) if out_dir is not None else checkpoint.parent / "analysis"
    net, cfg, kind, trained_at = load_embedder(checkpoint)
    setting = partial(setting_or_config, cfg=cfg or {}, checkpoint=checkpoint)
    temperature = float(setting(temperature, "method.temperature", "--temperature"))
    augmentation = setting(augmentation, "data.augmentation", "--augmentation", "simclr")
    # as --crop auto of the evaluators: the size the checkpoint records, else the protocol's 224
    image_size = int(next((s for s in (image_size, trained_at) if s is not None), 224))
    data = setting(data, "data.root", "--data")
    if temperature <= 0:
        raise AnalysisError(f"--temperature {temperature}: expected a positive number")
    if not os.path.isdir(data) and not is_sharded(data):
        raise AnalysisError(
            f"data root {data} is not a folder (pass --data an ImageFolder, a folder of images or tar shards)"
        )

    z1, z2, image_index = embed_views(net, data, augmentation, image_size, seed, max_images)
    n = z1.shape[0]
    usable = sorted({b for b in batch_sizes if 2 <= b <= n})
    if not usable:
        raise AnalysisError(f"batch sizes {list(batch_sizes)}: none fits the {n} images of {data} (need 2 ≤ B ≤ {n})")
    skipped = sorted(set(batch_sizes) - set(usable))
    results = npc_by_batch_size(z1, z2, usable, temperature, seed)

    stats, per_anchor = npc_tables(results, image_index)
    columns = ["batch_size", "batches", "anchors", "mean", "std", "cv", "p05", "p50", "p95"]
    write_csv(out_dir / "npc.csv", columns, stats)
    write_csv(out_dir / "npc_values.csv", ["batch_size", "batch", "image", "view", "q"], per_anchor)
    values = {b: q for b, (_, q) in results.items()}
    edges = histogram_edges(values)
    histograms = {b: torch.histogram(q.double().flatten(), edges).hist.long().tolist() for b, q in values.items()}
    summary = {
        "checkpoint": str(checkpoint),
        "embedding": kind,
        "data": str(data),
        "images": n,
        "temperature": temperature,
        "augmentation": augmentation,
        "image_size": image_size,
        "seed": seed,
        "skipped_batch_sizes": skipped,
        "stats": stats,
        "histogram": {"edges": edges.tolist(), "counts": histograms},
    }
    write_summary(out_dir / "npc.json", summary)
    plot(
        stats,
        values,
        out_dir / "npc.png",
        f"NPC multiplier q_B: {checkpoint.name}, {kind.split(' (')[0]}, τ={temperature:g}, {n} images",
    )
    summary["out_dir"] = str(out_dir)
    return summary


# ------------------------------------------------------------------------------------ command line


def add_arguments(parser) -> None:
    parser.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="checkpoint_last.pth (projection the loss sees) or a backbone checkpoint",
    )
    parser.add_argument("--data", help="image folder (default: the run's data.root)")
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=list(DEFAULT_BATCH_SIZES),
        help="batch sizes B (default %(default)s; those above the image count are skipped)",
    )
    parser.add_argument("--temperature", type=float, help="τ (default: the run's method.temperature)")
    parser.add_argument(
        "--augmentation", help="augmentation preset (default: the run's data.augmentation, else simclr)"
    )
    parser.add_argument(
        "--image-size", type=int, help="crop size (default: the pretraining size the checkpoint records, else 224)"
    )
    parser.add_argument("--max-images", type=int, help="use a seeded random subset of this many images")
    parser.add_argument("--seed", type=int, default=0, help="augmentation and batch partition seed")
    parser.add_argument(
        "--out",
        "--output-dir",
        dest="out_dir",
        type=Path,
        help="output folder (default: CHECKPOINT's folder/analysis)",
    )


def cli(args) -> None:
    s = common.run_with_args(run, args)
    print(f"NPC multiplier q_B of {s['checkpoint']} ({s['embedding']}), τ={s['temperature']:g}, {s['images']} images")
    print(f"{'B':>6} {'anchors':>8} {'mean':>8} {'C_v':>8} {'p05':>8} {'p50':>8} {'p95':>8}")
    for r in s["stats"]:
        print(
            f"{r['batch_size']:>6} {r['anchors']:>8} {r['mean']:>8.4f} {r['cv']:>8.4f} {r['p05']:>8.4f} "
            f"{r['p50']:>8.4f} {r['p95']:>8.4f}"
        )
    if s["skipped_batch_sizes"]:
        print(f"skipped batch sizes larger than the {s['images']} images: {s['skipped_batch_sizes']}")
    print(f"wrote {s['out_dir']}/npc.png, npc.csv, npc_values.csv, npc.json")
