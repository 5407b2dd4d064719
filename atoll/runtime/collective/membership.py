"""Who is in a collective job: the islands alive, the epoch, and each island's losses and rejoins.

One object, owned by :class:`~atoll.runtime.collective.runtime.CollectiveRuntime`; the quorum
(:func:`~atoll.runtime.collective.quorum.recover`, a loss) and the admission of a restarted island
(:mod:`~atoll.runtime.collective.rejoin`) change it only through :meth:`Membership.drop` and
:meth:`Membership.admit`, each of which starts a new epoch. Every rank of an epoch holds an equal copy: the
survivors apply the same agreed change, and a joiner receives the live islands' copy with their state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MembershipEvent:
    """One change of membership.

    Attributes:
        kind: ``"lost"`` (the others went on without the island) or ``"rejoined"`` (admitted again).
        island: the island's index.
        step: inner steps done when it happened (a loss: the inner step, 1-based, in which it was found).
        epoch: the epoch the change started.
    """

    kind: str
    island: int
    step: int
    epoch: int


@dataclass
class Membership:
    """The islands of a job alive in the current epoch, and the history that led there.

    Args:
        islands: K, the islands the job was started with (indices ``0..K-1``).

    Attributes:
        alive: the islands in the current epoch, ascending.
        epoch: 0 at the start, one more per change (a loss survived or an admission); the groups of epoch
            ``n`` meet over the store prefix ``epoch{n}/``.
        events: every change, in order.
        told: how many of them :meth:`changes` has handed out.
    """

    islands: int
    alive: list[int] = field(default_factory=list)
    epoch: int = 0
    events: list[MembershipEvent] = field(default_factory=list)
    told: int = 0  # events handed to :meth:`changes` (this process's, not part of the state)

    def __post_init__(self) -> None:
        if not self.alive and not self.events:
            self.alive = list(range(self.islands))

    @property
    def lost(self) -> dict[int, int]:
        """Island -> the inner step of its latest loss (islands never lost are absent)."""
        return {e.island: e.step for e in self.events if e.kind == "lost"}

    @property
    def rejoined(self) -> dict[int, int]:
        """Island -> inner steps done at its latest rejoin (islands never rejoined are absent)."""
        return {e.island: e.step for e in self.events if e.kind == "rejoined"}

    def first_rejoin(self) -> int | None:
        """Inner steps done at the job's first rejoin, or None."""
        return next((e.step for e in self.events if e.kind == "rejoined"), None)

    def changes(self) -> list[MembershipEvent]:
        """The events since the last call, in order (the run events of the job: ``failure``, ``rejoin``)."""
        new, self.told = self.events[self.told:], len(self.events)
        return new

    def ranks(self, ranks_per_island: int) -> list[int]:
        """The global ranks of the islands alive (island i is ranks ``[i*R, (i+1)*R)``)."""
        return [i * ranks_per_island + p for i in self.alive for p in range(ranks_per_island)]

    def drop(self, islands: list[int], step: int) -> None:
        """A new epoch without ``islands`` (lost at inner step ``step``).

        Raises:
            ValueError: an island that is not alive.
        """
        if any(i not in self.alive for i in islands):
            raise ValueError(f"drop: islands {islands} are not all alive ({self.alive})")
        self.epoch += 1
        self.alive = [i for i in self.alive if i not in islands]
        self.events += [MembershipEvent("lost", i, step, self.epoch) for i in islands]

    def admit(self, islands: list[int], step: int) -> None:
        """A new epoch with ``islands`` back, after ``step`` inner steps.

        Raises:
            ValueError: an island that is alive already, or not one of the job's.
        """
        if any(i in self.alive or not 0 <= i < self.islands for i in islands):
            raise ValueError(f"admit: islands {islands} are alive already or not in the job ({self.alive})")
        self.epoch += 1
        self.alive = sorted(self.alive + islands)
        self.events += [MembershipEvent("rejoined", i, step, self.epoch) for i in islands]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able (sent to a joiner with the live islands' state; no pickle)."""
        return {"islands": self.islands, "alive": list(self.alive), "epoch": self.epoch,
                "events": [dataclasses.asdict(e) for e in self.events]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take ``state`` (from :meth:`state_dict`).

        Raises:
            ValueError: it describes a job of another number of islands.
        """
        if int(state["islands"]) != self.islands:
            raise ValueError(f"membership: a job of {state['islands']} islands, this one has {self.islands}")
        self.alive, self.epoch = [int(i) for i in state["alive"]], int(state["epoch"])
        self.events = [MembershipEvent(str(e["kind"]), int(e["island"]), int(e["step"]), int(e["epoch"]))
                       for e in state["events"]]
