"""A run saved by an earlier version of the code resumes after the code has moved on: a loss gained
an option, a new loss was registered, keys were renamed (``pretrain.migrate``). The checkpoint is
``tests/data/old_tiny_simclr_last.pth``, written by commit dd67ff4's code (see
``tests/data/make_old_checkpoint.py``); what is printed is what runs and what is saved."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from contrastive_transfer.contract import FINAL_NAME, LAST_NAME, training_state
from pretrain.checkpoint import ResumeError, _check_same_setup, read_training_state
from pretrain.config import experiment, load_config
from pretrain.engine import train
from pretrain.losses import LOSSES, DCLLoss, LossSpec
from pretrain.migrate import upgrade

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "configs" / "pretrain"
OLD = REPO / "tests" / "data" / "old_tiny_simclr_last.pth"
_spec = importlib.util.spec_from_file_location(
    "make_old_checkpoint", REPO / "tests" / "data" / "make_old_checkpoint.py"
)
assert _spec is not None and _spec.loader is not None
maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(maker)


@pytest.fixture
def newer_losses(monkeypatch):
    """The registry of a later version: InfoNCE has one more option, and a loss was added."""
    infonce = LOSSES["infonce"]
    grown = LossSpec(infonce.from_config, {**infonce.config_keys, "toy_option": 0.5}, infonce.check)
    monkeypatch.setitem(LOSSES, "infonce", grown)
    monkeypatch.setitem(LOSSES, "toy", LossSpec(lambda m: DCLLoss(float(m.temperature)), {"toy_scale": 2.0}))


@pytest.fixture
def old_run(synthetic_root, tmp_path, monkeypatch):
    """The old checkpoint as the checkpoint_last.pth of a run folder, with the recipe's relative
    data root (what the old run saved) pointing at the synthetic images."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "datasets").mkdir()
    os.symlink(synthetic_root, tmp_path / "datasets" / "synthetic")
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(OLD, out / LAST_NAME)
    return out


def _cfg(out: Path, *overrides: str):
    return load_config(
        RECIPES / f"{maker.RECIPE}.yaml", [*maker.OVERRIDES, f"train.output_dir={out}", "train.max_steps=2", *overrides]
    )


def test_the_old_checkpoint_resumes_after_an_option_and_a_loss_were_added(newer_losses, old_run):
    cfg = _cfg(old_run)
    assert dict(cfg.method.loss) == {"name": "infonce", "eqco_alpha": None, "toy_option": 0.5}
    saved = torch.load(OLD, weights_only=False)
    # The old file: every loss's options directly under `method`, the state_dict under "method", the
    # crop scale not in the views. Compared as they stand (the old rule), the run would be refused.
    assert saved["config"]["method"] != OmegaConf.to_container(cfg.method)
    assert saved["config"]["data"]["views"] != OmegaConf.to_container(cfg.data.views)
    assert isinstance(saved["method"], dict) and "method_state" not in saved

    with mock.patch("pretrain.methods.simclr.build_encoder", maker.tiny_build_encoder):
        final = train(cfg, Accelerator(cpu=True))
    rows = (old_run / "metrics.jsonl").read_text().splitlines()
    assert [OmegaConf.create(r).step for r in rows if '"loss"' in r] == [2]  # step 1 came from the old file
    state = read_training_state(old_run / LAST_NAME)
    assert (state["step"], state["method"], final.name) == (2, "simclr", FINAL_NAME)
    assert state["method_state"].keys() == training_state(saved)["method_state"].keys()


def test_a_real_change_is_still_refused(newer_losses, old_run):
    saved = torch.load(OLD, weights_only=False)["config"]
    _check_same_setup(OLD, saved, _cfg(old_run))  # the control: as it is, it fits
    for override, named in [
        ("method.temperature=0.3", "method.temperature=0.1, this run has method.temperature=0.3"),
        (
            "method.loss.toy_option=0.7",
            "written without method.loss.toy_option, this run has method.loss.toy_option=0.7",
        ),
        ("method.loss.name=toy", "method.loss.name=infonce, this run has method.loss.name=toy"),
        (
            "data.min_crop_scale=0.4",
            "data.views.0.crop.scale=[0.5, 1.0], this run has data.views.0.crop.scale=[0.4, 1.0]",
        ),
    ]:
        with pytest.raises(ResumeError, match="^checkpoint .* was written ") as e:
            _check_same_setup(OLD, saved, _cfg(old_run, override))
        assert named in str(e.value), override


def test_old_spellings_give_the_new_config(tmp_path):
    """Recipes and overrides in the spelling of the old checkpoint's time resolve as today's."""
    new = load_config(RECIPES / "tiny_dclw.yaml", ["method.loss.sigma=0.3", "method.loss.per_process=true"])
    old = load_config(RECIPES / "tiny_dclw.yaml", ["method.dclw_sigma=0.3", "method.dclw_per_process=true"])
    assert old == new
    assert load_config(RECIPES / "tiny_dclw.yaml", ["method.loss=dcl"]).method.loss == {"name": "dcl"}
    # SiMo's own α can be turned off with either spelling (null is also InfoNCE's registry default)
    for override in ("method.loss.eqco_alpha=null", "method.eqco_alpha=null"):
        assert load_config(RECIPES / "tiny_simo.yaml", [override]).method.loss.eqco_alpha is None, override
    own = tmp_path / "mine.yaml"  # a user's recipe of the old spelling on today's project recipe
    own.write_text(f"_base_: {RECIPES / 'tiny_simclr.yaml'}\nmethod:\n  loss: dclw\n  dclw_sigma: 0.3\n")
    assert OmegaConf.to_container(load_config(own).method.loss) == {
        "name": "dclw",
        "sigma": 0.3,
        "detach": True,
        "per_process": False,
    }
    assert upgrade({"method": {"loss": "dual_temperature", "inter_temperature": 0.5}}) == {
        "method": {"loss": {"name": "dual_temperature", "inter_temperature": 0.5}}
    }


def test_adding_a_loss_or_an_option_changes_nothing_for_the_others(monkeypatch):
    before = {r: load_config(RECIPES / f"{r}.yaml") for r in ("tiny_dclw", "tiny_simco", "tiny_mocov2")}
    monkeypatch.setitem(LOSSES, "toy", LossSpec(lambda m: DCLLoss(float(m.temperature)), {"toy_scale": 2.0}))
    dcl = LOSSES["dcl"]
    monkeypatch.setitem(LOSSES, "dcl", LossSpec(dcl.from_config, {"toy_option": 1}, dcl.check))
    for recipe, cfg in before.items():
        assert OmegaConf.to_yaml(load_config(RECIPES / f"{recipe}.yaml")) == OmegaConf.to_yaml(cfg), recipe
    assert load_config(RECIPES / "tiny_dcl.yaml").method.loss == {"name": "dcl", "toy_option": 1}  # the control


def test_a_saved_config_that_cannot_be_upgraded_is_refused_in_one_line(old_run):
    """A checkpoint from elsewhere may hold anything as its config: it is compared as it stands."""
    cfg = _cfg(old_run)
    for saved in (
        {"method": 3, "data": {"augmentation": "nope", "views": [5], "min_crop_scale": "x"}},
        {"method": {"name": "simclr", "loss": {"name": ["infonce"]}}},
        {"method": {"name": "simclr", "loss": 5}},
    ):
        with pytest.raises(ResumeError, match="^checkpoint .* was written with method") as e:
            _check_same_setup(OLD, saved, cfg)
        assert "\n" not in str(e.value)


def _experiment_now(*overrides: str) -> dict:
    cfg = load_config(RECIPES / f"{maker.RECIPE}.yaml", [*maker.OVERRIDES, "train.max_steps=1", *overrides])
    return experiment(OmegaConf.to_container(cfg))


def test_the_old_run_is_the_same_experiment_for_todays_code(newer_losses):
    """Benchmarks key their measured runs by ``experiment``: the config the old code saved (old
    spellings, every loss's options under `method`, no views) and today's load of the same recipe,
    with an option and a loss added since, are one experiment; what trains is not."""
    saved = torch.load(OLD, weights_only=False)["config"]
    assert experiment(saved) == _experiment_now()
    assert experiment(saved) == _experiment_now("train.output_dir=/elsewhere", "train.log_every=7", "knn.k=3")
    assert experiment(saved) != _experiment_now("method.loss.toy_option=0.25")  # a value that trains
    assert experiment(saved) != _experiment_now("method.loss.name=dcl")


def test_a_changed_default_is_another_experiment(monkeypatch):
    """A key the old run held at the old default: when today's default differs, the runs differ."""
    saved = torch.load(OLD, weights_only=False)["config"]
    infonce = LOSSES["infonce"]
    monkeypatch.setitem(
        LOSSES, "infonce", LossSpec(infonce.from_config, {**infonce.config_keys, "eqco_alpha": 64}, infonce.check)
    )
    assert experiment(saved) != _experiment_now()
    assert experiment(saved) == _experiment_now("method.loss.eqco_alpha=null")


def test_a_refusal_names_the_changed_name_first_with_both_values():
    """Another loss (or method) brings other options: the refusal names the name that changed,
    with both values, not the first option that came or went with it."""

    def refusal(saved_recipe: str, recipe: str, *overrides: str) -> str:
        saved = OmegaConf.to_container(load_config(RECIPES / f"{saved_recipe}.yaml"))
        with pytest.raises(ResumeError) as e:
            _check_same_setup(Path("last.pth"), saved, load_config(RECIPES / f"{recipe}.yaml", list(overrides)))
        return str(e.value)

    named = "was written with method.loss.name=infonce, this run has method.loss.name=dcl (also differing: "
    assert named in refusal("tiny_simclr", "tiny_simclr", "method.loss.name=dcl")
    assert "written with method.loss.name=dclw, this run has method.loss.name=infonce (" in refusal(
        "tiny_dclw", "tiny_dclw", "method.loss.name=infonce"
    )
    assert "written with method.name=simclr, this run has method.name=simo (" in refusal("tiny_simclr", "tiny_simo")
    # a value that changed comes before a key one side lacks (here: an option the saved run predates)
    saved = OmegaConf.to_container(load_config(RECIPES / "tiny_simclr.yaml"))
    del saved["method"]["loss"]["eqco_alpha"]
    current = load_config(RECIPES / "tiny_simclr.yaml", ["method.loss.eqco_alpha=16", "method.temperature=0.3"])
    with pytest.raises(ResumeError) as e:
        _check_same_setup(Path("last.pth"), saved, current)
    named = "with method.temperature=0.1, this run has method.temperature=0.3 (also differing: method.loss.eqco_alpha)"
    assert named in str(e.value)
