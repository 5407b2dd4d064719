"""The island leader's step lease: inner steps taken from the run's shared budget a round at a time.

:class:`StepLease` fetches a lease of a round of steps in the background before the last one is used (no round
trip per step across a WAN), reports the steps of its session it used with each fetch and at ``Leave`` (the
unused go back to the budget), and while the syncer is unreachable trains on credit for up to one round of steps,
reserved before any push claims their tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from atoll.errors import ConfigError
from atoll.runtime.service import schema
from atoll.runtime.service.client import RETRY, SessionSuperseded, SyncerClient, SyncerUnreachable

#: what :meth:`StepLease.take` answers: take a step, stop (the budget is spent), or wait and ask again
GO, STOP, WAIT = 1, 0, 2


class StepLease:
    """The leader's inner steps: leases of ``size`` steps from the run's shared budget, fetched ahead.

    :meth:`take` never waits for the network: it hands out a step of the lease in hand and, once half of it
    is used, fetches the next (``ReserveSteps`` with ``n = size``, the steps used so far and the steps granted
    so far: a grant whose reply was lost comes again with the next) in a background thread; a reply ``wait``
    (the run has not started, or the syncer refused the lease) is asked again 0.2 s later. While the syncer is
    unreachable (a fetch failed: retried with backoff, 0.1 s doubling to 5 s) and the lease is used up, up to
    ``offline_steps`` steps are taken on credit; the next fetch asks for them first. A push may claim only
    tokens the syncer granted (its ledger, :class:`~atoll.strategies.decoupled.bounds.PushBounds`):
    :meth:`claimable` waits until the credit steps before it are settled and takes the steps the syncer no
    longer granted (the budget was spent meanwhile) out of its claim.

    Args:
        client: the leader's :class:`SyncerClient`.
        size: steps per lease (the island's H: one round).
        offline_steps: steps the island may take on credit while the syncer is unreachable.
        tokens_per_step: tokens of one inner step of the island.
        fragments: P.
        status: () -> (last training loss, inner learning rate), sent with each fetch for the progress.
        figures: () -> the session's figures so far (``compute_s``, ``bytes_sent``), sent with each fetch (the
            syncer sums an island's sessions, a killed one's too).

    Attributes:
        used: steps of this session taken (leased and on credit).
        received: steps of this session granted (the replies that reached it).
        offline_steps_taken: steps taken on credit.
    """

    def __init__(self, client: SyncerClient, size: int, offline_steps: int, tokens_per_step: int, fragments: int,
                 status: Callable[[], tuple[float, float]] | None = None,
                 figures: Callable[[], dict[str, float]] | None = None) -> None:
        self.client, self.size, self.offline_steps = client, max(1, size), offline_steps
        self.tokens_per_step, self.status, self.figures = tokens_per_step, status, figures
        self.leased = 0  # granted, not taken yet
        self.used = 0
        self.received = 0  # granted in this session (every reply that reached it)
        self.owed = 0  # steps taken on credit, not asked for yet
        self.credit_taken = self.credit_settled = 0  # steps taken on credit, and asked for, since the start
        self.offline_steps_taken = 0
        self.ungranted = [0] * fragments  # per fragment: credit steps the syncer did not grant
        self.spent = False  # the syncer granted fewer than asked: the budget is spent
        self.unreachable_since: float | None = None
        self.fetches = 0
        self._cond = threading.Condition()
        self._fetching = False
        self._retry_at, self._delay = 0.0, 0.1
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")

    def take(self) -> int:
        """A step: :data:`GO` (take it), :data:`STOP` (the budget is spent and the lease used up) or
        :data:`WAIT` (none in hand yet: ask again shortly). Never waits for the network.

        Raises:
            SyncerUnreachable, ConfigError: a fetch failed for good (no answer for ``give_up_s``; a refused
                credential).
        """
        with self._cond:
            if self._error is not None:
                raise self._error
            if self.client.superseded is not None:  # a newer job of this island joined (seen by any call)
                raise SessionSuperseded(self.client.superseded)
            if self.leased > 0:
                self.leased -= 1
                self.used += 1
                if self.leased <= self.size // 2 and not self.spent:
                    self._fetch()
                return GO
            if self.spent:
                return STOP
            self._fetch()
            if self.unreachable_since is not None and self.owed < self.offline_steps:
                self.owed += 1  # the syncer is down: train on, on credit
                self.credit_taken += 1
                self.used += 1
                self.offline_steps_taken += 1
                return GO
            return WAIT

    def _fetch(self) -> None:
        """Start a fetch in the background unless one runs or the backoff says not yet (under the lock)."""
        if not self._fetching and time.monotonic() >= self._retry_at:
            self._fetching = True
            self._pool.submit(self._run_fetch)

    def _run_fetch(self) -> None:
        with self._cond:
            owed = self.owed
            asked = {"n": owed + self.size, "used": self.used, "received": self.received}
        if self.status is not None:
            asked["loss"], asked["lr"] = self.status()
        if self.figures is not None:
            asked.update(self.figures())
        request = schema.ReserveStepsRequest(**asked)
        try:
            reply = self.client.call("ReserveSteps", request, timeout_s=10.0, retry=False)
            granted = int(reply["granted"])
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            with self._cond:
                self._fetching = False
                now = time.monotonic()
                if code == grpc.StatusCode.ABORTED:  # a newer job of this island joined: this one stops
                    self._error = SessionSuperseded(e.details() if isinstance(e, grpc.Call) else str(e))
                elif code not in RETRY:
                    self._error = (ConfigError(f"credential: the syncer refused island {self.client.island}'s "
                                               f"step lease ({e.details() if isinstance(e, grpc.Call) else e}); "
                                               "pass this island's own --credential and --island")
                                   if code == grpc.StatusCode.UNAUTHENTICATED else e)
                else:
                    self.unreachable_since = self.unreachable_since or now
                    if now - self.unreachable_since > self.client.give_up_s:
                        self._error = SyncerUnreachable(
                            f"syncer: no answer from '{self.client.address}' to ReserveSteps for "
                            f"{self.client.give_up_s:g} s; check that atoll syncer runs there")
                    self._retry_at, self._delay = now + self._delay, min(2 * self._delay, 5.0)
                self._cond.notify_all()
            return
        except BaseException as e:  # noqa: BLE001 - reported to the loop by take()
            with self._cond:
                self._fetching, self._error = False, e
                self._cond.notify_all()
            return
        with self._cond:
            if reply.get("wait"):  # the run has not started (not every island joined), or the lease was refused
                self._fetching, self._retry_at = False, time.monotonic() + 0.2
                self.unreachable_since = None
                self._cond.notify_all()
                return
            self.received += granted
            paid = min(granted, owed)
            for p in range(len(self.ungranted)):  # credit steps it did not grant: never in a claim
                self.ungranted[p] += owed - paid
            self.owed -= owed
            self.credit_settled += owed
            self.leased += granted - paid
            self.spent = self.spent or granted < request.n
            self.fetches += 1
            self.unreachable_since, self._delay, self._retry_at = None, 0.1, 0.0
            self._fetching = False
            self._cond.notify_all()

    def claimable(self, fragment: int, tokens: int, credit_mark: int) -> int:
        """The tokens a push of ``fragment`` claiming ``tokens`` may claim: once the ``credit_mark`` credit steps
        taken before it are settled (fetched, with retries), less the steps the syncer did not grant
        (``tokens_per_step`` each). 0: none granted (the push is not sent: its work is lost, the budget spent).

        Raises:
            SyncerUnreachable, ConfigError: as :meth:`take`.
        """
        with self._cond:
            while self.credit_settled < credit_mark:
                if self._error is not None:
                    raise self._error
                self._fetch()
                self._cond.wait(0.1)
            claim = max(0, tokens - self.ungranted[fragment] * self.tokens_per_step)
            self.ungranted[fragment] = 0
            return claim

    def close(self) -> None:
        """Stop fetching (a fetch in flight ends by itself)."""
        self._pool.shutdown(wait=False)
