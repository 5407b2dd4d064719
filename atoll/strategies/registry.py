"""The strategies atoll knows: one module each, listed once here.

Adding a strategy is one file plus one line: write ``atoll/strategies/<name>.py`` (or a package) with a
module-level ``SPEC = StrategySpec(...)`` (:mod:`atoll.strategies.spec`) and add ``<name>`` to :data:`STRATEGIES`. The
spec carries everything the rest of atoll asks of a strategy: its own config section (flags and TOML keys), the
runtimes it runs under, its checks of a whole config, its defaults for shared settings, the lockstep
strategy class (or none, for an asynchronous one that the runtimes' own event loops drive), its cost in
closed form for ``atoll project``, and its rows of ``atoll bench suite``.

The modules are imported on first use, in list order, so the config and the command line see every
strategy without naming any.
"""

from __future__ import annotations

import importlib
from functools import cache

from atoll.strategies.spec import StrategySpec, SuiteRun

__all__ = ["STRATEGIES", "StrategySpec", "SuiteRun", "spec", "specs"]

#: one line per strategy: its module under atoll.strategies, in the order of --help, tables and plots
STRATEGIES: tuple[str, ...] = ("ddp", "diloco", "streaming", "demo", "sparseloco", "decoupled")


@cache
def specs() -> tuple[StrategySpec, ...]:
    """Every strategy's spec, in :data:`STRATEGIES` order (their modules imported on first call)."""
    return tuple(importlib.import_module(f"atoll.strategies.{name}").SPEC for name in STRATEGIES)


def spec(name: str) -> StrategySpec:
    """The spec of strategy ``name``.

    Raises:
        KeyError: no strategy of that name.
    """
    for s in specs():
        if s.name == name:
            return s
    raise KeyError(name)
