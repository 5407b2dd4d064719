"""States between ranks without pickle: a JSON tree and a safetensors buffer in one uint8 tensor.

Ranks may belong to different owners, so nothing a rank sends is unpickled by another: a state (nested
dicts and lists of tensors and JSON scalars, as checkpoints hold) travels as 8 bytes of JSON length, the JSON
tree (:func:`atoll.job.checkpoint.flatten_state`) and the tensors as a safetensors file. A malformed buffer
can fail to parse; it cannot run code.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from atoll.job.checkpoint import flatten_state, unflatten_state
from atoll.runtime.collective.failure import dist_call


def encode_state(state: dict[str, Any]) -> torch.Tensor:
    """``state`` as one uint8 buffer (1-D): 8 bytes of JSON length (little-endian), the JSON tree, then the
    tensors as a safetensors file."""
    tree, tensors = flatten_state(state)
    meta = json.dumps(tree).encode()
    blob = save_tensors(tensors) if tensors else b""
    return torch.frombuffer(bytearray(len(meta).to_bytes(8, "little") + meta + blob), dtype=torch.uint8)


def decode_state(buf: torch.Tensor) -> dict[str, Any]:
    """Inverse of :func:`encode_state`.

    Raises:
        ValueError: the buffer is not a state (bad JSON or safetensors).
    """
    raw = bytes(buf.numpy().tobytes())
    n = int.from_bytes(raw[:8], "little")
    tensors = load_tensors(raw[8 + n:]) if len(raw) > 8 + n else {}
    return unflatten_state(json.loads(raw[8:8 + n]), tensors)


def broadcast_state(state: dict[str, Any] | None, group: Any) -> dict[str, Any]:
    """Group rank 0's ``state`` on every rank of ``group`` (two broadcasts: the length, then the bytes)."""
    buf = encode_state(state) if state is not None else None
    size = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64)
    dist_call(dist.broadcast, size, group_src=0, group=group)
    if buf is None:
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
    dist_call(dist.broadcast, buf, group_src=0, group=group)
    return decode_state(buf)


def gather_states(state: dict[str, Any] | None, group: Any, is_dst: bool) -> list[dict[str, Any] | None] | None:
    """Every rank's ``state`` (None: nothing to send) on group rank 0, in group rank order; None elsewhere.

    Two collectives over ``group``: an all-gather of the buffers' lengths, then a gather of the buffers
    padded to the longest.
    """
    buf = encode_state(state) if state is not None else torch.empty(0, dtype=torch.uint8)
    world = dist.get_world_size(group)
    size = torch.tensor([buf.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist_call(dist.all_gather, sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.cat([buf, buf.new_zeros(longest - buf.numel())])
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if is_dst else None
    dist_call(dist.gather, padded, parts, group_dst=0, group=group)
    if parts is None:
        return None
    return [decode_state(p[:int(s)]) if int(s) else None for p, s in zip(parts, sizes, strict=True)]


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the CPU, through dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj
