"""The syncer of Decoupled DiLoCo: global parameters per fragment, merged from asynchronous island pushes.

Decoupled DiLoCo (arXiv:2604.21428) lets islands (learners) run on their own clocks: an island *pushes* one
fragment's pseudo-gradient Δ = θ_global(v) − θ_island with its tokens and the version v it started from,
then *pulls* the newest global fragment and goes on, never waiting for another island.

The syncer keeps, per fragment, the global parameters and an outer optimizer
(:class:`~atoll.algorithms.outer.OuterOptimizer`: SGD-Nesterov, float32, on the CPU) and a buffer of
accepted pushes. It merges the buffer (one outer step) when

- a **quorum** of distinct islands has pushed to it (at once), or
- the buffer's **grace window** closes, opened at its minimum quorum of islands and as long as the
  measured timings say (:mod:`~atoll.strategies.decoupled.merge_rules`, with Decoupled DiLoCo's other rules:
  tokens x tokens per step, radial-directional averaging), so a dead or slow island never holds a merge up
  indefinitely. A timing is taken once per island and buffer, and a claim is clamped to what the syncer saw
  (:mod:`~atoll.strategies.decoupled.claims`): a claim of 1e300 s moves no deadline.

The merge is **token-weighted**: Δ̄ = Σ_i w_i Δ_i / Σ_i w_i over the pushes that actually contributed, with
``w_i = min(tokens_i, T_i) · (1 + s_i)^(−a)``, where ``T_i`` is one honest push of island i (its own H x
tokens per step, ``push_tokens``): a push claiming many rounds' tokens weighs (and is vouched a norm for,
:meth:`PushBounds.weight_tokens <atoll.strategies.decoupled.bounds.PushBounds.weight_tokens>`) one round's at
most; the staleness ``s_i`` counts the fragment's outer steps since the island's version. The discount is
FedAsync's (Xie, Koyejo, Gupta 2019, arXiv:1903.03934, §5.2, ``s(t) = (t + 1)^(−a)``); a push staler than
``max_staleness`` is dropped, as bounded-staleness async local SGD does (Liu et al. 2024, arXiv:2401.09135).
The average itself is the merge rules' (:mod:`~atoll.strategies.decoupled.merge_rules`).

**Partial merges.** The mean divides by the weights of the pushes that contributed, never by the configured
count. A merge of n < K islands is followed by merges of the others from (about) the same version: each
stepped in full moves the globals about K/n times as far per round as synchronous DiLoCo, which overshoots
with Nesterov momentum. So by default (``scale_partial``) Δ̄ is scaled by n/K, the share of the islands it
speaks for (as FedAsync mixes a stale update with a weight below 1); a full quorum's step is DiLoCo's.

Every push is checked as if from a stranger before it can reach a buffer: its form, sender and freshness
(:meth:`Admission.refusal <atoll.strategies.decoupled.trust.Admission.refusal>`), then its tokens and a norm
the islands' most recent pushes of the fragment vouch for (:class:`~atoll.strategies.decoupled.bounds.PushBounds`).
A refused push is counted (by reason and island), logged at WARNING on ``atoll.syncer``, never touches the
globals, never makes :meth:`Syncer.push` raise; an island refused throughout is :meth:`Syncer.starved`.

**One vote per island per merge.** A fragment's buffer holds one push per island: a newer accepted one
replaces the one waiting (``replaced_updates``; its tokens go to ``stale``), so sessions buy no second vote
(:mod:`~atoll.strategies.decoupled.trust`). ``robust_merge`` (:func:`~atoll.algorithms.robust.robust_mean`)
bounds what a minority of in-bound hostile islands can do to a merge.

**Fairness of staleness.** Who arrives after a quorum has merged is the same island round after round when
the islands run alike, and a tight ``max_staleness`` would drop it every round. So each island earns one
commit of **staleness credit** per fragment for every push of its dropped as stale, kept (paying it back
moves the starvation to the others), at most ``islands``: its limit is ``max_staleness`` + its credit; no
push is ever staler than ``max_staleness + islands``.

**Token accounting.** Every token a push claims ends in one bucket per island, ``merged``, ``stale`` or
``rejected`` (:mod:`~atoll.strategies.decoupled.accounting`; a forged push's in none); merges and refusals
are journaled for the run events.

:meth:`Syncer.state_dict` holds all, written atomically by :meth:`Syncer.save`: a syncer restarted from
:meth:`Syncer.load` loses no committed outer step (:mod:`~atoll.strategies.decoupled.syncer_state`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from atoll.algorithms.finite import l2_norm
from atoll.algorithms.fragments import FlatFragment, as_fragments
from atoll.algorithms.merge import is_embedding
from atoll.algorithms.outer import OuterOptimizer
from atoll.strategies.decoupled import syncer_state
from atoll.strategies.decoupled.accounting import syncer_stats
from atoll.strategies.decoupled.bounds import WINDOW, PushBounds
from atoll.strategies.decoupled.buffer import Buffer, Pending
from atoll.strategies.decoupled.claims import round_time, since_last_push, starved, starved_message
from atoll.strategies.decoupled.downlink import Downlink
from atoll.strategies.decoupled.island_record import OUTCOMES, IslandRecord
from atoll.strategies.decoupled.journal import Journal
from atoll.strategies.decoupled.merge_rules import MergeRules, transfer_s
from atoll.strategies.decoupled.protocol import Pull, Push, PushResult, is_index
from atoll.strategies.decoupled.tallies import MergeWaits, Tally
from atoll.strategies.decoupled.trust import Admission

log = logging.getLogger("atoll.syncer")

class Syncer:
    """Global parameters per fragment, merged asynchronously from validated, token-weighted island pushes.

    Args:
        init: the initial global parameters, flat (numel,), any float dtype (held as float32 on the CPU).
        index: per fragment, its ranges (:class:`~atoll.algorithms.fragments.FlatFragment`) or int64 ascending
            flat positions (:func:`~atoll.algorithms.fragments.as_fragments`); None: one fragment of all.
        islands: number of islands that may push (K); outer_lr, outer_momentum: the outer SGD-Nesterov's.
        quorum: distinct islands whose pushes merge a fragment at once; default every island (``K``): with
            failures, the grace window closes and merges those that pushed.
        grace_factor: the grace window is this times the median recent round time (seconds).
        max_staleness: pushes staler than this many versions (plus the island's credit) are dropped as stale.
        staleness_exponent: a in the staleness discount ``(1 + s)^(−a)``; 0 disables it.
        norm_bound: the factor of the token and norm bounds (:class:`~atoll.strategies.decoupled.bounds.PushBounds`).
        scale_partial: scale the merged Δ̄ of n < K distinct islands by n / K (the module docstring).
        push_tokens: per island, the tokens of one honest push at its own H: the token bound until a ledger opens
            (:meth:`grant`), and the most one push weighs and is vouched a norm for; None: a push weighs its claim.
        credentials: per island its secret (:class:`~atoll.strategies.decoupled.trust.Admission`); None: none.
        robust_merge, trim: :func:`~atoll.algorithms.robust.robust_mean`'s method and trimmed fraction per end.
        cold_bound: the norm bound before a round of pushes, times the fragment's parameter norm (None: norm_bound).
        max_round_s: the longest round time (seconds) a first push may claim (None: none); :meth:`round_time`.
        starve_after: an island whose last this many pushes were all refused is :meth:`starved`.
        min_quorum, grace_window, grace_slack_fraction, grace_overlap, average, push_weight, step_tokens:
            Decoupled DiLoCo's merge rules (:class:`~atoll.strategies.decoupled.merge_rules.MergeRules`).
        realign: measure, at each timed merge, how far behind each of its islands arrived (:meth:`realign_share`)
            and send it with the island's answer (:meth:`take_behind`), for ``realign_pushes``.
        pull_codec, pull_block_size: what a pull carries (:class:`~atoll.strategies.decoupled.downlink.Downlink`):
            fp32, the global fragment; bf16, int8 or int4, the encoded changes since the island's version.

    Raises:
        ValueError: a quorum outside ``1..islands``, an index that does not fit ``init``, credentials that are
            not one per island, or merge rules :class:`~atoll.strategies.decoupled.merge_rules.MergeRules` refuses.
    """

    def __init__(self, init: torch.Tensor, index: Sequence[FlatFragment | torch.Tensor] | None, islands: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, quorum: int | None = None,
                 grace_factor: float = 1.0, max_staleness: int = 4, staleness_exponent: float = 0.5,
                 norm_bound: float = 10.0, scale_partial: bool = True, push_tokens: Sequence[int] | None = None,
                 credentials: Sequence[str] | None = None, robust_merge: str = "none", trim: float = 0.25,
                 cold_bound: float | None = None, max_round_s: float | None = None,
                 starve_after: int = 16, min_quorum: int = 1, grace_window: str = "round",
                 grace_slack_fraction: float = 0.5, grace_overlap: float = 1.0, average: str = "mean",
                 push_weight: str = "tokens", step_tokens: Sequence[int] | None = None,
                 realign: bool = False, pull_codec: str = "fp32", pull_block_size: int = 64) -> None:
        flat = init.detach().reshape(-1).to("cpu", torch.float32)
        self.index = as_fragments(index, flat.numel())
        self.islands = islands
        self.quorum = quorum if quorum is not None else islands
        if not 1 <= self.quorum <= islands:
            raise ValueError(f"quorum {self.quorum} outside 1..{islands}")
        self.rules = MergeRules(islands, self.quorum, min_quorum, grace_window, grace_factor, grace_slack_fraction,
                                grace_overlap, average, push_weight, step_tokens, robust_merge, trim)
        self.max_staleness = max_staleness
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
        self.per_island = [IslandRecord.new(len(self.index)) for _ in range(islands)]
        self.round_s: deque[float] = deque(maxlen=WINDOW)
        self.push_gap_s: deque[float] = deque(maxlen=WINDOW)  # push to next push of an island, the syncer's clock
        self.sync_s: deque[float] = deque(maxlen=WINDOW)      # an exchange's transfer time, as inferred
        self.max_round_s = max_round_s
        self.starve_after = starve_after
        # statistics (all in state_dict)
        self.rejected_updates = 0
        self.rejected_by_reason: dict[str, int] = {}
        self.stale_updates = 0
        self.replaced_updates = 0  # accepted pushes replaced in their buffer by a newer one of the same island
        self.accepted_updates = 0
        self.commits = 0
        self.quorum_sizes = Tally()  # distinct islands merged by each commit
        self.staleness = Tally()     # staleness of every merged push
        self.merge_waits = MergeWaits()  # per timed merge: seconds waited, grace window (-1: none)
        self.merge_s = 0.0  # seconds spent computing merged Δ̄s (the robust merge's cost)
        self._means = [torch.empty(n) for n in self.numels]  # per fragment: where its Δ̄ is summed (lazy pages)
        self.journal = Journal()  # its merges and refusals, for the run events; drained by the runtime, not saved
        self.realign = realign
        # per fragment, its last timed merge: (its first push's arrival, seconds; the islands it held)
        self.last_merge: list[tuple[float, frozenset[int]] | None] = [None] * len(self.index)
        # per island and fragment, the share of a round its last merged push arrived behind (realign_share)
        self.behind = [[0.0] * len(self.index) for _ in range(islands)]
        # what the islands pull: per fragment the shadow they hold and its last payloads (pull_codec)
        self.downlink = Downlink(pull_codec, [o.params.detach() for o in self.outer], pull_block_size)

    @property
    def tokens_by_outcome(self) -> dict[str, list[float]]:
        """Per outcome (:data:`OUTCOMES`), per island in index order, its pushed tokens times their fragments'
        shares (float tokens): a view of the records' one count (:attr:`IslandRecord.tokens`)."""
        return {k: [r.tokens[k] for r in self.per_island] for k in OUTCOMES}

    @property
    def merged_tokens_per_island(self) -> list[float]:
        """Per island, the tokens of its merged pushes, each times its fragment's share of the parameters
        (float tokens): the records' ``tokens["merged"]`` (the summary's ``merged_tokens_by_island``), the one
        count of merged tokens."""
        return [r.tokens["merged"] for r in self.per_island]

    @property
    def merged_tokens(self) -> float:
        """The tokens of every merged push, each times its fragment's share (float tokens; the runs'
        ``useful_tokens``): the sum over islands of :attr:`merged_tokens_per_island`."""
        return float(sum(r.tokens["merged"] for r in self.per_island))

    # --- islands' side ------------------------------------------------------------------------------
    @property
    def fragments(self) -> int:
        return len(self.index)

    def version(self, fragment: int) -> int:
        """Outer steps committed to ``fragment`` so far."""
        return self.outer[fragment].version

    def pull(self, fragment: int, have: int | None = None) -> Pull:
        """The newest global fragment at its version, for an island that holds version ``have`` of it (its push's
        base version; None: unknown): with ``pull_codec`` fp32 a float32 copy (numel_p,) of G; else the encoded
        changes since ``have``, or the shadow Q in float32 where they are not kept
        (:meth:`Downlink.pull <atoll.strategies.decoupled.downlink.Downlink.pull>`)."""
        return self.downlink.pull(fragment, self.outer[fragment].params, self.outer[fragment].version, have)

    def pulled_params(self) -> torch.Tensor:
        """What an up-to-date island holds of every fragment, flat float32 (numel,) in the order of ``init``:
        :meth:`global_params` with ``pull_codec`` fp32, else the shadows Q (an island (re)joins from these)."""
        if self.downlink.shadow is None:
            return self.global_params()
        flat = torch.empty(self.numel, dtype=torch.float32)
        for frag, q in zip(self.index, self.downlink.shadow, strict=True):
            frag.scatter_(flat, q)
        return flat

    def take_behind(self, island: int, fragment: int) -> float:
        """With ``realign``: how far behind (:meth:`realign_share`) ``island``'s push of ``fragment`` merged
        last arrived, for the answer to it (a :class:`Pull`'s ``realign``); said once (then 0), so a later
        answer (to a refused push) does not repeat it. 0.0 without ``realign``."""
        behind, self.behind[island][fragment] = self.behind[island][fragment], 0.0
        return behind

    def realign_share(self, previous: tuple[float, frozenset[int]] | None, merged: frozenset[int], island: int,
                      arrived_at: float) -> float:
        """How far behind the fragment's previous merge ``island``'s push that arrived at ``arrived_at``
        (seconds) and was merged with the islands ``merged`` is, as a share of a round in [0, 1); 0: in phase.

        The islands push each fragment at one wall cadence (their H proportional to their speed), so a round is
        the median push-to-push time the syncer saw (``push_gap_s``). The push is behind when the ``previous``
        merge (its first arrival, its islands) did not hold its island, held more islands than this one (or as
        many, the lowest island index among them: of two equal groups exactly one moves, so they never swap
        phases for ever), and began less than a round before it. Not in Decoupled DiLoCo (arXiv:2604.21428)
        nor Streaming DiLoCo (arXiv:2501.18512), whose islands keep their schedule's phase: a stopped or
        restarted island otherwise splits every merge of a fragment in two for the rest of the run
        (bench/out/service_soak, the context).
        """
        if previous is None or not self.push_gap_s:
            return 0.0
        first, held = previous
        period = sorted(self.push_gap_s)[len(self.push_gap_s) // 2]
        lag = arrived_at - first
        if island in held or period <= 0 or not 0 < lag < period:
            return 0.0
        return lag / period if len(held) > len(merged) or (len(held) == len(merged) and min(held) < min(merged)) \
            else 0.0

    def global_params(self) -> torch.Tensor:
        """All global parameters, a flat float32 CPU vector (numel,), in the order of ``init``."""
        flat = torch.empty(self.numel, dtype=torch.float32)
        for frag, outer in zip(self.index, self.outer, strict=True):
            frag.scatter_(flat, outer.params.detach())
        return flat

    def push(self, msg: Push, now: float = 0.0, *, norm: float | None = None, owned: bool = False) -> PushResult:
        """Offer one fragment's pseudo-gradient; validate it, buffer it, and merge if a quorum is reached.

        Args:
            msg: the push (island, fragment, Δ = θ_global(base_version) − θ_island as float32 (numel_p,),
                tokens, base version, and the island's measured round time in seconds).
            now: the time of the push, seconds (simulated or real), for the grace window.
            norm, owned: the receiving runtime's own facts about ``msg.delta``, never part of an island's message
                (the syncer service's server decoded it: its L2 norm, taken outside the server's lock; ``owned``,
                a tensor made for this push alone, buffered without a copy). Defaults: the norm computed here,
                the tensor copied (an island's own, which it may reuse).

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
        observed = since_last_push([r.last_push_at for r in self.per_island], island, fragment, now)
        reason = self.admission.refusal(msg, self.numels, [o.version for o in self.outer]) or self.bounds.check(
            island, fragment, l2_norm(delta) if norm is None else norm, tokens,
            self.outer[fragment].params_norm())
        if reason:
            self._refuse(island, fragment, reason, tokens)
            return PushResult(False, reason)
        self.per_island[island].last_push_at[fragment] = now  # its own push (its identity checked): the syncer's clock
        if warm:  # checked for good (a cold push is vetted at its merge, and counts there)
            self.per_island[island].refused_in_a_row = 0
        self.admission.accepted(island, fragment, base_version, msg.session)
        if not self._fresh_enough(island, fragment, self.version(fragment) - base_version, tokens):
            return PushResult(False, "stale")
        self.accepted_updates += 1
        buf = self.buffers[fragment]
        pending = Pending(island, delta.detach() if owned else delta.detach().clone(), int(tokens),
                          int(base_version), warm, now)
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
        if len(buf.pushes) == self.rules.min_quorum:  # the minimum quorum is in: the grace window opens
            buf.opened_at, buf.grace_s = now, self.grace(now - buf.first_at)
        if len(buf.pushes) >= self.quorum:  # one push per island: as many distinct islands
            return PushResult(True, committed=self.commit(fragment, now))
        return PushResult(True)

    def measure(self, island: int, fragment: int, round_s: float | None, gap_s: float | None) -> None:
        """Take one push's timings for the grace windows (once per island and buffer): its clamped round time
        ``round_s`` (:meth:`round_time`), the syncer's own ``gap_s`` since the island's previous push of the
        fragment, and from both with its previous wait in the buffer, the transfer time (:func:`transfer_s`)."""
        if round_s is not None:
            self.round_s.append(round_s)
        if gap_s is not None:
            self.push_gap_s.append(gap_s)
            waited = self.per_island[island].last_wait[fragment]
            if round_s is not None and waited is not None:
                self.sync_s.append(transfer_s(gap_s, round_s, waited))

    def grace(self, waited_s: float) -> float:
        """The grace window (seconds) of a buffer that reached its minimum quorum ``waited_s`` after its first
        push, from the recent timings (:meth:`MergeRules.window
        <atoll.strategies.decoupled.merge_rules.MergeRules.window>`); inf: nothing measured yet."""
        return self.rules.window(waited_s, self.round_s, self.push_gap_s, self.sync_s)

    def round_time(self, claimed: Any, observed: float | None) -> float | None:
        """The round time (seconds) a push's claim ``claimed`` is taken as for the grace window, or None:
        clamped to ``observed`` or ``max_round_s`` (:func:`~atoll.strategies.decoupled.claims.round_time`)."""
        return round_time(claimed, observed, self.max_round_s)

    def starved(self) -> list[int]:
        """Islands whose last ``starve_after`` pushes were all refused, none accepted since: the runtime stops
        the run with :meth:`starved_message` (:func:`~atoll.strategies.decoupled.claims.starved`)."""
        return starved([r.refused_in_a_row for r in self.per_island], self.starve_after)

    def starved_message(self) -> str:
        """One line for a run that stops because of :meth:`starved` islands: who, why, and what to do."""
        return starved_message(self.starved(), self.admission.rejected_by_island, self.starve_after)

    def rejoin(self, island: int) -> int:
        """``island`` (re)joins from the newest global parameters: its new session (its pushes' ``session``).
        Its realignment shares (:meth:`take_behind`) are forgotten: they measured the old session's phase, and
        the new one starts its rounds at the join."""
        self.behind[island] = [0.0] * len(self.index)
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
                self.per_island[island].refused_in_a_row += 1
        self.rejected_updates += 1
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
        log.warning("syncer: rejected a push of island %r, fragment %r: %s", island, fragment, reason)
        self.journal.refused(island, fragment, reason)
        if named and reason != "identity" and is_index(fragment, self.fragments) and is_index(tokens, math.inf):
            self._count("rejected", island, fragment, tokens)

    def _fresh_enough(self, island: int, fragment: int, staleness: int, tokens: int) -> bool:
        """Within the island's staleness limit (``max_staleness`` + its credit)? Drops (and credits) it if not."""
        credit = self.per_island[island].stale_credit[fragment]
        if staleness <= self.max_staleness + credit:
            return True
        self.stale_updates += 1
        self.per_island[island].stale_credit[fragment] = min(credit + 1, self.islands)
        self._count("stale", island, fragment, tokens)
        return False

    def _count(self, outcome: str, island: int, fragment: int, tokens: int) -> None:
        self.per_island[island].tokens[outcome] += tokens * self.numels[fragment] / self.numel

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
            opened = len(pushes) >= self.rules.min_quorum  # its window's wait (short of K: from the first push)
            self.merge_waits.add(now - (buf.opened_at if opened else buf.first_at),
                                 buf.grace_s if math.isfinite(buf.grace_s) else -1.0)
            for p in pushes:
                self.per_island[p.island].last_wait[fragment] = now - p.arrived_at
        if not all(p.vetted for p in pushes):  # accepted before the fragment had a history: vetted now
            ok = self.bounds.vet(fragment, [(p.island, l2_norm(p.delta), p.tokens, p.vetted) for p in pushes])
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
        mean = self.rules.merge([p.delta for p in kept], weights, self.segments[fragment], out=self._means[fragment])
        self.merge_s += time.perf_counter() - t0
        contributors = len({p.island for p in kept})
        if self.scale_partial and contributors < self.islands:
            mean = mean * (contributors / self.islands)
        self.outer[fragment].step(mean)
        self.downlink.commit(fragment, self.outer[fragment].params, self.version(fragment))
        if self.realign and now is not None:  # how far behind the previous merge each island arrived
            merged = frozenset(p.island for p in kept)
            for p in kept:
                self.behind[p.island][fragment] = self.realign_share(self.last_merge[fragment], merged, p.island,
                                                                           p.arrived_at)
            self.last_merge[fragment] = (min(p.arrived_at for p in kept), merged)
        self.journal.merged(fragment, self.version(fragment), {p.island for p in kept}, now)
        self.commits += 1
        self.quorum_sizes.add(contributors)
        self.staleness.extend(stale)
        for p in kept:
            self.per_island[p.island].refused_in_a_row = 0
            self._count("merged", p.island, fragment, p.tokens)
        return 1

    def weight(self, island: int, tokens: int) -> float:
        """A push's merge weight before its staleness discount: its :meth:`PushBounds.weight_tokens
        <atoll.strategies.decoupled.bounds.PushBounds.weight_tokens>` (one honest push's tokens at most) by the
        push weight rule (:meth:`MergeRules.weight <atoll.strategies.decoupled.merge_rules.MergeRules.weight>`)."""
        return self.rules.weight(island, float(self.bounds.weight_tokens(island, tokens)))

    def flush(self) -> int:
        """Merge every open buffer now (end of training); return the outer steps committed."""
        return sum(self.commit(p) for p, b in enumerate(self.buffers) if b.pushes)

    # --- statistics and state -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counts for the run summary (:func:`~atoll.strategies.decoupled.accounting.syncer_stats`)."""
        return syncer_stats(self)

    def state_dict(self, lend: bool = False) -> dict[str, Any]:
        """Everything: globals and outer momentum per fragment, open buffers, medians, statistics. ``lend``: the
        caller gives it back with :meth:`release` once written (its copies' memory is then reused)."""
        return syncer_state.state_dict(self, lend)

    def release(self, state: dict[str, Any]) -> None:
        """Give back a :meth:`state_dict` made with ``lend=True`` (its checkpoint is written, or was replaced by
        a newer one before its write): a later commit's copies may reuse its memory.

        Raises:
            ValueError: a part of it is not lent (given back twice, or not made with ``lend``); the parts after it
                are not given back (their memory is not reused), since a state given back twice would otherwise
                take the lendings of the copies it shares with newer states.
        """
        for o, st in zip(self.outer, state["outer"], strict=True):
            o.release(st)
        self.downlink.release(state["downlink"])

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
