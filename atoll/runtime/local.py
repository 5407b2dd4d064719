"""The ``local`` runtime: every island in one process, run in turn, on a simulated network clock.

Collectives are computed in memory (deterministic, in island order). Their cost is not paid in real time:
the bytes each island would send are counted, and :class:`~atoll.runtime.network.Link` turns them into
seconds on each island's :class:`~atoll.runtime.network.SimClock`. Compute time is measured for real, and
so is a lossy codec's: each island is charged the seconds it took to encode its tensor before the collective
starts, and the seconds to decode every island's payload once it waits for the result.
This is the runtime of research sweeps and tests. :class:`LocalRuntime` is what the training loop sees.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from atoll.algorithms.merge import CodecTimes, average_encoded, weighted_mean
from atoll.algorithms.wire import Wire
from atoll.errors import CheckpointError
from atoll.job.device import island_devices, synchronize
from atoll.runtime.base import Runtime
from atoll.runtime.comm import Comm, Work
from atoll.runtime.network import ClockTrace, Link, SimClock, ring_allgather_bytes, ring_allreduce_bytes

if TYPE_CHECKING:
    from pathlib import Path

    from atoll.config.facts import RunFacts
    from atoll.config.runtimes import LocalConfig
    from atoll.job.island import Island
    from atoll.strategies.base import Strategy


class LocalWork(Work):
    """A simulated collective: its result is known at once, but islands wait for ``done_at`` to use it.

    ``decode_s``: per island, the codec seconds of decoding the payloads, charged once, after the first wait.
    ``weight``: the sum of the contributors' weights (0: nobody contributed; NaN: not known).
    """

    def __init__(self, result: torch.Tensor, done_at: float, clock: SimClock, ident: int | None = None,
                 decode_s: list[float] | None = None, weight: float = math.nan) -> None:
        self.result = result
        self.weight = weight
        self.done_at = done_at
        self.clock = clock
        self.ident = ident  # the collective's id in the clock's trace
        self.decode_s = decode_s

    def wait(self) -> torch.Tensor:
        for i in range(self.clock.islands):
            self.clock.wait_until(i, self.done_at, self.ident)
        if self.decode_s is not None:
            self.clock.charge_codec(self.decode_s)
            self.decode_s = None
        return self.result

    def result_for_checkpoint(self) -> torch.Tensor:
        return self.result


class LocalComm(Comm):
    """In-memory collectives over all islands of one process, charged to a simulated clock.

    Args:
        islands: number of islands (all local).
        link: each island's link, used to turn bytes into seconds.
        clock: the islands' simulated clocks; a blocking collective advances all of them.

    Attributes:
        timer: the clock (seconds) that measures the codec's encode and decode time charged on ``clock``.
    """

    in_memory = True

    def __init__(self, islands: int, link: Link, clock: SimClock) -> None:
        super().__init__()
        self.islands = islands
        self.local_islands = list(range(islands))
        self.link = link
        self.clock = clock
        self.timer: Callable[[], float] = time.perf_counter
        self._buffers: dict[str, torch.Tensor] = {}  # per key, the buffer its mean is accumulated in

    def _check(self, per_island: Sequence[Any]) -> None:
        if len(per_island) != self.islands:
            raise ValueError(f"local runtime expects one entry per island ({self.islands}), got {len(per_island)}")

    def start_all_reduce_mean(self, per_island: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                              wire: Wire | None = None, key: str = "") -> LocalWork:
        self._check(per_island)
        devices = {t.device for t in per_island}
        if (len(devices) > 1 or (wire is not None and wire.codec is not None)) and devices != {torch.device("cpu")}:
            # islands on different devices meet on the CPU; a codec and its error feedback run there
            per_island = [t.to("cpu") for t in per_island]
        total = float(sum(weights)) if weights is not None else float(len(per_island))
        if total <= 0 or wire is None or wire.codec is None:
            if total <= 0:  # no island contributed: the mean is undefined (NaN), as DistComm's
                mean = torch.full((per_island[0].numel(),), math.nan).reshape(per_island[0].shape)
            else:
                mean = weighted_mean(per_island, weights, out=self._buffer(key, per_island[0]))
            payload = (per_island[0].numel() * per_island[0].element_size() if wire is None or wire.codec is None
                       else wire.codec.payload_bytes(per_island[0].numel()))
            done_at = self.charge_allreduce(payload, blocking=False)
            return LocalWork(mean, done_at, self.clock, self.clock.last_collective, weight=total)
        device = per_island[0].device

        def timer() -> float:  # the codec's queued work on an accelerator is waited for
            synchronize(device)
            return self.timer()

        times = CodecTimes(timer)
        mean, payload = average_encoded(per_island, wire.codec, weights, wire.generators_for(device),
                                        feedback=wire.feedback, key=key, times=times,
                                        out=self._buffer(key, per_island[0]),
                                        scratch=self._buffer(key + "/decoded", per_island[0]) if key else None)
        self.clock.charge_codec(times.encode_s)  # each island encodes its tensor before sending it
        done_at = self.charge_allreduce(payload, blocking=False)
        decode = sum(times.decode_s)  # and decodes every island's payload once they arrived
        return LocalWork(mean, done_at, self.clock, self.clock.last_collective, [decode] * self.islands,
                         weight=total)

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        """The float32 buffer the mean of ``key`` is accumulated in, kept from one exchange of that key to the
        next on the CPU (a fresh one there costs a page fault per 4 KiB, more than the sum); None without a key
        or off the CPU (the caching allocator reuses memory there)."""
        if not key or like.device.type != "cpu":
            return None
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape:
            buf = self._buffers[key] = torch.empty(like.shape, dtype=torch.float32)
        return buf

    def charge_allreduce(self, payload_bytes: float, blocking: bool = True) -> float:
        """Count a ring all-reduce of ``payload_bytes`` and charge its time; return its completion time.

        With ``blocking=False`` the islands go on computing; call ``clock.wait_until`` when the result
        is needed (overlapped communication, Streaming DiLoCo §2.3).
        """
        sent = ring_allreduce_bytes(payload_bytes, self.islands)
        self._count(sent)
        duration = self.link.allreduce_seconds(payload_bytes, self.islands)
        cost = (sent, 2 * (self.islands - 1)) if self.islands > 1 else (0.0, 0)
        return (self.clock.collective(duration, cost) if blocking
                else self.clock.start_collective(duration, cost))

    def charge_mean(self, payload_bytes: float, codec_s: float = 0.0) -> None:
        """Count and wait for an all-reduce mean of ``payload_bytes`` per island that the caller computed itself
        (the compiled round, :mod:`atoll.algorithms.fused_round`): the bytes and the seconds of
        :meth:`start_all_reduce_mean`, then its ``wait()``. ``codec_s``: the seconds its codec took (encoding every
        island's payload and decoding them into the mean, in one loop), charged to every island before the
        all-reduce, as each island encodes its own payload and decodes all of them."""
        self.start_charged_mean(torch.empty(0), payload_bytes, codec_s).wait()

    def start_charged_mean(self, result: torch.Tensor, payload_bytes: float, codec_s: float = 0.0,
                           weight: float = math.nan) -> LocalWork:
        """:meth:`charge_mean` without waiting: the all-reduce of a mean the caller computed itself (``result``,
        which the work's ``wait()`` returns) counted and started on the clock, overlapped with what the islands do
        next (Streaming DiLoCo's compiled round); ``weight``: the contributors' weights' sum. ``codec_s``, the
        fused loop's seconds (every island's encode and decode at once: they cannot be told apart), is charged to
        every island now, before the all-reduce starts: an upper bound of an island's own encode (charged there by
        the eager exchange) and its decodes of every payload (charged at ``wait()`` by the eager exchange), so
        with a codec the simulated exchange ends a little later than the eager one's."""
        if codec_s:
            self.clock.charge_codec([codec_s] * self.islands)
        done_at = self.charge_allreduce(payload_bytes, blocking=False)
        return LocalWork(result, done_at, self.clock, self.clock.last_collective, weight=weight)

    def restore_work(self, result: torch.Tensor, done_at: float) -> LocalWork:
        return LocalWork(result, done_at, self.clock)

    def all_gather(self, per_island: Sequence[Any], payload_bytes: int, replicated: bool = False) -> list[Any]:
        self._check(per_island)
        sent = ring_allgather_bytes(payload_bytes, self.islands)
        self._count(sent)
        cost = (sent, self.islands - 1) if self.islands > 1 else (0.0, 0)
        self.clock.collective(self.link.allgather_seconds(payload_bytes, self.islands), cost)
        return list(per_island)


class LocalRuntime(Runtime):
    """Every island in this process, run in turn, on a simulated network clock (:class:`LocalComm`).

    Args:
        config: its own settings: the links of the simulated clock.
        facts: the run's (``islands``, ``device``).
        strategy: the strategy's config (not read here).

    Raises:
        ConfigError: ``device`` names a device that is not there.
    """

    def __init__(self, config: LocalConfig, facts: RunFacts, strategy: Any = None) -> None:
        self.config = config
        self.islands = facts.islands
        self.local_islands = list(range(facts.islands))
        # the trace lets a finished run be re-timed at other links (atoll.runtime.network.replay)
        self.clock = SimClock(facts.islands, trace=ClockTrace(facts.islands))
        link = Link.from_config(config.link_bandwidth_mbps, config.link_latency_ms)
        self.comm = LocalComm(facts.islands, link, self.clock)
        self.devices = island_devices(facts.islands, facts.device)  # GPUs round-robin, or all on one device
        self.device = self.devices[0]

    def save_trace(self, path: Path, sim_wall_s: float) -> None:
        """Write the simulated clock's trace to ``path`` (JSON) with this runtime's link, so the run can be
        re-timed at other links (:func:`atoll.runtime.network.replay`)."""
        trace = self.clock.trace
        if trace is not None:
            trace.save(path, link_bandwidth_mbps=self.config.link_bandwidth_mbps,
                       link_latency_ms=self.config.link_latency_ms, sim_wall_s=sim_wall_s)

    def device_of(self, island: int) -> torch.device:
        return self.devices[island]

    def forward_backward(self, island: Island, batch: torch.Tensor, step: int) -> None:
        island.forward_backward(batch)

    def totals(self, islands: list[Island]) -> tuple[float, int]:
        return sum(i.last_loss for i in islands) / len(islands), sum(i.tokens for i in islands)

    def island_counts(self, islands: list[Island]) -> tuple[list[int], list[int]]:
        return [i.skipped_steps for i in islands], [i.reset_count for i in islands]

    def compute_s(self, islands: list[Island]) -> float:
        return max(i.compute_s for i in islands)

    def run_wall_s(self, real_s: float) -> float:
        return self.clock.wall_s

    def job_state(self, islands: list[Island], strategy: Strategy, **extra: Any) -> dict[str, Any]:
        return {"islands": [i.state_dict() for i in islands], "strategy": strategy.state_dict(),
                "strategy_islands": [strategy.island_state(p) for p in range(len(islands))],
                "comm": self.comm.state_dict(), "clock": self.clock.state_dict(), **extra}

    def load_job_state(self, state: dict[str, Any], islands: list[Island], strategy: Strategy) -> None:
        if len(state["islands"]) != len(islands):
            raise CheckpointError(f"resume: the checkpoint holds {len(state['islands'])} islands, this run "
                                  f"{len(islands)}; resume with the run's own --islands")
        for island, s in zip(islands, state["islands"], strict=True):
            island.load_state_dict(s)
        strategy.load_state_dict(state["strategy"])
        for position, s in enumerate(state["strategy_islands"]):
            strategy.load_island_state(position, s)
        self.comm.load_state_dict(state["comm"])
        self.clock.load_state_dict(state["clock"])
