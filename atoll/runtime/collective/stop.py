"""Stopping every rank of a collective run at one inner step on a signal, with one checkpoint of it.

SIGINT or SIGTERM may reach one rank, every rank (Ctrl-C reaches the terminal's whole process group), or only
the launcher (a scheduler's SIGTERM to its main process); ranks of a lockstep job can be at different inner
steps (between two exchanges nothing holds them together), and a rank can be inside a collective that
waits for the others. A checkpoint is collective (every island's state goes to rank 0), so the ranks must
agree on the step after which they stop, and it must be one that each of them can still reach.

Through the rendezvous store, off the training thread (no collective, no per-step round trip):

1. whoever is asked first (a rank's signal handler, or the launcher's) sets :data:`REQUEST_KEY`; every rank's
   poller thread (every :data:`POLL_S` seconds) sees it and asks its own run to stop (:func:`atoll.job.stop.request`);
2. each rank then posts a *bound* once: the inner step it is computing (last finished + 1), posted by the
   poller, or the step just finished, posted by the training thread at a step's end, whichever comes first
   (under one lock, so the bound is never below the step the training thread will finish next);
3. a rank that finishes the step it posted waits for every live rank's bound and stops after their maximum
   ``T``; ranks below ``T`` train on to it. ``T`` is at least every rank's step in progress, so a rank inside a
   collective of step ``T`` or below is joined there by all the others; and a waiting rank waits only for the
   posts, which the pollers make even while their training threads are blocked, so nobody deadlocks.

The wait has the deadline ``collective_timeout_s``; past it, the rank stops as on a lost peer
(:class:`~atoll.runtime.collective.failure.PeerFailure`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from atoll.job import stop
from atoll.runtime.collective.failure import PeerFailure

#: the store key (no run prefix: the launcher sets it too) whose value is the number of the signal that asked
REQUEST_KEY = "atoll/stop"
POLL_S = 0.2  # seconds between two looks at the store for a stop asked elsewhere


class StopAgreement:
    """One rank's part in stopping the job at one inner step (the module docstring).

    Args:
        store: a client of the run's rendezvous store, used by this object alone.
        prefix: the run's key prefix (its bounds are ``prefix + "stop/<rank>"``).
        rank: this rank's global rank.
        live_ranks: the global ranks still in the job (those of islands lost are not waited for).
        steps: the run's ``--steps`` (no bound above it).
        timeout_s: seconds to wait for every live rank's bound.
        closed: an event that ends the poller when set (default: a new one; :meth:`close` sets it).
    """

    def __init__(self, store: Any, prefix: str, rank: int, live_ranks: Callable[[], list[int]], steps: int,
                 timeout_s: float, closed: threading.Event | None = None) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank
        self.live_ranks, self.steps, self.timeout_s = live_ranks, steps, timeout_s
        self.lock = threading.Lock()  # the store client and the bound: shared by the poller and the loop
        self.done: int | None = None  # inner steps the training thread finished (None before its first)
        self.posted: int | None = None  # this rank's bound
        self.target: int | None = None  # the step every rank stops after, once agreed
        self.closed = closed or threading.Event()
        self.thread = threading.Thread(target=self._poll, name="atoll-stop", daemon=True)
        self.thread.start()

    @classmethod
    def of(cls, rt: Any) -> StopAgreement:
        """The agreement of a started :class:`~atoll.runtime.collective.runtime.CollectiveRuntime` ``rt``: a store
        client of its own, the ranks of the islands alive (``rt.membership``), ``--steps``, ``--collective-timeout-s``;
        it ends when the rank's heartbeat does (the rank leaves: done, stopped or failed)."""
        from atoll.runtime.collective.quorum import store_client

        r_count, timeout_s = rt.ranks_per_island, rt.config.collective_timeout_s
        return cls(store_client(timeout_s), rt.prefix, rt.rank,
                   lambda: rt.membership.ranks(r_count), rt.facts.steps, timeout_s,
                   closed=rt.heartbeat.stopped)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}stop/{rank}"

    def _post(self, step: int) -> None:  # under self.lock
        self.store.set(self._key(self.rank), str(step))
        self.posted = step

    def _poll(self) -> None:
        relayed = False
        while not self.closed.wait(POLL_S):
            try:
                with self.lock:
                    asked = stop.requested()
                    if asked is not None and not relayed:
                        self.store.set(REQUEST_KEY, str(asked))  # the other ranks stop too
                        relayed = True
                    elif asked is None and self.store.check([REQUEST_KEY]):
                        stop.request(int(self.store.get(REQUEST_KEY)))
                        relayed = True
                    if stop.requested() is not None and self.posted is None and self.done is not None:
                        self._post(min(self.done + 1, self.steps))  # the step the training thread is on
            except Exception:  # the store is gone: the heartbeat says so and stops the rank
                continue

    def stop_after(self, done: int) -> bool:
        """At the end of inner step ``done`` (training thread): whether the job stops now.

        Raises:
            PeerFailure: a live rank posted no bound within ``timeout_s``.
        """
        with self.lock:
            self.done = done
            if self.posted is None:
                if stop.requested() is None:
                    return False
                self._post(done)
            if done < self.posted:  # type: ignore[operator]
                return False
        if self.target is None:
            self.target = self._agree()
        return done >= self.target

    def _agree(self) -> int:
        """The maximum of every live rank's bound (waits for them)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            keys = [self._key(r) for r in self.live_ranks()]
            with self.lock:
                if self.store.check(keys):
                    return max(int(v) for v in self.store.multi_get(keys))
            if time.monotonic() > deadline:
                raise PeerFailure(f"no agreement on the step to stop at within {self.timeout_s:g} s")
            time.sleep(POLL_S / 4)

    def close(self) -> None:
        """Stop the poller."""
        self.closed.set()
