"""The configuration of a run: :class:`TrainConfig` (see :mod:`atoll.config.train`) and how it is built.

``TrainConfig`` is assembled from every strategy's section, so it is built on first use
(``from atoll.config import TrainConfig`` imports the strategies' modules, and torch with them); the
sections (:mod:`atoll.config.section`, :mod:`atoll.config.sections`) and the parsers
(:mod:`atoll.config.parse`) import neither.
"""

from typing import Any

from atoll.config.parse import parse_chaos, parse_resources

_TRAIN = ("RESUMABLE_OVERRIDES", "TrainConfig", "build_config", "load_run_config")

__all__ = [*_TRAIN, "parse_chaos", "parse_resources"]


def __getattr__(name: str) -> Any:
    if name in _TRAIN:
        from atoll.config import train

        return getattr(train, name)
    raise AttributeError(f"module 'atoll.config' has no attribute {name!r}")
