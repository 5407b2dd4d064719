"""The ``collective`` runtime: every island as real processes over ``torch.distributed``.

Launch on one machine (atoll starts the ``islands x ranks_per_island`` processes itself)::

    atoll train --runtime collective --islands 2 --ranks-per-island 2

or across machines with torchrun (run on every node; atoll reads ``RANK``/``WORLD_SIZE`` from it)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m atoll.cli train --runtime collective --islands 2 --ranks-per-island 2

Process layout: world = ``islands`` x ``ranks_per_island`` (R) ranks; island i is ranks [i*R, (i+1)*R).
Every rank runs one island (the strategy's ``islands`` list has length 1). Two kinds of process groups:

- an *island group* per island (its R ranks): plain data parallel every inner step. Each rank computes
  the gradient of its ``batch_size / R`` rows of the island's batch and the ranks average their gradients
  before the strategy sees them, so an island of R ranks computes what one rank with the whole batch would.
- a *cross-island group* per position r in an island (ranks r, R + r, 2R + r, ...): it carries only what
  the strategy sends. A payload is cut into R equal shards; rank r moves shard r over its cross-island
  group, then the island's ranks all-gather their shards. Every island therefore sends each byte once
  (spread over its R ranks' links), and every rank of every island ends with bitwise the same result.

Backend: NCCL when CUDA is available (each rank on GPU ``LOCAL_RANK``; a gloo group carries checkpoints and
counters), gloo otherwise.

Bytes are counted from the tensors handed to the network, with the ring costs of :mod:`atoll.runtime.network`
(all-reduce of B bytes: 2(K-1)/K*B per island; all-gather of B bytes per island: (K-1)*B). Protocol
scalars (one weight per exchange, and at most R-1 bytes or elements of padding to cut equal shards) are
not counted.

Failure: every collective has the deadline ``collective_timeout_s``. A dead rank usually breaks its
peers' pending collectives at once (gloo: "Connection closed by peer"); a heartbeat through the
rendezvous store also catches a rank that stops without closing its connections (no heartbeat for
``min(10 s, collective_timeout_s)``). The surviving ranks then print one line,
``atoll: error: island J stopped responding at inner step N (<reason>); resume with
'atoll train --resume OUT'``, and exit with status 3 (:data:`EXIT_PEER_FAILURE`) via ``os._exit``,
because a backend with a dead peer can hang in its clean-up. The last checkpoint is the resume point.
The one-machine launcher (:func:`launch`) exits with the status of the first rank that failed.

Test hook: the environment variable ``ATOLL_TEST_KILL_RANK_AT_STEP=RANK:N`` makes global rank RANK kill
itself with SIGKILL as it starts inner step N (1-based). Read only by this runtime; for fault-injection tests.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.algorithms.merge import average_decoded
from atoll.algorithms.wire import Wire
from atoll.checkpoint import new_run_dir
from atoll.config import TrainConfig
from atoll.errors import AtollError, CheckpointError, ConfigError, RunFailed
from atoll.runtime.base import Runtime
from atoll.runtime.comm import Comm, Work
from atoll.runtime.network import SimClock, ring_allgather_bytes, ring_allreduce_bytes

if TYPE_CHECKING:  # the launcher (parent process) runs without importing transformers
    from atoll.island import Island
    from atoll.strategies.base import Strategy

EXIT_PEER_FAILURE = 3  # exit status of a rank that stopped because another rank stopped responding
KILL_HOOK_ENV = "ATOLL_TEST_KILL_RANK_AT_STEP"
HEARTBEAT_S = 0.5  # seconds between two heartbeats of a rank
HEARTBEAT_STALE_S = 10.0  # a rank silent this long (or collective_timeout_s if shorter) is declared dead


class PeerFailure(Exception):
    """A collective failed or timed out: another rank died, hung or became unreachable.

    Args:
        reason: one line saying what the backend reported.
        suspect: the global rank known to have failed, if known.
    """

    def __init__(self, reason: str, suspect: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.suspect = suspect


def _reason(e: BaseException) -> str:
    """The backend's message cut to one short line (no source location, no advice)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    text = text.split(". This is typically")[0].rstrip(". ")
    return text[:160] or type(e).__name__


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a ``torch.distributed`` call; turn a backend failure (RuntimeError) into :class:`PeerFailure`."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise PeerFailure(_reason(e)) from e


def in_worker() -> bool:
    """True in a process started by torchrun or by :func:`launch` (``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


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

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        assert self._result is not None
        return self._result


class _Exchange:
    """One payload moved across islands, cut into one shard per rank of the island (see the module doc).

    Started at construction (the cross-island part runs in the background, ``async_op=True``);
    :meth:`result` waits for it and all-gathers the shards inside the island.
    """

    def __init__(self, comm: DistComm, buf: torch.Tensor, gather: bool) -> None:
        self.comm, self.gather, self.length = comm, gather, buf.numel()
        r_count = comm.ranks_per_island
        size = -(-max(1, buf.numel()) // r_count)
        if size * r_count != buf.numel():
            buf = torch.cat([buf, buf.new_zeros(size * r_count - buf.numel())])
        shard = buf[comm.position * size:(comm.position + 1) * size].contiguous().to(comm.device)
        if gather:
            self.parts = [torch.empty_like(shard) for _ in range(comm.islands)]
            self.handle = _call(dist.all_gather, self.parts, shard, group=comm.cross_group, async_op=True)
        else:
            self.parts = [shard]
            self.handle = _call(dist.all_reduce, shard, group=comm.cross_group, async_op=True)

    def result(self) -> torch.Tensor:
        """All-reduce: the summed buffer (the input's length). All-gather: (islands, length), island order."""
        comm = self.comm
        _call(self.handle.wait)
        local = torch.stack(self.parts)  # (islands or 1, shard)
        if comm.ranks_per_island > 1:
            pieces = [torch.empty_like(local) for _ in range(comm.ranks_per_island)]
            _call(dist.all_gather, pieces, local, group=comm.island_group)
            local = torch.cat(pieces, dim=1)  # shards side by side, in position order
        local = local[:, :self.length].cpu()
        return local if self.gather else local[0]


class DistComm(Comm):
    """Collectives across the islands of a job, one island per process, over ``torch.distributed``.

    Args:
        islands: K, islands in the job.
        island: the island this process runs.
        ranks_per_island: R, ranks per island.
        position: this rank's position in its island (0..R-1).
        cross_group: the process group of the ranks at ``position`` in every island (island order).
        island_group: the process group of this island's ranks (None when R = 1).
        device: where tensors travel from (the GPU of this rank for NCCL, the CPU for gloo).

    All methods are collective: every rank of the job calls them in the same order.
    """

    def __init__(self, islands: int, island: int, ranks_per_island: int, position: int,
                 cross_group: Any, island_group: Any, device: torch.device) -> None:
        super().__init__()
        self.islands = islands
        self.local_islands = [island]
        self.ranks_per_island = ranks_per_island
        self.position = position
        self.cross_group = cross_group
        self.island_group = island_group
        self.device = device

    def _check(self, per_island: Sequence[Any]) -> None:
        if len(per_island) != 1:
            raise ValueError(f"collective runtime runs one island per process; got {len(per_island)} entries")

    def start_all_reduce_mean(self, per_island: Sequence[torch.Tensor],
                              weights: Sequence[float] | None = None, wire: Wire | None = None,
                              key: str = "") -> DistWork:
        """See :meth:`Comm.start_all_reduce_mean`; the cross-island transfer runs in the background.

        Without a codec: a ring all-reduce of ``[w * x, w]`` (float32), then the sum divided by the sum of
        the weights; counted ``2(K-1)/K * 4 * numel`` bytes. With a codec: each island encodes its tensor
        (with its error feedback and random source), the packed payloads are all-gathered, and every
        island decodes them in island order and averages in float32, exactly as
        :func:`~atoll.algorithms.merge.average_encoded` does; counted ``(K-1) * payload`` bytes.

        Raises:
            ConfigError: a weight that is negative or not finite; weights of every island summing to zero
                (at ``wait()``).
            PeerFailure: another rank failed or the deadline passed (at ``wait()``).
        """
        self._check(per_island)
        x = per_island[0].detach().reshape(-1).to("cpu", torch.float32)
        w = 1.0 if weights is None else float(weights[0])
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"weights: must be finite and >= 0, got {w}")
        n = x.numel()
        codec = wire.codec if wire is not None else None
        if codec is None:
            exchange = _Exchange(self, torch.cat([x * w, x.new_tensor([w])]), gather=False)
            self._count(ring_allreduce_bytes(4 * n, self.islands))

            def finish_sum() -> torch.Tensor:
                total = exchange.result()
                if float(total[n]) <= 0:
                    raise ConfigError("weights: the islands' weights sum to zero; nothing to average")
                return total[:n] / total[n]

            return DistWork(finish_sum)

        if w == 0.0:  # like average_encoded: not encoded, its residual and random source untouched
            packed = torch.zeros(codec.payload_bytes(n), dtype=torch.uint8)
        else:
            packed = wire.encode(0, x, key).pack().cpu()  # type: ignore[union-attr]
        header = torch.tensor([w], dtype=torch.float64).view(torch.uint8)
        exchange = _Exchange(self, torch.cat([header, packed]), gather=True)
        self._count(ring_allgather_bytes(packed.numel(), self.islands))

        def finish_decode() -> torch.Tensor:
            rows = exchange.result()  # (islands, 8 + payload bytes)
            ws = [float(row[:8].clone().view(torch.float64)) for row in rows]
            if sum(ws) <= 0:
                raise ConfigError("weights: the islands' weights sum to zero; nothing to average")
            return average_decoded(codec, [row[8:].contiguous() for row in rows], n, ws)

        return DistWork(finish_decode)

    def all_gather(self, per_island: Sequence[Any], payload_bytes: int) -> list[Any]:
        """See :meth:`Comm.all_gather`. The payload's tensors travel as one byte buffer.

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
        self._count(ring_allgather_bytes(packed.numel(), self.islands))
        rows = _Exchange(self, packed, gather=True).result()
        sizes = [p.numel() for p in parts]
        out = []
        for row in rows:
            chunks = iter(_from_bytes(c, t) for c, t in zip(torch.split(row, sizes), tensors, strict=True))
            out.append(_rebuild(template, chunks))
        return out


# ----------------------------------------------------------------------------------------------------------
# failure detection


class _Heartbeat:
    """Each rank bumps a counter in the rendezvous store every :data:`HEARTBEAT_S` seconds and watches the
    others'; a rank that leaves on purpose (done, or stopping after a failure) says so first.

    Args:
        rank, world: this rank and the world size.
        prefix: a key prefix unique to this run.
        stale_s: a rank whose counter has not moved for this long is declared dead.
        on_dead: called from the heartbeat thread as ``on_dead(rank or None, reason)``.
        store_host: the rank hosting the store (0 without a launcher's store), or None.
    """

    def __init__(self, rank: int, world: int, prefix: str, stale_s: float,
                 on_dead: Callable[[int | None, str], None], store_host: int | None) -> None:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=min(10.0, stale_s)))
        self.store = dist.PrefixStore(prefix, client)
        self.rank, self.world, self.stale_s = rank, world, stale_s
        self.on_dead, self.store_host = on_dead, store_host
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.keys = [f"hb/{r}" for r in range(world)] + [f"bye/{r}" for r in range(world)]
        with self.lock:
            self.store.add(f"hb/{rank}", 1)
            self.store.add(f"bye/{rank}", 0)
        self.thread = threading.Thread(target=self._run, name="atoll-heartbeat", daemon=True)

    def start(self) -> None:
        """Start beating (after every rank created its keys: call it after a barrier)."""
        self.thread.start()

    def _read(self) -> tuple[list[int], list[int]]:
        with self.lock:
            values = [int(v) for v in self.store.multi_get(self.keys)]
        return values[:self.world], values[self.world:]

    def _run(self) -> None:
        last = None
        seen = [time.monotonic()] * self.world
        store_ok = time.monotonic()
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                with self.lock:
                    self.store.add(f"hb/{self.rank}", 1)
                beats, bye = self._read()
            except Exception as e:  # the store is gone: its host died
                if time.monotonic() - store_ok > min(3.0, self.stale_s):
                    self.on_dead(self.store_host, f"rendezvous store unreachable: {_reason(e)}")
                continue
            now = store_ok = time.monotonic()
            for r in range(self.world):
                if last is None or beats[r] != last[r] or bye[r]:
                    seen[r] = now
            last = beats
            silent = [r for r in range(self.world) if r != self.rank and now - seen[r] > self.stale_s]
            if silent and not self.stopped.is_set():
                self.on_dead(silent[0], f"no heartbeat for {self.stale_s:.0f} s")

    def leave(self) -> None:
        """Say this rank leaves on purpose, and stop beating."""
        self.stopped.set()
        try:
            with self.lock:
                self.store.add(f"bye/{self.rank}", 1)
        except Exception:
            pass

    def find_dead(self, wait_s: float = 3.0) -> int | None:
        """The lowest rank that neither beats nor said goodbye over ``wait_s`` seconds, or None."""
        try:
            start, _ = self._read()
            alive = {self.rank}
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and len(alive) < self.world:
                time.sleep(0.25)
                beats, bye = self._read()
                alive |= {r for r in range(self.world) if beats[r] != start[r] or bye[r]}
        except Exception:
            return self.store_host
        dead = [r for r in range(self.world) if r not in alive]
        return dead[0] if dead else None


# ----------------------------------------------------------------------------------------------------------
# the runtime


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


def _parse_kill_hook() -> tuple[int, int] | None:
    value = os.environ.get(KILL_HOOK_ENV)
    if not value:
        return None
    try:
        rank, step = value.split(":")
        return int(rank), int(step)
    except ValueError:
        raise ConfigError(f"{KILL_HOOK_ENV}: expected RANK:STEP (e.g. 1:7), got {value!r}") from None


class CollectiveRuntime(Runtime):
    """This process is one rank of one island; the job is ``islands x ranks_per_island`` processes.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets
    them. :meth:`start` joins the process groups (deadline ``collective_timeout_s``).

    Args:
        config: the run's configuration.

    Raises:
        ConfigError: ``WORLD_SIZE`` is not ``islands x ranks_per_island``.
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.islands, self.ranks_per_island = config.islands, config.ranks_per_island
        if self.world != self.islands * self.ranks_per_island:
            raise ConfigError(f"ranks_per_island: {self.world} processes were started but islands x "
                              f"ranks_per_island = {self.islands} x {self.ranks_per_island}; start that many "
                              "(torchrun --nnodes x --nproc-per-node) or change --islands/--ranks-per-island")
        self.island, self.position = divmod(self.rank, self.ranks_per_island)
        self.local_islands = [self.island]
        self.is_main = self.rank == 0
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local_rank) if self.backend == "nccl" else torch.device("cpu")
        self.timeout = timedelta(seconds=config.collective_timeout_s)
        self.kill_at = _parse_kill_hook()
        self.step: int | None = None  # the 0-based inner step in progress, once the loop runs
        self.heartbeat: _Heartbeat | None = None
        self._aborting = threading.Lock()

    # --- joining and leaving ----------------------------------------------------------------------
    def start(self) -> None:
        """Join the default group, one island group per island, one cross-island group per position."""
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        _call(dist.init_process_group, self.backend, timeout=self.timeout)
        r_count, k = self.ranks_per_island, self.islands
        island_groups = ([_call(dist.new_group, list(range(i * r_count, (i + 1) * r_count)),
                                timeout=self.timeout) for i in range(k)] if r_count > 1 else [None] * k)
        cross_groups = [_call(dist.new_group, [i * r_count + p for i in range(k)], timeout=self.timeout)
                        for p in range(r_count)]
        # checkpoints and counters travel as CPU objects: a gloo group even when the collectives use NCCL
        self.control = (_call(dist.new_group, backend="gloo", timeout=self.timeout)
                        if self.backend == "nccl" else dist.group.WORLD)
        self.island_group = island_groups[self.island]
        self.comm = DistComm(k, self.island, r_count, self.position, cross_groups[self.position],
                             self.island_group, self.device)
        nonce = [uuid.uuid4().hex if self.is_main else None]
        _call(dist.broadcast_object_list, nonce, src=0, group=self.control)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.heartbeat = _Heartbeat(self.rank, self.world, f"atoll/{nonce[0]}/",
                                    min(HEARTBEAT_STALE_S, self.config.collective_timeout_s),
                                    lambda rank, reason: self.abort(reason, rank, wait=False),
                                    store_host=None if agent_store else 0)
        _call(dist.barrier, group=self.control)
        self.heartbeat.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM,
                          lambda *_: self.abort("stopped by SIGTERM", wait=False, signalled=True))

    @contextmanager
    def guard(self) -> Iterator[None]:
        """A lost peer (in a collective, or a silent heartbeat) ends this process: one line, status 3."""
        try:
            yield
            if self.heartbeat is not None:
                self.heartbeat.leave()
                _call(dist.barrier, group=self.control)  # every rank is done: nobody needs the store
                dist.destroy_process_group()
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except PeerFailure as e:
            self.abort(e.reason, e.suspect)

    def abort(self, reason: str, suspect: int | None = None, wait: bool = True,
              signalled: bool = False) -> None:
        """Print why this rank stops and exit with :data:`EXIT_PEER_FAILURE` (does not return).

        Called from the main thread (a failed collective), the heartbeat thread or the SIGTERM handler;
        the first caller wins, later callers return at once (``wait=False``) or block until the exit.
        """
        if not self._aborting.acquire(blocking=wait):
            return
        if self.heartbeat is not None:
            self.heartbeat.leave()
            if suspect is None:
                suspect = self.heartbeat.find_dead()
        where = f"at inner step {self.step + 1}" if self.step is not None else "while starting"
        resume = f"resume with 'atoll train --resume {self.config.out}'" if self.config.out else \
            "resume with 'atoll train --resume OUT'"
        if signalled and suspect is None:
            line = f"atoll: error: stopped by SIGTERM {where}; {resume}"
        else:
            who = f"island {suspect // self.ranks_per_island}" if suspect is not None else "another island"
            line = f"atoll: error: {who} stopped responding {where} ({reason}); {resume}"
        try:
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
        finally:
            os._exit(EXIT_PEER_FAILURE)

    # --- what the loop asks ------------------------------------------------------------------------
    def forward_backward(self, island: Island, batch: torch.Tensor, step: int) -> None:
        """This rank's rows of the island's batch, then the gradient averaged over the island's ranks."""
        self.step = step
        if self.kill_at == (self.rank, step + 1):
            os.kill(os.getpid(), signal.SIGKILL)  # test hook (see the module docstring)
        r_count = self.ranks_per_island
        rows = batch.shape[0] // r_count
        mine = batch[self.position * rows:(self.position + 1) * rows]
        island.forward_backward(mine)
        if r_count == 1:
            return
        island.tokens += (r_count - 1) * mine[:, 1:].numel()  # the island's tokens, as one rank would count
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in island.params]
        loss = torch.tensor([island.last_loss], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss])
        _call(dist.all_reduce, flat, group=self.island_group)
        flat.div_(r_count)
        offset = 0
        for p in island.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        island.last_loss = float(flat[-1])

    def totals(self, islands: list[Island]) -> tuple[float, int]:
        first = self.position == 0  # one rank per island reports it
        buf = torch.tensor([sum(i.last_loss for i in islands) if first else 0.0,
                            sum(i.tokens for i in islands) if first else 0.0], dtype=torch.float64)
        _call(dist.all_reduce, buf, group=self.control)
        return float(buf[0]) / self.islands, int(buf[1])

    def compute_s(self, islands: list[Island]) -> float:
        buf = torch.tensor([max(i.compute_s for i in islands)], dtype=torch.float64)
        _call(dist.all_reduce, buf, op=dist.ReduceOp.MAX, group=self.control)
        return float(buf[0])

    def run_wall_s(self, real_s: float) -> float:
        return real_s

    def job_state(self, islands: list[Island], strategy: Strategy, **extra: Any) -> dict[str, Any] | None:
        """Gather every island's state on rank 0 (``gather_object``), in the ``local`` runtime's format.

        Every rank takes the strategy's state (it may finish an exchange in flight, an island collective);
        one rank per island sends it with its islands' states. The clock entry is a
        :class:`~atoll.runtime.network.SimClock` state at the real wall time ``extra["wall_s"]``, so the
        ``local`` runtime can resume the checkpoint.
        """
        shared = strategy.state_dict()
        mine = ((self.island, [_to_cpu(i.state_dict()) for i in islands],
                 [_to_cpu(strategy.island_state(p)) for p in range(len(islands))]) if self.position == 0 else None)
        gathered: list[Any] | None = [None] * self.world if self.is_main else None
        _call(dist.gather_object, mine, gathered, dst=0, group=self.control)
        if gathered is None:
            return None
        entries = sorted((g for g in gathered if g is not None), key=lambda g: g[0])
        wall = float(extra.get("wall_s", 0.0))
        return {"islands": [s for e in entries for s in e[1]], "strategy": _to_cpu(shared),
                "strategy_islands": [s for e in entries for s in e[2]],
                "comm": self.comm.state_dict(),
                "clock": SimClock(self.islands, [wall] * self.islands).state_dict(), **extra}

    def load_job_state(self, state: dict[str, Any], islands: list[Island], strategy: Strategy) -> None:
        """Each rank loads its own island's entry (the checkpoint must be readable on every node)."""
        if len(state["islands"]) != self.islands:
            raise CheckpointError(f"resume: the checkpoint holds {len(state['islands'])} islands, this run "
                                  f"{self.islands}; resume with the run's own --islands")
        for island in islands:
            island.load_state_dict(state["islands"][island.index])
        strategy.load_state_dict(state["strategy"])
        for position, island in enumerate(islands):
            strategy.load_island_state(position, state["strategy_islands"][island.index])
        self.comm.load_state_dict(state["comm"])


# ----------------------------------------------------------------------------------------------------------
# launching on one machine


def launch(config: TrainConfig, resume: bool = False, grace_s: float = 30.0) -> dict[str, Any]:
    """Run ``config`` as ``islands x ranks_per_island`` local processes; return rank 0's summary.

    The parent hosts the rendezvous store (as torchrun's agent does, so the store outlives any rank),
    prepares the data once (the ranks then read it from the cache), and starts the ranks with ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set. The ranks are forked from a
    ``multiprocessing`` fork server that imported atoll once, so they start in a fraction of a second
    instead of each importing torch and transformers. No rank is restarted. When a rank fails, the others
    get ``grace_s`` seconds to notice and stop by themselves (they print why); any still running are then
    killed.

    Args:
        config: the run (``runtime="collective"``).
        resume: continue the run in ``config.out`` from its latest checkpoint.
        grace_s: seconds the other ranks get to stop after the first failure.

    Returns:
        The summary that rank 0 wrote to ``<out>/summary.json``.

    Raises:
        ConfigError: ``out`` holds a run already (without ``resume``).
        RunFailed: a rank failed; ``exit_code`` is its exit status (128 + N when killed by signal N).
    """
    import json
    import multiprocessing

    from atoll.data import default_cache_dir, prepare_data

    out = Path(config.out) if resume else new_run_dir(config.out, config.strategy)  # type: ignore[arg-type]
    config = config.model_copy(update={"out": out})
    world = config.islands * config.ranks_per_island
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["atoll.train"])
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=config.collective_timeout_s),
                          wait_for_workers=False)
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if config.threads is None and "OMP_NUM_THREADS" not in os.environ:  # as torchrun: no oversubscription
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    procs = [ctx.Process(target=_rank_main, name=f"atoll-rank{r}",
                         args=(config, resume, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
             for r in range(world)]
    first: tuple[int, int] | None = None  # (rank, exit status) of the first rank to fail
    try:
        cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache_dir,
                     partition=config.partition, text_field=config.text_field)
        for p in procs:
            p.start()
        deadline = math.inf
        while any(p.exitcode is None for p in procs):
            for rank, p in enumerate(procs):
                if first is None and p.exitcode not in (None, 0):
                    first, deadline = (rank, p.exitcode), time.monotonic() + grace_s
            if time.monotonic() > deadline:
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
            time.sleep(0.05)
        for rank, p in enumerate(procs):
            if first is None and p.exitcode != 0:
                first = (rank, p.exitcode)
    except BaseException:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
                if p.exitcode is None:
                    p.kill()
        raise
    finally:
        del store
    if first is not None:
        rank, code = first
        if code < 0:
            raise RunFailed(f"rank {rank} (island {rank // config.ranks_per_island}) was killed by "
                            f"{signal.Signals(-code).name}; resume with 'atoll train --resume {out}'",
                            128 - code)
        raise RunFailed("", code)
    return json.loads((out / "summary.json").read_text())


def _rank_main(config: TrainConfig, resume: bool, env: dict[str, str]) -> None:
    """One rank started by :func:`launch`: its environment as torchrun would set it, then the job."""
    os.environ.update(env)
    if config.threads is None and "OMP_NUM_THREADS" in env:  # torch was imported before the variable was set
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from atoll.train import train

    try:
        train(config, resume=resume)
    except AtollError as e:
        print(f"atoll: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


