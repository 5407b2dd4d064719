"""What travels between islands: a codec with each local island's error feedback and random source.

:class:`ErrorFeedback` keeps what a lossy codec dropped and adds it to the next exchange of the same tensor;
:class:`Wire` bundles, for the islands of one process, the run's codec (:mod:`atoll.algorithms.codecs`),
their error feedback and their seeded random sources for stochastic rounding, and is what a strategy hands to
its collectives (:class:`atoll.runtime.comm.Comm`). Pure tensor math; errors are ValueError.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from typing import Any

import torch

from atoll.algorithms.codec_base import Codec, Encoded
from atoll.algorithms.codecs import make_codec

__all__ = ["ErrorFeedback", "Wire"]


class ErrorFeedback:
    """Keeps the residual ``x - decode(encode(x))`` per key and adds it back before the next encode.

    With error feedback nothing a lossy codec drops is lost, only delayed: after T encodes,
    ``sum(inputs) - sum(decoded) == residual`` (bounded by one step's compression error), so the sum of
    what was sent tracks the sum of what should have been sent (Seide et al. 2014; Stich et al. 2018,
    arXiv:1809.07599; Karimireddy et al. 2019, arXiv:1901.09847; 1-bit Adam, arXiv:2102.02888; DeMo,
    arXiv:2411.19870). Residuals are float32, of shape ``(numel,)``, on the input's device (one loaded on
    another device, e.g. from a checkpoint on the CPU, is moved there at its next encode, once); keys name the
    tensor (e.g. ``"fragment3"``), one residual each. A lossless codec (``fp32``) stores nothing.
    """

    def __init__(self, codec: Codec) -> None:
        """Args: codec: the codec whose error is fed back."""
        self.codec = codec
        self._residual: dict[str, torch.Tensor] = {}

    def encode(self, key: str, x: torch.Tensor, generator: torch.Generator | None = None) -> Encoded:
        """Encode ``x + residual[key]`` and store the new residual.

        Args:
            key: which tensor this is; the residual of a previous encode under ``key`` is added.
            x: float32 tensor of shape ``(numel,)``, any device; not modified.
            generator: passed to :meth:`Codec.encode` (on ``x``'s device).

        Returns:
            the payload of ``x + residual[key]``, on ``x``'s device (the new residual is kept there too).

        Raises:
            ValueError: ``x`` is not 1-D float32, or its length differs from the stored residual's.
        """
        r = self._residual.get(key)
        if r is not None and r.shape != x.shape:
            raise ValueError(
                f"error_feedback: tensor {key!r} has shape {tuple(x.shape)}, its residual {tuple(r.shape)}"
            )
        if r is not None and r.device != x.device:  # a loaded residual (CPU): moved to x's device once, kept there
            r = self._residual[key] = r.to(x.device)
        target = x if r is None else x + r
        enc = self.codec.encode(target, generator)
        if not self.codec.lossless:
            # range by range (block codecs on the CPU): target minus the decoded chunk while it is in cache, into
            # target itself when it is this call's own x + r (the stored residual is a new tensor either way)
            residual = torch.empty_like(target) if r is None else target
            for a, b, decoded in self.codec.decoded_chunks(enc):
                torch.sub(target[a:b], decoded, out=residual[a:b])
            self._residual[key] = residual
        return enc

    def residual(self, key: str) -> torch.Tensor | None:
        """The stored float32 residual for ``key`` (shape ``(numel,)``), or ``None``."""
        return self._residual.get(key)

    def reset(self, key: str | None = None) -> None:
        """Forget the residual of ``key``, or all residuals when ``key`` is ``None``."""
        if key is None:
            self._residual.clear()
        else:
            self._residual.pop(key, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals by key (float32 ``(numel,)`` tensors; references, not copies)."""
        return dict(self._residual)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Replace all residuals with copies of ``sd``'s (converted to float32, on their own device; each moves
        to its tensor's device at the next :meth:`encode` of its key).

        Raises:
            ValueError: a value is not a 1-D tensor.
        """
        for key, value in sd.items():
            if not isinstance(value, torch.Tensor) or value.dim() != 1:
                raise ValueError(f"error_feedback: residual {key!r} must be a 1-D tensor")
        self._residual = {key: value.detach().float().clone() for key, value in sd.items()}


class Wire:
    """The codec a strategy's exchanges use, with each local island's error feedback and random source.

    ``codec == "fp32"`` without error feedback sends tensors as they are (``codec`` is None: no encode/decode
    round trip). Random sources for stochastic rounding are seeded by ``(seed, island)`` and belong to the
    state, so a resumed run rounds exactly as an uninterrupted one.

    Everything a wire keeps lives where the tensors it encodes are: each island's random source is a
    ``torch.Generator`` made on the device of the first tensor it rounds (or on ``device`` at construction),
    since a CPU generator cannot draw for an accelerator's ``torch.rand``; residuals stay on their tensor's
    device (:class:`ErrorFeedback`). The CPU's generator (mt19937) and CUDA's (Philox) are different
    algorithms: the same seed draws different numbers on each, so a run rounds the same way on the same
    device type only.

    Args:
        codec: a name of :data:`atoll.algorithms.codecs.CODEC_NAMES`.
        local_islands: the indices of the islands this process runs (one entry of state each).
        block_size, rounding, topk_fraction: the codec's settings (:func:`~atoll.algorithms.codecs.make_codec`).
        error_feedback: keep each island's residual per tensor key (lossy codecs only).
        seed: the run's seed (stochastic rounding draws from ``seed * 1_000_003 + island``).
        device: make the random sources on this device now; None: each on the device of the first tensor
            its island encodes.

    Attributes:
        codec_s: per local island, measured seconds :meth:`transmit` spent encoding and decoding (wall clock;
            on an accelerator the launches only).

    Raises:
        ValueError: the codec settings are invalid.
    """

    def __init__(self, codec: str, local_islands: list[int], *, block_size: int = 64, rounding: str = "nearest",
                 topk_fraction: float = 0.01, error_feedback: bool = False, seed: int = 0,
                 device: torch.device | str | None = None) -> None:
        lossy = codec != "fp32"
        self.codec: Codec | None = make_codec(codec, block_size=block_size, rounding=rounding,
                                              topk_fraction=topk_fraction) if lossy else None
        self.feedback = ([ErrorFeedback(self.codec) for _ in local_islands]
                         if self.codec is not None and error_feedback else None)
        # per local island: the seed of its random source (None: no stochastic rounding), the generator once
        # made, and a state loaded before it was made, with the device type it was saved from
        self._seeds: list[int] | None = ([seed * 1_000_003 + i for i in local_islands]
                                         if self.codec is not None and rounding == "stochastic" else None)
        self._generators: list[torch.Generator | None] = [None] * len(local_islands)
        self._loaded: list[tuple[str, torch.Tensor] | None] = [None] * len(local_islands)
        self.codec_s = [0.0] * len(local_islands)
        if device is not None and self._seeds is not None:
            for position in range(len(local_islands)):
                self.generator(position, torch.device(device))

    @property
    def stochastic(self) -> bool:
        """Whether the codec rounds stochastically (each local island then has a random source)."""
        return self._seeds is not None

    def generator(self, position: int, device: torch.device | str) -> torch.Generator | None:
        """The random source of the local island at ``position``, on ``device``; None without stochastic
        rounding.

        Made on ``device`` at its first use, seeded ``seed * 1_000_003 + island``, or set to the state
        :meth:`load_island_state` gave (a state saved from another device type cannot be set: the source is
        then seeded from that state's bytes, with a warning). Stays on that device.

        Raises:
            ValueError: it was made on another device.
        """
        if self._seeds is None:
            return None
        device = torch.device(device)
        gen = self._generators[position]
        if gen is None:
            gen = self._generators[position] = _make_generator(device, self._seeds[position],
                                                               self._loaded[position])
            self._loaded[position] = None
        elif gen.device.type != device.type or (gen.device.index != device.index
                                                 and None not in (gen.device.index, device.index)):
            raise ValueError(f"wire: the random source of local island {position} is on {gen.device}, "
                             f"the tensor to round on {device}; encode each island's tensors on one device")
        return gen

    def generators_for(self, device: torch.device | str) -> list[torch.Generator | None] | None:
        """Every local island's random source on ``device`` (:meth:`generator`), in position order, as
        :func:`~atoll.algorithms.merge.average_encoded` takes them; None without stochastic rounding."""
        if self._seeds is None:
            return None
        return [self.generator(position, device) for position in range(len(self._seeds))]

    def encode(self, position: int, x: torch.Tensor, key: str) -> Encoded:
        """Encode the 1-D float32 ``x`` of the local island at ``position`` (its error feedback under
        ``key`` and its random source, on ``x``'s device, applied). Requires a codec (``self.codec`` not
        None). The payload is on ``x``'s device.

        Raises:
            ValueError: ``x`` is not 1-D float32, or is not on the device of the island's random source.
        """
        assert self.codec is not None
        gen = self.generator(position, x.device)
        return self.feedback[position].encode(key, x, gen) if self.feedback is not None else self.codec.encode(x, gen)

    def transmit(self, position: int, x: torch.Tensor, key: str) -> tuple[torch.Tensor, int]:
        """What the receiver of one island's ``x`` (float32, (numel,)) gets, and the bytes it travels as.

        Returns:
            ``(decoded, nbytes)``: ``x`` itself and ``4 * numel`` without a codec; else the decoded float32
            tensor (error feedback and rounding applied, on ``x``'s device) and the encoded payload's bytes.
        """
        if self.codec is None:
            return x, x.numel() * x.element_size()
        t0 = time.perf_counter()
        decoded = self.codec.decode(self.encode(position, x, key))
        self.codec_s[position] += time.perf_counter() - t0
        return decoded, self.codec.payload_bytes(int(x.numel()))

    def _generator_state(self, position: int) -> tuple[torch.Tensor | None, str | None]:
        """The random source's state (a CPU uint8 tensor, torch's ``get_state``) and its device type; (None,
        None) for one never made nor loaded (it starts from its seed)."""
        gen = self._generators[position]
        if gen is not None:
            return gen.get_state(), gen.device.type
        loaded = self._loaded[position]
        return (loaded[1], loaded[0]) if loaded is not None else (None, None)

    def state_dict(self) -> dict[str, Any]:
        """Per local island (lists, island order): error-feedback residuals, random-source states (CPU uint8
        tensors, None for one not used yet) and the device type each was drawn on."""
        states = [self._generator_state(p) for p in range(len(self._seeds))] if self._seeds is not None else []
        return {"feedback": [f.state_dict() for f in self.feedback] if self.feedback else [],
                "generators": [s for s, _ in states], "generator_devices": [d for _, d in states]}

    def island_state(self, position: int) -> dict[str, Any]:
        """The state of the local island at ``position`` alone (what :meth:`load_island_state` takes):
        ``feedback`` (residuals by key), ``generator`` (the random source's state, a CPU uint8 tensor; None
        without stochastic rounding or before the source was first used), ``generator_device`` (the device
        type it draws on) and ``codec_s``."""
        state, device = self._generator_state(position) if self._seeds is not None else (None, None)
        return {"feedback": self.feedback[position].state_dict() if self.feedback else None,
                "generator": state, "generator_device": device, "codec_s": self.codec_s[position]}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:
        """Restore one local island's :meth:`island_state`.

        Residuals are loaded where ``state`` holds them (the CPU, from a checkpoint) and moved to their
        tensor's device at its next encode, once. The random source takes the saved state (a state without
        ``generator_device``, from before it was kept, is a CPU generator's); a source made on another device
        type than the state's is made again at the next encode (see :meth:`generator`); no saved state (None)
        starts it again from its seed.
        """
        if self.feedback is not None and state.get("feedback") is not None:
            self.feedback[position].load_state_dict(state["feedback"])
        if self._seeds is not None:
            saved = state.get("generator")
            kind = str(state.get("generator_device") or "cpu")
            gen = self._generators[position]
            if gen is not None and (saved is None or gen.device.type == kind):
                if saved is None:
                    gen.manual_seed(self._seeds[position])
                else:
                    gen.set_state(saved)
            else:
                self._generators[position] = None
                self._loaded[position] = None if saved is None else (kind, saved)
        self.codec_s[position] = float(state.get("codec_s", 0.0))


def _make_generator(device: torch.device, seed: int, loaded: tuple[str, torch.Tensor] | None) -> torch.Generator:
    """A generator on ``device`` seeded ``seed``, then set to the ``loaded`` ``(device type, state)``; a state
    of another device type seeds it from the state's bytes instead (warned: the run no longer rounds as an
    uninterrupted one would)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    if loaded is not None:
        kind, state = loaded
        if kind == device.type:
            gen.set_state(state)
        else:
            digest = hashlib.blake2b(state.detach().cpu().contiguous().numpy().tobytes(), digest_size=8).digest()
            gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
            warnings.warn(f"wire: a random source saved on {kind} is resumed on {device.type}, whose generator "
                          "cannot take its state; seeded from it instead (the rounding differs from an "
                          "uninterrupted run's)", RuntimeWarning, stacklevel=3)
    return gen
