"""SparseLoCo's compressor: chunk-wise top-k of a flat vector, values quantized to 2 bits, and its exact size.

Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with SparseLoCo"
(arXiv:2508.15706), §3: each parameter tensor is cut into chunks of ``chunk`` elements; in every chunk the
``k`` entries of largest magnitude are kept (their positions within the chunk and their values), the rest
is dropped, and the kept values travel quantized to 2 bits.

Chunks never straddle two parameters: each parameter's elements (its slice of the flat vector, in
``parameters()`` order) are cut into ``ceil(numel / chunk)`` chunks, the last one padded with zeros that are
never sent as values (a padded position can only be picked when the chunk holds fewer than ``k`` non-zero
entries, and then its value is 0).

2-bit values: each kept value becomes one of four levels of its chunk, ``-hi, -lo, +lo, +hi``, where ``lo``
and ``hi`` are the mean magnitudes of the chunk's kept values below and above their median: a two-level
Lloyd quantizer of the magnitudes with the sign (a chunk of equal magnitudes is exact). The levels travel as
two float32 per chunk. The rounding error stays in the sender's error-feedback accumulator and is sent
later (SparseLoCo §3), so the quantizer need not be unbiased. ``bits=32`` sends the kept values as float32
instead (no quantization), for the identities and studies.

Bytes of one payload, for ``C`` chunks (``n = C * k`` kept entries; ``index_bytes`` 1, 2 or 4: the smallest
signed integer that holds ``chunk - 1``)::

    bits=2:   n * index_bytes + ceil(n / 4) + 8 * C
    bits=32:  n * index_bytes + 4 * n
"""

from __future__ import annotations

import math

import torch

from atoll.algorithms.dct import index_dtype_for
from atoll.algorithms.demo_payload import pack_2bit, unpack_2bit

__all__ = ["SparseCompressor"]


class SparseCompressor:
    """Chunk-wise top-k with 2-bit (or float32) values over a model's flat parameter vector.

    Args:
        numels: the element counts of the model's parameters, in the flat vector's order.
        chunk: elements per chunk (>= 1).
        topk: entries kept per chunk (1 <= topk <= chunk).
        bits: 2 (sign + one of two per-chunk magnitude levels) or 32 (float32 values).

    Raises:
        ValueError: a setting out of range.
    """

    def __init__(self, numels: list[int], chunk: int, topk: int, bits: int = 2) -> None:
        if not 1 <= topk <= chunk:
            raise ValueError(f"topk {topk} must lie in 1..chunk ({chunk})")
        if bits not in (2, 32):
            raise ValueError(f"bits must be 2 or 32, not {bits}")
        self.numel, self.chunk, self.topk, self.bits = sum(numels), chunk, topk, bits
        rows = []  # for every chunk, the flat positions of its elements; padding points at index numel (a zero)
        offset = 0
        for n in numels:
            padded = math.ceil(n / chunk) * chunk
            pos = torch.arange(offset, offset + padded)
            rows.append(torch.where(pos < offset + n, pos, torch.tensor(self.numel)).view(-1, chunk))
            offset += n
        self.gather = torch.cat(rows)  # (C, chunk) int64
        self.chunks = int(self.gather.shape[0])
        # entries that can carry a value: at most the real (unpadded) elements of each chunk
        self.kept_real = int((self.gather < self.numel).sum(dim=1).clamp(max=topk).sum())
        self.index_dtype = index_dtype_for(chunk)

    @property
    def kept(self) -> int:
        """Entries sent per payload, ``C * k`` (padded positions of a parameter's last chunk included)."""
        return self.chunks * self.topk

    @property
    def density(self) -> float:
        """The share of the model's entries a payload can update: ``sum over chunks of min(k, real elements)``
        over ``numel`` (at most 1; padding is sent but never counted)."""
        return self.kept_real / self.numel

    def payload_bytes(self) -> int:
        """Bytes of one payload on the wire (module docstring)."""
        n = self.kept
        idx = n * torch.empty(0, dtype=self.index_dtype).element_size()
        return idx + (math.ceil(n / 4) + 8 * self.chunks if self.bits == 2 else 4 * n)

    def _chunks(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.detach().reshape(-1).float(), x.new_zeros(1, dtype=torch.float32)])[self.gather]

    def compress(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The payload of ``x`` (float32, (numel,)): ``indices`` (C, k) within each chunk, and ``signs``
        (the 2-bit level codes, (ceil(n / 4),) uint8) with ``levels`` (C, 2) float32 ``[lo, hi]`` for
        ``bits=2``, or ``values`` (C, k) float32 for ``bits=32``."""
        xc = self._chunks(x)
        idx = torch.topk(xc.abs(), self.topk, dim=1, sorted=False).indices.sort(dim=1).values
        vals = xc.gather(1, idx)
        out = {"indices": idx.to(self.index_dtype)}
        if self.bits == 32:
            return {**out, "values": vals}
        mag = vals.abs()
        high = mag > mag.median(dim=1, keepdim=True).values
        n_hi = high.sum(dim=1)
        hi = torch.where(high, mag, 0).sum(dim=1) / n_hi.clamp(min=1)
        lo = torch.where(high, 0, mag).sum(dim=1) / (self.topk - n_hi).clamp(min=1)
        codes = (vals < 0).to(torch.uint8) * 2 + high.to(torch.uint8)  # 0: +lo, 1: +hi, 2: -lo, 3: -hi
        return {**out, "signs": pack_2bit(codes), "levels": torch.stack([lo, hi], dim=1)}

    def decompress(self, payload: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 (numel,) vector a payload stands for (zeros where nothing was kept)."""
        idx = payload["indices"].long()
        if self.bits == 32:
            vals = payload["values"].float()
        else:
            codes = unpack_2bit(payload["signs"], self.kept, "sparseloco").view(self.chunks, self.topk).long()
            levels = payload["levels"].float()
            mag = torch.where(codes % 2 == 1, levels[:, 1:2], levels[:, 0:1])
            vals = torch.where(codes >= 2, -mag, mag)
        out = torch.zeros(self.numel + 1, dtype=torch.float32)
        out[self.gather.gather(1, idx)] = vals
        return out[:-1]

