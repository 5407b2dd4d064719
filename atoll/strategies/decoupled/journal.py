"""What the decoupled syncer did, kept for the runtime to turn into run events (:mod:`atoll.job.timeline`):
each merge (an outer step of a fragment) and each refused push, with its time."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: records kept until a runtime drains them (beyond this the oldest go first: a runtime that never drains)
JOURNAL_SIZE = 100_000


@dataclass(frozen=True)
class Merged:
    """The syncer committed outer step ``version`` of ``fragment`` at ``at`` (seconds, the clock of
    :meth:`Syncer.push <atoll.strategies.decoupled.syncer.Syncer.push>`), merging the pushes of ``islands``."""

    fragment: int
    version: int
    islands: tuple[int, ...]
    at: float


@dataclass(frozen=True)
class Refused:
    """The syncer refused a push of ``island`` for ``fragment`` (as the push named them; None: not a whole
    number) at ``at`` (seconds), for ``reason``: the check it failed (:mod:`~atoll.strategies.decoupled.trust`,
    :mod:`~atoll.strategies.decoupled.bounds`)."""

    island: Any
    fragment: Any
    reason: str
    at: float


def _whole(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


class Journal:
    """The syncer's records since the runtime last drained them, oldest first.

    Attributes:
        clock: the time of the syncer's latest push or poll (seconds): when what it records now happened.
    """

    def __init__(self) -> None:
        self.records: deque[Merged | Refused] = deque(maxlen=JOURNAL_SIZE)
        self.clock = 0.0

    def merged(self, fragment: int, version: int, islands: Iterable[int], at: float | None = None) -> None:
        """Record an outer step (``at``: its time, default :attr:`clock`)."""
        self.records.append(Merged(fragment, version, tuple(sorted(islands)), self.clock if at is None else at))

    def refused(self, island: Any, fragment: Any, reason: str) -> None:
        """Record a refused push, now (:attr:`clock`), with the island and fragment it named where they are whole
        numbers (anything else a stranger sent is recorded as None: the record stays plain JSON)."""
        self.records.append(Refused(_whole(island), _whole(fragment), reason, self.clock))

    def drain(self) -> list[Merged | Refused]:
        """The records since the last call, oldest first (and forget them)."""
        records = list(self.records)
        self.records.clear()
        return records
