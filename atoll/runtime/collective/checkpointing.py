"""The collective runtime's checkpoints: every rank writes and reads its own part (:mod:`atoll.job.rank_checkpoint`)."""

from __future__ import annotations

import errno
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.errors import CheckpointError, PeerWriteError
from atoll.job.checkpoint import checkpoint_tmp
from atoll.job.rank_checkpoint import (
    FORMAT,
    load_rank_state,
    owner_of_island,
    owner_of_shared,
    rank_folder,
    save_rank_state,
    stage_rank_state,
)
from atoll.runtime.collective.failure import HEARTBEAT_STALE_S, dist_call
from atoll.runtime.network import SimClock

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.job.run import Run
    from atoll.runtime.collective.view import CollectiveView
    from atoll.strategies.base import Strategy


def save_rank_checkpoint(rt: CollectiveView, run: Run, step: int, islands: list[Island],
                         strategy: Strategy, background: bool = False) -> None:
    """Write the checkpoint at inner step ``step`` per rank (:mod:`atoll.job.rank_checkpoint`); collective.

    First the checkpoint in flight, if any, is settled (:func:`settle_checkpoint`). Every rank takes the
    strategy's shared state (it may finish an exchange in flight, an island collective) and writes what only it
    holds into ``ranks/rank_<r>/`` of the temporary folder rank 0 made; the ranks agree that every write
    succeeded (one all-reduce over the control group), then rank 0 writes the shared state (counters, a
    :class:`~atoll.runtime.network.SimClock` at the real wall time, so the ``local`` runtime can resume an
    unsharded checkpoint) and the global model, and renames the folder. Island 0's ranks gather a sharded
    global model for the Hugging Face export; nothing else travels.

    With ``background`` each rank copies its part to host buffers and returns; threads write and commit it
    (:mod:`~.async_checkpoint`), agreeing through the store instead of the all-reduce.

    Raises:
        OSError: this rank, or another, could not write its part (of this checkpoint, or of the one in flight);
            the temporary folder is removed and the previous checkpoints stay as they were. One rank raises the
            error itself (the first that failed; rank 0 for the one in flight), the others a
            :class:`~atoll.errors.PeerWriteError`, so that the job says it in one line.
    """
    t0 = time.perf_counter()
    settled = settle_checkpoint(rt)  # (its wait counts in this one's blocked_s)
    sharded = rt.config.shard_island
    shared = strategy.state_dict()  # every rank: it may finish an exchange in flight
    tmp = run.out / "checkpoints" / f".tmp-step_{step:07d}"
    if rt.is_main:
        tmp = checkpoint_tmp(run.out, step)
    rt.comm.resilient(lambda: dist_call(dist.barrier, group=rt.control))
    if settled is not None and rt.is_main:  # every rank has read its result: its keys go
        from atoll.runtime.collective.async_checkpoint import forget

        forget(rt.background.store, rt.prefix, settled, rt.world)
    entry: dict[str, Any] = {"island": rt.island, "position": rt.position}
    if sharded or rt.position == 0:  # an island's replicas are alike: its first rank writes it
        island = islands[0]
        # the model's own tensors, not copies (a tied head is then written once)
        entry["island_state"] = (island.local_state_dict() if sharded  # type: ignore[attr-defined]
                                 else {**island.state_dict(), "model": island.model.state_dict()})
        entry["strategy_island"] = strategy.island_state(0)
        if rt.island == 0:  # the global model and the outer state, once (sharded: once per shard)
            entry["strategy"] = shared
    if background:
        _write_in_background(rt, run, step, tmp, entry, strategy, t0)
        return
    failure: OSError | None = None
    try:
        save_rank_state(rank_folder(tmp, rt.rank), entry)
    except OSError as e:
        failure = e
    # the first rank that could not write its part (rt.world: none): it says why, the others stop quietly
    mine = torch.tensor([float(rt.rank if failure is not None else rt.world)], dtype=torch.float64)

    def agree() -> torch.Tensor:
        out = mine.clone()
        dist_call(dist.all_reduce, out, op=dist.ReduceOp.MIN, group=rt.control)
        return out

    first = int(rt.comm.resilient(agree)[0])
    params = rt.full_params(strategy.global_params()) if rt.island == 0 else None
    if first < rt.world:
        if rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None and first == rt.rank:
            raise failure
        raise PeerWriteError(errno.EIO, f"rank {first} could not write its part of the checkpoint", str(tmp))
    if rt.is_main:
        assert params is not None
        run.save_checkpoint(step, _shared_state(rt, run), params, tmp=tmp, meta={"format": FORMAT},
                            blocked_s=round(time.perf_counter() - t0, 6))


def _shared_state(rt: CollectiveView, run: Run) -> dict[str, Any]:
    """The job's state rank 0 writes beside the ranks' folders (counters, membership, a clock at the real wall
    time), as of now."""
    wall = run.wall_s()
    return {"islands": rt.islands, "ranks_per_island": rt.ranks_per_island,
            "shard_ranks": rt.ranks_per_island if rt.config.shard_island else None,
            "alive": list(rt.membership.alive), "comm": rt.comm.state_dict(),
            "clock": SimClock(rt.islands, [wall] * rt.islands).state_dict(), "wall_s": wall}


def _write_in_background(rt: CollectiveView, run: Run, step: int, tmp: Path, entry: dict[str, Any],
                         strategy: Strategy, t0: float) -> None:
    """Copy this rank's part (and on rank 0 the shared state and the global parameters) to host buffers and
    hand it to a writer thread (:class:`~.async_checkpoint.InFlight`); returns once the copies are made. ``t0``:
    when the checkpoint's call began (``perf_counter``), from which the training thread's stall is counted."""
    from atoll.runtime.collective.async_checkpoint import Commit, InFlight, writers
    from atoll.runtime.collective.quorum import store_client

    background = rt.background
    staging = background.staging
    staged = stage_rank_state(entry, staging)
    params = rt.full_params(strategy.global_params()) if rt.island == 0 else None
    commit = None
    if rt.is_main:
        assert params is not None
        host = staging.copy("__global_params__", params.detach().reshape(-1))
        staging.wait()
        alive = list(rt.membership.alive)
        commit = Commit(run, run.checkpoint_state(_shared_state(rt, run)), host, {"format": FORMAT},
                        writers(alive, rt.ranks_per_island), rt.membership.epoch,
                        min(HEARTBEAT_STALE_S, rt.config.collective_timeout_s),
                        survives=rt.quorum is not None)  # (set where the job goes on without a lost island)
    if background.store is None:
        background.store = store_client(rt.config.collective_timeout_s)
    background.in_flight = InFlight(rt, background.store, step, tmp, staged, commit,
                                    blocked_s=time.perf_counter() - t0)


def settle_checkpoint(rt: CollectiveView) -> int | None:
    """Wait for the checkpoint in flight, if any (:meth:`~.async_checkpoint.InFlight.settle`; rank 0's writer
    thread logged its ``checkpoint`` event as it committed it, with ``blocked_s``: the seconds training stood
    still for it, ``write_s``: the thread's); the wait counts in the stall of the checkpoint that waits.
    Returns its inner step (None: none in flight).

    Raises:
        OSError: it could not be written (on every rank).
    """
    flight, rt.background.in_flight = rt.background.in_flight, None
    if flight is None:
        return None
    flight.settle()
    return flight.step


def load_rank_checkpoint(rt: CollectiveView, state: dict[str, Any], islands: list[Island],
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
