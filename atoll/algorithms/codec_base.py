"""The codec interface: :class:`Encoded` (one payload) and :class:`Codec` (the base class of every codec).

Pure tensor math: no processes, no sockets. A codec turns a flat float32 tensor (one fragment or bucket)
into an :class:`Encoded` payload, whose ``tensors`` are exactly what would travel over the link, and back.
``Encoded.nbytes`` is the payload that the runtimes count as "bytes sent per island"; every codec also
gives it in closed form as :meth:`Codec.payload_bytes`, so a runtime can price a transfer without encoding.

The codecs themselves, and :func:`~atoll.algorithms.codecs.make_codec` that builds them by name, are in
:mod:`atoll.algorithms.codecs` (lossless and sparse) and :mod:`atoll.algorithms.quantize` (cast and
block-scaled, the ones that round); both import this module, which imports neither.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "Codec",
    "Encoded",
]


@dataclass
class Encoded:
    """One encoded tensor: the payload that travels, plus what the receiver needs to know anyway.

    Attributes:
        tensors: the payload, by role, in the codec's layout order: ``"values"`` (the quantized or cast
            values; int4 packs two per uint8), ``"scales"`` (float32, one per block) and ``"indices"``
            (int32, ``topk`` only). All 1-D and contiguous.
        numel: length of the original flat tensor (part of the protocol, not counted in ``nbytes``).
        codec: the codec name that produced it (one of :data:`~atoll.algorithms.codecs.CODEC_NAMES`).
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
        self.check_payload(enc)
        return self._decode(enc)

    def decode_into(self, enc: Encoded, out: torch.Tensor) -> None:
        """Decode a payload made by this codec into ``out``: the values :meth:`decode` returns, written in place.
        The fp32, bf16/fp16, int8/int4 and fp8 codecs write straight into ``out`` (no decoded intermediate: at
        the syncer a push's slices are decoded into their places in the fragment, one pass over the values);
        ``topk`` decodes, then copies.

        Args:
            enc: the payload (from :meth:`encode` or :meth:`unpack`).
            out: float32 ``(enc.numel,)`` on the payload's device, written whole (a view of a larger tensor
                may do).

        Raises:
            ValueError: as :meth:`decode`, or ``out`` is not a float32 tensor of ``enc.numel`` elements.
        """
        if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != enc.numel:
            raise ValueError(f"codec: decode_into needs a float32 ({enc.numel},) tensor, got "
                             f"{tuple(out.shape)} {out.dtype}")
        self.check_payload(enc)
        self._decode_into(enc, out)

    def check_payload(self, enc: Encoded) -> None:
        """Whether ``enc`` is this codec's payload, its tensors of the layout its ``numel`` fixes: what
        :meth:`decode` checks before it decodes (and nothing of the values).

        Raises:
            ValueError: another codec's payload, or tensors of other names, dtypes or sizes.
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

    def range_decoder(self, enc: Encoded) -> tuple[list[tuple[int, int]], Callable[[int, int, torch.Tensor], None]]:
        """A payload's decode range by range, so that a caller can use each range while it is in cache (an
        average of several islands' payloads, :func:`~atoll.algorithms.merge.average_encoded`).

        Returns:
            ``(ranges, fn)``: ranges ``[a, b)`` in order, covering ``[0, enc.numel)``, and ``fn(a, b, dst)``,
            which writes the values :meth:`decode` returns at ``[a, b)`` into ``dst`` (float32 ``(b - a,)`` on
            the payload's device). The block codecs give chunks of whole blocks (about 1 MiB of float32 on the
            CPU); the others one range, :meth:`decode_into`.

        Raises:
            ValueError: as :meth:`decode`.
        """
        self.check_payload(enc)
        return self._range_decoder(enc)

    def decoded_chunks(self, enc: Encoded) -> Iterator[tuple[int, int, torch.Tensor]]:
        """A payload's decoded values range by range (:meth:`range_decoder`), in order: ``(a, b, values)``, the
        values :meth:`decode` returns at ``[a, b)`` (float32 ``(b - a,)`` on the payload's device), so that a caller
        combines each chunk with its own slices while it is in cache (error feedback's residual, a pull added to a
        shadow). One range: :meth:`decode`'s whole tensor; several: one chunk-sized buffer, reused from range to
        range (valid until the next is yielded).

        Raises:
            ValueError: as :meth:`decode`.
        """
        ranges, fn = self.range_decoder(enc)
        if len(ranges) <= 1:
            yield from ((a, b, self._decode(enc)) for a, b in ranges)
            return
        device = next(iter(enc.tensors.values())).device
        chunk = torch.empty(max(b - a for a, b in ranges), dtype=torch.float32, device=device)
        for a, b in ranges:
            fn(a, b, chunk[:b - a])
            yield a, b, chunk[:b - a]

    def _range_decoder(self, enc: Encoded) -> tuple[list[tuple[int, int]], Callable[[int, int, torch.Tensor], None]]:
        """(Checked payload.) One range, decoded whole; codecs that decode in chunks override this."""
        return ([(0, enc.numel)] if enc.numel else []), lambda a, b, dst: self._decode_into(enc, dst)

    def _decode_into(self, enc: Encoded, out: torch.Tensor) -> None:
        """(Checked payload.) Write the decoded values into ``out``; codecs that can do it without an
        intermediate override this."""
        out.copy_(self._decode(enc))

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
