"""The usage examples in the loss classes' docstrings run, and every loss class has one."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest
from torch import nn

import pretrain.losses

MODULES = sorted(f"pretrain.losses.{m.name}" for m in pkgutil.iter_modules(pretrain.losses.__path__))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_pass(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} doctest examples failed"


@pytest.mark.parametrize("name", MODULES)
def test_every_loss_class_shows_its_use(name):
    module = importlib.import_module(name)
    classes = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if c.__module__ == name and issubclass(c, nn.Module) and c is not pretrain.losses.ContrastiveLoss
    ]
    missing = [c.__name__ for c in classes if ">>>" not in (c.__doc__ or "")]
    assert not missing, f"{name}: no usage example in the docstring of {missing}"
