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


class Wire:
    """The codec a strategy's exchanges use, with each local island's error feedback and random source.

    ``codec == "fp32"`` without error feedback sends tensors as they are (no encode/decode round trip).
    Random sources for stochastic rounding are seeded by (seed, island) and saved in checkpoints, so a
    resumed run rounds exactly as an uninterrupted one.
    """

    def __init__(self, config: TrainConfig, local_islands: list[int]) -> None:
        from atoll.algorithms.codecs import ErrorFeedback, make_codec

        lossy = config.codec != "fp32"
        self.codec = make_codec(config.codec, block_size=config.codec_block_size, rounding=config.codec_rounding,
                                topk_fraction=config.topk_fraction) if lossy else None
        self.feedback = ([ErrorFeedback(self.codec) for _ in local_islands]
                         if lossy and config.error_feedback else None)
        self.generators = None
        if lossy and config.codec_rounding == "stochastic":
            self.generators = [torch.Generator().manual_seed(config.seed * 1_000_003 + i) for i in local_islands]

    def kwargs(self, key: str) -> dict[str, Any]:
        """Keyword arguments of ``Comm.all_reduce_mean`` for the tensor named ``key``."""
        return {"codec": self.codec, "feedback": self.feedback, "key": key, "generators": self.generators}

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": [f.state_dict() for f in self.feedback] if self.feedback else [],
                "generators": [g.get_state() for g in self.generators] if self.generators else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f, s in zip(self.feedback or [], state["feedback"], strict=False):
            f.load_state_dict(s)
        for g, s in zip(self.generators or [], state["generators"], strict=False):
            g.set_state(s)
