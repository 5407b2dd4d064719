"""``ddp``: the data-parallel baseline. Gradients are averaged across islands at every inner step.

The maths is that of one model trained with K times the batch: the mean of the islands' mean-loss
gradients is the gradient of the mean loss over all K batches. Every island applies the same averaged
gradient with identically initialised AdamW states, so the replicas stay identical.

An island whose gradient is not finite weighs 0 in the mean (the others' mean is applied everywhere); one
whose loss is not finite (its weights are lost) is then reset from a healthy replica
(:mod:`atoll.strategies.repair`; its AdamW state is every replica's already). Every island sees that
something went wrong in the all-reduce's total weight, so the healthy path costs no extra exchange.

When the gradients travel through the host (the ``local`` runtime; the collective runtime without torch's DDP
hooks) every step is a host synchronization anyway, and the repair happens at once. Under torch's DDP hooks
(:mod:`atoll.runtime.collective.torch_ddp`) nothing is read on the host in a step: the islands left out are
summed on the device and read at the loop's logging steps, where a diverged island is repaired (until then
it weighs 0 in every mean and applies the healthy islands' mean to its lost weights, so its AdamW state stays
every replica's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from atoll.algorithms.finite import all_finite
from atoll.analysis.cost import Cost, Setting, codec_bits
from atoll.config.section import StrategyConfig
from atoll.config.sections import AdamWSection, CodecSection
from atoll.runtime.network import ring_allreduce_bytes
from atoll.strategies.base import Strategy, make_wire
from atoll.strategies.repair import BAD_GRADIENT, DIVERGED, HEALTHY, gather_status, reset_from_peer
from atoll.strategies.spec import StrategySpec, SuiteRun

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm


class DDPConfig(AdamWSection, CodecSection, StrategyConfig):
    """ddp's config: the inner AdamW and the codec of its gradients (no outer rounds: no H)."""


class DDP(Strategy):
    """Ring all-reduce of the full gradient every inner step (float32, or as ``--codec`` encodes it)."""

    name = "ddp"

    config: DDPConfig

    def __init__(self, config: DDPConfig, islands: list[Island], comm: Comm, seed: int = 0) -> None:
        super().__init__(config, islands, comm, seed)
        self.wire = make_wire(config, comm.local_islands, seed)
        self.dropped_updates = 0
        #: under torch's DDP hooks: the islands of the job left out of the mean, summed over the steps since the
        #: last logging step (0-d float32 on the device, not read in a step); None: none since
        self.left_out: torch.Tensor | None = None

    def step(self, step: int) -> None:
        if all(island.ddp is not None for island in self.islands):
            self.step_hooked(step)
            return
        grads = [island.flat_grads() for island in self.islands]
        status = [DIVERGED if island.diverged else HEALTHY if all_finite(g) else BAD_GRADIENT
                  for island, g in zip(self.islands, grads, strict=True)]
        weights = [1.0 if s == HEALTHY else 0.0 for s in status]
        grads = [g if s == HEALTHY else torch.zeros_like(g) for g, s in zip(grads, status, strict=True)]
        mean, total = self.comm.all_reduce_mean_and_weight(grads, weights=weights, wire=self.wire, key="grad")
        for island in self.islands:  # no island contributed: the mean is NaN and every island skips the step
            island.set_flat_grads(mean)
            island.inner_step()
        if total < self.comm.islands:  # an island of the job contributed nothing: who, and is it diverged?
            job_status = gather_status(self.comm, status)
            self.dropped_updates += sum(s != HEALTHY for s in job_status)
            reset_from_peer(self.comm, self.islands, job_status, step, keep_optimizer=True)

    def step_hooked(self, step: int) -> None:
        """The step when torch's DDP hooks already averaged the gradient in the backward pass, on the device
        (:mod:`atoll.runtime.collective.torch_ddp`; a sharded island: FSDP2's reduce-scatter, then its all-reduce
        hook across the islands): the optimizer step and the bytes counted as the host path counts them. Nothing
        is read on the host: the islands left out of the mean are summed on the device (:attr:`left_out`) and a
        diverged island is repaired at the next logging step (:meth:`reset_diverged`)."""
        numel = sum(p.numel() for p in self.islands[0].params)  # the whole model's (a sharded one's DTensors too)
        for island in self.islands:
            island.inner_step()  # a mean that is not finite (no island contributed) is skipped
        self.comm.count_island(ring_allreduce_bytes(4 * numel, self.comm.islands))
        contributed = self.islands[0].sync_islands
        missing = (self.comm.islands - contributed if contributed is not None
                   else torch.tensor(float(self.comm.islands), device=self.islands[0].device))
        self.left_out = missing if self.left_out is None else self.left_out + missing

    def reset_diverged(self, steps_done: int | None = None) -> int:
        """Under torch's DDP hooks, at a logging step: when an island of the job was left out of a mean since
        the last one (one scalar read, the same on every rank), every island learns who diverged
        (:func:`~atoll.strategies.repair.gather_status`) and a diverged one is reset from a healthy replica,
        keeping its AdamW state (every replica's). Collective. Returns the islands of the job reset.

        Raises:
            Diverged: every island diverged (at ``steps_done``).
        """
        if self.left_out is None:
            return 0
        left_out, self.left_out = round(float(self.left_out)), None
        if left_out == 0:
            return 0
        self.dropped_updates += left_out  # contributions left out, over the steps since the last look
        status = [DIVERGED if island.diverged else HEALTHY for island in self.islands]
        step = (steps_done if steps_done is not None else 1) - 1
        return reset_from_peer(self.comm, self.islands, gather_status(self.comm, status), step, keep_optimizer=True)

    def global_params(self) -> torch.Tensor:
        return self.islands[0].flat_params()

    def island_state(self, position: int) -> dict[str, Any]:
        return {"wire": self.wire.island_state(position)}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:
        self.wire.load_island_state(position, state["wire"])


def project(config: DDPConfig, s: Setting) -> Cost:
    """ddp's cost per inner step: a ring all-reduce of the b-bit gradient (its codec's; fp32: 32) every step,
    not overlapped with the backward pass (as the simulated clock prices it)::

        bytes = 2(K-1)/K * N*b/8;  step = t_c + bytes*8/B + 2(K-1)L

    Raises:
        ValueError: a codec without fixed bits per element (topk).
    """
    x = ring_allreduce_bytes(s.params * codec_bits(config.codec) / 8, s.islands)
    t = x * 8 / s.bandwidth_bps + 2 * (s.islands - 1) * s.latency_s if s.islands > 1 else 0.0
    return Cost(s.step_compute_s + t, x, t)


SPEC = StrategySpec(
    name="ddp", summary="full gradients, ring all-reduce, every inner step (the data-parallel baseline)",
    config=DDPConfig, runtimes=("local", "collective"), lockstep=DDP, project=project, shards=True,
    suite=(SuiteRun("one_island", "one island alone (ddp, K=1)", {"strategy": "ddp", "islands": 1}),
           SuiteRun("ddp", "ddp", {"strategy": "ddp"})),
)
