"""What the syncer service keeps of one island: its steps, sessions, last call, progress figures and rejoin times.

:class:`IslandState` is one record per island of :class:`~atoll.runtime.service.syncer.SyncerService` (instead of
one list per figure); :class:`RejoinTimes` the run's rejoin times, kept bounded however often islands join. Both
are plain data with a ``state_dict`` for the syncer's checkpoint (JSON-able: ints, floats, None).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: the rejoin times a service keeps one by one (the most recent; older ones only in the count, sum and max)
REJOIN_WINDOW = 256
#: the sessions of an island whose figures are kept one by one (the most recent; older ones only in the totals)
SESSION_WINDOW = 64


def finite(value: Any, default: float = 0.0) -> float:
    """``value`` as a finite float, else ``default`` (an island's report: None, NaN, infinite, a huge int, text)."""
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return x if math.isfinite(x) else default


@dataclass
class Session:
    """The figures of one session of an island (a job's life from its Join): ``session`` (the syncer's number),
    ``steps`` (inner steps it reported using), ``compute_s`` (seconds of compute), ``bytes_sent`` (bytes it
    reported sending: its pushes), ``bytes_received`` (bytes it reported receiving: the global fragments it
    pulled, float32, its join's included); the latest it reported (with each step lease, and at its Leave)."""

    session: int = 0
    steps: int = 0
    compute_s: float = 0.0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"session": self.session, "steps": self.steps, "compute_s": self.compute_s,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}

    @classmethod
    def of(cls, state: dict[str, Any]) -> Session:
        return cls(session=int(state.get("session", 0)), steps=int(state.get("steps", 0)),
                   compute_s=finite(state.get("compute_s")), bytes_sent=finite(state.get("bytes_sent")),
                   bytes_received=finite(state.get("bytes_received")))


@dataclass
class IslandState:
    """What the service keeps of one island.

    Attributes:
        steps: inner steps granted to it (every session; steps given back are taken out).
        joins: its Joins (sessions opened).
        leased, lease_used: of its current session, steps granted, and the steps the service counts as used (the
            most it reported, or more where its pushes claimed the tokens of more; at most ``leased``).
        reported: of its current session, the most steps it reported using (``used``; at most what it was
            granted plus its credit): a report below it is refused.
        claimed_from: per fragment of this syncer, the tokens it had claimed when its current session opened
            (None: not known, a record written before them): the session's claims are those since.
        first_step_s: on the service's clock, when its first inner step was granted (None: none yet).
        last_seen: on the service's clock, its last call that counts for a rejoin time (a step lease, a push).
        heard: on the service's clock, its last call of any kind (None before its first): alive.
        last_loss, last_lr: its last training loss and inner learning rate (None until it reports).
        bytes_received: bytes of its pushes as they declare them.
        sessions: its sessions' figures, the most recent :data:`SESSION_WINDOW` (the current one last).
        closed: the figures of every session before those in ``sessions`` summed (``session``: their count).
    Only ``steps``, ``joins``, the lease (``leased``, ``lease_used``, ``reported``, ``claimed_from``),
    ``first_step_s`` and the sessions are checkpointed (the rest is the live view, started anew by a restart).
    """

    steps: int = 0
    joins: int = 0
    leased: int = 0
    lease_used: int = 0
    reported: int = 0
    claimed_from: list[int] | None = None
    first_step_s: float | None = None
    last_seen: float = 0.0
    heard: float | None = None
    last_loss: float | None = None
    last_lr: float | None = None
    bytes_received: float = 0.0
    sessions: list[Session] = field(default_factory=list)
    closed: Session = field(default_factory=Session)

    def open_session(self, session: int) -> None:
        """A new session ``session`` starts (its Join): the oldest kept session goes into ``closed``."""
        self.sessions.append(Session(session=session))
        while len(self.sessions) > SESSION_WINDOW:
            old = self.sessions.pop(0)
            self.closed = Session(self.closed.session + 1, self.closed.steps + old.steps,
                                  self.closed.compute_s + old.compute_s, self.closed.bytes_sent + old.bytes_sent,
                                  self.closed.bytes_received + old.bytes_received)

    def report(self, steps: Any = None, compute_s: Any = None, bytes_sent: Any = None,
               bytes_received: Any = None) -> None:
        """The current session's figures so far, as the island reports them (a value that is not a finite
        number >= 0 is ignored; figures only grow within a session)."""
        if not self.sessions:
            self.sessions.append(Session())
        s = self.sessions[-1]
        if isinstance(steps, int) and steps >= 0:
            s.steps = max(s.steps, steps)
        c, b, r = finite(compute_s, -1.0), finite(bytes_sent, -1.0), finite(bytes_received, -1.0)
        s.compute_s = max(s.compute_s, c)
        s.bytes_sent = max(s.bytes_sent, b)
        s.bytes_received = max(s.bytes_received, r)

    def total(self) -> Session:
        """Its figures summed over every session (``session``: the sessions counted)."""
        return Session(self.closed.session + len(self.sessions),
                       self.closed.steps + sum(s.steps for s in self.sessions),
                       self.closed.compute_s + sum(s.compute_s for s in self.sessions),
                       self.closed.bytes_sent + sum(s.bytes_sent for s in self.sessions),
                       self.closed.bytes_received + sum(s.bytes_received for s in self.sessions))

    def state_dict(self) -> dict[str, Any]:
        """The checkpointed part (JSON-able)."""
        return {"steps": self.steps, "joins": self.joins, "leased": self.leased, "lease_used": self.lease_used,
                "reported": self.reported, "claimed_from": self.claimed_from,
                "first_step_s": self.first_step_s, "sessions": [s.state_dict() for s in self.sessions],
                "closed": self.closed.state_dict()}

    @classmethod
    def of(cls, state: dict[str, Any]) -> IslandState:
        """An island's record from its :meth:`state_dict`."""
        first = state.get("first_step_s")
        return cls(steps=int(state.get("steps", 0)), joins=int(state.get("joins", 0)),
                   leased=int(state.get("leased", 0)), lease_used=int(state.get("lease_used", 0)),
                   reported=int(state.get("reported", 0)),
                   claimed_from=None if state.get("claimed_from") is None else
                   [int(x) for x in state["claimed_from"]],
                   first_step_s=None if first is None else float(first),
                   sessions=[Session.of(s) for s in state.get("sessions", [])][-SESSION_WINDOW:],
                   closed=Session.of(state.get("closed", {})))

    @classmethod
    def of_lists(cls, service: dict[str, Any], islands: int) -> list[IslandState]:
        """The records of a checkpoint written before them (one list per figure: ``steps_by_island``, ``joins``,
        ``leased``, ``lease_used``, ``island_first_step_s``)."""
        def column(name: str, default: Any) -> list[Any]:
            values = list(service.get(name, []))
            return values + [default] * (islands - len(values))

        return [cls(steps=int(s), joins=int(j), leased=int(le), lease_used=int(u),
                    first_step_s=None if f is None else float(f))
                for s, j, le, u, f in zip(column("steps_by_island", 0), column("joins", 0), column("leased", 0),
                                          column("lease_used", 0), column("island_first_step_s", None),
                                          strict=True)][:islands]


@dataclass
class RejoinTimes:
    """The run's rejoin times (seconds from an island's last call before it died to its Join), bounded: their
    count, sum and max, and the most recent :data:`REJOIN_WINDOW` one by one."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=REJOIN_WINDOW))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        self.recent.append(seconds)

    def summary(self) -> dict[str, Any]:
        """``count``, ``mean_s``, ``max_s`` and the quantiles ``p50_s``, ``p90_s`` of the recent ones (None
        without a rejoin)."""
        ordered = sorted(self.recent)

        def q(p: float) -> float | None:
            return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else None

        return {"count": self.count, "mean_s": self.total_s / self.count if self.count else None,
                "max_s": self.max_s if self.count else None, "p50_s": q(0.5), "p90_s": q(0.9)}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total_s": self.total_s, "max_s": self.max_s, "recent": list(self.recent)}

    @classmethod
    def of(cls, state: Any) -> RejoinTimes:
        """From :meth:`state_dict`, or a checkpoint's list of every rejoin time (before this record)."""
        times = cls()
        if isinstance(state, list):
            for x in state:
                times.add(float(x))
            return times
        times.count, times.total_s = int(state.get("count", 0)), float(state.get("total_s", 0.0))
        times.max_s = float(state.get("max_s", 0.0))
        times.recent.extend(float(x) for x in state.get("recent", []))
        return times
