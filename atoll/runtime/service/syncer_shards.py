"""The decoupled syncer sharded by fragment: which shard owns a fragment, the coordinator's signed grants, and
one run's statistics gathered from its shards.

Decoupled DiLoCo's syncer is CPU-only and sharded by fragment (arXiv:2604.21428, as third-party readings of
the paper describe it): a single process merging 12B parameters on one thread would take tens of minutes per
window. Each shard holds the global parameters, outer momentum, buffers, bounds and checkpoints of its own
fragments; the merge of one fragment never needs another's, so the shards share only what is per *island*:

- **The map** (:func:`shard_map`): fragment -> shard, computed from the fragments' sizes and the number of
  shards alone, so every process of the run (each shard, each rank of each island) derives the same one and
  an island whose map differs (another ``--syncer`` list, other fragments) is refused at its join.
- **The step budget, the token ledger and the sessions** are the coordinator's (shard 0): it grants the
  islands' step leases and opens their sessions, as the unsharded syncer does. The other shards must still
  bound a push's claimed tokens by the tokens its island was granted, and refuse a push of a session the
  coordinator never opened (:mod:`~atoll.strategies.decoupled.trust`), without trusting the island. So the
  coordinator signs a :class:`Grant` (island, session, tokens granted so far, a sequence number) with an HMAC
  under the run's key, hands it to the island with each lease, and the island forwards its newest grant with
  every push; a shard checks it (:class:`GrantBook`) before the syncer's own checks. No shard ever calls the
  coordinator on a push's path: a push to shard 1 costs no extra round trip, and shard 1 keeps merging while
  shard 0 restarts. The island cannot forge or alter a grant (it has no key), nor use another island's (the
  island is signed in), nor an old session's grant (replay) once a newer one reached the shard; the worst it
  can do is send an older grant of its own session, which grants it fewer tokens.
- **The end**: the coordinator gathers every shard's fragments and statistics (:func:`combine_stats`) and
  evaluates and saves the run's one model.

Pure functions and small records; no sockets. Errors: ValueError (one line) for a map that cannot be made;
CheckpointError (one line) for an unreadable ``coordinator.json``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atoll.algorithms.fragments import FlatFragment
from atoll.strategies.decoupled.protocol import is_index

if TYPE_CHECKING:
    from atoll.strategies.decoupled.trust import Admission

#: the HMAC of a grant and of the shards' peer credential: SHA-256
DIGEST = hashlib.sha256
#: how far a coordinator whose ``coordinator.json`` is missing skips its grant epoch past its checkpoint's copy
EPOCH_RECOVERY_SKIP = 1000


def shard_map(numels: Sequence[int], shards: int) -> list[int]:
    """Per fragment, the shard (0-based) that owns it: the fragments, largest first (ties: lower index first),
    each given to the shard holding the fewest values so far (ties: the lower shard). Deterministic from
    ``numels`` (values per fragment) and ``shards`` alone, so every process of a run computes the same map;
    balanced by values, which is what a shard's merge time and memory follow.

    Raises:
        ValueError: ``shards`` is not in ``1..len(numels)`` (every shard owns at least one fragment).
    """
    if not (is_index(shards, len(numels) + 1) and shards >= 1):
        raise ValueError(f"shards: {shards!r} shards for {len(numels)} fragments; each shard owns at least one "
                         "fragment: give at most as many --shards addresses as --fragments")
    load = [0] * shards
    owners = [0] * len(numels)
    for p in sorted(range(len(numels)), key=lambda p: (-int(numels[p]), p)):
        s = min(range(shards), key=lambda s: (load[s], s))
        owners[p] = s
        load[s] += int(numels[p])
    return owners


def shard_vector(flat: torch.Tensor, fragments: Sequence[FlatFragment]) -> tuple[torch.Tensor, list[FlatFragment]]:
    """A shard's own parameters: its ``fragments`` of the model's flat vector ``flat`` (numel,) one after the
    other, a new float tensor (sum of their numels,), and each fragment as its one contiguous range of it, in
    the same order (what a shard's :class:`~atoll.strategies.decoupled.syncer.Syncer` is built over), its
    ranges keeping their parameters' names (per-tensor merges, embeddings told apart, as on one syncer)."""
    index, start = [], 0
    for f in fragments:
        if not f.params:  # no names: one range
            index.append(FlatFragment(((start, start + f.numel()),)))
            start += f.numel()
            continue
        ranges = []
        for a, b in f.ranges:
            ranges.append((start, start + b - a))
            start += b - a
        index.append(FlatFragment(tuple(ranges), f.params))
    values = torch.cat([f.gather(flat) for f in fragments]) if fragments else flat.new_zeros(0)
    return values, index


def owned(owners: Sequence[int], shard: int) -> list[int]:
    """The fragments ``shard`` owns under the map ``owners``, ascending."""
    return [p for p, s in enumerate(owners) if s == shard]


def fingerprint(numels: Sequence[int], owners: Sequence[int]) -> str:
    """16 hex digits naming a run's fragments and map (the same on every process of the run, else not)."""
    text = json.dumps({"numels": [int(n) for n in numels], "owners": [int(s) for s in owners]})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def peer_token(key: bytes) -> str:
    """The credential one shard proves itself with to another (the coordinator gathering the model): derived
    from the run's key, so the key itself never travels."""
    return hmac.new(key, b"atoll-syncer-peer", DIGEST).hexdigest()


@dataclass(frozen=True)
class ShardSpec:
    """This syncer's place in a run sharded by fragment.

    Attributes:
        shard: its index, 0-based (0: the coordinator: leases, sessions, the run's end).
        owners: per fragment, its shard (:func:`shard_map`).
        key: the run's secret (bytes), the same on every shard's host: signs grants and derives the peer
            credential; never given to an island.
        run: the run's :func:`fingerprint`, part of every grant.
    """

    shard: int
    owners: tuple[int, ...]
    key: bytes
    run: str

    @classmethod
    def of(cls, shard: int, shards: int, key: bytes, numels: Sequence[int]) -> ShardSpec:
        """Shard ``shard`` of ``shards`` of a run of fragments of ``numels`` values (:func:`shard_map`)."""
        owners = shard_map(numels, shards)
        return cls(shard, tuple(owners), key, fingerprint(numels, owners))

    @property
    def shards(self) -> int:
        return max(self.owners) + 1

    @property
    def fragments(self) -> list[int]:
        """The fragments this shard owns, ascending (its syncer's local fragment j is ``fragments[j]``)."""
        return owned(self.owners, self.shard)

    @property
    def coordinator(self) -> bool:
        return self.shard == 0


@dataclass(frozen=True)
class Grant:
    """What the coordinator granted an island so far, signed: a shard other than the coordinator bounds the
    island's token claims and checks its pushes' session with it.

    Attributes:
        island: the island granted; session: its session at the coordinator (its joins).
        tokens: tokens granted to it in all (the coordinator's token ledger; it falls when unused steps
            go back to the budget as the island leaves).
        epoch: the coordinator's starts (a restarted coordinator's grants are newer than any before).
        seq: grants issued in this epoch (newer grants have larger ones).
        run: the run's :func:`fingerprint` (a grant of another run with the same key is not this run's).
    """

    island: int
    session: int
    tokens: int
    epoch: int
    seq: int
    run: str

    def signed(self, key: bytes) -> dict[str, Any]:
        """The grant as JSON-ready fields with ``mac``: HMAC-SHA256 under ``key`` of the others."""
        fields = asdict(self)
        return {**fields, "mac": _mac(key, fields)}

    @classmethod
    def verified(cls, obj: Any, key: bytes, run: str) -> Grant | None:
        """The grant ``obj`` (as :meth:`signed` made it) if its MAC is right under ``key`` and it is of ``run``;
        None if it is not a grant, was altered or forged (compared in constant time), or is another run's."""
        if not isinstance(obj, dict) or set(obj) != {"island", "session", "tokens", "epoch", "seq", "run", "mac"}:
            return None
        fields = {k: v for k, v in obj.items() if k != "mac"}
        if not (all(is_index(fields[k], 1 << 62) for k in ("island", "session", "tokens", "epoch", "seq"))
                and isinstance(fields["run"], str) and isinstance(obj["mac"], str)):
            return None
        if not hmac.compare_digest(obj["mac"].encode(), _mac(key, fields).encode()) or fields["run"] != run:
            return None
        return cls(**fields)

    @property
    def order(self) -> tuple[int, int]:
        return self.epoch, self.seq


def _mac(key: bytes, fields: dict[str, Any]) -> str:
    return hmac.new(key, json.dumps(fields, sort_keys=True, separators=(",", ":")).encode(), DIGEST).hexdigest()


class GrantBook:
    """A shard's record, per island, of the newest grant of the coordinator's it was shown, and its check of a
    push's grant and session (the coordinator itself holds the ledger: it needs no book).

    Args:
        islands: K; key, run: as :class:`ShardSpec`.
    """

    def __init__(self, islands: int, key: bytes, run: str) -> None:
        self.key, self.run = key, run
        self.session = [0] * islands       # per island: the newest session a verified grant named
        self.newest = [(-1, -1)] * islands  # per island: the (epoch, seq) of the newest grant recorded
        self.tokens = [0] * islands        # per island: its tokens

    def check(self, island: int, obj: Any, session: Any) -> tuple[str, Grant | None]:
        """Why a push of ``island`` in ``session`` carrying the grant ``obj`` is refused, or "" and the grant.

        ``grant``: not a grant, altered, forged, another run's, or another island's; ``replay``: a grant of an
        older session than one this shard saw (its island has rejoined since), or a push of an older session
        than its grant's; ``session``: a push of a session its grant does not name (one the coordinator never
        opened). A grant that passes is not yet recorded (:meth:`record`)."""
        grant = Grant.verified(obj, self.key, self.run)
        if grant is None or grant.island != island:
            return "grant", None
        if grant.session < self.session[island]:
            return "replay", None
        if not (isinstance(session, int) and not isinstance(session, bool)) or session != grant.session:
            return ("replay" if isinstance(session, int) and session < grant.session else "session"), None
        return "", grant

    def admit(self, island: int, obj: Any, session: Any) -> tuple[str, int | None]:
        """:meth:`check`, and :meth:`record` the grant that passes: (the reason to refuse, or ""; the island's
        tokens granted when they changed, else None)."""
        reason, grant = self.check(island, obj, session)
        return reason, self.record(grant) if grant is not None else None

    def record(self, grant: Grant) -> int | None:
        """Take ``grant`` (checked) as its island's newest if it is: a newer session, or a later grant of the
        same one (out-of-order pushes carry older grants: those change nothing). Returns the island's tokens
        granted when they changed, else None."""
        i = grant.island
        if grant.session < self.session[i] or (grant.session == self.session[i] and grant.order <= self.newest[i]):
            return None
        changed = grant.tokens != self.tokens[i]
        self.session[i], self.newest[i], self.tokens[i] = grant.session, grant.order, grant.tokens
        return grant.tokens if changed else None

    def state_dict(self) -> dict[str, Any]:
        return {"session": list(self.session), "newest": [list(o) for o in self.newest], "tokens": list(self.tokens)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.session = [int(x) for x in state["session"]]
        self.newest = [(int(a), int(b)) for a, b in state["newest"]]
        self.tokens = [int(x) for x in state["tokens"]]


class GrantIssuer:
    """(The coordinator.) Signs the islands' grants (:class:`Grant`), and keeps what must outlive a restart in a
    small JSON file ``path`` (beside its checkpoints), written at its start and at each join: its starts (the
    ``epoch`` of its grants, so a restarted coordinator's grants are newer than any it signed before, even after
    two restarts from the same checkpoint) and the islands' sessions (a coordinator restarted from a checkpoint
    older than a rejoin signs that session, never an older one: taken back into ``admission`` here).

    Args:
        spec: the coordinator's :class:`ShardSpec`; admission: its syncer's
            :class:`~atoll.strategies.decoupled.trust.Admission` (its sessions).
        checkpoint_epoch: the epoch its newest checkpoint holds (a copy: where ``path`` is missing), or None.

    Raises:
        CheckpointError: ``path`` is there but unreadable (never a silent epoch 1).
    """

    def __init__(self, spec: ShardSpec, path: Path, admission: Admission,
                 checkpoint_epoch: int | None = None) -> None:
        self.spec, self.path, self.seq = spec, Path(path), 0
        saved = self._read(checkpoint_epoch)
        for island, session in enumerate(saved.get("session", [])[:admission.islands]):
            if is_index(session, 1 << 62) and session > admission.session[island]:
                admission.session[island] = session  # as Admission.rejoin: any base version is new in it
                admission.last_base[island] = [-1] * len(admission.last_base[island])
        self.epoch = int(saved.get("epoch", 0)) + 1
        self.opened(admission)

    def _read(self, checkpoint_epoch: int | None) -> dict[str, Any]:
        """What ``path`` holds (``epoch``, ``session``); {} for a coordinator's first start (no file, no
        checkpoint). A missing file beside a checkpoint (deleted, or never made: an older syncer): the epoch of
        the newest checkpoint ``checkpoint_epoch`` plus :data:`EPOCH_RECOVERY_SKIP` (more starts than a
        coordinator makes between two commits, so its grants are newer than any it signed before), said in one
        line.

        Raises:
            CheckpointError: the file is there but unreadable (empty, torn, not this format): one line naming
                it and the fix; an epoch started again at 1 would make the other shards refuse every grant.
        """
        from atoll.errors import CheckpointError

        if not self.path.exists():
            if checkpoint_epoch is None:
                return {}
            epoch = int(checkpoint_epoch) + EPOCH_RECOVERY_SKIP
            print(f"atoll: warning: coordinator: '{self.path}' is missing; its grant epoch is recovered from the "
                  f"newest checkpoint's copy ({checkpoint_epoch}) as {epoch + 1}", file=sys.stderr, flush=True)
            return {"epoch": epoch}
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            if not (isinstance(saved, dict) and is_index(saved.get("epoch"), 1 << 62)
                    and isinstance(saved.get("session", []), list)):
                raise ValueError("not a coordinator's record")
        except (OSError, ValueError) as e:
            why = "empty" if self.path.is_file() and self.path.stat().st_size == 0 else \
                (str(e).splitlines()[0][:80] if str(e) else type(e).__name__)
            raise CheckpointError(
                f"coordinator: '{self.path}' is unreadable ({why}); it holds the grant epoch the other shards know: "
                "restore it from a backup, or delete it to recover the epoch from the newest checkpoint") from None
        return saved

    def opened(self, admission: Admission) -> None:
        """Keep the sessions of ``admission`` (an island just joined: before its grant goes out), durably
        (:func:`~atoll.job.checkpoint.write_text_atomic`: fsynced, so a power cut leaves the old file or the
        new one, never an empty one)."""
        from atoll.job.checkpoint import write_text_atomic

        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps({"epoch": self.epoch, "session": list(admission.session)}))

    def sign(self, island: int, session: int, tokens: int) -> dict[str, Any]:
        """The grant of ``island`` in ``session`` of ``tokens`` granted so far, signed (:meth:`Grant.signed`)."""
        self.seq += 1
        return Grant(island, session, int(tokens), self.epoch, self.seq, self.spec.run).signed(self.spec.key)


def shard_entries(spec: ShardSpec | None, book: GrantBook | None) -> dict[str, Any]:
    """What a shard adds to its checkpoint's ``service`` entries: which shard of which map it is, and its
    :class:`GrantBook` ({} unsharded)."""
    if spec is None:
        return {}
    return {"shard": spec.shard, "run": spec.run, **({"grants": book.state_dict()} if book is not None else {})}


def restore_shard(spec: ShardSpec | None, book: GrantBook | None, saved: dict[str, Any], where: Path) -> None:
    """Check that the checkpoint ``service`` entries ``saved`` (in the folder ``where``) are this shard's of
    this map (:func:`shard_entries`) and restore its ``book``.

    Raises:
        ValueError: another shard's checkpoint, or of another map (other ``--shards``, other fragments).
    """
    if (saved.get("shard", 0), saved.get("run")) != ((spec.shard, spec.run) if spec is not None else (0, None)):
        raise ValueError(f"shards: the checkpoint in '{where}' is another shard's, or of another map; restart "
                         "with the --shard and --shards it was started with")
    if book is not None and "grants" in saved:
        book.load_state_dict(saved["grants"])


#: statistics of the syncer (:func:`~atoll.strategies.decoupled.accounting.syncer_stats`) that are the largest
#: over the shards, not their sum
_MAX = ("merge_wait_max_s", "grace_window_max_s", "merge_overrun_max_s", "staleness_max", "quorum_size_max")
#: settings among them: the same on every shard
_SETTINGS = ("quorum", "robust_merge")


def combine_stats(parts: Sequence[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    """One run's syncer statistics from its shards': ``parts``, per shard its
    :meth:`Syncer.stats <atoll.strategies.decoupled.syncer.Syncer.stats>` and its share of the model's
    parameters (its values over the model's).

    Counts add up (commits, pushes by outcome and reason, per island and reason, histograms of quorum sizes and
    staleness, merge seconds); maxima and minima are over the shards; the means are recomputed from the
    histograms; the token buckets (``*_tokens_by_island``: each push's tokens times its fragment's share *of
    its shard*) are scaled by each shard's share, so they are the model's, as one syncer's would be. A key
    this function does not know is summed when it is a number or a list of numbers (per island), merged per
    key when a dict of numbers, and taken from shard 0 otherwise (settings, ``quorum`` and ``robust_merge``).
    """
    out: dict[str, Any] = {}
    for stats, share in parts:
        for k, v in stats.items():
            if k.endswith("_tokens_by_island"):
                v = [float(x) * share for x in v]
            if k not in out:
                out[k] = v
            elif k in _MAX:
                out[k] = max(out[k], v)
            elif k == "quorum_size_min":
                out[k] = min((x for x in (out[k], v) if x), default=0)
            elif k in _SETTINGS or isinstance(v, bool | str):
                continue
            elif isinstance(v, int | float):
                out[k] = out[k] + v
            elif isinstance(v, list):
                out[k] = [a + b for a, b in zip(out[k], v, strict=True)]
            elif isinstance(v, dict):
                merged = dict(out[k])
                for kk, vv in v.items():
                    if kk not in merged:
                        merged[kk] = vv
                    elif isinstance(vv, list):  # per island (rejected_by_island)
                        merged[kk] = [a + b for a, b in zip(merged[kk], vv, strict=True)]
                    else:
                        merged[kk] = merged[kk] + vv
                out[k] = merged
    for hist, mean in (("quorum_size_counts", "quorum_size_mean"), ("staleness_counts", "staleness_mean")):
        counts = out.get(hist)
        if isinstance(counts, dict) and mean in out:
            n = sum(counts.values())
            out[mean] = sum(int(k) * c for k, c in counts.items()) / n if n else 0.0
            out[hist] = {k: counts[k] for k in sorted(counts, key=int)}
    return out
