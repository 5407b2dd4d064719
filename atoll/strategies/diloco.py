"""``diloco``: H inner AdamW steps per island, then an outer Nesterov step on averaged pseudo-gradients.

DiLoCo, Douillard et al. 2023, arXiv:2311.08105, Algorithm 1. Every ``sync_every`` (H) inner steps, each
island sends Δ_i = θ_global − θ_i; the islands all-reduce the token-weighted mean Δ; the outer optimizer
(SGD, Nesterov momentum, lr 0.7, momentum 0.9 by default) updates the global parameters, held on the CPU;
every island restarts from them. Communication drops by a factor H against ``ddp``.
"""

from __future__ import annotations

from typing import Any

import torch

from atoll.algorithms.outer import OuterOptimizer, pseudo_gradient
from atoll.config import TrainConfig
from atoll.island import Island
from atoll.runtime.comm import Comm
from atoll.strategies.base import Strategy, Wire, drop_non_finite


class DiLoCo(Strategy):
    """Synchronous DiLoCo with one outer optimizer over all parameters."""

    name = "diloco"
    per_island_state = ("tokens_at_sync", "wire.feedback", "wire.generators")

    def __init__(self, config: TrainConfig, islands: list[Island], comm: Comm) -> None:
        super().__init__(config, islands, comm)
        self.outer = OuterOptimizer(islands[0].flat_params(), config.outer_lr, config.outer_momentum)
        self.tokens_at_sync = [island.tokens for island in islands]
        self.last_sync_step = 0
        self.wire = Wire(config, comm.local_islands)
        self.dropped_updates = 0

    def step(self, step: int) -> None:
        for island in self.islands:
            island.inner_step()
        if (step + 1) % self.config.sync_every == 0:
            self.outer_step(step + 1)

    def outer_step(self, steps_done: int) -> None:
        """Average the islands' pseudo-gradients (weighted by tokens since the last sync) and step."""
        deltas = [pseudo_gradient(self.outer.params, island.flat_params()) for island in self.islands]
        weights = [island.tokens - t0 for island, t0 in zip(self.islands, self.tokens_at_sync, strict=True)]
        deltas, weights, dropped = drop_non_finite(deltas, weights)
        self.dropped_updates += sum(dropped)
        if sum(weights) > 0:
            new_global = self.outer.step(self.comm.all_reduce_mean(deltas, weights=weights, **self.wire.kwargs("all")))
        else:  # nothing usable arrived: keep the global model, restart every island from it
            new_global = self.outer.params.detach()
        for island in self.islands:
            island.set_flat_params(new_global)
        self.tokens_at_sync = [island.tokens for island in self.islands]
        self.last_sync_step = steps_done

    def finish(self, steps_done: int) -> None:
        if self.last_sync_step != steps_done:
            self.outer_step(steps_done)

    def global_params(self) -> torch.Tensor:
        return self.outer.params.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.state_dict(), "tokens_at_sync": list(self.tokens_at_sync),
                "last_sync_step": self.last_sync_step, "wire": self.wire.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["outer"])
        self.tokens_at_sync = [int(t) for t in state["tokens_at_sync"]]
        self.last_sync_step = int(state["last_sync_step"])
        self.wire.load_state_dict(state["wire"])
