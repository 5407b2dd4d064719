"""Which settings a strategy or a runtime reads: a setting the user gave that has no effect is refused.

``atoll train --strategy diloco --fragments 8`` used to train as if ``--fragments`` were not there. Each
setting below is read by some strategies or runtimes only (found by reading where each is used); a setting
the user set explicitly (a flag, a TOML key, an override of :func:`atoll.config.build_config`) under another
one is refused in one line naming it, the strategy or runtime, and the fix. A setting left at its default, or
carried by a resumed run's saved ``config.json``, is never refused. A strategy's own section
(``--demo-topk``...) is read by that strategy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: shared settings read only by some strategies: setting -> the strategies that read it
BY_STRATEGY: dict[str, tuple[str, ...]] = {
    "fragments": ("streaming", "decoupled"),
    # ddp and demo exchange every step: H is the strategies' with outer rounds
    "sync_every": ("diloco", "streaming", "decoupled", "sparseloco"),
    # demo steps with its own optimizer (--demo-lr; no weight decay): the AdamW settings are the others'
    "lr": ("ddp", "diloco", "streaming", "decoupled", "sparseloco"),
    "weight_decay": ("ddp", "diloco", "streaming", "decoupled", "sparseloco"),
    "outer_lr": ("diloco", "streaming", "decoupled", "sparseloco"),  # ddp and demo have no outer optimizer
    "outer_momentum": ("diloco", "streaming", "decoupled", "sparseloco"),
    "outer_adapt": ("diloco",),  # the agreement-weighted outer step (atoll.algorithms.agreement)
    # demo and sparseloco compress in their own way (their own sections), not with the run's codec
    **{name: ("ddp", "diloco", "streaming", "decoupled")
       for name in ("codec", "codec_block_size", "codec_rounding", "topk_fraction", "error_feedback")},
}

#: (setting, strategy) -> what that strategy reads in its place, said in the refusal
INSTEAD: dict[tuple[str, str], str] = {("lr", "demo"): "demo reads --demo-lr instead",
                                       ("weight_decay", "demo"): "demo has no weight decay"}

#: settings read only by some runtimes: setting -> the runtimes that read it
BY_RUNTIME: dict[str, tuple[str, ...]] = {
    **{name: ("collective",) for name in ("ranks_per_island", "shard_island", "min_islands", "max_restarts")},
    "collective_timeout_s": ("collective", "ray"),
    # the simulated network clock; collective and ray runs measure real links
    "link_bandwidth_mbps": ("local",),
    "link_latency_ms": ("local",),
    **{name: ("ray",) for name in ("ray_address", "ray_cpus_per_island", "ray_gpus_per_island",
                                   "ray_island_resources", "ray_logs")},
}


def _own_sections() -> dict[str, tuple[str, ...]]:
    """Each strategy's own settings (its section's fields) -> that strategy."""
    from atoll.strategies.registry import specs

    return {name: (s.name,) for s in specs() if s.section is not None for name in s.section.model_fields}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _which(names: tuple[str, ...], kind: str) -> str:
    return f"--{kind} {'|'.join(names)}"


def unused_setting(strategy: str, runtime: str, given: Iterable[str],
                   files: Mapping[str, str] | None = None) -> str | None:
    """The one-line refusal of the first setting in ``given`` that ``strategy`` under ``runtime`` ignores.

    Args:
        strategy: the run's ``--strategy``.
        runtime: the run's ``--runtime``.
        given: the settings the user set explicitly (flags, TOML keys), not the defaults.
        files: of those, the ones set in a TOML file -> the file's path (the fix names the key in the file).

    Returns:
        None when every given setting is read; else ``"<setting>: the <strategy> strategy does not use it
        (only a, b); drop --<setting> or use --strategy a|b"`` (or the same for a runtime; ``drop '<setting>'
        from <file>`` for a key of a TOML file), with the setting that replaces it where there is one
        (:data:`INSTEAD`).
    """
    by_strategy = {**BY_STRATEGY, **_own_sections()}
    files = files or {}
    for name in given:
        drop = f"drop '{name}' from {files[name]}" if name in files else f"drop {_flag(name)}"
        readers = by_strategy.get(name)
        if readers is not None and strategy not in readers:
            instead = INSTEAD.get((name, strategy))
            return (f"{name}: the {strategy} strategy does not use it (only {', '.join(readers)}"
                    f"{'; ' + instead if instead else ''}); {drop} or use {_which(readers, 'strategy')}")
        readers = BY_RUNTIME.get(name)
        if readers is not None and runtime not in readers:
            return (f"{name}: the {runtime} runtime does not use it (only {', '.join(readers)}); {drop} or use "
                    f"{_which(readers, 'runtime')}")
    return None


def applicable(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` without those its strategy and runtime do not read (for the benchmarks' shared settings,
    e.g. one outer momentum pinned for a suite of ddp and diloco runs; the trained numbers are the same)."""
    from atoll.config.sections import RunSection

    strategy = settings.get("strategy", RunSection.model_fields["strategy"].default)
    runtime = settings.get("runtime", RunSection.model_fields["runtime"].default)
    by_strategy = {**BY_STRATEGY, **_own_sections()}
    return {k: v for k, v in settings.items()
            if strategy in by_strategy.get(k, (strategy,)) and runtime in BY_RUNTIME.get(k, (runtime,))}
