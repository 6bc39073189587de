"""The linear probe itself (torch): head, data, training loop with exact resume. The command line is
``transfer.linear``; the presets and the run's settings are ``transfer.probe_presets``."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.transforms import v2

from contrastive_transfer.cli import UserError
from contrastive_transfer.contract import IMAGENET_MEAN, IMAGENET_STD
from contrastive_transfer.preempt import (
    DEFAULT_SIGNALS,
    PREEMPTED_EXIT_CODE,
    Preempted,
    PreemptSignals,
    ignore_in_worker,
)
from contrastive_transfer.progress import progress
from contrastive_transfer.ranks import (
    decided_by_rank0,
    done_by_rank0,
    gather_in_order,
    is_main,
    rank,
    shard_indices,
    summed,
    world_size,
)
from contrastive_transfer.safe_load import UnsafeFileError, torch_load
from contrastive_transfer.seeding import seeded_draws
from contrastive_transfer.sync_bn import convert_sync_batchnorm
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
from transfer.probe_presets import PROBE_STATE, ProbeSettings

if TYPE_CHECKING:
    from contrastive_transfer.image_list import ImageList

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


class SeededSamples(Dataset):
    """``dataset``'s items with the augmentation's random draws seeded by ``(seed, epoch, index)``
    (``contrastive_transfer.seeding``): an image is augmented the same way whichever process,
    DataLoader worker or batch reads it, so N processes train on the one-process batches and a
    resumed epoch needs no replay of the batches before the stop. One per epoch."""

    def __init__(self, dataset, seed: int, epoch: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return seeded_draws(self.seed, self.epoch, i, self.dataset.__getitem__, i)


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """This process's part of each global batch of ``epoch``: the one-process order (the
    permutation torch's shuffling DataLoader draws from a generator seeded with seed + epoch,
    the last incomplete batch dropped) cut into global batches of ``batch_size``, of which rank r
    takes the r-th of W equal slices. DDP averages the W slices' gradients: the gradient of the
    global batch's mean loss, as in one process, at the same learning rate."""
    world, per_process = world_size(), batch_size // world_size()
    if batch_size % world or n < batch_size and world > 1:
        raise UserError(
            f"--batch-size {batch_size} on {world} processes: expected a multiple of {world} and at most the "
            f"{n} training images (the batch is the global one, split over the processes)"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    full = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if n > batch_size and len(full[-1]) < batch_size:
        full.pop()  # drop_last, as one process does
    return [b[rank() * per_process : (rank() + 1) * per_process] if world > 1 else b for b in full]


def read_dataset(name: str, root: str):
    from transfer.datasets.readers import read_image_folder, read_places205

    if name == "imagenet":
        train, val = read_image_folder(Path(root) / "train"), read_image_folder(Path(root) / "val")
        if train.classes != val.classes:
            raise UserError(f"{root}: class folders of train/ and val/ differ; use the same classes in both")
        return train, val
    return read_places205(root, "train"), read_places205(root, "val")


@torch.no_grad()
def evaluate(
    features: LayerFeatures, layer: str, head: nn.Module, dataset, batch_size: int, **loader
) -> dict[str, float]:
    """Top-1/top-5 of ``head`` on ``dataset``; under a launcher every process scores its batches
    (``shard_indices``) and the scores are gathered in order, so every rank reports the same."""
    head.eval()
    shard = Subset(dataset, shard_indices(len(dataset), batch_size))
    scores, labels = [torch.zeros(0, head[-1].out_features)], [torch.zeros(0, dtype=torch.long)]
    for x, y in DataLoader(shard, batch_size=batch_size, **loader):
        scores.append(head(features(x.to(**like(features)))[layer]).float().cpu())
        labels.append(y)
    n = len(dataset)
    return topk_accuracy(
        gather_in_order(torch.cat(scores), n, batch_size), gather_in_order(torch.cat(labels), n, batch_size)
    )


def backbone_changes(model: nn.Module, reference: dict[str, torch.Tensor]) -> list[str]:
    """Names of backbone tensors (weights and BN buffers) that differ from `reference` in any bit."""
    now = model.state_dict()
    return [k for k, v in reference.items() if not torch.equal(now[k].cpu(), v)]


def atomic_torch_save(obj, path: Path) -> None:
    from contrastive_transfer.cli import atomic_write

    atomic_write(path, lambda f: torch.save(obj, f))


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


# The keys of a probe state and their types: a state from elsewhere with another type at one is
# one line naming it, not an AttributeError where it is first used.
_PROBE_STATE_KEYS = {"identity": dict, "head": dict, "optimizer": dict, "history": list, "epoch": int}


def _read_probe_state(path: Path) -> dict:
    """The probe state to resume (weights_only: a state file may come from a shared folder)."""
    try:
        state = torch_load(path, kind="probe state")
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
    for key, kind in _PROBE_STATE_KEYS.items():
        history_ok = key != "history" or all(isinstance(h, dict) for h in state[key])
        if not isinstance(state[key], kind) or isinstance(state[key], bool) or not history_ok:
            raise UserError(
                f"{path}: {key} is a {type(state[key]).__name__}{'' if history_ok else ' of non-mappings'}, "
                f"expected a {kind.__name__}: not a linear probe state this tool wrote; remove it to start afresh"
            )
    return state


@dataclass
class Probe:
    """One run's live objects, from ``setup``; the loop changes only ``head`` and ``optimizer``."""

    settings: ProbeSettings
    model: nn.Module
    backbone: Any  # converters.checkpoint_io's record of the loaded weights
    reference: dict[str, torch.Tensor]  # the backbone's tensors as loaded
    features: LayerFeatures
    head: nn.Sequential  # what is saved and evaluated
    trained: nn.Module  # what the training step calls: the head, or DDP over it under a launcher
    optimizer: torch.optim.SGD
    train: ImageList
    val: ImageList
    val_prep: Preprocessing
    described: dict  # the feature's dim and map shape
    crop: int
    device: torch.device
    identity: dict  # what a resumed state must have been written with
    preempt: PreemptSignals = field(default_factory=lambda: PreemptSignals(DEFAULT_SIGNALS, "the probe's signals"))

    @property
    def state_path(self) -> Path:
        return self.settings.output_dir / PROBE_STATE


def setup(s: ProbeSettings) -> Probe:
    """Backbone, data, head and optimizer, in the order that fixes the random draws."""
    preset = s.preset
    device = default_device()
    model, backbone = load_model(s.weights, s.encoder, s.layout)
    resize, crop = eval_cli.resolve_size(s.resize, s.crop, backbone.image_size)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    train, val = read_dataset(s.dataset, s.data_root)
    val_prep = Preprocessing(resize, crop, "center")
    train.transform, val.transform = train_transform(crop), val_prep.transform()

    features = LayerFeatures(model, [preset.layer]).to(device).eval()
    described = features.describe(crop)[preset.layer]
    torch.manual_seed(s.seed)  # the fc initialization
    head = build_head(described["dim"], described["map"][0], len(train.classes), preset.head_bn)
    head = head.to(**like(features))
    trained = distributed(head, device)
    optimizer = torch.optim.SGD(
        head.parameters(),
        lr=preset.lr,
        momentum=preset.momentum,
        nesterov=preset.nesterov,
        weight_decay=preset.weight_decay,
    )
    identity = {
        "checkpoint_sha256": file_digest(s.weights),
        "encoder": s.encoder,
        "dataset": s.dataset,
        "data_root": str(s.data_root),
        "preset": s.preset_name,
        "settings": asdict(preset),
        "resize": resize,
        "crop": crop,
        "seed": s.seed,
    }
    return Probe(
        s,
        model,
        backbone,
        reference,
        features,
        head,
        trained,
        optimizer,
        train,
        val,
        val_prep,
        described,
        crop,
        device,
        identity,
    )


def distributed(head: nn.Sequential, device: torch.device) -> nn.Module:
    """The module the training step calls: ``head`` itself in one process. Under a launcher, DDP
    over it (the gradients averaged over the processes), its BatchNorm first made global
    (SyncBatchNorm on CUDA, ``ProcessGroupBatchNorm`` on gloo, where torch's does not run) so that
    it normalises with the global batch's statistics, as one process does. The conversion is in
    place: ``head`` keeps its parameters and state-dict keys, and is what is saved."""
    if world_size() == 1:
        return head
    from torch.nn.parallel import DistributedDataParallel

    convert_sync_batchnorm(head, device)
    # The synchronised BN keeps the buffers equal on every rank: nothing to send each step (they
    # are equal at the start too, the head built from the same seed everywhere).
    return DistributedDataParallel(
        head, device_ids=[device] if device.type == "cuda" else None, forward_sync_buffers=False
    )


def resume(probe: Probe) -> tuple[list[dict], int, dict | None]:
    """(history, next epoch, where a preempted epoch stopped or None) of the state on disk, loaded
    into the head and optimizer; refused when it was written with other settings."""
    path = probe.state_path
    state = done_by_rank0(lambda: _read_probe_state(path))  # rank 0's file, on every process
    if state["identity"] != probe.identity:
        diff = sorted(k for k in probe.identity if state["identity"].get(k) != probe.identity[k])
        raise UserError(
            f"{path} was written by another run (differs in: {', '.join(diff)}); "
            "resume with the same options or choose another --output-dir"
        )
    probe.head.load_state_dict(state["head"])
    probe.optimizer.load_state_dict(state["optimizer"])
    partial = state.get("partial")  # written by a preempted run, inside its epoch
    where = f" batch {partial['batch']}" if partial else ""
    logger.info("resumed %s at epoch %d%s", path, state["epoch"], where)
    return state["history"], state["epoch"], partial


def train_epoch(
    probe: Probe, epoch: int, lr: float, first_loss: float | None, partial: dict | None = None
) -> tuple[float, float | None, dict | None]:
    """One epoch of the head at ``lr``: (mean training loss, the run's first loss for the divergence
    stop, None), or, stopped by a preemption signal before its last batch, (nan, first loss, where
    it stopped: the next batch and the loss sums so far). ``partial`` continues such an epoch."""
    preset, seed = probe.settings.preset, probe.settings.seed
    for group in probe.optimizer.param_groups:
        group["lr"] = lr
    batches = epoch_batches(len(probe.train), preset.batch_size, seed, epoch)
    total, count, skip = (0.0, 0, 0) if partial is None else (partial["total"], partial["count"], partial["batch"])
    loader = DataLoader(
        SeededSamples(probe.train, seed, epoch),
        batch_sampler=batches[skip:],  # a preempted epoch continues at its next batch
        num_workers=probe.settings.workers,
        worker_init_fn=functools.partial(ignore_in_worker, probe.preempt.names),  # the cluster signals them too
    )
    probe.trained.train()
    desc = f"linear probe, epoch {epoch + 1}/{preset.epochs}"
    for i, (x, y) in enumerate(progress(loader, len(loader), desc), start=skip):
        with torch.no_grad():
            f = probe.features(x.to(**like(probe.features)))[preset.layer]
        loss = F.cross_entropy(probe.trained(f), y.to(probe.device))
        # The global batch's loss, the same on every rank: the divergence stop and the epoch's mean.
        loss_sum, n = summed([loss.item() * len(y), len(y)], probe.device)
        first_loss = check_divergence(loss_sum / n, first_loss, preset.lr)
        probe.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        probe.optimizer.step()
        total, count = total + loss_sum, count + int(n)
        # After the step, whether any process was signalled: every rank stops after the same batch.
        if summed([probe.preempt.received is not None], probe.device)[0] and i + 1 < len(batches):
            return math.nan, first_loss, {"batch": i + 1, "total": total, "count": count}
    return total / max(count, 1), first_loss, None


def save_state(probe: Probe, epoch: int, history: list[dict], partial: dict | None = None) -> None:
    """The state after ``epoch`` epochs (and ``partial``'s batches of the next), replacing the
    previous one atomically; by rank 0 alone under a launcher (the head is the same on every rank)."""
    if not is_main():
        return
    probe.settings.output_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "identity": probe.identity,
        "head": probe.head.state_dict(),
        "optimizer": probe.optimizer.state_dict(),
        "epoch": epoch,
        "history": history,
        "partial": partial,
    }
    atomic_torch_save(state, probe.state_path)


def run(s: ProbeSettings) -> dict:
    """The probe from ``s``, resumed from its state when asked; returns the metrics record."""
    path = s.output_dir / PROBE_STATE
    # lexists: a link that leads nowhere (or to itself) is there, read through the gate and named; rank 0's
    # disk decides: the one written to
    exists = decided_by_rank0(os.path.lexists(path))
    if exists and not s.resume:
        raise UserError(f"{path} exists: pass --resume to continue it, or choose another --output-dir")
    refuse_replacing_metrics(s.output_dir / "metrics.json", path, s.resume)
    probe = setup(s)
    history, start, partial = resume(probe) if s.resume and exists else ([], 0, None)
    with probe.preempt:
        epochs(probe, history, start, partial)
    changed = backbone_changes(probe.model, probe.reference)
    if changed:
        raise RuntimeError(f"the frozen backbone changed during the linear probe: {', '.join(changed[:5])}")
    return record(probe, history)


def refuse_replacing_metrics(metrics: Path, state: Path, resuming: bool) -> None:
    """A probe never replaces a finished probe's ``metrics.json`` that it does not continue: with
    one in the folder, only ``--resume`` from the folder's own state goes on (it rewrites the same
    record); starting afresh there is one line, before anything is written."""
    if not os.path.lexists(metrics) or (resuming and os.path.lexists(state)):
        return
    how = f"has no {state.name} to resume" if resuming else "starts afresh (no --resume)"
    raise UserError(
        f"{metrics} is a finished probe's output, and this run {how}, so it would replace it; nothing was "
        "written. Choose another --output-dir, or move the folder's files away to run there again"
    )


def epochs(probe: Probe, history: list[dict], start: int, partial: dict | None) -> None:
    """Train and evaluate from epoch ``start`` (``partial``: inside it) to the end. A preemption
    signal stops after the batch under way (or after the epoch's evaluation, on its last batch),
    saved, by raising ``Preempted``."""
    s = probe.settings
    val_loader = {
        "num_workers": s.workers,
        "worker_init_fn": functools.partial(ignore_in_worker, probe.preempt.names),
    }
    first_loss = None
    for epoch in range(start, s.preset.epochs):
        t0 = time.time()
        lr = s.preset.lr_at(epoch)
        train_loss, first_loss, partial = train_epoch(probe, epoch, lr, first_loss, partial)
        if partial is not None:
            save_state(probe, epoch, history, partial)
            stopped(probe, f"epoch {epoch + 1}, batch {partial['batch']}")
        acc = evaluate(probe.features, s.preset.layer, probe.head, probe.val, s.preset.batch_size, **val_loader)
        history.append({"epoch": epoch + 1, "lr": lr, "train_loss": train_loss, **acc, "seconds": time.time() - t0})
        save_state(probe, epoch + 1, history)
        logger.info(
            "epoch %d/%d lr %.4g loss %.4f top-1 %.2f top-5 %.2f",
            epoch + 1,
            s.preset.epochs,
            lr,
            train_loss,
            acc["top1"],
            acc["top5"],
        )
        if probe.preempt.received is not None and epoch + 1 < s.preset.epochs:
            stopped(probe, f"the end of epoch {epoch + 1}")


def stopped(probe: Probe, where: str) -> NoReturn:
    message = (
        f"preempted ({probe.preempt.received}): saved {probe.state_path} at {where}; exiting with code "
        f"{PREEMPTED_EXIT_CODE}. The same command with --resume continues from there"
    )
    logger.warning(message)
    raise Preempted(message)


def record(probe: Probe, history: list[dict]) -> dict:
    """metrics.json: the run's settings, the last epoch's accuracy and the best top-1."""
    s, preset = probe.settings, probe.settings.preset
    best = max(history, key=lambda h: h["top1"])
    return {
        "protocol": "linear",
        "dataset": s.dataset,
        "preset": s.preset_name,
        **eval_cli.source_record(s.weights, s.encoder, probe.backbone),
        "backbone_unchanged": True,
        "feature": {"layer": preset.layer, **probe.described, "head": "BN(no affine) + fc" if preset.head_bn else "fc"},
        "settings": asdict(preset),
        "processes": world_size(),  # each a slice of every global batch of settings.batch_size
        "preprocessing": {
            "train": f"RandomResizedCrop {probe.crop} (scale 0.08-1) + horizontal flip, seeded per image",
            "val": probe.val_prep.describe(),
        },
        "train": {"images": len(probe.train)},
        "val": {"images": len(probe.val)},
        "num_classes": len(probe.train.classes),
        "top1": history[-1]["top1"],
        "top5": history[-1]["top5"],
        "best_top1": best["top1"],
        "best_epoch": best["epoch"],
        "history": history,
    }
