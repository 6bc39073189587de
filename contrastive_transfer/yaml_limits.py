"""YAML from elsewhere, bounded before it is built (docs/security.md).

Anchors and aliases let a 261-byte recipe expand tenfold per level into gigabytes once the loader
(OmegaConf, detectron2's CfgNode) copies it into a tree. ``check_yaml`` composes the file (PyYAML's
node graph shares aliased nodes, so composing is linear in the file's size), counts the nodes the
tree would have after expansion, and refuses a file above ``MAX_YAML_NODES`` in one line, before
any loader sees it. It also refuses text that is not UTF-8.
"""

from __future__ import annotations

import os

import yaml

from contrastive_transfer.cli import UserError
from contrastive_transfer.untrusted import read_untrusted

MAX_YAML_NODES = 200_000  # the largest real config here has ~1,000


class YamlLimitError(UserError, ValueError):
    """A YAML file too large once expanded, or not UTF-8 text."""


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    key = id(node)
    if key not in memo:
        memo[key] = 0  # an alias cycle counts as nothing more (the loaders refuse it themselves)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        memo[key] = 1 + sum(_expanded_size(child, memo) for child in children)
        if memo[key] > MAX_YAML_NODES:  # stop at once: the sum only grows
            raise OverflowError
    return memo[key]


def compose(path: str | os.PathLike) -> yaml.Node | None:
    """The file's node graph after the checks of the module docstring (None for an empty file;
    a syntax error is left for the loader, which names the line)."""
    try:
        text = read_untrusted(path, "config").decode("utf-8")  # the gate: a FIFO is refused, not waited on
    except UnicodeDecodeError as e:
        raise YamlLimitError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    try:
        _expanded_size(node, {})
    except (OverflowError, RecursionError):
        raise YamlLimitError(
            f"{path}: expands to more than {MAX_YAML_NODES} values through its anchors and aliases "
            "(or nests too deeply); a config is far smaller: write it out plainly"
        ) from None
    return node


def _bases(node: yaml.Node | None, key: str) -> list[str]:
    if not isinstance(node, yaml.MappingNode):
        return []
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            if isinstance(v, yaml.ScalarNode):
                return [v.value]
            if isinstance(v, yaml.SequenceNode):
                return [item.value for item in v.value if isinstance(item, yaml.ScalarNode)]
    return []


def check_yaml(path: str | os.PathLike, base_key: str | None = None, _seen: frozenset[str] = frozenset()) -> None:
    """``compose`` the file and, with ``base_key`` (detectron2's ``_BASE_``), every file of its
    chain, resolved as fvcore resolves them (relative to the file; URLs are left to fvcore)."""
    path = os.fspath(path)
    node = compose(path)
    if base_key is None or os.path.abspath(path) in _seen:
        return
    for base in _bases(node, base_key):
        if base.startswith(("https://", "http://")):
            continue
        base = os.path.expanduser(base)
        target = base if base.startswith("/") else os.path.join(os.path.dirname(path), base)
        if os.path.isfile(target):
            check_yaml(target, base_key, _seen | {os.path.abspath(path)})
