"""Linear probes on a frozen backbone: ImageNet (MoCo, AdCo protocols) and Places205.

    python -m transfer.linear --weights CKPT --dataset imagenet|places205 --data-root DIR
                              --preset moco|adco|places205 --output-dir OUT [--resume]

The backbone stays in eval mode with frozen weights (BN statistics never move); only the head
learns. After the run every backbone tensor is compared bit for bit with the checkpoint's.

Presets (``PRESETS``):

    moco       fc on res5avg, fc ~ N(0, 0.01), SGD lr 30, momentum 0.9, wd 0, batch 256,
               100 epochs, lr × 0.1 at epochs 60 and 80               (MoCo main_lincls.py)
    adco       as moco but lr 10 with per-epoch cosine decay to 0.01:
               lr_e = 0.01 + ½(1 + cos(π e / E))(10 − 0.01)           (AdCo lincls.py --cos)
    places205  BatchNorm without affine + fc on the pooled res5 map (2×2 grid, 4·C-d), SGD
               nesterov lr 0.01, momentum 0.9, wd 1e-4, batch 256, 28 epochs,
               lr × 0.1 at 7, 14, 21                                 (mmselfsup / OpenSelfSup)

Train images: RandomResizedCrop(crop) + horizontal flip; val: shorter side `resize`, center crop.
``--epochs`` rescales the step milestones in proportion (60/80 of 100 → 3/4 of 5).
Reported: top-1/top-5 of the last epoch and the best top-1 over epochs (MoCo reports the best).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import v2
from tqdm import tqdm

from transfer.features import (IMAGENET_MEAN, IMAGENET_STD, LAYERS, LayerFeatures, Preprocessing,
                               default_device, file_digest, load_model)
from transfer.knn import topk_accuracy

logger = logging.getLogger(__name__)
CHECKPOINT = "checkpoint_last.pth"


@dataclass(frozen=True)
class Preset:
    layer: str
    head_bn: bool  # BatchNorm (no affine) on the features before the fc
    lr: float
    schedule: str  # "step" | "cosine"
    epochs: int
    milestones: tuple[int, ...] = ()
    final_lr: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    batch_size: int = 256

    def lr_at(self, epoch: int) -> float:
        """Learning rate of epoch `epoch` (0-based), set once per epoch as in the reference scripts."""
        if self.schedule == "cosine":
            return self.final_lr + 0.5 * (1 + math.cos(math.pi * epoch / self.epochs)) * (self.lr - self.final_lr)
        return self.lr * 0.1 ** sum(epoch >= m for m in self.milestones)

    def with_epochs(self, epochs: int) -> "Preset":
        scale = epochs / self.epochs
        return replace(self, epochs=epochs, milestones=tuple(max(1, round(m * scale)) for m in self.milestones))


PRESETS = {
    "moco": Preset("res5avg", False, 30.0, "step", 100, milestones=(60, 80)),
    "adco": Preset("res5avg", False, 10.0, "cosine", 100, final_lr=0.01),
    "places205": Preset("res5", True, 0.01, "step", 28, milestones=(7, 14, 21), nesterov=True, weight_decay=1e-4),
}


class ChannelBatchNorm(nn.Module):
    """BatchNorm without affine over the channels of a flattened pooled map (B, C·g²): statistics per
    channel over the batch and the g×g positions, as BatchNorm2d on the map in mmselfsup's head."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(channels, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        return self.bn(x.view(b, self.bn.num_features, -1)).view(b, -1)


def build_head(dim: int, channels: int, num_classes: int, with_bn: bool) -> nn.Sequential:
    fc = nn.Linear(dim, num_classes)
    nn.init.normal_(fc.weight, std=0.01)
    nn.init.zeros_(fc.bias)
    return nn.Sequential(ChannelBatchNorm(channels), fc) if with_bn else nn.Sequential(fc)


def train_transform(crop: int) -> v2.Compose:
    return v2.Compose([v2.ToImage(), v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                       v2.ToPureTensor()])


def read_dataset(name: str, root: str):
    from transfer.datasets.readers import read_image_folder, read_places205

    if name == "imagenet":
        train, val = read_image_folder(Path(root) / "train"), read_image_folder(Path(root) / "val")
        if train.classes != val.classes:
            raise ValueError(f"{root}: class folders of train/ and val/ differ")
        return train, val
    return read_places205(root, "train"), read_places205(root, "val")


@torch.no_grad()
def evaluate(features: LayerFeatures, layer: str, head: nn.Module, loader, device) -> dict[str, float]:
    head.eval()
    scores, labels = [], []
    for x, y in loader:
        scores.append(head(features(x.to(device))[layer]).float().cpu())
        labels.append(y)
    return topk_accuracy(torch.cat(scores), torch.cat(labels))


def backbone_changes(model: nn.Module, reference: dict[str, torch.Tensor]) -> list[str]:
    """Names of backbone tensors (weights and BN buffers) that differ from `reference` in any bit."""
    now = model.state_dict()
    return [k for k, v in reference.items() if not torch.equal(now[k].cpu(), v)]


def atomic_torch_save(obj, path: Path) -> None:
    from converters.checkpoint_io import atomic_write

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def run(args) -> dict:
    preset = PRESETS[args.preset]
    if args.epochs:
        preset = preset.with_epochs(args.epochs)
    preset = replace(preset, lr=args.lr or preset.lr, batch_size=args.batch_size or preset.batch_size,
                     layer=args.layer or preset.layer)
    out = Path(args.output_dir)
    ckpt_path = out / CHECKPOINT
    if ckpt_path.exists() and not args.resume:
        raise FileExistsError(f"{ckpt_path} exists: pass --resume to continue it, or choose another --output-dir")
    device = default_device()
    model, backbone = load_model(args.weights, args.encoder, args.layout)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    train, val = read_dataset(args.dataset, args.data_root)
    num_classes = len(train.classes)
    val_prep = Preprocessing(args.resize, args.crop, "center")
    train.transform, val.transform = train_transform(args.crop), val_prep.transform()

    features = LayerFeatures(model, [preset.layer]).to(device).eval()
    described = features.describe(args.crop)[preset.layer]
    dim, channels = described["dim"], described["map"][0]
    torch.manual_seed(args.seed)  # the fc initialization
    head = build_head(dim, channels, num_classes, preset.head_bn).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=preset.lr, momentum=preset.momentum,
                                nesterov=preset.nesterov, weight_decay=preset.weight_decay)
    identity = {"checkpoint_sha256": file_digest(args.weights), "encoder": args.encoder, "dataset": args.dataset,
                "data_root": str(args.data_root), "preset": args.preset, "settings": asdict(preset),
                "resize": args.resize, "crop": args.crop, "seed": args.seed}
    history, start = [], 0
    if args.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if state["identity"] != identity:
            diff = sorted(k for k in identity if state["identity"].get(k) != identity[k])
            raise ValueError(f"{ckpt_path} was written by another run (differs in: {', '.join(diff)}); "
                             "resume with the same options or choose another --output-dir")
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        history, start = state["history"], state["epoch"]
        logger.info("resumed %s at epoch %d", ckpt_path, start)

    val_loader = DataLoader(val, batch_size=preset.batch_size, num_workers=args.workers)
    bar = tqdm(total=preset.epochs, initial=start, desc="linear probe", unit="epoch", disable=None)
    for epoch in range(start, preset.epochs):
        t0 = time.time()
        lr = preset.lr_at(epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # Seeded per epoch: an interrupted run resumed at an epoch boundary repeats it exactly.
        torch.manual_seed(args.seed + epoch)
        order = torch.Generator().manual_seed(args.seed + epoch)
        loader = DataLoader(train, batch_size=preset.batch_size, shuffle=True, generator=order,
                            num_workers=args.workers, drop_last=len(train) > preset.batch_size)
        head.train()
        total, count = 0.0, 0
        for x, y in loader:
            with torch.no_grad():
                f = features(x.to(device))[preset.layer]
            loss = F.cross_entropy(head(f), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(y), count + len(y)
        acc = evaluate(features, preset.layer, head, val_loader, device)
        history.append({"epoch": epoch + 1, "lr": lr, "train_loss": total / max(count, 1), **acc,
                        "seconds": time.time() - t0})
        out.mkdir(parents=True, exist_ok=True)
        atomic_torch_save({"identity": identity, "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                           "epoch": epoch + 1, "history": history}, ckpt_path)
        bar.update(1)
        bar.set_postfix(loss=f"{history[-1]['train_loss']:.3f}", top1=f"{acc['top1']:.1f}")
        logger.info("epoch %d/%d lr %.4g loss %.4f top-1 %.2f top-5 %.2f", epoch + 1, preset.epochs, lr,
                    history[-1]["train_loss"], acc["top1"], acc["top5"])
    bar.close()

    changed = backbone_changes(model, reference)
    if changed:
        raise RuntimeError(f"the frozen backbone changed during the linear probe: {', '.join(changed[:5])}")
    best = max(history, key=lambda h: h["top1"])
    return {"protocol": "linear", "dataset": args.dataset, "preset": args.preset, "checkpoint": str(args.weights),
            "encoder": args.encoder,
            "backbone": {"arch": backbone.arch, "stem": backbone.stem, "layout": backbone.layout},
            "backbone_unchanged": True,
            "feature": {"layer": preset.layer, **described, "head": "BN(no affine) + fc" if preset.head_bn else "fc"},
            "settings": asdict(preset),
            "preprocessing": {"train": f"RandomResizedCrop {args.crop} (scale 0.08-1) + horizontal flip",
                              "val": val_prep.describe()},
            "train": {"images": len(train)}, "val": {"images": len(val)}, "num_classes": num_classes,
            "top1": history[-1]["top1"], "top5": history[-1]["top5"],
            "best_top1": best["top1"], "best_epoch": best["epoch"], "history": history}


def main(argv: list[str] | None = None) -> None:
    from converters.checkpoint_io import CheckpointError, atomic_write

    parser = argparse.ArgumentParser(prog="python -m transfer.linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, help="checkpoint in any layout the converters read")
    parser.add_argument("--dataset", required=True, choices=["imagenet", "places205"])
    parser.add_argument("--data-root", required=True, help="imagenet: train/ and val/ ImageFolders; "
                        "places205: trainvalsplit_places205/ and data/vision/...")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--resume", action="store_true", help=f"continue from OUT/{CHECKPOINT}")
    parser.add_argument("--epochs", type=int, default=None, help="override (milestones rescale)")
    parser.add_argument("--batch-size", type=int, default=None, help="override (the lr is not rescaled)")
    parser.add_argument("--lr", type=float, default=None, help="override the preset's base lr")
    parser.add_argument("--layer", default=None, choices=sorted(LAYERS), help="override the preset's feature")
    parser.add_argument("--resize", type=int, default=256, help="val: shorter side")
    parser.add_argument("--crop", type=int, default=224, help="network input side")
    parser.add_argument("--encoder", default="query", choices=["query", "key"])
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        metrics = run(args)
    except (CheckpointError, ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    atomic_write(Path(args.output_dir) / "metrics.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1)))
    print(json.dumps({k: round(metrics[k], 2) for k in ("top1", "top5", "best_top1")}))


if __name__ == "__main__":
    main()
