"""Weighted kNN classification on frozen, L2-normalized backbone features (InstDisc protocol).

    python -m transfer.knn --weights CKPT --train-dir DIR --val-dir DIR [--k 200] [--t 0.07]
                           [--output-dir OUT]

Both folders are torchvision ImageFolders; features are the backbone's global average pool
(``res5avg``: 2048-d for ResNet-50, 512-d for ResNet-18) after shorter side 256 and a 224 center
crop. Each validation image takes its k most cosine-similar training images; neighbour j votes for
its class with weight exp(s_j / t); the prediction is the class with the largest summed vote
(top-5: the five largest).

The vote is ``contrastive_transfer.contract.knn_vote``, the one the pretraining monitor
(``pretrain/knn.py``) uses too: the bank in float16 on a GPU, float32 on a CPU (``knn_bank``), the
queries in chunks sized so that the similarities held at once stay under a fixed count whatever
the number of queries (``benchmarks/knn_scale.py`` measures it at ImageNet's 1.28 M images).
Under a launcher the features are extracted by every process and rank 0 votes.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from contrastive_transfer.cli import UserError, command, ensure_writable_dir
from contrastive_transfer.contract import KNN_K, KNN_TEMPERATURE, knn_bank, knn_vote
from transfer import eval_cli

if TYPE_CHECKING:  # torch is imported where it is used, so that --help does not wait for it
    import numpy as np
    import torch

logger = logging.getLogger(__name__)


def topk_accuracy(scores: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> dict[str, float]:
    """{"top1": %, "top5": %} (k capped at the number of classes)."""
    ranked = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices
    hit = ranked == labels.unsqueeze(1)
    return {f"top{k}": 100.0 * hit[:, :k].any(dim=1).float().mean().item() for k in ks}


def knn_evaluate(
    train_feats: np.ndarray,
    train_labels,
    val_feats: np.ndarray,
    val_labels,
    num_classes: int,
    k: int = KNN_K,
    t: float = KNN_TEMPERATURE,
) -> dict[str, float]:
    """Top-1/top-5 of the weighted kNN vote, on the GPU when there is one. A float32 ``train_feats``
    is L2-normalised in place on a CPU: an ImageNet bank (10.5 GB) is not copied."""
    import torch

    from transfer.features import default_device

    device = default_device()
    bank = knn_bank(torch.as_tensor(train_feats), device)
    query = knn_bank(torch.as_tensor(val_feats), device)
    scores = knn_vote(query, bank, torch.as_tensor(train_labels, device=device), num_classes, k, t)
    return topk_accuracy(scores.cpu(), torch.as_tensor(val_labels))


def parser():
    p = eval_cli.make_parser("python -m transfer.knn", __doc__)
    eval_cli.add_checkpoint_args(p)
    p.add_argument("--train-dir", required=True, help="ImageFolder of the bank (e.g. imagenet/train)")
    p.add_argument("--val-dir", required=True, help="ImageFolder of the queries (e.g. imagenet/val)")
    p.add_argument("--k", type=int, default=KNN_K, help="neighbours that vote")
    p.add_argument("--t", type=float, default=KNN_TEMPERATURE, help="temperature of the exp(sim / t) votes")
    p.add_argument("--output-dir", "--out", default="knn_output", help="metrics.json and the feature cache go here")
    eval_cli.add_size_args(p, "shorter side before the center crop", "center crop side")
    eval_cli.add_loader_args(p, batch_size=64)
    return p


@command
def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.k < 1 or args.t <= 0:
        raise UserError(f"--k {args.k} / --t {args.t}: expected k >= 1 and t > 0")

    from contrastive_transfer.cli import write_json

    with eval_cli.launched_processes("transfer.knn"):
        bank, query, out, train, val, prep, backbone = _features(args)
        if bank is None:  # ranks other than 0 under a launcher: their shards are extracted
            return
    acc = knn_evaluate(bank, train.labels, query, val.labels, len(train.classes), args.k, args.t)
    metrics = {
        "protocol": "knn",
        **eval_cli.source_record(args.weights, args.encoder, backbone),
        "feature": {"layer": "res5avg", "dim": int(bank.shape[1]), "normalization": "L2"},
        "preprocessing": prep.describe(),
        "k": args.k,
        "t": args.t,
        "train": {"dir": str(args.train_dir), "images": len(train)},
        "val": {"dir": str(args.val_dir), "images": len(val)},
        **acc,
    }
    write_json(out / "metrics.json", metrics)
    logger.info(
        "kNN (k=%d, t=%g, %d-d): top-1 %.2f, top-5 %.2f", args.k, args.t, bank.shape[1], acc["top1"], acc["top5"]
    )
    print(json.dumps(acc))


def _features(args):
    """(bank, queries, output dir, both datasets, preprocessing, backbone record): the features of
    both folders, extracted by every process under a launcher; on ranks other than 0 the features
    are None (rank 0 votes and writes)."""
    from contrastive_transfer.ranks import done_by_rank0
    from converters.checkpoint_io import summary_lines
    from transfer.datasets.readers import read_image_folder
    from transfer.features import FeatureCache, LayerFeatures, Preprocessing, load_model

    model, backbone = load_model(args.weights, args.encoder, args.layout)
    resize, crop = eval_cli.resolve_size(args.resize, args.crop, backbone.image_size)
    prep = Preprocessing(resize, crop, "center")
    train, val = read_image_folder(args.train_dir), read_image_folder(args.val_dir)
    if train.classes != val.classes:
        raise UserError(f"class folders of {args.train_dir} and {args.val_dir} differ; use the same classes in both")
    # The inputs are valid; before the long work, prove the output can be written (rank 0 writes).
    out = done_by_rank0(lambda: ensure_writable_dir(args.output_dir, "--output-dir"))
    for line in summary_lines(backbone):
        logger.info(line)
    train.transform = val.transform = prep.transform()
    cache = FeatureCache(out / "features", backbone, prep)
    make = lambda names: LayerFeatures(model, names)  # noqa: E731
    kwargs = dict(batch_size=args.batch_size, workers=args.workers)
    bank = cache.get(make, train, "train", ["res5avg"], **kwargs)
    query = cache.get(make, val, "val", ["res5avg"], **kwargs)
    if bank is None:
        return None, None, out, train, val, prep, backbone
    return bank["res5avg"], query["res5avg"], out, train, val, prep, backbone


if __name__ == "__main__":
    main()
