"""Checkpoints: atomic writes, exact resume, and the backbone record.

Both files carry the backbone record of ``contrastive_transfer.contract`` (the format every reader
of weights uses). ``checkpoint_last.pth`` (rewritten atomically, the previous one kept as
``checkpoint_prev.pth``) adds the training state: the method's full state_dict (``method_state``:
encoders, momentum encoders, queues and pointers), the optimizer, the fp16 scaler, the RNG states of every rank and the
global step. ``checkpoint_final.pth`` is the record alone.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as torch_dist
from omegaconf import OmegaConf

from contrastive_transfer.cli import UserError, atomic_write
from contrastive_transfer.contract import (
    FINAL_NAME,
    LAST_NAME,
    METHOD_STATE,
    PREV_NAME,
    TRAINING_STATE_KEYS,
    backbone_record,
    training_state,
)
from contrastive_transfer.safe_load import NUMPY_RNG_GLOBALS, UnsafeFileError, torch_load
from contrastive_transfer.untrusted import read_untrusted
from pretrain import dist
from pretrain.config import config_defaults
from pretrain.migrate import upgrade_saved


class ResumeError(UserError):
    """A checkpoint that cannot continue this run (unreadable, another setup, missing on a rank)."""


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save through a temporary file renamed over ``path``: a crash never leaves a torn file,
    and a failed write leaves no temporary behind."""
    atomic_write(path, lambda f: torch.save(obj, f))


def keep_previous(last: Path) -> None:
    """Make ``checkpoint_prev.pth`` the current ``last`` (a hard link, renamed into place, so both
    names exist at every moment) before ``last`` is replaced: one bad write can never destroy the
    only good state."""
    if not last.is_file() or last.is_symlink():  # a link is no state of this run's: never kept as its previous one
        return
    prev, tmp = last.with_name(PREV_NAME), last.with_name(f".{PREV_NAME}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        # a new name for the same file: creating it never follows a link planted at tmp (EEXIST)
        os.link(last, tmp, follow_symlinks=False)
    except OSError:  # a filesystem without hard links: a copy, through the gate and the writer
        atomic_write(prev, lambda f: f.write(read_untrusted(last, "training state")))
        return
    os.replace(tmp, prev)


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rng_state() -> dict:
    # numpy's key as a list of ints: the file then loads with weights_only=True and no numpy globals
    kind, key, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (kind, key.tolist(), pos, has_gauss, cached)
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():  # this process's GPU only: a resume may see another number of GPUs
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # older checkpoints saved every visible GPU's state
            cuda = cuda[torch.cuda.current_device()] if torch.cuda.current_device() < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


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
        keep_previous(path)
        atomic_save(
            {
                **record(method, cfg, step),
                METHOD_STATE: method.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
                "rng": rngs,
                "steps_per_epoch": steps_per_epoch,
            },  # "step", "config" and "method" (its name) come with the record
            path,
        )
    accelerator.wait_for_everyone()


# A resume continues the same run: these keys must not change in between (the rest may, e.g.
# train.max_steps or logging cadence). The saved config is first brought to today's spelling
# (pretrain.migrate); a key it lacks is no change where this run holds the key's default.
RESUME_INVARIANT_KEYS = (
    "method",
    "model",
    "optim.name",
    "optim.exclude_norm_bias",
    "train.batch_size",
    "train.seed",
    "data.root",
    "data.augmentation",
    "data.views",
    "data.image_size",
    "data.min_crop_scale",
)
_ABSENT = object()


def _select(tree: dict, dotted: str, missing=None):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return missing
        tree = tree[part]
    return tree


def _changes(key: str, was: Any, now: Any, default: Any) -> Iterator[tuple[str, Any, Any]]:
    """(key, saved value, current value) of every difference between two config trees."""
    if was is _ABSENT and now == default:
        return  # a key added after the checkpoint was written, at its default
    if isinstance(was, dict) and isinstance(now, dict):
        default = default if isinstance(default, dict) else {}
        for k in [*was, *(k for k in now if k not in was)]:
            yield from _changes(f"{key}.{k}", was.get(k, _ABSENT), now.get(k, _ABSENT), default.get(k, _ABSENT))
    elif isinstance(was, list) and isinstance(now, list) and len(was) == len(now) and _all_dicts(was + now):
        # the views: name the op that differs
        for i, (a, b) in enumerate(zip(was, now)):
            yield from _changes(f"{key}.{i}", a, b, _ABSENT)
    elif was != now:
        yield key, was, now


def _all_dicts(items: list) -> bool:
    return all(isinstance(item, dict) for item in items)


# A changed name explains every option that comes and goes with it: named first, method before loss.
_NAME_KEYS = ("method.name", "method.loss.name")


def _precedence(change: tuple[str, Any, Any]) -> int:
    """The order a refusal names changes in: a method's or loss's name, then a value that changed,
    then a key that one side lacks (an option of the other loss, a key added since)."""
    key, was, now = change
    if key in _NAME_KEYS:
        return _NAME_KEYS.index(key)
    return len(_NAME_KEYS) + (was is _ABSENT or now is _ABSENT)


def _check_same_setup(path: Path, saved: dict, cfg) -> None:
    saved = upgrade_saved(saved)
    current = OmegaConf.to_container(cfg)
    defaults = OmegaConf.to_container(config_defaults(cfg.method.name, OmegaConf.select(cfg, "method.loss.name")))
    changes = [
        change
        for invariant in RESUME_INVARIANT_KEYS
        for change in _changes(invariant, *(_select(t, invariant, _ABSENT) for t in (saved, current, defaults)))
    ]
    if not changes:
        return
    key, was, now = min(changes, key=_precedence)  # the first of the most telling kind
    before = f"without {key}" if was is _ABSENT else f"with {key}={was}"
    after = f"no {key}" if now is _ABSENT else f"{key}={now}"
    others = [k for k, _, _ in changes if k != key]
    also = f" (also differing: {', '.join(others[:3])}{f' and {len(others) - 3} more' if len(others) > 3 else ''})"
    raise ResumeError(
        f"checkpoint {path} was written {before}, this run has {after}{also if others else ''}: "
        "resume with the same setting, or start afresh with train.resume=none or another train.output_dir"
    )


def read_training_state(path: Path) -> dict:
    """The training state in ``path``; ResumeError (one line) for a file that is not one."""
    try:
        # weights_only: a checkpoint from elsewhere (train.resume=FILE, a downloaded run folder)
        # must not run code; files written before the RNG key was a list need numpy's array globals.
        state = torch_load(path, NUMPY_RNG_GLOBALS, kind="training state")
    except UnsafeFileError as e:
        raise ResumeError(str(e)) from None
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ResumeError(f"cannot read checkpoint {path} ({first})") from None
    upgraded = training_state(state)  # older files name the method's state_dict "method"
    if upgraded is None:
        raise ResumeError(
            f"{path} is not a training checkpoint (expected the keys {', '.join(sorted(TRAINING_STATE_KEYS))}; "
            "checkpoint_final.pth cannot be resumed, use checkpoint_last.pth)"
        )
    return upgraded


def load_training_state(path: Path, accelerator, method, optimizer, steps_per_epoch: int, cfg, state: dict) -> int:
    """Restore ``state`` (read from ``path`` by read_training_state); returns the global step to
    continue from."""
    if state.get("steps_per_epoch") != steps_per_epoch:
        raise ResumeError(
            f"checkpoint {path} was written with {state.get('steps_per_epoch')} steps per epoch, "
            f"this run has {steps_per_epoch}: data.root or train.batch_size changed"
        )
    _check_same_setup(path, state.get("config") or {}, cfg)
    try:
        method.load_state_dict(state[METHOD_STATE])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0]
        raise ResumeError(
            f"checkpoint {path} does not fit this run's method/optimizer ({first}); "
            "resume with the config it was written with, or start afresh with train.resume=none "
            "or another train.output_dir"
        ) from None
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]
    set_rng_state(rngs[dist.rank() % len(rngs)])
    return int(state["step"])


def resume_candidates(cfg) -> list[Path]:
    """train.resume: 'auto' → checkpoint_last.pth, then checkpoint_prev.pth, of output_dir (those
    present); 'none' → nothing; a path → that file."""
    choice = cfg.train.resume
    if choice in (None, "none"):
        return []
    if choice == "auto":
        out = Path(cfg.train.output_dir)
        return [p for p in (out / LAST_NAME, out / PREV_NAME) if os.path.lexists(p)]
    if not os.path.lexists(choice):
        raise ResumeError(
            f"train.resume={choice!r}: no such checkpoint; give the path of a checkpoint_last.pth, or auto/none"
        )
    return [Path(choice)]


def refuse_replacing_final(cfg) -> None:
    """A run never replaces a finished run's ``checkpoint_final.pth`` that it does not continue:
    with one in ``train.output_dir``, the run must resume from that folder's own training state
    (``checkpoint_last.pth`` or ``checkpoint_prev.pth``); starting afresh there (``train.resume=none``,
    ``auto`` with no training state left, or a training state from elsewhere) is one line, and
    nothing in the folder is touched. Called under the folder's lock, before anything is written."""
    out = Path(cfg.train.output_dir)
    final = out / FINAL_NAME
    if not os.path.lexists(final):
        return
    own = {os.path.abspath(p) for p in (out / LAST_NAME, out / PREV_NAME, final)}
    candidates = resume_candidates(cfg)
    if any(os.path.abspath(p) in own for p in candidates):
        return  # continues this folder's run (an unreadable state is choose_resume's one line)
    how = (
        f"resumes from {candidates[0]}, another run's state"
        if candidates
        else "starts afresh: the folder has no checkpoint_last.pth or checkpoint_prev.pth to continue"
    )
    raise ResumeError(
        f"{final} is a finished run's output, and this run (train.resume={cfg.train.resume}) {how}, so it would "
        "replace it; nothing was written. Choose another train.output_dir, or move the folder's files away "
        "to train there again"
    )


def last_good(out: Path) -> str:
    """The sentence a stopped run ends its error with: which checkpoint of ``out`` a resume uses."""
    good = [p for p in (out / LAST_NAME, out / PREV_NAME) if p.is_file()]
    return (
        f"Last good checkpoint: {good[0]}; train.resume=auto continues from it."
        if good
        else "No checkpoint was written yet."
    )


def choose_resume(cfg, log=print) -> tuple[Path, dict] | None:
    """The checkpoint to resume from and its state: the first readable candidate. An unreadable
    checkpoint_last.pth (truncated by a full disk, emptied) falls back to checkpoint_prev.pth with
    one line saying so; when none is readable, ResumeError names them all."""
    candidates = resume_candidates(cfg)
    errors = []
    for path in candidates:
        try:
            state = read_training_state(path)
        except ResumeError as e:
            errors.append(str(e))
            continue
        for error in errors:
            log(f"warning: {error}; resuming from {path} instead")
        return path, state
    if errors:
        raise ResumeError(
            "; ".join(errors) + ": no readable checkpoint to resume; remove them to start afresh, "
            "or set train.resume=none or another train.output_dir"
        )
    return None


def record(method, cfg, step: int) -> dict:
    """The backbone record (``contrastive_transfer.contract``) of the method at this step."""
    momentum = method.momentum_backbone
    return backbone_record(
        method.backbone.state_dict(),
        None if momentum is None else momentum.state_dict(),
        arch=cfg.model.arch,
        stem=cfg.model.stem,
        image_size=cfg.data.image_size,
        method=cfg.method.name,
        step=step,
        git_sha=git_sha(),
        config=OmegaConf.to_container(cfg),
    )


def export_final(path: Path, method, cfg, step: int) -> None:
    """``checkpoint_final.pth``: the backbone record alone."""
    atomic_save(record(method, cfg, step), path)
