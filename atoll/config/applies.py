"""Which settings a strategy or a runtime reads, derived from their configs: a setting given that has no effect
is refused.

Every setting is either read by every run (a field of :class:`~atoll.config.train.TrainConfig`'s own sections,
:data:`atoll.config.sections.RUN_SECTIONS`) or owned: a field of some strategies' configs
(:class:`~atoll.config.section.StrategyConfig`, each in its strategy's module) or of some runtimes' configs
(:func:`atoll.runtime.registry.configs`). There is no table to keep: ``sync_every`` is read by the strategies
whose config has it. A setting the user set explicitly (a flag, a TOML key, an override of
:func:`atoll.config.build_config`, a keyword of ``TrainConfig(...)``) that the chosen strategy or runtime does
not own is refused in one line naming it, who reads it, and the fix; a resumed run's saved ``config.json`` and
a benchmark's shared settings (the ``base`` of :func:`~atoll.config.train.build_config`) are filtered
(:func:`applicable`) instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from pydantic.fields import FieldInfo

from atoll.config.runtimes import SERVICE_COMMANDS_ONLY, service_command
from atoll.config.sections import RUN_SECTIONS, SHARED_SECTIONS


@cache
def run_settings() -> frozenset[str]:
    """The settings every run reads (``strategy``, ``islands``, ``steps``, ``model``, ``lr`` schedule...)."""
    return frozenset(name for section in RUN_SECTIONS for name in section.model_fields)


def strategy_readers(name: str) -> tuple[str, ...]:
    """The strategies whose config has setting ``name`` (in registry order; empty: no strategy owns it)."""
    from atoll.strategies.registry import STRATEGIES

    return _readers(STRATEGIES, name)


@cache
def _readers(strategies: tuple[str, ...], name: str) -> tuple[str, ...]:
    from atoll.strategies.registry import specs

    return tuple(s.name for s in specs() if name in s.config.model_fields)


def runtime_readers(name: str) -> tuple[str, ...]:
    """The runtimes whose config has setting ``name`` (in registry order; empty: no runtime owns it)."""
    from atoll.runtime.registry import configs

    return tuple(r for r, config in configs().items() if name in config.model_fields)


def catalog() -> dict[str, FieldInfo]:
    """Every setting atoll knows -> its field (description, type, default), in ``--help`` order: the run's,
    the shared sections', each strategy's own, the runtimes'. A shared setting's field is its section's (a
    strategy may change its default for itself: :func:`strategy_defaults`)."""
    from atoll.runtime.registry import RUNTIMES as runtimes
    from atoll.strategies.registry import STRATEGIES

    return _catalog(STRATEGIES, runtimes)


@cache
def _catalog(strategies: tuple[str, ...], runtimes: tuple[str, ...]) -> dict[str, FieldInfo]:
    from atoll.runtime.registry import configs
    from atoll.strategies.registry import specs

    run, model, device, data, schedule, output = RUN_SECTIONS
    runtime = configs()
    sync, *shared = SHARED_SECTIONS
    built_in = ("collective", "ray", "local", "service")
    others = [config for name, config in runtime.items() if name not in built_in]  # registered beyond atoll's
    out: dict[str, FieldInfo] = {}
    for section in (run, sync, runtime["collective"], model, device, data, schedule, *shared,
                    *(s.config for s in specs()), runtime["ray"], runtime["local"], runtime["service"], *others,
                    output):
        out.update({k: v for k, v in section.model_fields.items() if k not in out})
    for name in SERVICE_COMMANDS_ONLY:  # atoll syncer's and atoll island's own: not settings of atoll train
        del out[name]
    return out


def strategy_defaults(name: str) -> dict[str, Any]:
    """Strategy -> its default for setting ``name`` where it differs from the catalog's (streaming's int4
    codec; demo's constant rate after warmup, its spec's ``defaults``)."""
    from atoll.strategies.registry import specs

    base = catalog()[name].get_default(call_default_factory=True)
    out: dict[str, Any] = {}
    for s in specs():
        field = s.config.model_fields.get(name)
        own = s.defaults.get(name, field.get_default(call_default_factory=True) if field is not None else base)
        if own != base:
            out[s.name] = own
    return out


def _flag(name: str, value: Any = None) -> str:
    """The flag of setting ``name`` as typed: ``--no-<name>`` for a switch turned off (``value`` False)."""
    return ("--no-" if value is False else "--") + name.replace("_", "-")


def _which(names: tuple[str, ...], kind: str) -> str:
    return f"--{kind} {'|'.join(names)}"


def unused_setting(strategy: str, runtime: str, given: Iterable[str],
                   files: Mapping[str, str] | None = None, values: Mapping[str, Any] | None = None) -> str | None:
    """The one-line refusal of the first setting in ``given`` that ``strategy`` under ``runtime`` ignores.

    Args:
        strategy: the run's ``--strategy``.
        runtime: the run's ``--runtime``.
        given: the settings the user set explicitly (flags, TOML keys), not the defaults.
        files: of those, the ones set in a TOML file -> the file's path (the fix names the key in the file).
        values: the settings' values, so the fix names a switch turned off as typed (``--no-<setting>``).

    Returns:
        None when every given setting is read (or is not a setting at all: the validation names those); else
        ``"<setting>: the <strategy> strategy does not use it (only a, b); drop --<setting> or use --strategy
        a|b"`` (or the same for a runtime; ``drop '<setting>' from <file>`` for a key of a TOML file), with what
        the strategy reads in its place where its config says (:attr:`StrategyConfig.instead`).
    """
    from atoll.strategies.registry import names, spec

    files = files or {}
    shared = run_settings()
    for name in given:
        if name in shared:
            continue
        drop = f"drop '{name}' from {files[name]}" if name in files else f"drop {_flag(name, (values or {}).get(name))}"
        readers = strategy_readers(name)
        if readers and strategy not in readers:
            instead = spec(strategy).config.instead.get(name) if strategy in names() else None
            return (f"{name}: the {strategy} strategy does not use it (only {', '.join(readers)}"
                    f"{'; ' + instead if instead else ''}); {drop} or use {_which(readers, 'strategy')}")
        readers = runtime_readers(name)
        if readers and runtime not in readers:  # (the service runtime is atoll island's, not atoll train's)
            named = ", ".join(f"service: {service_command(name)}" if r == "service" else r for r in readers)
            trained = tuple(r for r in readers if r != "service")
            return (f"{name}: the {runtime} runtime does not use it (only {named}); {drop}"
                    + (f" or use {_which(trained, 'runtime')}" if trained and runtime != "service" else ""))
    return None


def applicable(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` (flat) without those its strategy and runtime do not read (a resumed run's saved settings;
    a benchmark's shared settings, e.g. one outer momentum pinned for a suite of ddp and diloco runs)."""
    from atoll.config.sections import RunSection

    strategy = settings.get("strategy", RunSection.model_fields["strategy"].default)
    runtime = settings.get("runtime", RunSection.model_fields["runtime"].default)
    shared = run_settings()
    return {k: v for k, v in settings.items() if k in shared or (
        strategy in (strategy_readers(k) or (strategy,)) and runtime in (runtime_readers(k) or (runtime,)))}
