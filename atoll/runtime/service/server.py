"""``atoll syncer``: one :class:`~atoll.runtime.service.syncer.SyncerService` served over gRPC.

Every call is authenticated: its metadata carries the caller's island index and secret (``atoll-island``,
``atoll-credential``), checked with the syncer's own admission check
(:meth:`Admission.identity <atoll.strategies.decoupled.trust.Admission.identity>`, constant time) before
anything else; a call without them (``no_credential``), naming no island of the run (``island``) or with
another island's secret (``identity``) is refused with UNAUTHENTICATED, counted in ``refused_calls`` by
reason and logged (at a bounded rate: :class:`~atoll.runtime.service.calls.Gate`). Its request is then parsed
by the service's schema (:mod:`~atoll.runtime.service.schema`: one typed record per request, every field
bounded); one that fails it is refused with INVALID_ARGUMENT naming the field and counted as ``schema``, and
the handlers receive typed records only. A push that passes is then checked as the syncer checks every push
(identity, freshness: a replay is refused and counted as ``replay``, bounds). Payloads are JSON and
safetensors only.

**Joins and sessions.** A ``Join`` carries the record of the island's run settings and its digest
(:mod:`atoll.config.run_record`); one that differs from the syncer's is refused with FAILED_PRECONDITION and one
line naming the first differing setting and both values, counted as ``settings``. Each join opens a new
session and fences the ones before it: a control call carrying an older session (``Heartbeat``,
``ReserveSteps``, ``Buffered``, ``Push``, ``Leave``) is refused with ABORTED and counted as ``stale_session``,
and the island's job stops (a second job of one island index, or an old torchrun attempt, never acts for the
live session: its ``Leave`` returns no lease of the live session's).

**Slices.** Each rank of an island job uploads its slice of a push over its own connection: the ``Upload``
header names the fragment and the slice's ranges of its element order (:mod:`~atoll.runtime.service.slices`),
and its bytes are the codec's encoded payload (:func:`~atoll.runtime.service.wire.payload_bytes`, at most what
the run's codec makes of that many values). The island's leader commits the push, listing its slices' uploads:
in its own slice's ``Upload`` header (answered in that call's reply once every slice is up: no round trip after
the last byte), or with ``Push`` when a slice came late; the server decodes each with the run's codec, checks
that they tile the fragment exactly (else the push is refused and counted as ``slices``) and reassembles the
island's Δ before the syncer's own checks, so admission, bounds, sessions and one vote per island stay per
island. The bytes a push counts (``nbytes``) are those of the payloads received. ``Download`` serves the float32
values of the newest global fragment at the ranges asked for (all of it by default), so each rank pulls its own
slice.

**Leases.** ``ReserveSteps`` grants a lease of ``n`` steps (an island job asks a round ahead of need), with
the steps of its session the island has used and received; ``Leave`` gives the unused back
(:meth:`~atoll.runtime.service.syncer.SyncerService.reserve_steps`). An island holds at most 3 rounds of steps
granted and not used: a lease beyond is cut, one when it holds that many (``lease``) or whose ``used`` fell
(``used``) is answered ``{"granted": 0, "wait": true}`` (ask again) and counted. No step is granted before every
island has joined (``{"granted": 0, "wait": true}``), or ``collective_timeout_s`` after the first did: the
islands start together, as the learners of one run, and an island job that takes longer to start (torchrun,
a cold data cache) does not find the budget spent by the others.

**Sharded by fragment** (``atoll syncer --shard S --shards ADDR0,ADDR1,...``): each shard serves the same
calls for its own fragments (:mod:`~atoll.runtime.service.shards`: ownership, the map checked at the join,
the coordinator's grants, the peer calls of the run's end); shard 0 alone grants leases, opens sessions and
ends the run. The tensors' calls are :mod:`~atoll.runtime.service.bulk`'s. Both are collaborators the server
holds (:class:`~atoll.runtime.service.shards.Shards`, :class:`~atoll.runtime.service.bulk.Bulk`), given the
service, the lock and the gate; every method is registered in one place, :meth:`SyncerServer.handler`.

Threads: gRPC runs calls on a pool of threads; every call into the service holds one lock, so the
service sees one call at a time, as the Ray actor does. Tensor bytes are received and sent outside the
lock, so a slow upload never holds up a heartbeat; and transfers are admitted apart, within ``bulk_slots``
and ``island_transfers`` (:meth:`Bulk.admitted <atoll.runtime.service.bulk.Bulk.admitted>`), so they never
take the control calls' threads. A poll thread closes due grace windows, writes
``<out>/service/status.json`` (commits, versions, refusals: for operators and tests) and ends the run once
the step budget is spent and every island that joined has left (or ``collective_timeout_s`` after the
budget was spent). The service checkpoints atomically after every commit (``<out>/syncer``); restarted on
the same folder it continues from its newest checkpoint, and the islands, which retry with backoff, resume.
At the end the global model is evaluated and saved, with a summary, in the run folder ``<out>/run``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from atoll.algorithms.finite import l2_norm
from atoll.config import TrainConfig
from atoll.config.run_record import digest as record_digest
from atoll.config.run_record import mismatch, run_record
from atoll.config.runtimes import ServiceConfig
from atoll.runtime.service import schema, slices, wire
from atoll.runtime.service.bulk import Bulk, Transfer
from atoll.runtime.service.calls import Gate
from atoll.runtime.service.monitor import island_states
from atoll.runtime.service.shards import Shards
from atoll.runtime.service.syncer import LeaseRefused, SyncerService, prepare
from atoll.runtime.service.syncer_shards import peer_token
from atoll.strategies.base import codec_of
from atoll.strategies.decoupled import DecoupledConfig
from atoll.strategies.decoupled.journal import JOURNAL_SIZE
from atoll.strategies.decoupled.protocol import Push

#: answers to completed pushes remembered per island, so a commit retried after a lost reply is not a replay
ANSWERS = 16
#: superseded island jobs remembered per island (their torchrun restarts are refused at the join)
JOBS_KEPT = 16
#: a control method's handler: (the caller's island and secret, its request, the call) -> the reply
Handle = Callable[[tuple[int, str], Any, grpc.ServicerContext], schema.Record]


class SyncerServer:
    """The gRPC handlers around one :class:`SyncerService` (see the module docstring).

    Args:
        service: the syncer service it serves (:meth:`of_run` builds it from a run's settings).
        strategy: the decoupled strategy's config: the codec a push's payload must be encoded with.
        settings: the service runtime's config (``collective_timeout_s``: how long the islands' joins and the
            end wait for a missing island).
        out: the syncer's folder (``syncer/`` checkpoints, ``service/status.json``, ``run/`` at the end), the
            service's.
        key: the run's secret of a syncer sharded by fragment (see :class:`SyncerService` and the module
            docstring); empty unsharded.
    """

    def __init__(self, service: SyncerService, strategy: DecoupledConfig, settings: ServiceConfig, out: Path,
                 key: bytes = b"") -> None:
        self.service, self.out = service, Path(out)
        self.islands = service.run.islands
        self.timeout_s = settings.collective_timeout_s  # (the islands' joins, the end's wait)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified when a push may have left a buffer
        self.done = threading.Event()
        self.gate = Gate(self.islands, lambda i, c: service.syncer.admission.identity(i, c),
                         peer_token(key) if service.shard is not None else None, self.lock)
        self.shards = Shards(service, self.lock, self.gate, self.done)
        # the run's codec: what a push's payload must be (the islands encode with the same settings)
        self.codec = codec_of(strategy)
        self.bulk = Bulk(service, self.codec, self.lock, self.gate, self.shards, slots=settings.bulk_slots,
                         per_island=settings.island_transfers, chunk_timeout_s=settings.chunk_timeout_s,
                         commit=self._commit_riding)
        self.waiting = [0] * self.islands  # per island, its Buffered calls waiting (a long poll each)
        self.answers: dict[int, OrderedDict[str, schema.PushReply]] = {i: OrderedDict() for i in range(self.islands)}
        self.calls: dict[str, int] = {}  # control calls received, by method (refused ones too)
        self.count_lock = threading.Lock()
        # island -> its report at leaving; kept beside the checkpoints so a restarted syncer knows who left
        self.left: dict[int, dict[str, Any]] = self._load_left()
        self.spent_at: float | None = None
        # the record of the run's settings and its digest (atoll.config.run_record), compared with each island's
        # at its join; None: not checked (a server built without its run's config)
        self.record: dict[str, str] | None = None
        self.digest = ""
        # per island: the job id of its present session, and the jobs a newer job superseded (the newest JOBS_KEPT)
        self.job_of: dict[int, str] = {}
        self.superseded_jobs: dict[int, OrderedDict[str, None]] = {}
        self.final: dict[str, Any] | None = None
        self.written_status: str | None = ""  # None: the last write failed
        # the run events tick() drains from the service, for the live view (atoll.runtime.service.monitor)
        self.drained: deque[tuple[str, dict[str, Any]]] = deque(maxlen=JOURNAL_SIZE)

    @classmethod
    def of_run(cls, config: TrainConfig, out: Path, credentials: list[str], shard: int = 0, shards: int = 1,
               key: bytes = b"") -> SyncerServer:
        """The server of a run's settings ``config`` (the same the islands are given; its runtime ``service``):
        its :class:`SyncerService` in ``out`` (:func:`~atoll.runtime.service.syncer.prepare`), shard
        ``shard`` of ``shards`` of a syncer sharded by fragment with the run's secret ``key``, the islands'
        ``credentials``.

        Raises:
            ConfigError: ``config`` is not a run of the service runtime.
        """
        settings = ServiceConfig.of_run(config)
        run, index, syncer, spec = prepare(config, credentials, shard=shard, shards=shards, key=key)
        service = SyncerService(run, index, syncer, str(out), spec, key=key, pid_dir="service")
        server = cls(service, config.strategy_config, settings, out, key=key)
        server.record = run_record(config)
        server.digest = record_digest(server.record)
        return server

    # --- what the drivers and the status read -------------------------------------------------------------
    @property
    def refused_calls(self) -> dict[str, int]:
        """Calls refused, by reason (the gate's count)."""
        return self.gate.refused

    @property
    def shard(self) -> Any:
        """This shard's :class:`~atoll.runtime.service.syncer_shards.ShardSpec` (None unsharded)."""
        return self.shards.shard

    @property
    def coordinator(self) -> bool:
        """Is this the coordinator (shard 0, or an unsharded syncer)?"""
        return self.shards.coordinator

    @property
    def finished(self) -> schema.FinishReply | None:
        """This shard's answer to the coordinator's ``Finish`` (None before)."""
        return self.shards.finished

    # --- control ------------------------------------------------------------------------------------------
    def join(self, caller: tuple[int, str], req: schema.JoinRequest,
             context: grpc.ServicerContext) -> schema.JoinReply:
        """An island (re)joins (the coordinator): its new session and steps so far, and, sharded, its grant."""
        island, credential = caller
        self.shards.coordinator_only(context, "Join")
        self.shards.check_map(req, context)
        if (refusal := self._settings_refusal(island, req)) is not None:
            self.gate.refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "settings", refusal)
        with self.lock:
            superseded = self._job_superseded(island, req.job)
        if superseded is not None:
            self.gate.refuse(context, grpc.StatusCode.ABORTED, "stale_session", superseded)
        with self.lock:
            _, versions, steps, session = self.service.join(island, credential)
            self.left.pop(island, None)
            self._save_left()
            return schema.JoinReply(versions=versions, steps=steps, session=session, **self.shards.grant(island))

    def _settings_refusal(self, island: int, req: schema.JoinRequest) -> str | None:
        """Why ``island``'s join is refused for its run's settings (one line: the first setting its record has
        otherwise than the syncer's, both values), or None: the same run, or nothing to compare (a server
        without its run's record, a join without one)."""
        if self.record is None or (req.digest is None and req.settings is None) or req.digest == self.digest:
            return None
        if req.settings is None:
            return (f"settings: island {island}'s run settings differ from the syncer's (their digests differ); "
                    "start every island with the syncer's run.toml")
        return mismatch(island, self.record, dict(req.settings)) or (
            f"settings: island {island}'s digest of its run settings is not the digest of its record; run the same "
            "atoll on the syncer and the islands")

    def _job_superseded(self, island: int, job: str | None) -> str | None:
        """(Under the lock.) Why the join of ``island``'s job ``job`` is refused: a newer job of the island
        superseded it (its torchrun restarts would supersede the newer job in turn); or None, the job noted as the
        present session's, and the job it replaces, if another, as superseded."""
        if job is None:
            return None
        jobs = self.superseded_jobs.setdefault(island, OrderedDict())
        if job in jobs:
            return (f"session: island {island} was joined by another job (with --island {island}) after this one; "
                    "this job stops: run one job per island index")
        before = self.job_of.get(island)
        if before is not None and before != job:
            jobs[before] = None
            while len(jobs) > JOBS_KEPT:
                jobs.popitem(last=False)
        self.job_of[island] = job
        return None

    def _stale(self, island: int, session: int | None) -> str | None:
        """(Under the lock.) Why a call of ``island`` carrying ``session`` is refused as ``stale_session`` (one
        line: a newer join superseded that session, so this job stops), or None (a later session than the
        syncer's becomes the present one: :meth:`~atoll.strategies.decoupled.trust.Admission.seen`)."""
        admission = self.service.syncer.admission
        if not admission.stale(island, session):
            admission.seen(island, session)
            return None
        return (f"session: island {island} joined again as session {admission.session[island]} (another job with "
                f"--island {island}, or a restart) and this job's session {session} is over; this job stops: run one "
                "job per island index")

    def _fence(self, island: int, session: int | None, context: grpc.ServicerContext) -> None:
        """Refuse (ABORTED) and count as ``stale_session`` a call of a superseded session (:meth:`_stale`)."""
        with self.lock:
            why = self._stale(island, session)
        if why is not None:
            self.gate.refuse(context, grpc.StatusCode.ABORTED, "stale_session", why)

    def hello(self, caller: tuple[int, str], req: schema.HelloRequest,
              context: grpc.ServicerContext) -> schema.HelloReply:
        return self.shards.hello(caller[0], req, context)

    def reserve_steps(self, caller: tuple[int, str], req: schema.ReserveStepsRequest,
                      context: grpc.ServicerContext) -> schema.ReserveStepsReply:
        """A lease of up to ``n`` steps; ``used``: the steps of its session the island has taken, ``received``:
        those it was granted (``loss``, ``lr``: its last, for the progress). Fewer than ``n`` granted: the budget
        is spent; ``wait``: ask again shortly: the run has not started (not every island joined), or the lease
        is refused (:class:`~atoll.runtime.service.syncer.LeaseRefused`: the island's ``used`` decreased, or it
        holds as many steps it has not used as an honest island can), counted in ``refused_calls`` by reason
        (``used``, ``lease``)."""
        island, credential = caller
        self.shards.coordinator_only(context, "ReserveSteps")
        refused: LeaseRefused | None = None
        with self.lock:
            why = self._stale(island, req.session)
            if why is None and not self._started():
                return schema.ReserveStepsReply(granted=0, wait=True)
            if why is None:
                try:
                    granted = self.service.reserve_steps(
                        island, credential, req.n, used=req.used, loss=req.loss, lr=req.lr, compute_s=req.compute_s,
                        bytes_sent=req.bytes_sent, bytes_received=req.bytes_received, received=req.received)
                    return schema.ReserveStepsReply(granted=granted, **self.shards.grant(island))
                except LeaseRefused as e:
                    refused = e
        if refused is not None:  # nothing granted; the island asks again (counted outside the lock: the gate's)
            self.gate.note(refused.reason, context.peer(), str(refused))
            return schema.ReserveStepsReply(granted=0, wait=True)
        self.gate.refuse(context, grpc.StatusCode.ABORTED, "stale_session", why or "")

    def _started(self) -> bool:
        """(Under the lock.) Has the run started (:meth:`~atoll.runtime.service.syncer.SyncerService.started`)?"""
        return self.service.started(self.timeout_s)

    def buffered(self, caller: tuple[int, str], req: schema.BufferedRequest,
                 context: grpc.ServicerContext) -> schema.BufferedReply:
        """The run's fragments of this shard whose buffer holds a push of the island's not merged yet.

        A long poll: with ``fragment`` (the run's index) and ``wait_s`` (seconds, at most
        :data:`~atoll.runtime.service.wire.MAX_WAIT_S`) the answer comes once that fragment's buffer no longer
        holds the island's push (merged at a quorum or its grace window), or when ``wait_s`` has passed, so an
        island waiting for its push to merge makes one call per merge, not one per poll interval (each call
        costs CPU on the syncer's host and on the island's). With ``realign_pushes``, the answer that finds
        ``fragment``'s push merged carries ``realign``: the share of a round it arrived behind the fragment's
        previous, larger merge (:meth:`SyncerService.merged_answer
        <atoll.runtime.service.syncer.SyncerService.merged_answer>`, said once), as ``Push``'s answer does for a
        push merged at once."""
        island = caller[0]
        self._fence(island, req.session, context)
        deadline = time.monotonic() + min(req.wait_s, wire.MAX_WAIT_S)
        with self.changed:
            # an island waits on at most one call per fragment of this shard: more are answered at once, so no
            # island can hold the threads the other islands' calls need
            waits = self.waiting[island] < len(self.service.fragment_ids)
            self.waiting[island] += waits
            try:
                while True:
                    ids = [self.service.fragment_ids[j] for j in self.service.buffered(island)]
                    left = deadline - time.monotonic()
                    if req.fragment is not None and req.fragment not in ids and \
                            req.fragment in self.service.fragment_ids:  # its push merged: its answer's share
                        share = self.service.merged_answer(island, self.service.fragment_ids.index(req.fragment))
                        return schema.BufferedReply(buffered=ids, **({} if share is None else {"realign": share}))
                    if req.fragment not in ids or left <= 0 or not waits or not context.is_active():
                        return schema.BufferedReply(buffered=ids)
                    self.changed.wait(min(left, 0.5))
            finally:
                self.waiting[island] -= waits

    def heartbeat(self, caller: tuple[int, str], req: schema.HeartbeatRequest,
                  context: grpc.ServicerContext) -> schema.HeartbeatReply:
        """The island is alive; answers whether the step budget is spent (a superseded session: refused). A call
        of the island's present session takes no lock (:meth:`SyncerService.alive
        <atoll.runtime.service.syncer.SyncerService.alive>`): a merge holds the lock for up to a fragment's outer
        step, and a heartbeat that waited behind it would read as a lost island (bench/out/service_link: 752 ms)."""
        self.shards.coordinator_only(context, "Heartbeat")
        if self.service.alive(caller[0], req.session):
            return schema.HeartbeatReply(spent=self.service.reserved >= self.service.budget)
        with self.lock:
            why = self._stale(caller[0], req.session)
            if why is None:
                self.service.heartbeat(caller[0])
                return schema.HeartbeatReply(spent=self.service.reserved >= self.service.budget)
        self.gate.refuse(context, grpc.StatusCode.ABORTED, "stale_session", why)

    def pull_meta(self, caller: tuple[int, str], req: schema.FragmentRequest,
                  context: grpc.ServicerContext) -> schema.VersionReply:
        """The newest version of a fragment."""
        fragment = self.shards.fragment(req.fragment, context)
        with self.lock:
            return schema.VersionReply(version=self.service.syncer.version(fragment))

    def push(self, caller: tuple[int, str], req: schema.PushRequest,
             context: grpc.ServicerContext) -> schema.PushReply:
        """Commit a push whose slices were uploaded (``slices``: their upload ids, the island's ranks' or one):
        decode each with the run's codec, reassemble the fragment's Δ, hand it to the syncer; answer (accepted,
        answered: merged or refused now, the version to pull; merged now with ``realign_pushes``: ``realign``)."""
        island, credential = caller
        if self.shards.finished is not None:  # the coordinator gathered this shard: the run is over
            context.abort(grpc.StatusCode.UNAVAILABLE, "the run is over")
        key = "\n".join(req.slices)
        with self.lock:
            if key in self.answers[island]:  # a retry whose first reply was lost: the same answer
                return self.answers[island][key]
            uploads = self.bulk.taken(island, req.slices)
            stale = self.service.syncer.admission.stale(island, req.session)
        if stale:  # a superseded session's push (its uploads dropped): refused and counted as stale_session
            self._fence(island, req.session, context)
        if uploads is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "upload: incomplete or unknown; upload it again")
        fragment, tokens, syncer = req.fragment, req.tokens, self.service.syncer
        if fragment < len(self.shards.owners):  # this shard's syncer's index (another shard's: refused)
            fragment = self.shards.own(fragment, context)
        ours = fragment < syncer.fragments  # else a fragment of no run's: the syncer refuses it
        delta: Any = None  # a fragment of no run's, or a payload that does not decode: the syncer refuses it
        nbytes, norm = 0, None
        if self.service.grants is not None and ours:
            with self.lock:  # a shard checks the coordinator's grant first: the tokens and session it vouches for
                grant = req.grant.model_dump() if req.grant is not None else None
                if reason := self.service.admit_grant(island, grant, req.session):
                    self.service.refuse(island, fragment, reason, tokens)
                    return self._answer(island, key, False, fragment)
        if ours:
            numel = syncer.numels[fragment]
            if any(h.fragment != fragment for h in uploads) or not slices.tiles([h.ranges for h in uploads], numel):
                with self.lock:
                    self.service.refuse(island, fragment, "slices", tokens)
                    return self._answer(island, key, False, fragment)
            try:  # decoded outside the lock: a large push never holds up the other islands' calls
                delta, nbytes = self.bulk.assemble(uploads, numel)
                norm = l2_norm(delta)  # (this pass too outside the lock; the syncer checks it there)
            except Exception:  # noqa: BLE001 - a stranger's payload: refused by the syncer's check (type), counted
                delta, norm = None, None
        msg = Push(island, fragment, delta, tokens, req.base_version, nbytes=nbytes, round_s=req.round_s,
                   session=req.session, credential=credential)
        with self.lock:
            # a join may have superseded the push's session while it was decoded, outside the lock: fenced as at
            # its start (the syncer would count it a replay); a session once superseded stays so
            superseded = syncer.admission.stale(island, req.session)
            if not superseded:
                # the version only, no copy under the lock: delta is this push's own tensor, its norm taken above
                accepted, pull = self.service.push(msg, values=False, norm=norm, owned=True)
                self.changed.notify_all()
                # merged now, with realign_pushes: the share of a round it arrived behind (SyncerService._answer)
                share = {"realign": pull.realign} if pull is not None and accepted and syncer.realign else {}
                answer = schema.PushReply(accepted=accepted, answered=pull is not None,
                                          version=pull.version if pull is not None else None, **share)
                self._remember(island, key, answer)
        if superseded:
            self._fence(island, req.session, context)
        return answer

    def _commit_riding(self, caller: tuple[int, str], req: schema.PushRequest, context: grpc.ServicerContext,
                       transfer: Transfer) -> schema.PushReply | None:
        """A push committed by the upload that carried it (``UploadHeader.commit``), once every slice it names is
        held (:meth:`Bulk.await_slices <atoll.runtime.service.bulk.Bulk.await_slices>`; None when one came late:
        not committed, the island commits with ``Push``), or at once when it was answered before (an upload
        retried after its reply was lost: the same answer); as :meth:`push`, counted as a ``Push`` call."""
        with self.lock:
            known = "\n".join(req.slices) in self.answers[caller[0]]
        if not known and not self.bulk.await_slices(caller[0], req.slices, transfer):
            return None
        with self.count_lock:
            self.calls["Push"] = self.calls.get("Push", 0) + 1
        return self.push(caller, req, context)

    def _answer(self, island: int, key: str, accepted: bool, fragment: int) -> schema.PushReply:
        """A push answered now (refused), remembered for a retried commit (under the lock)."""
        answer = schema.PushReply(accepted=accepted, answered=True, version=self.service.syncer.version(fragment))
        self._remember(island, key, answer)
        return answer

    def _remember(self, island: int, key: str, answer: schema.PushReply) -> None:
        self.answers[island][key] = answer
        while len(self.answers[island]) > ANSWERS:
            self.answers[island].popitem(last=False)

    def leave(self, caller: tuple[int, str], req: schema.LeaveRequest,
              context: grpc.ServicerContext) -> schema.LeaveReply:
        """The island is done: its counters, and ``used``, the steps of its session it took (the rest of its
        lease goes back to the budget)."""
        island = caller[0]
        self.shards.coordinator_only(context, "Leave")
        report = req.model_dump(exclude={"used", "session"}, exclude_none=True)
        with self.lock:
            why = self._stale(island, req.session)  # an older session's Leave never ends the present one's lease
            if why is None:
                returned = self.service.leave_session(island, req.used, req.compute_s, req.bytes_sent,
                                                      req.bytes_received)
                self.left[island] = report
                self._save_left()
                return schema.LeaveReply(ok=True, returned=returned, **self.shards.grant(island))
        self.gate.refuse(context, grpc.StatusCode.ABORTED, "stale_session", why)

    def upload_status(self, caller: tuple[int, str], req: schema.UploadStatusRequest,
                      context: grpc.ServicerContext) -> schema.ReceivedReply:
        return self.bulk.upload_status(caller[0], req)

    def finish(self, caller: tuple[int, str], req: schema.Empty,
               context: grpc.ServicerContext) -> schema.FinishReply:
        return self.shards.finish()

    def close(self, caller: tuple[int, str], req: schema.Empty, context: grpc.ServicerContext) -> schema.OkReply:
        return self.shards.close()

    def _load_left(self) -> dict[int, dict[str, Any]]:
        """The islands that left and their reports (``service/left.json``); {} before any left. An unreadable
        file (damaged) is one line: the islands that left are then waited for ``collective_timeout_s`` at the
        end, and their reports are missing from the summary."""
        path = self.out / "service" / "left.json"
        try:
            saved = wire.loads(path.read_bytes())
            if not isinstance(saved, dict):
                raise ValueError("not a record of islands")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            print(f"atoll: warning: syncer: '{path}' is unreadable ({str(e).splitlines()[0][:80] if str(e) else e!r}); "
                  "the islands that left are not known: the end waits for them up to collective_timeout_s",
                  file=sys.stderr, flush=True)
            return {}
        return {int(k): v for k, v in saved.items() if str(k).isdigit() and isinstance(v, dict)}

    def _save_left(self) -> None:
        """Keep :attr:`left` durably (fsynced, :func:`~atoll.job.checkpoint.write_text_atomic`). A failed write
        (a full disk) is one line: the Leave is answered, and the file is written again at the next one."""
        from atoll.job.checkpoint import write_text_atomic

        try:
            write_text_atomic(self.out / "service" / "left.json",
                              wire.dumps({str(k): v for k, v in self.left.items()}).decode())
        except OSError as e:
            print(f"atoll: warning: syncer: '{self.out / 'service' / 'left.json'}' not written ({e.strerror or e}); "
                  "the leave is kept in memory and written at the next one", file=sys.stderr, flush=True)

    @property
    def joined(self) -> set[int]:
        """Islands that joined the run (in the syncer's checkpoint: a restarted syncer waits for them too)."""
        return {i for i, state in enumerate(self.service.islands) if state.joins > 0}

    # --- the run ------------------------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        """The service's generic handler: raw bytes in and out (no protobuf, no pickle). Every method is here:
        the control methods (unary: who may call, the handler of their typed request), ``Upload``
        (client-streaming) and ``Download`` (server-streaming)."""
        control: dict[str, tuple[str, Handle]] = {  # name -> (who may call: island, peer; its handler)
            "Join": ("island", self.join), "Hello": ("island", self.hello),
            "ReserveSteps": ("island", self.reserve_steps), "Buffered": ("island", self.buffered),
            "Heartbeat": ("island", self.heartbeat), "UploadStatus": ("island", self.upload_status),
            "Push": ("island", self.push), "PullMeta": ("island", self.pull_meta), "Leave": ("island", self.leave),
            "Finish": ("peer", self.finish), "Close": ("peer", self.close)}
        assert set(control) == set(wire.CONTROL), "every control method of the wire, and only those"
        guarded = self.gate.guarded  # an exception no check foresaw: counted by kind, logged, INTERNAL
        methods = {name: grpc.unary_unary_rpc_method_handler(guarded(name, self._unary(name, who, handle)))
                   for name, (who, handle) in control.items()}
        methods["Upload"] = grpc.stream_unary_rpc_method_handler(guarded("Upload", self.bulk.upload))
        methods["Download"] = grpc.unary_stream_rpc_method_handler(guarded("Download", self.bulk.download, True))
        return grpc.method_handlers_generic_handler(wire.SERVICE, methods)

    def _unary(self, name: str, who: str, handle: Handle) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        """Control method ``name``: count the call (``calls`` in the status: what the islands ask how often, for
        operators and benchmarks), check who calls (``who``: an island, or a shard's ``peer``), parse its request
        with the schema, and answer the handler's reply as JSON."""
        model = schema.REQUESTS[name]

        def unary(data: bytes, context: grpc.ServicerContext) -> bytes:
            with self.count_lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            caller = self.gate.peer(context) if who == "peer" else self.gate.caller(context)
            return schema.encode(handle(caller, self.gate.parse(model, data, context, name), context))

        return unary

    def status(self) -> dict[str, Any]:
        """What ``<out>/service/status.json`` holds. A shard of a sharded syncer says which (``shard``,
        ``shards``, ``fragments``: the run's fragments it owns, in the order of ``versions``; ``finished``: it
        merged its last, and was gathered by the coordinator); its ``merged_tokens_by_island`` are shares of its
        own parameters; the budget, leases, joins and leaves are the coordinator's alone."""
        s = self.service
        budget = {"reserved": s.reserved, "budget": s.budget, "steps_by_island": [i.steps for i in s.islands],
                  "joins": [i.joins for i in s.islands], "joined": sorted(self.joined), "left": sorted(self.left),
                  "islands": island_states(s, self.left)} if self.coordinator else {}
        return {**self.shards.status(self.final is not None), "commits": s.syncer.commits,
                "versions": [s.syncer.version(p) for p in range(s.syncer.fragments)], "restarts": s.restarts,
                "merged_tokens_by_island": list(s.syncer.tokens_by_outcome["merged"]),
                "refused_calls": dict(self.refused_calls), "calls": dict(self.calls),
                "handler_errors": dict(self.gate.errors),
                "rejected_updates": s.syncer.rejected_updates,
                "rejected_by_reason": dict(s.syncer.rejected_by_reason), **budget, "done": self.done.is_set()}

    def _buffer_counts(self) -> tuple[int, ...]:
        """The pushes each fragment's buffer holds (under the lock): what a waiting ``Buffered`` call watches."""
        return tuple(len(b.pushes) for b in self.service.syncer.buffers)

    def tick(self) -> None:
        """Close due grace windows, write the status, and end the run when it is over (the poll thread's step)."""
        from atoll.job.checkpoint import write_text_atomic

        with self.lock:
            before = self._buffer_counts()
            # polls: closes due grace windows (and checkpoints a commit); its run events go to the live view
            self.drained.extend(self.service.progress()["events"])
            if self._buffer_counts() != before:  # a push left a buffer: the long polls waiting on it answer now
                self.changed.notify_all()
            now = time.monotonic()
            # (a shard other than the coordinator spends no budget: its run ends when the coordinator closes it)
            if self.coordinator and self.spent_at is None and self.service.reserved >= self.service.budget:
                self.spent_at = now
            over = self.spent_at is not None and (
                (self.joined and self.joined <= set(self.left))
                or now - self.spent_at > self.timeout_s)
            if over and self.final is None:
                self.final = self.service.finish()
                self.done.set()
            status = wire.dumps(self.status()).decode()
        if status != self.written_status:  # written when it changed, not ten times a second
            try:
                write_text_atomic(self.out / "service" / "status.json", status)
            except OSError as e:  # a full disk: one line until a write succeeds again; the syncer goes on
                if self.written_status is not None:
                    print(f"atoll: warning: syncer: status not written ({e.strerror or e}); the syncer goes on",
                          file=sys.stderr, flush=True)
                self.written_status = None
                return
            self.written_status = status
