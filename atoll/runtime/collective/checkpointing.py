"""The collective runtime's checkpoints: every rank writes and reads its own part (:mod:`atoll.job.rank_checkpoint`)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.errors import CheckpointError
from atoll.job.checkpoint import checkpoint_tmp
from atoll.job.rank_checkpoint import (
    FORMAT,
    load_rank_state,
    owner_of_island,
    owner_of_shared,
    rank_folder,
    save_rank_state,
)
from atoll.runtime.collective.failure import dist_call
from atoll.runtime.network import SimClock

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.job.run import Run
    from atoll.runtime.collective.runtime import CollectiveRuntime
    from atoll.strategies.base import Strategy


def save_rank_checkpoint(rt: CollectiveRuntime, run: Run, step: int, islands: list[Island],
                         strategy: Strategy) -> None:
    """Write the checkpoint at inner step ``step`` per rank (:mod:`atoll.job.rank_checkpoint`); collective.

    Every rank takes the strategy's shared state (it may finish an exchange in flight, an island
    collective) and writes what only it holds into ``ranks/rank_<r>/`` of the temporary folder rank 0 made;
    the ranks agree that every write succeeded (one all-reduce over the control group), then rank 0 writes
    the shared state (counters, a :class:`~atoll.runtime.network.SimClock` at the real wall time, so the
    ``local`` runtime can resume an unsharded checkpoint) and the global model, and renames the folder.
    Island 0's ranks gather a sharded global model for the Hugging Face export; nothing else travels.

    Raises:
        OSError: this rank, or another, could not write its part; the temporary folder is removed and the
            previous checkpoints stay as they were.
    """


    sharded = rt.config.shard_island
    shared = strategy.state_dict()  # every rank: it may finish an exchange in flight
    tmp = run.out / "checkpoints" / f".tmp-step_{step:07d}"
    if rt.is_main:
        tmp = checkpoint_tmp(run.out, step)
    rt.comm.resilient(lambda: dist_call(dist.barrier, group=rt.control))
    entry: dict[str, Any] = {"island": rt.island, "position": rt.position}
    if sharded or rt.position == 0:  # an island's replicas are alike: its first rank writes it
        island = islands[0]
        # the model's own tensors, not copies (a tied head is then written once)
        entry["island_state"] = (island.local_state_dict() if sharded  # type: ignore[attr-defined]
                                 else {**island.state_dict(), "model": island.model.state_dict()})
        entry["strategy_island"] = strategy.island_state(0)
        if rt.island == 0:  # the global model and the outer state, once (sharded: once per shard)
            entry["strategy"] = shared
    failure: OSError | None = None
    try:
        save_rank_state(rank_folder(tmp, rt.rank), entry)
    except OSError as e:
        failure = e
    ok = torch.tensor([0.0 if failure is not None else 1.0], dtype=torch.float64)

    def agree() -> torch.Tensor:
        out = ok.clone()
        dist_call(dist.all_reduce, out, op=dist.ReduceOp.MIN, group=rt.control)
        return out

    everyone = float(rt.comm.resilient(agree)[0]) == 1.0
    params = rt.full_params(strategy.global_params()) if rt.island == 0 else None
    if not everyone:
        if rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
        raise OSError(errno.EIO, "another rank could not write its part of the checkpoint", str(tmp))
    if rt.is_main:
        assert params is not None
        wall = run.wall_s()
        state = {"islands": rt.islands, "ranks_per_island": rt.ranks_per_island,
                 "shard_ranks": rt.ranks_per_island if sharded else None, "alive": list(rt.membership.alive),
                 "comm": rt.comm.state_dict(), "clock": SimClock(rt.islands, [wall] * rt.islands).state_dict(),
                 "wall_s": wall}
        run.save_checkpoint(step, state, params, tmp=tmp, meta={"format": FORMAT})


def load_rank_checkpoint(rt: CollectiveRuntime, state: dict[str, Any], islands: list[Island],
                         strategy: Strategy) -> None:
    """Restore from a per-rank checkpoint: this rank reads its island's folder and the shared state's owner
    (:func:`~atoll.job.rank_checkpoint.owner_of_island`), nothing of the other islands."""
    if int(state["islands"]) != rt.islands:
        raise CheckpointError(f"resume: the checkpoint holds {state['islands']} islands, this run "
                              f"{rt.islands}; resume with the run's own --islands")
    sharded, saved = rt.config.shard_island, state.get("shard_ranks")
    if (saved or None) != (rt.ranks_per_island if sharded else None):
        raise CheckpointError(f"resume: the checkpoint's islands are sharded over {saved or 1} ranks, this "
                              f"run's over {rt.ranks_per_island if sharded else 1}; resume with "
                              + (f"--shard-island --ranks-per-island {saved}" if saved else "no --shard-island"))
    path, alive = Path(state["checkpoint_path"]), [int(i) for i in state["alive"]]
    own_rank = owner_of_island(rt.island, rt.position, int(state["ranks_per_island"]), sharded, alive)
    own, dtensors = load_rank_state(rank_folder(path, own_rank))
    island = islands[0]
    if sharded:
        island.load_local_state_dict(own["island_state"],  # type: ignore[attr-defined]
                                     lambda key: f"island_state.{key}" in dtensors)
    else:
        island.load_state_dict(own["island_state"])
    shared_rank = owner_of_shared(rt.position, sharded)
    shared = own if shared_rank == own_rank else load_rank_state(rank_folder(path, shared_rank))[0]
    strategy.load_state_dict(shared["strategy"])
    strategy.load_island_state(0, own["strategy_island"])
    rt.comm.load_state_dict(state["comm"])
