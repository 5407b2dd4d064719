"""The codecs that round: 16-bit casts and block-scaled fp8 / int8 / int4 quantizers, and their rounding.

Pure tensor math, built by :func:`atoll.algorithms.codecs.make_codec` (the codec table, payload sizes and
the rounding contract are in :mod:`atoll.algorithms.codecs`' docstring); every class here is a
:class:`~atoll.algorithms.codec_base.Codec`.

- ``bf16`` / ``fp16``: a cast to the 16-bit float, no scale.
- ``fp8-e4m3`` / ``fp8-e5m2``, ``int8``, ``int4``: the flat tensor is cut into blocks of ``block_size``
  elements (the last one possibly partial, zero-padded for the arithmetic only), each block gets one float32
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
