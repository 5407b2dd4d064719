"""What the collective runtime reports to the loop: the job's totals, per-island counts and the slowest
island's compute seconds (all-reduced over the control group, one rank per island reporting), and its
entries of ``summary.json`` (sharded islands, the islands lost and rejoined)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.runtime.collective import torch_ddp
from atoll.runtime.collective.failure import dist_call

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.runtime.collective.view import CollectiveView


def totals(rt: CollectiveView, islands: list[Island]) -> tuple[float, dict[int, int]]:
    """Mean loss (nats per token) over the islands alive, and each live island's tokens (the runtime keeps a
    lost one's as last reported). Collective over the control group."""
    def op() -> torch.Tensor:
        buf = torch.zeros(1 + rt.islands, dtype=torch.float64)
        if rt.position == 0:  # one rank per island reports it
            buf[0] = sum(i.last_loss for i in islands)
            buf[1 + rt.island] = sum(i.tokens for i in islands) + rt.job_tokens.offset
        dist_call(dist.all_reduce, buf, group=rt.control)
        return buf

    buf = rt.comm.resilient(op)
    alive = rt.membership.alive
    return float(buf[0]) / len(alive), {i: int(buf[1 + i]) for i in alive}


def island_counts(rt: CollectiveView, islands: list[Island]) -> tuple[list[int], list[int]]:
    """Per island of the job, in index order: (``skipped_steps``, ``reset_count``). Collective."""
    def op() -> torch.Tensor:
        buf = torch.zeros(2 * rt.islands, dtype=torch.float64)
        if rt.position == 0:  # one rank per island reports it
            for i in islands:
                buf[i.index], buf[rt.islands + i.index] = i.skipped_steps, i.reset_count
        dist_call(dist.all_reduce, buf, group=rt.control)
        return buf

    buf = rt.comm.resilient(op)
    return [int(x) for x in buf[:rt.islands]], [int(x) for x in buf[rt.islands:]]


def compute_s(rt: CollectiveView, islands: list[Island]) -> float:
    """Measured compute seconds of the slowest island of the job (the maximum over ranks). Collective."""
    def op() -> float:
        buf = torch.tensor([max(i.compute_s for i in islands)], dtype=torch.float64)
        dist_call(dist.all_reduce, buf, op=dist.ReduceOp.MAX, group=rt.control)
        return float(buf[0])

    return rt.comm.resilient(op)


def summary(rt: CollectiveView) -> dict[str, Any]:
    """``lost_islands`` (island -> the inner step the others went on without it, its latest loss),
    ``rejoined_islands`` (island -> inner steps done at its latest rejoin), ``membership`` (every loss and
    rejoin in order: kind, island, step, epoch) and ``degraded_exchanges`` (exchanges with fewer
    contributors than ``islands``), once an island was lost;
    ``recovery_s``: wall seconds from each failure to the re-formed groups; ``interrupted_exchange_s``:
    wall seconds of each exchange a loss interrupted, from its start to its result over the survivors;
    ``resumed_at``: the wall clock (Unix seconds) at that result, when training goes on."""
    shard = {**({"shard_island": True, "params_per_rank": rt.layout.numel_per_rank} if rt.config.shard_island
                else {}), **torch_ddp.describe(rt.torch_ddp, rt.config.shard_island)}
    members = rt.membership
    if not members.events:
        return shard
    lost, rejoined = members.lost, members.rejoined
    return {**shard, "lost_islands": {str(i): s for i, s in sorted(lost.items())},
            "islands_alive": len(members.alive),
            "membership": [dataclasses.asdict(e) for e in members.events],
            "degraded_exchanges": rt.comm.degraded_exchanges,
            "recovery_s": [round(t, 3) for t in rt.recovery_s],
            "interrupted_exchange_s": [round(t, 3) for t in rt.comm.interrupted_s],
            "resumed_at": rt.comm.resumed_at,
            **({"rejoined_islands": {str(i): s for i, s in sorted(rejoined.items())}} if rejoined else {})}
