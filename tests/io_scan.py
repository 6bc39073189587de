"""Every read and write of a file in the project's source, found by parsing it (``ast``), for the
one-reader and one-writer tests (issue 48, items 1 and 2).

A call is *raw* when it opens, reads or writes a file by its path instead of going through the
gate (``contrastive_transfer.untrusted``) or the writer (``contrastive_transfer.cli.atomic_write``
and ``open_append``). What the gate or the writer hands over is a file object, so a call on a file
object is not raw:

- a name bound by ``with open_untrusted(...) as f`` (or ``open_own``/``os.fdopen``) in the same
  function, or an ``io.BytesIO(...)``;
- for writes, a parameter of the innermost lambda (``atomic_write(path, lambda f: torch.save(obj,
  f))``: the writer hands ``f`` in; a ``def``'s parameter may be a path, so it does not count).

A call of a bare name (``write_text(path, text)``, ``save(tensors)``) is the project's own function
or one that returns bytes, not a method of a path, and is not reported.

Anything else that reads or writes a path is reported as ``(line, "read"|"write", what)``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pretrain", "transfer", "converters", "contrastive_transfer", "benchmarks", "tools")

# Functions whose argument names the file: (module-ish receiver, name) -> index of that argument.
WRITE_CALLS = {
    ("torch", "save"): 1,
    ("np", "save"): 0,
    ("np", "savez"): 0,
    ("np", "savez_compressed"): 0,
    ("np", "savetxt"): 0,
    ("json", "dump"): 1,
    ("pickle", "dump"): 1,
    ("yaml", "dump"): 1,
    ("yaml", "safe_dump"): 1,
    ("OmegaConf", "save"): 1,
    (None, "save_file"): 1,  # safetensors
    (None, "savefig"): 0,
    (None, "save"): 0,  # PIL's Image.save, a FileIndex's save, a checkpointer's: each judged below
    (None, "to_csv"): 0,
}
READ_CALLS = {
    ("torch", "load"): 0,
    ("np", "load"): 0,
    ("np", "loadtxt"): 0,
    ("np", "genfromtxt"): 0,
    ("np", "fromfile"): 0,
    ("json", "load"): 0,
    ("pickle", "load"): 0,
    ("Image", "open"): 0,
    ("tarfile", "open"): 0,
    ("zipfile", "ZipFile"): 0,
    (None, "safe_open"): 0,
    (None, "read_image"): 0,
    (None, "load_file"): 0,  # safetensors
}
PATH_WRITES = {"write_text", "write_bytes"}
PATH_READS = {"read_text", "read_bytes"}
PATH_CHANGES = {"touch", "chmod", "symlink_to", "hardlink_to"}
MOVES = {("shutil", n) for n in ("copy", "copy2", "copyfile", "copytree", "move")} | {
    ("os", n) for n in ("link", "symlink", "rename", "replace")
}
# Calls that return a file object of the gate's or the writer's (a name bound to one is handed over).
HANDING = {"open_untrusted", "open_own", "fdopen", "BytesIO", "open_append", "NamedTemporaryFile"}


def _name(func: ast.expr) -> tuple[str | None, str]:
    """(receiver, attribute) of a call's function: ``torch.save`` -> ("torch", "save"), ``open`` ->
    (None, "open"), ``fig.savefig`` -> ("fig", "savefig")."""
    if isinstance(func, ast.Name):
        return None, func.id
    if isinstance(func, ast.Attribute):
        value = func.value
        receiver = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else "?"
        return receiver, func.attr
    return None, "?"


def _lookup(table: dict, receiver: str | None, attr: str):
    if (receiver, attr) in table:
        return table[(receiver, attr)]
    return table.get((None, attr))


def _mode(call: ast.Call, position: int) -> str | None:
    """The mode of an ``open``-like call: its constant, "?" when not constant, None when absent."""
    node = next((k.value for k in call.keywords if k.arg == "mode"), None)
    if node is None and len(call.args) > position:
        node = call.args[position]
    if node is None:
        return None
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"


def _writes(mode: str | None) -> bool:
    return mode is not None and (mode == "?" or any(c in mode for c in "wax+"))


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[tuple[int, str, str]] = []
        self.scopes: list[tuple[set[str], set[str]]] = [(set(), set())]  # (lambda parameters, handed names)

    # ---- scopes: a function's parameters, and the names its ``with`` statements bind to handed files
    def _function(self, node) -> None:
        a = node.args
        params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None}
        self.scopes.append((params if isinstance(node, ast.Lambda) else set(), set()))
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            if isinstance(item.context_expr, ast.Call) and _name(item.context_expr.func)[1] in HANDING:
                if isinstance(item.optional_vars, ast.Name):
                    self.scopes[-1][1].add(item.optional_vars.id)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if isinstance(node.value, ast.Call) and _name(node.value.func)[1] in HANDING:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.scopes[-1][1].add(target.id)
        self.generic_visit(node)

    def _handed(self, node: ast.expr | None, write: bool) -> bool:
        if node is None:
            return True  # no file argument: the call does not name one (json.dumps-like use)
        if isinstance(node, ast.Call) and _name(node.func)[1] in HANDING:
            return True
        if not isinstance(node, ast.Name):
            return False
        params, handed = self.scopes[-1]
        return node.id in handed or (write and node.id in params)

    @staticmethod
    def _arg(call: ast.Call, index: int, keywords: tuple[str, ...] = ()) -> ast.expr | None:
        if len(call.args) > index:
            return call.args[index]
        return next((k.value for k in call.keywords if k.arg in keywords), None)

    def visit_Call(self, call: ast.Call) -> None:
        receiver, attr = _name(call.func)
        what = ast.unparse(call.func)
        line = call.lineno
        if isinstance(call.func, ast.Name) and attr in ("save", "write_text", "write_bytes", "read_text", "read_bytes"):
            pass  # the project's own helpers (cli.write_text, paths.read_text) or safetensors' save -> bytes
        elif (receiver, attr) == (None, "open") or (receiver, attr) == ("io", "open"):
            self.found.append((line, "write" if _writes(_mode(call, 1)) else "read", what))
        elif attr == "open" and receiver not in ("Image", "tarfile", "os", "gzip", "bz2", "lzma", "codecs"):
            # Path.open(mode), its first argument a mode string or nothing (an archive's open(name) is not one;
            # tarfile.open and Image.open are judged below)
            mode = _mode(call, 0)
            if mode != "?" and not call.args[1:]:
                self.found.append((line, "write" if _writes(mode) else "read", what))
        elif (receiver, attr) == ("os", "open"):
            flags = ast.unparse(call.args[1]) if len(call.args) > 1 else ""
            if "NOFOLLOW" not in flags:
                self.found.append((line, "write" if "O_W" in flags or "O_RDWR" in flags else "read", what))
        elif isinstance(call.func, ast.Attribute) and (
            attr in PATH_CHANGES or (attr in ("rename", "replace") and len(call.args) == 1 and not call.keywords)
        ):
            # a path's own rename/replace (str.replace takes two arguments), touch, chmod, links
            self.found.append((line, "write", what))
        elif attr in PATH_WRITES and receiver != "cli":
            self.found.append((line, "write", what))
        elif attr in PATH_READS:
            self.found.append((line, "read", what))
        elif (receiver, attr) in MOVES:
            self.found.append((line, "write", what))
        else:
            index = _lookup(WRITE_CALLS, receiver, attr)
            if index is not None and not self._handed(self._arg(call, index, ("f", "file", "fp", "fname")), True):
                self.found.append((line, "write", what))
            index = _lookup(READ_CALLS, receiver, attr)
            if index is not None and not self._handed(
                self._arg(call, index, ("f", "fp", "file", "filename", "name")), False
            ):
                if not (attr == "open" and receiver == "tarfile" and any(k.arg == "fileobj" for k in call.keywords)):
                    self.found.append((line, "read", what))
        self.generic_visit(call)


def raw_io(source: str, filename: str = "<source>") -> list[tuple[int, str, str]]:
    """(line, "read" | "write", the call) of every raw read or write in ``source``."""
    scan = _Scan()
    scan.visit(ast.parse(source, filename=filename))
    return sorted(scan.found)


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def scan_project(kind: str, allowed: dict[tuple[str, str], str], root: Path = REPO) -> list[str]:
    """``path:line: call`` of every raw ``kind`` ("read" or "write") in the project's packages
    that the allowlist (``(path, call) -> why``) does not name; the allowlist's entries that
    matched nothing are reported too, so it never outlives what it excuses."""
    offenders, used = [], set()
    for path in sorted(p for package in PACKAGES for p in (root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for line, found_kind, call in raw_io(path.read_text(encoding="utf-8"), rel):
            if found_kind != kind:
                continue
            if (rel, call) in allowed:
                used.add((rel, call))
                continue
            offenders.append(f"{rel}:{line}: {call}")
    offenders += [f"allowlist entry {key} matches nothing" for key in set(allowed) - used]
    return offenders
