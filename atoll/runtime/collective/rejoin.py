"""A restarted island rejoins a running collective job with the global state of a live island (not from disk).

The launcher restarts a lost island's rank (``max_restarts``) with ``ATOLL_REJOIN=1``. The new process reads
the run's key prefix from the store, asks to join (``join/<rank>``) and waits. The islands alive look for
such requests at the end of every inner step (one small all-reduce over the control group, only when
``max_restarts`` > 0) and, when none of their exchanges is in flight, admit them: a new epoch whose groups
include the joiners (``admit/<rank>`` tells a joiner the epoch and the islands), then group rank 0 broadcasts
its island's state, the strategy's state, the counters and the step, as a safetensors buffer and a JSON tree
(no pickle). The joiner enters the loop at the next inner step, an island like the others.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.runtime.collective.failure import dist_call
from atoll.runtime.collective.transfer import broadcast_state

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.runtime.collective.runtime import CollectiveRuntime
    from atoll.strategies.base import Strategy

REJOIN_ENV = "ATOLL_REJOIN"  # set by the launcher on a restarted rank
PREFIX_KEY = "atoll/run_prefix"  # the running job's key prefix, set by rank 0 in the rendezvous store


def join(rt: CollectiveRuntime) -> dict[str, Any]:
    """The restarted rank's side: ask, wait to be admitted, join the epoch's groups, receive the state.

    Returns:
        ``{"step": inner steps done, "job": the state in the checkpoint format, "lost": ..., "tokens_of": ...}``.
    """
    store = rt.store
    rt.prefix = store.get(PREFIX_KEY).decode()
    store.set(f"{rt.prefix}join/{rt.rank}", "1")
    key = f"{rt.prefix}admit/{rt.rank}"
    deadline = time.monotonic() + 600
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError("rejoin: not admitted within 600 s")
        time.sleep(0.1)
    admit = json.loads(store.get(key))
    rt.alive, rt.epoch = list(admit["alive"]), int(admit["epoch"])
    rt.init_epoch()
    return broadcast_state(None, rt.control)


def admit(rt: CollectiveRuntime, done: int, islands: list[Island], strategy: Strategy, extra: dict[str, Any]) -> None:
    """The live islands' side, at the end of inner step ``done``: admit the ranks that asked to join, if any.

    A collective call (every live rank, same step). The joiners' islands take group rank 0's island state;
    their tokens count from what they had processed before they were lost.
    """
    flags = torch.zeros(rt.islands, dtype=torch.float64)
    if rt.is_main and not rt.comm.pending:  # (with an exchange in flight, which a joiner could not finish: later)
        flags += torch.tensor([float(i not in rt.alive and rt.store.check([f"{rt.prefix}join/{i}"]))
                               for i in range(rt.islands)], dtype=torch.float64)

    def op() -> torch.Tensor:
        out = flags.clone()
        dist_call(dist.all_reduce, out, group=rt.control)
        return out

    joiners = [i for i, f in enumerate(rt.comm.resilient(op).tolist()) if f > 0]
    if not joiners:
        return
    epoch = rt.epoch + 1
    alive = sorted(rt.alive + joiners)
    if rt.is_main:
        for i in joiners:
            rt.store.delete_key(f"{rt.prefix}join/{i}")
            rt.store.set(f"{rt.prefix}admit/{i}", json.dumps({"epoch": epoch, "alive": alive}))
    rt.close_groups()
    rt.alive, rt.epoch = alive, epoch
    rt.init_epoch()
    assert rt.heartbeat is not None
    rt.heartbeat.undrop(joiners)
    for i in joiners:
        rt.rejoined[i] = done
    state = None
    if rt.is_main:
        island = islands[0]
        state = {"step": done, "island": island.state_dict(), "strategy": strategy.state_dict(),
                 "strategy_island": strategy.island_state(0), "comm": rt.comm.state_dict(),
                 "tokens_of": list(rt.tokens_of), "lost": {str(k): v for k, v in rt.lost.items()},
                 "rejoined": {str(k): v for k, v in rt.rejoined.items()}, **extra}
    broadcast_state(state, rt.control)


def joined_job(got: dict[str, Any], islands: int) -> dict[str, Any]:
    """What a rejoined rank received as ``{"step": S, "job": the state in the checkpoint's format}`` (every
    island entry the live island's, which is the only one it has)."""
    job = {"islands": [got["island"]] * islands, "strategy": got["strategy"],
           "strategy_islands": [got["strategy_island"]] * islands, "comm": got["comm"],
           **{key: got[key] for key in ("initial_eval_loss", "eval_loss", "wall_s")}}
    return {"step": int(got["step"]), "job": job}
