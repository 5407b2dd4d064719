"""``ddp``: the data-parallel baseline. Gradients are averaged across islands at every inner step.

The maths is that of one model trained with K times the batch: the mean of the islands' mean-loss
gradients is the gradient of the mean loss over all K batches. Every island applies the same averaged
gradient with identically initialised AdamW states, so the replicas stay identical.
"""

from __future__ import annotations

from typing import Any

import torch

from atoll.config import TrainConfig
from atoll.island import Island
from atoll.runtime.comm import Comm
from atoll.strategies.base import Strategy, Wire


class DDP(Strategy):
    """Ring all-reduce of the full gradient every inner step (float32, or as ``--codec`` encodes it)."""

    name = "ddp"
    per_island_state = ("wire.feedback", "wire.generators")

    def __init__(self, config: TrainConfig, islands: list[Island], comm: Comm) -> None:
        super().__init__(config, islands, comm)
        self.wire = Wire(config, comm.local_islands)

    def step(self, step: int) -> None:
        grads = [island.flat_grads() for island in self.islands]
        mean = self.comm.all_reduce_mean(grads, weights=[1.0] * len(grads), **self.wire.kwargs("grad"))
        for island in self.islands:
            island.set_flat_grads(mean)
            island.inner_step()

    def global_params(self) -> torch.Tensor:
        return self.islands[0].flat_params()

    def state_dict(self) -> dict[str, Any]:
        return {"wire": self.wire.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wire.load_state_dict(state["wire"])
