"""Checkpoints: atomic writes, exact resume, and the final backbone export.

``checkpoint_last.pth`` (training state, rewritten in place atomically) holds the method's full
state_dict (encoders, momentum encoders, queues and pointers), the optimizer, the fp16 scaler,
the RNG states of every rank and the global step. ``checkpoint_final.pth`` is the contract with
``converters`` and ``transfer``: the backbone(s) in torchvision ResNet naming plus metadata.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
from omegaconf import OmegaConf

from pretrain import dist

FINAL_FORMAT = "contrastive-transfer/backbone/v1"


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save to a temp file in the same folder, then rename: a crash never leaves a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _all_rng_states() -> list[dict]:
    if dist.world_size() == 1:
        return [rng_state()]
    states: list = [None] * dist.world_size()
    torch_dist.all_gather_object(states, rng_state())
    return states


def save_training_state(path: Path, accelerator, method, optimizer, step: int, steps_per_epoch: int, cfg) -> None:
    """Called on every rank (RNG states are gathered); only the main process writes."""
    rngs = _all_rng_states()
    if accelerator.is_main_process:
        atomic_save({
            "method": method.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
            "rng": rngs,
            "step": step,
            "steps_per_epoch": steps_per_epoch,
            "config": OmegaConf.to_container(cfg),
        }, path)
    accelerator.wait_for_everyone()


# A resume continues the same run: these keys must not change in between (the rest may, e.g.
# train.max_steps or logging cadence).
RESUME_INVARIANT_KEYS = ("method", "model", "optim.name", "optim.exclude_norm_bias", "train.batch_size")


def _select(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _check_same_setup(path: Path, saved: dict, cfg) -> None:
    current = OmegaConf.to_container(cfg)
    for key in RESUME_INVARIANT_KEYS:
        was, now = _select(saved, key), _select(current, key)
        if was != now:
            raise RuntimeError(f"checkpoint {path} was written with {key}={was}, this run has {key}={now}: "
                               "resume with the same setting, or start afresh with train.resume=none "
                               "or another train.output_dir")


def load_training_state(path: Path, accelerator, method, optimizer, steps_per_epoch: int, cfg) -> int:
    """Restore everything saved by save_training_state; returns the global step to continue from."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise RuntimeError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(state, dict) or not {"method", "optimizer", "step"} <= state.keys():
        raise RuntimeError(f"{path} is not a training checkpoint (expected the keys method, optimizer, step; "
                           "checkpoint_final.pth cannot be resumed, use checkpoint_last.pth)")
    if state.get("steps_per_epoch") != steps_per_epoch:
        raise RuntimeError(f"checkpoint {path} was written with {state.get('steps_per_epoch')} steps per epoch, "
                           f"this run has {steps_per_epoch}: data.root or train.batch_size changed")
    _check_same_setup(path, state.get("config") or {}, cfg)
    try:
        method.load_state_dict(state["method"])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0]
        raise RuntimeError(f"checkpoint {path} does not fit this run's method/optimizer ({first}); "
                           "resume with the config it was written with, or start afresh with train.resume=none "
                           "or another train.output_dir") from None
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]
    set_rng_state(rngs[dist.rank() % len(rngs)])
    return int(state["step"])


def resume_path(cfg) -> Path | None:
    """train.resume: 'auto' → output_dir/checkpoint_last.pth if present; 'none'; or a path."""
    choice = cfg.train.resume
    if choice in (None, "none"):
        return None
    if choice == "auto":
        last = Path(cfg.train.output_dir) / "checkpoint_last.pth"
        return last if last.is_file() else None
    if not Path(choice).is_file():
        raise FileNotFoundError(f"train.resume={choice!r}: no such checkpoint")
    return Path(choice)


def export_final(path: Path, method, cfg, step: int) -> None:
    """The backbone (and the momentum encoder's, if any) in torchvision ResNet naming."""
    momentum = method.momentum_backbone
    atomic_save({
        "format": FINAL_FORMAT,
        "backbone": {k: v.detach().cpu() for k, v in method.backbone.state_dict().items()},
        "momentum_backbone": (None if momentum is None
                              else {k: v.detach().cpu() for k, v in momentum.state_dict().items()}),
        "arch": cfg.model.arch,
        "stem": cfg.model.stem,
        "method": cfg.method.name,
        "step": step,
        "git_sha": git_sha(),
        "config": OmegaConf.to_container(cfg),
    }, path)
