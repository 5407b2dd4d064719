"""Where the tokens of a decoupled run went: every token an island trained in exactly one bucket, per island.

The buckets, per island, in tokens (each push's tokens times its fragment's share of the parameters, as
``useful_tokens``: a push of fragment p speaks for that share of the model):

- ``merged_tokens_by_island``: merged into the global model (the syncer's ``merged`` bucket);
- ``stale_tokens_by_island``: pushed, but dropped as staler than the island's limit, or replaced in its
  buffer by a newer push of the same island (one push per island per merge);
- ``rejected_tokens_by_island``: pushed, but refused by validation (norm, tokens, shape, ...);
- ``lost_tokens_by_island``: lost to a failure: not pushed yet when the island failed, or on the wire then;
- ``in_flight_tokens_by_island``: pushed but still on the wire when the run stopped (only a run that gave
  up on its failures stops with pushes on the wire: a finished run delivers and merges every push).

:func:`token_buckets` adds ``trained_tokens_by_island`` (inner steps x tokens per step) and
``unaccounted_tokens``: trained minus every bucket, summed over the islands, which is 0 (to float
rounding, reported to 1e-6 tokens) when the accounting holds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("atoll.syncer")

#: the buckets of the syncer's :meth:`~atoll.strategies.decoupled.syncer.Syncer.stats` (per island)
SYNCER_BUCKETS = ("merged_tokens_by_island", "stale_tokens_by_island", "rejected_tokens_by_island")


def token_buckets(stats: dict[str, Any], trained: Sequence[float], lost: Sequence[float],
                  in_flight: Sequence[float]) -> dict[str, Any]:
    """The run's own buckets beside the syncer's ``stats``, and the tokens no bucket holds.

    Args:
        stats: :meth:`~atoll.strategies.decoupled.syncer.Syncer.stats` (holds :data:`SYNCER_BUCKETS`).
        trained: per island, tokens trained (inner steps taken, lost ones included, x tokens per step).
        lost: per island, tokens lost to failures; ``in_flight``: per island, tokens on the wire at the end.

    Returns:
        ``trained_tokens_by_island``, ``lost_tokens_by_island``, ``in_flight_tokens_by_island`` and
        ``unaccounted_tokens`` (float tokens; a warning is logged when it is not 0).
    """
    held = [sum(v) for v in zip(*(stats[k] for k in SYNCER_BUCKETS), lost, in_flight, strict=True)]
    unaccounted = round(sum(t - h for t, h in zip(trained, held, strict=True)), 6) + 0.0
    if unaccounted:
        log.warning("syncer: %s of %s trained tokens are in no bucket", unaccounted, sum(trained))
    return {"trained_tokens_by_island": [float(t) for t in trained], "lost_tokens_by_island": list(lost),
            "in_flight_tokens_by_island": list(in_flight), "unaccounted_tokens": unaccounted}


def syncer_stats(s: Any) -> dict[str, Any]:
    """The summary's counts of a :class:`~atoll.strategies.decoupled.syncer.Syncer` ``s``: commits, pushes
    accepted and refused (by reason, and per island and reason), staleness, quorum sizes, merge waits, the
    robust merge and its measured seconds, and the tokens pushed per island by what became of them."""
    st, qs = s.staleness, s.quorum_sizes  # (tallies: atoll.strategies.decoupled.tallies)
    return {
        "commits": s.commits, "accepted_updates": s.accepted_updates,
        "rejected_updates": s.rejected_updates, "rejected_by_reason": dict(s.rejected_by_reason),
        "rejected_by_island": {k: list(v) for k, v in s.admission.rejected_by_island.items()},
        "robust_merge": s.robust_merge, "merge_s": s.merge_s, "stale_updates": s.stale_updates,
        "replaced_updates": s.replaced_updates,
        "quorum": s.quorum, "quorum_size_mean": qs.mean(),
        "quorum_size_min": qs.least(), "quorum_size_max": qs.greatest(), "quorum_size_counts": qs.histogram(),
        "staleness_mean": st.mean(), "staleness_max": st.greatest(), "staleness_counts": st.histogram(),
        # buffers' waits for a quorum; merges' overruns of their window (> 0 only on Ray's call-driven clock)
        **s.merge_waits.summary(),
        # per island, the tokens pushed by what became of them (times fragment share, as merged_tokens)
        **{f"{k}_tokens_by_island": list(v) for k, v in s.tokens_by_outcome.items()},
    }
