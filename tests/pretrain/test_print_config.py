"""What ``--print-config`` shows is what the run does: the config after every derivation equals the
config.yaml the run saves, the crop scale that ``data.min_crop_scale`` sets included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from torchvision.transforms import v2

from pretrain.__main__ import main
from pretrain.config import load_config
from pretrain.methods import METHODS
from pretrain.optim import build_optimizer

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "tiny_simclr.yaml"


def test_print_config_equals_the_config_the_run_saves(synthetic_root, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    out = tmp_path / "run"
    argv = [
        "--config",
        str(RECIPE),
        f"data.root={synthetic_root / 'imagenet' / 'train'}",
        f"train.output_dir={out}",
        "data.image_size=16",
        "train.batch_size=8",
        "train.max_steps=1",
        "train.log_with=none",
    ]
    main([*argv, "--print-config"])
    printed = capsys.readouterr().out
    shown = yaml.safe_load(printed)
    # tiny_simclr: the simclr preset's crop (0.08-1) raised by _tiny.yaml's data.min_crop_scale 0.5
    assert [view["crop"]["scale"] for view in shown["data"]["views"]] == [[0.5, 1.0], [0.5, 1.0]]
    assert shown["train"]["mixed_precision"] == "no"  # resolved from the launcher, as the run does
    assert not out.exists()
    main(argv)
    assert printed == (out / "config.yaml").read_text()


RECIPES = sorted(p for p in RECIPE.parent.glob("*.yaml") if not p.stem.startswith("_"))


def _comments(printed: str) -> dict:
    """The resolved block under the config: the YAML in the comment lines after the config's own."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# resolved on this machine"))
    assert all(line.startswith("# ") for line in lines[start + 1 :])
    return yaml.safe_load("\n".join(line[2:] for line in lines[start + 1 :]))["resolved"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_print_config_shows_the_views_lr_and_settings_the_run_builds(recipe, capsys, monkeypatch):
    """Every recipe: the views printed are the transforms the run builds (the method's own, multi-crop
    included), the lr the optimizer starts from, and each automatic setting as this machine gets it."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    main(["--config", str(recipe), "--print-config"])
    printed = capsys.readouterr().out
    cfg = load_config(recipe)
    cfg.train.mixed_precision = cfg.train.mixed_precision or "no"  # the launcher's: none here
    assert OmegaConf.create(yaml.safe_load(printed)) == cfg  # still the config itself, loadable as a recipe
    shown = _comments(printed)

    views = METHODS[cfg.method.name].view_transforms(cfg)  # what the run's data pipeline gets
    crops = [next(op for op in view.transforms if isinstance(op, v2.RandomResizedCrop)) for view in views]
    assert shown["views"]["count"] == len(views) == len(shown["view"])
    assert [v["crop"]["size"] for v in shown["view"]] == [list(c.size) for c in crops]
    assert [v["crop"]["scale"] for v in shown["view"]] == [list(c.scale) for c in crops]

    try:  # as engine.setup builds it; on the meta device (shapes only) where the method allows
        with torch.device("meta"):
            method = METHODS[cfg.method.name](cfg, 1)
    except RuntimeError:  # AdCo reads a value of its bank at construction
        method = METHODS[cfg.method.name](cfg, 1)
    optimizer = build_optimizer(method, cfg)
    factor = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}[cfg.optim.lr_scaling]
    hand = cfg.optim.lr * (cfg.train.batch_size / cfg.optim.reference_batch) ** factor
    assert shown["lr"]["optim.lr"] == pytest.approx(hand) and str(cfg.optim.lr) in shown["lr"]["rule"]
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(shown["lr"]["optim.lr"])] * len(
        optimizer.param_groups
    )

    cuda = torch.cuda.is_available() and not cfg.train.cpu
    for key in ("train.channels_last", "train.cudnn_benchmark", "data.colour_on_device"):
        value = OmegaConf.select(cfg, key)
        assert shown[key] is (cuda if value is None else value), key
    assert shown["device"] == ("cuda" if cuda else "cpu")


def test_multicrop_prints_the_six_views_it_builds(capsys):
    """tiny_adco_multicrop at 64 px: the key crop (the recipe's 0.5-1 crop scale), then AdCo's query
    crops 224/192/160/128/96 scaled to 64 px with their own scale ranges; lr 0.3 at batch 16."""
    main(["--config", str(RECIPE.parent / "tiny_adco_multicrop.yaml"), "train.batch_size=32", "--print-config"])
    shown = _comments(capsys.readouterr().out)
    assert [v["crop"]["size"][0] for v in shown["view"]] == [64, 64, 55, 46, 37, 27]  # round(s·64/224)
    assert [v["crop"]["scale"] for v in shown["view"]] == [
        [0.5, 1.0],
        [0.2, 1.0],
        [0.172, 0.86],
        [0.143, 0.715],
        [0.114, 0.571],
        [0.086, 0.429],
    ]
    assert shown["lr"]["optim.lr"] == pytest.approx(0.6)  # 0.3 x 32/16, linear
    assert shown["device"] == "cpu"  # the tiny recipes set train.cpu
    assert shown["train.channels_last"] is False and shown["data.colour_on_device"] is False
