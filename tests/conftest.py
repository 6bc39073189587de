"""Shared fixtures, built once per test session: the tiny synthetic datasets, and one brief
pretraining run (with its own initialization saved beside it) that the learning checks share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contrastive_transfer.synthetic import PRESETS, generate, write_imagenet

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ the suite on two workers
# `make test` runs two pytest-xdist workers. A module's tests share a worker (its module fixtures,
# e.g. the multi-process runs and the detection trainings, are built once), and the modules using
# a session fixture too costly to build twice share one whatever their module. xdist's own
# `--dist loadgroup` would do the latter from xdist_group marks, but with pytest 9 it groups
# nothing (it renames `item._nodeid`, which pytest 9 no longer reads): hence this scheduler.
# The controller sees only test ids, so the modules are named here; collection checks the list.
SHARED_WORKER = {
    "brief_pretraining": (
        "tests/pretrain/test_learning.py",
        "tests/transfer/test_pretrained_beats_random.py",
        "tests/transfer/test_probe_scale.py",
    ),
}
_GROUP_OF_MODULE = {module: fixture for fixture, modules in SHARED_WORKER.items() for module in modules}


def pytest_xdist_make_scheduler(config, log):
    """Work units of whole modules (or ``SHARED_WORKER`` groups), handed out in collection order."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the other modes
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _GROUP_OF_MODULE.get(module, module)

    # xdist's default hands out the units with the most tests first; collection order instead,
    # which puts the costliest units first (below), so that none of them ends the run alone
    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """Costly units first: the modules of a ``SHARED_WORKER`` fixture, then the modules with slow
    tests (a stable sort keeps each module's own order). A module using such a fixture that is not
    listed there is a usage error, not a silent rebuild on the other worker."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.path.relative_to(REPO).as_posix()
        uses = [fixture for fixture in SHARED_WORKER if fixture in getattr(item, "fixturenames", ())]
        for fixture in uses:
            if module not in SHARED_WORKER[fixture]:
                raise pytest.UsageError(f"{module} uses {fixture}: add it to SHARED_WORKER in tests/conftest.py")
        rank[module] = min(rank.get(module, 2), 0 if uses else 1 if item.get_closest_marker("slow") else 2)
    items.sort(key=lambda item: rank[item.path.relative_to(REPO).as_posix()])


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory) -> Path:
    """Root of the tiny synthetic datasets (seed 0); `manifest.json` there says what was written."""
    root = tmp_path_factory.mktemp("synthetic")
    generate(root, seed=0, preset="tiny", workers=1)
    return root


@pytest.fixture(scope="session")
def synthetic_manifest(synthetic_root) -> dict:
    return json.loads((synthetic_root / "manifest.json").read_text())


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    """Root of the real-digits preset (seed 0; about 3 s): scikit-learn's UCI digits in the layouts."""
    root = tmp_path_factory.mktemp("digits")
    generate(root, seed=0, preset="digits")
    return root


@pytest.fixture(scope="session")
def tiny_moco(synthetic_root, tmp_path_factory) -> Path:
    """A two-step MoCo v2 run (its checkpoint_last.pth with the queue, its checkpoint_final.pth),
    smaller than the tiny recipe (16 px, batch 8, queue 64, the quarter-width ResNet-18): the
    analyses' input."""
    from accelerate import Accelerator

    from pretrain.config import load_config
    from pretrain.engine import train

    out = tmp_path_factory.mktemp("tiny_moco")
    overrides = [f"data.root={synthetic_root / 'imagenet' / 'train'}", f"train.output_dir={out}", "train.max_steps=2"]
    overrides += ["data.image_size=16", "train.batch_size=8", "method.queue_size=64", "method.bn_splits=2"]
    overrides += [f"model.arch={BRIEF_ARCH}"]  # the quarter-width ResNet-18
    train(load_config(REPO / "configs" / "pretrain" / "tiny_mocov2.yaml", overrides), Accelerator(cpu=True))
    return out


# The brief pretraining: the tiny SimCLR recipe for a few epochs on the small preset's ImageNet
# layout (1500 train / 300 val images: the tiny preset's 100 val images make kNN too coarse), with
# the quarter-width ResNet-18 (`resnet18_0.25x`: the same blocks, SplitBatchNorm and SyncBN apply
# alike, about 10x cheaper a step) at 24 px for 8 epochs, on one thread: kNN goes from 32.7 % at
# the random init to 57.3 % (the tests' margin is 5 points) in 72 s alone (AMD EPYC, 2026-11-30;
# under ATEN_CPU_CAPABILITY=default 33.0 -> 46.0; seeds 1 and 2: +16.7 and +18.3 points; 6 epochs:
# 50.7 %). The full-width ResNet-18 took 286 s of CPU for 4 epochs (40.7 -> 53.0 %), and cheaper
# budgets of it left too little margin (3 epochs: 47.3 % with 2 threads; 16 px: 36.0 %).
BRIEF_RECIPE = "configs/pretrain/tiny_simclr.yaml"
BRIEF_ARCH = "resnet18_0.25x"
BRIEF_EPOCHS = 8
BRIEF_SIZE = 24


@pytest.fixture(scope="session")
def brief_pretraining(tmp_path_factory) -> dict:
    """{"init", "pretrained"}: checkpoint_final.pth files of the same run before any step and
    after BRIEF_EPOCHS epochs; "train_dir"/"val_dir": the ImageFolders; "metrics": the run's rows;
    "image_size": the side it trained and its kNN monitor evaluated at."""
    from accelerate.utils import set_seed

    from pretrain.checkpoint import export_final
    from pretrain.config import load_config
    from pretrain.methods import METHODS

    data = tmp_path_factory.mktemp("imagenet_small")
    write_imagenet(data, PRESETS["small"], seed=0, workers=1)
    out = tmp_path_factory.mktemp("brief_pretraining")
    overrides = [
        f"data.root={data / 'train'}",
        f"train.epochs={BRIEF_EPOCHS}",
        f"train.output_dir={out}",
        f"knn.train_dir={data / 'train'}",
        f"knn.val_dir={data / 'val'}",
        f"knn.every_epochs={BRIEF_EPOCHS}",
        f"data.image_size={BRIEF_SIZE}",
        f"model.arch={BRIEF_ARCH}",
        "train.log_every=20",
    ]
    subprocess.run(
        [sys.executable, "-m", "pretrain", "--config", BRIEF_RECIPE, *overrides],
        cwd=REPO,
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # the other worker has the other core
    )
    # The run's starting point: the engine seeds with train.seed and then builds the method.
    cfg = load_config(REPO / BRIEF_RECIPE, overrides)
    set_seed(cfg.train.seed)
    export_final(out / "init" / "checkpoint_final.pth", METHODS[cfg.method.name](cfg, 1), cfg, 0)
    return {
        "init": out / "init" / "checkpoint_final.pth",
        "pretrained": out / "checkpoint_final.pth",
        "train_dir": data / "train",
        "val_dir": data / "val",
        "image_size": BRIEF_SIZE,
        "metrics": [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
    }
