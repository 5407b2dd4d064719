"""What one DeMo island sends per step, per parameter: :class:`DemoPayload`, and its exact size.

Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (Algorithm 1, the
sparse payload ``q_t``): the ``k = min(topk, chunk_elems)`` largest DCT-II coefficients of each chunk of a
parameter's momentum (:mod:`atoll.algorithms.dct`), as their positions within the chunk and their values.

Bytes sent per island per step, for one parameter (``payload_bytes``), with ``n = num_chunks * k`` kept
coefficients and ``k = min(topk, chunk_elems)``::

    n * index_bytes + n * 4          # float32 values (sign_values=False)
    n * index_bytes + ceil(n / 4)    # sign values, ternary {-1, 0, +1} packed 2 bits each (sign_values=True)

where ``chunk_elems`` is the tile size (``h * w``) and ``index_bytes`` is 1, 2 or 4 (int8 / int16 / int32,
the smallest signed integer that holds ``chunk_elems - 1``). Shapes are not sent: every island knows the
model's parameter shapes.

Sign values: Psyche (Nous Research's DisTrO network) sends 1 bit per value. We keep an exact zero as a third
state and spend 2 bits: the top-k of an all-zero chunk (the momentum of embedding rows that no token has
touched yet, a parameter whose gradient is None) has value 0, and one bit would turn it into a spurious +1
that the sign step then applies as a real update of ``lr`` to parameters that had no gradient.
:func:`pack_ternary` and :func:`unpack_ternary` are that 2-bit format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from atoll.algorithms.dct import ChunkedDCT, index_dtype_for

__all__ = [
    "DemoPayload",
    "pack_2bit",
    "pack_ternary",
    "payload_bytes",
    "unpack_2bit",
    "unpack_ternary",
]


_TERNARY_SHIFTS = (0, 2, 4, 6)  # value j of a byte sits in bits 2j, 2j+1 (little-endian within the byte)
_TERNARY_DECODE = (0, 1, 0, -1)  # 2-bit code -> value: 0b00 -> 0, 0b01 -> +1, 0b11 -> -1 (0b10 unused)


def pack_ternary(values: torch.Tensor) -> torch.Tensor:
    """Pack ternary values {-1, 0, +1} 2 bits each, 4 per byte (DeMo sign values on the wire).

    The values of DeMo's sparse payload ``q_t`` (arXiv:2411.19870, Algorithm 1) reduced to their signs, as
    Psyche sends them, with zero kept as a third state (module docstring: why 2 bits and not 1).

    Codes are the 2-bit two's complement of the value: 0 -> ``0b00``, +1 -> ``0b01``, -1 -> ``0b11``; value
    ``j`` of the flattened input goes to bits ``2*(j % 4)`` and up of byte ``j // 4``; the last byte is
    padded with zero codes. All-zero values pack to all-zero bytes. Lossless: ``unpack_ternary(packed,
    values.numel())`` gives ``values`` back (as int8, flattened).

    Args:
        values: any shape, an integer or float dtype, every element in {-1, 0, +1}; not checked here
            (``torch.sign(x).to(torch.int8)`` gives such values).

    Returns:
        uint8 tensor of shape ``(ceil(values.numel() / 4),)`` on ``values.device``.
    """
    return pack_2bit(torch.bitwise_and(values.detach().reshape(-1).to(torch.int8), 3))  # -1 -> 3, +1 -> 1


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes (integers in 0..3, any shape) 4 per byte: code ``j`` of the flattened input in bits
    ``2*(j % 4)`` and up of byte ``j // 4``, the last byte padded with zero codes.

    Returns:
        uint8 tensor of shape ``(ceil(codes.numel() / 4),)`` on ``codes.device``.
    """
    flat = codes.detach().reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.tensor(_TERNARY_SHIFTS, dtype=torch.uint8, device=flat.device)
    # the four shifted codes occupy disjoint bits, so their sum is their bitwise or (at most 255)
    return torch.bitwise_left_shift(flat.reshape(-1, 4), shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_2bit(packed: torch.Tensor, numel: int, who: str = "unpack_2bit") -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: the first ``numel`` codes (uint8 in 0..3, shape ``(numel,)``).

    Raises:
        ValueError: ``packed`` is not a 1-D uint8 tensor of ``ceil(numel / 4)`` bytes (``who`` names the caller).
    """
    expected = -(-numel // 4)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
        raise ValueError(
            f"{who}: expected a 1-D uint8 tensor of ceil({numel} / 4) = {expected} bytes, got "
            f"{packed.dtype} of shape {tuple(packed.shape)}"
        )
    shifts = torch.tensor(_TERNARY_SHIFTS, dtype=torch.uint8, device=packed.device)
    return torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(1), shifts), 3).reshape(-1)[:numel]


def unpack_ternary(packed: torch.Tensor, numel: int, check: bool = True) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: the first ``numel`` ternary values of ``packed``.

    Args:
        packed: uint8 tensor of shape ``(ceil(numel / 4),)``.
        numel: number of values packed, >= 0.
        check: refuse the unused code (one host read of a flag); False: it decodes to 0, and the caller has
            checked every payload of the step at once (:meth:`DemoPayload.corrupt`, one read for them all).

    Returns:
        int8 tensor of shape ``(numel,)`` with values in {-1, 0, +1}, on ``packed.device``.

    Raises:
        ValueError: ``packed`` is not a 1-D uint8 tensor of ``ceil(numel / 4)`` bytes, or holds the unused
            code ``0b10`` among its first ``numel`` values (a corrupt payload).
    """
    codes = unpack_2bit(packed, numel, "unpack_ternary")
    if check and bool((codes == 2).any()):
        raise ValueError("unpack_ternary: code 0b10 is not a ternary value; the payload is corrupt")
    table = torch.tensor(_TERNARY_DECODE, dtype=torch.int8, device=packed.device)
    return table[codes.long()]


@dataclass(frozen=True)
class DemoPayload:
    """What one island sends for one parameter in one step (DeMo Algorithm 1, the sparse ``q_t``).

    Attributes:
        indices: (num_chunks, k) int8 / int16 / int32 (``index_dtype_for(chunk_elems)``), positions within
            each chunk's flattened coefficients.
        values: (num_chunks, k) float32 coefficients; or, when ``sign_values``, the signs {-1, 0, +1} of
            the (num_chunks, k) coefficients in row-major order packed 2 bits each by :func:`pack_ternary`:
            uint8 of shape ``(ceil(num_chunks * k / 4),)``. :meth:`dense_values` decodes either form.
        shape: the parameter's shape (metadata that every island already knows; not counted in bytes).
        chunk_elems: elements per chunk (metadata; not counted).
        sign_values: whether ``values`` holds packed signs (metadata, fixed by the optimizer; not counted).
    """

    indices: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, ...]
    chunk_elems: int
    sign_values: bool = False

    @property
    def num_chunks(self) -> int:
        return int(self.indices.shape[0])

    @property
    def k(self) -> int:
        return int(self.indices.shape[1])

    @property
    def nbytes(self) -> int:
        """Exact bytes on the wire: ``indices`` plus ``values`` as stored (their dtype sizes)."""
        return (
            self.indices.numel() * self.indices.element_size()
            + self.values.numel() * self.values.element_size()
        )

    def dense_values(self, check: bool = True) -> torch.Tensor:
        """The kept coefficients as a (num_chunks, k) float32 tensor: the values, or the signs +-1 / 0.

        ``check``: refuse a corrupt sign code here (a host read); False where :meth:`corrupt` was checked.

        Raises:
            ValueError: packed sign values of the wrong size or (with ``check``) with a corrupt code.
        """
        if self.sign_values:
            n = self.num_chunks * self.k
            return unpack_ternary(self.values, n, check).reshape(self.num_chunks, self.k).to(torch.float32)
        return self.values.to(torch.float32)

    def corrupt(self) -> torch.Tensor:
        """Whether packed sign values hold the unused code ``0b10``: a 0-d bool tensor on the values' device,
        not read (float32 values: False).

        Raises:
            ValueError: packed sign values of the wrong size.
        """
        if not self.sign_values:
            return torch.zeros((), dtype=torch.bool, device=self.values.device)
        return (unpack_2bit(self.values, self.num_chunks * self.k, "DemoPayload.corrupt") == 2).any()


def _check_chunk_topk(chunk: Any, topk: Any) -> None:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"demo_chunk must be a positive integer (DeMo uses 64), got {chunk!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= chunk * chunk:
        raise ValueError(
            f"demo_topk must be an integer in [1, demo_chunk**2 = {chunk * chunk}] "
            f"(coefficients kept per chunk; DeMo uses 32), got {topk!r}"
        )


def payload_bytes(shape: Sequence[int], chunk: int = 64, topk: int = 32, sign_values: bool = False) -> int:
    """Closed-form bytes one island sends for one parameter per step (DeMo Algorithm 1, the payload ``q_t``).

    With ``n = num_chunks * min(topk, chunk_elems)`` kept coefficients (the tiling of
    ``ChunkedDCT(shape, chunk)``; ``topk`` is clamped to the tile size for tiles smaller than
    ``chunk x chunk``: 1-D parameters, dimensions that ``chunk`` does not divide) and ``index_bytes`` from
    ``index_dtype_for(chunk_elems)`` (1, 2 or 4): ``n * index_bytes + n * 4`` with float32 values, or
    ``n * index_bytes + ceil(n / 4)`` with sign values (ternary, 2 bits each, see :func:`pack_ternary`).
    Equals ``DemoPayload.nbytes`` of ``DeMo.encode_step()``'s payload for that parameter.

    Args:
        shape: the parameter's shape (any number of dimensions).
        chunk: DCT tile side, >= 1.
        topk: coefficients kept per chunk, 1 .. chunk**2.
        sign_values: price packed sign values instead of float32 values.

    Returns:
        Bytes (an int).

    Raises:
        ValueError: ``chunk`` or ``topk`` is invalid (``topk > chunk**2``).
    """
    _check_chunk_topk(chunk, topk)
    t = ChunkedDCT(shape, chunk)
    n = t.num_chunks * min(topk, t.chunk_elems)
    index_bytes = torch.empty((), dtype=index_dtype_for(t.chunk_elems)).element_size()
    value_bytes = -(-n // 4) if sign_values else 4 * n
    return n * index_bytes + value_bytes
