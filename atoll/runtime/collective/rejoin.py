"""A restarted island rejoins a running collective job with the global state of a live island (not from disk).

The launcher restarts a lost island's rank (``max_restarts``) with ``ATOLL_REJOIN=<n>`` (its n-th restart).
The new process reads the run's key prefix from the store, asks to join (``join/<rank>``, holding a fresh
request id) and waits. The islands alive look for such requests at the end of every inner step (one small
all-reduce over the control group, only when ``max_restarts`` > 0) and, when none of their exchanges is in
flight, admit them: a new epoch whose groups include the joiners (``admit/<rank>/<request id>`` tells a
joiner the new membership; it deletes the key), then group rank 0 broadcasts its island's state, the
strategy's state, the counters (the operation count the quorum compares at a later loss) and the step, as a
safetensors buffer and a JSON tree (no pickle). The joiner enters the loop at the next inner step, an island
like the others, and can be lost and rejoin again any number of times."""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.runtime.collective.failure import REPORT_KEY, dist_call
from atoll.runtime.collective.transfer import broadcast_state

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.runtime.collective.view import CollectiveView
    from atoll.strategies.base import Strategy

REJOIN_ENV = "ATOLL_REJOIN"  # set by the launcher on a restarted rank: its incarnation (1 for the first restart)
PREFIX_KEY = "atoll/run_prefix"  # the running job's key prefix, set by rank 0 in the rendezvous store
ADMITTED_KEY = "atoll/admitted/"  # + global rank: the incarnation admitted last (the launcher reads it)
FINISHED = "finished"  # under the run's prefix: rank 0 is past the last step (a waiting joiner exits 0)


def wait_for_admission(store: Any, rank: int) -> tuple[str, dict[str, Any]]:
    """The restarted rank's side: ask to join, wait to be admitted; return the running job's key prefix and the
    membership it was admitted into (:meth:`~.membership.Membership.state_dict`, this island back). The runtime
    then joins that epoch's groups and receives the state (:meth:`CollectiveRuntime._rejoin`).

    The request carries a fresh id and the admission answers under that id (``admit/<rank>/<id>``, deleted
    once read), so a rank restarted again never takes an earlier admission for its own. Once admitted, the
    rank clears its peers' report of its previous incarnation and tells the launcher (:data:`ADMITTED_KEY`),
    which from then on kills it if it is reported silent again.

    Args:
        store: the rendezvous store (a client).
        rank: this rank's global rank.

    Raises:
        TimeoutError: not admitted within 600 s.
        SystemExit: (status 0) the job finished before admitting this rank.
    """
    prefix = store.get(PREFIX_KEY).decode()
    request = uuid.uuid4().hex
    store.set(f"{prefix}join/{rank}", request)
    key = f"{prefix}admit/{rank}/{request}"
    deadline = time.monotonic() + 600
    while not store.check([key]):
        if store.check([f"{prefix}{FINISHED}"]):  # restarted too late: the job is done, nothing to join
            sys.exit(0)
        if time.monotonic() > deadline:
            raise TimeoutError("rejoin: not admitted within 600 s")
        time.sleep(0.1)
    members = json.loads(store.get(key))
    store.delete_key(key)
    store.delete_key(f"{REPORT_KEY}{rank}")  # (written before this admission: about the previous process)
    store.set(f"{ADMITTED_KEY}{rank}", os.environ.get(REJOIN_ENV, "1"))
    return prefix, members


def admit(rt: CollectiveView, done: int, islands: list[Island], strategy: Strategy, extra: dict[str, Any]) -> None:
    """The live islands' side, at the end of inner step ``done``: admit the ranks that asked to join, if any.

    A collective call (every live rank, same step). Each joiner is told the new membership under its
    request's id; then every rank of the new epoch forms its groups and group rank 0 broadcasts its island's
    state, the strategy's, the counters (the comm's operation count included) and the step. The joiners'
    islands take group rank 0's island state; their tokens count from what they had processed before they
    were lost. The membership changes through :meth:`~.membership.Membership.admit`, the groups through the
    runtime's methods.
    """
    members = rt.membership
    flags = torch.zeros(rt.islands, dtype=torch.float64)
    requests: dict[int, str] = {}
    if rt.is_main and not rt.comm.pending:  # (with an exchange in flight, which a joiner could not finish: later)
        for i in range(rt.islands):
            key = f"{rt.prefix}join/{i}"
            if i not in members.alive and rt.store.check([key]):
                requests[i] = rt.store.get(key).decode()
                flags[i] = 1.0

    def op() -> torch.Tensor:
        out = flags.clone()
        dist_call(dist.all_reduce, out, group=rt.control)
        return out

    joiners = [i for i, f in enumerate(rt.comm.resilient(op).tolist()) if f > 0]
    if not joiners:
        return
    if rt.is_main:
        after = copy.deepcopy(members)
        after.admit(joiners, done)
        for i in joiners:
            rt.store.delete_key(f"{rt.prefix}join/{i}")
            rt.store.set(f"{rt.prefix}admit/{i}/{requests[i]}", json.dumps(after.state_dict()))
    rt.close_groups()
    members.admit(joiners, done)
    rt.init_epoch()
    assert rt.heartbeat is not None
    rt.heartbeat.undrop(joiners)
    state = None
    if rt.is_main:
        island = islands[0]
        state = {"step": done, "island": island.state_dict(), "strategy": strategy.state_dict(),
                 "strategy_island": strategy.island_state(0), "comm": rt.comm.state_dict(), "ops": rt.comm.ops,
                 "tokens_of": list(rt.job_tokens.of), **extra}
    broadcast_state(state, rt.control)


def joined_job(got: dict[str, Any], islands: int) -> dict[str, Any]:
    """What a rejoined rank received as ``{"step": S, "job": the state in the checkpoint's format}`` (every
    island entry the live island's, which is the only one it has)."""
    job = {"islands": [got["island"]] * islands, "strategy": got["strategy"],
           "strategy_islands": [got["strategy_island"]] * islands, "comm": got["comm"],
           **{key: got[key] for key in ("initial_eval_loss", "eval_loss", "wall_s")}}
    return {"step": int(got["step"]), "job": job}
