"""Every relative link in README.md and docs/*.md points to a file of the repository, and every
#anchor to a heading of the file it names (GitHub's heading slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+?)\s*$", text, re.M)}


def links(path: Path) -> list[str]:
    return LINK.findall(CODE.sub("", path.read_text()))


def test_docs_exist():
    assert (REPO / "docs" / "README.md").is_file() and len(DOCS) > 2


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_the_checker_catches_a_broken_link(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n[ok](#title) [bad](missing.md) [bad anchor](#nope) `[code](not-a-link.md)`\n")
    assert links(doc) == ["#title", "missing.md", "#nope"]
    assert anchors(doc) == {"title"}
    assert slug("Detection fine-tuning") == "detection-fine-tuning"
    assert slug("`pretrain/` engine, v2 (CPU)") == "pretrain-engine-v2-cpu"
