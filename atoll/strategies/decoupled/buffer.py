"""A fragment's merge buffer at the decoupled syncer: the accepted pushes waiting, one per island, and its
grace window (:class:`~atoll.strategies.decoupled.syncer.Syncer`, which merges it; saved by
:mod:`~atoll.strategies.decoupled.syncer_state`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Pending:
    """An accepted push waiting in a buffer: its island, its Δ (float32 CPU, (numel_p,)), the tokens it
    claims, the global version it started from, and whether it was checked against a warm history (else
    :meth:`PushBounds.vet <atoll.strategies.decoupled.bounds.PushBounds.vet>` vets it at the merge)."""

    island: int
    delta: torch.Tensor
    tokens: int
    base_version: int
    vetted: bool = True
    arrived_at: float = 0.0  # seconds, the syncer's clock: its wait in the buffer ends at the merge


@dataclass
class Buffer:
    """A fragment's pending pushes, when its grace window opened (``opened_at``, seconds, the clock of
    :meth:`Syncer.push <atoll.strategies.decoupled.syncer.Syncer.push>`: at the push that brought it to the
    minimum quorum, its first with the default of 1), the window (``grace_s``, seconds; inf: not open yet, or
    no round time measured yet) and the time of its first push (``first_at``)."""

    pushes: list[Pending] = field(default_factory=list)
    opened_at: float = 0.0
    grace_s: float = math.inf
    first_at: float = 0.0
