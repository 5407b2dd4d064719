"""What a decoupled run shows while it trains, for every runtime: the progress line's detail and the run events
of what the syncer did (:mod:`atoll.job.timeline`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from atoll.strategies.decoupled.journal import Merged, Refused

#: merged pushes whose staleness the progress line averages (the most recent)
RECENT = 50


def progress_detail(steps: Sequence[int], commits: int, staleness: Sequence[int], goodput: float | None,
                    down: Sequence[int] = ()) -> str:
    """The decoupled part of a progress line: ``steps 40/40/20/10 | merges 12 | staleness 0.25 | goodput 83%``.

    Args:
        steps: inner steps each island has taken so far.
        commits: outer steps the syncer committed so far.
        staleness: the staleness (commits since its base version) of every push merged so far; the mean of
            the last :data:`RECENT` is shown.
        goodput: useful tokens per second over the failure-free rate so far (None: not known yet).
        down: islands down now (shown only when some are).
    """
    recent = list(staleness)[-RECENT:]
    parts = [f"steps {'/'.join(str(n) for n in steps)}", f"merges {commits}",
             f"staleness {sum(recent) / len(recent):.2f}" if recent else "staleness -",
             f"goodput {goodput:.0%}" if goodput is not None else "goodput -"]
    if down:
        parts.append(f"down {','.join(str(i) for i in down)}")
    return " | ".join(parts)


def syncer_events(records: Sequence[Merged | Refused]) -> list[tuple[str, dict[str, Any]]]:
    """The run events (kind, fields) of the syncer's journal
    (:meth:`~atoll.strategies.decoupled.journal.Journal.drain`): ``merge`` (fragment, version, islands) and
    ``refusal`` (island, fragment, reason), each at its time."""
    events: list[tuple[str, dict[str, Any]]] = []
    for r in records:
        if isinstance(r, Merged):
            events.append(("merge", {"fragment": r.fragment, "version": r.version, "islands": list(r.islands),
                                     "sim_wall_s": r.at}))
        else:
            events.append(("refusal", {"island": r.island, "fragment": r.fragment, "reason": r.reason,
                                       "sim_wall_s": r.at}))
    return events
