"""The strategies atoll knows: one module each, listed once here.

Adding a strategy is one file plus one line: write ``atoll/strategies/<name>.py`` (or a package) with a
module-level ``SPEC = StrategySpec(...)`` (:mod:`atoll.strategies.spec`) and add ``<name>`` to :data:`STRATEGIES`
(a module outside atoll: its dotted path). The spec carries everything the rest of atoll asks of a strategy:
its config (:class:`~atoll.config.section.StrategyConfig`: the shared sections it reads and its own settings,
hence its flags and TOML keys), the runtimes it runs under, its checks of a whole config, its defaults for the
settings of every run, the lockstep strategy class (or none, for an asynchronous one that the runtimes' own
event loops drive), its cost in closed form for ``atoll project``, and its rows of ``atoll bench suite``.
``tests/test_strategy_plugin.py`` adds one that way and trains it.

The modules are imported on first use, in list order, so the config and the command line see every
strategy without naming any.
"""

from __future__ import annotations

import importlib
from functools import cache

from atoll.strategies.spec import StrategySpec, SuiteRun

__all__ = ["STRATEGIES", "StrategySpec", "SuiteRun", "spec", "specs"]

#: one line per strategy: its module under atoll.strategies (or a dotted module path), in the order of --help,
#: tables and plots
STRATEGIES: tuple[str, ...] = ("ddp", "diloco", "streaming", "demo", "sparseloco", "decoupled")


def specs() -> tuple[StrategySpec, ...]:
    """Every strategy's spec, in :data:`STRATEGIES` order (their modules imported on first call)."""
    return _load(STRATEGIES)


@cache
def _load(modules: tuple[str, ...]) -> tuple[StrategySpec, ...]:
    return tuple(importlib.import_module(m if "." in m else f"atoll.strategies.{m}").SPEC for m in modules)


def names() -> tuple[str, ...]:
    """Every strategy's ``--strategy`` name, in :data:`STRATEGIES` order."""
    return tuple(s.name for s in specs())


def spec(name: str) -> StrategySpec:
    """The spec of strategy ``name``.

    Raises:
        KeyError: no strategy of that name.
    """
    for s in specs():
        if s.name == name:
            return s
    raise KeyError(name)
