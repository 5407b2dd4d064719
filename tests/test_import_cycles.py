"""No import cycle between atoll's modules, in ONE graph that sees every import.

The graph holds every import statement a module has, wherever it stands: at module level, under any ``if``
(``TYPE_CHECKING`` included) or ``try``/``except``/``else``/``finally``, ``with`` and class bodies, and inside
function and method bodies (lazy imports: they run, only later), plus the strategy modules the strategy registry
imports by name. A cycle through a lazy or a type-checking import is a cycle all the same: it ties the layers
together and only hides from the interpreter. Relative imports are resolved; ``from a.b import c`` is an edge to
``a.b.c`` when that is a module, else to ``a.b``. A package's ``__init__`` importing its submodule, and a
submodule importing its parent package, are edges like any other.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "atoll"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


@functools.cache
def parsed(path: Path) -> ast.Module:
    """The syntax tree of ``path``, parsed once for every check of the session (test_import_cycles' too)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a list of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``: at module level, in any block, and in function bodies, in line order."""
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return sorted(found, key=lambda n: n.lineno)


def _known(name: str, modules: set[str] | dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is one of ``modules`` (``import a.b.c`` of a name in ``a.b``: ``a.b``)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in modules:
            return ".".join(parts[:k])
    return None


def imports_of(source: str | ast.Module, module: str, is_package: bool,
               modules: set[str] | dict[str, Path]) -> dict[str, int]:
    """The modules among ``modules`` that ``module`` (its ``source``, or its parsed tree) imports anywhere (module
    level, type-checking blocks, function bodies), each with the line of its first import; itself excluded."""
    edges: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            edges.setdefault(target, line)

    tree = ast.parse(source) if isinstance(source, str) else source
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known(alias.name, modules), node.lineno)
            continue
        base = node.module or ""
        if node.level:  # relative: from the package of ``module`` (itself, for a package's __init__), up level-1
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            add(full if alias.name != "*" and full in modules else _known(base, modules), node.lineno)
    return edges


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {an atoll module it imports anywhere: the line of its first such import}, plus the registry's
    edges to the strategy modules it imports by name (line 0). Built once; the checks only read it."""
    from atoll.strategies.registry import STRATEGIES

    modules = _modules()
    graph = {name: imports_of(parsed(path), name, path.name == "__init__.py", modules)
             for name, path in modules.items()}
    for s in STRATEGIES:
        target = s if "." in s else f"atoll.strategies.{s}"
        if target in modules:
            graph["atoll.strategies.registry"].setdefault(target, 0)
    return graph


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """The edges inside ``component``, one a line: ``a -> b (line N)``."""
    inside = set(component)
    return "\n".join(f"  {a} -> {b} (line {graph[a][b]})" for a in component for b in sorted(graph[a]) if b in inside)


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    message = "\n".join(f"cycle of {len(c)} modules:\n{describe(graph, c)}" for c in found)
    assert found == [], message


def test_the_graph_sees_the_packages_imports() -> None:
    graph = import_graph()
    assert "atoll.runtime.collective.launch" in graph["atoll.runtime.collective"]  # __init__ -> its submodule
    assert "atoll.runtime.collective.torch_ddp" in graph["atoll.runtime.collective.report"]  # from pkg import mod
    assert "atoll.runtime.collective" not in graph["atoll.runtime.collective.report"]


def test_resolution() -> None:
    modules = {"p", "p.a", "p.b", "p.sub", "p.sub.c"}
    source = ("from typing import TYPE_CHECKING\nimport os\ntry:\n    from .. import a\nexcept ImportError:\n"
              "    pass\nif TYPE_CHECKING:\n    from .c import Thing\n\n\ndef f():\n    from p import b\n")
    assert imports_of(source, "p.sub", True, modules) == {"p.a": 4, "p.sub.c": 8, "p.b": 12}  # lazy ones too
    assert imports_of("from .. import NAME\nfrom ..b import X\n", "p.sub.c", False, modules) == {"p": 1, "p.b": 2}
    assert imports_of("from p import sub, NAME\nimport p.sub.c\n", "p.a", False, modules) == {"p.sub": 1, "p": 1,
                                                                                             "p.sub.c": 2}
    assert imports_of("from p.sub import *\n", "p.a", False, modules) == {"p.sub": 1}


def test_the_check_finds_a_cycle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert describe(graph, ["a", "b", "c"]) == "  a -> b (line 1)\n  b -> c (line 2)\n  c -> a (line 3)"


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "atoll.strategies.ddp" in graph["atoll.strategies.registry"]  # imported by name
    assert "atoll.training" in graph["atoll"]  # lazy: inside atoll.train()
