"""The bulk calls of ``atoll syncer``: the tensors of pushes and pulls, in chunks, over each rank's own connection.

What moves here are bytes, never a decision: an ``Upload`` holds a slice of a push (the codec's payload, named by
its fragment and ranges; with an element-wise codec its values, written into their places in the push's fragment as
they arrive: :mod:`~atoll.runtime.service.placement`) until the island's leader commits the push, where the slices
are decoded (or taken as they were written) and checked: in its own slice's ``Upload`` (the commit rides on it,
waits here until every slice is held, and is handed to the server's ``Push`` handler) or with ``Push``, a control
call; ``Download`` serves the float32 values of the newest global fragment at the ranges a rank asks for, serialized
once per version and slice and cached (every island's ranks pull the same slices), or with a ``pull_codec`` other
than fp32 the pull codec's payloads since the version the island holds (whole fragments only: cached per version and
held version). Both resume after a failure at the offset the syncer holds (``UploadStatus``; ``Download`` from an
offset). Bytes are received and sent outside the server's lock, so a slow transfer never holds up a heartbeat.
:class:`Bulk` is the collaborator of :class:`~atoll.runtime.service.server.SyncerServer` that holds the transfers.

**Admission.** A transfer takes one of the server's ``bulk_slots`` (every island together) and one of its
island's ``island_transfers`` before it reads a byte; without a free one it is refused UNAVAILABLE (counted
``busy`` or ``transfers``; the island retries with backoff), so the server's threads beyond the slots are
the control calls' (:func:`~atoll.runtime.service.serve.build_server`). A transfer with no chunk moving for
``chunk_timeout_s`` (a header and then silence, a reader that stopped reading) is cut (counted ``stalled``;
the island resumes it); an empty chunk is refused (``empty_chunk``). Per island the uploads held are bounded
by count (:data:`ISLAND_UPLOADS`), by their ranges (:data:`ISLAND_RANGES`) and by their declared bytes
(:data:`OPEN_FRAGMENTS` fragments' payloads): beyond, the oldest are dropped (counted ``quota``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch

from atoll.runtime.service import schema, slices, wire
from atoll.runtime.service.calls import Gate
from atoll.runtime.service.placement import Assembly, Placement, Sealed, element_wise, expected_head
from atoll.runtime.service.shards import Shards

if TYPE_CHECKING:
    from atoll.algorithms.codec_base import Codec
    from atoll.runtime.service.syncer import SyncerService

#: bytes of uploads (slices of pushes in transfer) one island may hold, in whole fragments' payloads; the
#: oldest uploads are dropped beyond (an island has at most one push per fragment in flight, two fragments
#: in flight at the paper's settings)
OPEN_FRAGMENTS = 8
#: uploads one island may hold at once, whatever their size (each id at most schema.MAX_ID characters)
ISLAND_UPLOADS = 256
#: ranges the uploads one island holds may name together (one upload names at most wire.MAX_RANGES)
ISLAND_RANGES = 2 * wire.MAX_RANGES
#: bytes of a safetensors header the payload of a slice may take beyond the codec's own bytes
HEADER_BYTES = 4096
#: a commit riding on an upload (``UploadHeader.commit``) waits for the island's other slices while their bytes
#: keep arriving; after this many seconds with none arriving it answers without committing (the island then
#: commits with ``Push``)
COMMIT_WAIT_QUIET_S = 5.0
#: the most ranges a slice written in place may name (a rank's slice of an island's FSDP shards names one per
#: parameter of the fragment); a slice of more is held as bytes and decoded at the commit
PLACED_RANGES = 4096
#: pulled slices kept serialized (a fragment's slices are pulled by every island's ranks alike), at most this
#: many, and at most twice the global parameters' float32 bytes
PULL_CACHE = 256


@dataclass
class Upload:
    """One slice of a push in transfer: its fragment, its ranges, its declared size and the bytes so far
    (``data``), or with an element-wise codec its values written in place as they arrive (``into``:
    :mod:`~atoll.runtime.service.placement`)."""

    fragment: int
    ranges: slices.Ranges
    size: int
    data: bytearray = field(default_factory=bytearray)
    into: Placement | None = None

    @property
    def received(self) -> int:
        """Bytes of the payload held (or written in place)."""
        return self.into.received if self.into is not None else len(self.data)


@dataclass
class Transfer:
    """One admitted transfer: its island (-1: a shard of this syncer), its call, when a chunk last moved
    (monotonic seconds), and whether it was cut for silence."""

    island: int
    context: grpc.ServicerContext
    moved: float
    cut: bool = False


class Bulk:
    """``Upload``, ``UploadStatus`` and ``Download`` (see the module docstring): the uploads each island holds
    and the pulled slices cached, held by :class:`~atoll.runtime.service.server.SyncerServer`.

    Args:
        service: the syncer service served (its fragments' sizes and newest values).
        codec: the run's codec (the most bytes a slice's payload may take).
        lock: the server's lock (one call into the service at a time; never held while bytes move).
        gate: the server's :class:`~atoll.runtime.service.calls.Gate` (who calls; refusals, counted).
        shards: the server's :class:`~atoll.runtime.service.shards.Shards` (which fragments this shard owns).
        slots: transfers served at once, every island together (``bulk_slots``).
        per_island: transfers one island may have open at once (``island_transfers``).
        chunk_timeout_s: seconds a transfer may go without a chunk moving before it is cut.
        commit: the server's commit of a push that rides on an upload (the caller, the push, the call, the
            upload's transfer): its answer, or None (not committed).
    """

    def __init__(self, service: SyncerService, codec: Codec, lock: threading.Lock, gate: Gate,
                 shards: Shards, slots: int = 64, per_island: int = 16, chunk_timeout_s: float = 30.0,
                 commit: Callable[[tuple[int, str], schema.PushRequest, grpc.ServicerContext, Transfer],
                                  schema.PushReply | None] | None = None) -> None:
        self.service, self.codec, self.lock, self.gate, self.shards = service, codec, lock, gate, shards
        self.commit = commit
        self.arrived = threading.Condition(lock)  # an upload completed (a commit riding on another waits for it)
        self.slots, self.per_island, self.chunk_timeout_s = slots, per_island, chunk_timeout_s
        self.open: dict[int, Transfer] = {}  # id(transfer) -> the transfers admitted, not ended
        self._open_lock = threading.Lock()  # (the admission's own: never the server's, never held while waiting)
        self._watching = False
        self.uploads: dict[int, OrderedDict[str, Upload]] = {i: OrderedDict() for i in range(service.run.islands)}
        # (fragment, ranges, have) -> (version, since, safetensors bytes of its pull), least recently pulled first
        self.pulls: OrderedDict[tuple[int, slices.Ranges | None, int | None], tuple[int, int | None, bytes]] = \
            OrderedDict()
        self.max_open = OPEN_FRAGMENTS * max(codec.payload_bytes(n) + HEADER_BYTES for n in service.syncer.numels)
        self.element_wise = element_wise(codec)  # (a push's slices then written in place as their bytes arrive)
        self.bytes_out = 0  # bytes of the global fragments served by Download (the live view's bytes out)
        self.bytes_out_by_island = [0] * service.run.islands  # the same, per island that downloaded them

    @contextmanager
    def admitted(self, island: int, context: grpc.ServicerContext) -> Iterator[Transfer]:
        """Hold one of the server's transfer slots and one of ``island``'s while the block runs, or refuse the
        call UNAVAILABLE (``busy``: every slot taken; ``transfers``: the island's taken); the transfer is
        watched for silence (:meth:`moved` marks a chunk) and cut after ``chunk_timeout_s``."""
        with self._open_lock:
            own = sum(1 for t in self.open.values() if t.island == island)
            reason = "transfers" if own >= self.per_island else "busy" if len(self.open) >= self.slots else None
            if reason is None:
                transfer = Transfer(island, context, time.monotonic())
                self.open[id(transfer)] = transfer
                start, self._watching = not self._watching, True
        if reason is not None:
            most = self.per_island if reason == "transfers" else self.slots
            self.gate.refuse(context, grpc.StatusCode.UNAVAILABLE, reason,
                             f"busy: {most} transfers open{' of this island' if reason == 'transfers' else ''}; "
                             "retry later")
        if start:
            threading.Thread(target=self._watch, name="atoll-bulk-watch", daemon=True).start()
        try:
            yield transfer
        finally:
            with self._open_lock:
                self.open.pop(id(transfer), None)

    @staticmethod
    def moved(transfer: Transfer) -> None:
        """A chunk of ``transfer`` moved: its silence starts again."""
        transfer.moved = time.monotonic()

    def _watch(self) -> None:
        """Cut every transfer silent for ``chunk_timeout_s`` (its call cancelled: the thread it holds returns);
        ends when no transfer is open (the next admitted starts it again)."""
        while True:
            time.sleep(min(1.0, self.chunk_timeout_s / 4))
            now, cut = time.monotonic(), []
            with self._open_lock:
                if not self.open:
                    self._watching = False
                    return
                for t in self.open.values():
                    if not t.cut and now - t.moved > self.chunk_timeout_s:
                        t.cut = True
                        cut.append(t)
            for t in cut:
                self.gate.note("stalled", t.context.peer(), f"no chunk for {self.chunk_timeout_s:g} s; cut")
                t.context.cancel()

    def upload_status(self, island: int, req: schema.UploadStatusRequest) -> schema.ReceivedReply:
        """The bytes the syncer holds of the island's upload ``req.upload`` (0: none)."""
        with self.lock:
            held = self.uploads[island].get(req.upload)
        return schema.ReceivedReply(received=held.received if held is not None else 0)

    def taken(self, island: int, ids: tuple[str, ...]) -> list[Upload] | None:
        """(Under the lock.) The island's uploads ``ids``, taken out of those held, if every one is complete;
        None (and nothing taken) if one is missing or incomplete (the syncer restarted since)."""
        held = [self.uploads[island].get(u) for u in ids]
        complete = [h for h in held if h is not None and h.received == h.size]
        if len(complete) != len(ids):
            return None
        for u in ids:
            self.uploads[island].pop(u, None)
        return complete

    def upload(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """A slice of a push: a JSON header (:class:`~atoll.runtime.service.schema.UploadHeader`: ``ranges`` of
        the fragment's element order; ``size``: the payload's bytes, at most what the run's codec makes of that
        many values), then raw chunks appended at ``offset`` (a retry resumes where the bytes held end). With a
        ``commit`` in the header, the push it names is committed once its slices are all held
        (:meth:`_commit_riding`), and the reply carries the answer; an upload whose stream ends short of ``size``
        is answered at once, uncommitted (the island resumes it, then commits). A stream that ends before its
        header is cut, not refused (not counted in ``refused_calls``): what gRPC hands the server when an island is
        killed mid-call, its connection's end read as the stream's before the call's cancellation
        (``grpc._server``), is a stream with no message; answered INVALID_ARGUMENT, if its client is still there."""
        caller = self.gate.caller(context)
        with self.admitted(caller[0], context) as transfer:
            first = next(requests, None)
            if first is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "upload: the stream ended before its header")
            header = self.gate.parse(schema.UploadHeader, first, context, "Upload")
            received = self._upload(caller[0], header, requests, context, transfer)
            # a stream that ended short (the island cut it) leaves a slice to resume: no commit waits for it
            riding = header.commit is not None and received == header.size
            answer = self._commit_riding(caller, header, context, transfer) if riding else None
        return schema.encode(schema.ReceivedReply(received=received, **({"push": answer} if answer else {})))

    def _commit_riding(self, caller: tuple[int, str], header: schema.UploadHeader, context: grpc.ServicerContext,
                       transfer: Transfer) -> schema.PushReply | None:
        """The push ``header.commit`` rides on this upload (it must name it among its slices): the server's answer
        (its ``commit`` hook: once every slice is held, :meth:`await_slices`), or None, not committed."""
        assert header.commit is not None and self.commit is not None
        if header.upload not in header.commit.slices:
            self.gate.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "commit",
                             "upload: its commit's slices must name this upload")
        return self.commit(caller, header.commit, context, transfer)

    def await_slices(self, island: int, ids: tuple[str, ...], transfer: Transfer) -> bool:
        """Wait, in ``transfer``'s slot, until the island holds every upload ``ids`` complete: True; False when
        none of their bytes arrived for :data:`COMMIT_WAIT_QUIET_S` (a slice late or lost: the island commits
        with ``Push``). While they arrive the transfer is not silent."""
        held, quiet_since = -1, time.monotonic()
        with self.lock:
            while True:
                slices_held = [self.uploads[island].get(u) for u in ids]
                if all(h is not None and h.received == h.size for h in slices_held):
                    transfer.moved = math.inf  # the commit is the syncer's work, not the island's silence
                    return True
                now, got = time.monotonic(), sum(h.received for h in slices_held if h is not None)
                if got != held:  # the others' bytes are arriving: the island is heard
                    held, quiet_since = got, now
                    self.moved(transfer)
                elif now - quiet_since > COMMIT_WAIT_QUIET_S:
                    return False
                self.arrived.wait(timeout=0.25)

    def _upload(self, island: int, header: schema.UploadHeader, requests: Iterator[bytes],
                context: grpc.ServicerContext, transfer: Transfer) -> int:
        self.moved(transfer)
        upload, offset, size = header.upload, header.offset, header.size
        fragment = self.shards.fragment(header.fragment, context)
        try:
            ranges = wire.parse_ranges(header.ranges, self.service.syncer.numels[fragment])
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        most = self.codec.payload_bytes(sum(b - a for a, b in ranges)) + HEADER_BYTES
        if not 0 < size <= most:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"size: {size}; a slice's payload is 1..{most} bytes")
        evicted = 0
        with self.lock:
            uploads = self.uploads[island]
            held = uploads.get(upload)
            if held is None or (held.fragment, held.ranges, held.size) != (fragment, ranges, size):
                held = uploads[upload] = Upload(fragment, ranges, size)
                held.into = self._placement(island, fragment, ranges, size)
            uploads.move_to_end(upload)
            while len(uploads) > ISLAND_UPLOADS or self._held_bytes(island) > self.max_open or \
                    sum(len(u.ranges) for u in uploads.values()) > ISLAND_RANGES:
                uploads.popitem(last=False)
                evicted += 1
        self.moved(transfer)  # (the wait for the lock, behind a merge, is no silence of the island's)
        if evicted:  # the island's oldest uploads: a commit naming one is answered "upload it again"
            self.gate.note("quota", context.peer(), f"island {island}'s uploads over their quota; {evicted} dropped")
        if offset > held.received or (held.into is not None and not held.into.resume(offset)):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"offset: {offset}, the syncer holds {held.received} bytes")
        del held.data[offset:]
        for chunk in requests:
            self.moved(transfer)
            if not chunk:
                self.gate.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "empty_chunk", "upload: an empty chunk")
            if held.received + len(chunk) > size:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"upload: over its declared {size} bytes")
            if held.into is not None:
                try:
                    if held.into.write(chunk):
                        continue
                except Sealed as e:  # (a second stream of an upload whose push was committed)
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
                # not the codec's layout: held as bytes, refused at the commit (type) as any malformed payload
                held.data, held.into = bytearray(held.into.head[:held.into.received]), None
            held.data += chunk
        if held.received == size:
            with self.lock:
                self.arrived.notify_all()
        return held.received

    def assemble(self, uploads: list[Upload], numel: int) -> tuple[torch.Tensor, int]:
        """A push's Δ, float32 ``(numel,)``, from its slices ``uploads`` (complete, taken; the caller checked that
        they tile the fragment), and the codec's bytes they carried (headers apart). Slices written in place into
        one assembly (an element-wise codec, every rank's slice of the push): that assembly, sealed, with no
        decode and no copy; otherwise each slice decoded (or copied out of its assembly) into its place.

        Raises:
            ValueError: a slice held as bytes is not the codec's payload for its ranges.
        """
        placed = {id(h.into.assembly): h.into.assembly for h in uploads if h.into is not None}
        nbytes = sum(self.codec.payload_bytes(sum(b - a for a, b in h.ranges)) for h in uploads if h.into is not None)
        if len(placed) == 1 and all(h.into is not None for h in uploads):
            return next(iter(placed.values())).seal(), nbytes
        payloads = []
        for h in uploads:
            if h.into is None:
                payload = wire.bytes_payload(h.data, self.codec, sum(b - a for a, b in h.ranges))
                nbytes += payload.nbytes
                payloads.append((h.ranges, payload))
        delta = slices.assemble_payloads(numel, payloads, self.codec)  # each slice decoded into its place
        for h in uploads:  # (an assembly shared with another push's slice: copied out, not sealed)
            if h.into is not None:
                with h.into.assembly.lock:
                    values = h.into.assembly.values
                    assert values is not None  # (a complete slice wrote its values)
                    for a, b in h.ranges:
                        delta[a:b].copy_(values[a:b])
        return delta, nbytes

    def _placement(self, island: int, fragment: int, ranges: slices.Ranges, size: int) -> Placement | None:
        """(Under the lock.) Where a new upload of ``fragment`` at ``ranges`` writes its values as they arrive: into
        the assembly of one of the island's uploads of that fragment in transfer, not yet committed, none of whose
        claimed ranges overlap ``ranges`` (the other ranks' slices of the same push; an assembly's claims outlive
        its slices), which it claims, else a new one; None (held as bytes) unless the codec is element-wise,
        ``size`` is exactly its payload's for ``ranges`` and they are at most :data:`PLACED_RANGES` (the work
        here, under the server's lock, is a few bisections per range and assembly)."""
        if self.element_wise is None or len(ranges) > PLACED_RANGES:
            return None
        if expected_head(ranges, self.element_wise)[1] != size:
            return None
        candidates = {id(u.into.assembly): u.into.assembly for u in self.uploads[island].values()
                      if u.into is not None and u.fragment == fragment and not u.into.assembly.sealed}
        assembly = next((a for a in candidates.values() if not a.overlaps(ranges)), None)
        assembly = assembly or Assembly(self.service.syncer.numels[fragment])
        assembly.claim(ranges)
        return Placement(assembly, ranges, self.element_wise)

    def _held_bytes(self, island: int) -> int:
        """(Under the lock.) The memory the island's uploads hold: the declared bytes of those held as bytes, and
        each assembly they write into whole (float32 of its fragment), once."""
        assemblies = {id(u.into.assembly): u.into.assembly.nbytes for u in self.uploads[island].values()
                      if u.into is not None}
        return sum(u.size for u in self.uploads[island].values() if u.into is None) + sum(assemblies.values())

    def download(self, data: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The newest global fragment's float32 values at ``ranges`` of its element order (default: all of it):
        a JSON header (:class:`~atoll.runtime.service.schema.DownloadHeader`), then their safetensors bytes from
        ``offset`` (from 0 when the version asked for is no longer the newest). With a ``pull_codec`` other than
        fp32, the whole fragment's pull for an island that holds version ``have``
        (:meth:`SyncerService.pull <atoll.runtime.service.syncer.SyncerService.pull>`): the pull codec's payloads
        since ``have`` (:func:`~atoll.runtime.service.wire.deltas_bytes`, header ``since = have``), or the full
        fragment in float32 (``since`` None: the island starts, rejoins, or holds a version whose payloads are
        no longer kept); never by ``ranges`` (a block-scaled payload is not cut by element ranges:
        INVALID_ARGUMENT), and resumed only in the same answer (``version``, ``since`` and ``epoch``, the syncer's
        restarts). Another shard of the syncer (the coordinator gathering the final model) is sent the global
        fragment G itself in float32, whatever the pull codec (:meth:`_global`)."""
        island, _ = self.gate.caller(context, peer=True)
        with self.admitted(island, context) as transfer:
            for chunk in self._download(data, context, transfer, island):
                yield chunk
                self.moved(transfer)

    def _download(self, data: bytes, context: grpc.ServicerContext, transfer: Transfer,
                  island: int) -> Iterator[bytes]:
        req = self.gate.parse(schema.DownloadRequest, data, context, "Download")
        fragment = self.shards.fragment(req.fragment, context)
        peer = island < 0  # another shard gathering the final model: the global fragment G, not an island's pull
        coded = self.service.syncer.downlink.codec is not None and not peer
        ranges = None
        if req.ranges is not None:
            if coded:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ranges: a {self.service.syncer.downlink.name} "
                              "pull is the whole fragment's payloads; ask without ranges")
            try:
                ranges = wire.parse_ranges(req.ranges, self.service.syncer.numels[fragment])
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if peer:
            version, since, payload = self._global(fragment, ranges)
        else:
            version, since, payload = self._pull(fragment, ranges, req.have if coded else None, island)
        self.moved(transfer)  # (serializing a large fragment is no silence of the island's)
        epoch = self.service.restarts  # (the same version of another epoch is other bytes: from 0)
        same = req.version == version and req.since == since and req.epoch == epoch and req.offset <= len(payload)
        offset = req.offset if same else 0
        with self.lock:
            self.bytes_out += len(payload) - offset  # (the live view's bytes out)
            if not peer:
                self.bytes_out_by_island[island] += len(payload) - offset
        yield schema.encode(schema.DownloadHeader(version=version, size=len(payload), offset=offset, since=since,
                                                  epoch=epoch))
        yield from wire.chunks(payload, offset)

    def _global(self, fragment: int, ranges: slices.Ranges | None) -> tuple[int, None, bytes]:
        """(version, None, safetensors bytes) of the global fragment G itself at ``ranges`` (None: all), float32,
        whatever the pull codec (an island's pull carries the shadow Q or its changes: what the islands hold, not
        G): what another shard's coordinator gathers as the run's final model."""
        with self.lock:
            syncer = self.service.syncer
            version, params = syncer.version(fragment), syncer.outer[fragment].params.detach()
            values = params.clone() if ranges is None else slices.take(params, ranges)
        return version, None, wire.tensor_bytes(values)

    def _pull(self, fragment: int, ranges: slices.Ranges | None = None,
              have: int | None = None, island: int | None = None) -> tuple[int, int | None, bytes]:
        """(version, since, safetensors bytes) of the newest global fragment's values at ``ranges`` (None: all),
        or with ``have`` (a pull codec's, for island ``island`` at that version) of its pull: its payloads since
        ``have`` (``since = have``) or its full float32 values (``since`` None; also while this process has not
        answered the island a pull of the fragment yet:
        :meth:`SyncerService.pull_since <atoll.runtime.service.syncer.SyncerService.pull_since>`)."""
        with self.lock:
            downlink = self.service.syncer.downlink
            have = self.service.pull_since(island, fragment, have)  # (a restarted syncer: the full fragment first)
            if have is not None and not downlink.sends_deltas(fragment, self.service.syncer.version(fragment), have):
                have = None  # (no payloads since it: the full fragment, one cache entry whatever the stranger asked,
                # ahead of the syncer's version or behind the payloads kept)
            key = (fragment, ranges, have)
            cached = self.pulls.get(key)
            if cached is not None and cached[0] == self.service.syncer.version(fragment):
                self.pulls.move_to_end(key)
                return cached
            pull = self.service.pull(fragment, have=have)  # a copy: serialized below, outside the lock
        if pull.params is None:
            cached = (pull.version, pull.since, wire.deltas_bytes(pull.deltas))
        else:
            values = pull.params if ranges is None else slices.take(pull.params, ranges)
            cached = (pull.version, None, wire.tensor_bytes(values))
        with self.lock:
            self.pulls[key] = cached
            most = 8 * self.service.syncer.numel
            while len(self.pulls) > PULL_CACHE or sum(len(c[2]) for c in self.pulls.values()) > most:
                self.pulls.popitem(last=False)
        return cached
