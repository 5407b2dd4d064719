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

Modules: the payload and the base class are in :mod:`atoll.algorithms.codec_base`; the cast and
block-scaled codecs (``bf16``, ``fp16``, ``fp8-*``, ``int8``, ``int4``) and their rounding in
:mod:`atoll.algorithms.quantize`; ``fp32``, ``topk`` and :func:`make_codec` here.

Example::

    codec = make_codec("int4", block_size=64)
    enc = codec.encode(delta.flatten())          # delta: float32
    sent = enc.nbytes                            # == codec.payload_bytes(delta.numel())
    delta_hat = codec.decode(enc).view_as(delta)
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from atoll.algorithms.codec_base import Codec, Encoded, _check_numel
from atoll.algorithms.quantize import _CastCodec, _Fp8Codec, _IntCodec

__all__ = [
    "CODEC_NAMES",
    "ROUNDING_MODES",
    "Codec",
    "Encoded",
    "make_codec",
]

CODEC_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int8", "int4", "topk")
ROUNDING_MODES: tuple[str, ...] = ("nearest", "stochastic")

_MAX_INDEX = 2**31 - 1  # indices travel as int32


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

    def _decode_into(self, enc: Encoded, out: torch.Tensor) -> None:
        out.copy_(enc.tensors["values"])


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
