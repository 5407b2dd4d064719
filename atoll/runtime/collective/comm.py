"""The collectives of the collective runtime: one payload cut into one piece per rank of an island, moved
across islands over ``torch.distributed`` (see the package docstring for the layout and the byte counts).

Deadlines: each exchange gets its own, sized from the bytes it sends and the configured link
(:func:`exchange_deadline_s`: ``bytes * 8 / bandwidth * DEADLINE_SAFETY + rounds * latency + floor``, the floor
being ``collective_timeout_s``), because one fixed timeout cannot both find a hung peer in a minute and let a
1B-parameter float32 all-reduce cross a 1 Gbit/s link (about 64 s for 8 islands). The wait for the exchange
has that deadline in user space (``Work.wait(timeout)``: the backend's error, a :class:`PeerFailure`, when it
passes), and the cross-island group's own timeout (gloo's per-operation timeout, NCCL's watchdog) is raised to
it first where it is longer, so the backend never fails a healthy exchange before its deadline. A dead peer is
still found within seconds by the heartbeat (:mod:`atoll.runtime.collective.heartbeat`), whatever the payload.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from atoll.algorithms.merge import average_decoded
from atoll.algorithms.wire import Wire
from atoll.errors import ConfigError
from atoll.runtime.collective.failure import PeerFailure, dist_call
from atoll.runtime.comm import Comm, Work
from atoll.runtime.network import Link, ring_allgather_bytes, ring_allreduce_bytes

T = TypeVar("T")

#: an exchange's transfer time at the configured link is multiplied by this in its deadline: room for a link
#: slower than configured (shared, congested, TCP's slow start) and for a peer that joins the exchange late
DEADLINE_SAFETY = 4.0


def exchange_deadline_s(bytes_sent: float, rounds: int, link: Link, floor_s: float,
                        safety: float = DEADLINE_SAFETY) -> float:
    """The deadline of one exchange, in seconds::

        bytes_sent * 8 / link.bandwidth_bps * safety + rounds * link.latency_s + floor_s

    Args:
        bytes_sent: bytes one island sends in it (the ring cost: 2(K-1)/K of the payload for an all-reduce,
            (K-1) payloads for an all-gather), >= 0.
        rounds: its sequential messages (a ring all-reduce 2(K-1), an all-gather K-1), >= 0.
        link: the slowest link between two islands (``collective_link_mbps``, ``collective_link_latency_ms``).
        floor_s: what any exchange is given, however small (``collective_timeout_s``), > 0.
        safety: the factor on the transfer time, >= 1.

    Raises:
        ValueError: a negative byte count or round count, a floor that is not positive, a factor below 1.
    """
    if bytes_sent < 0 or rounds < 0 or not floor_s > 0 or not safety >= 1:
        raise ValueError(f"exchange_deadline_s: bytes_sent {bytes_sent} and rounds {rounds} must be >= 0, "
                         f"floor_s {floor_s} > 0, safety {safety} >= 1")
    return bytes_sent * 8.0 / link.bandwidth_bps * safety + rounds * link.latency_s + floor_s

# ----------------------------------------------------------------------------------------------------------
# the communication layer


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors of a payload (tensors, lists, tuples, dicts, dataclasses), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors_of(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors_of(x)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors_of(getattr(obj, f.name))]
    return []


def _rebuild(template: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``template`` with its tensors replaced, in :func:`_tensors_of` order, by those of ``tensors``."""
    if isinstance(template, torch.Tensor):
        return next(tensors)
    if isinstance(template, list):
        return [_rebuild(x, tensors) for x in template]
    if isinstance(template, tuple):
        return tuple(_rebuild(x, tensors) for x in template)
    if isinstance(template, dict):
        return {k: _rebuild(v, tensors) for k, v in template.items()}
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        return dataclasses.replace(template, **{f.name: _rebuild(getattr(template, f.name), tensors)
                                                for f in dataclasses.fields(template) if f.init})
    return template


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, as a flat uint8 CPU tensor."""
    t = t.detach().contiguous().reshape(-1).cpu()
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _from_bytes(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The tensor of ``like``'s dtype and shape whose bytes are ``buf`` (uint8, the right length)."""
    return buf.clone().view(like.dtype).reshape(like.shape)


class DistWork(Work):
    """A collective in flight over ``torch.distributed``; ``wait()`` finishes it once and keeps the result."""

    def __init__(self, finish: Callable[[], tuple[torch.Tensor, float]]) -> None:
        self._finish: Callable[[], tuple[torch.Tensor, float]] | None = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result, self.weight = self._finish()
            self._finish = None
        assert self._result is not None
        return self._result


class _Exchange:
    """One payload moved across islands, cut into one piece per rank of the island (see the module doc).

    Started at construction (the cross-island part runs in the background, ``async_op=True``) and counted
    ``cost(islands)`` bytes; :meth:`result` waits for it and all-gathers the pieces inside the island, and
    gives it on the CPU, or on the comm's device with ``on_device``. While it is pending, a lost island makes
    the comm start it again over the survivors' groups (recounted at their number).
    """

    def __init__(self, comm: DistComm, buf: torch.Tensor | Callable[[], torch.Tensor], gather: bool,
                 cost: Callable[[int], float], replicated: bool = False, on_device: bool = False) -> None:
        # an all-reduce sums in place, into the buffer itself: ``buf`` is then a function that builds it (again
        # for a relaunch after a loss), so the payload is written once and never copied
        self.make = buf if callable(buf) else (lambda: buf)
        self.buf = self.make()
        self.comm, self.gather, self.length, self.cost = comm, gather, self.buf.numel(), cost
        self.on_device = on_device  # the result stays on the comm's device (else it is copied to the CPU)
        # a payload every rank of the island holds alike is cut into one piece per rank, sharded island or not
        self.cut = comm.ranks_per_island if replicated else comm.cut
        self.launches = 0
        self.counted = cost(comm.islands)
        self.deadline_s = comm.floor_s  # set for the groups it is launched over (launch())
        self.started, self.relaunched = time.perf_counter(), False
        comm._count(self.counted, island_sum=not replicated)
        comm.resilient(self.launch)
        comm.pending.append(self)

    def launch(self) -> None:
        """Start the cross-island part over the comm's current groups (recounting the bytes if they changed)."""
        comm = self.comm
        if self.launches:  # a relaunch: the summed-in-place buffer is rebuilt from its source
            self.buf = self.make()
        self.launches += 1
        buf = self.buf
        counted = self.cost(comm.islands)
        self.relaunched = self.relaunched or counted != self.counted
        comm.bytes_sent_per_island += counted - self.counted
        comm.bytes_received_per_island += counted - self.counted  # a ring: as much in as out
        self.counted = counted
        rounds = (comm.islands - 1) * (1 if self.gather else 2)
        self.deadline_s = comm.deadline_s(counted, rounds)
        comm.allow(self.deadline_s)  # the backend must not fail it first
        r_count = self.cut
        size = -(-max(1, buf.numel()) // r_count)
        if size * r_count != buf.numel():
            buf = torch.cat([buf, buf.new_zeros(size * r_count - buf.numel())])
        part = comm.position if r_count > 1 else 0
        piece = buf[part * size:(part + 1) * size].contiguous().to(comm.device)
        if self.gather:
            self.parts = [torch.empty_like(piece) for _ in range(comm.islands)]
            self.handle = dist_call(dist.all_gather, self.parts, piece, group=comm.cross_group, async_op=True)
        else:
            self.parts = [piece]
            self.handle = dist_call(dist.all_reduce, piece, group=comm.cross_group, async_op=True)

    def result(self) -> torch.Tensor:
        """All-reduce: the summed buffer (the input's length). All-gather: (islands alive, length), island order.
        On the CPU, or on the comm's device with ``on_device``."""
        comm = self.comm
        out = comm.resilient(self._finish)
        comm.pending.remove(self)
        comm.degraded_exchanges += comm.islands < comm.full_islands
        if self.relaunched:  # the exchange a loss interrupted: its wall time, failure and recovery included
            comm.interrupted_s.append(time.perf_counter() - self.started)
            comm.resumed_at.append(time.time())
        return out

    def _finish(self) -> torch.Tensor:
        comm = self.comm
        dist_call(self.handle.wait, timeout=timedelta(seconds=self.deadline_s))  # its own deadline, in user space
        local = self.parts[0][None] if len(self.parts) == 1 else torch.stack(self.parts)  # (islands or 1, piece)
        if self.cut > 1:
            pieces = [torch.empty_like(local) for _ in range(self.cut)]
            dist_call(dist.all_gather, pieces, local, group=comm.island_group)
            local = torch.cat(pieces, dim=1)  # pieces side by side, in position order
        local = local[:, :self.length]
        if not self.on_device:
            local = local.cpu()
        return local if self.gather else local[0]


class DistComm(Comm):
    """Collectives across the islands of a job, one island per process, over ``torch.distributed``.

    Args:
        islands: K, islands in the job (the islands alive, once one was lost).
        island: the island this process runs.
        ranks_per_island: R, ranks per island.
        position: this rank's position in its island (0..R-1).
        cross_group: the process group of the ranks at ``position`` in every island (island order).
        island_group: the process group of this island's ranks (None when R = 1).
        device: where tensors travel from (the GPU of this rank for NCCL, the CPU for gloo).
        sharded: the island is sharded (``shard_island``): each rank's payload is its own shard of the
            island's, moved whole over its cross-island group (no cut, no all-gather inside the island), and
            the bytes counted are the sum over the island's ranks (one scalar all-reduce per exchange).
        link: the slowest link between two islands, which each exchange's deadline assumes
            (:func:`exchange_deadline_s`; None: no transfer time, the floor alone).
        floor_s: the least deadline of an exchange, and the timeout the process groups are created with
            (``collective_timeout_s``).

    All methods are collective: every rank of the job calls them in the same order. :meth:`resilient` runs
    each one; when ``recover`` is set, a :class:`PeerFailure` calls ``recover(failure, op)`` (``op``: the
    number of the operation that failed, the same on every rank), which re-forms the groups with the
    islands alive (:meth:`regroup`) or ends the process; the collectives pending are then started again
    and the operation is retried.
    """

    def __init__(self, islands: int, island: int, ranks_per_island: int, position: int,
                 cross_group: Any, island_group: Any, device: torch.device, sharded: bool = False,
                 link: Link | None = None, floor_s: float = 60.0) -> None:
        super().__init__()
        self.link = link if link is not None else Link(math.inf, 0.0)
        self.floor_s = floor_s
        self.group_timeout_s = floor_s  # the cross-island group's timeout now (raised by allow())
        self.islands = islands
        self.local_islands = [island]
        self.ranks_per_island = ranks_per_island
        self.position = position
        self.cross_group = cross_group
        self.island_group = island_group
        self.device = device
        self.sharded = sharded
        self.cut = 1 if sharded else ranks_per_island  # pieces one payload is cut into, one per rank
        self.recover: Callable[[PeerFailure, int], None] | None = None
        self.ops = 0  # operations run through resilient(), the same count on every rank
        self.pending: list[_Exchange] = []
        self.full_islands = islands
        self.degraded_exchanges = 0  # exchanges finished with fewer islands than the job started with
        self.interrupted_s: list[float] = []  # wall seconds of each exchange that a loss interrupted
        self.resumed_at: list[float] = []  # wall clock (Unix seconds) when each of them finished
        self._buffers: dict[str, torch.Tensor] = {}  # per key, the all-reduce buffer (CPU)

    def resilient(self, op: Callable[[], T]) -> T:
        """``op()``, run again over the survivors' groups after a lost island (see the class doc).

        Raises:
            PeerFailure: a rank failed and nothing recovers (``recover`` is None).
        """
        seq, self.ops = self.ops, self.ops + 1
        relaunch = False
        while True:
            try:
                if relaunch:
                    for exchange in list(self.pending):
                        exchange.launch()
                return op()
            except PeerFailure as e:
                if self.recover is None:
                    raise
                self.recover(e, seq)
                relaunch = True

    def regroup(self, islands: int, cross_group: Any, island_group: Any) -> None:
        """Use the survivors' groups from now on (``islands`` alive; this rank's position is unchanged); new
        groups have the floor's timeout."""
        self.islands, self.cross_group, self.island_group = islands, cross_group, island_group
        self.group_timeout_s = self.floor_s

    def deadline_s(self, bytes_sent: float, rounds: int) -> float:
        """The deadline of an exchange sending ``bytes_sent`` bytes per island in ``rounds`` messages, seconds
        (:func:`exchange_deadline_s` at this comm's link and floor)."""
        return exchange_deadline_s(bytes_sent, rounds, self.link, self.floor_s)

    def allow(self, deadline_s: float) -> None:
        """Raise the cross-island group's own timeout (gloo's per operation, NCCL's watchdog) to ``deadline_s``
        where it is shorter, so the backend does not fail an exchange before its deadline; local, no collective."""
        if deadline_s > self.group_timeout_s and self.cross_group is not None:
            _set_pg_timeout(timedelta(seconds=deadline_s), group=self.cross_group)
            self.group_timeout_s = deadline_s

    def _count(self, bytes_sent: float, island_sum: bool = True) -> None:
        if self.sharded and island_sum:  # the island's bytes: what each of its ranks sent for its shard, summed
            total = torch.tensor([bytes_sent], dtype=torch.float64, device=self.device)
            dist_call(dist.all_reduce, total, group=self.island_group)
            bytes_sent = float(total)
        super()._count(bytes_sent)

    def _check(self, per_island: Sequence[Any]) -> None:
        if len(per_island) != 1:
            raise ValueError(f"collective runtime runs one island per process; got {len(per_island)} entries")

    def start_all_reduce_mean(self, per_island: Sequence[torch.Tensor],
                              weights: Sequence[float] | None = None, wire: Wire | None = None,
                              key: str = "") -> DistWork:
        """See :meth:`Comm.start_all_reduce_mean`; the cross-island transfer runs in the background.

        Without a codec: a ring all-reduce of ``[w * x, w]`` (float32), then the sum divided by the sum of
        the weights, on the CPU; counted ``2(K-1)/K * 4 * numel`` bytes. With a codec: each island encodes its
        tensor (with its error feedback and random source), the packed payloads (``8`` bytes of float64
        weight, then the codec's) are all-gathered, and every island decodes them in island order and
        averages in float32, exactly as :func:`~atoll.algorithms.merge.average_encoded` does; counted
        ``(K-1) * payload`` bytes. All of it runs on the comm's device (``self.device``: the GPU under NCCL,
        the CPU under gloo), where the result is (float32 ``(numel,)``), the wire's residuals and random
        source too; the host reads the K weights once, at ``wait()``.

        Raises:
            ConfigError: a weight that is negative or not finite (weights of every island summing to zero
                give a NaN mean, as the local runtime's).
            PeerFailure: another rank failed or the deadline passed (at ``wait()``).
        """
        self._check(per_island)
        x = per_island[0].detach().reshape(-1)
        w = 1.0 if weights is None else float(weights[0])
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"weights: must be finite and >= 0, got {w}")
        n = x.numel()
        codec = wire.codec if wire is not None else None
        if codec is None:
            def weighted() -> torch.Tensor:  # [w * x, w], written once where the collective runs (no host trip)
                buf = self._buffer(key, n + 1)
                torch.mul(x.to(self.device, torch.float32, non_blocking=True), w, out=buf[:n])
                buf[n] = w
                return buf

            exchange = _Exchange(self, weighted, gather=False, cost=lambda k: ring_allreduce_bytes(4 * n, k))

            def finish_sum() -> tuple[torch.Tensor, float]:
                total = exchange.result()
                weight = float(total[n])
                return (total[:n].div_(weight) if weight > 0 else torch.full((n,), math.nan)), weight

            return DistWork(finish_sum)

        # the codec, its error feedback and its random source run where the collective does: encoded, packed,
        # gathered, decoded and averaged on the comm's device, no host trip but the weights' read at the end
        device = self.device
        x = x.to(device, torch.float32)
        assert wire is not None
        if w == 0.0:  # like average_encoded: not encoded, its residual and random source untouched
            packed = torch.zeros(codec.payload_bytes(n), dtype=torch.uint8, device=device)
        else:
            packed = wire.encode(0, x, key).pack()
        header = torch.full((1,), w, dtype=torch.float64, device=device).view(torch.uint8)  # a fill: no host copy
        exchange = _Exchange(self, torch.cat([header, packed]), gather=True,
                             cost=lambda k: ring_allgather_bytes(packed.numel(), k), on_device=True)

        def finish_decode() -> tuple[torch.Tensor, float]:
            rows = exchange.result()  # (islands, 8 + payload bytes), on the comm's device
            # every island's weight in one host read: the (islands, 8) header bytes, viewed as float64
            # (cloned with rows of 8 bytes: one row's slice keeps the gathered row's stride, and float64 needs 8)
            heads = rows[:, :8].cpu().clone(memory_format=torch.contiguous_format)
            ws = heads.view(torch.float64).reshape(-1).tolist()
            if sum(ws) <= 0:
                return torch.full((n,), math.nan, device=device), 0.0
            return average_decoded(codec, [row[8:].contiguous() for row in rows], n, ws, device=device), sum(ws)

        return DistWork(finish_decode)

    def _buffer(self, key: str, numel: int) -> torch.Tensor:
        """A float32 buffer of ``numel`` on the comm's device for an all-reduce of ``key``: on the CPU kept for
        the next exchange of the key (a fresh one costs a page fault per 4 KiB, more than the sum); elsewhere
        new (the caching allocator reuses memory)."""
        if not key or self.device.type != "cpu":
            return torch.empty(numel, dtype=torch.float32, device=self.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=torch.float32)
        return buf

    def all_gather(self, per_island: Sequence[Any], payload_bytes: int, replicated: bool = False) -> list[Any]:
        """See :meth:`Comm.all_gather`. The payload's tensors travel as one byte buffer.

        A sharded island's ranks each send their own payload, unless ``replicated`` (every rank of the island
        holds the same one, e.g. demo's, selected from whole tensors): it is then cut into one piece per rank
        and counted once, as an unsharded island's.

        Every island's payload must have the same structure, tensor shapes and dtypes (DeMo's do); the
        gathered payloads are rebuilt on the CPU. Counted ``(K-1) * bytes of the tensors``.

        Raises:
            PeerFailure: another rank failed or the deadline passed.
        """
        self._check(per_island)
        template = per_island[0]
        tensors = _tensors_of(template)
        parts = [_as_bytes(t) for t in tensors]
        packed = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        rows = _Exchange(self, packed, gather=True, cost=lambda k: ring_allgather_bytes(packed.numel(), k),
                         replicated=replicated).result()
        sizes = [p.numel() for p in parts]
        out = []
        for row in rows:
            chunks = iter(_from_bytes(c, t) for c, t in zip(torch.split(row, sizes), tensors, strict=True))
            out.append(_rebuild(template, chunks))
        return out


