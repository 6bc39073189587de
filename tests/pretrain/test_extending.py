"""docs/extending.md's templates, taken from the page as written: the toy method and the toy loss
are written into a package of their own, registered by importing it, checked against brute-force
references and run through the generic cases every registered method and loss gets
(tests/method_cases.py). The guide cannot drift from the code without a failure here."""

from __future__ import annotations

import functools
import importlib
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from contrastive_transfer.errors import ConfigError
from pretrain.config import load_config
from pretrain.losses import LOSSES, InfoNCELoss
from pretrain.methods import METHODS

from ..method_cases import (
    check_converts,
    check_loss_shows_its_use,
    check_trains_and_resumes,
    loss_host,
)
from ..multiprocess_harness import Workers, assert_check_passed
from .test_multiprocess import CASE_RTOL, Case, _differences, _run  # before any template is registered

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "extending.md").read_text()
PACKAGE = "extending_templates"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE, re.S)


def _python_blocks() -> dict[str, str]:
    """The page's python blocks by the path on their first line (``# pretrain/methods/x.py``)."""
    return {re.match(r"# (\S+\.py)\n", block).group(1): block for block in _blocks("python")}


def _files_named(heading: str) -> list[str]:
    """The files listed under the page's line ``heading`` (``- `path`: ...`` bullets)."""
    section = PAGE.split(heading, 1)[1].split("\n\n", 2)[1]
    return re.findall(r"^- `([^`]+)`", section, re.M)


def _write_package(root: Path) -> Path:
    package = root / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    for path, source in _python_blocks().items():
        (package / Path(path).name).write_text(source)
    return root


def _import_templates(root: str) -> None:
    """Import (and so register) the templates written under ``root``: here and in each worker."""
    if root not in sys.path:
        sys.path.insert(0, root)
    for path in _python_blocks():
        importlib.import_module(f"{PACKAGE}.{Path(path).stem}")


@pytest.fixture
def templates(tmp_path):
    """The page's method and loss, registered for this test only."""
    methods, losses = dict(METHODS), dict(LOSSES)
    root = str(_write_package(tmp_path / "package"))
    _import_templates(root)
    yield sys.modules[f"{PACKAGE}.two_view"], sys.modules[f"{PACKAGE}.debiased"]
    METHODS.clear()
    METHODS.update(methods)
    LOSSES.clear()
    LOSSES.update(losses)
    sys.path.remove(root)
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


@pytest.fixture
def recipes(tmp_path):
    shutil.copy(REPO / "configs" / "pretrain" / "_tiny.yaml", tmp_path)
    for block in _blocks("yaml"):
        match = re.match(r"# (\S+\.yaml)", block)
        if match:
            (tmp_path / match.group(1)).write_text(block)
    return tmp_path


def test_the_page_holds_both_templates_and_names_few_files(recipes):
    assert sorted(_python_blocks()) == ["pretrain/losses/debiased.py", "pretrain/methods/two_view.py"]
    assert {p.name for p in recipes.glob("*two_view.yaml")} == {"two_view.yaml", "tiny_two_view.yaml"}
    for source in _python_blocks().values():
        assert len(source.splitlines()) <= 70  # a template one reads at once
    method_files, loss_files = _files_named("A new method `<name>`:"), _files_named("A new loss `<name>`:")
    assert len(method_files) <= 5 and len(loss_files) <= 3, (method_files, loss_files)
    assert "pretrain/methods/<name>.py" in method_files and "pretrain/losses/<name>.py" in loss_files
    assert "make lint" in PAGE


def test_registration_refuses_a_taken_name(templates):
    from pretrain.losses import register_loss
    from pretrain.methods import register_method

    method, loss = templates
    with pytest.raises(ValueError, match="method 'simclr' is already registered"):
        register_method("simclr")(method.TwoViewInfoNCE)
    with pytest.raises(ValueError, match="loss 'infonce' is already registered"):
        register_loss("infonce")(loss.from_config)
    assert METHODS["two_view"] is method.TwoViewInfoNCE and LOSSES["debiased"].config_keys == {"tau_plus": 0.1}


# ------------------------------------------------------------------------------------ the method


def test_template_method_loss_is_cross_entropy_over_the_batch(templates, recipes):
    cfg = load_config(recipes / "tiny_two_view.yaml", ["train.batch_size=6"])
    torch.manual_seed(0)
    method = METHODS["two_view"](cfg, 1).double().eval()
    x1, x2 = torch.randn(2, 6, 3, 32, 32, dtype=torch.float64)
    out = method([x1, x2])
    # By hand: row i's positive is the second view of image i, its negatives the other 5 images'.
    with torch.no_grad():
        q = F.normalize(method.encoder(x1), dim=1)
        k = F.normalize(method.encoder(x2), dim=1)
        expected = F.cross_entropy(q @ k.T / cfg.method.temperature, torch.arange(6))
    torch.testing.assert_close(out["loss"].detach(), expected, rtol=1e-10, atol=1e-12)
    shuffled = F.cross_entropy(q @ k.T / cfg.method.temperature, torch.arange(6).roll(1))
    assert not torch.isclose(expected, shuffled)  # control: a wrong pairing gives another loss


def test_template_method_trains_resumes_and_converts(templates, recipes, synthetic_root, tmp_path):
    check_trains_and_resumes(recipes / "tiny_two_view.yaml", synthetic_root / "imagenet" / "train", tmp_path / "run")
    check_converts(recipes / "tiny_two_view.yaml", tmp_path / "convert")


def _check_template_two_processes(root: str, recipe: str, rank: int, out_dir: str) -> None:
    _import_templates(root)
    torch.save(_run(Case(recipe), rank), Path(out_dir) / f"rank{rank}_run.pt")


@pytest.mark.slow  # two spawned processes: ~30 s on 2 busy cores, mostly their start-up
@pytest.mark.multiprocess
def test_template_method_two_processes_equal_one_process(templates, recipes, tmp_path):
    recipe = str(recipes / "tiny_two_view")  # Case joins it to configs/pretrain: an absolute path stays
    check = functools.partial(_check_template_two_processes, str(tmp_path / "package"), recipe)
    (tmp_path / "out").mkdir()
    workers = Workers({"template": check}, tmp_path / "out")
    assert_check_passed(workers.results(), "template")
    got = torch.load(tmp_path / "out" / "rank0_run.pt", weights_only=True)
    errors = _differences(got, _run(Case(recipe), rank=None))
    assert max(errors.values()) <= CASE_RTOL, errors


# ------------------------------------------------------------------------------------ the loss


def _brute_force_debiased(pos, neg, t: float, tau_plus: float) -> float:
    total = 0.0
    for p, row in zip(pos.tolist(), neg.tolist()):
        k = len(row)
        n_g = (sum(math.exp(s / t) for s in row) - tau_plus * k * math.exp(p / t)) / (1 - tau_plus)
        n_g = max(n_g, k * math.exp(-1 / t))
        total += -math.log(math.exp(p / t) / (math.exp(p / t) + n_g))
    return total / len(pos)


def test_template_loss_equals_the_papers_formula(templates):
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.rand(5, generator=g) * 2 - 1, torch.rand(5, 12, generator=g) * 2 - 1
    loss = templates[1].DebiasedLoss(0.5, tau_plus=0.1)
    assert loss(pos, neg).item() == pytest.approx(_brute_force_debiased(pos, neg, 0.5, 0.1), rel=1e-6)
    # control: the correction matters (τ⁺ = 0.1 is not InfoNCE) and the clamp is reached at a large τ⁺
    assert not math.isclose(loss(pos, neg).item(), InfoNCELoss(0.5)(pos, neg).item(), rel_tol=1e-3)
    high = templates[1].DebiasedLoss(0.5, tau_plus=0.9)
    assert high(pos, neg).item() == pytest.approx(_brute_force_debiased(pos, neg, 0.5, 0.9), rel=1e-6)


def test_template_loss_is_chosen_by_name_shows_its_use_and_checks_its_option(templates):
    cfg = load_config(loss_host(), ["method.loss.name=debiased", "method.loss.tau_plus=0.2"])
    assert dict(cfg.method.loss) == {"name": "debiased", "tau_plus": 0.2}
    check_loss_shows_its_use("debiased")
    with pytest.raises(ConfigError) as e:
        load_config(loss_host(), ["method.loss.name=debiased", "method.loss.tau_plus=1"])
    assert str(e.value).endswith(": method.loss.tau_plus=1: expected a number in [0, 1)")  # after the recipe


def test_template_loss_trains_and_resumes_on_a_host(templates, synthetic_root, tmp_path):
    root = synthetic_root / "imagenet" / "train"
    check_trains_and_resumes(loss_host(), root, tmp_path, "method.loss.name=debiased")
