"""The checkpoint state of the decoupled syncer: everything a restarted
:class:`~atoll.strategies.decoupled.syncer.Syncer` needs to lose no committed outer step.

:func:`state_dict` holds, per fragment, the globals and outer momentum (float32 CPU tensors), the open
buffers (their pending Δs, float32 (numel_p,)), the pull codec's shadows and payloads
(:class:`~atoll.strategies.decoupled.downlink.Downlink`), the push bounds and admission, the recent round times, push
gaps, transfer times and last pushes and waits (seconds), and every statistic; :func:`save` writes it atomically with
:func:`~atoll.job.checkpoint.save_checkpoint` (tensors as safetensors, nothing as pickle), :func:`load` reads
the newest complete one back. Entries absent from older checkpoints load as their defaults.

Errors: :class:`~atoll.errors.CheckpointError` from :func:`load` (no readable syncer checkpoint).
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from atoll.strategies.decoupled.bounds import WINDOW
from atoll.strategies.decoupled.buffer import Buffer, Pending
from atoll.strategies.decoupled.tallies import MergeWaits, Tally

if TYPE_CHECKING:
    from atoll.algorithms.outer import OuterOptimizer
    from atoll.strategies.decoupled.bounds import PushBounds
    from atoll.strategies.decoupled.downlink import Downlink
    from atoll.strategies.decoupled.island_record import IslandRecord
    from atoll.strategies.decoupled.trust import Admission


class SyncerView(Protocol):
    """What this module reads and restores of a :class:`~atoll.strategies.decoupled.syncer.Syncer` (a protocol
    here, so that this module, which the syncer imports, does not import it back)."""

    islands: int
    outer: list[OuterOptimizer]
    buffers: list[Buffer]
    bounds: PushBounds
    admission: Admission
    merge_s: float
    round_s: deque[float]
    push_gap_s: deque[float]
    sync_s: deque[float]
    per_island: list[IslandRecord]
    rejected_updates: int
    rejected_by_reason: dict[str, int]
    stale_updates: int
    replaced_updates: int
    accepted_updates: int
    commits: int
    quorum_sizes: Tally
    staleness: Tally
    merge_waits: MergeWaits
    last_merge: list[tuple[float, frozenset[int]] | None]
    behind: list[list[float]]
    downlink: Downlink

    @property
    def tokens_by_outcome(self) -> dict[str, list[float]]:
        """Per outcome, per island, tokens pushed."""

    @property
    def merged_tokens(self) -> float:
        """Tokens merged, over the islands."""

    @property
    def merged_tokens_per_island(self) -> list[float]:
        """Tokens merged, per island."""

    def state_dict(self, lend: bool = False) -> dict[str, Any]:
        """:func:`state_dict` of this syncer."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:func:`load_state_dict` into this syncer."""


def state_dict(s: SyncerView, lend: bool = False) -> dict[str, Any]:
    """Everything of ``s``: globals and outer momentum per fragment, open buffers, medians, statistics
    (plain lists, numbers and tensors; a grace window or last push that is none is written as -1.0).
    ``lend``: the copies of globals, momenta and shadows are lent (given back by the syncer's ``release``)."""
    return {
        "outer": [o.state_dict(lend) for o in s.outer],
        "buffers": [{"opened_at": b.opened_at, "grace_s": b.grace_s if math.isfinite(b.grace_s) else -1.0,
                     "first_at": b.first_at,
                     "pushes": [{"island": p.island, "delta": p.delta, "tokens": p.tokens,
                                 "base_version": p.base_version, "vetted": p.vetted, "arrived_at": p.arrived_at}
                                for p in b.pushes]}
                    for b in s.buffers],
        "bounds": s.bounds.state_dict(), "admission": s.admission.state_dict(), "merge_s": s.merge_s,
        "round_s": list(s.round_s), "push_gap_s": list(s.push_gap_s), "sync_s": list(s.sync_s),
        # per island (the checkpoint keeps its layout of one list per field, indexed by island)
        "last_wait": [[-1.0 if t is None else t for t in r.last_wait] for r in s.per_island],
        "last_push_at": [[-1.0 if t is None else t for t in r.last_push_at] for r in s.per_island],
        "refused_in_a_row": [r.refused_in_a_row for r in s.per_island],
        "stale_credit": [list(r.stale_credit) for r in s.per_island],
        "tokens_by_outcome": {k: list(v) for k, v in s.tokens_by_outcome.items()},
        "rejected_updates": s.rejected_updates, "rejected_by_reason": dict(s.rejected_by_reason),
        "stale_updates": s.stale_updates, "replaced_updates": s.replaced_updates,
        "accepted_updates": s.accepted_updates, "commits": s.commits,
        "quorum_sizes": s.quorum_sizes.state_dict(), "staleness": s.staleness.state_dict(),
        # derived from tokens_by_outcome["merged"] (not read back): for readers of the checkpoint
        "merged_tokens": s.merged_tokens, "merged_tokens_per_island": list(s.merged_tokens_per_island),
        "merge_waits": s.merge_waits.state_dict(),
        # realign_pushes: per fragment its last timed merge (its first arrival, -1.0: none; its islands); per
        # island and fragment how far behind its last merged push arrived
        "last_merge_at": [-1.0 if m is None else m[0] for m in s.last_merge],
        "last_merge_islands": [[] if m is None else sorted(m[1]) for m in s.last_merge],
        "behind": [list(b) for b in s.behind],
        # pull_codec: per fragment the shadow the islands hold, its version and last payloads (empty for fp32)
        "downlink": s.downlink.state_dict(lend),
    }


def load_state_dict(s: SyncerView, state: dict[str, Any]) -> None:
    """Restore :func:`state_dict` into ``s`` (a syncer built with the same shapes and settings)."""
    for o, st in zip(s.outer, state["outer"], strict=True):
        o.load_state_dict(st)
    s._norms = {}
    s.buffers = []
    for b in state["buffers"]:
        grace = float(b["grace_s"])
        s.buffers.append(Buffer([Pending(int(p["island"]), p["delta"], int(p["tokens"]),
                                         int(p["base_version"]), bool(p.get("vetted", True)),
                                         float(p.get("arrived_at", b["opened_at"])))
                                 for p in b["pushes"]],
                                float(b["opened_at"]), grace if grace >= 0 else math.inf,
                                float(b.get("first_at", b["opened_at"]))))  # older checkpoints: the window's
    s.bounds.load_state_dict(state["bounds"])
    if "admission" in state:
        s.admission.load_state_dict(state["admission"])
    s.merge_s = float(state.get("merge_s", 0.0))
    s.round_s = deque((float(x) for x in state["round_s"]), maxlen=WINDOW)
    s.push_gap_s = deque((float(x) for x in state.get("push_gap_s", [])), maxlen=WINDOW)  # absent: older ones
    s.sync_s = deque((float(x) for x in state.get("sync_s", [])), maxlen=WINDOW)
    for i, r in enumerate(s.per_island):
        if "last_wait" in state:
            r.last_wait = [None if float(t) < 0 else float(t) for t in state["last_wait"][i]]
        if "last_push_at" in state:  # absent from older checkpoints: no push seen yet
            r.last_push_at = [None if float(t) < 0 else float(t) for t in state["last_push_at"][i]]
        r.refused_in_a_row = int(state.get("refused_in_a_row", [0] * s.islands)[i])
        r.stale_credit = [int(x) for x in state["stale_credit"][i]]
        r.tokens = {k: float(v[i]) for k, v in state["tokens_by_outcome"].items()}
    for name in ("rejected_updates", "stale_updates", "accepted_updates", "commits", "replaced_updates"):
        setattr(s, name, int(state.get(name, 0)))  # replaced_updates: absent from older checkpoints
    s.rejected_by_reason = {str(k): int(v) for k, v in state["rejected_by_reason"].items()}
    s.quorum_sizes = Tally.from_state(state["quorum_sizes"])  # (older checkpoints: one entry per merge)
    s.staleness = Tally.from_state(state["staleness"])
    # merged_tokens and merged_tokens_per_island (still written, for readers of the checkpoint) are derived
    # from tokens_by_outcome["merged"] on load; older checkpoints' copies of them are not read
    s.merge_waits = MergeWaits.from_state(state.get("merge_waits", []))
    if "last_merge_at" in state:  # absent from older checkpoints: no merge measured yet
        s.last_merge = [None if float(t) < 0 else (float(t), frozenset(int(i) for i in held))
                        for t, held in zip(state["last_merge_at"], state["last_merge_islands"], strict=True)]
        s.behind = [[float(x) for x in b] for b in state["behind"]]
    if not s.downlink.load_state_dict(state.get("downlink", {})):  # no shadows of this pull codec: from G, and
        s.downlink.restart([o.params for o in s.outer], [o.version for o in s.outer])  # a full pull each once


def save(s: SyncerView, folder: Path, keep: int = 2, extra: dict[str, Any] | None = None) -> Path:
    """Write ``s``'s :func:`state_dict` atomically to ``folder/checkpoints/step_<commits>/``; return its path.

    ``extra``: more entries for the same checkpoint (a runtime's own counters), beside ``"syncer"``; ``keep``:
    the checkpoints kept (:func:`~atoll.job.checkpoint.save_checkpoint`).
    """
    from atoll.job.checkpoint import save_checkpoint

    return save_checkpoint(Path(folder), s.commits, {**(extra or {}), "syncer": s.state_dict()}, keep=keep)


def load(s: SyncerView, folder: Path) -> None:
    """Restore into ``s`` the newest complete checkpoint written by :func:`save` under ``folder``.

    Raises:
        CheckpointError: ``folder`` holds no readable syncer checkpoint.
    """
    from atoll.job.checkpoint import latest_checkpoint, load_checkpoint

    _, state = load_checkpoint(latest_checkpoint(Path(folder)))
    s.load_state_dict(state["syncer"])
