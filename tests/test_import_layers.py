"""No import circles among shardwise's modules, counting imports inside functions and package ``__init__``s.

Every module's imports are read with ``ast`` (nothing is imported): ``import x`` and ``from x import y``,
at the top and inside functions and methods, relative ones resolved, and ``from pkg import name``
counted as an import of the submodule ``pkg.name`` when there is one (else of ``pkg``). Imports under
``if TYPE_CHECKING:`` never run and are not counted.

An import that runs while the module itself is imported (not inside a function) also imports the
packages above its target: ``import a.b.c`` runs ``a/b/__init__.py`` first, and whatever that imports.
Those package edges are counted too (the top package ``shardwise`` excepted: every module is under it,
and the packages holding the importing module itself, which are already being imported). A circle
(``a`` imports ``b`` ... imports ``a``) is printed module by module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Known circles, each listed by its modules; an entry that no longer occurs fails the test (remove it).
ALLOWED: set[frozenset] = set()  # circles known and accepted (none)


def module_files(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` for every module of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (getattr(node.test, "id", None) == "TYPE_CHECKING"
                                         or getattr(node.test, "attr", None) == "TYPE_CHECKING"):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _in_functions(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    return inside


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, with the package ``__init__``s that module-level
    imports run."""
    modules = module_files(root, package)

    def known(name: str | None) -> str | None:  # the module itself, or the package holding the name
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_only(tree)
        deferred = _in_functions(tree)
        here = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            found = set()
            if isinstance(node, ast.Import):
                found.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.add(sub if sub in modules else known(base))
            targets |= found
            if id(node) not in deferred:  # runs at import time: the target's packages run first
                targets |= {p for t in found if t for p in _parents(t, package, modules) if not _holds(p, name)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def _parents(module: str, package: str, modules) -> list[str]:
    """The packages above ``module``, the top package left out."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p in modules and p != package]


def _holds(pkg: str, module: str) -> bool:
    return module == pkg or module.startswith(pkg + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module, as one circle through it (first module repeated at the end)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm (the graph is small: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, g) for g in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def _groups(graph: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected groups of more than one module, as sets."""
    found = []
    for circle in cycles(graph):
        members = set(circle)
        frontier = list(members)
        while frontier:  # the whole group: every module the circle's modules reach and that reaches back
            v = frontier.pop()
            for w in graph[v]:
                if w not in members and _reaches(graph, w, members):
                    members.add(w)
                    frontier.append(w)
        found.append(frozenset(members))
    return found


def _reaches(graph, start, targets) -> bool:
    seen, stack = {start}, [start]
    while stack:
        v = stack.pop()
        for w in graph[v]:
            if w in targets:
                return True
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return False


def test_no_import_circles_in_shardwise():
    graph = import_graph(ROOT, "shardwise")
    found = _groups(graph)
    new = [c for c, g in zip(cycles(graph), found) if g not in ALLOWED]
    assert not new, "import circles:\n" + "\n".join("  " + " -> ".join(c) for c in new)
    stale = [sorted(g) for g in ALLOWED if g not in found]
    assert not stale, f"ALLOWED lists circles that no longer occur (remove them): {stale}"


def test_the_walker_sees_function_local_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")  # function-local, relative
    (pkg / "sub" / "b.py").write_text("from pkg import c\n")  # 'from package import submodule'
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "e.py").write_text("from . import d\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set() and graph["pkg.e"] == {"pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_the_walker_counts_package_inits(tmp_path):
    """``from pkg.sub.m import x`` at the top runs ``pkg/sub/__init__.py``: a circle through it is found; the
    same import inside a function (run later, when every package is loaded) adds no package edge."""
    pkg = tmp_path / "pkg"
    for d in ("u", "z"):
        (pkg / d).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "u" / "__init__.py").write_text("from pkg.u.state import s\n")
    (pkg / "u" / "state.py").write_text("from pkg.z.core import c\n")
    (pkg / "u" / "groups.py").write_text("g = 1\n")
    (pkg / "z" / "__init__.py").write_text("from pkg.z.init import i\n")
    (pkg / "z" / "core.py").write_text("c = 1\n")
    (pkg / "z" / "init.py").write_text("from pkg.u.groups import g\n")
    graph = import_graph(tmp_path, "pkg")
    assert "pkg.u" in graph["pkg.z.init"] and "pkg.z" in graph["pkg.u.state"]
    assert _groups(graph) == [frozenset({"pkg.u", "pkg.u.state", "pkg.z", "pkg.z.init"})]
    (pkg / "z" / "init.py").write_text("def f():\n    from pkg.u.groups import g\n    return g\n")
    assert cycles(import_graph(tmp_path, "pkg")) == []
