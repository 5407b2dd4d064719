"""How the ranks of an island job exchange fragments with ``atoll syncer``: slices, in parallel, agreed.

:class:`ServiceTransport` is the :class:`~atoll.strategies.decoupled.island.Transport` of
:meth:`IslandWorker.run <atoll.strategies.decoupled.island.IslandWorker.run>` on every rank of an island job
(one rank: an island as a single process). For each push of fragment p (:class:`SlicePlan` says who moves
what):

1. **push** (``slice_transfer = "ranks"``): every rank encodes its slice of Δ with the run's codec and uploads
   the payload over its own bulk connection (``Upload`` names the slice's ranges); the leader, once the
   agreement says every slice is up, commits the push listing the slices (``Push``), and the syncer
   reassembles the island's Δ. (``"leader"``: rank 0 gathers the slices inside the island, encodes the whole
   fragment and uploads it alone.)
2. **wait**: the leader waits (``Buffered``, a long poll of at most ``wire.MAX_WAIT_S``, asked again until) the
   push is merged (a quorum, or the grace window), and says so in the agreement.
3. **pull**: every rank downloads its slice of the newest global fragment over its own connection (the
   leader alone the whole fragment with ``"leader"``); the versions the ranks got are agreed (a commit between
   two ranks' downloads: the older ones download again), and the island's ranks then assemble what they hold
   (all-gather of the slices; with ``--shard-island`` a rank's slice is what it holds), or the leader
   broadcasts or scatters it.

   With a ``pull_codec`` other than fp32 the leader alone downloads the fragment's pull for the version the
   island holds (the pull codec's payloads since it, or the full fragment in float32 at the island's start or
   when its payloads are no longer kept: :mod:`~atoll.strategies.decoupled.downlink`) and broadcasts its bytes
   over the island's process group; every rank decodes them and adds them to its own copy
   (:func:`~atoll.strategies.decoupled.downlink.apply_pull`), as an island of the local and Ray runtimes
   does, so every rank's copy equals the syncer's shadow bit for bit. Why not a slice per rank: a
   block-scaled payload (one scale per ``codec_block_size`` values, int4 two values per byte) cannot be cut at
   a rank's element ranges, and ranges aligned to blocks would put the codec's layout into the service; the
   payload is 4-8x smaller than the float32 slices, and the broadcast runs on the island's own fast links.
   A rank of a sharded island keeps its part of each decoded payload.

The network calls run in a thread per exchange, so the island trains on meanwhile; everything the ranks do
together (the agreement, the slices' collectives, adopting a pulled fragment) runs on the main thread at
points every rank reaches alike (:meth:`reserve_step`: once per inner step; :meth:`settle`, :meth:`close`),
so no two ranks of an island ever hold a fragment of different versions. The agreement is one all-reduce
(minimum) of ``1 + 6 P`` int64 per inner step (:meth:`IslandGroup.agree
<atoll.runtime.service.group.IslandGroup.agree>`); each stage waits for the next one (at most an inner step).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch

from atoll.algorithms.codec_base import Codec, Encoded
from atoll.algorithms.fragments import FlatFragment
from atoll.algorithms.wire import Wire
from atoll.runtime.service import schema, slices, wire
from atoll.runtime.service.agreement import DONE, READY, SHIFT, UP, VMIN, VNEG, Agreement, at, bits_share, share_bits
from atoll.runtime.service.client import SyncerClient, UploadLost
from atoll.runtime.service.group import IslandGroup
from atoll.runtime.service.lease import GO, WAIT, StepLease
from atoll.runtime.service.slices import Part, Ranges
from atoll.strategies.decoupled.protocol import Pull, Push


@dataclass(frozen=True)
class SlicePlan:
    """Who of an island's ``ranks`` ranks moves what of each fragment (see :mod:`~atoll.runtime.service.slices`).

    Attributes:
        rank, ranks: this rank and the island's.
        sharded: the island is FSDP2-sharded (a rank holds its shard's part of each fragment only).
        leader_moves: ``slice_transfer = "leader"``: rank 0 alone pushes and pulls whole fragments.
        numels: per fragment, its values.
        parts: per fragment, per rank, its part (:class:`~atoll.runtime.service.slices.Part`).
        held: per fragment, what this rank holds of it, as ranges of its local flat vector.
    """

    rank: int
    ranks: int
    sharded: bool
    leader_moves: bool
    numels: list[int]
    parts: list[list[Part]]
    held: list[FlatFragment]

    @classmethod
    def whole(cls, index: list[FlatFragment], rank: int, ranks: int, leader_moves: bool = False) -> SlicePlan:
        """An island whose every rank holds the whole model (one rank, or R under DDP): rank r's slice is the
        r-th of R contiguous runs of each fragment (:func:`~atoll.runtime.service.slices.even_parts`)."""
        return cls(rank, ranks, False, leader_moves or ranks == 1, [f.numel() for f in index],
                   [slices.even_parts(f, ranks) for f in index], list(index))

    @classmethod
    def sharded_island(cls, index: list[FlatFragment], param_numels: list[int], counts: torch.Tensor, rank: int,
                       leader_moves: bool = False) -> SlicePlan:
        """An FSDP2-sharded island: rank r's slice is its shard's part of each fragment (``counts``:
        :attr:`ShardLayout.counts <atoll.runtime.collective.sharding.ShardLayout.counts>`, (R, params))."""
        pieces = slices.shard_pieces(param_numels, counts)
        parts = [slices.shard_parts(f, pieces) for f in index]
        return cls(rank, len(pieces), True, leader_moves, [f.numel() for f in index], parts,
                   [parts[p][rank].local for p in range(len(index))])

    def sizes(self, p: int) -> list[int]:
        """Each rank's part of fragment p, in values."""
        return [part.numel() for part in self.parts[p]]

    def send_range(self, p: int) -> tuple[int, int]:
        """The values ``[a, b)`` of what this rank holds of fragment p that its push's Δ covers."""
        if self.sharded:
            return 0, self.held[p].numel()
        if self.leader_moves:
            return (0, self.numels[p]) if self.rank == 0 else (0, 0)
        own = self.parts[p][self.rank].ranges
        return own[0] if own else (0, 0)

    def movers(self, p: int) -> list[int]:
        """The ranks that upload and download fragment p over their own connections."""
        return [0] if self.leader_moves else [r for r, n in enumerate(self.sizes(p)) if n]

    def moves(self, p: int) -> bool:
        """Does this rank upload and download fragment p?"""
        return self.rank in self.movers(p)

    def moved(self, p: int) -> Ranges:
        """The ranges of fragment p this rank moves (all of it when the leader moves whole fragments)."""
        return ((0, self.numels[p]),) if self.leader_moves else self.parts[p][self.rank].ranges


@dataclass(frozen=True)
class Outgoing:
    """A push as this rank's exchange thread sends it: its encoded slice (None: this rank uploads nothing)
    and, for the leader, what the commit says."""

    payload: dict[str, torch.Tensor] | None
    tokens: int
    base_version: int
    round_s: float
    credit_mark: int


class ServiceTransport:
    """The transport of one rank of an island job (see the module docstring).

    Args:
        client: this rank's :class:`~atoll.runtime.service.client.SyncerClient` (the leader's has the control
            connection); ``route``: per fragment, the client of the syncer's shard that owns it (None: ``client``).
        group: the island's :class:`~atoll.runtime.service.group.IslandGroup`.
        plan: who moves what (:class:`SlicePlan`).
        wire: the island's :class:`~atoll.algorithms.wire.Wire` (its codec, error feedback and random source):
            a push's Δ is encoded with it here, and its payload is what travels.
        codec: the run's codec (the bytes a slice's payload takes).
        pull_codec: the run's pull codec (:func:`~atoll.strategies.decoupled.downlink.pull_codec`; None: fp32
            pulls, a slice per rank).
        session: the island's session (from its join).
        lease: the leader's :class:`~atoll.runtime.service.lease.StepLease` (None on the other ranks).
        poll_s: seconds between two agreements while waiting for an exchange (and two ``Buffered``).
        heartbeat_s: seconds between the leader's heartbeats (on the control connection).

    Attributes:
        bytes_sent: the encoded payload bytes of the island's pushes (the leader's count: every rank's slices).
        bytes_received: the bytes of the global fragments the island pulled (the leader's count: every rank's
            float32 slices, or with a pull codec the pull's :attr:`~atoll.strategies.decoupled.protocol.Pull.nbytes`,
            its payloads' or 4 per parameter, once per exchange, the start's pull of every fragment included; a
            download a rank repeats because a commit fell between two ranks' downloads is not counted).
        refused, lost: pushes the syncer refused; pushes whose slices it lost (it restarted between the
            upload and the commit of an island of several ranks: the island pulls the newest fragment).
    """

    def __init__(self, client: SyncerClient, group: IslandGroup, plan: SlicePlan, wire: Wire, codec: Codec,
                 session: int, lease: StepLease | None, poll_s: float = 0.02, heartbeat_s: float = 2.0,
                 route: list[SyncerClient] | None = None, pull_codec: Codec | None = None) -> None:
        self.client, self.group, self.plan, self.wire, self.codec = client, group, plan, wire, codec
        self.pull_codec = pull_codec
        fragments = len(plan.numels)
        self.session, self.lease, self.poll_s, self.route = session, lease, poll_s, route or [client] * fragments
        self.ranks_move = not plan.leader_moves and group.size > 1
        self.agreement = Agreement(group, fragments)
        for p in range(fragments):
            if self.ranks_move and plan.moves(p):
                self.agreement.local[at(p, UP)] = 0
            if group.leader:
                self.agreement.local[at(p, READY)] = 0
                self.agreement.local[at(p, SHIFT)] = share_bits(0.0)
            if self._pulls(p):
                self.agreement.local[at(p, DONE)] = 0
        self.agreement.agreed = list(self.agreement.local)
        self.count = [0] * fragments  # exchanges started per fragment (their number k)
        self.pending: dict[int, int] = {}  # fragment -> the exchange k in progress
        self.futures: dict[int, Future[None]] = {}
        # this rank's download: (version, values), or with a pull codec (version, (since, bytes)) on the leader
        self.pulled: dict[int, tuple[int, Any]] = {}
        self.pulled_at = [time.monotonic()] * fragments
        self.pool = ThreadPoolExecutor(max_workers=max(2, fragments), thread_name_prefix="exchange")
        self.bytes_sent = 0.0
        self.bytes_received = 0.0
        self.refused = self.lost = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if group.leader:
            self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True)
            self._beat.start()

    # --- the agreement ---------------------------------------------------------------------------------------
    def _arrived(self, agreed: list[int], p: int) -> bool:
        """Has exchange ``pending[p]`` ended on every rank, with the same version everywhere?"""
        k = self.pending[p]
        return agreed[at(p, DONE)] >= k and agreed[at(p, VMIN)] == -agreed[at(p, VNEG)]

    def _pulls(self, p: int) -> bool:
        """Does this rank download fragment p? (its movers; the leader alone with a pull codec)"""
        return self.group.leader if self.pull_codec is not None else self.plan.moves(p)

    def _check(self) -> None:
        """Raise an exchange thread's error on the main thread."""
        for f in self.futures.values():
            if f.done() and f.exception() is not None:
                f.result()

    # --- the Transport of IslandWorker.run --------------------------------------------------------------------
    def reserve_step(self) -> bool:
        """The leader takes a step of its lease (:class:`~atoll.runtime.service.lease.StepLease`), and every
        rank learns whether to take it, with the agreement of this step."""
        while True:
            if self.lease is not None:
                self.agreement.update({0: self.lease.take()})
            agreed = self.agreement.agree()
            if agreed[0] != WAIT:
                return agreed[0] == GO
            self._check()
            time.sleep(self.poll_s)

    def start(self) -> list[Pull]:
        """Pull the newest global fragments (what each rank holds of them, the same versions on every rank): the
        island's start."""
        for p in range(len(self.plan.numels)):
            self._begin(p, None)
        pulls: list[Pull] = []
        while self.pending:
            pulls += self._drain()
        return sorted(pulls, key=lambda pull: pull.fragment)

    def send(self, push: Push) -> None:
        """Encode this rank's slice of ``push`` (the raw Δ of the plan's send range) and start its exchange."""
        p, plan = push.fragment, self.plan
        delta: torch.Tensor | None = push.delta if plan.moves(p) else None
        if plan.sharded and plan.leader_moves and self.group.size > 1:  # the leader gathers the shards' slices
            gathered = self.group.gather(push.delta, plan.sizes(p))
            delta = None if gathered is None else slices.assemble(
                plan.numels[p], [(part.ranges, d) for part, d in zip(plan.parts[p], gathered, strict=True)])
        payload = self._encode(delta, p) if delta is not None else None
        if self.group.leader:
            moved = [plan.numels[p]] if plan.leader_moves else [n for n in plan.sizes(p) if n]
            self.bytes_sent += sum(self.codec.payload_bytes(n) for n in moved)
        credit = self.lease.credit_taken if self.lease is not None else 0
        self._begin(p, Outgoing(payload, push.tokens, push.base_version, time.monotonic() - self.pulled_at[p],
                                credit))

    def _encode(self, delta: torch.Tensor, p: int) -> dict[str, torch.Tensor]:
        """The codec's payload of ``delta`` (with the island's error feedback and random source)."""
        if self.wire.codec is None:
            return {"values": delta.detach().to("cpu", torch.float32).contiguous()}
        t0 = time.perf_counter()
        tensors = self.wire.encode(0, delta.detach().to("cpu", torch.float32), f"fragment{p}").tensors
        self.wire.codec_s[0] += time.perf_counter() - t0
        return tensors

    def _begin(self, p: int, out: Outgoing | None) -> None:
        self.count[p] += 1
        k = self.pending[p] = self.count[p]
        if self.plan.moves(p) or self.group.leader:
            self.futures[p] = self.pool.submit(self._exchange, p, k, out)

    def arrived(self) -> list[Pull]:
        """The fragments the last agreement found pulled by every rank, assembled (collective)."""
        return self._collect([p for p in sorted(self.pending) if self._arrived(self.agreement.agreed, p)])

    def settle(self, fragment: int) -> list[Pull]:
        """Agree until fragment's exchange has ended on every rank (and with it any other that did)."""
        pulls: list[Pull] = []
        while fragment in self.pending:
            pulls += self._drain()
        return pulls

    def _drain(self) -> list[Pull]:
        """One round of the agreement and the exchanges it finds ended (a short sleep if none)."""
        agreed = self.agreement.agree()
        done = [p for p in sorted(self.pending) if self._arrived(agreed, p)]
        if not done:
            self._check()
            time.sleep(self.poll_s)
        return self._collect(done)

    def close(self) -> None:
        """Wait until every exchange has ended (its push merged or refused, its answer pulled)."""
        try:
            while self.pending:
                self._drain()
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop: the heartbeats end, and exchanges waiting for the agreement raise (an island that stops on an
        error does not wait for them)."""
        self._stop.set()
        self.agreement.close()
        self.pool.shutdown(wait=False)
        if self._beat is not None and self._beat is not threading.current_thread():
            # a daemon thread still inside a gRPC call when the channels close and the interpreter ends is
            # one way to an abort at exit: its call has a 5 s deadline, so this wait is bounded
            self._beat.join(timeout=6.0)

    def _collect(self, fragments: list[int]) -> list[Pull]:
        pulls = []
        for p in fragments:
            future = self.futures.pop(p, None)
            if future is not None:
                future.result()  # ended with the agreement just seen (or raises its error)
            del self.pending[p]
            if self.group.leader and self.pull_codec is None:  # float32 slices every rank downloaded (a pull codec's:
                # counted by _decoded)
                moved = [self.plan.numels[p]] if self.plan.leader_moves else [n for n in self.plan.sizes(p) if n]
                self.bytes_received += 4.0 * sum(moved)
            pulls.append(self._assemble(p))
            self.pulled_at[p] = time.monotonic()
        return pulls

    def _assemble(self, p: int) -> Pull:
        """What this rank holds of fragment p, as the island pulled it (collective over the island)."""
        plan, group = self.plan, self.group
        version = self.agreement.entry(p, VMIN)
        if self.pull_codec is not None:
            return replace(self._decoded(p, version), realign=bits_share(self.agreement.entry(p, SHIFT)))
        mine = self.pulled.pop(p, (version, torch.empty(0)))[1]
        if group.size == 1:
            values = mine
        elif not plan.leader_moves:
            values = mine if plan.sharded else group.all_gather(mine, plan.sizes(p))
        elif plan.sharded:
            values = group.scatter([slices.take(mine, part.ranges) for part in plan.parts[p]] if group.leader
                                   else None, plan.sizes(p))
        else:
            values = group.broadcast(mine if group.leader else None, plan.numels[p])
        # realign_pushes: the share of a round the answer to the leader's push said (0: none), the same on every
        # rank (the agreement's), so every rank shifts its schedule alike at this adoption's step
        return Pull(p, values, version, realign=bits_share(self.agreement.entry(p, SHIFT)))

    def _decoded(self, p: int, version: int) -> Pull:
        """(A pull codec's; collective over the island.) The leader's download of fragment p's pull at
        ``version``, broadcast to every rank as bytes and decoded there: the full fragment (float32 (numel_p,))
        or the pull codec's payloads since the version the island holds; a rank of a sharded island keeps its
        part (the payloads decoded and cut: codec ``"fp32"``). The leader counts its bytes (``Pull.nbytes``).

        Raises:
            ValueError: the syncer's bytes are not such a pull (checked as from a stranger).
        """
        plan, group, codec = self.plan, self.group, self.pull_codec
        assert codec is not None
        since, data = self.pulled.pop(p, (version, (None, None)))[1] if group.leader else (None, None)
        size, since_or = group.broadcast_ints([len(data), -1 if since is None else since] if group.leader else [0, 0])
        data = group.broadcast_bytes(data if group.leader else None, size)
        numel = plan.numels[p]
        if since_or < 0:
            values = wire.bytes_tensor(data)
            if values.dtype != torch.float32 or tuple(values.shape) != (numel,):
                raise ValueError(f"pull: fragment {p} is float32 ({numel},), the syncer sent {values.dtype} "
                                 f"{tuple(values.shape)}")
            pull = Pull(p, values, version)
        else:
            pull = Pull(p, None, version, deltas=wire.bytes_deltas(data, codec, numel, version - since_or),
                        since=since_or)
        if group.leader:
            self.bytes_received += pull.nbytes
        if not plan.sharded:
            return pull
        ranges = plan.parts[p][plan.rank].ranges
        if pull.params is not None:
            return Pull(p, slices.take(pull.params, ranges), version)
        return Pull(p, None, version, since=pull.since, deltas=tuple(
            Encoded({"values": slices.take(codec.decode(enc), ranges)}, plan.held[p].numel(), "fp32")
            for enc in pull.deltas))

    # --- an exchange, in its thread ---------------------------------------------------------------------------
    def _upload_id(self, p: int, k: int, rank: int) -> str:
        return f"{self.session}.{p}.{k}.{rank}"

    def _upload_ids(self, p: int, k: int) -> list[str]:
        """The uploads of push k of fragment p: one per rank that moves a slice of it (what its commit lists)."""
        return [self._upload_id(p, k, r) for r in self.plan.movers(p)]

    def _exchange(self, p: int, k: int, out: Outgoing | None) -> None:
        """Exchange k of fragment p on this rank (``out`` None: a pull alone)."""
        plan, client = self.plan, self.route[p]
        # (the leader) the tokens its push claims (0: none granted, not committed)
        claim = self._claim(p, out) if self.group.leader and out is not None else 0
        answer: dict[str, Any] | None = None  # the commit's, when it rode on the leader's upload
        if self.ranks_move and plan.moves(p):
            if out is not None and out.payload is not None:
                data, upload = wire.payload_bytes(out.payload), self._upload_id(p, k, plan.rank)
                if claim > 0:  # the leader's slice carries the commit: answered once every slice is up
                    answer = self._upload_commit(p, k, out, claim, data, upload)
                else:
                    client.upload(data, p, plan.moved(p), upload)
            self.agreement.set(p, UP, k)
        if self.group.leader:
            share = 0.0
            if out is not None and claim > 0:
                share = self._commit(p, k, out, claim, answer)
            # the answer's realignment with READY, under one lock: every rank reads this exchange's
            self.agreement.update({at(p, READY): k, at(p, SHIFT): share_bits(share)})
        if not self._pulls(p):
            return
        self.agreement.wait(lambda a: a[at(p, READY)] >= k)
        if self.pull_codec is not None:  # the leader alone, the whole fragment's pull for the version held
            version, since, data = client.download_bytes(p, have=None if out is None else out.base_version)
            self.pulled[p] = (version, (since, data))
            self.agreement.update({at(p, DONE): k, at(p, VMIN): version, at(p, VNEG): -version})
            return
        while True:  # until every rank holds the same version (a commit may fall between two ranks' downloads)
            version, values = client.download(p, plan.moved(p) if self.ranks_move else None)
            self.pulled[p] = (version, values)  # (read on the main thread once the agreement says DONE)
            self.agreement.update({at(p, DONE): k, at(p, VMIN): version, at(p, VNEG): -version})
            if self._settled(p, k, version):
                return

    def _settled(self, p: int, k: int, version: int) -> bool:
        """Wait until every rank downloaded exchange k of fragment p: True when they hold the same version,
        False when this rank's ``version`` is older than another's (it downloads again)."""
        agreed = self.agreement.wait(lambda a: a[at(p, DONE)] >= k and (
            a[at(p, VMIN)] == -a[at(p, VNEG)] or version < -a[at(p, VNEG)]))
        return agreed[at(p, VMIN)] == -agreed[at(p, VNEG)]

    def _claim(self, p: int, out: Outgoing) -> int:
        """(The leader.) The tokens push ``out`` of fragment p claims: less the steps its lease did not grant;
        0: none granted (the budget was spent): the push is not committed, the newest is pulled."""
        return self.lease.claimable(p, out.tokens, out.credit_mark) if self.lease is not None else out.tokens

    def _upload_commit(self, p: int, k: int, out: Outgoing, claim: int, data: wire.Sendable,
                       upload: str) -> dict[str, Any] | None:
        """(The leader, whose rank moves a slice.) Upload its slice of push k of fragment p carrying the push's
        commit: the syncer's answer, or None when the syncer did not commit it (the other slices were late, or it
        lost them: :meth:`_commit` commits or counts it lost)."""
        ids = self._upload_ids(p, k)
        request = self.route[p].push_request(ids, p, claim, out.base_version, self.session, out.round_s)
        try:
            return self.route[p].upload_commit(data, p, self.plan.moved(p), upload, request)
        except UploadLost:  # (the slice is up: _commit's Push finds the others lost too, and counts it)
            return None

    def _commit(self, p: int, k: int, out: Outgoing, claim: int, answer: dict[str, Any] | None) -> float:
        """(The leader.) Commit push k of fragment p claiming ``claim`` tokens (``answer``: committed already,
        on the leader's upload), then wait until it has left the syncer's buffer. Returns the realignment the
        answer to its merge carried (``realign_pushes``: a share of a round in [0, 1); 0.0 when none, or when
        the push was refused or lost)."""
        # (to another shard than the coordinator, the commit carries its newest grant)
        if answer is None and self.ranks_move:  # the slices' uploads carried no commit, or it was not answered
            self.agreement.wait(lambda a: a[at(p, UP)] >= k)  # every slice is up
            ids = self._upload_ids(p, k)
            try:
                answer = self.route[p].commit(ids, p, claim, out.base_version, self.session, out.round_s)
            except UploadLost:  # the other ranks' slices cannot be sent again from here: the push is lost
                self.lost += 1
                return 0.0
        elif answer is None:
            assert out.payload is not None
            answer = self.route[p].push(wire.payload_bytes(out.payload), p, ((0, self.plan.numels[p]),), claim,
                                        out.base_version, self.session, out.round_s)
        self.refused += not answer["accepted"]
        if not answer["accepted"]:
            return 0.0
        if not answer["answered"]:  # waits in the buffer for a quorum or its grace window
            ask = schema.BufferedRequest(fragment=p, wait_s=wire.MAX_WAIT_S)  # answered once merged (or MAX_WAIT_S)
            while p in (answer := self.route[p].call("Buffered", ask, timeout_s=wire.MAX_WAIT_S + 30.0))["buffered"]:
                time.sleep(self.poll_s)  # never back to back (answered at once: an older syncer, or slots taken)
        # the realignment of its merge's answer (a syncer with realign_pushes; the schema checked its range, and
        # share_bits checks it again)
        return answer.get("realign") or 0.0

    def _heartbeat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with contextlib.suppress(grpc.RpcError):  # the syncer is down: the calls that matter retry themselves
                self.client.call("Heartbeat", schema.HeartbeatRequest(), timeout_s=5.0, retry=False)

    def counters(self) -> dict[str, Any]:
        """What this rank moved: its bulk connections' bytes up and down (to every shard)."""
        return {k: sum(getattr(c, k) for c in set(self.route)) for k in ("bytes_up", "bytes_down")}
