"""Lists that name registered things (methods, losses, augmentation and probe presets, checkpoint
layouts, data backends) in the docs, the code's comments and ``python -m pretrain --help`` name all
of them: a list written ``a | b | c`` whose names are mostly one registry's must be that registry,
so registering a loss (say) fails here until every such list says it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_WORD = r"[A-Za-z_][\w.+-]*"
# `a | b | c` (backticks allowed): the project's way of writing "one of"; table cells hold more than a word
_LIST = re.compile(rf"`?{_WORD}`?(?:[ \t]*\|[ \t]*`?{_WORD}`?){{1,}}")


def registries() -> dict[str, set[str]]:
    from converters.layouts import LAYOUTS
    from pretrain.augment.views import PRESETS
    from pretrain.data_backends import BACKENDS
    from pretrain.losses import LOSSES
    from pretrain.methods import METHODS
    from transfer.probe_presets import PRESETS as PROBE_PRESETS

    return {
        "methods": set(METHODS),
        "losses": set(LOSSES),
        "augmentation presets": set(PRESETS),
        "probe presets": set(PROBE_PRESETS),
        "layouts": set(LAYOUTS),
        "backends": set(BACKENDS),
    }


def stale_lists(text: str, where: str, registered: dict[str, set[str]]) -> list[str]:
    """Each ``a | b | c`` list of ``text`` whose names are mostly (60 %, at least two) one
    registry's but not all of it, as one line saying what it lacks."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|") and line.rstrip().endswith("|"):
            continue  # a Markdown table row: its cells are columns, not a list of choices
        for match in _LIST.finditer(line):
            names = [t for t in re.findall(_WORD, match.group(0))]
            for kind, registry in registered.items():
                hits = {t for t in names if t in registry}
                if len(hits) >= 2 and len(hits) >= 0.6 * len(set(names)) and hits != registry:
                    found.append(f"{where}:{n}: {match.group(0)!r} lacks the {kind} {sorted(registry - hits)}")
    return found


CODE = ("pretrain", "converters", "transfer", "contrastive_transfer")


def sources() -> list[Path]:
    return [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted(
            p for d in ("pretrain", "converters", "transfer", "contrastive_transfer") for p in (REPO / d).rglob("*.py")
        ),
        *sorted((REPO / "configs").rglob("*.yaml")),
    ]


def test_every_list_of_registered_names_in_docs_and_code_names_them_all():
    registered = registries()
    stale = [
        line for path in sources() for line in stale_lists(path.read_text(), str(path.relative_to(REPO)), registered)
    ]
    assert not stale, "\n".join(stale)


def test_pretrain_help_lists_the_registered_methods_losses_presets_and_backends(capsys):
    from pretrain.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    registered = registries()
    assert not stale_lists(text, "--help", registered)
    for kind in ("methods", "losses", "augmentation presets", "backends"):
        assert all(re.search(rf"\b{re.escape(name)}\b", text) for name in registered[kind]), kind


def test_the_check_finds_a_list_that_lacks_a_registered_name(monkeypatch):
    """The control: the loss list of docs/pretraining.md is found and passes, and fails once a loss
    is registered that it does not name; a list of recipe names or a table row is no list of losses."""
    from pretrain.losses import LOSSES

    registered = registries()
    text = (REPO / "docs" / "pretraining.md").read_text()
    assert "infonce | dcl | dclw | dual_temperature" in text and not stale_lists(text, "p", registered)
    monkeypatch.setitem(LOSSES, "toy", LOSSES["dcl"])
    stale = stale_lists(text, "p", registries())
    assert stale and all("lacks the losses ['toy']" in line for line in stale), stale
    assert not stale_lists("| dcl | dclw | x |\nrecipes `dcl`, `dclw`, `mocov2_dcl`", "p", registries())
