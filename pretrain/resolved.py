"""What a run resolves beyond its config, shown under it: ``--print-config`` and ``config.yaml``.

The config says ``data.views`` (the declared views), ``optim.lr`` (at ``optim.reference_batch``)
and ``null`` for the automatic settings; the run builds the method's own views (AdCo's multi-crop:
a key crop and one query crop per ``method.query_crops`` size), scales the lr to the global batch
and resolves each ``null`` on the machine it runs on. ``resolved`` says those values, taken from
the objects the run builds (the view transforms, the rule ``scaled_lr``) and the functions the
engine applies (``automatic``); ``config_text`` writes them as YAML comments under the config, so
the text stays loadable as a recipe (a comment is no key) and ``read_resolved`` reads them back.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf
from torchvision.transforms import v2

from pretrain.config import per_process_batch, scaled_lr
from pretrain.methods import METHODS

MARK = "# resolved on this machine (what runs; comments, so the config above stays loadable as a recipe):"


def run_device(cfg) -> torch.device:
    """The device Accelerate gives a run of ``cfg`` on this machine (``train.cpu`` forces the CPU)."""
    if not cfg.train.cpu and torch.cuda.is_available():
        return torch.device("cuda")
    if not cfg.train.cpu and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def automatic(cfg, device: torch.device) -> dict[str, bool]:
    """Every setting whose ``null`` means "what suits the device", as the run applies it."""
    cuda = device.type == "cuda"

    def auto(value) -> bool:
        return cuda if value is None else bool(value)

    return {
        "train.channels_last": auto(cfg.train.channels_last),
        "train.cudnn_benchmark": auto(cfg.train.cudnn_benchmark),
        "train.compile": bool(cfg.train.compile),
        "data.colour_on_device": auto(cfg.data.colour_on_device),
        "data.pin_memory": bool(cfg.data.pin_memory) and cuda,  # only CUDA copies gain from it
    }


def _op(op) -> str:
    """One op of a built view, as torchvision names it, with its probability when below 1."""
    if isinstance(op, v2.RandomApply):
        return f"{type(op.transforms[0]).__name__} p={op.p:g}"
    p = getattr(op, "p", None)
    return type(op).__name__ + (f" p={p:g}" if p is not None and p < 1 else "")


def describe_view(view) -> dict[str, Any]:
    """A built ViewTransform: its crop (size, scale, ratio) and its ops in the order they run
    (the geometric ones first, pretrain/augment/pipeline.py)."""
    declared = [op for op in view.transforms if op not in (view.to_float, view.normalize)]
    ops = [op for op in declared if op in view.geometric] + [op for op in declared if op not in view.geometric]
    crop = next((op for op in ops if isinstance(op, v2.RandomResizedCrop)), None)
    out: dict[str, Any] = {}
    if crop is not None:
        out["crop"] = {
            "size": list(crop.size),
            "scale": [float(s) for s in crop.scale],
            "ratio": [round(float(r), 4) for r in crop.ratio],
        }
    out["ops"] = [_op(op) for op in ops]
    return out


def resolved(cfg, device: torch.device, num_processes: int = 1) -> dict[str, Any]:
    views = METHODS[cfg.method.name].view_transforms(cfg)
    o = cfg.optim
    ratio = f"{cfg.train.batch_size}/{o.reference_batch}"
    factor = {"linear": ratio, "sqrt": f"sqrt({ratio})", "none": "1"}[o.lr_scaling]
    return {
        "device": device.type,
        "processes": num_processes,
        "batch_per_process": per_process_batch(cfg, num_processes),
        "lr": {
            "optim.lr": scaled_lr(cfg),
            "optim.final_lr": scaled_lr(cfg, o.final_lr),
            "rule": f"{o.lr_scaling}: optim.lr {o.lr} x {factor} (train.batch_size/optim.reference_batch)",
        },
        **automatic(cfg, device),
        "views": {"built_by": f"{cfg.method.name}.view_transforms", "count": len(views)},
        "view": [describe_view(view) for view in views],
    }


def config_text(cfg, device: torch.device, num_processes: int = 1) -> str:
    """The config as YAML, then what the run resolves as comments (``MARK``, then one ``# `` line
    per line of YAML)."""
    import yaml

    # flow style for the innermost lists: a view's crop on one line
    tree = {"resolved": resolved(cfg, device, num_processes)}
    block = yaml.safe_dump(tree, sort_keys=False, default_flow_style=None, width=1000)
    return OmegaConf.to_yaml(cfg) + MARK + "\n" + "".join(f"# {line}\n" for line in block.splitlines())


def read_resolved(text: str) -> dict[str, Any]:
    """The ``resolved`` section of a ``config_text`` (printed, or a run's config.yaml)."""
    import yaml

    comments = text.split(MARK + "\n", 1)[1]
    return yaml.safe_load("".join(line[2:] + "\n" for line in comments.splitlines()))["resolved"]
