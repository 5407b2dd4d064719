"""What a strategy declares about itself (:class:`StrategySpec`), in its module's ``SPEC``; read by the
registry (:mod:`atoll.strategies.registry`), the config, the training loop, the projection and the suite."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from atoll.config.section import RunSettings, StrategyConfig

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from atoll.analysis.cost import Cost, Setting
    from atoll.strategies.base import Strategy


@dataclass(frozen=True)
class SuiteRun:
    """One row of ``atoll bench suite``: a run name, its label (formatted with the run's settings) and the
    settings on top of the suite's base (``standard_chaos``: train under the standard failure trace)."""

    name: str
    label: str
    settings: Mapping[str, Any]


@dataclass(frozen=True)
class StrategySpec:
    """What atoll needs to know of one strategy.

    Attributes:
        name: the ``--strategy`` value.
        summary: one line for ``--help`` and the strategy tables of README.md and docs/concepts.md.
        config: the strategy's config (a :class:`~atoll.config.section.StrategyConfig` subclass): the shared
            sections it reads and its own settings, each a flag and a TOML key; a setting of another strategy's
            config that this one does not have is refused under it (:func:`atoll.config.applies.unused_setting`).
            The strategy is built from it (``lockstep(config, islands, comm, seed)``).
        runtimes: the runtimes it runs under; the first is the default one for it.
        validate: checks of a whole config once its values are known; raises ValueError with a one-line
            message naming the field and the fix.
        defaults: values of settings every run reads (not its config's: those have their own defaults) for this
            strategy when the user gives none (e.g. demo's constant learning rate after warmup).
        lockstep: the :class:`~atoll.strategies.base.Strategy` the lockstep loop (``atoll.training``) runs, built
            as ``lockstep(config.strategy_config, islands, comm, config.seed)``;
            None for an asynchronous strategy, which the ``local`` runtime's event simulation
            (:mod:`atoll.runtime.events`) and the ``ray`` runtime drive instead.
        inner_optimizer: ``(param_groups, strategy config) -> torch.optim.Optimizer`` for an island's inner steps;
            None: AdamW (:func:`atoll.job.island.adamw`).
        project: the steady-state cost per inner step of one island, ``project(strategy config, setting)``: its
            own config (H, fragments, codec...) in a :class:`~atoll.analysis.cost.Setting` (the facts of the
            run: model, compute, islands, links; :func:`atoll.analysis.projection.project`).
        suite: its rows of ``atoll bench suite``.
        syncs_per_h: the H of its exchanges for the synchronous failure accounting (``True``: every
            ``sync_every`` steps; ``False``: every step).
        shards: it runs on sharded islands (``shard_island``): its exchanges and state are per flat
            position, so they work on each rank's shard of the flat parameter vector.
    """

    name: str
    summary: str
    config: type[StrategyConfig] = StrategyConfig
    runtimes: tuple[str, ...] = ("local", "collective")
    validate: Callable[[Any, RunSettings], None] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    lockstep: Callable[..., Strategy] | None = None
    inner_optimizer: Callable[[list[dict[str, Any]], Any], Optimizer] | None = None
    project: Callable[[Any, Setting], Cost] | None = None
    suite: tuple[SuiteRun, ...] = ()
    syncs_per_h: bool = False
    shards: bool = False
