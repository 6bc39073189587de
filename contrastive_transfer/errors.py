"""The errors more than one tower raises for the same reason. They live in the base package so that
whoever raises one need not import whoever checks for it (pretrain.config validates through the
methods, whose losses check their own options)."""

from __future__ import annotations

from contrastive_transfer.cli import UserError

__all__ = ["ConfigError"]


class ConfigError(UserError, ValueError):
    """A bad configuration: a recipe or config file, a key, a value or a weights file named by one;
    the message names it and, where there are some, the allowed values."""
