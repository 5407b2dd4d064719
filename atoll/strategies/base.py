"""The interface every strategy implements, so the training loop never sees which one runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from atoll.config import TrainConfig
from atoll.island import Island
from atoll.runtime.comm import Comm


class Strategy(ABC):
    """What islands exchange and when.

    The loop calls :meth:`step` once per inner step, after every local island has run its forward and
    backward pass, and :meth:`finish` once at the end. The strategy takes the inner optimizer steps and
    issues the collectives through ``comm``.

    Args:
        config: the run's configuration.
        islands: the islands this process runs (all of them in the ``local`` runtime).
        comm: the collectives across every island of the job.
    """

    name: str

    def __init__(self, config: TrainConfig, islands: list[Island], comm: Comm) -> None:
        self.config = config
        self.islands = islands
        self.comm = comm

    @abstractmethod
    def step(self, step: int) -> None:
        """Finish inner step ``step`` (0-based) on every local island: exchange, then optimizer steps."""

    def finish(self, steps_done: int) -> None:  # noqa: B027 - optional hook
        """Bring the global model up to date at the end of training (e.g. a last outer step)."""

    @abstractmethod
    def global_params(self) -> torch.Tensor:
        """The global model's parameters, a flat float32 CPU vector in ``model.parameters()`` order."""

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state (outer optimizers, error-feedback residuals...), for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore :meth:`state_dict`."""
