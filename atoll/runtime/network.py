"""The simulated network: counted bytes turned into seconds, and a clock per island.

Cost model (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms"): a ring all-reduce of a
payload of ``B`` bytes over ``K`` islands runs a reduce-scatter and an all-gather, ``2(K-1)`` rounds in
which every island sends ``B/K`` bytes. So each island sends ``2(K-1)/K * B`` bytes and the collective
takes ``2(K-1)/K * B * 8 / bandwidth + 2(K-1) * latency`` seconds. A ring all-gather of ``B`` bytes per
island sends ``(K-1) * B`` bytes per island in ``K-1`` rounds.

Each island's link is the bottleneck (its upload bandwidth, as for volunteers on home internet or a region
behind a WAN gateway); links are full duplex.

Encoding and decoding an exchange's payload with a lossy codec is charged on the clock too, as each
island's measured codec seconds (:meth:`SimClock.charge_codec`): it delays the island like compute, but is
not counted as compute, so ``compute_utilization`` shows it as overhead.

A run trains once, but its clock can be re-timed at any other link: :class:`ClockTrace` records what the
clock was asked (each island's compute and codec seconds, each collective's bytes and rounds, who waited for
which collective), and :func:`replay` runs the same clock again with another :class:`Link`. The training maths
does not depend on the link, so the replayed wall time is exactly what the run would have measured there
(overlapped exchanges, e.g. Streaming DiLoCo's, included).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def ring_allreduce_bytes(payload_bytes: float, islands: int) -> float:
    """Bytes each island sends in a ring all-reduce of ``payload_bytes``: ``2(K-1)/K * B``; 0 for K=1."""
    if islands <= 1:
        return 0.0
    return 2.0 * (islands - 1) / islands * payload_bytes


def ring_allgather_bytes(payload_bytes: float, islands: int) -> float:
    """Bytes each island sends in a ring all-gather where each contributes ``payload_bytes``: ``(K-1) * B``."""
    if islands <= 1:
        return 0.0
    return float(islands - 1) * payload_bytes


@dataclass(frozen=True)
class Link:
    """One island's network link.

    Attributes:
        bandwidth_bps: bits per second in each direction.
        latency_s: one-way latency per message, seconds.
    """

    bandwidth_bps: float
    latency_s: float

    @classmethod
    def from_config(cls, bandwidth_mbps: float, latency_ms: float) -> Link:
        """A link of ``bandwidth_mbps`` Mbit/s (10^6 bits) and ``latency_ms`` milliseconds."""
        return cls(bandwidth_mbps * 1e6, latency_ms * 1e-3)

    def transfer_seconds(self, bytes_sent: float, rounds: int) -> float:
        """Seconds to send ``bytes_sent`` bytes in ``rounds`` sequential messages over this link."""
        if bytes_sent <= 0 and rounds <= 0:
            return 0.0
        return bytes_sent * 8.0 / self.bandwidth_bps + rounds * self.latency_s

    def allreduce_seconds(self, payload_bytes: float, islands: int) -> float:
        """Seconds of a ring all-reduce of ``payload_bytes`` over ``islands`` islands (0 for one island)."""
        if islands <= 1:
            return 0.0
        return self.transfer_seconds(ring_allreduce_bytes(payload_bytes, islands), 2 * (islands - 1))

    def allgather_seconds(self, payload_bytes: float, islands: int) -> float:
        """Seconds of a ring all-gather of ``payload_bytes`` per island (0 for one island)."""
        if islands <= 1:
            return 0.0
        return self.transfer_seconds(ring_allgather_bytes(payload_bytes, islands), islands - 1)


@dataclass
class ClockTrace:
    """The requests a :class:`SimClock` served, in order, so the run can be re-timed at another link.

    ``events`` holds lists:
    ``["c", [s_0, ..., s_K-1]]``: compute seconds of each island since the previous event;
    ``["x", bytes_sent, rounds]``: a collective starts (its id is its index among the ``"x"`` events);
    ``["w", island, id]``: ``island`` waits for collective ``id``;
    ``["m", label]``: a mark (the loop's evaluations, by inner step), whose time :func:`replay` reports;
    ``["k", [s_0, ..., s_K-1]]``: codec seconds (encoding or decoding a payload) of each island.

    Attributes:
        islands: K.
        complete: False once the trace misses part of the run (a wait it cannot attribute, or a resume from
            a checkpoint written without its trace): :func:`replay` refuses it. A checkpoint holds the trace
            so far (:meth:`SimClock.state_dict`), so a resumed run's trace is whole.
    """

    islands: int
    events: list[list[Any]] = field(default_factory=list)
    complete: bool = True
    _pending: list[float] = field(default_factory=list)
    collectives: int = 0

    def __post_init__(self) -> None:
        self._pending = [0.0] * self.islands

    def compute(self, island: int, seconds: float) -> None:
        self._pending[island] += seconds

    def _flush(self) -> None:
        if any(self._pending):
            self.events.append(["c", list(self._pending)])
            self._pending = [0.0] * self.islands

    def collective(self, bytes_sent: float, rounds: int) -> int:
        """Record the start of a collective; return its id."""
        self._flush()
        self.events.append(["x", float(bytes_sent), int(rounds)])
        self.collectives += 1
        return self.collectives - 1

    def wait(self, island: int, ident: int) -> None:
        self._flush()
        self.events.append(["w", island, ident])

    def mark(self, label: int) -> None:
        """Record a point of the run (an evaluation after inner step ``label``) to re-time with the rest."""
        self._flush()
        self.events.append(["m", int(label)])

    def codec(self, seconds: list[float]) -> None:
        """Record each island's codec seconds (encoding or decoding one exchange's payload)."""
        self._flush()
        self.events.append(["k", [float(x) for x in seconds]])

    def to_dict(self) -> dict[str, Any]:
        self._flush()
        return {"islands": self.islands, "complete": self.complete, "events": self.events}

    def snapshot(self) -> dict[str, Any]:
        """What :meth:`to_dict` gives, without flushing the compute pending since the last event (so that a
        checkpoint does not split it and change the replay's sums): for checkpoints."""
        pending = [["c", list(self._pending)]] if any(self._pending) else []
        return {"islands": self.islands, "complete": self.complete, "events": [*self.events, *pending],
                "collectives": self.collectives}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Continue the trace of :meth:`snapshot` (a resumed run)."""
        self.events = [list(e) for e in snapshot["events"]]
        self.complete = bool(snapshot["complete"])
        self.collectives = int(snapshot["collectives"])
        self._pending = [0.0] * self.islands

    def save(self, path: Path, **meta: Any) -> None:
        """Write the trace as JSON, with ``meta`` (e.g. the link it ran at) beside it."""
        Path(path).write_text(json.dumps({**meta, **self.to_dict()}))


def load_trace(path: Path) -> dict[str, Any]:
    """A trace written by :meth:`ClockTrace.save`."""
    return json.loads(Path(path).read_text())


def replay(trace: dict[str, Any], link: Link, compute_scale: float = 1.0) -> dict[str, Any]:
    """Re-time a recorded run on ``link``: the same compute and collectives, another bandwidth and latency.

    The clock rules are :class:`SimClock`'s: a collective starts once the last island has arrived at it
    and the links are free, and lasts ``link.transfer_seconds(bytes_sent, rounds)``; an island that waits
    for it resumes at its end. Overlapped collectives (started, waited for later) are re-timed as such.

    Args:
        trace: :meth:`ClockTrace.to_dict` (or :func:`load_trace`) of a run.
        link: the link to re-time at.

        compute_scale: multiplies every recorded compute and codec second (e.g. to compare runs measured on
            a machine under different loads at one reference step time; the codec ran on the same machine).

    Returns:
        ``sim_wall_s`` (seconds), ``compute_s`` (the slowest island's compute seconds),
        ``compute_utilization`` (compute_s / sim_wall_s), ``comm_s`` (seconds of collectives in flight),
        ``codec_s`` (the slowest island's codec seconds, not counted in ``compute_s``) and ``marks``:
        {label: simulated seconds at that mark} (the evaluations' times).

    Raises:
        ValueError: an incomplete trace (a run resumed from a checkpoint written without its trace).
    """
    if not trace.get("complete", False):
        raise ValueError("the clock trace misses part of the run (resumed from a checkpoint written without its "
                         "trace, by an older atoll); cannot re-time it")
    k = int(trace["islands"])
    clock = SimClock(k)
    compute = [0.0] * k
    ends: list[float] = []
    marks: dict[int, float] = {}
    for event in trace["events"]:
        if event[0] == "c":
            for i, s in enumerate(event[1]):
                clock.compute(i, s * compute_scale)
                compute[i] += s * compute_scale
        elif event[0] == "x":
            ends.append(clock.start_collective(link.transfer_seconds(event[1], event[2])))
        elif event[0] == "m":
            marks[int(event[1])] = clock.wall_s
        elif event[0] == "k":
            clock.charge_codec([s * compute_scale for s in event[1]])
        else:
            clock.wait_until(int(event[1]), ends[int(event[2])])
    compute_s = max(compute)
    wall = clock.wall_s
    return {"sim_wall_s": wall, "compute_s": compute_s, "comm_s": clock.comm_busy_s, "codec_s": max(clock.codec_s),
            "compute_utilization": compute_s / wall if wall > 0 else 1.0, "marks": marks}


@dataclass
class SimClock:
    """Simulated time of each island, in seconds.

    Compute advances one island's clock by its measured compute time. A blocking collective starts when
    the last participant arrives and ends ``duration`` seconds later; every participant waits for it.
    A collective may also be started without blocking (overlapped with further inner steps): an island
    then calls :meth:`wait_until` only when it needs the result.

    Attributes:
        island_time: the current simulated time of each island, seconds.
        comm_busy_s: total seconds during which a collective was in flight (for reports).
        blocked_s: per island, seconds spent waiting for collectives or slower islands.
        codec_s: per island, seconds charged for encoding and decoding payloads (:meth:`charge_codec`).
        trace: records the requests, for :func:`replay` at another link (None: not recorded).
    """

    islands: int
    island_time: list[float] = field(default_factory=list)
    comm_busy_s: float = 0.0
    blocked_s: list[float] = field(default_factory=list)
    link_free_at: float = 0.0
    trace: ClockTrace | None = None
    codec_s: list[float] = field(default_factory=list)
    #: charges measured on a device but not yet read (CUDA events): settled before the clocks are read
    _deferred: list[Callable[[], None]] = field(default_factory=list, repr=False, compare=False)

    def defer(self, settle: Callable[[], None]) -> None:
        """Have ``settle`` (which calls :meth:`compute`) run before the clocks are next read, so that an island
        on an accelerator is timed without the host waiting for each step (once per callable)."""
        if not any(f == settle for f in self._deferred):
            self._deferred.append(settle)

    def settle(self) -> None:
        """Run the deferred charges (:meth:`defer`)."""
        deferred, self._deferred = self._deferred, []
        for f in deferred:
            f()

    def __post_init__(self) -> None:
        if not self.island_time:
            self.island_time = [0.0] * self.islands
        if not self.blocked_s:
            self.blocked_s = [0.0] * self.islands
        if not self.codec_s:
            self.codec_s = [0.0] * self.islands

    def compute(self, island: int, seconds: float) -> None:
        """Advance ``island``'s clock by ``seconds`` of compute."""
        self.island_time[island] += seconds
        if self.trace is not None:
            self.trace.compute(island, seconds)

    def charge_codec(self, seconds: list[float]) -> None:
        """Advance each island's clock by its codec seconds (``seconds[i]`` for island ``i``: encoding its
        payload before a collective, or decoding the payloads after it); not counted as compute."""
        self.settle()
        if len(seconds) != self.islands:
            raise ValueError(f"charge_codec: {len(seconds)} values for {self.islands} islands")
        for i, s in enumerate(seconds):
            self.island_time[i] += s
            self.codec_s[i] += s
        if self.trace is not None:
            self.trace.codec(list(seconds))

    def start_collective(self, duration_s: float, cost: tuple[float, int] | None = None) -> float:
        """Start a collective once the last island arrives and the links are free; return its end time.

        Collectives in flight share the links one after another (the next starts when the previous ends).
        ``cost`` = (bytes each island sends, sequential rounds) is what the trace records; its id is then
        :attr:`last_collective`.
        """
        self.settle()
        self.last_collective = None if self.trace is None or cost is None else self.trace.collective(*cost)
        start = max(max(self.island_time), self.link_free_at)
        self.comm_busy_s += duration_s
        self.link_free_at = start + duration_s
        return self.link_free_at

    last_collective: int | None = None

    def wait_until(self, island: int, t: float, collective: int | None = None) -> None:
        """Block ``island`` until simulated time ``t`` (no-op if already later).

        ``collective``: the id of the collective waited for (:attr:`last_collective` at its start), for
        the trace.
        """
        self.settle()
        if self.trace is not None:
            if collective is None:
                self.trace.complete = False  # a wait the trace cannot attribute: it cannot be replayed
            else:
                self.trace.wait(island, collective)
        if t > self.island_time[island]:
            self.blocked_s[island] += t - self.island_time[island]
            self.island_time[island] = t

    def collective(self, duration_s: float, cost: tuple[float, int] | None = None) -> float:
        """A blocking collective: every island waits for its completion. Returns the completion time."""
        end = self.start_collective(duration_s, cost)
        ident = self.last_collective
        for i in range(self.islands):
            self.wait_until(i, end, ident)
        return end

    def mark(self, label: int) -> None:
        """Mark a point of the run (an evaluation after inner step ``label``) in the trace, for :func:`replay`."""
        self.settle()
        if self.trace is not None:
            self.trace.mark(label)

    @property
    def wall_s(self) -> float:
        """Simulated wall time of the run so far: the latest island clock, seconds."""
        self.settle()
        return max(self.island_time) if self.island_time else 0.0

    def state_dict(self) -> dict:
        self.settle()
        state = {"island_time": list(self.island_time), "comm_busy_s": self.comm_busy_s,
                 "blocked_s": list(self.blocked_s), "link_free_at": self.link_free_at, "codec_s": list(self.codec_s)}
        if self.trace is not None:
            state["trace"] = self.trace.snapshot()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.island_time = [float(x) for x in state["island_time"]]
        self.comm_busy_s = float(state["comm_busy_s"])
        self.blocked_s = [float(x) for x in state["blocked_s"]]
        self.link_free_at = float(state["link_free_at"])
        self.codec_s = [float(x) for x in state.get("codec_s", [0.0] * self.islands)]  # older checkpoints: none
        if self.trace is not None:
            if "trace" in state:  # the trace up to the checkpoint, continued by this process
                self.trace.restore(state["trace"])
            else:  # a checkpoint written without it: what ran before is not recorded
                self.trace.complete = False
