"""The codecs that round: 16-bit casts and block-scaled fp8 / int8 / int4 quantizers, and their rounding.

Pure tensor math, built by :func:`atoll.algorithms.codecs.make_codec` (the codec table, payload sizes and
the rounding contract are in :mod:`atoll.algorithms.codecs`' docstring); every class here is a
:class:`~atoll.algorithms.codec_base.Codec`.

- ``bf16`` / ``fp16``: a cast to the 16-bit float, no scale.
- ``fp8-e4m3`` / ``fp8-e5m2``, ``int8``, ``int4``: the flat tensor is cut into blocks of ``block_size``
  elements (the last one possibly partial: nothing is padded), each block gets one float32
  scale ``absmax / vmax`` (``vmax`` the format's largest finite value, or ``qmax`` for integers), and the
  scaled values are rounded to the format. Block-wise absmax quantization: Dettmers et al. 2022
  (arXiv:2110.02861); FP8 formats: Micikevicius et al. 2022 (arXiv:2209.05433).

Rounding is ``"nearest"`` (the cast, or ``torch.round`` for integers) or ``"stochastic"`` (Gupta et
al. 2015, arXiv:1502.02551): ``floor(y / ulp + u) * ulp`` with ``u ~ U[0, 1)`` and ``ulp`` the format's
spacing around ``y``, a power of two built from float32 bits so the result is exact; unbiased, drawn from
the generator given to :meth:`~atoll.algorithms.codec_base.Codec.encode`, saturating at the largest finite
value.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from atoll.algorithms.codec_base import Codec, Encoded, _check_numel

_SCALE_DTYPE = torch.float32


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
    return _stochastic_float(y, dtype, _uniform(y, generator))


def _stochastic_float(y: torch.Tensor, dtype: torch.dtype, u: torch.Tensor) -> torch.Tensor:
    """:func:`_round_float`'s stochastic rounding of float32 ``y`` to ``dtype`` with the draws ``u`` (y's shape)."""
    mant_bits, emin = _FLOAT_FORMATS[dtype]
    fmax = float(torch.finfo(dtype).max)
    _, exp = torch.frexp(y)  # |y| = m * 2**exp with m in [0.5, 1): y's binade is 2**(exp - 1)
    ulp = _pow2((exp.to(torch.int32) - 1).clamp_(min=emin) - mant_bits)
    q = torch.floor(y / ulp + u) * ulp
    return q.clamp_(-fmax, fmax).to(dtype)


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

    def _decode_into(self, enc: Encoded, out: torch.Tensor) -> None:
        out.copy_(enc.tensors["values"])  # (widened as it is copied)


class _BlockCodec(Codec):
    """Shared block bookkeeping: ``ceil(numel / block_size)`` blocks, the last one possibly partial.

    The element-wise passes run chunk by chunk on the CPU (whole blocks, about 1 MiB of float32 each: the
    intermediates stay in cache, and no float32 tensor of the input's size is allocated but the decoded
    output); on an accelerator in one chunk. Every element gets the same float32 operations in either case,
    so the payload and the decoded values do not depend on the chunking.
    """

    def __init__(self, block_size: int, rounding: str) -> None:
        self.block_size = block_size
        self.rounding = rounding

    def num_blocks(self, numel: int) -> int:
        """Number of blocks (and of scales) for ``numel`` elements: ``ceil(numel / block_size)``."""
        return -(-_check_numel(numel) // self.block_size)

    def _chunks(self, numel: int, device: torch.device) -> list[tuple[int, int]]:
        """Element ranges ``[start, end)`` covering ``numel``; each starts on a block boundary at an even index."""
        if device.type != "cpu":
            return [(0, numel)] if numel else []
        step = self.block_size * max(2, _CHUNK_ELEMENTS // self.block_size // 2 * 2)
        return [(a, min(a + step, numel)) for a in range(0, numel, step)]

    def _scale(self, x: torch.Tensor, vmax: float, scratch: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block scale ``absmax / vmax`` of ``x`` (float32, ``(n,)``) as float32 ``(B,)``, and a safe
        divisor (1 where the block is 0). ``absmax`` is the per-block max of ``|x|``, written into ``scratch``
        (float32, at least ``n``; default a new tensor) and reduced there: one pass over ``x``."""
        n, bs = x.numel(), self.block_size
        full = n // bs
        mag = torch.abs(x, out=(torch.empty_like(x) if scratch is None else scratch[:n]))
        parts = [mag[: full * bs].view(full, bs).amax(dim=1)] if full else []
        if n > full * bs:
            parts.append(mag[full * bs:].amax().reshape(1))
        absmax = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else x.new_zeros(0)
        scale = absmax / vmax
        return scale, torch.where(scale > 0, scale, torch.ones_like(scale))

    def _per_block_(self, y: torch.Tensor, scales: torch.Tensor, start: int, divide: bool,
                    src: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 chunk ``y`` (elements ``start..``, ``start`` on a block boundary) divided (or multiplied)
        by its blocks' ``scales``: in place, or, with ``src`` (float32, ``y``'s shape), ``src``'s values
        divided or multiplied into ``y`` (one pass: no copy first); returns ``y``."""
        bs = self.block_size
        b0, full = start // bs, y.numel() // bs
        head, s = y[: full * bs].view(full, bs), scales[b0 : b0 + full].unsqueeze(1)
        tail, t = y[full * bs:], scales[b0 + full : b0 + full + 1]
        if src is None:
            head.div_(s) if divide else head.mul_(s)
            if tail.numel():
                tail.div_(t) if divide else tail.mul_(t)
            return y
        op = torch.div if divide else torch.mul
        op(src[: full * bs].view(full, bs), s, out=head)
        if tail.numel():
            op(src[full * bs:], t, out=tail)
        return y

    def _quantize(self, x: torch.Tensor, vmax: float,
                  rnd: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                  generator: torch.Generator | None,
                  store: Callable[[torch.Tensor, int, int], object]) -> torch.Tensor:
        """Scale ``x`` (float32 ``(n,)``) per block to ``[-vmax, vmax]``, round each chunk ``[a, b)`` with
        ``rnd(y, u)`` (in place on the chunk's float32 scratch ``y``; ``u``: its slice of one ``U[0, 1)`` draw
        of ``n`` values for stochastic rounding, else None) and hand the rounded chunk to ``store(y, a, b)``,
        which writes it into the payload; return the float32 scales ``(B,)``. Each chunk's scales are taken
        just before it is scaled (its blocks are whole: a chunk starts on a block boundary), so the chunk is
        read from memory once: ``|x|`` into the scratch, its block maxima, ``x`` divided into the scratch."""
        u = _uniform(x, generator) if self.rounding == "stochastic" else None
        scratch = torch.empty(0, dtype=torch.float32, device=x.device)
        scales = []
        for a, b in self._chunks(x.numel(), x.device):
            if scratch.numel() < b - a:
                scratch = torch.empty(b - a, dtype=torch.float32, device=x.device)
            scale, safe = self._scale(x[a:b], vmax, scratch)
            scales.append(scale)
            y = self._per_block_(scratch[: b - a], safe, 0, divide=True, src=x[a:b])
            store(rnd(y, None if u is None else u[a:b]), a, b)
        if not scales:
            return x.new_zeros(0, dtype=_SCALE_DTYPE)
        return (scales[0] if len(scales) == 1 else torch.cat(scales)).to(_SCALE_DTYPE)

    def _decode(self, enc: Encoded) -> torch.Tensor:
        out = torch.empty(enc.numel, dtype=torch.float32, device=enc.tensors["scales"].device)
        self._decode_into(enc, out)
        return out

    def _widener(self, enc: Encoded) -> tuple[torch.Tensor, Callable[[torch.Tensor, int, int, torch.Tensor], object]
                                                | None]:
        """The payload's values as :meth:`_range_decoder` reads them, and ``widen(values, a, b, dst)`` that writes
        the chunk ``[a, b)`` as float32 into ``dst`` (None: ``dst.copy_(values[a:b])``)."""
        return enc.tensors["values"], None

    def _range_decoder(self, enc: Encoded) -> tuple[list[tuple[int, int]], Callable[[int, int, torch.Tensor], None]]:
        """Chunks of whole blocks (:meth:`_chunks`) and ``fn(a, b, dst)``: each value of ``[a, b)`` widened into
        ``dst`` (float32 ``(b - a,)``), times its block's scale."""
        values, widen = self._widener(enc)
        scales = enc.tensors["scales"].float()

        def fn(a: int, b: int, dst: torch.Tensor) -> None:
            if widen is None:
                dst.copy_(values[a:b])
            else:
                widen(values, a, b, dst)
            self._per_block_(dst, scales, a, divide=False)

        return self._chunks(enc.numel, scales.device), fn

    def _decode_into(self, enc: Encoded, out: torch.Tensor) -> None:
        ranges, fn = self._range_decoder(enc)
        for a, b in ranges:
            fn(a, b, out[a:b])


#: elements per chunk of the block-wise passes on the CPU (1 MiB of float32)
_CHUNK_ELEMENTS = 1 << 18

# the float32 value of each of the 256 fp8 codes: decoding by table lookup (a cast of fp8 on the CPU is slow)
_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {
    dtype: torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
}


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
        values = torch.empty(x.numel(), dtype=self.dtype, device=x.device)

        def rnd(y: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
            y.clamp_(-self.fmax, self.fmax)
            return y.to(self.dtype) if u is None else _stochastic_float(y, self.dtype, u)

        def store(y: torch.Tensor, a: int, b: int) -> None:
            values[a:b] = y

        scales = self._quantize(x.detach(), self.fmax, rnd, generator, store)
        return {"scales": scales, "values": values}

    def _widener(self, enc: Encoded) -> tuple[torch.Tensor, Callable[[torch.Tensor, int, int, torch.Tensor], object]
                                                | None]:
        values = enc.tensors["values"]
        if values.device.type != "cpu":
            return values.float(), None
        table = _FP8_TABLES[self.dtype]
        index = [torch.empty(0, dtype=torch.int32)]  # one chunk's codes as int32, reused

        def widen(v: torch.Tensor, a: int, b: int, dst: torch.Tensor) -> None:
            if index[0].numel() < b - a:
                index[0] = torch.empty(b - a, dtype=torch.int32)
            torch.index_select(table, 0, index[0][: b - a].copy_(v[a:b]), out=dst)

        return values.view(torch.uint8), widen


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
        n, qmax = x.numel(), self.qmax

        def rnd(y: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
            return (y.round_() if u is None else y.add_(u).floor_()).clamp_(-qmax, qmax)

        if self.bits == 4 and sys.byteorder == "little" and x.device.type == "cpu":
            # each rounded chunk packed while it is in cache: no int8 tensor of the input's size
            packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
            scales = self._quantize(x.detach(), float(qmax), rnd, generator, _NibblePacker(packed))
            return {"scales": scales, "values": packed}
        q = torch.empty(n + n % 2 if self.bits == 4 else n, dtype=torch.int8, device=x.device)

        def store(y: torch.Tensor, a: int, b: int) -> None:
            q[a:b] = y

        scales = self._quantize(x.detach(), float(qmax), rnd, generator, store)
        if self.bits == 8:
            return {"scales": scales, "values": q}
        q[n:] = 0  # the pad nibble encodes 0
        q.add_(8)  # offset-binary nibbles 1..15, two per byte: element 2i low, 2i+1 high
        pairs = q.view(torch.uint8).view(-1, 2)
        return {"scales": scales, "values": torch.bitwise_left_shift(pairs[:, 1], 4).bitwise_or_(pairs[:, 0])}

    def _widener(self, enc: Encoded) -> tuple[torch.Tensor, Callable[[torch.Tensor, int, int, torch.Tensor], object]
                                                | None]:
        return enc.tensors["values"], None if self.bits == 8 else _unpack_nibbles


class _NibblePacker:
    """int4's ``store`` on a little-endian CPU: writes a rounded float32 chunk ``y`` (elements ``[a, b)`` of the
    input, ``a`` even, values in ``[-7, 7]``) into the packed bytes ``out`` (uint8 ``(ceil(n / 2),)``) as
    offset-binary nibbles ``q + 8``, element ``2i`` in the low nibble of byte ``i`` and ``2i + 1`` in the high
    one (the pad nibble of an odd ``n`` encodes 0: 8). Through two scratch buffers of the chunk's size: ``y`` as
    int8, and each pair read as one int16 ``v = q[2i] + 256 q[2i+1]``, whose low byte of ``v | v >> 4`` is the
    packed byte (its conversion to uint8 keeps the low byte)."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.q = torch.empty(0, dtype=torch.int8)
        self.v = torch.empty(0, dtype=torch.int16)

    def __call__(self, y: torch.Tensor, a: int, b: int) -> None:
        m = b - a
        even = m + m % 2
        if self.q.numel() < even:
            self.q = torch.empty(even, dtype=torch.int8)
            self.v = torch.empty(even // 2, dtype=torch.int16)
        q = self.q[:even]
        q[:m] = y
        if even > m:
            q[m:] = 0
        q.add_(8)
        v = q.view(torch.int16)
        packed = torch.bitwise_right_shift(v, 4, out=self.v[: even // 2]).bitwise_or_(v)
        self.out[a // 2 : a // 2 + even // 2] = packed  # (the low bytes)


# the float32 pair (low nibble, high nibble) - 8 of each of the 256 int4 bytes: decoding by table lookup
_INT4_TABLE = torch.stack([torch.arange(256) & 0x0F, torch.arange(256) >> 4], dim=1).sub_(8).float()
#: the same pairs, each as one 64-bit word: a lookup copies 8 bytes per byte decoded
_INT4_TABLE64 = _INT4_TABLE.view(torch.int64).reshape(256)


def _unpack_nibbles(v: torch.Tensor, a: int, b: int, dst: torch.Tensor) -> None:
    """Write elements ``[a, b)`` (``a`` even) of int4's packed bytes ``v`` (uint8), ``q`` in ``[-8, 7]``, into the
    float32 ``dst``: on the CPU one lookup per byte of its two values (exact small integers) into ``dst``."""
    byte = v[a // 2 : (b + 1) // 2]
    if byte.device.type != "cpu":
        nib = torch.stack([byte & 0x0F, byte >> 4], dim=1).view(-1)[: b - a]
        dst.copy_(nib.view(torch.int8).sub_(8))
        return
    whole = (b - a) // 2  # bytes whose two values are both in [a, b)
    index = byte.to(torch.int32)
    pairs = dst[: 2 * whole]
    if pairs.is_contiguous() and pairs.storage_offset() % 2 == 0 and pairs.data_ptr() % 8 == 0:
        # both floats of a pair as one 64-bit word: the same bits, one copy per byte decoded
        torch.index_select(_INT4_TABLE64, 0, index[:whole], out=pairs.view(torch.int64))
    else:
        torch.index_select(_INT4_TABLE, 0, index[:whole], out=pairs.view(whole, 2))
    if (b - a) % 2:  # the last element: the low nibble of the last byte (its high nibble is the pad)
        dst[-1] = _INT4_TABLE[index[whole], 0]
