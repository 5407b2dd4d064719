"""The configuration of a run: :class:`TrainConfig` (see :mod:`atoll.config.train`) and how it is built.

``TrainConfig`` holds the run's settings and the chosen strategy's and runtime's configs; importing it
imports neither torch nor a strategy (the registry is read when a config is built, and imports the chosen
strategies' modules then). Loaded on first use, so the parsers (:mod:`atoll.config.parse`) stay light.
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
