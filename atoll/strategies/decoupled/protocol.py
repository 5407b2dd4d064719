"""What islands and the syncer of Decoupled DiLoCo say to each other: typed records, the same in every runtime.

An island *pushes* one fragment's pseudo-gradient (:class:`Push`) and is answered with the merged global
fragment (:class:`Pull`) once its push was merged, or at once if it was refused; the syncer reports what it
did with each push (:class:`PushResult`). Tensors are float32 on the CPU; token counts are tokens trained;
versions count the outer steps committed to a fragment. A push is checked as if from a stranger: its indices
and counts must be ints (:func:`is_index`, never bools) and its Δ a plain tensor (:func:`tensor_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from atoll.algorithms.codec_base import Encoded
from atoll.algorithms.finite import all_finite


@dataclass(frozen=True)
class Push:
    """One fragment's pseudo-gradient from one island.

    Attributes:
        island: the pushing island, 0-based.
        fragment: the fragment, 0-based.
        delta: Δ = θ_global(base_version) − θ_island for the fragment, as the syncer receives it (decoded
            from the wire), float32 of shape (numel_p,).
        tokens: training tokens behind Δ (its merge weight before the staleness discount, at most one honest
            push's of its island: :meth:`PushBounds.weight_tokens
            <atoll.strategies.decoupled.bounds.PushBounds.weight_tokens>`).
        base_version: the version of the global fragment the island started from.
        nbytes: bytes the push occupied on the wire (the encoded payload).
        round_s: seconds from the island's last pull of the fragment to this push, on the island's clock
            (its measured round time, for the grace window); a claim, which the syncer clamps to the time it
            saw since the island's previous push of the fragment (:meth:`Syncer.round_time
            <atoll.strategies.decoupled.syncer.Syncer.round_time>`); None: not measured.
        session: the island's session at the syncer (its joins so far, :meth:`Syncer.rejoin
            <atoll.strategies.decoupled.syncer.Syncer.rejoin>`): a push of an earlier session is a replay.
        credential: the island's secret, proving the push is its own
            (:class:`~atoll.strategies.decoupled.trust.Admission`); "" where islands are not authenticated.
    """

    island: int
    fragment: int
    delta: torch.Tensor
    tokens: int
    base_version: int
    nbytes: int = 0
    round_s: float | None = None
    session: int = 0
    credential: str = field(default="", repr=False)


@dataclass(frozen=True)
class Pull:
    """A global fragment sent to an island at ``version``: float32 parameters (numel_p,), or the payloads
    that bring the island's copy there.

    ``params``: the fragment's values, float32 (numel_p,); None for a delta pull (``pull_codec`` other than
    fp32, :mod:`~atoll.strategies.decoupled.downlink`): then ``deltas`` holds the encoded changes of the versions
    ``since + 1 .. version`` in order (none when the island is up to date), which the island decodes and adds to
    its copy at version ``since`` (:func:`~atoll.strategies.decoupled.downlink.apply_pull`).

    ``realign``: the share of a round, in [0, 1), by which the island's push that this pull answers arrived
    behind the fragment's previous, larger merge (:meth:`Syncer.take_behind
    <atoll.strategies.decoupled.syncer.Syncer.take_behind>`); 0: in phase, not measured, or the rule off. An
    island with ``realign_pushes`` shortens its next round by that share of its H
    (:meth:`IslandWorker.adopt <atoll.strategies.decoupled.island.IslandWorker.adopt>`).
    """

    fragment: int
    params: torch.Tensor | None
    version: int
    realign: float = 0.0
    deltas: tuple[Encoded, ...] = ()
    since: int = -1

    @property
    def nbytes(self) -> int:
        """Bytes of the pull on the wire: its values as they travel (float32: 4 per parameter), or its
        payloads' bytes (:attr:`Encoded.nbytes <atoll.algorithms.codec_base.Encoded.nbytes>`, the pushes' count)."""
        if self.params is None:
            return sum(d.nbytes for d in self.deltas)
        return self.params.numel() * self.params.element_size()

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Pull:
        """A pull from its :func:`dataclasses.asdict` (a checkpoint's), its payloads rebuilt."""
        deltas = tuple(d if isinstance(d, Encoded) else Encoded(dict(d["tensors"]), int(d["numel"]), str(d["codec"]))
                       for d in state.get("deltas", ()))
        return cls(int(state["fragment"]), state["params"], int(state["version"]), float(state.get("realign", 0.0)),
                   deltas, int(state.get("since", -1)))


@dataclass(frozen=True)
class PushResult:
    """What the syncer did with one push.

    Attributes:
        accepted: the push entered the fragment's buffer (it may still be dropped as too stale later).
        reason: why it was rejected ("" when accepted): ``island``, ``identity``, ``fragment``, ``type``,
            ``dtype``, ``shape``, ``non_finite``, ``tokens``, ``version``, ``replay``, ``norm`` or ``stale``.
        committed: versions of the fragment committed by this push (0 or 1 outer steps).
    """

    accepted: bool
    reason: str = ""
    committed: int = 0


def is_index(x: Any, n: float) -> bool:
    """Is ``x`` an int (not a bool) in ``0..n-1`` (an island, a fragment, a count or a version)?"""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n


def tensor_refusal(delta: Any, numel: int) -> str:
    """Why ``delta`` is not a push's Δ of ``numel`` values (``type``, ``dtype``, ``shape``, ``non_finite``), or "".

    Only a plain dense float32 tensor in CPU memory is taken: a meta, sparse, nested or CUDA tensor, or a
    tensor subclass, is ``type`` (checking its values would raise, or run the subclass's code).
    """
    if type(delta) is not torch.Tensor or delta.layout != torch.strided or delta.is_nested \
            or delta.device.type != "cpu":
        return "type"
    if delta.dtype != torch.float32:
        return "dtype"
    if tuple(delta.shape) != (numel,):
        return "shape"
    return "" if all_finite(delta.detach()) else "non_finite"
