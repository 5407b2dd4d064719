"""The agreement of an island job's ranks on their exchanges: one int64 vector, reduced to its minimum each step.

Every rank of an island keeps a local vector of ``1 + 6 P`` int64 (P fragments): entry 0 is the leader's
answer to "take the next inner step?" (:data:`~atoll.runtime.service.client.GO`,
:data:`~atoll.runtime.service.client.WAIT`, or stop), then per fragment p six entries (:data:`UP`,
:data:`READY`, :data:`DONE`, :data:`VMIN`, :data:`VNEG`, :data:`SHIFT`): the exchange whose slices this rank
uploaded, the one the leader committed and saw merged, the one this rank downloaded, the version it downloaded
(as itself and negated, so that one all-reduce of minima gives both the least and the greatest version), and
the realignment the syncer's answer to the leader's push carried (``realign_pushes``: a share of a round in
[0, 1) as its float64 bits, :func:`share_bits`; written with :data:`READY`, so every rank reads the one
value of that exchange). A rank writes :data:`INF` where only another rank knows the value.
:meth:`Agreement.agree` is that all-reduce (:meth:`IslandGroup.agree
<atoll.runtime.service.group.IslandGroup.agree>`), run on the main thread at points every rank reaches alike;
the exchange threads write their entries (:meth:`Agreement.set`) and wait on the agreed vector
(:meth:`Agreement.wait`). An island of one rank agrees with itself at once.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable

import torch

from atoll.runtime.service.group import IslandGroup

#: what a rank sends for a value of the agreement only another rank knows (the all-reduce takes the minimum)
INF = 2**63 - 1
#: per fragment, the agreement's entries: the push whose slices are uploaded; the push the leader committed
#: and saw merged; the push whose slices are downloaded; the version downloaded (its minimum, and its
#: maximum as the minimum of its negation); the realignment of the leader's answer (its float64 bits)
UP, READY, DONE, VMIN, VNEG, SHIFT = range(6)
#: the entries per fragment
ENTRIES = 6


def at(p: int, what: int) -> int:
    """The index of fragment p's entry ``what`` (:data:`UP` ... :data:`SHIFT`) in the vector."""
    return 1 + ENTRIES * p + what


def share_bits(share: float) -> int:
    """A realignment share as an agreement entry: the float64 bits of ``share`` if it is a finite number in
    [0, 1), else of 0.0 (an answer is not trusted blindly). Exact (the ranks apply the very float the leader
    received) and in [0, 2**62), below :data:`INF`, so the minimum over the ranks is the leader's."""
    ok = isinstance(share, int | float) and not isinstance(share, bool) and math.isfinite(share) and 0 <= share < 1
    return struct.unpack("<q", struct.pack("<d", float(share) if ok and share > 0 else 0.0))[0]  # (-0.0: 0.0)


def bits_share(value: int) -> float:
    """The share :func:`share_bits` encoded (0.0 for :data:`INF`, no leader's value, or anything not a share)."""
    if not 0 <= value < INF:
        return 0.0
    share = struct.unpack("<d", struct.pack("<q", value))[0]
    return share if math.isfinite(share) and 0 <= share < 1 else 0.0


class Agreement:
    """This rank's entries and the island's agreed vector (see the module docstring); thread-safe.

    Args:
        group: the island's ranks.
        fragments: P, the run's fragments.

    Attributes:
        local: this rank's entries, ``1 + 6 P`` ints (start: :data:`INF`, the caller sets its own).
        agreed: the last agreed vector (the element-wise minimum over the island's ranks).
    """

    def __init__(self, group: IslandGroup, fragments: int) -> None:
        self.group = group
        self.local = [INF] * (1 + ENTRIES * fragments)
        self.agreed = list(self.local)
        self._cond = threading.Condition()
        self._closed = False

    def entry(self, p: int, what: int) -> int:
        """Fragment p's agreed entry ``what``."""
        return self.agreed[at(p, what)]

    def set(self, p: int, what: int, value: int) -> None:
        """Set this rank's entry ``what`` of fragment p (an island of one rank: agreed at once)."""
        self.update({at(p, what): value})

    def update(self, entries: dict[int, int]) -> None:
        """Set several of this rank's entries at once (vector index -> value), under one lock."""
        with self._cond:
            for i, value in entries.items():
                self.local[i] = value
            if self.group.size == 1:
                self.agreed = list(self.local)
                self._cond.notify_all()

    def agree(self) -> list[int]:
        """One round of the agreement (collective over the island): every rank's entries, reduced to their
        minimum; the agreed vector."""
        with self._cond:
            local = torch.tensor(self.local, dtype=torch.int64)
        agreed = self.group.agree(local).tolist()
        with self._cond:
            self.agreed = agreed
            self._cond.notify_all()
        return agreed

    def wait(self, ready: Callable[[list[int]], bool]) -> list[int]:
        """(An exchange thread.) Wait until the agreed vector is ``ready``; that vector.

        Raises:
            RuntimeError: the agreement was closed (:meth:`close`) while waiting.
        """
        with self._cond:
            while not ready(self.agreed):
                if self._closed:
                    raise RuntimeError("the island's transport closed while an exchange waited")
                self._cond.wait(1.0)
            return list(self.agreed)

    def close(self) -> None:
        """Wake every waiter: they raise (an island that stops on an error does not wait for its exchanges)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
