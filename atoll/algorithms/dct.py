"""Chunked orthonormal DCT-II, the transform that DeMo applies to each island's momentum.

Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (section 3.1):
the DCT-II of each chunk decorrelates the momentum so that a few coefficients carry most of its energy;
the basis is orthonormal, so the inverse (the DCT-III) is the transpose.

A parameter is viewed as a 2-D (rows, cols) matrix (0-d -> (1, 1), 1-D (n,) -> (1, n), ndim > 2 ->
(shape[0], prod(shape[1:]))) and cut into ``h x w`` tiles, ``h`` the largest divisor of ``rows`` that is
<= ``chunk`` and ``w`` the same for ``cols`` (DeMo's reference rule, :func:`largest_divisor_at_most`).
:class:`ChunkedDCT` transforms every tile with the separable 2-D DCT ``B_h @ tile @ B_w.T`` and returns
the coefficients as ``(num_chunks, chunk_elems)`` float32, one row per tile; :func:`index_dtype_for` is the
smallest signed integer dtype that holds a position within one such row (what DeMo's payload sends as
indices, :mod:`atoll.algorithms.demo_payload`).

Example::

    t = ChunkedDCT((4096, 1024), chunk=64)   # 64 x 64 tiles: t.num_chunks == 1024, t.chunk_elems == 4096
    coeffs = t.encode(momentum)               # (1024, 4096) float32
    momentum_again = t.decode(coeffs)         # (4096, 1024) float32, to float32 rounding
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "ChunkedDCT",
    "dct_basis",
    "index_dtype_for",
    "largest_divisor_at_most",
]


@functools.lru_cache(maxsize=64)
def _dct_basis_cached(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2.0 * i + 1.0) * k / (2.0 * n)) * math.sqrt(2.0 / n)
    basis[0] *= 1.0 / math.sqrt(2.0)
    # entries that are 0 in exact arithmetic ((2i + 1) k = n (2m + 1), e.g. n = 6, k = 2, i = 1; never for a
    # power of two) come out of cos() as 1e-17..1e-15: snap them, so that sign() of what they decode is 0
    basis[basis.abs() < 1e-12] = 0.0
    return basis.to(torch.float32)


def dct_basis(n: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix of size ``n``.

    ``basis[k, i] = sqrt(2/n) * c_k * cos(pi * (2i + 1) * k / (2n))`` with ``c_0 = 1/sqrt(2)``, ``c_k = 1``
    otherwise, so ``basis @ basis.T == I`` and ``y = basis @ x`` is the DCT-II of a length-``n`` vector
    (``x = basis.T @ y`` its inverse, the DCT-III). Computed in float64, returned as float32.

    Args:
        n: transform length, >= 1.

    Returns:
        A fresh (n, n) float32 CPU tensor (a copy of a cached one; safe to modify).

    Raises:
        ValueError: ``n`` is not a positive integer.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"demo_chunk: DCT size must be a positive integer, got {n!r}")
    return _dct_basis_cached(n).clone()


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is <= ``limit`` (1 at worst), as DeMo's reference chunks.

    A dimension of 4096 with chunk 64 is cut into 64 tiles of 64; a dimension of 100 with chunk 64 into
    2 tiles of 50; a prime dimension such as 97 into 97 tiles of 1 (the DCT of size 1 is the identity).
    """
    if n < 1:
        return 1
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


def index_dtype_for(chunk_elems: int) -> torch.dtype:
    """Smallest signed integer dtype that holds a within-chunk index ``0 .. chunk_elems - 1``.

    int8 up to 128 elements (a 1-D chunk of 64), int16 up to 32768 (a 64 x 64 tile), int32 beyond.
    """
    if chunk_elems <= 1 << 7:
        return torch.int8
    if chunk_elems <= 1 << 15:
        return torch.int16
    return torch.int32


def _as_2d_shape(shape: Sequence[int]) -> tuple[int, int]:
    """How a parameter shape is viewed for chunking: (rows, cols).

    0-d -> (1, 1); 1-D (n,) -> (1, n) (chunked along its only axis); 2-D as is; ndim > 2 flattened to
    (shape[0], prod(shape[1:])).
    """
    dims = tuple(int(d) for d in shape)
    if len(dims) == 0:
        return 1, 1
    if len(dims) == 1:
        return 1, dims[0]
    return dims[0], math.prod(dims[1:])


class ChunkedDCT:
    """Tiled orthonormal DCT-II for one parameter shape (DeMo section 3.1).

    The parameter is viewed as (rows, cols) (see below) and cut into ``h x w`` tiles where ``h`` is the
    largest divisor of ``rows`` that is <= ``chunk`` and ``w`` the same for ``cols`` (DeMo's reference
    rule; tiles are ``chunk x chunk`` when both dimensions divide, smaller otherwise). Each tile gets the
    separable 2-D DCT ``B_h @ tile @ B_w.T``. Views: a 1-D tensor (n,) is (1, n), so its tiles are
    ``1 x w`` runs along its only axis; a tensor with ndim > 2 is flattened to (shape[0], rest); a scalar
    is (1, 1).

    Attributes:
        shape: the parameter shape.
        rows, cols: the 2-D view.
        tile: (h, w).
        num_chunks: ``(rows // h) * (cols // w)``.
        chunk_elems: ``h * w``.

    Raises:
        ValueError: ``chunk`` is not a positive integer.
    """

    def __init__(self, shape: Sequence[int], chunk: int) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"demo_chunk must be a positive integer, got {chunk!r}")
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)
        self.chunk = chunk
        self.rows, self.cols = _as_2d_shape(self.shape)
        h = largest_divisor_at_most(self.rows, chunk)
        w = largest_divisor_at_most(self.cols, chunk)
        self.tile: tuple[int, int] = (h, w)
        self.num_chunks: int = (self.rows // h) * (self.cols // w)
        self.chunk_elems: int = h * w
        self._bases: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _basis(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self._bases.get(device)
        if pair is None:
            h, w = self.tile
            pair = (_dct_basis_cached(h).to(device), _dct_basis_cached(w).to(device))
            self._bases[device] = pair
        return pair

    def encode(self, x: torch.Tensor, buffers: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Forward tiled DCT.

        Args:
            x: tensor of ``self.shape`` (any float dtype; computed in float32).
            buffers: None (fresh tensors), or three contiguous float32 tensors of at least ``numel`` elements
                each, on ``x``'s device, not overlapping, the first two not overlapping ``x``: the two matmuls'
                results go into the first two and the coefficients into the third (the same floats; no allocation,
                which on the CPU costs a page fault per 4 KiB of a fresh tensor; no autograd, as for any ``out=``).

        Returns:
            Coefficients, (num_chunks, chunk_elems) float32, chunks in row-major tile order, each chunk's
            coefficients row-major within the tile (frequency (i, j) at ``i * w + j``); with ``buffers``, a view
            of the third.

        Raises:
            ValueError: ``x`` does not have ``self.shape``, or ``buffers`` are not as above.
        """
        if tuple(x.shape) != self.shape:
            raise ValueError(f"ChunkedDCT.encode: expected shape {self.shape}, got {tuple(x.shape)}")
        h, w = self.tile
        bh, bw = self._basis(x.device)
        r, c = self.rows // h, self.cols // w
        first, second, out = self._views(buffers, x, (self.rows, c, w), (r, h, c * w), (r, c, h, w))
        # Separable DCT as two plain matmuls (faster than one einsum on CPU): along each tile's columns,
        # then along its rows; one permute copy puts each tile's coefficients in a row.
        y = torch.matmul(x.detach().to(torch.float32).reshape(self.rows, c, w), bw.T, out=first)  # (rows, c, w)
        y = torch.matmul(bh, y.reshape(r, h, c * w), out=second)  # (r, h, c * w)
        y = y.reshape(r, h, c, w).permute(0, 2, 1, 3)
        return (y.reshape(r, c, h, w) if out is None else out.copy_(y)).reshape(self.num_chunks, self.chunk_elems)

    def decode(self, coeffs: torch.Tensor, buffers: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Inverse tiled DCT, the exact inverse of ``encode`` (to float32 rounding).

        Args:
            coeffs: (num_chunks, chunk_elems) float tensor.
            buffers: as :meth:`encode`'s: the permuted coefficients go into the first, the first matmul's result
                into the second and the output into the third (which may hold ``coeffs``: they are read first).

        Returns:
            float32 tensor of ``self.shape``; with ``buffers``, a view of the third.

        Raises:
            ValueError: ``coeffs`` has the wrong shape, or ``buffers`` are not as :meth:`encode` needs them.
        """
        if tuple(coeffs.shape) != (self.num_chunks, self.chunk_elems):
            raise ValueError(
                f"ChunkedDCT.decode: expected coefficients ({self.num_chunks}, {self.chunk_elems}), "
                f"got {tuple(coeffs.shape)}"
            )
        h, w = self.tile
        bh, bw = self._basis(coeffs.device)
        r, c = self.rows // h, self.cols // w
        first, second, out = self._views(buffers, coeffs, (r, h, c, w), (r, h, c * w), (self.rows, c, w))
        y = coeffs.to(torch.float32).reshape(r, c, h, w).permute(0, 2, 1, 3)
        y = (y.reshape(r, h, c, w) if first is None else first.copy_(y)).reshape(r, h, c * w)
        y = torch.matmul(bh.T, y, out=second)  # (r, h, c * w)
        return torch.matmul(y.reshape(self.rows, c, w), bw, out=out).reshape(self.shape)

    def _views(self, buffers: Sequence[torch.Tensor] | None, source: torch.Tensor,
               *shapes: tuple[int, ...]) -> tuple[torch.Tensor | None, ...]:
        """The first ``numel`` elements of each of ``buffers``, shaped as ``shapes`` (Nones for no buffers).

        Raises:
            ValueError: not three buffers; one too short, not float32, not contiguous or not on ``source``'s
                device; two of them overlapping; or ``source`` (the input) overlapping the first two.
        """
        if buffers is None:
            return (None,) * len(shapes)
        n = self.rows * self.cols
        if (len(buffers) != len(shapes)
                or any(b.dtype != torch.float32 or b.numel() < n or not b.is_contiguous() for b in buffers)):
            raise ValueError(f"ChunkedDCT: buffers must be {len(shapes)} contiguous float32 tensors of at least {n} "
                             "elements")
        if any(b.device != source.device for b in buffers):
            raise ValueError(f"ChunkedDCT: buffers must be on the input's device, {source.device}")
        used = [b.reshape(-1)[:n] for b in buffers]
        spans = [_bytes_of(b) for b in used]
        if (any(_overlap(a, b) for i, a in enumerate(spans) for b in spans[i + 1:])
                or any(_overlap(_bytes_of(source), b) for b in spans[:2])):
            raise ValueError("ChunkedDCT: the buffers must not overlap each other, nor the first two the input")
        return tuple(b.view(shape) for b, shape in zip(used, shapes, strict=True))

    def __repr__(self) -> str:
        return (
            f"ChunkedDCT(shape={self.shape}, tile={self.tile}, num_chunks={self.num_chunks}, "
            f"chunk_elems={self.chunk_elems})"
        )


def _bytes_of(t: torch.Tensor) -> tuple[int, int]:
    """The byte addresses ``[start, end)`` that ``t`` may read or write: its own span when contiguous, its whole
    storage otherwise (a strided view's elements lie anywhere in it)."""
    if t.is_contiguous():
        return t.data_ptr(), t.data_ptr() + t.element_size() * t.numel()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]
