"""The cases every registered method and loss gets, derived from the registries (``METHODS``,
``LOSSES``) and the recipes in ``configs/pretrain``: a new method or loss is in them without a list
to edit. ``docs/extending.md``'s templates run through the same functions
(``tests/pretrain/test_extending.py``).

The tiny encoder (``tiny_build_encoder``: conv → BN → ReLU → pool under the method's own head) is
patched in once for every method by ``tiny_encoders``, wherever the method's module lives; a method
that builds its encoder another way is caught by ``assert_tiny`` instead of silently running the
full ResNet.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from pretrain import models
from pretrain.config import load_config
from pretrain.methods import METHODS

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "configs" / "pretrain"
FEATURES = 8  # the tiny backbone's output width
TINY_IMAGE = 16  # px: the tiny encoder pools whatever it gets
TINY_PARAMETERS = 100_000  # far below a ResNet-18's 11 M: what assert_tiny allows a method
# The tiny recipes' ResNet-18 at a quarter of its width: the same blocks, SplitBatchNorm and SyncBN
# conversion, about ten times cheaper a step, for the trainings that check mechanics, not learning.
NARROW = "model.arch=resnet18_0.25x"


def tiny_build_encoder(arch, stem, head, dim, hidden_dim=None, bn_splits=1, out_bn=False) -> models.Encoder:
    """Stands in for pretrain.models.build_encoder: conv → BN → ReLU → pool, then the real head."""
    backbone = nn.Sequential(
        nn.Conv2d(3, FEATURES, 3, padding=1, bias=False),
        nn.BatchNorm2d(FEATURES),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    return models.Encoder(backbone, models.build_head(head, FEATURES, hidden_dim or FEATURES, dim, out_bn))


@contextlib.contextmanager
def tiny_encoders():
    """Every method builds ``tiny_build_encoder``: ``pretrain.models.build_encoder`` is replaced in
    every loaded module that holds it (the registered methods' modules, wherever they live)."""
    real = models.build_encoder
    holders = [m for m in list(sys.modules.values()) if getattr(m, "build_encoder", None) is real]
    with contextlib.ExitStack() as stack:
        for module in holders:
            stack.enter_context(mock.patch.object(module, "build_encoder", tiny_build_encoder))
        yield


def assert_tiny(method: nn.Module) -> None:
    count = sum(p.numel() for p in method.parameters())
    assert count < TINY_PARAMETERS, (
        f"{type(method).__name__} has {count} parameters under tiny_encoders(): it does not build its "
        "encoder with pretrain.models.build_encoder, so the tests would train the full network"
    )


@functools.lru_cache(maxsize=None)
def tiny_recipes() -> dict[str, str]:
    """tiny recipe stem -> the method it trains, for every configs/pretrain/tiny_*.yaml."""
    return {p.stem: load_config(p).method.name for p in sorted(RECIPES.glob("tiny_*.yaml"))}


def method_recipe(name: str) -> Path:
    """The tiny recipe that stands for method ``name``: ``tiny_<name>.yaml``, else the first of its
    tiny recipes by name."""
    stems = [stem for stem, method in tiny_recipes().items() if method == name]
    assert stems, f"method {name!r} is registered but no configs/pretrain/tiny_*.yaml trains it"
    return RECIPES / f"{f'tiny_{name}' if f'tiny_{name}' in stems else stems[0]}.yaml"


def registered_methods() -> list[str]:
    return sorted(METHODS)


def tiny_overrides(root: Path, out: Path, steps: int) -> list[str]:
    return [
        f"data.root={root}",
        f"train.output_dir={out}",
        f"train.max_steps={steps}",
        f"data.image_size={TINY_IMAGE}",
        "train.diagnostics_every=1",
        "train.log_every=1",
    ]


# ---------------------------------------------------------------------------- the generic cases


def train_tiny(recipe: Path, root: Path, out: Path, steps: int, *overrides: str) -> Path:
    """``steps`` engine steps of ``recipe`` with the tiny encoder on TINY_IMAGE px images of
    ``root`` (an ImageFolder); returns checkpoint_final.pth (a second call on ``out`` resumes)."""
    from accelerate import Accelerator

    from pretrain.engine import train

    cfg = load_config(recipe, [*tiny_overrides(root, out, steps), *overrides])
    with tiny_encoders():
        return train(cfg, Accelerator(cpu=True))


def check_trains_and_resumes(recipe: Path, root: Path, tmp: Path, *overrides: str) -> None:
    """Two engine steps: finite rows, the backbone moves between the steps, and one step, a restart
    and a second step give the same bits as two steps in one go (backbone and method state)."""
    import json
    import math

    def load(path: Path) -> dict:  # files this test just wrote
        return torch.load(path, weights_only=False)

    straight = load(train_tiny(recipe, root, tmp / "straight", 2, *overrides))
    first = load(train_tiny(recipe, root, tmp / "resumed", 1, *overrides))
    resumed = load(train_tiny(recipe, root, tmp / "resumed", 2, *overrides))
    rows = [json.loads(line) for line in (tmp / "straight" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2], rows
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float)), rows
    assert straight["method"] == load_config(recipe).method.name and straight["step"] == resumed["step"] == 2
    assert sum(v.numel() for v in straight["backbone"].values()) < TINY_PARAMETERS, "not the tiny encoder"
    moved = [
        k for k, v in straight["backbone"].items() if v.is_floating_point() and not torch.equal(v, first["backbone"][k])
    ]
    assert moved, "the second step left every backbone tensor unchanged"
    for key, value in straight["backbone"].items():
        assert torch.equal(value, resumed["backbone"][key]), f"backbone {key} differs after the restart"
    a = load(tmp / "straight" / "checkpoint_last.pth")["method_state"]
    b = load(tmp / "resumed" / "checkpoint_last.pth")["method_state"]
    assert a.keys() == b.keys()
    for key, value in a.items():  # encoders, momentum encoders, queues, banks and their counters
        assert torch.equal(value, b[key]), f"method state {key} differs after the restart"


def check_converts(recipe: Path, tmp: Path, *overrides: str) -> None:
    """The method at its initialization with the recipe's real ResNet, exported as the engine does:
    both converters read every encoder it exports, with torchvision's names and the same tensors."""
    import pickle

    import torchvision

    from converters import to_detectron2, to_torchvision
    from pretrain.checkpoint import export_final

    cfg = load_config(recipe, [f"train.output_dir={tmp}", *overrides])
    torch.manual_seed(0)
    method = METHODS[cfg.method.name](cfg, 1)
    final = tmp / "checkpoint_final.pth"
    export_final(final, method, cfg, 0)
    encoders = {"query": method.backbone, "key": method.momentum_backbone}
    for encoder, net in encoders.items():
        if net is None:
            continue
        summary = to_torchvision.convert(final, tmp / f"{encoder}.pth", encoder)
        weights = torch.load(tmp / f"{encoder}.pth", weights_only=True)
        missing, unexpected = getattr(torchvision.models, summary["arch"])().load_state_dict(weights, strict=False)
        assert (sorted(missing), unexpected) == (["fc.bias", "fc.weight"], ["metadata"]), (missing, unexpected)
        record = weights.pop("metadata")  # the record the evaluators read, beside the tensors
        assert (record["encoder"], record["image_size"]) == (encoder, str(cfg.data.image_size)), record
        expected = net.state_dict()
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], v) for k, v in expected.items())
        if summary["stem"] == "imagenet":
            to_detectron2.convert(final, tmp / f"{encoder}.pkl", encoder)
            with open(tmp / f"{encoder}.pkl", "rb") as f:
                assert len(pickle.load(f)["model"]) == len(expected)


def loss_host() -> Path:
    """The InfoNCE host that trains every registered loss in the generic cases."""
    return RECIPES / "tiny_simclr.yaml"


def check_loss_shows_its_use(name: str) -> None:
    """The class that ``method.loss.name=<name>`` builds has a usage example (``>>>``), which passes."""
    import doctest
    import inspect

    from pretrain.losses import LOSSES

    cfg = load_config(loss_host(), [f"method.loss.name={name}"])
    cls = type(LOSSES[name].from_config(cfg.method))
    assert ">>>" in (cls.__doc__ or ""), f"loss {name!r}: no usage example in the docstring of {cls.__name__}"
    module = inspect.getmodule(cls)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(cls, cls.__name__, module=module, globs=vars(module)):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0, (
        f"loss {name!r}: {runner.failures} of {runner.tries} examples failed"
    )
