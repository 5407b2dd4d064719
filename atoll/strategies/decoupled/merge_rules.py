"""Decoupled DiLoCo's merge rules as the syncer's settings: minimum quorum, grace window, push weight, average.

The paper's syncer (arXiv:2604.21428, as third-party readings describe it) merges a fragment's buffer at a
**minimum quorum** K (default 1: the grace window opens at the buffer's K-th distinct island; a buffer short
of K waits for islands, not for the clock) within an **adaptive grace window**
``gamma x (tau x t_step - (t_quorum + t_sync))``, at least 0, weighs a push by **tokens x (tokens / steps)**
and averages every non-embedding tensor **radial-directionally** (the mean of the pushes' norms along the
normalized mean of their directions; :func:`~atoll.algorithms.merge.segmented_mean`, the tensors told apart by
the fragment's parameter names). :class:`MergeRules` holds them for
:class:`~atoll.strategies.decoupled.syncer.Syncer`, with atoll's earlier rules beside them (the ``round``
window, ``tokens`` weights, the token-weighted ``mean``); which is the default of a run, and why, is measured
in bench/out/decoupled_merge and said in docs/decoupled.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from atoll.algorithms.merge import segmented_mean
from atoll.algorithms.robust import clip_to_median_norm, robust_mean

#: how a buffer's pushes are averaged (``average``), weighed (``push_weight``), and how long it waits (``grace_window``)
AVERAGES = ("mean", "radial_directional")
PUSH_WEIGHTS = ("tokens", "tokens_x_tokens_per_step")
GRACE_WINDOWS = ("round", "slack")


@dataclass
class MergeRules:
    """A syncer's merge rules.

    Attributes:
        islands: the islands of the run; quorum: the distinct islands that merge a buffer at once.
        min_quorum: K, the fewest distinct islands a merge takes; the window opens when a buffer holds K.
        grace_window: ``round`` (``grace_factor`` x the median round time) or ``slack`` (:meth:`window`).
        grace_factor: the ``round`` window in median round times.
        grace_slack_fraction: gamma of the ``slack`` window; grace_overlap: tau x t_step as a share of the
            islands' measured push-to-push round (tau / H).
        average: ``mean`` (the token-weighted mean, or the robust merge's) or ``radial_directional``
            (every tensor but the embeddings by :func:`~atoll.algorithms.merge.radial_directional_mean`, after
            ``clip`` if the robust merge is clip).
        push_weight: ``tokens`` or ``tokens_x_tokens_per_step`` (times the island's tokens per inner step,
            ``step_tokens``, over the largest).
        step_tokens: per island, its tokens per inner step (its batch x sequence length), declared; None: equal.
        robust_merge, trim: :func:`~atoll.algorithms.robust.robust_mean`'s method and trimmed fraction per end.

    Raises:
        ValueError: a minimum quorum outside ``1..quorum``, an unknown ``average``, ``push_weight`` or
            ``grace_window``, ``radial_directional`` with a coordinate-wise robust merge, or step tokens that
            are not one positive count per island.
    """

    islands: int
    quorum: int
    min_quorum: int = 1
    grace_window: str = "round"
    grace_factor: float = 1.0
    grace_slack_fraction: float = 0.5
    grace_overlap: float = 1.0
    average: str = "mean"
    push_weight: str = "tokens"
    step_tokens: Sequence[int] | None = None
    robust_merge: str = "none"
    trim: float = 0.25
    step_share: list[float] = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_quorum <= self.quorum:
            raise ValueError(f"min_quorum {self.min_quorum} outside 1..{self.quorum} (the quorum)")
        for name, value, known in (("average", self.average, AVERAGES),
                                   ("push_weight", self.push_weight, PUSH_WEIGHTS),
                                   ("grace_window", self.grace_window, GRACE_WINDOWS)):
            if value not in known:
                raise ValueError(f"{name}: unknown '{value}'; use one of {', '.join(known)}")
        if self.average == "radial_directional" and self.robust_merge not in ("none", "clip"):
            raise ValueError(f"average: radial_directional merges norms and directions, {self.robust_merge} merges "
                             "coordinates; use robust_merge none or clip with it")
        steps = self.step_tokens
        if steps is not None and (len(steps) != self.islands or min(steps) <= 0):
            raise ValueError(f"step_tokens: one positive count per island needed, got {list(steps)}")
        self.step_share = [t / max(steps) for t in steps] if steps is not None else [1.0] * self.islands

    def window(self, waited_s: float, round_s: Sequence[float], push_gap_s: Sequence[float],
               sync_s: Sequence[float]) -> float:
        """The grace window (seconds) of a buffer that reached its minimum quorum ``waited_s`` after its first
        push, from the syncer's recent measurements (seconds); inf where nothing was measured yet (the buffer
        then waits for the quorum).

        ``round``: ``grace_factor`` x the median of ``round_s`` (the islands' clamped round times).
        ``slack`` (Decoupled DiLoCo's adaptive window): ``grace_slack_fraction`` x the slack the compute
        overlap leaves, ``slack = tau x t_step - (t_quorum + t_sync)``, at least 0, where tau x t_step is
        ``grace_overlap`` x the median of ``push_gap_s`` (an island's push to its next push of the fragment,
        speed-free: every island's H follows its speed), t_quorum is ``waited_s`` and t_sync the median of
        ``sync_s`` (the transfer times :func:`transfer_s` inferred); before a gap was seen, the ``round`` window.
        """
        if self.grace_window == "slack" and push_gap_s:
            sync = statistics.median(sync_s) if sync_s else 0.0
            slack = self.grace_overlap * statistics.median(push_gap_s) - (waited_s + sync)
            return self.grace_slack_fraction * max(0.0, slack)
        return self.grace_factor * statistics.median(round_s) if round_s else math.inf

    def weight(self, island: int, tokens: float) -> float:
        """A push's merge weight before its staleness discount from its bounded ``tokens`` (one honest push's at
        most): with ``tokens_x_tokens_per_step`` times its island's declared tokens per inner step over the
        largest (Decoupled DiLoCo's tokens x tokens / steps: an island of a larger batch per step weighs more;
        the steps are the declared batch's, not a claim, so claiming fewer steps buys nothing)."""
        return tokens * self.step_share[island] if self.push_weight == "tokens_x_tokens_per_step" else tokens

    def merge(self, deltas: list[torch.Tensor], weights: list[float], segments: list[tuple[int, int, bool]],
              out: torch.Tensor | None = None) -> torch.Tensor:
        """The average of a buffer's pushes ``deltas`` (float32 (numel_p,)) with ``weights``: ``mean`` by the
        robust merge (``none``: the weighted mean), ``radial_directional`` per tensor of ``segments`` ((start,
        stop, radial) of the fragment; embeddings by the mean), after ``clip`` if the robust merge is clip."""
        if self.average == "radial_directional":
            deltas = clip_to_median_norm(deltas) if self.robust_merge == "clip" else deltas
            return segmented_mean(deltas, weights, segments, out=out)
        return robust_mean(deltas, weights, self.robust_merge, self.trim, out=out)


def transfer_s(gap_s: float, round_s: float, waited_s: float) -> float:
    """An exchange's transfer time (seconds) inferred from an island's push-to-push ``gap_s`` (the syncer's
    clock) = transfer + its previous push's wait in the buffer ``waited_s`` + its claimed pull-to-push
    ``round_s``; at least 0, so a claim can only shorten the slack window."""
    return max(0.0, gap_s - round_s - waited_s)
