"""The simulated network: counted bytes turned into seconds, and a clock per island.

Cost model (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms"): a ring all-reduce of a
payload of ``B`` bytes over ``K`` islands runs a reduce-scatter and an all-gather, ``2(K-1)`` rounds in
which every island sends ``B/K`` bytes. So each island sends ``2(K-1)/K * B`` bytes and the collective
takes ``2(K-1)/K * B * 8 / bandwidth + 2(K-1) * latency`` seconds. A ring all-gather of ``B`` bytes per
island sends ``(K-1) * B`` bytes per island in ``K-1`` rounds.

Each island's link is the bottleneck (its upload bandwidth, as for volunteers on home internet or a region
behind a WAN gateway); links are full duplex.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """

    islands: int
    island_time: list[float] = field(default_factory=list)
    comm_busy_s: float = 0.0
    blocked_s: list[float] = field(default_factory=list)
    link_free_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.island_time:
            self.island_time = [0.0] * self.islands
        if not self.blocked_s:
            self.blocked_s = [0.0] * self.islands

    def compute(self, island: int, seconds: float) -> None:
        """Advance ``island``'s clock by ``seconds`` of compute."""
        self.island_time[island] += seconds

    def start_collective(self, duration_s: float) -> float:
        """Start a collective once the last island arrives and the links are free; return its end time.

        Collectives in flight share the links one after another (the next starts when the previous ends).
        """
        start = max(max(self.island_time), self.link_free_at)
        self.comm_busy_s += duration_s
        self.link_free_at = start + duration_s
        return self.link_free_at

    def wait_until(self, island: int, t: float) -> None:
        """Block ``island`` until simulated time ``t`` (no-op if already later)."""
        if t > self.island_time[island]:
            self.blocked_s[island] += t - self.island_time[island]
            self.island_time[island] = t

    def collective(self, duration_s: float) -> float:
        """A blocking collective: every island waits for its completion. Returns the completion time."""
        end = self.start_collective(duration_s)
        for i in range(self.islands):
            self.wait_until(i, end)
        return end

    @property
    def wall_s(self) -> float:
        """Simulated wall time of the run so far: the latest island clock, seconds."""
        return max(self.island_time) if self.island_time else 0.0

    def state_dict(self) -> dict:
        return {"island_time": list(self.island_time), "comm_busy_s": self.comm_busy_s,
                "blocked_s": list(self.blocked_s), "link_free_at": self.link_free_at}

    def load_state_dict(self, state: dict) -> None:
        self.island_time = [float(x) for x in state["island_time"]]
        self.comm_busy_s = float(state["comm_busy_s"])
        self.blocked_s = [float(x) for x in state["blocked_s"]]
        self.link_free_at = float(state["link_free_at"])
