"""Shared fixtures: the tiny synthetic datasets, generated once per test session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from transfer.datasets.synthetic import generate


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory) -> Path:
    """Root of the tiny synthetic datasets (seed 0); `manifest.json` there says what was written."""
    root = tmp_path_factory.mktemp("synthetic")
    generate(root, seed=0, preset="tiny", workers=1)
    return root


@pytest.fixture(scope="session")
def synthetic_manifest(synthetic_root) -> dict:
    return json.loads((synthetic_root / "manifest.json").read_text())
