"""What travels between an island and ``atoll syncer``: method names, metadata keys, JSON and safetensors.

Control calls (join, step leases, heartbeats, buffer and pull metadata, the commit of a push) are unary
calls of JSON objects on the control connection; tensors travel as safetensors bytes in chunks of
:data:`CHUNK_BYTES` on a separate bulk connection (``Upload``: client-streaming, resumable at the offset the
syncer reports; ``Download``: server-streaming from an offset). Each rank of an island has its own bulk
connection and moves its own *slice* of a fragment: ranges of the fragment's element order
(:mod:`~atoll.runtime.service.slices`) named in the ``Upload`` header and the ``Download`` request.

What a push uploads is the codec's payload as it is encoded (:func:`payload_bytes`: the tensors of
:class:`~atoll.algorithms.codec_base.Encoded`, ``values`` / ``scales`` / ``indices``, in one safetensors file),
so the bytes on the wire are the ``nbytes`` the run reports (plus the safetensors header, about 100 bytes); the
syncer decodes it (:func:`bytes_payload`, checked against the run's codec as from a stranger). A pull downloads
float32 values (:func:`tensor_bytes`), or with a ``pull_codec`` other than fp32 the pull codec's payloads of the
versions since the island's (:func:`deltas_bytes`, :func:`bytes_deltas`). Nothing is ever unpickled: a payload
that is not a JSON object or a safetensors file of the expected tensors is refused, and a JSON message nested
deeper than :data:`MAX_DEPTH` is refused before it is parsed (:func:`check_depth`). What each message holds is
:mod:`~atoll.runtime.service.schema`'s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import load as st_load

from atoll.algorithms.codec_base import Codec, Encoded
from atoll.config.parse import is_loopback, parse_address  # noqa: F401 - (part of the wire's API)

#: the gRPC service's name; methods are ``/atoll.Syncer/<Name>``
SERVICE = "atoll.Syncer"
#: unary JSON -> JSON methods (``UploadStatus``, part of a transfer's retry, goes over the bulk connection);
#: ``Hello``: an island's check of a shard of a sharded syncer; ``Finish``, ``Close``: the coordinator's calls
#: to the other shards at the run's end (peer credential only)
CONTROL = ("Join", "ReserveSteps", "Buffered", "Heartbeat", "UploadStatus", "Push", "PullMeta", "Leave", "Hello",
           "Finish", "Close")
#: the longest a ``Buffered`` call (a long poll) waits for a push to leave the buffer, seconds; asked again after
MAX_WAIT_S = 5.0
#: the most ranges one slice may name (a sharded rank's slice: one per parameter of the fragment)
MAX_RANGES = 1 << 16
#: the deepest a JSON message may nest (objects and arrays; the service's own go 4 deep)
MAX_DEPTH = 32
#: bytes per chunk of a tensor transfer (gRPC's default message limit is 4 MiB)
CHUNK_BYTES = 1 << 20
#: call metadata carrying the caller's island index and its secret
ISLAND_KEY, CREDENTIAL_KEY = "atoll-island", "atoll-credential"
#: call metadata of a shard of a sharded syncer calling another (its index; its secret in ``CREDENTIAL_KEY``)
PEER_KEY = "atoll-peer"
#: the one tensor name in a safetensors payload
TENSOR_NAME = "t"


def method(name: str) -> str:
    """The full gRPC method path of ``name``."""
    return f"/{SERVICE}/{name}"


def dumps(obj: dict[str, Any]) -> bytes:
    """A JSON object as compact UTF-8 bytes."""
    return json.dumps(obj, separators=(",", ":")).encode()


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[][{}]")


def check_depth(data: bytes, limit: int = MAX_DEPTH) -> None:
    """Check, without parsing, that the JSON text ``data`` nests objects and arrays at most ``limit`` deep (a
    parser recurses once per level: 100,000 levels would exhaust Python's stack). Brackets inside strings do
    not count; an unbalanced text passes here and fails its parse.

    Raises:
        ValueError: nested deeper than ``limit``.
    """
    depth = 0
    for m in _BRACKETS.finditer(_STRINGS.sub(b"", bytes(data))):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > limit:
            raise ValueError(f"message: JSON nested deeper than {limit} levels")


def loads(data: bytes) -> dict[str, Any]:
    """A JSON object from bytes, its nesting checked first (:func:`check_depth`).

    Raises:
        ValueError: nested too deep, not UTF-8 JSON, or not an object.
    """
    check_depth(data)
    obj = json.loads(data.decode())
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


#: safetensors' dtype names (those a codec's payload or a pull uses) and torch's
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
#: the longest safetensors header read (safetensors' own limit is 100 MB; ours name at most a few tensors)
MAX_HEADER = 1 << 16


def view_tensors(data: bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``data``, as views of its bytes (no copy: the tensors keep
    ``data`` alive, and while they live it cannot be resized: BufferError). Checked as from a stranger, as
    ``safetensors.torch.load`` checks: an 8-byte little-endian header length, a JSON object of at most
    :data:`MAX_HEADER` bytes naming each tensor's dtype, shape and ``data_offsets``, the tensors tiling the bytes
    after the header exactly.

    Raises:
        ValueError: anything else (one line).
    """
    if len(data) < 8:
        raise ValueError("not a safetensors payload (shorter than its header's length)")
    n = int.from_bytes(data[:8], "little")
    if not 2 <= n <= min(MAX_HEADER, len(data) - 8):
        raise ValueError(f"not a safetensors payload (header of {n} bytes in {len(data)})")
    try:
        header = loads(bytes(data[8:8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not a safetensors payload (its header: {str(e)[:80]})") from None
    header.pop("__metadata__", None)
    # through one memoryview, which the tensors keep alive: while any of them lives, ``data`` cannot be resized
    # (BufferError), so a call still appending to it can never move the memory under them
    view = memoryview(data)
    body, spans, out = 8 + n, [], {}
    for name, entry in header.items():
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(x) for x in entry["shape"]]
            a, b = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not a safetensors payload (tensor {name[:40]!r}: {str(entry)[:80]})") from None
        numel = 1
        for x in shape:
            if x < 0:
                raise ValueError(f"not a safetensors payload (tensor {name[:40]!r}: shape {shape})")
            numel *= x
        if not 0 <= a <= b <= len(data) - body or b - a != numel * dtype.itemsize:
            raise ValueError(f"not a safetensors payload (tensor {name[:40]!r}: offsets {a}..{b} for {shape})")
        spans.append((a, b))
        out[name] = (torch.frombuffer(view, dtype=dtype, count=numel, offset=body + a) if numel
                     else torch.empty(0, dtype=dtype)).view(shape)
    end = 0
    for a, b in sorted(spans):
        if a != end:
            raise ValueError("not a safetensors payload (its tensors' bytes overlap or leave gaps)")
        end = b
    if body + end != len(data):
        raise ValueError(f"not a safetensors payload ({len(data) - body} bytes after its header, its tensors {end})")
    return out


#: safetensors' order of the tensors in a file: by dtype (this order), then by name (its writer's ``prepare``)
_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def header(layout: list[tuple[str, torch.dtype, list[int]]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The head of a safetensors file of tensors ``layout`` (``(name, dtype, shape)``) as safetensors' writer makes it:
    its 8-byte length, its JSON (tensors in safetensors' order: :data:`_ORDER`, then name; no spaces; names beyond
    ASCII as they are), padded with spaces so that the body starts 8-byte aligned; and each tensor's byte span in
    the body (``{name: (start, stop)}``). A receiver that knows the layout it expects compares the bytes it gets
    against this head (:class:`~atoll.runtime.service.placement.Placement`).

    Raises:
        KeyError: a dtype safetensors' payloads here do not use (:data:`_DTYPES`).
    """
    order = sorted(layout, key=lambda e: (_ORDER.index(_NAMES[e[1]]), e[0]))
    entries, spans, at = {}, {}, 0
    for name, dtype, shape in order:
        n = dtype.itemsize
        for x in shape:
            n *= x
        entries[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        spans[name] = (at, at + n)
        at += n
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 8)  # (the body starts 8-byte aligned)
    return len(text).to_bytes(8, "little") + text, spans


class Payload:
    """A safetensors file of ``tensors``, read from the tensors as it is sent: ``safetensors.torch.save``'s bytes
    (:func:`header`'s head, then each tensor's bytes in its order), without a copy of the whole file first. Its
    chunks (:meth:`chunks`, what :func:`iter_chunks` cuts from it) are copied out of the tensors one at a time, so
    an upload's first byte leaves as soon as the codec has encoded, and a retry reads again from any offset. The
    tensors (made contiguous CPU tensors) must not change while the payload is sent; ``len`` is its bytes.

    Raises:
        KeyError: a dtype safetensors' payloads here do not use (:data:`_DTYPES`).
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        flat = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
        self.head, spans = header([(k, t.dtype, list(t.shape)) for k, t in flat.items()])
        # (each tensor's bytes as a memoryview of format B, at its offset in the file)
        self.parts = sorted((len(self.head) + spans[k][0], memoryview(flat[k].reshape(-1).view(torch.uint8).numpy()))
                            for k in flat if spans[k][1] > spans[k][0])
        self.size = len(self.head) + sum(len(v) for _, v in self.parts)
        self._tensors = flat  # (kept alive with their views)

    def __len__(self) -> int:
        return self.size

    def chunks(self, offset: int = 0) -> Iterator[bytes]:
        """The bytes from ``offset`` on, in chunks of :data:`CHUNK_BYTES` (``bytes``: each its own copy)."""
        pieces = [(0, memoryview(self.head)), *self.parts]
        for start in range(offset, self.size, CHUNK_BYTES):
            stop = min(start + CHUNK_BYTES, self.size)
            got = [view[max(start - at, 0):stop - at] for at, view in pieces if at < stop and at + len(view) > start]
            yield bytes(got[0]) if len(got) == 1 else b"".join(got)

    def tobytes(self) -> bytes:
        """The whole file as one ``bytes``."""
        return b"".join(self.chunks())


#: what an upload sends: a payload read from its tensors, or bytes held
Sendable = bytes | bytearray | memoryview | Payload


def save(tensors: dict[str, torch.Tensor]) -> memoryview:
    """``safetensors.torch.save``'s bytes (the same file, byte for byte: its header, its order of the tensors, its
    padding), written with torch's copies, which release the GIL: a payload of hundreds of MB built in an upload
    or a pull's thread never holds up the process's other threads (a heartbeat's answer: safetensors' own writer
    holds the GIL for the whole copy; bench/out/service_link). The tensors are made contiguous CPU
    tensors first. A ``memoryview`` of bytes (format ``B``: ``len`` is its bytes), sliced into the wire's chunks
    (:func:`iter_chunks`) without a second copy of the whole; what is served many times (a pull, cached). A
    payload sent once is a :class:`Payload` (no whole copy at all).

    Raises:
        KeyError: a dtype safetensors' payloads here do not use (:data:`_DTYPES`).
    """
    payload = Payload(tensors)
    out = torch.empty(payload.size, dtype=torch.uint8)  # (not zeroed: bytearray(n)'s memset holds the GIL)
    out[:len(payload.head)].copy_(torch.frombuffer(bytearray(payload.head), dtype=torch.uint8))
    for at, view in payload.parts:
        out[at:at + len(view)].copy_(torch.frombuffer(view, dtype=torch.uint8))
    return memoryview(out.numpy())


def _load(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load``, without copying a ``bytearray`` or a writable ``memoryview`` (:func:`save`'s)
    (:func:`view_tensors`)."""
    if isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly):
        return view_tensors(data)
    try:
        return st_load(bytes(data))
    except Exception as e:  # safetensors raises its own SafetensorError on malformed headers
        raise ValueError(f"not a safetensors payload ({type(e).__name__})") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """One tensor (any shape and dtype, on the CPU) as a safetensors file's bytes."""
    return save({TENSOR_NAME: t})


def bytes_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """The tensor of :func:`tensor_bytes`'s bytes (its shape and dtype as sent: the caller checks them); of a
    ``bytearray``, a view of its bytes (:func:`view_tensors`: no copy).

    Raises:
        ValueError: not a safetensors file holding exactly the one tensor.
    """
    tensors = _load(data)
    if set(tensors) != {TENSOR_NAME}:
        raise ValueError(f"expected one tensor named {TENSOR_NAME!r}, got {sorted(tensors)[:4]}")
    return tensors[TENSOR_NAME]


def payload_bytes(tensors: dict[str, torch.Tensor]) -> Payload:
    """A codec's payload (:attr:`Encoded.tensors <atoll.algorithms.codec_base.Encoded.tensors>`: 1-D tensors
    by role) as a safetensors file, as it travels from an island to the syncer: a :class:`Payload`, read from the
    tensors as it is sent."""
    return Payload(tensors)


def bytes_payload(data: bytes | bytearray | memoryview, codec: Codec, numel: int) -> Encoded:
    """The payload of :func:`payload_bytes`'s bytes, checked as from a stranger against ``codec``'s layout for
    ``numel`` values: exactly its tensors (names, dtypes, lengths), and ``topk`` indices inside ``0..numel-1``; of
    a ``bytearray``, views of its bytes (:func:`view_tensors`: no copy).

    Raises:
        ValueError: not a safetensors file, or not that layout (one line).
    """
    tensors = _load(data)
    expected = sorted((k, dtype, n) for k, dtype, n in codec.layout(numel))
    got = sorted((k, t.dtype, t.numel() if t.dim() == 1 else -1) for k, t in tensors.items())
    if got != expected:
        raise ValueError(f"a {codec.name} payload of {numel} values is {expected}, got {got[:4]}")
    indices = tensors.get("indices")
    if indices is not None and indices.numel() and not (int(indices.min()) >= 0 and int(indices.max()) < numel):
        raise ValueError(f"indices outside 0..{numel - 1}")
    return Encoded(tensors, numel, codec.name)


def deltas_bytes(deltas: tuple[Encoded, ...]) -> memoryview:
    """A delta pull's payloads (:attr:`Pull.deltas <atoll.strategies.decoupled.protocol.Pull.deltas>`, oldest
    first) as one safetensors file's bytes: payload i's tensors named ``"<i>.<role>"`` (none: an up-to-date
    island; the file is then its header alone)."""
    return save({f"{i}.{k}": t for i, enc in enumerate(deltas) for k, t in enc.tensors.items()})


def bytes_deltas(data: bytes | bytearray | memoryview, codec: Codec, numel: int, count: int) -> tuple[Encoded, ...]:
    """The ``count`` payloads of :func:`deltas_bytes`'s bytes, each checked as from a stranger against ``codec``'s
    layout for ``numel`` values (exactly its tensors: names, dtypes, lengths); views of a ``bytearray``'s bytes.

    Raises:
        ValueError: not a safetensors file, or not ``count`` payloads of that layout (one line).
    """
    if not 0 <= count <= len(data) // max(1, codec.payload_bytes(numel)):
        raise ValueError(f"{count} {codec.name} payloads of {numel} values cannot be {len(data)} bytes")
    tensors = _load(data)
    layout = sorted((k, dtype, n) for k, dtype, n in codec.layout(numel))
    expected = sorted((f"{i}.{k}", dtype, n) for i in range(count) for k, dtype, n in layout)
    got = sorted((k, t.dtype, t.numel() if t.dim() == 1 else -1) for k, t in tensors.items())
    if got != expected:
        raise ValueError(f"{count} {codec.name} payloads of {numel} values are {expected[:4]}, got {got[:4]}")
    return tuple(Encoded({k: tensors[f"{i}.{k}"] for k, _, _ in codec.layout(numel)}, numel, codec.name)
                 for i in range(count))


def parse_ranges(obj: Any, numel: int) -> tuple[tuple[int, int], ...]:
    """A slice's ranges of a fragment of ``numel`` values (``[[start, stop], ...]``, lists or tuples), checked: ints,
    ``0 <= start < stop <= numel``, ascending and disjoint, at most :data:`MAX_RANGES`.

    Raises:
        ValueError: anything else (one line).
    """
    if not isinstance(obj, list | tuple) or not 0 < len(obj) <= MAX_RANGES:
        raise ValueError(f"ranges: a list of 1..{MAX_RANGES} [start, stop] pairs")
    out, end = [], 0
    for r in obj:
        if not (isinstance(r, list | tuple) and len(r) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in r) and end <= r[0] < r[1] <= numel):
            raise ValueError(f"ranges: {str(r)[:40]} is not an ascending [start, stop] within 0..{numel}")
        out.append((r[0], r[1]))
        end = r[1]
    return tuple(out)


def chunks(data: Sendable, offset: int = 0) -> list[bytes]:
    """``data[offset:]`` cut into chunks (``bytes``, what a gRPC message is) of at most :data:`CHUNK_BYTES`."""
    return list(iter_chunks(data, offset))


def iter_chunks(data: Sendable, offset: int = 0) -> Iterator[bytes]:
    """:func:`chunks`, one at a time (a transfer holds one chunk's copy at once, not a second whole payload)."""
    if isinstance(data, Payload):
        yield from data.chunks(offset)
        return
    view = memoryview(data)
    for i in range(offset, len(data), CHUNK_BYTES):
        yield bytes(view[i:i + CHUNK_BYTES])
