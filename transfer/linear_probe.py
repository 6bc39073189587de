"""The linear probe itself (torch): head, data, training loop with exact resume. The command line and
the presets are in ``transfer.linear``."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from contrastive_transfer.cli import UserError
from contrastive_transfer.contract import IMAGENET_MEAN, IMAGENET_STD
from contrastive_transfer.safe_load import UnsafeFileError, torch_load
from transfer import eval_cli
from transfer.features import (
    LayerFeatures,
    Preprocessing,
    default_device,
    file_digest,
    like,
    load_model,
)
from transfer.knn import topk_accuracy
from transfer.linear import CHECKPOINT, PRESETS

logger = logging.getLogger(__name__)
# The probe stops when a batch's loss exceeds this multiple of the first batch's: the lr is too large.
DIVERGENCE_FACTOR = 100.0


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
    return v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(crop, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            v2.ToPureTensor(),
        ]
    )


def read_dataset(name: str, root: str):
    from transfer.datasets.readers import read_image_folder, read_places205

    if name == "imagenet":
        train, val = read_image_folder(Path(root) / "train"), read_image_folder(Path(root) / "val")
        if train.classes != val.classes:
            raise UserError(f"{root}: class folders of train/ and val/ differ; use the same classes in both")
        return train, val
    return read_places205(root, "train"), read_places205(root, "val")


@torch.no_grad()
def evaluate(features: LayerFeatures, layer: str, head: nn.Module, loader, device) -> dict[str, float]:
    head.eval()
    scores, labels = [], []
    for x, y in loader:
        scores.append(head(features(x.to(**like(features)))[layer]).float().cpu())
        labels.append(y)
    return topk_accuracy(torch.cat(scores), torch.cat(labels))


def backbone_changes(model: nn.Module, reference: dict[str, torch.Tensor]) -> list[str]:
    """Names of backbone tensors (weights and BN buffers) that differ from `reference` in any bit."""
    now = model.state_dict()
    return [k for k, v in reference.items() if not torch.equal(now[k].cpu(), v)]


def atomic_torch_save(obj, path: Path) -> None:
    from contrastive_transfer.cli import atomic_write

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def check_divergence(loss: float, first: float | None, lr: float) -> float:
    """The first loss of the run (``loss`` itself when ``first`` is None); stops the probe when the
    loss is non-finite or has grown past DIVERGENCE_FACTOR × the first one."""
    if not math.isfinite(loss) or (first is not None and loss > DIVERGENCE_FACTOR * max(first, 1e-3)):
        raise UserError(
            f"the linear probe diverged (loss {loss:.4g}, first loss {first if first is not None else loss:.4g}) "
            f"at lr {lr:g}: lower it with --lr (e.g. --lr {lr / 10:g}), or use --preset bn, whose head does not "
            "depend on the feature scale"
        )
    return loss if first is None else first


_PROBE_STATE_KEYS = ("identity", "head", "optimizer", "history", "epoch")


def _read_probe_state(path: Path) -> dict:
    """The probe state to resume (weights_only: a state file may come from a shared folder)."""
    try:
        state = torch_load(path)
    except UnsafeFileError:
        raise
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"cannot read {path} ({first}); remove it to start afresh, or choose another --output-dir"
        ) from None
    if not isinstance(state, dict) or not all(k in state for k in _PROBE_STATE_KEYS):
        raise UserError(
            f"{path} is not a linear probe state (expected the keys {', '.join(_PROBE_STATE_KEYS)}); "
            "remove it to start afresh, or choose another --output-dir"
        )
    return state


def run(args) -> dict:
    preset = PRESETS[args.preset]
    if args.epochs:
        preset = preset.with_epochs(args.epochs)
    preset = replace(
        preset,
        lr=args.lr or preset.lr,
        batch_size=args.batch_size or preset.batch_size,
        layer=args.layer or preset.layer,
    )
    out = Path(args.output_dir)
    ckpt_path = out / CHECKPOINT
    if ckpt_path.exists() and not args.resume:
        raise UserError(f"{ckpt_path} exists: pass --resume to continue it, or choose another --output-dir")
    device = default_device()
    model, backbone = load_model(args.weights, args.encoder, args.layout)
    resize, crop = eval_cli.resolve_size(args.resize, args.crop, backbone.image_size)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    train, val = read_dataset(args.dataset, args.data_root)
    num_classes = len(train.classes)
    val_prep = Preprocessing(resize, crop, "center")
    train.transform, val.transform = train_transform(crop), val_prep.transform()

    features = LayerFeatures(model, [preset.layer]).to(device).eval()
    described = features.describe(crop)[preset.layer]
    dim, channels = described["dim"], described["map"][0]
    torch.manual_seed(args.seed)  # the fc initialization
    head = build_head(dim, channels, num_classes, preset.head_bn).to(**like(features))
    optimizer = torch.optim.SGD(
        head.parameters(),
        lr=preset.lr,
        momentum=preset.momentum,
        nesterov=preset.nesterov,
        weight_decay=preset.weight_decay,
    )
    identity = {
        "checkpoint_sha256": file_digest(args.weights),
        "encoder": args.encoder,
        "dataset": args.dataset,
        "data_root": str(args.data_root),
        "preset": args.preset,
        "settings": asdict(preset),
        "resize": resize,
        "crop": crop,
        "seed": args.seed,
    }
    history, start, first_loss = [], 0, None
    if args.resume and ckpt_path.exists():
        state = _read_probe_state(ckpt_path)
        if state["identity"] != identity:
            diff = sorted(k for k in identity if state["identity"].get(k) != identity[k])
            raise UserError(
                f"{ckpt_path} was written by another run (differs in: {', '.join(diff)}); "
                "resume with the same options or choose another --output-dir"
            )
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        history, start = state["history"], state["epoch"]
        logger.info("resumed %s at epoch %d", ckpt_path, start)

    val_loader = DataLoader(val, batch_size=preset.batch_size, num_workers=args.workers)
    for epoch in range(start, preset.epochs):
        t0 = time.time()
        lr = preset.lr_at(epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # Seeded per epoch: an interrupted run resumed at an epoch boundary repeats it exactly.
        torch.manual_seed(args.seed + epoch)
        order = torch.Generator().manual_seed(args.seed + epoch)
        loader = DataLoader(
            train,
            batch_size=preset.batch_size,
            shuffle=True,
            generator=order,
            num_workers=args.workers,
            drop_last=len(train) > preset.batch_size,
        )
        head.train()
        total, count = 0.0, 0
        for x, y in eval_cli.progress(loader, len(loader), f"linear probe, epoch {epoch + 1}/{preset.epochs}"):
            with torch.no_grad():
                f = features(x.to(**like(features)))[preset.layer]
            loss = F.cross_entropy(head(f), y.to(device))
            first_loss = check_divergence(loss.item(), first_loss, preset.lr)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(y), count + len(y)
        acc = evaluate(features, preset.layer, head, val_loader, device)
        history.append(
            {"epoch": epoch + 1, "lr": lr, "train_loss": total / max(count, 1), **acc, "seconds": time.time() - t0}
        )
        out.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(
            {
                "identity": identity,
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
                "history": history,
            },
            ckpt_path,
        )
        logger.info(
            "epoch %d/%d lr %.4g loss %.4f top-1 %.2f top-5 %.2f",
            epoch + 1,
            preset.epochs,
            lr,
            history[-1]["train_loss"],
            acc["top1"],
            acc["top5"],
        )

    changed = backbone_changes(model, reference)
    if changed:
        raise RuntimeError(f"the frozen backbone changed during the linear probe: {', '.join(changed[:5])}")
    best = max(history, key=lambda h: h["top1"])
    return {
        "protocol": "linear",
        "dataset": args.dataset,
        "preset": args.preset,
        **eval_cli.source_record(args.weights, args.encoder, backbone),
        "backbone_unchanged": True,
        "feature": {"layer": preset.layer, **described, "head": "BN(no affine) + fc" if preset.head_bn else "fc"},
        "settings": asdict(preset),
        "preprocessing": {
            "train": f"RandomResizedCrop {crop} (scale 0.08-1) + horizontal flip",
            "val": val_prep.describe(),
        },
        "train": {"images": len(train)},
        "val": {"images": len(val)},
        "num_classes": num_classes,
        "top1": history[-1]["top1"],
        "top5": history[-1]["top5"],
        "best_top1": best["top1"],
        "best_epoch": best["epoch"],
        "history": history,
    }
