"""How the project's modules may depend on each other, read from their source with ast (nothing is
imported): no import cycles, no late imports that dodge one, the runtime packages independent of the
benchmarks, and the dependency direction of the towers (pretrain → converters → transfer, all on the
base package)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contrastive_transfer", "pretrain", "converters", "transfer", "benchmarks", "tools")
RUNTIME = ("contrastive_transfer", "pretrain", "converters", "transfer")
# A comment on an import that says it is placed to get around a cycle.
DODGE = re.compile(r"#.*\b(late|circular|circle|cycle)\b", re.IGNORECASE)


# Imports against the tower order that remain for now, each with its reason; a new one fails.
KNOWN_CROSSINGS = {
    # npc reads any checkpoint layout (MoCo, VISSL, torchvision files) through the converters' reader;
    # leaving it needs that reader in the base package or npc limited to this project's files.
    ("pretrain.analysis.npc", "converters.checkpoint_io"),
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the project module imported
    line: int
    in_function: bool
    text: str  # the statement's lines and the comment line above it


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module that defines ``name`` (a module, or a name inside one)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue  # never executed: cannot take part in a cycle
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    if child.level:
                        base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                    # `from pkg import name` imports pkg, and pkg.name when that is a module
                    names = [base] + [f"{base}.{a.name}" for a in child.names]
                end = child.end_lineno or child.lineno
                text = "\n".join(lines[max(child.lineno - 2, 0) : end])
                for name in names:
                    target = _resolve(name, modules)
                    if target is not None and target != module:
                        found.append(Import(module, target, child.lineno, in_function, text))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source, filename=str(path)), False)
    return found


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Import]]:
    modules = _modules()
    return modules, [imp for name, path in modules.items() for imp in _imports(name, path, modules)]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph):
    """Function-level imports count: deferring an import does not remove the dependency."""
    modules, imports = graph
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports:
        # A package's __init__ importing its own submodules is how a package exports them.
        if not imp.target.startswith(imp.source + "."):
            edges[imp.source].add(imp.target)
    cycles = _cycles(edges)
    details = [
        f"{' <-> '.join(cycle)}: "
        + "; ".join(
            sorted({f"{i.source}:{i.line} imports {i.target}" for i in imports if {i.source, i.target} <= set(cycle)})
        )
        for cycle in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(details)


def test_no_late_import_dodges_a_cycle(graph):
    _, imports = graph
    dodges = sorted(
        {f"{i.source}:{i.line}: {i.text.strip()}" for i in imports if i.in_function and DODGE.search(i.text)}
    )
    assert not dodges, "function-level imports placed to get around a cycle:\n" + "\n".join(dodges)


def test_runtime_packages_never_import_the_benchmarks(graph):
    """The benchmarks measure the runtime packages; a command of theirs needs none of it (the two
    bench shims pretrain/bench.py and transfer/bench_svm.py go with the benchmarks' restructuring)."""
    _, imports = graph
    bad = sorted(
        {
            f"{i.source}:{i.line} imports {i.target}"
            for i in imports
            if i.source.split(".")[0] in RUNTIME and i.target.split(".")[0] == "benchmarks"
        }
    )
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "package, allowed",
    [
        ("contrastive_transfer", {"contrastive_transfer"}),
        ("pretrain", {"contrastive_transfer", "pretrain"}),
        ("converters", {"contrastive_transfer", "converters"}),
    ],
)
def test_towers_depend_only_on_the_base_package(graph, package, allowed):
    _, imports = graph
    bad = sorted(
        {
            f"{i.source}:{i.line} imports {i.target}"
            for i in imports
            if i.source.split(".")[0] == package
            and i.target.split(".")[0] not in allowed
            and (i.source, i.target) not in KNOWN_CROSSINGS
        }
    )
    assert not bad, "\n".join(bad)


# How a method or loss module's docstring names its source (docs/extending.md, "Conventions"): an
# arXiv id, a DOI, or, for a method that has no paper, a line "No paper: <why, and what it follows>".
CITATION = re.compile(r"arXiv:\d{4}\.\d{4,5}|doi:10\.\d{4,9}/\S+|^No paper: \S.{10,}", re.MULTILINE)


def cites_a_paper(docstring: str | None) -> bool:
    return bool(CITATION.search(docstring or ""))


def test_the_citation_rule_takes_every_form_the_guide_names():
    assert cites_a_paper('Paper: "Momentum Contrast", CVPR 2020, arXiv:1911.05722.')
    assert cites_a_paper("Paper: Y. LeCun et al., Proc. IEEE 1998, doi:10.1109/5.726791.")
    assert cites_a_paper("A baseline.\n\nNo paper: the cross-entropy classifier of torchvision's recipe.")
    assert not cites_a_paper("Momentum Contrast (He et al. 2020).")  # a name and a year are no citation
    assert not cites_a_paper("No paper:")  # without the reason
    guide = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    conventions = " ".join(guide.split("## Conventions the suite enforces")[1].split("\n## ")[0].split())
    assert all(form in conventions for form in ("`arXiv:NNNN.NNNNN`", "`doi:10.`", "`No paper: ...`"))
    # the other conventions a test enforces, each with the test that does
    for said in ("`>>>`", "test_loss_examples.py", "tiny_<name>.yaml", "test_engine.py", "build_encoder"):
        assert said in conventions, said
    for named in re.findall(r"`(tests/[\w/]+\.py)`", conventions):
        assert (ROOT / named).is_file(), named


def test_methods_and_losses_cite_their_papers():
    """Each method module and each loss module names its paper (title, authors, year, and an arXiv
    id or a DOI), or says it has none and why."""
    paths = [
        p
        for folder in ("pretrain/methods", "pretrain/losses")
        for p in sorted((ROOT / folder).glob("*.py"))
        if p.stem not in ("__init__", "base", "registry", "precision", "similarities")
    ]
    missing = [
        str(p.relative_to(ROOT))
        for p in paths
        if not cites_a_paper(ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))))
    ]
    assert paths and not missing, f"module docstrings without a citation (arXiv, DOI or 'No paper: why'): {missing}"


def test_mypy_covers_the_methods_and_the_losses():
    """`make lint` type-checks what a new method or loss touches (docs/extending.md): the files of
    [tool.mypy] include both packages (mypy itself runs in `make lint`, a minute on two cores)."""
    import tomllib

    files = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]["files"]
    assert {"pretrain/methods", "pretrain/losses"} <= set(files), files
