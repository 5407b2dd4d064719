"""A push's slices written into their places in the fragment as their bytes arrive (element-wise codecs).

With a codec whose payload is one tensor of element-wise values (``fp32``, ``bf16``, ``fp16``: :func:`element_wise`;
the ``fp8`` ones carry a scale beside them), byte ``i`` of a slice's payload body is a known part of value ``i //
itemsize`` of the slice, so the syncer need not hold the bytes until the commit and decode them then: each chunk is
written (widened to float32) into its place in a fragment-sized float32 :class:`Assembly` as it arrives, and the
slices of one push share one assembly, which is the push's Δ at the commit (no decode, no copy on the commit's path:
bench/out/service_link, "decode as bytes arrive"). The payload's safetensors head is compared byte for byte with the
one the run's codec makes for the slice (:func:`~atoll.runtime.service.wire.header`): a payload of another layout
falls back to being held as bytes and is refused at the commit as any malformed payload is (``type``). An assembly
is sealed at the commit (:meth:`Assembly.seal`), under its lock: a stream of the same upload still arriving after it
is refused, so nothing writes into a Δ once its norm was checked.
"""

from __future__ import annotations

import bisect
import threading

import torch

from atoll.algorithms.codec_base import Codec
from atoll.runtime.service import wire
from atoll.runtime.service.slices import Ranges


def element_wise(codec: Codec) -> torch.dtype | None:
    """The dtype of ``codec``'s one tensor of element-wise values (its payload body is the slice's values in
    order, ``itemsize`` bytes each); None for any other layout (block scales, indices: held as bytes)."""
    layout = codec.layout(1)
    if len(layout) == 1 and layout[0][1].is_floating_point and layout[0][2] == 1:
        return layout[0][1]
    return None


def expected_head(ranges: Ranges, dtype: torch.dtype) -> tuple[bytes, int]:
    """The head of an element-wise payload of ``dtype`` for a slice at ``ranges``, and the payload's bytes."""
    n = sum(b - a for a, b in ranges)
    head, _ = wire.header([("values", dtype, [n])])
    return head, len(head) + n * dtype.itemsize


class Sealed(Exception):
    """The assembly's push was committed: no more bytes are written into it."""


class Assembly:
    """The float32 Δ of one push of a fragment of ``numel`` values, ``values`` float32 ``(numel,)``, written by its
    slices' :class:`Placement` s (each at its own ranges) as their bytes arrive; made (zeroed) by the first value
    written, in an upload's thread: never under the server's lock, and its pages touched at the upload's start,
    not on the commit's path."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.values: torch.Tensor | None = None
        self.lock = threading.Lock()
        self.sealed = False
        # the ranges its slices claimed, merged, ascending: kept for its lifetime (a slice taken by its commit, or
        # dropped over the quota, still owns its ranges here: no later upload writes where it wrote)
        self.starts: list[int] = []
        self.stops: list[int] = []

    def overlaps(self, ranges: Ranges) -> bool:
        """Does a slice at ``ranges`` (ascending, disjoint) share a value with those claimed? Two bisections per
        range (``O(len(ranges) log claimed)``)."""
        starts, stops = self.starts, self.stops
        for a, b in ranges:
            i = bisect.bisect_right(starts, a) - 1  # the last claimed range starting at or before a
            if (i >= 0 and stops[i] > a) or (i + 1 < len(starts) and starts[i + 1] < b):
                return True
        return False

    def claim(self, ranges: Ranges) -> None:
        """Claim ``ranges`` (the caller checked :meth:`overlaps` first): merged into those claimed."""
        self.starts = sorted(self.starts + [a for a, _ in ranges])  # (disjoint: both orders agree)
        self.stops = sorted(self.stops + [b for _, b in ranges])

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    def seal(self) -> torch.Tensor:
        """No more writes (a stream still arriving is refused: :class:`Sealed`); the values, now the push's."""
        with self.lock:
            self.sealed = True
            if self.values is None:
                self.values = torch.zeros(self.numel, dtype=torch.float32)
            return self.values


class Placement:
    """One upload's payload (a safetensors file of one tensor ``values`` of ``dtype``, as long as ``ranges``)
    written into ``assembly`` at ``ranges`` as its bytes arrive.

    Args:
        assembly: where the values go.
        ranges: the slice's ranges of the fragment's element order (checked by the caller).
        dtype: the codec's element-wise dtype (:func:`element_wise`).

    Attributes:
        head: the payload's expected head (:func:`~atoll.runtime.service.wire.header`); ``size``: its bytes.
        received: bytes of the payload taken so far (the head's included).
    """

    def __init__(self, assembly: Assembly, ranges: Ranges, dtype: torch.dtype) -> None:
        self.assembly, self.ranges, self.dtype = assembly, ranges, dtype
        self.head, self.size = expected_head(ranges, dtype)
        self.starts = [0]  # the slice's index of each range's first value
        for a, b in ranges:
            self.starts.append(self.starts[-1] + b - a)
        self.received = 0
        self._partial = b""  # the bytes of a value split between two chunks
        self._stage = bytearray()  # (a narrower dtype's bytes, staged writable for torch)

    def resume(self, offset: int) -> bool:
        """Continue at ``offset`` (a retry from the bytes held): where they end (what ``UploadStatus`` reports,
        inside a value too: its first bytes kept), or earlier at a whole value; False beyond them, or earlier
        inside a value (its first bytes are no longer held)."""
        if offset == self.received:
            return True
        body = offset - len(self.head)
        if offset > self.received or (body > 0 and body % self.dtype.itemsize):
            return False
        self.received, self._partial = offset, b""
        return True

    def write(self, chunk: bytes) -> bool:
        """Take the payload's next ``chunk``: its values written in place (widened to float32). False: the
        payload's head is not the expected one (the caller holds the payload's bytes instead: ``head[:received]``,
        then ``chunk`` and the rest).

        Raises:
            Sealed: the push was committed.
        """
        view, at = memoryview(chunk), self.received
        if at < len(self.head):
            k = min(len(self.head) - at, len(view))
            if view[:k] != self.head[at:at + k]:
                return False
            view, at = view[k:], at + k
        if len(view):
            self._body(at - len(self.head), view)
        self.received += len(chunk)
        return True

    def _body(self, offset: int, view: memoryview) -> None:
        """Write the body's bytes ``view`` starting at byte ``offset`` of the body."""
        size = self.dtype.itemsize
        if self._partial:
            view, offset = memoryview(self._partial + bytes(view)), offset - len(self._partial)
        whole = len(view) // size * size
        self._partial = bytes(view[whole:])
        if not whole:
            return
        first, src = offset // size, view[:whole]
        values = None  # (float32: the bytes are the values, written into the float32 in place; else widened)
        if self.dtype != torch.float32:
            if len(self._stage) < whole:
                self._stage = bytearray(whole)
            self._stage[:whole] = src
            values = torch.frombuffer(self._stage, dtype=self.dtype, count=whole // size)
        with self.assembly.lock:
            if self.assembly.sealed:
                raise Sealed("upload: its push was committed")
            if self.assembly.values is None:
                self.assembly.values = torch.zeros(self.assembly.numel, dtype=torch.float32)
            out = self.assembly.values
            dest = out.numpy().view("u1")
            i = bisect.bisect_right(self.starts, first) - 1  # the range holding value `first` of the slice
            done, count = 0, whole // size
            while done < count:
                a, b = self.ranges[i]
                start = first + done - self.starts[i]  # within range i
                n = min(b - a - start, count - done)
                if values is None:
                    dest[4 * (a + start):4 * (a + start + n)] = src[4 * done:4 * (done + n)]
                else:
                    out[a + start:a + start + n].copy_(values[done:done + n])
                done += n
                i += 1
