"""The collective job's trained tokens as one rank knows them: each island's last reported count, a rejoin's offset."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class JobTokens:
    """The job's trained tokens as this rank knows them (its runtime's ``job_tokens``).

    Attributes:
        of: each island's tokens at the last :func:`~atoll.runtime.collective.report.totals` (a lost island's
            stay as last reported).
        offset: this island's tokens not in its islands' own counts: a rejoined island's before the loss, less
            those of the live island's state it took (added to what it reports).
    """

    of: list[int]
    offset: int = 0

    def update(self, alive: dict[int, int]) -> int:
        """Take the live islands' counts (island -> tokens, :func:`~atoll.runtime.collective.report.totals`);
        return every island's sum."""
        for island, tokens in alive.items():
            self.of[island] = tokens
        return sum(self.of)

    def rejoined(self, island: int, counted: int) -> None:
        """Island ``island`` took a live island's state, whose own counts are ``counted`` tokens: what it trained
        before its loss (its entry of :attr:`of`, received on rejoining) less those is its offset."""
        self.offset = self.of[island] - counted
