"""The decoupled simulation's state (:mod:`atoll.runtime.events`): clocks, counters and the pending events, as
plain records that a checkpoint saves and restores exactly (JSON-friendly lists; no pickle)."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from atoll.strategies.decoupled.protocol import Pull, Push


@dataclass
class Transfer:
    """A push or a pull on the wire, to or from ``island`` while it was in its ``epoch`` (failures so far)."""

    island: int
    epoch: int
    push: Push | None = None
    pull: Pull | None = None


@dataclass
class Waiter:
    """An island whose accepted push waits in a buffer for its merge (answered with the merged fragment);
    ``version``: the version of the fragment it holds (its push's base version; -1: unknown, a full pull)."""

    island: int
    epoch: int
    version: int = -1


@dataclass
class SimState:
    """The simulation's state: clocks, counters, and the pending events."""

    clock: list[float]                      # each island's simulated time, seconds
    compute: list[float]                    # simulated compute seconds (lost work included)
    pulled_at: list[list[float]]            # per island and fragment: time of the last pull
    bytes_sent: list[float]                 # per island: its pushes' encoded bytes
    failures: list[int]
    failed_at: list[float | None]
    rejoins: list[int]
    last_loss: list[float]
    rejoin_s: list[float] = field(default_factory=list)
    bytes_received: list[float] = field(default_factory=list)  # per island: the float32 fragments it pulled
    lost_tokens: float = 0.0
    lost_by_island: list[float] = field(default_factory=list)  # lost_tokens per island
    started: int = 0                        # inner steps begun (the budget counts these)
    done: int = 0                           # inner steps finished
    queue: list[tuple[float, int, int, str, int]] = field(default_factory=list)  # (time, island, seq, event, fragment)
    in_flight: dict[int, Transfer] = field(default_factory=dict)  # transfers on the wire, by their event's seq
    uplink_free: list[float] = field(default_factory=list)    # per island: when its uplink is next idle
    downlink_free: list[float] = field(default_factory=list)  # per island: when its downlink is next idle
    awaiting: list[list[bool]] = field(default_factory=list)  # per island and fragment: a push/pull in flight
    waiting: list[list[Waiter]] = field(default_factory=list)  # per fragment: islands buffered, unanswered
    epoch: list[int] = field(default_factory=list)            # per island: failures so far (stale transfers die)
    deferred_pushes: int = 0                # pushes skipped because the fragment's previous one was in flight
    lost_pushes: int = 0                    # pushes on the wire when their island failed
    last_arrival: float = 0.0               # simulated time of the last push that reached the syncer
    merges_seen: int = 0                    # merges (timed or final) the participation counts
    participation_sum: float = 0.0          # over those merges: islands merged over islands alive then
    merges_all_live: int = 0                # merges that held every island alive then
    seq: int = 0

    @classmethod
    def new(cls, islands: int, fragments: int) -> SimState:
        return cls([0.0] * islands, [0.0] * islands, [[0.0] * fragments for _ in range(islands)], [0.0] * islands,
                   [0] * islands, [None] * islands, [0] * islands, [float("nan")] * islands,
                   uplink_free=[0.0] * islands, downlink_free=[0.0] * islands,
                   awaiting=[[False] * fragments for _ in range(islands)], waiting=[[] for _ in range(fragments)],
                   epoch=[0] * islands, lost_by_island=[0.0] * islands, bytes_received=[0.0] * islands)

    def state_dict(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["queue"] = [list(e) for e in self.queue]
        state["in_flight"] = [[n, asdict(v)] for n, v in self.in_flight.items()]
        state["waiting"] = [[asdict(w) for w in ws] for ws in self.waiting]
        state["failed_at"] = [-1.0 if t is None else t for t in self.failed_at]
        return copy.deepcopy(state)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SimState:
        state = dict(state)
        state["queue"] = [(float(t), int(i), int(n), str(a), int(p)) for t, i, n, a, p in state["queue"]]
        state["in_flight"] = {int(n): Transfer(int(v["island"]), int(v["epoch"]),
                                               Push(**v["push"]) if v.get("push") else None,
                                               Pull.from_state(v["pull"]) if v.get("pull") else None)
                              for n, v in state["in_flight"]}
        state["waiting"] = [[Waiter(int(w["island"]), int(w["epoch"]), int(w.get("version", -1))) for w in ws]
                            for ws in state["waiting"]]
        state["failed_at"] = [None if t < 0 else float(t) for t in state["failed_at"]]
        state.setdefault("lost_by_island", [0.0] * len(state["clock"]))  # a checkpoint from before the buckets
        # a checkpoint from before the pulls were counted: those before it are not known, only those after
        state.setdefault("bytes_received", [0.0] * len(state["clock"]))
        return cls(**state)
