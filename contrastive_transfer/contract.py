"""What pretraining, the converters and the evaluators agree on: the checkpoint file format, the
ImageNet normalization and the kNN vote. ``pretrain`` writes through this module, ``converters``
and ``transfer`` read through it; none of them imports another for these.

The backbone record
-------------------
Both files a pretraining run writes carry the same record at their top level::

    format             "contrastive-transfer/backbone/v1"  (BACKBONE_FORMAT; readers refuse other versions)
    backbone           {torchvision ResNet name: tensor}   the query/online encoder's ResNet, no fc
    momentum_backbone  the same for the momentum (key) encoder, or None
    arch, stem         one of ARCHS, e.g. "resnet50"; one of STEMS: "imagenet" (7x7/2 conv + max-pool) |
                       "small" (3x3/1, no max-pool); ``resnet_backbone`` builds the network
    image_size         the pretraining crop in pixels (evaluators use it for --crop auto)
    weights_sha256     ``weights_sha256(backbone)``: evaluators repeat it in metrics.json, so a
                       figure names exactly the weights it measured (absent in older files)
    method, step, git_sha, config

``method`` is the method's name in every file. ``checkpoint_final.pth`` is the record alone.
``checkpoint_last.pth`` (and ``checkpoint_prev.pth``) add the training state (the method's
state_dict as ``method_state``, optimizer, scaler, RNG states, ...; marked by ``TRAINING_STATE_KEYS``),
which only ``pretrain`` reads: a reader of weights never parses a method's internals. Files written
before ``method_state`` had that name hold the state_dict under ``method``; ``training_state`` reads
both.

Torch is imported inside the functions that need it, so a command's ``--help`` does not wait for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contrastive_transfer.cli import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

BACKBONE_FORMAT = "contrastive-transfer/backbone/v1"
_FORMAT_FAMILY = BACKBONE_FORMAT.rsplit("/", 1)[0] + "/"
FINAL_NAME, LAST_NAME, PREV_NAME = "checkpoint_final.pth", "checkpoint_last.pth", "checkpoint_prev.pth"
METHOD_STATE = "method_state"  # the method's state_dict in a training state
TRAINING_STATE_KEYS = frozenset({METHOD_STATE, "optimizer", "step"})  # present in every training state


@dataclass(frozen=True)
class ResNetSpec:
    """A ResNet variant as torchvision (and detectron2's build_resnet_backbone) builds it."""

    depth: int
    bottleneck: bool
    blocks: tuple[int, int, int, int]  # blocks per stage
    width_per_group: int = 64  # the bottleneck width of stage 1; torchvision's wide variants use 128
    channels: int = 64  # the stem's output channels; stage k has channels * 2**(k-1) (x4 after a bottleneck)


# The record's ``arch``: the ResNets that pretraining builds and every reader rebuilds. All but the
# ``_<m>x`` ones are torchvision's; those multiply every layer's channels by m, as SimCLR's width
# multiplier does (ResNet-50 (2x) and (4x) of its Table 6: 94 M and 375 M parameters, fc excluded).
ARCHS: dict[str, ResNetSpec] = {
    "resnet18": ResNetSpec(18, False, (2, 2, 2, 2)),
    "resnet34": ResNetSpec(34, False, (3, 4, 6, 3)),
    "resnet50": ResNetSpec(50, True, (3, 4, 6, 3)),
    "resnet101": ResNetSpec(101, True, (3, 4, 23, 3)),
    "resnet152": ResNetSpec(152, True, (3, 8, 36, 3)),
    "wide_resnet50_2": ResNetSpec(50, True, (3, 4, 6, 3), 128),
    "wide_resnet101_2": ResNetSpec(101, True, (3, 4, 23, 3), 128),
    "resnet50_2x": ResNetSpec(50, True, (3, 4, 6, 3), 128, channels=128),
    "resnet50_4x": ResNetSpec(50, True, (3, 4, 6, 3), 256, channels=256),
    # A quarter of ResNet-18's width, about 10x cheaper a step on a CPU: smoke runs and the test
    # suite's trainings (detectron2 builds ResNet-18/34 only at 64 channels: no detection).
    "resnet18_0.25x": ResNetSpec(18, False, (2, 2, 2, 2), channels=16),
}
# The record's ``stem``, with its conv1 kernel (by which a reader recognizes the stem of a file
# that does not say): "imagenet" is torchvision's 7×7/2 conv and max-pool, "small" a CIFAR-style
# 3×3/1 conv without max-pool for 32-64 px images.
STEM_KERNELS = {"imagenet": (7, 7), "small": (3, 3)}
STEMS = tuple(STEM_KERNELS)

# torchvision's ImageNet statistics (RGB, 0-1 scale): every pretraining view and every evaluation.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# The weighted kNN classifier of InstDisc (Wu et al. 2018; DINO's eval_knn): k 200, τ 0.07. The
# pretraining monitor and `transfer.knn` share the vote and these defaults, so their figures compare.
KNN_K, KNN_TEMPERATURE = 200, 0.07


class FormatError(UserError, ValueError):
    """A file that claims this project's format but cannot be read as it (another version, a
    missing key); the message is one line naming the file."""


def resnet_backbone(
    arch: str, stem: str = "imagenet", norm_layer: Callable[[int], nn.Module] | None = None
) -> tuple[nn.Module, int]:
    """A freshly initialized ResNet ``arch`` (``ARCHS``) with ``stem`` and without its classifier
    (``fc`` = Identity, so the state dict has torchvision's names and no ``fc.*``); returns
    (backbone, feature dimension). ``norm_layer``: torchvision's (BatchNorm2d when None)."""
    import torchvision
    from torch import nn

    spec = ARCHS[arch]
    if spec.channels == 64:
        net = getattr(torchvision.models, arch)(weights=None, norm_layer=norm_layer)
    else:
        net = _scaled_resnet(spec, norm_layer)
    if stem == "small":
        net.conv1 = nn.Conv2d(3, spec.channels, kernel_size=STEM_KERNELS["small"], stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    dim = net.fc.in_features
    net.fc = nn.Identity()
    return net, dim


def _scaled_resnet(spec: ResNetSpec, norm_layer: Callable[[int], nn.Module] | None) -> nn.Module:
    """torchvision's ResNet with ``spec.channels`` stem channels, every stage scaled alike.

    torchvision fixes the stem at 64 channels, so its ResNet is built on the meta device (no
    memory, no random draws) and its stem, stages and classifier are built again at this width by
    its own ``_make_layer``, then initialized as its constructor initializes them."""
    import torch
    from torch import nn
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    block = Bottleneck if spec.bottleneck else BasicBlock
    # a bottleneck's inner width is planes * base_width / 64: base_width keeps spec.width_per_group
    base_width = spec.width_per_group * 64 // spec.channels if spec.bottleneck else 64
    with torch.device("meta"):
        net = ResNet(block, list(spec.blocks), width_per_group=base_width, norm_layer=norm_layer)
    c = net.inplanes = spec.channels
    net.conv1 = nn.Conv2d(3, c, kernel_size=7, stride=2, padding=3, bias=False)
    net.bn1 = net._norm_layer(c)
    for stage, blocks in enumerate(spec.blocks):
        layer = net._make_layer(block, c << stage, blocks, stride=1 if stage == 0 else 2)
        setattr(net, f"layer{stage + 1}", layer)
    net.fc = nn.Linear(net.inplanes, 1000)
    for m in net.modules():  # ResNet.__init__'s initialization (zero_init_residual=False)
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    return net


def backbone_record(
    backbone: Mapping[str, torch.Tensor],
    momentum_backbone: Mapping[str, torch.Tensor] | None,
    *,
    arch: str,
    stem: str,
    image_size: int,
    method: str,
    step: int,
    git_sha: str,
    config: dict,
) -> dict[str, Any]:
    """The record both checkpoint files carry (tensors detached, on the CPU)."""
    if stem not in STEMS:
        raise ValueError(f"stem={stem!r}: expected one of {STEMS}")

    def cpu(sd):
        return None if sd is None else {k: v.detach().cpu() for k, v in sd.items()}

    weights = cpu(backbone)
    return {
        "format": BACKBONE_FORMAT,
        "backbone": weights,
        "weights_sha256": weights_sha256(weights),
        "momentum_backbone": cpu(momentum_backbone),
        "arch": arch,
        "stem": stem,
        "image_size": int(image_size),
        "method": method,
        "step": int(step),
        "git_sha": git_sha,
        "config": config,
    }


def training_state(ckpt: object) -> dict | None:
    """A loaded ``checkpoint_last.pth`` with today's keys, or None when it is not a training state.

    Until the training state's ``method_state`` had its own name it was saved under ``method``, the
    key that names the method in the record (and overwrote that name): such a file gets its
    state_dict moved to ``method_state`` and ``method`` back as the name its saved config gives."""
    if not isinstance(ckpt, Mapping):
        return None
    state = dict(ckpt)
    if METHOD_STATE not in state and isinstance(state.get("method"), Mapping):
        state[METHOD_STATE] = state.pop("method")
        config = state.get("config")
        section = config.get("method") if isinstance(config, Mapping) else None
        if isinstance(section, Mapping) and isinstance(section.get("name"), str):
            state["method"] = section["name"]
    return state if TRAINING_STATE_KEYS <= state.keys() else None


def weights_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """A digest of the weights themselves, not of the file that holds them: the same tensors give the
    same digest in checkpoint_final.pth, a converted .pth or .safetensors and an evaluator's
    metrics.json. Over the names in sorted order, each with its dtype, shape and bytes; floating
    tensors as float32 (what every reader evaluates)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu()
        t = (t.float() if t.is_floating_point() else t).contiguous()
        digest.update(f"{name}|{str(t.dtype)}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def read_backbone_record(ckpt: object, source: str) -> dict[str, Any] | None:
    """The record of a loaded checkpoint, None if the file is not in this project's format; a
    FormatError for a version this code does not know or a record without its backbone."""
    if not isinstance(ckpt, Mapping):
        return None
    fmt = ckpt.get("format")
    if not (isinstance(fmt, str) and fmt.startswith(_FORMAT_FAMILY)):
        return None
    if fmt != BACKBONE_FORMAT:
        raise FormatError(
            f"{source}: written in format {fmt!r}; this version reads {BACKBONE_FORMAT!r}: "
            "convert it with the version of this project that wrote it"
        )
    if not isinstance(ckpt.get("backbone"), Mapping):
        raise FormatError(f"{source}: a {BACKBONE_FORMAT} file without its 'backbone' tensors")
    return dict(ckpt)


def pretraining_image_size(record: Mapping[str, Any]) -> int | None:
    """The pretraining crop of a record (``config.data.image_size`` in files written before the
    record carried ``image_size``)."""
    size = record.get("image_size")
    if size is None:
        config = record.get("config")
        data = config.get("data") if isinstance(config, Mapping) else None
        size = data.get("image_size") if isinstance(data, Mapping) else None
    return size if isinstance(size, int) and size > 0 else None


# Values in one chunk's similarity matrix (256 MB in float32): the queries go in chunks of
# KNN_SIMILARITIES // bank rows, so the vote's memory grows with the bank, never bank × queries.
KNN_SIMILARITIES = 1 << 26


def knn_bank(features, device=None, block_rows: int = 1 << 16):
    """L2-normalised rows of ``features`` ((N, D) tensor or array) on ``device`` (its own by
    default), as ``knn_vote`` takes them: float16 on CUDA, where it halves the bank's memory and
    the bandwidth each chunk of queries reads (ImageNet's 1.28 M × 2048 bank: 5.2 GB, not 10.5),
    float32 elsewhere (CPUs have no fast float16 product; float64 stays float64). Normalised block
    by block into the result, so the device never holds a float32 copy of the whole bank; a CPU
    tensor that is already float32 (or float64) and bound for the CPU is normalised in place."""
    import torch
    import torch.nn.functional as F

    x = torch.as_tensor(features)
    device = torch.device(device) if device is not None else x.device
    dtype = torch.float16 if device.type == "cuda" else (torch.float64 if x.dtype == torch.float64 else torch.float32)
    out = x if (x.device == device and x.dtype == dtype) else torch.empty(x.shape, dtype=dtype, device=device)
    with torch.no_grad():
        for start in range(0, x.shape[0], block_rows):
            block = x[start : start + block_rows].to(device, torch.promote_types(x.dtype, torch.float32))
            out[start : start + block_rows] = F.normalize(block, dim=1).to(dtype)
    return out


def knn_vote(
    query: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    num_classes: int,
    k: int = KNN_K,
    t: float = KNN_TEMPERATURE,
    max_similarities: int = KNN_SIMILARITIES,
) -> torch.Tensor:
    """Class scores (Nq, C) of L2-normalized queries (Nq, D) against a normalized bank (Nb, D):

        score[q, c] = Σ_{j ∈ top-k(q)} [y_j = c] · exp(⟨q, b_j⟩ / t)

    Each query's neighbours depend on that query alone, so the queries go in chunks of
    ``max_similarities // Nb`` rows: the similarity matrix held at once is at most that many
    values (the full Nq × Nb matrix never exists), and each query gets the neighbours and votes
    of the full matrix (bit for bit where the products are exact; otherwise up to the rounding of
    a product with another number of rows). The product runs in the bank's dtype (float16 from
    ``knn_bank`` on CUDA), the vote in float32 at least; on the tensors' device."""
    import torch

    k = min(k, bank.shape[0])
    rows = max(1, max_similarities // max(bank.shape[0], 1))
    vote_dtype = torch.promote_types(bank.dtype, torch.float32)
    out = []
    with torch.no_grad():
        for q in query.split(rows):
            sim, idx = (q.to(bank.dtype) @ bank.T).topk(k, dim=1)
            votes = torch.zeros(q.shape[0], num_classes, dtype=vote_dtype, device=sim.device)
            out.append(votes.scatter_add_(1, bank_labels[idx], (sim.to(vote_dtype) / t).exp()))
    return torch.cat(out) if out else torch.zeros(0, num_classes, dtype=vote_dtype, device=bank.device)
