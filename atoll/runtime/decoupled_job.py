"""The decoupled strategy's pieces from a run's whole settings: where its drivers turn the run's config into what
the strategy's components take (their own config, the run's facts, the islands' settings).

The drivers of the decoupled strategy are entry points of their processes: the ``local`` runtime's event
simulation (:mod:`atoll.runtime.events`), the Ray actors (:mod:`atoll.runtime.ray`), ``atoll syncer`` and
``atoll island`` (:mod:`atoll.runtime.service`). Each holds the run's config (from ``atoll train``, from JSON at
a process boundary, or from the command line) and builds the strategy's components here, so that
:class:`~atoll.strategies.decoupled.island.Job`, :class:`~atoll.strategies.decoupled.island.IslandWorker` and
the :class:`~atoll.strategies.decoupled.syncer.Syncer` never see the whole run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atoll.config.facts import IslandSettings, RunFacts
from atoll.config.runtimes import TimeoutSection
from atoll.strategies.decoupled import DecoupledConfig, local_sync_every, make_syncer
from atoll.strategies.decoupled.island import Job, expected_steps
from atoll.strategies.decoupled.syncer import Syncer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from atoll.algorithms.fragments import FlatFragment
    from atoll.config.train import TrainConfig
    from atoll.job.data import PreparedData


def own(config: TrainConfig) -> DecoupledConfig:
    """The decoupled strategy's config of a run's ``config``.

    Raises:
        TypeError: the run is not a decoupled run.
    """
    strategy = config.strategy_config
    if not isinstance(strategy, DecoupledConfig):
        raise TypeError(f"a {config.strategy} run has no decoupled config ({type(strategy).__name__})")
    return strategy


def job_of(config: TrainConfig, data: PreparedData, model: PreTrainedModel) -> Job:
    """The run's job of its prepared ``data`` and initial ``model`` (:meth:`Job.of
    <atoll.strategies.decoupled.island.Job.of>`).

    Raises:
        ConfigError: the model has fewer layers than ``fragments``.
    """
    return Job.of(own(config), RunFacts.of(config), IslandSettings.of(config), data, model)


def prepare_job(config: TrainConfig) -> Job:
    """The job prepared from the settings alone (a Ray actor's, the syncer service's: the same data and model as
    the islands'; notes were said by whoever started the run)."""
    from atoll.job.run import prepare_inputs

    data, model = prepare_inputs(config, notes=False)
    return job_of(config, data, model)


def island_steps(config: TrainConfig) -> list[int]:
    """Each island's expected inner steps: its share of the ``islands x steps`` budget by speed."""
    return expected_steps(own(config), config.islands, config.steps)


def push_sync_every(config: TrainConfig) -> list[int]:
    """Each island's own H (:func:`~atoll.strategies.decoupled.local_sync_every`)."""
    return local_sync_every(own(config), config.islands)


def syncer_of(config: TrainConfig, init: torch.Tensor, index: list[FlatFragment],
              credentials: list[str] | None = None) -> Syncer:
    """The run's syncer (:func:`~atoll.strategies.decoupled.make_syncer`) over ``init`` (float32 (numel,)) cut
    into ``index``; a first round is bounded by the runtime's deadline (``collective_timeout_s``; none on the
    ``local`` runtime's simulated clock)."""
    runtime = config.runtime_config
    timeout = runtime.collective_timeout_s if isinstance(runtime, TimeoutSection) else None
    return make_syncer(own(config), RunFacts.of(config), init, index, credentials, timeout_s=timeout)
