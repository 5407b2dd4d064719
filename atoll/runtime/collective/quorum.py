"""Going on without a lost island: the survivors agree, through the rendezvous store, on who is alive.

One *epoch* per change of :class:`~atoll.runtime.collective.membership.Membership` (a loss, or an admission).
Every rank whose collective failed registers in epoch ``e`` with the number of the operation that failed
(:attr:`DistComm.ops`, the same on every rank of a lockstep job: a rejoined rank takes the live ranks' count
with their state). A rank that neither registers nor beats (its heartbeat silent for ``dead_s``, or it said
goodbye) is dead. Once every rank of the current job has registered or is dead, the first survivor to decide
writes the new membership with ``compare_set`` and every survivor adopts what the store holds, so all agree
even if their views differed for a moment. An island is alive only if all its ranks are. The survivors then
re-form their process groups over ``PrefixStore(f"epoch{e}/", store)`` (see :class:`CollectiveRuntime.recover`).

The store is the launcher's (or torchrun's agent's), which outlives any rank; under plain ``torchrun``
without an agent store, rank 0 hosts it, and its loss cannot be survived.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from atoll.runtime.collective.failure import PeerFailure
from atoll.runtime.collective.view import CollectiveView

DEAD_S = 3.0  # a rank of the failed job whose heartbeat has not moved for this long is dead


class Quorum:
    """Agreement on the islands alive after a failure (one round per epoch).

    Args:
        store: the rendezvous store, prefixed with a key unique to the run.
        rank: this rank's global rank (its rank in the first epoch).
        ranks_per_island: R; island i is global ranks [i*R, (i+1)*R).
        is_gone: ``is_gone(rank, dead_s)``: the rank left, or its heartbeat has not moved for ``dead_s`` s.
        timeout_s: how long to wait for the others to register, seconds.
    """

    def __init__(self, store: Any, rank: int, ranks_per_island: int, is_gone: Callable[[int, float], bool],
                 timeout_s: float) -> None:
        self.store, self.rank, self.r_count = store, rank, ranks_per_island
        self.is_gone, self.timeout_s = is_gone, timeout_s

    def register(self, epoch: int, op: int) -> None:
        """Say this rank is alive in ``epoch`` and failed in operation ``op`` (first thing after a failure:
        a registered rank is never taken for dead, even if its heartbeat stalls while it closes its groups)."""
        self.store.set(f"{epoch}/op/{self.rank}", str(op))

    def agree(self, epoch: int, op: int, alive: list[int]) -> tuple[list[int], list[int]] | None:
        """The islands alive in ``epoch`` and the global ranks found dead, or None if the survivors failed
        in different operations (or the others did not register in time): then nothing can be redone.

        Args:
            epoch: the new epoch (1 for the first loss).
            op: the number of the operation that failed on this rank.
            alive: the islands of the job before this loss, ascending.
        """
        store, e = self.store, epoch
        self.register(epoch, op)
        ranks = [i * self.r_count + p for i in alive for p in range(self.r_count)]
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if store.check([f"{e}/members"]):
                return self._decoded(store.get(f"{e}/members"))
            joined = [r for r in ranks if store.check([f"{e}/op/{r}"])]
            waiting = [r for r in ranks if r not in joined and not self.is_gone(r, DEAD_S)]
            if not waiting:
                ops = {r: int(store.get(f"{e}/op/{r}")) for r in joined}
                islands = [i for i in alive if all(i * self.r_count + p in ops for p in range(self.r_count))]
                dead = [r for r in ranks if r not in ops]
                same = len({ops[i * self.r_count + p] for i in islands for p in range(self.r_count)}) <= 1
                proposal = json.dumps({"islands": islands if same else None, "dead": dead})
                return self._decoded(store.compare_set(f"{e}/members", "", proposal))
            time.sleep(0.1)
        return None

    @staticmethod
    def _decoded(raw: bytes | str) -> tuple[list[int], list[int]] | None:
        value = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        return None if value["islands"] is None else (list(value["islands"]), list(value["dead"]))


def store_client(timeout_s: float) -> dist.TCPStore:
    """A client of the rendezvous store at ``MASTER_ADDR:MASTER_PORT`` (as torchrun or the launcher set)."""
    import os

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


class _Recovering(CollectiveView, Protocol):
    """A runtime that survives losses: its :class:`Quorum` is set."""

    quorum: Quorum | None


def recover(rt: _Recovering, failure: PeerFailure, op: int) -> float:
    """Go on with the islands alive after ``failure`` in operation ``op``, or end this process; return the wall
    seconds from the failure to the re-formed groups.

    The survivors agree on who is alive (:class:`~atoll.runtime.collective.quorum.Quorum`), drop every
    island that lost a rank, and re-form the default group over ``PrefixStore(f"epoch{n}/", store)``
    with ranks renumbered in island order; the comm then starts its pending collectives again. The run
    stops (one line, status 3) if fewer than ``min_islands`` islands are left, if island 0 (which writes
    the run folder) is lost, or if the survivors failed in different operations; a rank of a dropped
    island that is still alive stops too, with a warning where the run goes on without it. The change goes
    through the runtime's methods and its :class:`~atoll.runtime.collective.membership.Membership`
    (:meth:`~.Membership.drop`), never its attributes.
    """
    assert rt.quorum is not None and rt.heartbeat is not None
    for exc in (failure, failure.__cause__, failure.__context__):  # their frames hold the failed work
        if exc is not None and exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
    t0 = time.perf_counter()
    members = rt.membership
    epoch = members.epoch + 1
    try:
        rt.quorum.register(epoch, op)
        rt.close_groups()
        decided = rt.quorum.agree(epoch, op, members.alive)
    except RuntimeError:  # the store is gone too (its host died): nobody to agree with
        decided = None
    if decided is None:
        rt.abort(failure.reason, failure.suspect)
    alive, dead = decided  # type: ignore[misc]
    rt.heartbeat.report(dead)
    lost = [i for i in members.alive if i not in alive]
    where = f"inner step {rt.step + 1}" if rt.step is not None else "start"
    culprit = (f"island {lost[0]} (rank {', '.join(map(str, dead))})" if lost and dead else "")
    # the run stops (every rank, a dropped island's live one too, with the same line) ...
    if 0 not in alive:
        rt.abort(f"{failure.reason}; island 0 writes the run folder", dead[0] if dead else None)
    if len(alive) < rt.config.min_islands:
        rt.abort(f"{failure.reason}; {len(alive)} of {rt.islands} islands left, --min-islands "
                   f"{rt.config.min_islands}", dead[0] if dead else None)
    if rt.island not in alive:  # ... or goes on without a live rank's island, which lost another: a warning
        rt.abort(failure.reason, dead[0] if dead else None, warning=True,
                 advice=f"island {rt.island} is dropped and the other islands go on without it")
    rt.heartbeat.drop([i * rt.ranks_per_island + p for i in lost for p in range(rt.ranks_per_island)])
    members.drop(lost, rt.step + 1 if rt.step is not None else 0)  # (epoch + 1: the epoch agreed on)
    rt.init_epoch()
    took = time.perf_counter() - t0
    if rt.is_main and culprit:
        print(f"atoll: warning: {culprit} stopped responding at {where} ({failure.reason}); going on with "
              f"{len(alive)} of {rt.islands} islands", file=sys.stderr, flush=True)
    return took

