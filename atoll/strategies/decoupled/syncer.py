"""The syncer of Decoupled DiLoCo: global parameters per fragment, merged from asynchronous island pushes.

Decoupled DiLoCo (arXiv:2604.21428) lets islands (learners) run on their own clocks: after its inner steps an
island *pushes* one fragment's pseudo-gradient Δ = θ_global(v) − θ_island to the syncer, tagged with the
tokens it trained on and the version v of the global fragment it started from, then *pulls* the newest
global fragment and goes on. It never waits for another island.

The syncer keeps, per fragment, the global parameters and an outer optimizer
(:class:`~atoll.algorithms.outer.OuterOptimizer`: SGD-Nesterov, float32, on the CPU) and a buffer of
accepted pushes. It merges the buffer (one outer step) when

- a **quorum** of distinct islands has pushed to it (at once), or
- the buffer's **grace window** closes: ``grace_factor`` x the median of the recent round times the
  islands measured on their own clocks (seconds from their pull to their next push), counted from the
  buffer's first push. The deadline thus follows the measured step times, so a dead or slow island holds
  a merge up by at most about one round, never indefinitely. A round time is taken once per island and
  buffer, so one island's repeated pushes do not fill the recent ones, and it is a claim clamped to what the
  syncer saw (:mod:`~atoll.strategies.decoupled.claims`): a claim of 1e300 s moves no deadline.

Decoupled DiLoCo's own rules (arXiv:2604.21428, as third-party readings describe it) are settings: a
**minimum quorum** K (``min_quorum``, default 1: the window opens at the buffer's K-th distinct island, and a
buffer short of K waits for islands, not for the clock); the **adaptive grace window** (``grace_window="slack"``,
:meth:`Syncer.grace`): ``gamma x (tau x t_step - (t_quorum + t_sync))``, at least 0, from the syncer's own
measurements (the islands' push-to-push gaps, the transfer times it infers, the buffer's wait for its quorum);
the **push weight** tokens x tokens per step (``push_weight``); and **radial-directional averaging**
(``average``: per tensor of the fragment, the mean of the pushes' norms along the normalized mean of their
directions, embeddings by the mean; :func:`~atoll.algorithms.merge.segmented_mean`, the tensors told apart by
the fragment's parameter names). Measured against the defaults in bench/out/decoupled_merge.

The merge is **token-weighted**: Δ̄ = Σ_i w_i Δ_i / Σ_i w_i over the pushes that actually contributed, with
``w_i = min(tokens_i, T_i) · (1 + s_i)^(−a)``, where ``T_i`` is one honest push of island i (its own H x
tokens per step, ``push_tokens``): an island that pushes a fragment rarely and claims the tokens of many
rounds at once weighs (and is vouched a norm for, :meth:`PushBounds.weight_tokens
<atoll.strategies.decoupled.bounds.PushBounds.weight_tokens>`) one round's at most; its tokens still count
as merged; the staleness ``s_i`` is how many outer steps of that fragment were committed since the version
the island started from. The polynomial staleness discount is FedAsync's
(Xie, Koyejo, Gupta 2019, arXiv:1903.03934, §5.2, ``s(t) = (t + 1)^(−a)``); a push staler than
``max_staleness`` is dropped, as bounded-staleness async local SGD does (Liu et al. 2024, arXiv:2401.09135,
keep the delay of pseudo-gradients small). With ``a = 0`` the merge is the plain token-weighted mean.

**Partial merges.** The mean divides by the weights of the pushes that contributed, never by the configured
count. But a merge of n < K islands is followed by merges of the others, each of whose Δ was taken from
(about) the same global version: stepping each partial mean in full moves the globals about K/n times as far
per round as synchronous DiLoCo, which overshoots with Nesterov momentum. So by default (``scale_partial``)
Δ̄ is scaled by n/K before the outer step, the share of the islands it speaks for (as FedAsync mixes a stale
update with a weight below 1). With a full quorum nothing is scaled: the step is synchronous DiLoCo's.

Every push is checked as if from a stranger before it can reach a buffer: its form, sender and freshness
(:meth:`Admission.refusal <atoll.strategies.decoupled.trust.Admission.refusal>`: an island and a fragment of
the run, a plain float32 CPU tensor of the fragment's shape with finite values, tokens > 0, a version issued
and newer than the island's last accepted push of the fragment in its session), then the bounds of
:class:`~atoll.strategies.decoupled.bounds.PushBounds`: tokens per island (within what it was granted, or
``norm_bound`` x its declared push size) and a norm that the islands' most recent pushes of the fragment
vouch for (one entry per island), whatever the islands' speeds, with a floor that the smallest pushes cannot
lower. A refused push is counted (:attr:`Syncer.rejected_updates`, by reason, and per island in
``rejected_by_island``), logged at WARNING on the ``atoll.syncer`` logger, and never touches the global
parameters; no push makes :meth:`Syncer.push` raise. An island whose pushes are all refused is
:meth:`Syncer.starved` (:mod:`~atoll.strategies.decoupled.claims`): the runtimes stop the run.

**One vote per island per merge.** A fragment's buffer holds one push per island: a newer accepted one
replaces the one waiting (``replaced_updates``; its tokens go to the ``stale`` bucket), so an island that opens
sessions itself gains no second vote (:mod:`~atoll.strategies.decoupled.trust`). A push that passes is still
a claim of its sender's: ``robust_merge`` (:func:`~atoll.algorithms.robust.robust_mean`: clipping, trimmed
mean, median) bounds what a minority of in-bound hostile islands can do to a merge; ``none`` (default) is the
token-weighted mean.

**Fairness of staleness.** Who arrives after a quorum has merged is the same island round after round when
the islands run alike (a slower link, or only the order of ties): with a tight ``max_staleness`` it would be
dropped every round while the others merge. So each island earns one commit of **staleness credit** per
fragment for every push of its dropped as stale, kept, at most ``islands``: its limit is ``max_staleness`` +
its credit. An island that is always one commit late is dropped once and merged ever after; no island is
starved, and no push is ever staler than ``max_staleness + islands``. Paying the credit back as soon as
an island pushes fresh moves the starvation to the others in turn, so it is kept.

**Token accounting.** Every token a push claims ends in one bucket per island, ``merged``, ``stale`` (or
replaced) or ``rejected`` (:mod:`~atoll.strategies.decoupled.accounting`); a forged push (``identity``) or one
naming no island is no island's claim, and in no bucket. Merges and refusals are journaled for the run events.

:meth:`Syncer.state_dict` holds all, written atomically by :meth:`Syncer.save`: a syncer restarted from
:meth:`Syncer.load` loses no committed outer step (:mod:`~atoll.strategies.decoupled.syncer_state`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from atoll.algorithms.fragments import FlatFragment, as_fragments, is_embedding
from atoll.algorithms.merge import segmented_mean
from atoll.algorithms.outer import OuterOptimizer
from atoll.algorithms.robust import clip_to_median_norm, robust_mean
from atoll.strategies.decoupled import syncer_state
from atoll.strategies.decoupled.accounting import syncer_stats
from atoll.strategies.decoupled.bounds import WINDOW, PushBounds
from atoll.strategies.decoupled.buffer import Buffer, Pending
from atoll.strategies.decoupled.claims import round_time, since_last_push, starved, starved_message
from atoll.strategies.decoupled.journal import Journal
from atoll.strategies.decoupled.protocol import Pull, Push, PushResult, is_index
from atoll.strategies.decoupled.trust import Admission

log = logging.getLogger("atoll.syncer")

#: the buckets of the tokens pushed, per island (:meth:`Syncer.stats`)
OUTCOMES = ("merged", "stale", "rejected")
#: how a buffer's pushes are averaged (``average``), weighed (``push_weight``), and how long it waits (``grace_window``)
AVERAGES = ("mean", "radial_directional")
PUSH_WEIGHTS = ("tokens", "tokens_x_tokens_per_step")
GRACE_WINDOWS = ("round", "slack")


class Syncer:
    """Global parameters per fragment, merged asynchronously from validated, token-weighted island pushes.

    Args:
        init: the initial global parameters, flat (numel,), any float dtype (held as float32 on the CPU).
        index: per fragment, its ranges of the flat vector (:class:`~atoll.algorithms.fragments.FlatFragment`)
            or its int64 ascending flat positions (:func:`~atoll.algorithms.fragments.as_fragments`); None: one
            fragment of all of ``init``.
        islands: number of islands that may push (K).
        outer_lr: outer learning rate; ``outer_momentum``: Nesterov momentum (0: plain SGD).
        quorum: distinct islands whose pushes merge a fragment at once; default every island (``K``): with
            failures, the grace window closes and merges those that pushed.
        grace_factor: the grace window is this times the median recent round time (seconds).
        max_staleness: pushes staler than this many committed versions (plus the island's staleness credit,
            see the module docstring) are dropped (counted in ``stale_updates``, not in ``rejected_updates``).
        staleness_exponent: a in the staleness discount ``(1 + s)^(−a)``; 0 disables it.
        norm_bound: the factor of the token and norm bounds (:class:`~atoll.strategies.decoupled.bounds.PushBounds`).
        scale_partial: scale the merged Δ̄ of n < K distinct islands by n / K before the outer step (see
            the module docstring); False: every merge steps with the full mean.
        push_tokens: per island, the tokens of one honest push at its own H, the token bound until the runtime
            opens a ledger (:meth:`grant`), and always the most one push weighs in a merge and is vouched a norm
            for (banked tokens buy nothing more); None: none declared (a push weighs all it claims).
        credentials: per island its secret (:class:`~atoll.strategies.decoupled.trust.Admission`); None: none.
        robust_merge, trim: :func:`~atoll.algorithms.robust.robust_mean`'s method and trimmed fraction per end.
        cold_bound: the norm bound before a round of pushes, times the fragment's parameter norm (None: norm_bound).
        max_round_s: the longest round time a push may claim, seconds, where the syncer has not seen the
            island push the fragment before (None: no ceiling); see :meth:`round_time`.
        starve_after: an island whose last this many pushes were all refused (and none accepted since) is
            :meth:`starved`: the runtime stops the run (its pushes would never train the model).
        min_quorum: the fewest distinct islands a merge takes (Decoupled DiLoCo's minimum quorum); the grace
            window opens when a buffer holds this many (1: at its first push).
        grace_window: ``round`` (``grace_factor`` x the median round time) or ``slack`` (``grace_slack_fraction``
            x what the overlap leaves, :meth:`grace`).
        grace_slack_fraction: gamma of the ``slack`` window; grace_overlap: tau x t_step as a share of the
            islands' measured push-to-push round (tau / H).
        average: ``mean`` (the token-weighted mean, or ``robust_merge``'s) or ``radial_directional``
            (:func:`~atoll.algorithms.merge.segmented_mean`: every tensor of the fragment but the embeddings by
            :func:`~atoll.algorithms.merge.radial_directional_mean`, after ``clip`` if ``robust_merge`` is clip).
        push_weight: ``tokens`` or ``tokens_x_tokens_per_step`` (a push's tokens times its island's tokens per
            inner step, ``step_tokens``, over the largest).
        step_tokens: per island, its tokens per inner step (its batch x sequence length), declared; None: equal.

    Raises:
        ValueError: a quorum outside ``1..islands`` or a minimum quorum outside ``1..quorum``, an index that does
            not fit ``init``, credentials or step tokens that are not one per island, an unknown ``average``,
            ``push_weight`` or ``grace_window``, or ``radial_directional`` with a coordinate-wise robust merge.
    """

    def __init__(self, init: torch.Tensor, index: Sequence[FlatFragment | torch.Tensor] | None, islands: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, quorum: int | None = None,
                 grace_factor: float = 1.0, max_staleness: int = 4, staleness_exponent: float = 0.5,
                 norm_bound: float = 10.0, scale_partial: bool = True, push_tokens: Sequence[int] | None = None,
                 credentials: Sequence[str] | None = None, robust_merge: str = "none", trim: float = 0.25,
                 cold_bound: float | None = None, max_round_s: float | None = None,
                 starve_after: int = 16, min_quorum: int = 1, grace_window: str = "round",
                 grace_slack_fraction: float = 0.5, grace_overlap: float = 1.0, average: str = "mean",
                 push_weight: str = "tokens", step_tokens: Sequence[int] | None = None) -> None:
        flat = init.detach().reshape(-1).to("cpu", torch.float32)
        self.index = as_fragments(index, flat.numel())
        self.islands = islands
        self.quorum = quorum if quorum is not None else islands
        if not 1 <= self.quorum <= islands:
            raise ValueError(f"quorum {self.quorum} outside 1..{islands}")
        if not 1 <= min_quorum <= self.quorum:
            raise ValueError(f"min_quorum {min_quorum} outside 1..{self.quorum} (the quorum)")
        for name, value, known in (("average", average, AVERAGES), ("push_weight", push_weight, PUSH_WEIGHTS),
                                   ("grace_window", grace_window, GRACE_WINDOWS)):
            if value not in known:
                raise ValueError(f"{name}: unknown '{value}'; use one of {', '.join(known)}")
        if average == "radial_directional" and robust_merge not in ("none", "clip"):
            raise ValueError(f"average: radial_directional merges norms and directions, {robust_merge} merges "
                             "coordinates; use robust_merge none or clip with it")
        if step_tokens is not None and (len(step_tokens) != islands or min(step_tokens) <= 0):
            raise ValueError(f"step_tokens: one positive count per island needed, got {list(step_tokens)}")
        self.min_quorum, self.grace_window, self.average, self.push_weight = min_quorum, grace_window, average, \
            push_weight
        self.grace_slack_fraction, self.grace_overlap = grace_slack_fraction, grace_overlap
        most = max(step_tokens) if step_tokens is not None else 1
        self.step_share = [t / most for t in step_tokens] if step_tokens is not None else [1.0] * islands
        self.grace_factor, self.max_staleness = grace_factor, max_staleness
        self.staleness_exponent, self.norm_bound = staleness_exponent, norm_bound
        self.scale_partial, self.robust_merge, self.trim = scale_partial, robust_merge, trim
        self.numel = flat.numel()
        self.numels = [f.numel() for f in self.index]  # per fragment
        self.outer = [OuterOptimizer(f.gather(flat), outer_lr, outer_momentum) for f in self.index]
        self.buffers = [Buffer() for _ in self.index]
        # per fragment, its tensors (start, stop, merged radial-directionally: not an embedding)
        self.segments = [[(a, b, not is_embedding(name)) for a, b, name in f.tensor_segments()] for f in self.index]
        self.bounds = PushBounds(islands, len(self.index), norm_bound, push_tokens, cold_bound)
        self.admission = Admission(islands, len(self.index), credentials)
        self.stale_credit = [[0] * len(self.index) for _ in range(islands)]  # per island and fragment
        self.round_s: deque[float] = deque(maxlen=WINDOW)
        self.push_gap_s: deque[float] = deque(maxlen=WINDOW)  # push to next push of an island, the syncer's clock
        self.sync_s: deque[float] = deque(maxlen=WINDOW)      # an exchange's transfer time, as inferred
        self.last_wait: list[list[float | None]] = [[None] * len(self.index) for _ in range(islands)]
        self.max_round_s = max_round_s
        self.last_push_at: list[list[float | None]] = [[None] * len(self.index) for _ in range(islands)]
        self.starve_after = starve_after
        self.refused_in_a_row = [0] * islands  # per island: pushes refused since its last accepted one
        # statistics (all in state_dict)
        self.rejected_updates = 0
        self.rejected_by_reason: dict[str, int] = {}
        self.stale_updates = 0
        self.replaced_updates = 0  # accepted pushes replaced in their buffer by a newer one of the same island
        self.accepted_updates = 0
        self.commits = 0
        self.quorum_sizes: list[int] = []   # distinct islands merged by each commit
        self.staleness: list[int] = []      # staleness of every merged push
        # per island, times fragment share: the one count of merged tokens (merged_tokens and
        # merged_tokens_per_island are derived from its "merged" bucket)
        self.tokens_by_outcome = {k: [0.0] * islands for k in OUTCOMES}
        self.merge_waits: list[tuple[float, float]] = []  # per timed merge: (seconds waited, grace window; -1: none)
        self.merge_s = 0.0  # seconds spent computing merged Δ̄s (the robust merge's cost)
        self._means = [torch.empty(n) for n in self.numels]  # per fragment: where its Δ̄ is summed (lazy pages)
        self.journal = Journal()  # its merges and refusals, for the run events; drained by the runtime, not saved

    @property
    def merged_tokens_per_island(self) -> list[float]:
        """Per island, the tokens of its merged pushes, each times its fragment's share of the parameters
        (float tokens): ``tokens_by_outcome["merged"]`` (the summary's ``merged_tokens_by_island``), the one
        count of merged tokens."""
        return self.tokens_by_outcome["merged"]

    @property
    def merged_tokens(self) -> float:
        """The tokens of every merged push, each times its fragment's share (float tokens; the runs'
        ``useful_tokens``): the sum over islands of :attr:`merged_tokens_per_island`."""
        return float(sum(self.tokens_by_outcome["merged"]))

    # --- islands' side ------------------------------------------------------------------------------
    @property
    def fragments(self) -> int:
        return len(self.index)

    def version(self, fragment: int) -> int:
        """Outer steps committed to ``fragment`` so far."""
        return self.outer[fragment].version

    def pull(self, fragment: int) -> Pull:
        """The newest global fragment: a float32 copy (numel_p,) and its version."""
        return Pull(fragment, self.outer[fragment].params.detach().clone(), self.outer[fragment].version)

    def global_params(self) -> torch.Tensor:
        """All global parameters, a flat float32 CPU vector (numel,), in the order of ``init``."""
        flat = torch.empty(self.numel, dtype=torch.float32)
        for frag, outer in zip(self.index, self.outer, strict=True):
            frag.scatter_(flat, outer.params.detach())
        return flat

    def push(self, msg: Push, now: float = 0.0) -> PushResult:
        """Offer one fragment's pseudo-gradient; validate it, buffer it, and merge if a quorum is reached.

        Args:
            msg: the push (island, fragment, Δ = θ_global(base_version) − θ_island as float32 (numel_p,),
                tokens, base version, and the island's measured round time in seconds).
            now: the time of the push, seconds (simulated or real), for the grace window.

        Returns:
            A :class:`~atoll.strategies.decoupled.protocol.PushResult` (never raises for what ``msg`` holds);
            accepted: it entered the buffer, replacing the island's push waiting there if any.
        """
        self.journal.clock = now
        if not isinstance(msg, Push):  # not a push at all (a runtime that deserializes anything it is sent)
            self._refuse(None, None, "type", None)
            return PushResult(False, "type")
        island, fragment, delta, tokens, base_version = (msg.island, msg.fragment, msg.delta, msg.tokens,
                                                         msg.base_version)
        warm = is_index(fragment, self.fragments) and self.bounds.warm(fragment)
        observed = since_last_push(self.last_push_at, island, fragment, now)
        reason = self.admission.refusal(msg, self.numels, [o.version for o in self.outer]) or self.bounds.check(
            island, fragment, float(delta.detach().norm()), tokens, self.outer[fragment].params_norm())
        if reason:
            self._refuse(island, fragment, reason, tokens)
            return PushResult(False, reason)
        self.last_push_at[island][fragment] = now  # its own push (its identity checked): the syncer's clock
        if warm:  # checked for good (a cold push is vetted at its merge, and counts there)
            self.refused_in_a_row[island] = 0
        self.admission.accepted(island, fragment, base_version, msg.session)
        if not self._fresh_enough(island, fragment, self.version(fragment) - base_version, tokens):
            return PushResult(False, "stale")
        self.accepted_updates += 1
        buf = self.buffers[fragment]
        pending = Pending(island, delta.detach().clone(), int(tokens), int(base_version), warm, now)
        if mine := [j for j, p in enumerate(buf.pushes) if p.island == island]:  # one vote per island per merge
            replaced, buf.pushes[mine[0]] = buf.pushes[mine[0]], pending
            self.replaced_updates += 1
            self._count("stale", island, fragment, replaced.tokens)
            return PushResult(True)
        r = self.round_time(msg.round_s, observed)
        self.measure(island, fragment, r, observed)  # once per island and buffer
        if not buf.pushes:
            buf.first_at = now
        buf.pushes.append(pending)
        if len(buf.pushes) == self.min_quorum:  # the minimum quorum is in: the grace window opens
            buf.opened_at, buf.grace_s = now, self.grace(now - buf.first_at)
        if len(buf.pushes) >= self.quorum:  # one push per island: as many distinct islands
            return PushResult(True, committed=self.commit(fragment, now))
        return PushResult(True)

    def measure(self, island: int, fragment: int, round_s: float | None, gap_s: float | None) -> None:
        """Take one push's timings for the grace windows (once per island and buffer): its clamped round time
        ``round_s`` (pull to push, :meth:`round_time`), the syncer's own ``gap_s`` since the island's previous
        push of the fragment, and from both with that push's wait in its buffer, the exchange's transfer time
        (push gap = transfer + wait + pull-to-push round; at least 0: a claim can only shorten the window)."""
        if round_s is not None:
            self.round_s.append(round_s)
        if gap_s is not None:
            self.push_gap_s.append(gap_s)
            waited = self.last_wait[island][fragment]
            if round_s is not None and waited is not None:
                self.sync_s.append(max(0.0, gap_s - round_s - waited))

    def grace(self, waited_s: float) -> float:
        """The grace window (seconds) of a buffer that reached its minimum quorum ``waited_s`` after its first
        push; inf where nothing was measured yet (the buffer then waits for the quorum).

        ``round``: ``grace_factor`` x the median recent round time. ``slack`` (Decoupled DiLoCo's adaptive
        window): ``grace_slack_fraction`` x the slack the compute overlap leaves,
        ``slack = tau x t_step - (t_quorum + t_sync)``, at least 0, where tau x t_step is ``grace_overlap`` x the
        median push-to-push round the syncer saw (speed-free: every island's H follows its speed), t_quorum is
        ``waited_s`` and t_sync the median transfer time inferred by :meth:`measure`; before a round was seen,
        the ``round`` window.
        """
        if self.grace_window == "slack" and self.push_gap_s:
            sync_s = statistics.median(self.sync_s) if self.sync_s else 0.0
            slack = self.grace_overlap * statistics.median(self.push_gap_s) - (waited_s + sync_s)
            return self.grace_slack_fraction * max(0.0, slack)
        return self.grace_factor * statistics.median(self.round_s) if self.round_s else math.inf

    def round_time(self, claimed: Any, observed: float | None) -> float | None:
        """The round time (seconds) a push's claim ``claimed`` is taken as for the grace window, or None:
        clamped to ``observed`` or ``max_round_s`` (:func:`~atoll.strategies.decoupled.claims.round_time`)."""
        return round_time(claimed, observed, self.max_round_s)

    def starved(self) -> list[int]:
        """Islands whose last ``starve_after`` pushes were all refused, none accepted since: the runtime stops
        the run with :meth:`starved_message` (:func:`~atoll.strategies.decoupled.claims.starved`)."""
        return starved(self.refused_in_a_row, self.starve_after)

    def starved_message(self) -> str:
        """One line for a run that stops because of :meth:`starved` islands: who, why, and what to do."""
        return starved_message(self.starved(), self.admission.rejected_by_island, self.starve_after)

    def rejoin(self, island: int) -> int:
        """``island`` (re)joins from the newest global parameters: its new session (its pushes' ``session``)."""
        return self.admission.rejoin(island)

    def grant(self, island: int, tokens: int) -> None:
        """The runtime gave ``island`` ``tokens`` more to train on: the ledger of its claims (:class:`PushBounds`)."""
        self.bounds.grant(island, tokens)

    def grant_since_checkpoint(self, tokens: Sequence[int]) -> None:
        """Restarted from a checkpoint: ``tokens[i]`` granted to island i since (:class:`PushBounds` reopen)."""
        self.bounds.reopen(tokens)

    def _refuse(self, island: Any, fragment: Any, reason: str, tokens: Any) -> None:
        """Count and log a refused push (per island if it names one; its tokens if its island's, not forged)."""
        named = is_index(island, self.islands)
        if named:
            self.admission.rejected(island, reason)
            if reason not in ("identity", "replay"):  # its own pushes (a stranger's or a copy say nothing)
                self.refused_in_a_row[island] += 1
        self.rejected_updates += 1
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
        log.warning("syncer: rejected a push of island %r, fragment %r: %s", island, fragment, reason)
        self.journal.refused(island, fragment, reason)
        if named and reason != "identity" and is_index(fragment, self.fragments) and is_index(tokens, math.inf):
            self._count("rejected", island, fragment, tokens)

    def _fresh_enough(self, island: int, fragment: int, staleness: int, tokens: int) -> bool:
        """Within the island's staleness limit (``max_staleness`` + its credit)? Drops (and credits) it if not."""
        credit = self.stale_credit[island][fragment]
        if staleness <= self.max_staleness + credit:
            return True
        self.stale_updates += 1
        self.stale_credit[island][fragment] = min(credit + 1, self.islands)
        self._count("stale", island, fragment, tokens)
        return False

    def _count(self, outcome: str, island: int, fragment: int, tokens: int) -> None:
        self.tokens_by_outcome[outcome][island] += tokens * self.numels[fragment] / self.numel

    # --- merging ------------------------------------------------------------------------------------
    def next_deadline(self) -> tuple[float, int] | None:
        """(time, fragment) of the earliest grace window that will close, or None if no buffer is open."""
        open_ = [(b.opened_at + b.grace_s, p) for p, b in enumerate(self.buffers) if b.pushes]
        return min(open_) if open_ else None

    def poll(self, now: float) -> int:
        """Merge every buffer whose grace window has closed by ``now``; return the outer steps committed."""
        done = 0
        for p, b in enumerate(self.buffers):
            if b.pushes and b.opened_at + b.grace_s <= now:
                done += self.commit(p, now)
        return done

    def commit(self, fragment: int, now: float | None = None) -> int:
        """Merge the fragment's buffer now: one outer step with the token-weighted mean Δ; 1 if it stepped.

        ``now`` (seconds, the clock of :meth:`push`): when given, the buffer's wait (from its first push to
        this merge) and its grace window are recorded in ``merge_waits`` for :meth:`stats`.

        Pushes that turned staler than ``max_staleness`` while buffered are dropped; if none is left, the
        buffer is emptied and nothing steps (a zero Δ would still move the outer momentum).
        """
        buf = self.buffers[fragment]
        pushes, self.buffers[fragment] = buf.pushes, Buffer()
        if now is not None and pushes:
            opened = len(pushes) >= self.min_quorum  # the window's wait (short of the minimum quorum: from the first)
            self.merge_waits.append((now - (buf.opened_at if opened else buf.first_at),
                                     buf.grace_s if math.isfinite(buf.grace_s) else -1.0))
            for p in pushes:
                self.last_wait[p.island][fragment] = now - p.arrived_at
        if not all(p.vetted for p in pushes):  # accepted before the fragment had a history: vetted now
            ok = self.bounds.vet(fragment, [(p.island, float(p.delta.norm()), p.tokens, p.vetted) for p in pushes])
            for p in (p for p, good in zip(pushes, ok, strict=True) if not good):
                self._refuse(p.island, fragment, "norm", p.tokens)
            pushes = [p for p, good in zip(pushes, ok, strict=True) if good]
        version = self.version(fragment)
        kept, weights, stale = [], [], []
        for p in pushes:
            s = version - p.base_version
            if s > self.max_staleness and not self._fresh_enough(p.island, fragment, s, p.tokens):
                continue
            kept.append(p)  # weighed by one round's tokens at most: banked tokens buy no weight
            weights.append(self.weight(p.island, p.tokens) * (1.0 + s) ** (-self.staleness_exponent))
            stale.append(s)
        if not kept:
            return 0
        t0 = time.perf_counter()
        if self.average == "radial_directional":  # per tensor: norms and directions; embeddings: the mean
            deltas = [p.delta for p in kept]
            deltas = clip_to_median_norm(deltas) if self.robust_merge == "clip" else deltas
            mean = segmented_mean(deltas, weights, self.segments[fragment], out=self._means[fragment])
        else:
            mean = robust_mean([p.delta for p in kept], weights, self.robust_merge, self.trim,
                               out=self._means[fragment])  # none: weighted_mean
        self.merge_s += time.perf_counter() - t0
        contributors = len({p.island for p in kept})
        if self.scale_partial and contributors < self.islands:
            mean = mean * (contributors / self.islands)
        self.outer[fragment].step(mean)
        self.journal.merged(fragment, self.version(fragment), {p.island for p in kept}, now)
        self.commits += 1
        self.quorum_sizes.append(contributors)
        self.staleness += stale
        for p in kept:
            self.refused_in_a_row[p.island] = 0
            self._count("merged", p.island, fragment, p.tokens)
        return 1

    def weight(self, island: int, tokens: int) -> float:
        """A push's merge weight before its staleness discount: its :meth:`PushBounds.weight_tokens
        <atoll.strategies.decoupled.bounds.PushBounds.weight_tokens>` (one honest push's tokens at most), and with
        ``push_weight`` ``tokens_x_tokens_per_step`` times its island's declared tokens per inner step over the
        largest (Decoupled DiLoCo's tokens x tokens / steps: an island of a larger batch per step weighs more;
        the steps are the declared batch's, not a claim, so claiming fewer steps buys nothing)."""
        w = float(self.bounds.weight_tokens(island, tokens))
        return w * self.step_share[island] if self.push_weight == "tokens_x_tokens_per_step" else w

    def flush(self) -> int:
        """Merge every open buffer now (end of training); return the outer steps committed."""
        return sum(self.commit(p) for p, b in enumerate(self.buffers) if b.pushes)

    # --- statistics and state -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counts for the run summary (:func:`~atoll.strategies.decoupled.accounting.syncer_stats`)."""
        return syncer_stats(self)

    def state_dict(self) -> dict[str, Any]:
        """Everything: globals and outer momentum per fragment, open buffers, medians, statistics."""
        return syncer_state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (into a syncer built with the same shapes and settings)."""
        syncer_state.load_state_dict(self, state)

    def save(self, folder: Path, keep: int = 2, extra: dict[str, Any] | None = None) -> Path:
        """Write :meth:`state_dict` atomically to ``folder/checkpoints/step_<commits>/``, return that path
        (``extra``: a runtime's own entries beside ``"syncer"``; :mod:`~atoll.strategies.decoupled.syncer_state`)."""
        return syncer_state.save(self, folder, keep, extra)

    def load(self, folder: Path) -> None:
        """Restore the newest complete checkpoint written by :meth:`save` under ``folder``; raises
        :class:`~atoll.errors.CheckpointError` where it holds no readable syncer checkpoint."""
        syncer_state.load(self, folder)
