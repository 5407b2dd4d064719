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
  buffer, so one island's repeated pushes do not fill the recent ones.

The merge is **token-weighted**: Δ̄ = Σ_i w_i Δ_i / Σ_i w_i over the pushes that actually contributed, with
``w_i = tokens_i · (1 + s_i)^(−a)``; the staleness ``s_i`` is how many outer steps of that fragment were
committed since the version the island started from. The polynomial staleness discount is FedAsync's
(Xie, Koyejo, Gupta 2019, arXiv:1903.03934, §5.2, ``s(t) = (t + 1)^(−a)``); a push staler than
``max_staleness`` is dropped, as bounded-staleness async local SGD does (Liu et al. 2024, arXiv:2401.09135,
keep the delay of pseudo-gradients small). With ``a = 0`` the merge is the plain token-weighted mean.

**Partial merges.** The mean divides by the weights of the pushes that contributed, never by the configured
count. But a merge of n < K islands is followed by merges of the others, each of whose Δ was taken from
(about) the same global version: stepping each partial mean in full moves the globals about K/n times as
far per round as synchronous DiLoCo, and with the outer Nesterov momentum (lr 0.7, momentum 0.9) that
overshoots (measured: README, "Asynchronous islands"). So by default (``scale_partial``) the merged Δ̄ is scaled by n/K before the outer step, the
share of the islands it speaks for (as FedAsync mixes a single stale update with a weight below 1). With a
full quorum (n = K) nothing is scaled, and the step is exactly synchronous DiLoCo's.

Every push is checked as if from a stranger before it can reach a buffer: its form, sender and freshness
(:meth:`Admission.refusal <atoll.strategies.decoupled.trust.Admission.refusal>`: an island and a fragment of
the run, a plain float32 CPU tensor of the fragment's shape with finite values, tokens > 0, a version issued
and newer than the island's last accepted push of the fragment in its session), then the bounds of
:class:`~atoll.strategies.decoupled.bounds.PushBounds`: tokens per island (within what it was granted, or
``norm_bound`` x its declared push size) and a norm that the islands' most recent pushes of the fragment
vouch for (one entry per island), whatever the islands' speeds. A refused push is counted
(:attr:`Syncer.rejected_updates`, by reason, and per island in ``rejected_by_island``), logged at WARNING on
the ``atoll.syncer`` logger, and never touches the global parameters; no push makes :meth:`Syncer.push` raise.

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
an island pushes fresh (tried) moves the starvation to the others in turn: 3 islands, quorum 2,
``max_staleness`` 0 (micro, 60 steps) merged 57%, 57% and 93% of their tokens, against 90%, 90% and 72% with
the credit kept (0% for the last island without any credit).

**Token accounting.** Every token a push claims ends in one bucket per island, ``merged``, ``stale`` (or
replaced) or ``rejected`` (:meth:`Syncer.stats`, :mod:`~atoll.strategies.decoupled.accounting`); a forged push
(``identity``) or one naming no island is no island's claim, and in no bucket.

:meth:`Syncer.state_dict` holds everything (globals, outer momentum, versions, buffers, statistics);
:meth:`Syncer.save` writes it atomically with :func:`atoll.job.checkpoint.save_checkpoint`, so a syncer that
restarts from :meth:`Syncer.load` loses no committed outer step.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from atoll.algorithms.fragments import FlatFragment, as_fragments
from atoll.algorithms.outer import OuterOptimizer
from atoll.algorithms.robust import robust_mean
from atoll.strategies.decoupled.accounting import syncer_stats
from atoll.strategies.decoupled.bounds import WINDOW, PushBounds
from atoll.strategies.decoupled.protocol import Pull, Push, PushResult, is_index
from atoll.strategies.decoupled.trust import Admission

log = logging.getLogger("atoll.syncer")

#: the buckets of the tokens pushed, per island (:meth:`Syncer.stats`)
OUTCOMES = ("merged", "stale", "rejected")


@dataclass
class _Pending:
    island: int
    delta: torch.Tensor
    tokens: int
    base_version: int
    vetted: bool = True  # checked against a warm window (else vetted at the merge: PushBounds.vet)


@dataclass
class _Buffer:
    pushes: list[_Pending] = field(default_factory=list)
    opened_at: float = 0.0
    grace_s: float = math.inf


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
            opens a ledger (:meth:`grant`); None: none declared.
        credentials: per island its secret (:class:`~atoll.strategies.decoupled.trust.Admission`); None: none.
        robust_merge, trim: :func:`~atoll.algorithms.robust.robust_mean`'s method and trimmed fraction per end.
        cold_bound: the norm bound before a round of pushes, times the fragment's parameter norm (None: norm_bound).

    Raises:
        ValueError: a quorum outside ``1..islands``, an index that does not fit ``init``, or credentials that
            are not one per island.
    """

    def __init__(self, init: torch.Tensor, index: Sequence[FlatFragment | torch.Tensor] | None, islands: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, quorum: int | None = None, grace_factor: float = 1.0,
                 max_staleness: int = 4, staleness_exponent: float = 0.5, norm_bound: float = 10.0,
                 scale_partial: bool = True, push_tokens: Sequence[int] | None = None,
                 credentials: Sequence[str] | None = None, robust_merge: str = "none", trim: float = 0.25,
                 cold_bound: float | None = None) -> None:
        flat = init.detach().reshape(-1).to("cpu", torch.float32)
        self.index = as_fragments(index, flat.numel())
        self.islands = islands
        self.quorum = quorum if quorum is not None else islands
        if not 1 <= self.quorum <= islands:
            raise ValueError(f"quorum {self.quorum} outside 1..{islands}")
        self.grace_factor = grace_factor
        self.max_staleness = max_staleness
        self.staleness_exponent = staleness_exponent
        self.norm_bound = norm_bound
        self.scale_partial = scale_partial
        self.robust_merge, self.trim = robust_merge, trim
        self.numel = flat.numel()
        self.numels = [f.numel() for f in self.index]  # per fragment
        self.outer = [OuterOptimizer(f.gather(flat), outer_lr, outer_momentum) for f in self.index]
        self.buffers = [_Buffer() for _ in self.index]
        self.bounds = PushBounds(islands, len(self.index), norm_bound, push_tokens, cold_bound)
        self.admission = Admission(islands, len(self.index), credentials)
        self.stale_credit = [[0] * len(self.index) for _ in range(islands)]  # per island and fragment
        self.round_s: deque[float] = deque(maxlen=WINDOW)
        # statistics (all in state_dict)
        self.rejected_updates = 0
        self.rejected_by_reason: dict[str, int] = {}
        self.stale_updates = 0
        self.replaced_updates = 0  # accepted pushes replaced in their buffer by a newer one of the same island
        self.accepted_updates = 0
        self.commits = 0
        self.quorum_sizes: list[int] = []   # distinct islands merged by each commit
        self.staleness: list[int] = []      # staleness of every merged push
        self.merged_tokens = 0.0            # tokens of merged pushes, each scaled by its fragment's share
        self.merged_tokens_per_island = [0.0] * islands
        self.tokens_by_outcome = {k: [0.0] * islands for k in OUTCOMES}  # per island, times fragment share
        self.merge_waits: list[tuple[float, float]] = []  # per timed merge: (seconds waited, grace window; -1: none)
        self.merge_s = 0.0  # seconds spent computing merged Δ̄s (the robust merge's cost)
        self._means = [torch.empty(n) for n in self.numels]  # per fragment: where its Δ̄ is summed (lazy pages)

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
        if not isinstance(msg, Push):  # not a push at all (a runtime that deserializes anything it is sent)
            self._refuse(None, None, "type", None)
            return PushResult(False, "type")
        island, fragment, delta, tokens, base_version = msg.island, msg.fragment, msg.delta, msg.tokens, msg.base_version
        warm = is_index(fragment, self.fragments) and self.bounds.warm(fragment)
        reason = self.admission.refusal(msg, self.numels, [o.version for o in self.outer]) or self.bounds.check(
            island, fragment, float(delta.detach().norm()), tokens, self.outer[fragment].params_norm())
        if reason:
            self._refuse(island, fragment, reason, tokens)
            return PushResult(False, reason)
        self.admission.accepted(island, fragment, base_version, msg.session)
        if not self._fresh_enough(island, fragment, self.version(fragment) - base_version, tokens):
            return PushResult(False, "stale")
        self.accepted_updates += 1
        buf = self.buffers[fragment]
        pending = _Pending(island, delta.detach().clone(), int(tokens), int(base_version), warm)
        if mine := [j for j, p in enumerate(buf.pushes) if p.island == island]:  # one vote per island per merge
            replaced, buf.pushes[mine[0]] = buf.pushes[mine[0]], pending
            self.replaced_updates += 1
            self._count("stale", island, fragment, replaced.tokens)
            return PushResult(True)
        if isinstance(r := msg.round_s, int | float) and not isinstance(r, bool) and 0 < r < math.inf:  # once per buffer
            self.round_s.append(float(r))
        if not buf.pushes:
            buf.opened_at = now
            buf.grace_s = self.grace_factor * statistics.median(self.round_s) if self.round_s else math.inf
        buf.pushes.append(pending)
        if len(buf.pushes) >= self.quorum:  # one push per island: as many distinct islands
            return PushResult(True, committed=self.commit(fragment, now))
        return PushResult(True)

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
        self.rejected_updates += 1
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
        log.warning("syncer: rejected a push of island %r, fragment %r: %s", island, fragment, reason)
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
        pushes, self.buffers[fragment] = buf.pushes, _Buffer()
        if now is not None and pushes:
            self.merge_waits.append((now - buf.opened_at, buf.grace_s if math.isfinite(buf.grace_s) else -1.0))
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
            kept.append(p)
            weights.append(p.tokens * (1.0 + s) ** (-self.staleness_exponent))
            stale.append(s)
        if not kept:
            return 0
        t0 = time.perf_counter()
        mean = robust_mean([p.delta for p in kept], weights, self.robust_merge, self.trim,
                           out=self._means[fragment])  # none: weighted_mean
        self.merge_s += time.perf_counter() - t0
        contributors = len({p.island for p in kept})
        if self.scale_partial and contributors < self.islands:
            mean = mean * (contributors / self.islands)
        self.outer[fragment].step(mean)
        self.commits += 1
        self.quorum_sizes.append(contributors)
        self.staleness += stale
        share = self.numels[fragment] / self.numel
        for p in kept:
            self.merged_tokens += p.tokens * share
            self.merged_tokens_per_island[p.island] += p.tokens * share
            self._count("merged", p.island, fragment, p.tokens)
        return 1

    def flush(self) -> int:
        """Merge every open buffer now (end of training); return the outer steps committed."""
        return sum(self.commit(p) for p, b in enumerate(self.buffers) if b.pushes)

    # --- statistics and state -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counts for the run summary (:func:`~atoll.strategies.decoupled.accounting.syncer_stats`)."""
        return syncer_stats(self)

    def state_dict(self) -> dict[str, Any]:
        """Everything: globals and outer momentum per fragment, open buffers, medians, statistics."""
        return {
            "outer": [o.state_dict() for o in self.outer],
            "buffers": [{"opened_at": b.opened_at, "grace_s": b.grace_s if math.isfinite(b.grace_s) else -1.0,
                         "pushes": [{"island": p.island, "delta": p.delta, "tokens": p.tokens,
                                     "base_version": p.base_version, "vetted": p.vetted} for p in b.pushes]}
                        for b in self.buffers],
            "bounds": self.bounds.state_dict(), "admission": self.admission.state_dict(), "merge_s": self.merge_s,
            "round_s": list(self.round_s),
            "stale_credit": [list(c) for c in self.stale_credit],
            "tokens_by_outcome": {k: list(v) for k, v in self.tokens_by_outcome.items()},
            "rejected_updates": self.rejected_updates, "rejected_by_reason": dict(self.rejected_by_reason),
            "stale_updates": self.stale_updates, "replaced_updates": self.replaced_updates,
            "accepted_updates": self.accepted_updates, "commits": self.commits,
            "quorum_sizes": list(self.quorum_sizes), "staleness": list(self.staleness),
            "merged_tokens": self.merged_tokens, "merged_tokens_per_island": list(self.merged_tokens_per_island),
            "merge_waits": [list(w) for w in self.merge_waits],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (into a syncer built with the same shapes and settings)."""
        for o, s in zip(self.outer, state["outer"], strict=True):
            o.load_state_dict(s)
        self.buffers = []
        for b in state["buffers"]:
            grace = float(b["grace_s"])
            self.buffers.append(_Buffer([_Pending(int(p["island"]), p["delta"], int(p["tokens"]),
                                                  int(p["base_version"]), bool(p.get("vetted", True)))
                                        for p in b["pushes"]],
                                        float(b["opened_at"]), grace if grace >= 0 else math.inf))
        self.bounds.load_state_dict(state["bounds"])
        if "admission" in state:
            self.admission.load_state_dict(state["admission"])
        self.merge_s = float(state.get("merge_s", 0.0))
        self.round_s = deque((float(x) for x in state["round_s"]), maxlen=WINDOW)
        self.stale_credit = [[int(x) for x in c] for c in state["stale_credit"]]
        self.tokens_by_outcome = {k: [float(x) for x in v] for k, v in state["tokens_by_outcome"].items()}
        for name in ("rejected_updates", "stale_updates", "accepted_updates", "commits", "replaced_updates"):
            setattr(self, name, int(state.get(name, 0)))  # replaced_updates: absent from older checkpoints
        self.rejected_by_reason = {str(k): int(v) for k, v in state["rejected_by_reason"].items()}
        self.quorum_sizes = [int(x) for x in state["quorum_sizes"]]
        self.staleness = [int(x) for x in state["staleness"]]
        self.merged_tokens = float(state["merged_tokens"])
        self.merged_tokens_per_island = [float(x) for x in state["merged_tokens_per_island"]]
        self.merge_waits = [(float(w), float(g)) for w, g in state.get("merge_waits", [])]

    def save(self, folder: Path, keep: int = 2, extra: dict[str, Any] | None = None) -> Path:
        """Write :meth:`state_dict` atomically to ``folder/checkpoints/step_<commits>/``; return that path.

        ``extra``: more entries for the same checkpoint (a runtime's own counters), beside ``"syncer"``.
        """
        from atoll.job.checkpoint import save_checkpoint

        return save_checkpoint(Path(folder), self.commits, {**(extra or {}), "syncer": self.state_dict()}, keep=keep)

    def load(self, folder: Path) -> None:
        """Restore the newest complete checkpoint written by :meth:`save` under ``folder``.

        Raises:
            CheckpointError: ``folder`` holds no readable syncer checkpoint.
        """
        from atoll.job.checkpoint import latest_checkpoint, load_checkpoint

        _, state = load_checkpoint(latest_checkpoint(Path(folder)))
        self.load_state_dict(state["syncer"])
