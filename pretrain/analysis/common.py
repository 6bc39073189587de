"""What the diagnostics share: atomic CSV/JSON/PNG writes, and rebuilding a run's encoder.

Checkpoints (see ``pretrain.checkpoint``): ``checkpoint_last.pth`` holds the method's full
state_dict and resolved config, so the method is rebuilt exactly (query encoder with its
projection head, MoCo queue, AdCo adversaries). ``checkpoint_final.pth`` (or any layout the
converters read) holds only the backbone.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from contrastive_transfer.cli import UserError, atomic_write
from contrastive_transfer.safe_load import NUMPY_RNG_GLOBALS, UnsafeFileError, torch_load


class AnalysisError(UserError, ValueError):
    """Bad input to a diagnostic; the message is one line naming the file, key or value."""


# ------------------------------------------------------------------------------------ writing


def write_text(path: Path, text: str) -> Path:
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


def write_json(path: Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2) + "\n")


def write_csv(path: Path, columns: Sequence[str], rows: Iterable[dict]) -> Path:
    """Rows as dicts; a missing value is an empty cell."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), restval="", extrasaction="raise", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return write_text(path, buf.getvalue())


def save_figure(fig, path: Path, dpi: int = 130) -> Path:
    import matplotlib.pyplot as plt

    def write(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight")

    atomic_write(path, write)
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------ checkpoints


def load_checkpoint(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not os.path.lexists(path):
        raise AnalysisError(f"checkpoint {path} does not exist")
    try:  # weights_only: checkpoints given to the analyses may come from anywhere
        state = torch_load(path, NUMPY_RNG_GLOBALS, kind="training state")
    except UnsafeFileError as e:
        raise AnalysisError(str(e)) from None
    except Exception as e:  # torch raises many kinds for a bad file
        raise AnalysisError(f"cannot read checkpoint {path}: {str(e).strip().splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise AnalysisError(f"checkpoint {path}: expected a dict, got {type(state).__name__}")
    return state


def is_training_checkpoint(state: dict) -> bool:
    """checkpoint_last.pth: the method's state_dict under "method" (the final export has its name)."""
    return isinstance(state.get("method"), dict) and isinstance(state.get("config"), dict)


def rebuild_method(state: dict, path: str | os.PathLike) -> tuple[nn.Module, Any]:
    """The method of a ``checkpoint_last.pth`` with its weights, and its config, on CPU."""
    from pretrain.methods import METHODS

    cfg = OmegaConf.create(state["config"])
    name = OmegaConf.select(cfg, "method.name")
    if name not in METHODS:
        raise AnalysisError(f"checkpoint {path}: method.name={name!r} is not one of {sorted(METHODS)}")
    try:  # a config from another version (or hand-edited) may lack keys the method reads
        method = METHODS[name](cfg, 1)
    except (OmegaConfBaseException, KeyError, AttributeError, TypeError, ValueError) as e:
        first = (" ".join(str(e).split()) or type(e).__name__)[:200]
        raise AnalysisError(
            f"checkpoint {path}: its config cannot rebuild {name} ({type(e).__name__}: {first}); "
            "use a checkpoint_last.pth written by this version of the project"
        ) from None
    try:
        method.load_state_dict(state["method"])
    except RuntimeError as e:
        raise AnalysisError(
            f"checkpoint {path}: its method state does not fit {name} ({str(e).strip().splitlines()[0]})"
        ) from None
    return method, cfg


def query_encoder(method: nn.Module) -> nn.Module:
    """The online encoder (backbone → head) whose backbone is the exported one: MoCo/AdCo/SiMo's
    ``encoder_q``, SimCLR/SimCo's ``encoder``. Found by identity so new methods need no entry."""
    from pretrain.models import Encoder

    for module in method.modules():
        if isinstance(module, Encoder) and module.backbone is method.backbone:
            return module
    raise AnalysisError(f"{type(method).__name__} has no Encoder around its backbone")


@torch.no_grad()
def embed(net: nn.Module, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """L2-normalized fp32 outputs of ``net`` in its current mode, in chunks."""
    return torch.cat([F.normalize(net(x).float(), dim=1) for x in images.split(batch_size)])
