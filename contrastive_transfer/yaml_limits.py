"""YAML from elsewhere, bounded before it is built (docs/security.md).

Anchors and aliases let a 261-byte recipe expand tenfold per level into gigabytes once the loader
(OmegaConf, detectron2's CfgNode) copies it into a tree, and 3,000 aliases of one 1 MB string make
3 GB of text out of a 1 MB file. ``compose_text`` composes the text (PyYAML's node graph shares
aliased nodes, so composing is linear in the file's size), counts the values and the bytes of text
the tree would hold after expansion, and refuses a file above ``MAX_YAML_NODES`` values or
``MAX_YAML_BYTES`` bytes in one line, before any loader sees it. It also refuses text that is not
UTF-8, a top level that is not a mapping of keys, and nesting deeper than ``MAX_YAML_DEPTH``.

``_base_`` (recipes) and ``_BASE_`` (detectron2) chains are walked by their readers, which hold the
same two limits: at most ``MAX_BASE_DEPTH`` files from a config to its deepest base and
``MAX_BASE_FILES`` files in all (a file listing its base twice, at every level, would otherwise read
2^depth files); a file that is its own ancestor is a loop, named with the chain.
"""

from __future__ import annotations

import yaml

from contrastive_transfer.cli import UserError

MAX_YAML_NODES = 200_000  # the largest real config here has ~1,000
MAX_YAML_BYTES = 8 * 2**20  # of text after expanding aliases; the largest real config has ~5 kB
MAX_YAML_DEPTH = 64  # nesting of mappings and lists; the deepest real config has 6 levels
MAX_BASE_DEPTH = 8  # the deepest real chain here is 3 files
MAX_BASE_FILES = 32


class YamlLimitError(UserError, ValueError):
    """A YAML file too large once expanded, not UTF-8 text, or not a mapping; a base chain that
    loops or runs too deep."""


def _expanded_size(node: yaml.Node, memo: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(values, bytes of scalar text) of the tree that ``node`` expands to."""
    key = id(node)
    if key not in memo:
        memo[key] = (0, 0)  # an alias cycle counts as nothing more (the loaders refuse it themselves)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        nodes, size = 1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0
        for child in children:
            n, b = _expanded_size(child, memo)
            nodes, size = nodes + n, size + b
            if nodes > MAX_YAML_NODES or size > MAX_YAML_BYTES:  # stop at once: the sums only grow
                raise OverflowError
        memo[key] = (nodes, size)
    return memo[key]


def decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YamlLimitError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None


def _check_depth(text: str, where: str) -> None:
    """Nesting within MAX_YAML_DEPTH, from the parser's events (which come one at a time, without
    recursion): a config nested 100,000 levels would end every loader in a RecursionError."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise YamlLimitError(
                    f"{where}: nests more than {MAX_YAML_DEPTH} levels deep (line {event.start_mark.line + 1}); "
                    "a config is far shallower"
                )
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def compose_text(text: str, where: str) -> yaml.MappingNode | None:
    """The text's node graph after the checks of the module docstring (None for an empty file or
    a syntax error, which is left to the loader: it names the line)."""
    try:
        _check_depth(text, where)  # before composing: PyYAML's composer recurses once per level
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    try:
        _expanded_size(node, {})
    except (OverflowError, RecursionError):
        raise YamlLimitError(
            f"{where}: expands to more than {MAX_YAML_NODES} values or {MAX_YAML_BYTES // 2**20} MiB of text "
            "through its anchors and aliases (or nests too deeply); a config is far smaller: write it out plainly"
        ) from None
    if not isinstance(node, yaml.MappingNode):
        kind = "a list" if isinstance(node, yaml.SequenceNode) else f"the single value {node.value!r:.60}"
        raise YamlLimitError(f"{where}: holds {kind} at the top level, expected a mapping of keys (key: value)")
    return node


def base_names(node: yaml.MappingNode | None, key: str, where: str) -> list[str]:
    """The file names under ``key`` (one string or a list of strings); one line naming the file,
    the key and the value otherwise."""
    if node is None:
        return []
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            if isinstance(v, yaml.ScalarNode) and v.tag == "tag:yaml.org,2002:null":
                return []
            if isinstance(v, yaml.ScalarNode) and v.tag == "tag:yaml.org,2002:str" and v.value:
                return [v.value]
            if isinstance(v, yaml.SequenceNode) and all(
                isinstance(i, yaml.ScalarNode) and i.tag == "tag:yaml.org,2002:str" and i.value for i in v.value
            ):
                return [i.value for i in v.value]
            shown = v.value if isinstance(v, yaml.ScalarNode) else yaml.safe_load(yaml.serialize(v))
            raise YamlLimitError(
                f"{where}: {key}={shown!r:.80} (line {v.start_mark.line + 1}): expected a file name or a list of "
                "file names"
            )
    return []


def check_chain(chain: tuple[str, ...], name: str, files_read: int, key: str) -> None:
    """Refuse reading ``name`` as the next base below ``chain`` (outermost first) when it loops or
    goes past the limits of the module docstring."""
    if name in chain:
        loop = " -> ".join((*chain[chain.index(name) :], name))
        raise YamlLimitError(f"{chain[-1]}: {key} chain loops ({loop}); a base may not include itself")
    if len(chain) >= MAX_BASE_DEPTH:
        raise YamlLimitError(
            f"{chain[-1]}: {key} chain deeper than {MAX_BASE_DEPTH} files ({' -> '.join(chain)} -> {name}); flatten it"
        )
    if files_read >= MAX_BASE_FILES:
        raise YamlLimitError(f"{chain[0]}: its {key} chain reads more than {MAX_BASE_FILES} files; flatten it")
