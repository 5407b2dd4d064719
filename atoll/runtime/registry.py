"""The runtimes atoll knows, listed once here.

Adding a runtime is one module plus one line: write a module with its
:class:`~atoll.runtime.base.Runtime` (or its driver of asynchronous strategies), its config (a
:class:`~atoll.config.section.RuntimeConfig` subclass: its settings, hence its flags and TOML keys) and a
module-level ``SPEC = RuntimeSpec(...)`` (:mod:`atoll.runtime.spec`), and add the module's dotted path to
:data:`RUNTIMES`. The built-in runtimes' specs are declared below (their configs are in
:mod:`atoll.config.runtimes`, their code is imported only when a run is built under them), so the config sees
every runtime without importing torch. ``tests/test_runtime_plugin.py`` adds one that way and trains under it.

The runtimes' configs (:func:`configs`: name -> config) and the values ``--runtime`` accepts are derived from
this list; the config reads it on first use (as it reads the strategy registry), not at import.
"""

from __future__ import annotations

import importlib
from functools import cache

from atoll.config.runtimes import CollectiveConfig, LocalConfig, RayConfig, ServiceConfig
from atoll.config.section import RuntimeConfig
from atoll.runtime.spec import RuntimeSpec

__all__ = ["RUNTIMES", "RuntimeSpec", "configs", "names", "spec", "specs"]

LOCAL = RuntimeSpec(
    name="local", summary="every island in one process, run in turn, on a simulated network clock",
    config=LocalConfig, kinds=("lockstep", "asynchronous"), lockstep="atoll.runtime.local:LocalRuntime",
    asynchronous="atoll.runtime.events:train_simulated")
COLLECTIVE = RuntimeSpec(
    name="collective", summary="real processes over torch.distributed (gloo on CPUs, NCCL on GPUs)",
    config=CollectiveConfig, kinds=("lockstep",), lockstep="atoll.runtime.collective:CollectiveRuntime",
    launcher="atoll.runtime.collective:start_job")
RAY = RuntimeSpec(
    name="ray", summary="the syncer and every island as Ray actors on real clocks", config=RayConfig,
    kinds=("asynchronous",), asynchronous="atoll.runtime.ray:train_ray")
SERVICE = RuntimeSpec(
    name="service", summary="the syncer service and island jobs across sites ('atoll syncer', 'atoll island')",
    config=ServiceConfig, kinds=("asynchronous",),
    refusal="runtime: service is run by 'atoll syncer' and 'atoll island' (one job per site, docs/deployment.md), "
            "not atoll train; run those, or pass --runtime local or ray")

_BUILT_IN = {s.name: s for s in (LOCAL, COLLECTIVE, RAY, SERVICE)}

#: one line per runtime, in --help order: a built-in runtime's name, or the dotted path of a module with a
#: ``SPEC`` (a runtime outside atoll)
RUNTIMES: tuple[str, ...] = ("local", "collective", "ray", "service")


def specs() -> tuple[RuntimeSpec, ...]:
    """Every runtime's spec, in :data:`RUNTIMES` order (a plugin's module imported on first call)."""
    return _load(RUNTIMES)


@cache
def _load(entries: tuple[str, ...]) -> tuple[RuntimeSpec, ...]:
    return tuple(_BUILT_IN[e] if e in _BUILT_IN else importlib.import_module(e).SPEC for e in entries)


def names() -> tuple[str, ...]:
    """Every runtime's ``--runtime`` name, in :data:`RUNTIMES` order."""
    return tuple(s.name for s in specs())


def configs() -> dict[str, type[RuntimeConfig]]:
    """Each ``--runtime`` name -> its config, in :data:`RUNTIMES` order."""
    return {s.name: s.config for s in specs()}


def spec(name: str) -> RuntimeSpec:
    """The spec of runtime ``name``.

    Raises:
        KeyError: no runtime of that name.
    """
    for s in specs():
        if s.name == name:
            return s
    raise KeyError(name)
