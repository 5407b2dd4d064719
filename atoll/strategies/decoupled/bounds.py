"""What a push may claim at the syncer of Decoupled DiLoCo: its tokens, per island, and its norm, speed-free.

Islands of different speeds push different amounts of work at the same cadence (an island at speed s takes
s·H inner steps per round, :func:`~atoll.strategies.decoupled.local_sync_every`), so nothing a push
claims may be compared with the pushes of *other* islands as if they were alike. :class:`PushBounds` holds
two bounds, each checked per push before it can reach a buffer:

- **Tokens, per island.** With a ledger (the runtime calls :meth:`PushBounds.grant` for every inner step it
  gives an island: the local simulation's event loop, and on Ray the syncer's ``reserve_step``, which only
  the island's credential opens), the tokens an island claims for a fragment, summed over its pushes (those
  later replaced in a buffer or refused for their norm included), never exceed the tokens it was granted:
  exact, whatever its speed, its deferred pushes, its failures (a failed island claims less) or the
  sessions it opens. Without one, a push may claim at most ``norm_bound`` x the island's declared push size
  (``push_tokens``: its own H x tokens per step). Refused as ``tokens``.
- **Norm, per fragment, one entry per island.** An honest pseudo-gradient's L2 norm grows with the inner
  steps behind it, at most linearly (steps all aligned) and at least not at all (a saturated random walk):
  n(k) <= n(j) max(1, k/j) for two honest pushes of k and j tokens, whatever the speeds. So the history of a
  fragment holds, per island, its most recent *accepted* push (n_j, k_j), which vouches for a push of k
  tokens up to n_j max(1, k/k_j), and a push is refused (``norm``) beyond ``norm_bound`` x the
  ``statistics.median_low`` over the islands' entries of those allowances. An island's pushes, however many
  (it may open new sessions itself, :mod:`~atoll.strategies.decoupled.trust`), only replace its own entry,
  so a minority of islands never sets the bound (with 2 islands, median_low picks the smaller entry), and
  refused pushes never enter the history, so pushes over the bound cannot raise it. The honest growth of
  the updates (a learning-rate warmup) is followed by the accepted pushes, each within ``norm_bound`` x the
  islands' previous ones. An entry stays until its island's next accepted push (a dead island's last entry
  still counts; median_low lets a minority of such entries set nothing either).

  Before a majority of distinct islands (``islands`` // 2 + 1) has an entry (a dead or hostile island never
  holds the bound cold), there is no history to compare with: a push is checked against ``cold_bound`` x
  the fragment's parameter norm only (default ``norm_bound``: an honest first push can be close to the
  parameters' own norm), and again when its buffer merges, against the pushes merged with it
  (:meth:`PushBounds.vet`: ``norm_bound`` x the median_low of their allowances; the buffer holds one push
  per island), as later pushes are against the islands' entries (a push merged alone, with a quorum of 1,
  meets the parameters' bound only). Claiming more tokens buys at most the declared size (or the ledger),
  claiming fewer buys nothing (the allowance never falls below n_j).

**Per merge, one round.** The ledger bounds the sum of an island's claims, not one push's share: an island
that pushes a fragment rarely could claim ten rounds' tokens in one push, for ten times the merge weight and
the norm allowance (5 islands, full quorum, outer lr 1: one sign-flipped push undid about 80 honest rounds).
So a push weighs, and is vouched a norm for, :meth:`PushBounds.weight_tokens`: at most one honest push of its
island (``push_tokens``), whatever it claims.

**A floor.** With an even split of the islands (2: median_low is the smaller entry) one half can lower the
median bound with tiny pushes until every push of the other half is refused. A push over the median bound
still passes within ``sqrt(norm_bound)`` x the median_high of the allowances, and then enters the history at
most at that reference, so the floor never raises an entry (:meth:`PushBounds.check`).

The history is part of :meth:`PushBounds.state_dict` (``latest``); a checkpoint written before it was kept
per island (a ``window`` of the last pushes, whoever sent them) loads with an empty history: the fragments
are cold again until a majority of islands has pushed, and the cold bound applies meanwhile.

This replaces norms per token compared with the median of recent pushes, which, across islands of unequal
speeds, refused the honest pushes of the fast (tokens) or of the slow (norm per token) islands, and a window
of the last pushes of a fragment, whoever sent them, which one island filled with its own pushes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

#: round times kept for the grace window (:class:`~atoll.strategies.decoupled.syncer.Syncer`)
WINDOW = 32


class PushBounds:
    """The token and norm bounds of the pushes of ``islands`` islands to ``fragments`` fragments.

    Args:
        islands: K; fragments: P.
        norm_bound: the factor of both bounds (> 1).
        cold_bound: the norm bound before a round of pushes was accepted, times the fragment's parameter norm
            (None: ``norm_bound``).
        push_tokens: per island, the tokens of one honest push at its own H (declared, without a ledger);
            None: no declared size (only a ledger bounds the tokens).
    """

    def __init__(self, islands: int, fragments: int, norm_bound: float,
                 push_tokens: Sequence[int] | None = None, cold_bound: float | None = None) -> None:
        self.islands, self.norm_bound = islands, norm_bound
        self.cold_bound = norm_bound if cold_bound is None else cold_bound
        self.push_tokens = list(push_tokens) if push_tokens is not None else None
        # per fragment and island: its most recent accepted push (L2 norm, tokens), None before its first
        self.latest: list[list[tuple[float, int] | None]] = [[None] * islands for _ in range(fragments)]
        self.granted: list[int] | None = None          # per island: tokens granted (None: no ledger)
        self.claimed = [[0] * fragments for _ in range(islands)]  # per island and fragment: tokens claimed

    def grant(self, island: int, tokens: int) -> None:
        """The runtime gave ``island`` ``tokens`` more tokens to train on (one inner step's): the ledger.

        The first grant opens the ledger for every island (until then only ``push_tokens`` bounds a claim);
        ``tokens`` 0 opens it without granting anything."""
        if self.granted is None:
            self.granted = [0] * self.islands
        self.granted[island] += int(tokens)

    def reopen(self, tokens: Sequence[int]) -> None:
        """After a restart from a checkpoint: grant each island ``tokens[i]`` more (the steps granted since the
        checkpoint); without a ledger in the checkpoint, open one at each island's largest claim so far."""
        if self.granted is None:
            self.granted = [max(c, default=0) for c in self.claimed]
        for island, t in enumerate(tokens):
            self.granted[island] += int(t)

    def weight_tokens(self, island: int, tokens: int) -> int:
        """The tokens a push of ``island`` claiming ``tokens`` may weigh in one merge (and be vouched for):
        at most one honest push of its own (``push_tokens``, its H x tokens per step), so tokens banked by
        pushing rarely buy no more weight or norm than one round's; all of ``tokens`` without a declared size."""
        if self.push_tokens is None:
            return int(tokens)
        return min(int(tokens), int(self.push_tokens[island]))

    def _limit(self, entries: Sequence[tuple[float, int]], tokens: int) -> tuple[float, float]:
        """(the median bound, the floor's reference) for a push weighing ``tokens``, from the (norm, tokens)
        ``entries``: ``norm_bound`` x the median_low of their allowances n_j max(1, k/k_j), and the
        median_high of those allowances (see :meth:`check`)."""
        allowances = sorted(n * max(1.0, tokens / k) for n, k in entries)
        return self.norm_bound * statistics.median_low(allowances), statistics.median_high(allowances)

    def _within(self, norm: float, median_bound: float, reference: float) -> tuple[bool, float]:
        """Is ``norm`` within the median bound, or else within the floor (``sqrt(norm_bound)`` x the
        ``reference``)? With the norm that entry records: the push's own, or at most ``reference`` when
        only the floor let it pass (so the floor never grows an entry, and no island climbs it push by push)."""
        if norm <= median_bound:
            return True, norm
        if norm <= math.sqrt(self.norm_bound) * reference:
            return True, min(norm, reference)
        return False, norm

    def check(self, island: int, fragment: int, norm: float, tokens: int, params_norm: float) -> str:
        """Why a push of ``tokens`` tokens and L2 norm ``norm`` is refused ("tokens", "norm"), or "".

        ``params_norm``: the fragment's global parameter norm (the bound of the first round). The tokens of a
        push that reaches the norm check count as claimed; a push within the norm bound becomes its island's
        entry of the history (the caller refuses it for no other reason after this check) if the fragment is
        :meth:`warm`; before, the caller vets it when it merges (:meth:`vet`). The allowances are for the
        push's :meth:`weight_tokens`, not its claim.

        **The floor.** The median_low of the entries is what a minority cannot raise, but with an even split
        (2 islands: the smaller entry) half of the islands can lower it with tiny pushes until every push
        of the others is refused. So a push over the median bound still passes if it is within
        ``sqrt(norm_bound)`` x the median_high of the allowances (what the larger half vouches for: the
        honest island's own entry, with 2), and then enters the history at most at that reference: the floor
        never raises an entry, so a half that inflates its pushes climbs no higher than the median bound
        lets it (``sqrt(norm_bound)`` x ``norm_bound`` x the smaller half's entries at most).
        """
        if self.granted is not None:
            if self.claimed[island][fragment] + tokens > self.granted[island]:
                return "tokens"
        elif self.push_tokens is not None and tokens > self.norm_bound * self.push_tokens[island]:
            return "tokens"
        self.claimed[island][fragment] += tokens
        warm = self.warm(fragment)
        weight = self.weight_tokens(island, tokens)
        if warm:  # a majority of islands has an entry: what their most recent pushes vouch for
            median_bound, reference = self._limit([e for e in self.latest[fragment] if e is not None], weight)
            ok, entry = self._within(norm, median_bound, reference)
        else:  # the first round: an honest Δ is far smaller than the parameters themselves (if not all zero)
            ok, entry = norm <= (self.cold_bound * params_norm if params_norm > 0 else math.inf), norm
        if not ok:
            return "norm"
        if warm:
            self.latest[fragment][island] = (entry, weight)
        return ""

    def warm(self, fragment: int) -> bool:
        """Has a majority of distinct islands (``islands`` // 2 + 1) an accepted push of ``fragment``?"""
        return sum(e is not None for e in self.latest[fragment]) >= self.islands // 2 + 1

    def vet(self, fragment: int, pushes: Sequence[tuple[int, float, int, bool]]) -> list[bool]:
        """At a merge: which of the buffer's ``pushes`` (island, L2 norm, tokens, checked against a warm
        history; one per island) pass.

        A push accepted before the fragment was warm passes if its norm is within ``norm_bound`` x the
        ``statistics.median_low`` of what the buffer's pushes vouch for (n_j max(1, k/k_j), for the push's
        :meth:`weight_tokens`), or within the floor of :meth:`check` (``sqrt(norm_bound)`` x the median_high
        of what the *other* pushes vouch for: cold, no push vouches for itself, so with 2 islands the floor
        does not let a first push that negates the parameters in, and tiny pushes from the first round on
        still refuse the other's; the syncer then stops the run, :meth:`Syncer.starved
        <atoll.strategies.decoupled.syncer.Syncer.starved>`); those that pass become their islands' entries. Pushes
        checked against a warm history pass.
        """
        ok = []
        entries = [(n, self.weight_tokens(i, k)) for i, n, k, _ in pushes]
        for j, (island, norm, tokens, checked) in enumerate(pushes):
            weight = self.weight_tokens(island, tokens)
            median_bound, _ = self._limit(entries, weight)
            others = entries[:j] + entries[j + 1:]  # cold, no push vouches for itself: with 2, a push that
            reference = self._limit(others, weight)[1] if others else norm  # negates the parameters stays out
            passed, entry = self._within(norm, median_bound, reference)
            ok.append(checked or passed)
            if passed and not checked:
                self.latest[fragment][island] = (entry, weight)
        return ok

    def state_dict(self) -> dict[str, Any]:
        return {"latest": [[None if e is None else list(e) for e in f] for f in self.latest],
                "granted": None if self.granted is None else list(self.granted),
                "claimed": [list(c) for c in self.claimed]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an older checkpoint's ``window`` (not per island) loads as no history
        (cold: the fragments' cold bound until a majority of islands has pushed again)."""
        fragments = len(self.latest)
        if "latest" in state:
            self.latest = [[None if e is None else (float(e[0]), int(e[1])) for e in f] for f in state["latest"]]
        else:
            self.latest = [[None] * self.islands for _ in range(fragments)]
        self.granted = None if state["granted"] is None else [int(x) for x in state["granted"]]
        self.claimed = [[int(x) for x in c] for c in state["claimed"]]
