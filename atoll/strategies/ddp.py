"""``ddp``: the data-parallel baseline. Gradients are averaged across islands at every inner step.

The maths is that of one model trained with K times the batch: the mean of the islands' mean-loss
gradients is the gradient of the mean loss over all K batches. Every island applies the same averaged
gradient with identically initialised AdamW states, so the replicas stay identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from atoll.analysis.cost import Cost, Setting
from atoll.runtime.network import ring_allreduce_bytes
from atoll.strategies.base import Strategy, make_wire
from atoll.strategies.spec import StrategySpec, SuiteRun

if TYPE_CHECKING:
    from atoll.config import TrainConfig
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm


class DDP(Strategy):
    """Ring all-reduce of the full gradient every inner step (float32, or as ``--codec`` encodes it)."""

    name = "ddp"

    def __init__(self, config: TrainConfig, islands: list[Island], comm: Comm) -> None:
        super().__init__(config, islands, comm)
        self.wire = make_wire(config, comm.local_islands)

    def step(self, step: int) -> None:
        grads = [island.flat_grads() for island in self.islands]
        mean = self.comm.all_reduce_mean(grads, weights=[1.0] * len(grads), wire=self.wire, key="grad")
        for island in self.islands:
            island.set_flat_grads(mean)
            island.inner_step()

    def global_params(self) -> torch.Tensor:
        return self.islands[0].flat_params()

    def island_state(self, position: int) -> dict[str, Any]:
        return {"wire": self.wire.island_state(position)}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:
        self.wire.load_island_state(position, state["wire"])


def project(s: Setting) -> Cost:
    """ddp's cost per inner step: a ring all-reduce of the fp32 gradient every step, not overlapped with the
    backward pass (as the simulated clock prices it)::

        bytes = 2(K-1)/K * 4N;  step = t_c + bytes*8/B + 2(K-1)L
    """
    x = ring_allreduce_bytes(4 * s.params, s.islands)
    t = x * 8 / s.bandwidth_bps + 2 * (s.islands - 1) * s.latency_s if s.islands > 1 else 0.0
    return Cost(s.step_compute_s + t, x, t)


SPEC = StrategySpec(
    name="ddp", summary="full gradients, ring all-reduce, every inner step (the data-parallel baseline)",
    runtimes=("local", "collective"), lockstep=DDP, project=project, shards=True,
    suite=(SuiteRun("one_island", "one island alone (ddp, K=1)", {"strategy": "ddp", "islands": 1}),
           SuiteRun("ddp", "ddp", {"strategy": "ddp"})),
)
