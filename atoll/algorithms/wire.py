"""What travels between islands: a codec with each local island's error feedback and random source.

:class:`ErrorFeedback` keeps what a lossy codec dropped and adds it to the next exchange of the same tensor;
:class:`Wire` bundles, for the islands of one process, the run's codec (:mod:`atoll.algorithms.codecs`),
their error feedback and their seeded random sources for stochastic rounding, and is what a strategy hands to
its collectives (:class:`atoll.runtime.comm.Comm`). Pure tensor math; errors are ValueError.
"""

from __future__ import annotations

import time
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
    arXiv:2411.19870). Residuals are float32, of shape ``(numel,)``, on the input's device; keys name the
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
            x: float32 tensor of shape ``(numel,)``; not modified.
            generator: passed to :meth:`Codec.encode`.

        Returns:
            the payload of ``x + residual[key]``.

        Raises:
            ValueError: ``x`` is not 1-D float32, or its length differs from the stored residual's.
        """
        r = self._residual.get(key)
        if r is not None and r.shape != x.shape:
            raise ValueError(
                f"error_feedback: tensor {key!r} has shape {tuple(x.shape)}, its residual {tuple(r.shape)}"
            )
        target = x if r is None else x + r.to(x.device)
        enc = self.codec.encode(target, generator)
        if not self.codec.lossless:
            self._residual[key] = target - self.codec.decode(enc)
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
        """Replace all residuals with copies of ``sd``'s (converted to float32).

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

    Args:
        codec: a name of :data:`atoll.algorithms.codecs.CODEC_NAMES`.
        local_islands: the indices of the islands this process runs (one entry of state each).
        block_size, rounding, topk_fraction: the codec's settings (:func:`~atoll.algorithms.codecs.make_codec`).
        error_feedback: keep each island's residual per tensor key (lossy codecs only).
        seed: the run's seed (stochastic rounding draws from ``seed * 1_000_003 + island``).

    Attributes:
        codec_s: per local island, measured seconds :meth:`transmit` spent encoding and decoding (wall clock;
            on an accelerator the launches only).

    Raises:
        ValueError: the codec settings are invalid.
    """

    def __init__(self, codec: str, local_islands: list[int], *, block_size: int = 64, rounding: str = "nearest",
                 topk_fraction: float = 0.01, error_feedback: bool = False, seed: int = 0) -> None:
        lossy = codec != "fp32"
        self.codec: Codec | None = make_codec(codec, block_size=block_size, rounding=rounding,
                                              topk_fraction=topk_fraction) if lossy else None
        self.feedback = ([ErrorFeedback(self.codec) for _ in local_islands]
                         if self.codec is not None and error_feedback else None)
        self.generators = None
        if self.codec is not None and rounding == "stochastic":
            self.generators = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in local_islands]
        self.codec_s = [0.0] * len(local_islands)

    def encode(self, position: int, x: torch.Tensor, key: str) -> Encoded:
        """Encode the 1-D float32 ``x`` of the local island at ``position`` (its error feedback under
        ``key`` and its random source applied). Requires a codec (``self.codec`` not None)."""
        assert self.codec is not None
        gen = self.generators[position] if self.generators is not None else None
        return self.feedback[position].encode(key, x, gen) if self.feedback is not None else self.codec.encode(x, gen)

    def transmit(self, position: int, x: torch.Tensor, key: str) -> tuple[torch.Tensor, int]:
        """What the receiver of one island's ``x`` (float32, (numel,)) gets, and the bytes it travels as.

        Returns:
            ``(decoded, nbytes)``: ``x`` itself and ``4 * numel`` without a codec; else the decoded float32
            tensor (error feedback and rounding applied) and the encoded payload's bytes.
        """
        if self.codec is None:
            return x, x.numel() * x.element_size()
        t0 = time.perf_counter()
        decoded = self.codec.decode(self.encode(position, x, key))
        self.codec_s[position] += time.perf_counter() - t0
        return decoded, self.codec.payload_bytes(int(x.numel()))

    def state_dict(self) -> dict[str, Any]:
        """Per local island: error-feedback residuals and random-source states (lists, island order)."""
        return {"feedback": [f.state_dict() for f in self.feedback] if self.feedback else [],
                "generators": [g.get_state() for g in self.generators] if self.generators else []}

    def island_state(self, position: int) -> dict[str, Any]:
        """The state of the local island at ``position`` alone (what :meth:`load_island_state` takes)."""
        return {"feedback": self.feedback[position].state_dict() if self.feedback else None,
                "generator": self.generators[position].get_state() if self.generators else None,
                "codec_s": self.codec_s[position]}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:
        """Restore one local island's :meth:`island_state`."""
        if self.feedback is not None and state.get("feedback") is not None:
            self.feedback[position].load_state_dict(state["feedback"])
        if self.generators is not None and state.get("generator") is not None:
            self.generators[position].set_state(state["generator"])
        self.codec_s[position] = float(state.get("codec_s", 0.0))
