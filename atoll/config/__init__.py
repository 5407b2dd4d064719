"""The configuration of a run: :class:`TrainConfig` (see :mod:`atoll.config.train`) and how it is built."""

from atoll.config.parse import parse_chaos, parse_resources
from atoll.config.train import RESUMABLE_OVERRIDES, TrainConfig, build_config, load_run_config

__all__ = ["RESUMABLE_OVERRIDES", "TrainConfig", "build_config", "load_run_config", "parse_chaos", "parse_resources"]
