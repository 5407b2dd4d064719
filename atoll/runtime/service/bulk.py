"""The bulk calls of ``atoll syncer``: the tensors of pushes and pulls, in chunks, over each rank's own connection.

What moves here are bytes, never a decision: an ``Upload`` holds a slice of a push (the codec's payload, named
by its fragment and ranges) until the island's leader commits the push (``Push``, a control call, where the
slices are decoded and checked); ``Download`` serves the float32 values of the newest global fragment at the
ranges a rank asks for, serialized once per version and slice and cached (every island's ranks pull the same
slices). Both resume after a failure at the offset the syncer holds (``UploadStatus``; ``Download`` from an
offset). Bytes are received and sent outside the server's lock, so a slow transfer never holds up a heartbeat.
:class:`BulkCalls` is mixed into :class:`~atoll.runtime.service.server.SyncerServer`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from atoll.runtime.service import slices, wire
from atoll.strategies.decoupled.protocol import is_index

if TYPE_CHECKING:
    from atoll.algorithms.codec_base import Codec
    from atoll.runtime.service.syncer import SyncerService

#: bytes of uploads (slices of pushes in transfer) one island may hold, in whole fragments' payloads; the
#: oldest uploads are dropped beyond (an island has at most one push per fragment in flight, two fragments
#: in flight at the paper's settings)
OPEN_FRAGMENTS = 8
#: uploads one island may hold at once, whatever their size
OPEN_UPLOADS = 4096
#: bytes of a safetensors header the payload of a slice may take beyond the codec's own bytes
HEADER_BYTES = 4096
#: pulled slices kept serialized (a fragment's slices are pulled by every island's ranks alike), at most this
#: many, and at most twice the global parameters' float32 bytes
PULL_CACHE = 256


@dataclass
class Upload:
    """One slice of a push in transfer: its fragment, its ranges, its declared size and the bytes so far."""

    fragment: int
    ranges: slices.Ranges
    size: int
    data: bytearray = field(default_factory=bytearray)


class BulkCalls:
    """``Upload``, ``UploadStatus`` and ``Download`` (see the module docstring), mixed into
    :class:`~atoll.runtime.service.server.SyncerServer`, whose state they use."""

    service: SyncerService
    codec: Codec
    lock: threading.Lock
    uploads: dict[int, OrderedDict[str, Upload]]
    pulls: OrderedDict[tuple[int, slices.Ranges | None], tuple[int, bytes]]
    max_open: int

    def _caller(self, context: grpc.ServicerContext, peer: bool = False) -> tuple[int, str]:
        raise NotImplementedError  # SyncerServer's

    @staticmethod
    def _request(data: bytes, context: grpc.ServicerContext) -> dict[str, Any]:
        raise NotImplementedError  # SyncerServer's

    def _fragment(self, fragment: Any, context: grpc.ServicerContext) -> int:
        raise NotImplementedError  # ShardCalls'

    def UploadStatus(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        island, _ = self._caller(context)
        upload = str(self._request(data, context).get("upload"))
        with self.lock:
            held = self.uploads[island].get(upload)
        return wire.dumps({"received": len(held.data) if held is not None else 0})

    def Upload(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:  # noqa: N802
        """A slice of a push: a JSON header ``{"upload", "offset", "fragment", "ranges", "size"}`` (``ranges``
        of the fragment's element order; ``size``: the payload's bytes, at most what the run's codec makes of
        that many values), then raw chunks appended at ``offset`` (a retry resumes where the bytes held end)."""
        island, _ = self._caller(context)
        header = self._request(next(requests, b""), context)
        upload, offset, fragment, size = (str(header.get("upload")), header.get("offset", 0), header.get("fragment"),
                                          header.get("size"))
        fragment = self._fragment(fragment, context)
        try:
            ranges = wire.parse_ranges(header.get("ranges"), self.service.syncer.numels[fragment])
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        most = self.codec.payload_bytes(sum(b - a for a, b in ranges)) + HEADER_BYTES
        if not (is_index(size, most + 1) and size > 0):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"size: {size!r}; a slice's payload is 1..{most} bytes")
        with self.lock:
            uploads = self.uploads[island]
            held = uploads.get(upload)
            if held is None or (held.fragment, held.ranges, held.size) != (fragment, ranges, size):
                held = uploads[upload] = Upload(fragment, ranges, size)
            uploads.move_to_end(upload)
            while len(uploads) > OPEN_UPLOADS or sum(u.size for u in uploads.values()) > self.max_open:
                uploads.popitem(last=False)
        buf = held.data
        if not (is_index(offset, len(buf) + 1)):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"offset: {offset!r}, the syncer holds {len(buf)} bytes")
        del buf[offset:]
        for chunk in requests:
            if len(buf) + len(chunk) > size:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"upload: over its declared {size} bytes")
            buf += chunk
        return wire.dumps({"received": len(buf)})

    def Download(self, data: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        """The newest global fragment's float32 values at ``ranges`` of its element order (default: all of it):
        a JSON header ``{"version", "size", "offset"}``, then their safetensors bytes from ``offset`` (from 0
        when the version asked for is no longer the newest)."""
        self._caller(context, peer=True)
        req = self._request(data, context)
        fragment = self._fragment(req.get("fragment"), context)
        ranges = None
        if req.get("ranges") is not None:
            try:
                ranges = wire.parse_ranges(req.get("ranges"), self.service.syncer.numels[fragment])
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        version, payload = self._pull(fragment, ranges)
        offset = req.get("offset", 0)
        if req.get("version") != version or not is_index(offset, len(payload) + 1):
            offset = 0
        yield wire.dumps({"version": version, "size": len(payload), "offset": offset})
        yield from wire.chunks(payload, offset)

    def _pull(self, fragment: int, ranges: slices.Ranges | None = None) -> tuple[int, bytes]:
        """(version, safetensors bytes) of the newest global fragment's values at ``ranges`` (None: all)."""
        key = (fragment, ranges)
        with self.lock:
            cached = self.pulls.get(key)
            if cached is not None and cached[0] == self.service.syncer.version(fragment):
                self.pulls.move_to_end(key)
                return cached
            pull = self.service.pull(fragment)  # a copy: serialized below, outside the lock
        values = pull.params if ranges is None else slices.take(pull.params, ranges)
        cached = (pull.version, wire.tensor_bytes(values))
        with self.lock:
            self.pulls[key] = cached
            most = 8 * self.service.syncer.numel
            while len(self.pulls) > PULL_CACHE or sum(len(b) for _, b in self.pulls.values()) > most:
                self.pulls.popitem(last=False)
        return cached

