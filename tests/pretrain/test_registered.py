"""Every registered method and loss, found in the registries: each method trains two engine steps
and resumes bit-exactly with the tiny encoder, and its checkpoint converts; each loss trains on an
InfoNCE host and shows its use. A new method or loss is here without a list to edit
(tests/method_cases.py)."""

from __future__ import annotations

import pytest

from pretrain.losses import LOSSES
from pretrain.methods import METHODS

from ..method_cases import (
    check_converts,
    check_loss_shows_its_use,
    check_trains_and_resumes,
    loss_host,
    method_recipe,
    tiny_recipes,
)


def test_every_registered_method_has_a_tiny_recipe_and_every_recipe_a_method():
    assert set(tiny_recipes().values()) <= set(METHODS)
    for name in METHODS:
        assert method_recipe(name).is_file()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_trains_and_resumes_exactly(synthetic_root, tmp_path, name):
    check_trains_and_resumes(method_recipe(name), synthetic_root / "imagenet" / "train", tmp_path)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_checkpoint_converts(tmp_path, name):
    check_converts(method_recipe(name), tmp_path)


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_trains_and_resumes_exactly_on_a_host(synthetic_root, tmp_path, name):
    check_trains_and_resumes(loss_host(), synthetic_root / "imagenet" / "train", tmp_path, f"method.loss.name={name}")


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_shows_its_use(name):
    check_loss_shows_its_use(name)
