"""What travels between an island and ``atoll syncer``: method names, metadata keys, JSON and safetensors.

Control calls (join, step grants, heartbeats, buffer and pull metadata, the commit of a push) are unary
calls of JSON objects on the control connection; tensors travel as safetensors bytes in chunks of
:data:`CHUNK_BYTES` on a separate bulk connection (``Upload``: client-streaming, resumable at the offset the
syncer reports; ``Download``: server-streaming from an offset). Nothing is ever unpickled: a payload that is
not a JSON object or a safetensors file of exactly one tensor is refused.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

#: the gRPC service's name; methods are ``/atoll.Syncer/<Name>``
SERVICE = "atoll.Syncer"
#: unary JSON -> JSON methods on the control connection
CONTROL = ("Join", "ReserveSteps", "Buffered", "Heartbeat", "UploadStatus", "Push", "PullMeta", "Leave")
#: bytes per chunk of a tensor transfer (gRPC's default message limit is 4 MiB)
CHUNK_BYTES = 1 << 20
#: call metadata carrying the caller's island index and its secret
ISLAND_KEY, CREDENTIAL_KEY = "atoll-island", "atoll-credential"
#: the one tensor name in a safetensors payload
TENSOR_NAME = "t"


def method(name: str) -> str:
    """The full gRPC method path of ``name``."""
    return f"/{SERVICE}/{name}"


def dumps(obj: dict[str, Any]) -> bytes:
    """A JSON object as compact UTF-8 bytes."""
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes) -> dict[str, Any]:
    """A JSON object from bytes.

    Raises:
        ValueError: not UTF-8 JSON, or not an object.
    """
    obj = json.loads(data.decode())
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def tensor_bytes(t: torch.Tensor) -> bytes:
    """One tensor (any shape and dtype, on the CPU) as a safetensors file's bytes."""
    return st_save({TENSOR_NAME: t.detach().contiguous().cpu()})


def bytes_tensor(data: bytes) -> torch.Tensor:
    """The tensor of :func:`tensor_bytes`'s bytes (its shape and dtype as sent: the caller checks them).

    Raises:
        ValueError: not a safetensors file holding exactly the one tensor.
    """
    try:
        tensors = st_load(bytes(data))
    except Exception as e:  # safetensors raises its own SafetensorError on malformed headers
        raise ValueError(f"not a safetensors payload ({type(e).__name__})") from None
    if set(tensors) != {TENSOR_NAME}:
        raise ValueError(f"expected one tensor named {TENSOR_NAME!r}, got {sorted(tensors)[:4]}")
    return tensors[TENSOR_NAME]


def chunks(data: bytes, offset: int = 0) -> list[bytes]:
    """``data[offset:]`` cut into chunks of at most :data:`CHUNK_BYTES`."""
    return [data[i:i + CHUNK_BYTES] for i in range(offset, len(data), CHUNK_BYTES)]


def parse_address(text: str, field: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port).

    Raises:
        ValueError: one line naming ``field``: no port, a port outside 1..65535 (0 for ``listen``: any), or no host.
    """
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    low = 0 if field == "listen" else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) <= 65535:
        raise ValueError(f"{field}: '{text}' is not HOST:PORT with a port in {low}..65535; pass e.g. "
                         f"--{field} {'0.0.0.0' if field == 'listen' else 'syncer.example.org'}:7070")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Does ``host`` name this machine only (``localhost``, 127.0.0.0/8, ::1)? Names are not resolved."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
