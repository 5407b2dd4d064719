"""Codecs for the tensors that islands exchange (pseudo-gradients, gradients), and error feedback.

Pure tensor math: no processes, no sockets. A codec turns a flat float32 tensor (one fragment or bucket)
into an :class:`Encoded` payload, whose ``tensors`` are exactly what would travel over the link, and back.
``Encoded.nbytes`` is the payload that the runtimes count as "bytes sent per island"; every codec also
gives it in closed form as :meth:`Codec.payload_bytes`, so a runtime can price a transfer without encoding.

Codecs (``CODEC_NAMES``), with ``n = numel``, ``b = block_size`` and ``B = ceil(n / b)`` blocks:

==============  ==========================================================  ============================
name            what travels                                                payload bytes
==============  ==========================================================  ============================
``fp32``        the float32 values (identity, lossless)                     ``4 n``
``bf16``        bfloat16 values                                             ``2 n``
``fp16``        float16 values (no scale: |x| > 65504 overflows to inf)     ``2 n``
``fp8-e4m3``    float8_e4m3fn values + one fp32 scale per block             ``n + 4 B``
``fp8-e5m2``    float8_e5m2 values + one fp32 scale per block               ``n + 4 B``
``int8``        int8 values in [-127, 127] + one fp32 scale per block       ``n + 4 B``
``int4``        4-bit values in [-7, 7], two per uint8, + fp32 block scales ``ceil(n / 2) + 4 B``
``topk``        the k largest-magnitude values (fp32) + their int32 indices ``8 k``, ``k = ceil(f n)``
==============  ==========================================================  ============================

Scales are stored as float32 (not float16): pseudo-gradients of small models are often below float16's
normal range (6e-5), where a float16 scale would lose precision or flush to zero; the cost is 4 bytes per
block (0.0625 byte per element at b = 64). Only the sent elements are counted: the zero padding of a
partial last block never travels.

Rounding (``rounding="nearest"`` or ``"stochastic"``) applies wherever a value is rounded: ``bf16``,
``fp16``, ``fp8-*``, ``int8``, ``int4``. Stochastic rounding rounds to one of the two neighbouring
representable values with probabilities that make it unbiased (E[decode(encode(x))] = x), draws from the
``generator`` given to :meth:`Codec.encode` (same seed, same payload), and saturates at the format's
largest finite value. ``fp32`` and ``topk`` send exact fp32 values, so there is nothing to round.

Sources: block-wise absmax quantization, Dettmers et al. 2022 (arXiv:2110.02861); FP8 formats,
Micikevicius et al. 2022 (arXiv:2209.05433); stochastic rounding, Gupta et al. 2015 (arXiv:1502.02551);
top-k sparsification, Aji & Heafield 2017 (arXiv:1704.05021); error feedback, Seide et al. 2014 (1-bit SGD),
Stich et al. 2018 (arXiv:1809.07599), Karimireddy et al. 2019 (arXiv:1901.09847), 1-bit Adam
(arXiv:2102.02888), DeMo (arXiv:2411.19870); low-precision outer gradients with fp32 accumulation,
Streaming DiLoCo (arXiv:2501.18512, "quantized outer gradients").

Example::

    codec = make_codec("int4", block_size=64)
    enc = codec.encode(delta.flatten())          # delta: float32
    sent = enc.nbytes                            # == codec.payload_bytes(delta.numel())
    delta_hat = codec.decode(enc).view_as(delta)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction

import torch

__all__ = [
    "CODEC_NAMES",
    "ROUNDING_MODES",
    "Codec",
    "Encoded",
    "make_codec",
]

CODEC_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int8", "int4", "topk")
ROUNDING_MODES: tuple[str, ...] = ("nearest", "stochastic")

_SCALE_DTYPE = torch.float32
_MAX_INDEX = 2**31 - 1  # indices travel as int32


@dataclass
class Encoded:
    """One encoded tensor: the payload that travels, plus what the receiver needs to know anyway.

    Attributes:
        tensors: the payload, by role, in the codec's layout order: ``"values"`` (the quantized or cast
            values; int4 packs two per uint8), ``"scales"`` (float32, one per block) and ``"indices"``
            (int32, ``topk`` only). All 1-D and contiguous.
        numel: length of the original flat tensor (part of the protocol, not counted in ``nbytes``).
        codec: the codec name that produced it (one of :data:`CODEC_NAMES`).
    """

    tensors: dict[str, torch.Tensor]
    numel: int
    codec: str

    @property
    def nbytes(self) -> int:
        """Payload size in bytes: ``sum(t.numel() * t.element_size())`` over ``tensors``."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def pack(self) -> torch.Tensor:
        """Concatenate the payload into one flat byte buffer, for transports that move bytes.

        Returns:
            uint8 tensor of shape ``(nbytes,)`` on the payload's device: each tensor's bytes in layout
            order (widest element type first, so :meth:`Codec.unpack` can view them without copying).
        """
        parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in self.tensors.values()]
        if not parts:
            return torch.empty(0, dtype=torch.uint8)
        return torch.cat(parts)


class Codec(ABC):
    """Encodes a flat float32 tensor into an :class:`Encoded` payload and decodes it back.

    Subclasses define :meth:`layout` (which fixes ``payload_bytes`` in closed form), ``_encode`` and
    ``_decode``. Encoding never modifies its input; decoding returns a fresh float32 tensor.
    """

    name: str = ""
    lossless: bool = False

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> Encoded:
        """Encode ``x``.

        Args:
            x: float32 tensor of shape ``(numel,)``, finite values (a flattened fragment or bucket); any
                device. Non-finite values give non-finite or undefined results.
            generator: random source for stochastic rounding, on ``x``'s device; ``None`` uses torch's
                global generator. Ignored by deterministic codecs and ``rounding="nearest"``.

        Returns:
            the payload; ``result.nbytes == self.payload_bytes(x.numel())``.

        Raises:
            ValueError: ``x`` is not a 1-D float32 tensor.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32:
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"codec: {self.name} encodes a 1-D float32 tensor; got {got} (flatten it first)"
            )
        return Encoded(tensors=self._encode(x, generator), numel=x.numel(), codec=self.name)

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Decode a payload made by this codec.

        Args:
            enc: the payload (from :meth:`encode` or :meth:`unpack`).

        Returns:
            float32 tensor of shape ``(enc.numel,)`` on the payload's device (a new tensor).

        Raises:
            ValueError: the payload was made by another codec, or its tensors do not match
                :meth:`layout` (wrong names, dtypes or lengths).
        """
        if enc.codec != self.name:
            raise ValueError(
                f"codec: payload was encoded with '{enc.codec}', cannot decode with '{self.name}'"
            )
        expected = self.layout(enc.numel)
        got = [(k, t.dtype, t.numel()) for k, t in enc.tensors.items()]
        if sorted(got, key=lambda e: e[0]) != sorted(expected, key=lambda e: e[0]):
            raise ValueError(
                f"codec: {self.name} payload for numel={enc.numel} should be {expected}, got {got}"
            )
        return self._decode(enc)

    def payload_bytes(self, numel: int) -> int:
        """Bytes sent for a tensor of ``numel`` elements (closed form; equals ``encode(x).nbytes``).

        Raises:
            ValueError: ``numel`` is negative.
        """
        return sum(n * dtype.itemsize for _, dtype, n in self.layout(numel))

    def unpack(self, buf: torch.Tensor, numel: int) -> Encoded:
        """Inverse of :meth:`Encoded.pack`: split a flat byte buffer back into the payload tensors.

        Args:
            buf: uint8 tensor of shape ``(payload_bytes(numel),)``.
            numel: length of the original tensor.

        Returns:
            the payload; its tensors are views into ``buf`` (copied first if ``buf`` is misaligned).

        Raises:
            ValueError: ``buf`` is not 1-D uint8 or has the wrong length.
        """
        size = self.payload_bytes(numel)
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != size:
            raise ValueError(
                f"codec: {self.name} payload for numel={numel} is {size} uint8 bytes; "
                f"got {tuple(buf.shape)} {buf.dtype}"
            )
        if buf.storage_offset() % 8:
            buf = buf.clone()
        tensors: dict[str, torch.Tensor] = {}
        offset = 0
        for key, dtype, n in self.layout(numel):
            nb = n * dtype.itemsize
            tensors[key] = buf[offset : offset + nb].view(dtype)
            offset += nb
        return Encoded(tensors=tensors, numel=numel, codec=self.name)

    @abstractmethod
    def layout(self, numel: int) -> list[tuple[str, torch.dtype, int]]:
        """The payload's tensors for ``numel`` elements: ``[(key, dtype, length), ...]``, widest first.

        Raises:
            ValueError: ``numel`` is negative.
        """

    @abstractmethod
    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def _decode(self, enc: Encoded) -> torch.Tensor: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _check_numel(numel: int) -> int:
    if numel < 0:
        raise ValueError(f"codec: numel must be >= 0, got {numel}")
    return int(numel)


# ----------------------------------------------------------------------------------------------------------
# rounding helpers


# (mantissa bits, smallest normal exponent) of the float formats that values are rounded to
_FLOAT_FORMATS: dict[torch.dtype, tuple[int, int]] = {
    torch.bfloat16: (7, -126),
    torch.float16: (10, -14),
    torch.float8_e4m3fn: (3, -6),
    torch.float8_e5m2: (2, -14),
}


def _uniform(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(like.shape, generator=generator, device=like.device, dtype=torch.float32)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for int32 ``k`` in [-149, 127], built from the bits (subnormals included)."""
    normal = (k.clamp(min=-126) + 127) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _round_float(
    y: torch.Tensor, dtype: torch.dtype, rounding: str, generator: torch.Generator | None
) -> torch.Tensor:
    """Round float32 ``y`` to ``dtype``.

    Stochastic: with ``ulp`` the spacing of ``dtype`` around ``y`` (from y's binade, or the subnormal
    spacing below the smallest normal), ``floor(y / ulp + u) * ulp`` with ``u ~ U[0, 1)`` lands on one of
    the two neighbours, the upper with probability ``frac(y / ulp)``: unbiased (up to the float32
    resolution of that probability), and exact in float32 because ``ulp`` is a power of two. Saturates at
    the largest finite value.
    """
    if rounding == "nearest":
        return y.to(dtype)
    mant_bits, emin = _FLOAT_FORMATS[dtype]
    fmax = float(torch.finfo(dtype).max)
    _, exp = torch.frexp(y)  # |y| = m * 2**exp with m in [0.5, 1): y's binade is 2**(exp - 1)
    ulp = _pow2((exp.to(torch.int32) - 1).clamp_(min=emin) - mant_bits)
    q = torch.floor(y / ulp + _uniform(y, generator)) * ulp
    return q.clamp_(-fmax, fmax).to(dtype)


def _round_int(y: torch.Tensor, qmax: int, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    """Round float32 ``y`` to integers in ``[-qmax, qmax]`` (returned as float32)."""
    q = torch.round(y) if rounding == "nearest" else torch.floor(y + _uniform(y, generator))
    return q.clamp_(-qmax, qmax)


# ----------------------------------------------------------------------------------------------------------
# codecs


class _Fp32Codec(Codec):
    """Identity: the float32 values travel as they are. Payload ``4 * numel`` bytes. Lossless."""

    name = "fp32"
    lossless = True

    def layout(self, numel: int) -> list[tuple[str, torch.dtype, int]]:
        return [("values", torch.float32, _check_numel(numel))]

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        return {"values": x.detach().clone()}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return enc.tensors["values"].float().clone()


class _CastCodec(Codec):
    """Cast to a 16-bit float (``bf16``: relative error <= 2^-8 nearest; ``fp16``: <= 2^-11 in range).

    Payload ``2 * numel`` bytes. No scale: ``fp16`` overflows to inf beyond 65504 with nearest rounding
    and saturates with stochastic rounding; ``bf16`` has float32's range.
    """

    def __init__(self, name: str, dtype: torch.dtype, rounding: str) -> None:
        self.name = name
        self.dtype = dtype
        self.rounding = rounding

    def layout(self, numel: int) -> list[tuple[str, torch.dtype, int]]:
        return [("values", self.dtype, _check_numel(numel))]

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        return {"values": _round_float(x.detach(), self.dtype, self.rounding, generator)}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return enc.tensors["values"].float()


class _BlockCodec(Codec):
    """Shared block bookkeeping: ``ceil(numel / block_size)`` blocks, the last one possibly partial."""

    def __init__(self, block_size: int, rounding: str) -> None:
        self.block_size = block_size
        self.rounding = rounding

    def num_blocks(self, numel: int) -> int:
        """Number of blocks (and of scales) for ``numel`` elements: ``ceil(numel / block_size)``."""
        return -(-_check_numel(numel) // self.block_size)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(n,)`` zero-padded and viewed as ``(num_blocks, block_size)``."""
        nb = self.num_blocks(x.numel())
        pad = nb * self.block_size - x.numel()
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        return x.view(nb, self.block_size)

    def _scale(self, xb: torch.Tensor, vmax: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block scale ``absmax / vmax`` (float32, ``(B,)``) and a safe divisor (1 where the block is 0)."""
        scale = xb.abs().amax(dim=1) / vmax if xb.numel() else xb.new_zeros(xb.shape[0])
        return scale, torch.where(scale > 0, scale, torch.ones_like(scale))

    def _unscale(self, values: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """``values`` (float32, ``(numel,)``) times their block's scale."""
        return (self._blocks(values) * scales.float().unsqueeze(1)).reshape(-1)[:numel].contiguous()


class _Fp8Codec(_BlockCodec):
    """FP8 with one float32 scale per block: the block's absmax maps to the format's largest finite value.

    ``fp8-e4m3`` (torch.float8_e4m3fn, max 448, 3 mantissa bits: relative error <= 2^-4 nearest) and
    ``fp8-e5m2`` (max 57344, 2 mantissa bits: <= 2^-3), plus an absolute error of half the subnormal
    spacing times the scale for elements far below the block's absmax. Payload ``numel + 4 * B`` bytes.
    Formats: Micikevicius et al. 2022 (arXiv:2209.05433).
    """

    def __init__(self, name: str, dtype: torch.dtype, block_size: int, rounding: str) -> None:
        super().__init__(block_size, rounding)
        self.name = name
        self.dtype = dtype
        self.fmax = float(torch.finfo(dtype).max)

    def layout(self, numel: int) -> list[tuple[str, torch.dtype, int]]:
        return [("scales", _SCALE_DTYPE, self.num_blocks(numel)), ("values", self.dtype, numel)]

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        xb = self._blocks(x.detach())
        scale, safe = self._scale(xb, self.fmax)
        y = (xb / safe.unsqueeze(1)).clamp_(-self.fmax, self.fmax).reshape(-1)[: x.numel()]
        return {
            "scales": scale.to(_SCALE_DTYPE),
            "values": _round_float(y, self.dtype, self.rounding, generator),
        }

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return self._unscale(enc.tensors["values"].float(), enc.tensors["scales"], enc.numel)


class _IntCodec(_BlockCodec):
    """Symmetric block-wise absmax integer quantization (Dettmers et al. 2022, arXiv:2110.02861).

    Per block: ``scale = absmax / qmax`` (float32), ``q = round(x / scale)`` in ``[-qmax, qmax]``,
    ``x_hat = q * scale``; nearest rounding errs by at most ``scale / 2`` per element. ``int8``: qmax 127,
    values as int8, payload ``numel + 4 * B`` bytes. ``int4``: qmax 7, values stored offset-binary
    (``q + 8`` in 1..15) two per uint8 (element ``2i`` in the low nibble, ``2i+1`` in the high nibble),
    payload ``ceil(numel / 2) + 4 * B`` bytes.
    """

    def __init__(self, bits: int, block_size: int, rounding: str) -> None:
        super().__init__(block_size, rounding)
        self.bits = bits
        self.name = f"int{bits}"
        self.qmax = 2 ** (bits - 1) - 1

    def layout(self, numel: int) -> list[tuple[str, torch.dtype, int]]:
        nb = self.num_blocks(numel)
        if self.bits == 8:
            return [("scales", _SCALE_DTYPE, nb), ("values", torch.int8, numel)]
        return [("scales", _SCALE_DTYPE, nb), ("values", torch.uint8, (numel + 1) // 2)]

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        xb = self._blocks(x.detach())
        scale, safe = self._scale(xb, float(self.qmax))
        y = (xb / safe.unsqueeze(1)).reshape(-1)[: x.numel()]
        q = _round_int(y, self.qmax, self.rounding, generator)
        if self.bits == 8:
            values = q.to(torch.int8)
        else:
            nib = (q + 8).to(torch.uint8)
            if nib.numel() % 2:
                nib = torch.cat([nib, nib.new_full((1,), 8)])  # pad nibble encodes 0
            pairs = nib.view(-1, 2)
            values = pairs[:, 0] | (pairs[:, 1] << 4)
        return {"scales": scale.to(_SCALE_DTYPE), "values": values.contiguous()}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        v = enc.tensors["values"]
        if self.bits == 8:
            q = v.float()
        else:
            q = torch.stack([v & 0x0F, v >> 4], dim=1).reshape(-1)[: enc.numel].float() - 8.0
        return self._unscale(q, enc.tensors["scales"], enc.numel)


class _TopKCodec(Codec):
    """Top-k sparsification (Aji & Heafield 2017, arXiv:1704.05021): keep the k largest-magnitude entries.

    ``k = ceil(fraction * numel)``, computed exactly on the decimal value of ``fraction`` (0.07 * 100 = 7,
    not 8), capped at ``numel``. Kept values travel exactly as float32, with int32 indices sorted
    ascending; the rest decode to zero. Payload ``8 * k`` bytes. Ties between equal magnitudes are broken
    by ``torch.topk`` (deterministic for a given device and input). Pair it with :class:`ErrorFeedback`.
    """

    name = "topk"

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._fraction_exact = Fraction(repr(float(fraction)))

    def k(self, numel: int) -> int:
        """Number of kept entries for ``numel`` elements: ``min(numel, ceil(fraction * numel))``."""
        return min(_check_numel(numel), math.ceil(self._fraction_exact * numel))

    def layout(self, numel: int) -> list[tuple[str, torch.dtype, int]]:
        k = self.k(numel)
        return [("values", torch.float32, k), ("indices", torch.int32, k)]

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        if x.numel() > _MAX_INDEX:
            raise ValueError(
                f"codec: topk indices are int32; split tensors of {x.numel()} elements into buckets"
            )
        k = self.k(x.numel())
        x = x.detach()
        idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
        return {"values": x[idx], "indices": idx.to(torch.int32)}

    def _decode(self, enc: Encoded) -> torch.Tensor:
        values = enc.tensors["values"]
        out = torch.zeros(enc.numel, dtype=torch.float32, device=values.device)
        out[enc.tensors["indices"].long()] = values.float()
        return out


def make_codec(
    name: str, *, block_size: int = 64, rounding: str = "nearest", topk_fraction: float = 0.01
) -> Codec:
    """Build a codec by name.

    Args:
        name: one of :data:`CODEC_NAMES`.
        block_size: elements per scale for ``fp8-*``, ``int8`` and ``int4`` (ignored by the others).
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; see the module docstring).
        topk_fraction: fraction of entries kept by ``topk``, in ``(0, 1]``.

    Returns:
        the codec; codecs hold no state, so one instance can serve every island and fragment.

    Raises:
        ValueError: unknown ``name`` or ``rounding``, ``block_size`` < 1, ``topk_fraction`` outside (0, 1].
    """
    if name not in CODEC_NAMES:
        raise ValueError(f"codec: unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    if rounding not in ROUNDING_MODES:
        raise ValueError(
            f"rounding: unknown rounding {rounding!r}; choose one of {', '.join(ROUNDING_MODES)}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
    if not isinstance(topk_fraction, (int, float)) or not 0.0 < float(topk_fraction) <= 1.0:
        raise ValueError(f"topk_fraction: must be in (0, 1], got {topk_fraction!r}")
    if name == "fp32":
        return _Fp32Codec()
    if name == "bf16":
        return _CastCodec("bf16", torch.bfloat16, rounding)
    if name == "fp16":
        return _CastCodec("fp16", torch.float16, rounding)
    if name == "fp8-e4m3":
        return _Fp8Codec(name, torch.float8_e4m3fn, block_size, rounding)
    if name == "fp8-e5m2":
        return _Fp8Codec(name, torch.float8_e5m2, block_size, rounding)
    if name == "int8":
        return _IntCodec(8, block_size, rounding)
    if name == "int4":
        return _IntCodec(4, block_size, rounding)
    return _TopKCodec(float(topk_fraction))
