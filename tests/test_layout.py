"""The package's layout: each module one concept, named in its docstring; the layers' directions.

A module is placed by its reason to change, not by a line count: its docstring's first line names that one
concept (what would make someone edit this file), and docs/architecture.md's Layout lists every module under its
layer. Size stays a signal, not a rule: a module over :data:`SIZE_SIGNAL` lines draws a warning (in pytest's
summary) asking whether it holds two concepts, unless :data:`LARGE_BY_DESIGN` names it with the reason it is one.
Import cycles are checked in one graph that sees every import: :mod:`tests.test_import_cycles`.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

from test_import_cycles import ROOT, _modules, import_graph, parsed

#: lines above which a module draws a warning (a signal to look for a second concept, never a failure)
SIZE_SIGNAL = 500
#: modules known to be long for one concept, each with why it stays whole
LARGE_BY_DESIGN: dict[str, str] = {}
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def test_every_module_names_its_one_concept() -> None:
    """Each module's docstring opens with a line that says what it is (its one reason to change)."""
    missing = []
    for name, path in sorted(_modules().items()):
        doc = ast.get_docstring(parsed(path))
        if path.name == "__init__.py" and not path.read_text(encoding="utf-8").strip():
            continue  # an empty package marker holds no code
        if not doc or not doc.splitlines()[0].strip():
            missing.append(name)
    assert missing == [], f"modules without a first docstring line naming their concept: {missing}"


def test_architecture_lists_every_module() -> None:
    """docs/architecture.md's Layout places every module (by its file name) under its folder."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    absent = sorted(name for name, path in _modules().items()
                    if path.name != "__init__.py" and path.stem not in text)
    assert absent == [], f"docs/architecture.md's Layout does not place: {absent}"


def test_size_is_a_signal() -> None:
    """Long modules warn (never fail), except those named with a reason in :data:`LARGE_BY_DESIGN`."""
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > SIZE_SIGNAL and name not in LARGE_BY_DESIGN}
    for name, n in sorted(long.items()):
        warnings.warn(f"{name} has {n} lines (> {SIZE_SIGNAL}): does it hold two concepts? Split it by reason to "
                      "change, or name it in tests/test_layout.py's LARGE_BY_DESIGN with why it is one", stacklevel=1)
    assert all(reason.strip() for reason in LARGE_BY_DESIGN.values())


def test_runtimes_do_not_import_the_training_loop() -> None:
    graph = import_graph()
    for module in graph:
        if module.startswith("atoll.runtime"):
            assert "atoll.training" not in graph[module], module


def test_pure_maths_imports_no_job_runtime_or_strategy() -> None:
    """Layer 1 (atoll.algorithms: tensor maths) stands on nothing above it."""
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("atoll.algorithms"):
            above = [t for t in targets if t.startswith(("atoll.job", "atoll.runtime", "atoll.strategies",
                                                         "atoll.config", "atoll.training", "atoll.cli"))]
            assert above == [], f"{module} imports {above}"


def test_config_imports_no_torch_at_module_level() -> None:
    """The config package stays torch-free when imported (the CLI's --help and the launcher read it)."""
    for name, path in _modules().items():
        if not name.startswith("atoll.config"):
            continue
        tree = parsed(path)
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m == "torch" or m.startswith("torch.")], name


_ = Path  # (type hints only)
