"""atoll: train language models across islands of compute joined by slow links.

    from atoll import TrainConfig, train
    summary = train(TrainConfig(strategy="diloco", islands=4, sync_every=50, steps=600))
"""

from typing import Any

from atoll.errors import AtollError, CheckpointError, ConfigError, DataError

__all__ = ["TrainConfig", "build_config", "train", "AtollError", "ConfigError", "DataError", "CheckpointError"]
__version__ = "0.1.0"


def train(config: Any, resume: bool = False) -> dict:
    """Run one training job; see :func:`atoll.training.train`."""
    from atoll.training import train as _train

    return _train(config, resume=resume)


def __getattr__(name: str) -> Any:  # the config is assembled from every strategy (and imports torch): on use
    if name in ("TrainConfig", "build_config"):
        import atoll.config

        return getattr(atoll.config, name)
    raise AttributeError(f"module 'atoll' has no attribute {name!r}")
