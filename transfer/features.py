"""Frozen ResNet features: layers and pooling of the FAIR/VISSL benchmark, preprocessing, disk cache.

The layers and their pooling are in ``transfer.layers``.

Preprocessing: "warp" (VOC07 SVM: shorter side → resize, then resize to crop×crop, aspect not
kept, no crop) or "center" (linear/kNN evaluation: shorter side → resize, center crop).

Both run on the PIL image, as VISSL (and the MoCo/VISSL linear evaluations) do with torchvision's
``transforms.Resize`` / ``CenterCrop`` on PIL images: PIL bilinear resampling (PIL's own, which
widens the filter when it shrinks), the long side computed by torchvision's
``_compute_resized_output_size`` — ``int(resize * long / short)``, truncated, in torchvision
0.29 — then ``ToTensor`` (÷255) and the ImageNet normalisation. Resizing a uint8 tensor instead
(antialiased bilinear in torch) gives different pixels and moves the mAP by a few tenths.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import PIL
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision import transforms
from torchvision.models.feature_extraction import create_feature_extractor

from contrastive_transfer.cli import UserError, atomic_write
from contrastive_transfer.contract import IMAGENET_MEAN, IMAGENET_STD
from contrastive_transfer.progress import progress
from contrastive_transfer.ranks import decided_by_rank0, gather_in_order, is_main, local_device, shard_indices
from contrastive_transfer.untrusted import open_untrusted
from converters.checkpoint_io import Backbone, build_resnet, load_backbone
from transfer.layers import LAYERS, pooling_for

logger = logging.getLogger(__name__)


def pool(layer: str, fmap: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) map → (B, dim) feature of `layer`."""
    ops = pooling_for(layer, fmap.shape[2], fmap.shape[3])
    if ops is None:
        return fmap.mean(dim=(2, 3))
    kernel, stride, pad = ops
    return F.avg_pool2d(fmap, kernel, stride, pad).flatten(1)


@dataclass(frozen=True)
class Preprocessing:
    resize: int = 256  # shorter side
    crop: int = 224  # network input side
    mode: str = "warp"  # "warp" (VOC07 SVM) | "center" (linear / kNN evaluation)

    def __post_init__(self):
        if self.mode not in ("warp", "center"):
            raise ValueError(f"preprocessing mode {self.mode!r}: expected 'warp' or 'center'")
        if not 0 < self.crop <= self.resize:
            raise ValueError(f"--crop {self.crop} / --resize {self.resize}: expected 0 < crop <= resize")

    backend: str = "pil"  # where the resizing happens; part of the feature cache key

    def pil_steps(self) -> transforms.Compose:
        """The PIL part: PIL image → PIL image (resize shorter side, then warp or center crop)."""
        second = (
            transforms.Resize((self.crop, self.crop), interpolation=transforms.InterpolationMode.BILINEAR)
            if self.mode == "warp"
            else transforms.CenterCrop(self.crop)
        )
        return transforms.Compose(
            [transforms.Resize(self.resize, interpolation=transforms.InterpolationMode.BILINEAR), second]
        )

    def transform(self) -> transforms.Compose:
        """PIL image → normalised float tensor (3, crop, crop)."""
        return transforms.Compose(
            [self.pil_steps(), transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        )

    def describe(self) -> dict:
        second = f"resize to {self.crop}x{self.crop}" if self.mode == "warp" else f"center crop {self.crop}"
        return {
            **asdict(self),
            "ops": f"shorter side {self.resize} (long side truncated), {second}, ToTensor, ImageNet mean/std",
            "resampling": f"PIL {PIL.__version__} bilinear on the PIL image (torchvision {torchvision.__version__})",
        }


def load_model(weights: str | os.PathLike, encoder: str = "query", layout: str = "auto") -> tuple[nn.Module, Backbone]:
    """The frozen backbone of any checkpoint the converters read, in eval mode, without gradients."""
    backbone = load_backbone(weights, encoder=encoder, layout=layout)
    model = build_resnet(backbone)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, backbone


class LayerFeatures(nn.Module):
    """Backbone → {layer: (B, dim) pooled features}; only the nodes the layers need are run."""

    def __init__(self, model: nn.Module, layers: list[str]) -> None:
        super().__init__()
        unknown = [name for name in layers if name not in LAYERS]
        if unknown:
            raise ValueError(f"layers {unknown}: expected names from {list(LAYERS)}")
        self.layers = list(layers)
        nodes = sorted({LAYERS[name].node for name in layers})
        self.body = create_feature_extractor(model, return_nodes={n: n for n in nodes})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        maps = self.body(x)
        return {name: pool(name, maps[LAYERS[name].node]) for name in self.layers}

    def describe(self, crop: int) -> dict[str, dict]:
        """Per layer: feature dim, map size and pooling for a crop×crop input."""
        with torch.no_grad():  # the probe lives where the model does (a CUDA, float64 or meta model)
            maps = self.body(torch.zeros(1, 3, crop, crop, **like(self.body)))
        out = {}
        for name in self.layers:
            fmap = maps[LAYERS[name].node]
            ops = pooling_for(name, fmap.shape[2], fmap.shape[3])
            out[name] = {
                "dim": int(pool(name, fmap).shape[1]),
                "map": list(fmap.shape[1:]),
                "pooling": "global average"
                if ops is None
                else {"kernel": list(ops[0]), "stride": list(ops[1]), "pad": list(ops[2])},
            }
        return out


def like(model: nn.Module) -> dict:
    """``device`` and ``dtype`` of the model's first parameter, for the tensors fed to it."""
    param = next(model.parameters())
    return {"device": param.device, "dtype": param.dtype}


def default_device() -> torch.device:
    """This process's GPU (its LOCAL_RANK under a launcher) when there is one, else the CPU."""
    return local_device()


@torch.no_grad()
def extract(
    extractor: LayerFeatures,
    dataset,
    batch_size: int = 32,
    workers: int = 0,
    device: torch.device | None = None,
    desc: str = "features",
) -> dict[str, np.ndarray]:
    """{layer: (N, dim) float32} for every image of `dataset` (items (image, label)), in order.

    Under a launcher (``torch.distributed`` initialized) each process extracts every W-th batch of
    the one-process run (``contrastive_transfer.ranks.shard_indices``) and every process receives
    all N rows back in the dataset's order: the same bits as one process with the same kernels and
    threads, since every image meets the same batch mates (batch-size-dependent convolution
    kernels would otherwise change the last bits)."""
    device = device or default_device()
    extractor = extractor.to(device).eval()
    shard = Subset(dataset, shard_indices(len(dataset), batch_size))
    loader = DataLoader(
        shard, batch_size=batch_size, shuffle=False, num_workers=workers, pin_memory=device.type == "cuda"
    )
    chunks: dict[str, list[np.ndarray]] = {name: [] for name in extractor.layers}
    for images, _ in progress(loader, len(loader), desc):
        for name, feats in extractor(images.to(non_blocking=True, **like(extractor))).items():
            chunks[name].append(feats.float().cpu().numpy())
    if not len(shard) and len(dataset):  # more processes than images: zero rows of the layers' widths
        for name, feats in extractor(dataset[0][0].unsqueeze(0).to(**like(extractor))).items():
            chunks[name].append(feats[:0].float().cpu().numpy())
    out = {}
    for name, c in chunks.items():
        out[name] = gather_in_order(torch.from_numpy(np.concatenate(c)), len(dataset), batch_size).numpy()
    return out


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open_untrusted(path, "weights") as f:  # the gate: a special file is refused, never read
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class FeatureCache:
    """Features on disk per (weights, layer, split): ``<root>/<key>/<split>_<layer>_features.npy``.

    key = hash of the backbone's weights (``weights_sha256``), encoder, preprocessing and the image
    list, so changed weights, list or transform never reuse stale features, and a re-run with the same
    inputs only reads. Not the file's bytes: a pretraining checkpoint also records its output folder and
    the code's commit, and the same weights moved, converted or re-saved give the same features.
    """

    def __init__(self, root: str | os.PathLike, backbone: Backbone, preprocessing: Preprocessing) -> None:
        self.root = Path(root)
        self.identity = {
            "weights_sha256": backbone.weights_sha256,
            "encoder": backbone.encoder,
            "preprocessing": asdict(preprocessing),
        }

    def _dir(self, dataset) -> Path:
        key = json.dumps({**self.identity, "images": dataset.fingerprint()}, sort_keys=True)
        return self.root / hashlib.sha256(key.encode()).hexdigest()[:16]

    def path(self, dataset, split: str, layer: str) -> Path:
        return self._dir(dataset) / f"{split}_{layer}_features.npy"

    def get(
        self, extractor_for, dataset, split: str, layers: list[str], **extract_kwargs
    ) -> dict[str, np.ndarray] | None:
        """Cached features of `layers`; the missing ones are extracted in one pass with
        `extractor_for(missing_layers)` and written atomically.

        Under a launcher every process extracts its shard and rank 0, alone, writes the cache and
        gets the features; the others get None (the evaluators' work after the features, the vote
        or the SVMs, runs on rank 0). Rank 0's disk decides what is missing, so that every process
        takes part in the same extractions even when machines do not share a file system."""
        folder = self._dir(dataset)
        if decided_by_rank0(folder.is_symlink()):  # neither read nor written through: another folder's features
            raise UserError(f"{folder} is a symbolic link, expected a folder of this feature cache; remove it")
        # a link is never adopted as a cached file (a cache may sit in a shared folder): extracted again and
        # replaced by this run's own file
        missing = decided_by_rank0([name for name in layers if not _own_file(self.path(dataset, split, name))])
        feats = extract(extractor_for(missing), dataset, desc=f"{split} features", **extract_kwargs) if missing else {}
        if not is_main():
            return None
        if missing:
            for name in missing:
                # within the cache's root: a link planted in place of a key folder sends nothing elsewhere
                atomic_write(self.path(dataset, split, name), lambda f, a=feats[name]: np.save(f, a), within=self.root)
            meta = json.dumps(self.identity, indent=1).encode()
            atomic_write(self._dir(dataset) / "cache.json", lambda f: f.write(meta), within=self.root)
        if len(missing) < len(layers):
            logger.info("features of %s (%s) read from the cache %s", split, ", ".join(layers), self._dir(dataset))
        return {name: feats[name] if name in feats else _read_npy(self.path(dataset, split, name)) for name in layers}


def _own_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _read_npy(path: Path) -> np.ndarray:
    """A cached feature array through the gate (a cache folder may be shared): a 2-D float array
    only (no pickled objects); one line naming the file otherwise."""
    try:
        with open_untrusted(path, "features") as f:
            array = np.load(f, allow_pickle=False)
    except (ValueError, EOFError) as e:
        array = f"unreadable ({' '.join(str(e).split())[:120]})"
    if not isinstance(array, np.ndarray) or array.ndim != 2 or array.dtype.kind != "f":
        what = array if isinstance(array, str) else f"shape {getattr(array, 'shape', '?')}"
        raise UserError(f"{path}: {what}, expected cached features (a 2-D float array); delete it to extract again")
    return array
