"""What the decoupled syncer keeps of one island: one record per island, not parallel lists indexed by island.

Read and written by :class:`~atoll.strategies.decoupled.syncer.Syncer` (``per_island``) and saved by
:mod:`~atoll.strategies.decoupled.syncer_state` (in the checkpoint's layout of one list per field).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the buckets of the tokens pushed, per island (:meth:`~atoll.strategies.decoupled.syncer.Syncer.stats`)
OUTCOMES = ("merged", "stale", "rejected")


@dataclass
class IslandRecord:
    """What the syncer keeps of one island: its timings, its staleness credit, its refusals in a row and where
    its tokens went (one record per island, :attr:`Syncer.per_island`).

    Attributes:
        last_push_at: per fragment, the syncer's time (seconds) of the island's last accepted push; None: never.
        last_wait: per fragment, the seconds its last merged push waited in the buffer; None: none merged yet.
        stale_credit: per fragment, the commits of staleness it earned (pushes dropped as stale; the module
            docstring's fairness rule), at most the number of islands.
        refused_in_a_row: its pushes refused since its last accepted one (:meth:`Syncer.starved`).
        tokens: its pushed tokens by outcome (:data:`OUTCOMES`), each times its fragment's share of the
            parameters (float tokens).
    """

    last_push_at: list[float | None]
    last_wait: list[float | None]
    stale_credit: list[int]
    refused_in_a_row: int = 0
    tokens: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0.0))

    @classmethod
    def new(cls, fragments: int) -> IslandRecord:
        """The record of an island that has pushed nothing yet, in a run of ``fragments`` fragments."""
        return cls([None] * fragments, [None] * fragments, [0] * fragments)
