"""The collective runtime's evaluation: the held-out windows split over the ranks, each on its own device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from atoll.job.evaluation import evaluate_island
from atoll.runtime.collective.failure import dist_call

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.runtime.collective.view import CollectiveView


def split_evaluate(rt: CollectiveView, island: Island, params: torch.Tensor | None,
                   batches: list[torch.Tensor]) -> float:
    """Mean held-out loss (nats per token) of the global model ``params`` (this rank's ``global_params()``;
    None: the initial model) over ``batches``, the same number on every rank; collective over the control group.

    Batch j goes to rank j mod (ranks alive), which runs it with its island's model holding the global weights
    (:func:`atoll.job.evaluation.evaluate_island`); a sharded island is one evaluator (its ranks run the FSDP2
    forward together; its first rank reports). The per-batch losses are summed into one float64 vector where
    each slot has one contributor, so the mean is the one a single process computes (bit for bit on the CPU).
    """
    sharded = rt.config.shard_island
    slot = rt.membership.alive.index(rt.island)
    units, unit = ((len(rt.membership.alive), slot) if sharded
                   else (len(rt.membership.alive) * rt.ranks_per_island, slot * rt.ranks_per_island + rt.position))
    mine = evaluate_island(island, params, batches, range(unit, len(batches), units))

    def op() -> torch.Tensor:
        buf = torch.zeros(len(batches), dtype=torch.float64)
        if not sharded or rt.position == 0:
            for j, loss in mine.items():
                buf[j] = loss
        dist_call(dist.all_reduce, buf, group=rt.control)
        return buf

    losses = [float(x) for x in rt.comm.resilient(op)]
    return sum(losses) / len(losses)
