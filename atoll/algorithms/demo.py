"""DeMo: decoupled momentum with top-k DCT components, exchanged every step, sign-SGD applied.

Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (Algorithm 1),
the algorithm behind Nous Research's DisTrO. Each island keeps its own float32 momentum ``m`` and, every
step, sends only the fast-moving part of it: the ``topk`` largest DCT-II coefficients of each chunk. What is
sent is subtracted from ``m`` (the rest keeps accumulating for later steps), every island decodes the
islands' payloads, averages them, and applies the sign of the average.

Usage, one island (a plain optimizer)::

    opt = DeMo(model.parameters(), lr=1e-3, beta=0.999, chunk=64, topk=32)
    loss.backward(); opt.step(); opt.zero_grad()

Usage, several islands in lockstep in one process (what a runtime does)::

    payloads = [opt.encode_step() for opt in opts]      # payloads[island][param]
    for opt in opts:
        opt.apply_step(payloads)                          # every island gets the same list, same order

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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ChunkedDCT",
    "DeMo",
    "DemoPayload",
    "dct_basis",
    "index_dtype_for",
    "largest_divisor_at_most",
    "pack_ternary",
    "payload_bytes",
    "unpack_ternary",
]

AllGatherFn = Callable[[list["DemoPayload"]], list[list["DemoPayload"]]]


# --------------------------------------------------------------------------------------------------------
# DCT helpers (DeMo section 3.1: the DCT-II of each chunk decorrelates the momentum so that a few
# coefficients carry most of its energy; orthonormal, so the inverse is the transpose).
# --------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _dct_basis_cached(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2.0 * i + 1.0) * k / (2.0 * n)) * math.sqrt(2.0 / n)
    basis[0] *= 1.0 / math.sqrt(2.0)
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

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Forward tiled DCT.

        Args:
            x: tensor of ``self.shape`` (any float dtype; computed in float32).

        Returns:
            Coefficients, (num_chunks, chunk_elems) float32, chunks in row-major tile order, each chunk's
            coefficients row-major within the tile (frequency (i, j) at ``i * w + j``).

        Raises:
            ValueError: ``x`` does not have ``self.shape``.
        """
        if tuple(x.shape) != self.shape:
            raise ValueError(f"ChunkedDCT.encode: expected shape {self.shape}, got {tuple(x.shape)}")
        h, w = self.tile
        bh, bw = self._basis(x.device)
        r, c = self.rows // h, self.cols // w
        # Separable DCT as two plain matmuls (faster than one einsum on CPU): along each tile's columns,
        # then along its rows; one permute copy puts each tile's coefficients in a row.
        y = x.detach().to(torch.float32).reshape(self.rows, c, w) @ bw.T  # (rows, c, w)
        y = bh @ y.reshape(r, h, c * w)  # (r, h, c * w)
        return y.reshape(r, h, c, w).permute(0, 2, 1, 3).reshape(self.num_chunks, self.chunk_elems)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Inverse tiled DCT, the exact inverse of ``encode`` (to float32 rounding).

        Args:
            coeffs: (num_chunks, chunk_elems) float tensor.

        Returns:
            float32 tensor of ``self.shape``.

        Raises:
            ValueError: ``coeffs`` has the wrong shape.
        """
        if tuple(coeffs.shape) != (self.num_chunks, self.chunk_elems):
            raise ValueError(
                f"ChunkedDCT.decode: expected coefficients ({self.num_chunks}, {self.chunk_elems}), "
                f"got {tuple(coeffs.shape)}"
            )
        h, w = self.tile
        bh, bw = self._basis(coeffs.device)
        r, c = self.rows // h, self.cols // w
        y = coeffs.to(torch.float32).reshape(r, c, h, w).permute(0, 2, 1, 3).reshape(r, h, c * w)
        y = bh.T @ y  # (r, h, c * w)
        return (y.reshape(self.rows, c, w) @ bw).reshape(self.shape)

    def __repr__(self) -> str:
        return (
            f"ChunkedDCT(shape={self.shape}, tile={self.tile}, num_chunks={self.num_chunks}, "
            f"chunk_elems={self.chunk_elems})"
        )


# --------------------------------------------------------------------------------------------------------
# Payload and its size
# --------------------------------------------------------------------------------------------------------


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
    flat = values.detach().reshape(-1).to(torch.int8)
    n = flat.numel()
    pad = -n % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    codes = torch.bitwise_and(flat, 3).to(torch.uint8).reshape(-1, 4)  # -1 (0xff) -> 3, +1 -> 1, 0 -> 0
    shifts = torch.tensor(_TERNARY_SHIFTS, dtype=torch.uint8, device=codes.device)
    # the four shifted codes occupy disjoint bits, so their sum is their bitwise or (at most 255)
    return torch.bitwise_left_shift(codes, shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_ternary(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: the first ``numel`` ternary values of ``packed``.

    Args:
        packed: uint8 tensor of shape ``(ceil(numel / 4),)``.
        numel: number of values packed, >= 0.

    Returns:
        int8 tensor of shape ``(numel,)`` with values in {-1, 0, +1}, on ``packed.device``.

    Raises:
        ValueError: ``packed`` is not a 1-D uint8 tensor of ``ceil(numel / 4)`` bytes, or holds the unused
            code ``0b10`` among its first ``numel`` values (a corrupt payload).
    """
    expected = -(-numel // 4)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
        raise ValueError(
            f"unpack_ternary: expected a 1-D uint8 tensor of ceil({numel} / 4) = {expected} bytes, got "
            f"{packed.dtype} of shape {tuple(packed.shape)}"
        )
    shifts = torch.tensor(_TERNARY_SHIFTS, dtype=torch.uint8, device=packed.device)
    codes = torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(1), shifts), 3).reshape(-1)[:numel]
    if bool((codes == 2).any()):
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

    def dense_values(self) -> torch.Tensor:
        """The kept coefficients as a (num_chunks, k) float32 tensor: the values, or the signs +-1 / 0.

        Raises:
            ValueError: packed sign values of the wrong size or with a corrupt code.
        """
        if self.sign_values:
            n = self.num_chunks * self.k
            return unpack_ternary(self.values, n).reshape(self.num_chunks, self.k).to(torch.float32)
        return self.values.to(torch.float32)


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


def _single_island(payloads: list[DemoPayload]) -> list[list[DemoPayload]]:
    return [payloads]


def _check_scalar(field: str, value: Any, low: float, high: float, high_open: bool, hint: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = low <= value < high if high_open else low <= value <= high
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{field} must be a number in [{low}, {high}{bracket} ({hint}), got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------------


class DeMo(torch.optim.Optimizer):
    """DeMo / DisTrO optimizer (arXiv:2411.19870, Algorithm 1), split into phases for a runtime.

    Per parameter with gradient ``g`` (``grad is None`` counts as a zero gradient, so every island sends
    one payload per parameter and the lists line up):

    a. ``m = beta * m + g``  (decoupled momentum, float32, never synchronised)
    b. ``C = DCT_chunks(m)``; per chunk keep the ``k = min(topk, chunk_elems)`` largest ``|C|`` entries
    c. ``m -= IDCT(sparse C)``  (what is sent leaves the momentum; the residual accumulates)
    d. all-gather the (indices, values) payloads across islands
    e. scatter every island's payload into zeros (island order as gathered), average over the islands
       that sent (``len(gathered)``), inverse DCT, ``p *= 1 - lr * weight_decay``, ``p -= lr * sign(avg)``.

    Phases: ``encode_step()`` does a-c and returns the payloads, ``apply_step(gathered)`` does e, and
    ``step()`` is ``apply_step(all_gather_fn(encode_step()))``.

    Args:
        params: parameters or param groups. Groups may override ``lr``, ``beta``, ``weight_decay``;
            ``chunk``, ``topk`` and ``sign_values`` are optimizer-wide (they fix the wire format).
        lr: step size of the sign update (parameter units per step), > 0. Field ``lr``.
        beta: momentum decay in [0, 1). Field ``demo_beta``.
        chunk: DCT tile side. Field ``demo_chunk``.
        topk: coefficients kept per chunk, 1 .. chunk**2. Field ``demo_topk``.
        weight_decay: decoupled, ``p *= 1 - lr * weight_decay`` before the sign update, >= 0.
        sign_values: send ``sign(value)`` in {-1, 0, +1}, packed 2 bits per value (4 per byte, see
            :func:`pack_ternary`), instead of float32 (4 bytes). Psyche sends 1 bit; we keep an exact 0
            as a third state because the top-k of an all-zero chunk (unused embedding rows) would
            otherwise become spurious +1s that the sign step applies. With int16 indices a kept
            coefficient costs 2.25 bytes instead of 6; the indices dominate. The momentum still loses
            the full-precision selected components (step c), as with float values. Default False here
            (DeMo's reference); the ``demo`` strategy's default is ``TrainConfig.demo_sign_values``.
        all_gather_fn: ``payloads -> gathered[island][param]``; must return the same list, in the same
            island order, on every island. Defaults to a single island (``[payloads]``).

    State (all in ``state_dict()``): per parameter ``momentum`` (float32, the parameter's shape, kept in
    float32 across ``load_state_dict`` even for bf16 parameters) and ``step`` (int64 scalar tensor).

    Raises:
        ValueError: a hyperparameter is invalid (message names ``lr``, ``demo_beta``, ``demo_chunk``,
            ``demo_topk``, ``weight_decay`` or ``sign_values``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        beta: float = 0.999,
        chunk: int = 64,
        topk: int = 32,
        weight_decay: float = 0.0,
        sign_values: bool = False,
        all_gather_fn: AllGatherFn | None = None,
    ) -> None:
        _check_chunk_topk(chunk, topk)
        if not isinstance(sign_values, bool):
            raise ValueError(f"sign_values must be true or false, got {sign_values!r}")
        if all_gather_fn is not None and not callable(all_gather_fn):
            raise ValueError(f"all_gather_fn must be callable or None, got {all_gather_fn!r}")
        self.chunk = chunk
        self.topk = topk
        self.sign_values = sign_values
        self.all_gather_fn: AllGatherFn = all_gather_fn if all_gather_fn is not None else _single_island
        self._transforms: dict[tuple[int, ...], ChunkedDCT] = {}
        defaults = {
            "lr": lr,
            "beta": beta,
            "weight_decay": weight_decay,
            "chunk": chunk,
            "topk": topk,
            "sign_values": sign_values,
        }
        super().__init__(params, defaults)

    # ---- configuration ------------------------------------------------------------------------------

    def _validate_group(self, group: dict[str, Any]) -> None:
        lr = group["lr"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"lr must be a finite number > 0 (sign-SGD step size per step), got {lr!r}")
        _check_scalar("demo_beta", group["beta"], 0.0, 1.0, True, "momentum decay; DeMo uses 0.999")
        _check_scalar("weight_decay", group["weight_decay"], 0.0, math.inf, True, "decoupled, >= 0")
        for key, field in (("chunk", "demo_chunk"), ("topk", "demo_topk"), ("sign_values", "sign_values")):
            if group[key] != getattr(self, key) or type(group[key]) is not type(getattr(self, key)):
                raise ValueError(
                    f"{field} is optimizer-wide (it fixes the wire format): a param group has "
                    f"{group[key]!r}, the optimizer {getattr(self, key)!r}"
                )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch semantics) and validate its hyperparameters. Raises ValueError."""
        self._validate_group({**self.defaults, **param_group})  # before adding: a bad group is never kept
        super().add_param_group(param_group)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def transform_for(self, shape: Sequence[int]) -> ChunkedDCT:
        """The (cached) ``ChunkedDCT`` for a parameter shape under this optimizer's ``chunk``."""
        key = tuple(int(d) for d in shape)
        t = self._transforms.get(key)
        if t is None:
            t = ChunkedDCT(key, self.chunk)
            self._transforms[key] = t
        return t

    def payload_bytes(self, shape: Sequence[int]) -> int:
        """Bytes one island sends for one parameter of ``shape`` per step (see module ``payload_bytes``)."""
        return payload_bytes(shape, self.chunk, self.topk, self.sign_values)

    def bytes_per_step(self) -> int:
        """Bytes one island sends per step for all parameters; equals ``sum(p.nbytes for p in encode_step())``."""
        return sum(self.payload_bytes(p.shape) for p in self._params())

    @property
    def step_count(self) -> int:
        """Steps taken (``encode_step`` calls), read from the first parameter's state; 0 before any."""
        for p in self._params():
            st = self.state.get(p)
            if st and "step" in st:
                return int(st["step"])
        return 0

    # ---- phases -------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_step(self) -> list[DemoPayload]:
        """Steps a-c for every parameter, in param-group order; returns what this island sends.

        Updates the momentum in place (adds the gradient, removes the transmitted components) and the
        step counter; leaves the parameters untouched (``apply_step`` moves them).

        Returns:
            One ``DemoPayload`` per parameter: indices (num_chunks, k) int8/int16/int32, values
            (num_chunks, k) float32 (with ``sign_values``: the signs packed 2 bits each, uint8 of shape
            ``(ceil(num_chunks * k / 4),)``), on the parameter's device.

        Raises:
            RuntimeError: no parameter has a gradient (call ``backward()`` first), or a gradient is sparse.
        """
        params = self._params()
        if params and all(p.grad is None for p in params):
            raise RuntimeError("DeMo.encode_step: no parameter has a gradient; call backward() first")
        payloads: list[DemoPayload] = []
        for group in self.param_groups:
            beta = group["beta"]
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("DeMo does not support sparse gradients")
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(
                        p, dtype=torch.float32, memory_format=torch.contiguous_format
                    )
                    state["step"] = torch.zeros((), dtype=torch.int64)
                m: torch.Tensor = state["momentum"]
                state["step"] = state["step"] + 1  # not in place: a loaded state_dict may alias it
                # a. decoupled momentum
                m.mul_(beta)
                if p.grad is not None:
                    m.add_(p.grad.to(torch.float32))
                # b. top-k DCT coefficients per chunk
                t = self.transform_for(p.shape)
                coeffs = t.encode(m)
                k = min(self.topk, t.chunk_elems)
                idx = torch.topk(coeffs.abs(), k, dim=1, sorted=False).indices
                vals = torch.gather(coeffs, 1, idx)
                # c. remove what is transmitted; the residual stays for later steps
                sparse = torch.zeros_like(coeffs).scatter_(1, idx, vals)
                m.sub_(t.decode(sparse))
                wire_vals = pack_ternary(torch.sign(vals)) if self.sign_values else vals
                payloads.append(
                    DemoPayload(
                        indices=idx.to(index_dtype_for(t.chunk_elems)),
                        values=wire_vals,
                        shape=t.shape,
                        chunk_elems=t.chunk_elems,
                        sign_values=self.sign_values,
                    )
                )
        return payloads

    def _sum_coefficients(
        self, t: ChunkedDCT, payloads: Sequence[DemoPayload], device: torch.device
    ) -> torch.Tensor:
        total = torch.zeros(t.num_chunks, t.chunk_elems, dtype=torch.float32, device=device)
        for island, pl in enumerate(payloads):
            if tuple(pl.shape) != t.shape or pl.chunk_elems != t.chunk_elems or pl.num_chunks != t.num_chunks:
                raise ValueError(
                    f"DeMo.apply_step: island {island} sent a payload for shape {tuple(pl.shape)}, "
                    f"expected {t.shape}"
                )
            island_coeffs = torch.zeros_like(total).scatter_(
                1,
                pl.indices.to(device=device, dtype=torch.int64),
                pl.dense_values().to(device=device),
            )
            total.add_(island_coeffs)
        return total

    def decode_payload(self, payload: DemoPayload) -> torch.Tensor:
        """Dense float32 tensor (the parameter's shape) that one payload stands for: IDCT(scatter(payload)).

        With ``sign_values`` the coefficients are the signs (+-1), not the original values.
        """
        t = self.transform_for(payload.shape)
        return t.decode(self._sum_coefficients(t, [payload], payload.values.device))

    @torch.no_grad()
    def apply_step(self, gathered: Sequence[Sequence[DemoPayload]]) -> None:
        """Step e: decode every island's payloads, average, take the sign, update the parameters.

        Args:
            gathered: ``gathered[island][param]``, the same list in the same island order on every island
                (so that every island computes bitwise the same update). The average divides by
                ``len(gathered)``, the islands that actually sent.

        Raises:
            ValueError: ``gathered`` is empty, an island's list has the wrong length, or a payload's shape
                does not match its parameter.
        """
        params = self._params()
        if len(gathered) == 0:
            raise ValueError(
                "DeMo.apply_step: gathered is empty; it must hold at least this island's payloads"
            )
        for island, pls in enumerate(gathered):
            if len(pls) != len(params):
                raise ValueError(
                    f"DeMo.apply_step: island {island} sent {len(pls)} payloads, expected {len(params)} "
                    "(one per parameter, in param-group order)"
                )
        n_islands = len(gathered)
        i = 0
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                t = self.transform_for(p.shape)
                total = self._sum_coefficients(t, [pls[i] for pls in gathered], p.device)
                update = torch.sign(t.decode(total.div_(n_islands)))
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)
                i += 1

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One full step: ``apply_step(self.all_gather_fn(self.encode_step()))``. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.apply_step(self.all_gather_fn(self.encode_step()))
        return loss

    # ---- state --------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch-format state; momentum stays float32 (torch would cast it to the parameter dtype).

        Raises:
            ValueError: the saved ``chunk``, ``topk`` or ``sign_values`` differ from this optimizer's.
        """
        for group in state_dict.get("param_groups", []):
            for key in ("chunk", "topk", "sign_values"):
                if key in group and group[key] != getattr(self, key):
                    raise ValueError(
                        f"DeMo state has {key}={group[key]!r} but this optimizer has {getattr(self, key)!r}; "
                        "the momentum of a different wire format cannot be resumed"
                    )
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        for index, p in enumerate(self._params()):
            entry = saved.get(index)
            if entry is not None and "momentum" in entry:
                self.state[p]["momentum"] = entry["momentum"].to(
                    device=p.device, dtype=torch.float32, copy=True
                )
