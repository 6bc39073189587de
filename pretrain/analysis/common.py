"""What the diagnostics share: atomic CSV/JSON/PNG writes, and rebuilding a run's encoder.

Checkpoints (see ``pretrain.checkpoint``): ``checkpoint_last.pth`` holds the method's full
state_dict and resolved config, so the method is rebuilt exactly (query encoder with its
projection head, MoCo queue, AdCo adversaries). ``checkpoint_final.pth`` (or any layout the
converters read) holds only the backbone.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import io
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.utils.data import DataLoader, Subset

from contrastive_transfer import cli
from contrastive_transfer.cli import UserError, atomic_write, finite_or_null, write_json
from contrastive_transfer.contract import METHOD_STATE, training_state
from contrastive_transfer.progress import progress
from contrastive_transfer.safe_load import UnsafeFileError, load_weights_file
from pretrain.migrate import upgrade_saved


class AnalysisError(UserError, ValueError):
    """Bad input to a diagnostic; the message is one line naming the file, key or value."""


# ------------------------------------------------------------------------------------ writing


def write_text(path: Path, text: str) -> Path:
    cli.write_text(path, text)
    return path


def write_summary(path: Path, summary: dict) -> Path:
    """A diagnostic's summary as JSON, an estimate that came out NaN or infinite written as null
    (standard JSON, which ``json.dumps`` alone would not write), through ``write_json``."""
    return write_json(path, finite_or_null(summary), indent=2)


def write_csv(path: Path, columns: Sequence[str], rows: Iterable[dict]) -> Path:
    """Rows as dicts; a missing value is an empty cell."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), restval="", extrasaction="raise", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return write_text(path, buf.getvalue())


def save_figure(fig, path: Path, dpi: int = 130) -> Path:
    import matplotlib.pyplot as plt

    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi, bbox_inches="tight"))
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
    try:  # the project's one reader of weights (checkpoints given to the analyses may come from anywhere):
        state = load_weights_file(path)  # training states, and every format the evaluators read
    except UnsafeFileError as e:
        raise AnalysisError(str(e)) from None
    except Exception as e:  # torch raises many kinds for a bad file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]  # some say nothing (EOFError)
        raise AnalysisError(f"cannot read checkpoint {path}: {first}") from None
    if not isinstance(state, dict):
        raise AnalysisError(f"checkpoint {path}: expected a dict, got {type(state).__name__}")
    return training_state(state) or state  # a training state with today's keys (older files: "method")


def is_training_checkpoint(state: dict) -> bool:
    """checkpoint_last.pth: the method's state_dict under "method_state" (both files name the method
    under "method")."""
    return isinstance(state.get(METHOD_STATE), dict) and isinstance(state.get("config"), dict)


def rebuild_method(state: dict, path: str | os.PathLike) -> tuple[nn.Module, Any]:
    """The method of a ``checkpoint_last.pth`` with its weights, and its config, on CPU."""
    from pretrain.config import saved_config
    from pretrain.methods import METHODS

    saved_config(state["config"], f"checkpoint {path}")  # no planted interpolation, no huge sizes
    cfg = OmegaConf.create(upgrade_saved(state["config"]))
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
        method.load_state_dict(state[METHOD_STATE])
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


@torch.no_grad()
def embed_dataset(net: nn.Module, dataset, indices: list[int], batch_size: int, desc: str) -> list[torch.Tensor]:
    """Per view of ``dataset`` (an ``ImageDataset``), the (len(indices), d) embeddings of those
    images, in batches of ``batch_size`` (BN in ``net``'s current mode sees one batch at a time)."""
    from pretrain.data import collate

    loader = DataLoader(Subset(dataset, indices), batch_size=batch_size, collate_fn=collate)
    batches = [[embed(net, x, batch_size) for x in views] for views, _, _ in progress(loader, desc=desc)]
    return [torch.cat(view) for view in zip(*batches)]


def run_with_args(run: Callable[..., dict], args: argparse.Namespace) -> dict:
    """``run`` called with the command-line arguments named as its parameters (the options' dest)."""
    names = inspect.signature(run).parameters
    return run(**{name: value for name, value in vars(args).items() if name in names})
