"""What a push's claims can buy at the decoupled syncer beyond its tokens and norm
(:mod:`~atoll.strategies.decoupled.bounds`): its round time, and an island's standing when its claims are
all refused. Pure functions over the :class:`~atoll.strategies.decoupled.syncer.Syncer`'s counters.

- **Round time.** A push carries the island's own measured round time (seconds from its pull to its push, on
  its clock), which sets the grace window of the buffers (the median of the recent ones, x ``grace_factor``).
  It is a claim, so :func:`round_time` clamps it to what the syncer itself saw: the seconds since the
  island's previous accepted push of the fragment (:func:`since_last_push`), or ``max_round_s`` before one.
  An island that claims 1e300 s and goes silent moves no deadline beyond the time it really took.
- **Starvation.** An island whose last ``starve_after`` pushes were all refused, none accepted since, is
  :func:`starved`: its work never reaches the model (e.g. another island's tiny pushes lowered the norm
  bound), so the runtimes stop the run with :func:`starved_message` (exit status 1) rather than train on.

Errors: none; a claim that is not a positive finite number is simply not taken (None).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from atoll.strategies.decoupled.protocol import is_index


def since_last_push(last_push_at: Sequence[Sequence[float | None]], island: Any, fragment: Any,
                    now: float) -> float | None:
    """Seconds from the syncer's last accepted push of ``island``'s of ``fragment`` to ``now`` (at least 0),
    from ``last_push_at`` (per island and fragment, seconds; None: never); None if it never accepted one or
    ``island`` or ``fragment`` (as a stranger sent them) is no index of the run."""
    if not (is_index(island, len(last_push_at)) and is_index(fragment, len(last_push_at[island]))):
        return None
    last = last_push_at[island][fragment]
    return None if last is None else max(0.0, now - last)


def round_time(claimed: Any, observed: float | None, max_round_s: float | None) -> float | None:
    """The round time a push's claim ``claimed`` (seconds) is taken as for the grace window, or None.

    A claim is the island's own measurement (pull to push, on its clock), so it is clamped to what the
    syncer itself saw: the seconds since the island's previous accepted push of the fragment
    (``observed``; an honest round is a little shorter: the pull follows the push), or ``max_round_s``
    where the syncer has seen none (the runtimes pass one; None: the claim is taken as it is). So no
    claim (1e300) stretches the window beyond the time the island really took, or beyond the ceiling
    for its first push; a claim that is not a positive finite number is not taken.
    """
    if not (isinstance(claimed, int | float) and not isinstance(claimed, bool) and 0 < claimed < math.inf):
        return None
    ceiling = observed if observed is not None else max_round_s
    r = min(float(claimed), ceiling if ceiling is not None else math.inf)
    return r if r > 0 else None


def starved(refused_in_a_row: Sequence[int], starve_after: int) -> list[int]:
    """The islands whose last ``starve_after`` pushes were all refused (``refused_in_a_row``: per island,
    the pushes refused since its last accepted one), in ascending order."""
    return [i for i, n in enumerate(refused_in_a_row) if n >= starve_after]


def starved_message(islands: Sequence[int], rejected_by_island: Mapping[str, Sequence[int]],
                    starve_after: int) -> str:
    """One line for a run that stops because of the :func:`starved` ``islands``: who, why (the reasons of
    their refusals, ``rejected_by_island``: per reason, per island, the pushes refused) and what to do."""
    reasons = {r: v for r, v in rejected_by_island.items() if any(v[i] for i in islands)}
    why = ", ".join(f"{r} x{sum(v[i] for i in islands)}" for r, v in sorted(reasons.items()))
    return (f"syncer: every push of island{'s' if len(islands) > 1 else ''} {', '.join(map(str, islands))} "
            f"was refused ({starve_after} in a row: {why}), so its training never reaches the model; "
            "another island may be setting the norm bound with tiny pushes (with 2 islands, no majority "
            "vouches for either): check the islands, or run 3 or more "
            "(see rejected_by_island in summary.json)")
