"""What the syncer counts per merge, kept in bounded memory: integer tallies and the merges' waits.

A syncer of a long run merges without end, so nothing it keeps per merge may grow with the run: the staleness
of every merged push and the size of every quorum are small integers (staleness at most ``max_staleness +
islands``, a quorum at most ``islands``), kept as counts per value (:class:`Tally`: the mean, least, greatest
and the histogram of the run are exact) plus a window of the most recent (the progress line's); the merges'
waits for a quorum and their grace windows as running sums and maxima (:class:`MergeWaits`). Both are written to
the syncer's checkpoint and read back, also from the older form (one list entry per merge).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

#: the most recent observations a tally keeps in order (the progress line averages the last few of them)
RECENT_WINDOW = 256


class Tally:
    """Integer observations of a whole run as counts per value, and the most recent ones in order.

    Attributes:
        counts: value -> how many times it was observed.
        recent: the last :data:`RECENT_WINDOW` observations, oldest first.
    """

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.recent: deque[int] = deque(maxlen=RECENT_WINDOW)

    def add(self, value: int) -> None:
        """Observe ``value``."""
        self.counts[value] = self.counts.get(value, 0) + 1
        self.recent.append(value)

    def extend(self, values: Iterable[int]) -> None:
        """Observe each of ``values`` in order."""
        for v in values:
            self.add(v)

    def __len__(self) -> int:
        return sum(self.counts.values())

    def mean(self) -> float:
        """The mean of every observation (0.0 if none)."""
        n = len(self)
        return sum(k * v for k, v in self.counts.items()) / n if n else 0.0

    def least(self) -> int:
        """The least observation (0 if none)."""
        return min(self.counts, default=0)

    def greatest(self) -> int:
        """The greatest observation (0 if none)."""
        return max(self.counts, default=0)

    def histogram(self) -> dict[str, int]:
        """Value (as a string, ascending) -> count: the summary's ``*_counts``."""
        return {str(k): self.counts[k] for k in sorted(self.counts)}

    def state_dict(self) -> dict[str, Any]:
        """The counts and the recent window (JSON types)."""
        return {"counts": self.histogram(), "recent": list(self.recent)}

    @classmethod
    def from_state(cls, state: dict[str, Any] | list[int]) -> Tally:
        """A tally from :meth:`state_dict`, or from an older checkpoint's list of every observation."""
        tally = cls()
        if isinstance(state, list):
            tally.extend(int(x) for x in state)
            return tally
        tally.counts = {int(k): int(v) for k, v in state["counts"].items()}
        tally.recent.extend(int(x) for x in state["recent"])
        return tally


class MergeWaits:
    """The merges' waits for a quorum (seconds, from the buffer's window opening, or its first push short of a
    quorum, until the merge) and their grace windows (seconds; none: -1.0), as running sums and maxima.

    Attributes:
        count: merges timed.
        wait_sum_s: the sum of their waits, added in order.
        last: the last merge's (wait, grace window), or None.
    """

    def __init__(self) -> None:
        self.count = 0
        self.wait_sum_s = 0.0
        self._wait_max = self._grace_max = self._overrun_max = -math.inf
        self.last: tuple[float, float] | None = None

    def add(self, wait_s: float, grace_s: float) -> None:
        """One merge's wait and grace window (-1.0: none)."""
        self.count += 1
        self.wait_sum_s += wait_s
        self._wait_max, self._grace_max = max(self._wait_max, wait_s), max(self._grace_max, grace_s)
        if grace_s >= 0:
            self._overrun_max = max(self._overrun_max, wait_s - grace_s)
        self.last = (wait_s, grace_s)

    def summary(self) -> dict[str, float]:
        """``merge_wait_max_s``, ``merge_wait_mean_s``, ``grace_window_max_s``, ``merge_overrun_max_s`` (0.0 where
        no merge was timed; an overrun only of merges with a grace window)."""
        def seen(x: float) -> float:
            return x if x > -math.inf else 0.0

        return {"merge_wait_max_s": seen(self._wait_max),
                "merge_wait_mean_s": self.wait_sum_s / self.count if self.count else 0.0,
                "grace_window_max_s": seen(self._grace_max), "merge_overrun_max_s": seen(self._overrun_max)}

    def state_dict(self) -> dict[str, Any]:
        """Its sums and maxima (JSON types; a maximum of nothing: None)."""
        def opt(x: float) -> float | None:
            return x if x > -math.inf else None

        return {"count": self.count, "wait_sum_s": self.wait_sum_s, "wait_max_s": opt(self._wait_max),
                "grace_max_s": opt(self._grace_max), "overrun_max_s": opt(self._overrun_max),
                "last": list(self.last) if self.last is not None else None}

    @classmethod
    def from_state(cls, state: dict[str, Any] | list[list[float]]) -> MergeWaits:
        """From :meth:`state_dict`, or from an older checkpoint's list of (wait, grace) per merge."""
        waits = cls()
        if isinstance(state, list):
            for w, g in state:
                waits.add(float(w), float(g))
            return waits

        def back(x: Any) -> float:
            return -math.inf if x is None else float(x)

        waits.count, waits.wait_sum_s = int(state["count"]), float(state["wait_sum_s"])
        waits._wait_max, waits._grace_max = back(state["wait_max_s"]), back(state["grace_max_s"])
        waits._overrun_max = back(state["overrun_max_s"])
        last = state.get("last")
        waits.last = (float(last[0]), float(last[1])) if last else None
        return waits
