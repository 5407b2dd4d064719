"""No import cycle between atoll's modules at module level, ``if TYPE_CHECKING:`` imports included.

The graph here is what a module names at module level: plain imports, those under any ``if`` (``TYPE_CHECKING``
included) or ``try``/``except``/``else``/``finally``, ``with`` and class bodies; not those in function or method
bodies (lazy: :mod:`tests.test_layout` checks those with the rest of the running imports). Relative imports are
resolved; ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``. A package's
``__init__`` importing its submodule, and a submodule importing its parent package, are edges like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layout import _modules, cycles, parsed  # one cycle finder (Tarjan), one parse, for both checks

ROOT = Path(__file__).resolve().parents[1] / "atoll"


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements run when the module is imported or type-checked: ``body``'s own, and those nested
    in its ``if``/``try``/``with``/class blocks, never inside a function."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.ClassDef):
            found += _module_level_imports(node.body)
        elif isinstance(node, ast.If):
            found += _module_level_imports(node.body) + _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            # (ast.TryStar is Python 3.11+: its blocks read by name, as a Try's)
            blocks = [getattr(node, name, []) for name in ("body", "orelse", "finalbody")]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                found += _module_level_imports(block)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            found += _module_level_imports(node.body)
    return found


def _known(name: str, modules: set[str] | dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is one of ``modules`` (``import a.b.c`` of a name in ``a.b``: ``a.b``)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in modules:
            return ".".join(parts[:k])
    return None


def imports_of(source: str | ast.Module, module: str, is_package: bool,
               modules: set[str] | dict[str, Path]) -> dict[str, int]:
    """The modules among ``modules`` that ``module`` (its ``source``, or its parsed tree) imports at module
    level, each with the line of its first import there; itself excluded."""
    edges: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            edges.setdefault(target, line)

    tree = ast.parse(source) if isinstance(source, str) else source
    for node in _module_level_imports(tree.body):
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


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {an atoll module it imports at module level: the line of that import}."""
    modules = _modules()
    return {name: imports_of(parsed(path), name, path.name == "__init__.py", modules) for name, path in modules.items()}


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """The edges inside ``component``, one a line: ``a -> b (line N)``."""
    inside = set(component)
    return "\n".join(f"  {a} -> {b} (line {graph[a][b]})" for a in component for b in sorted(graph[a]) if b in inside)


def test_no_import_cycles_type_checking_included() -> None:
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
    assert imports_of(source, "p.sub", True, modules) == {"p.a": 4, "p.sub.c": 8}
    assert imports_of("from .. import NAME\nfrom ..b import X\n", "p.sub.c", False, modules) == {"p": 1, "p.b": 2}
    assert imports_of("from p import sub, NAME\nimport p.sub.c\n", "p.a", False, modules) == {"p.sub": 1, "p": 1,
                                                                                             "p.sub.c": 2}
    assert imports_of("from p.sub import *\n", "p.a", False, modules) == {"p.sub": 1}


def test_the_check_finds_a_cycle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert describe(graph, ["a", "b", "c"]) == "  a -> b (line 1)\n  b -> c (line 2)\n  c -> a (line 3)"
