"""atoll: train language models across islands of compute joined by slow links.

    from atoll import TrainConfig, train
    summary = train(TrainConfig(strategy="diloco", islands=4, sync_every=50, steps=600))
"""

from atoll.config import TrainConfig, build_config
from atoll.errors import AtollError, CheckpointError, ConfigError, DataError


def train(config: TrainConfig, resume: bool = False) -> dict:
    """Run one training job; see :func:`atoll.train.train`."""
    from atoll.train import train as _train

    return _train(config, resume=resume)


__all__ = ["TrainConfig", "build_config", "train", "AtollError", "ConfigError", "DataError", "CheckpointError"]
__version__ = "0.1.0"
