"""``atoll island``: one island of a decoupled run as a job of its own, which only dials out to ``atoll syncer``.

Launch (one island of R ranks; ``--shard-island`` to shard its model over them with FSDP2)::

    torchrun --nproc-per-node 4 -m atoll island --syncer syncer.example.org:7070 --tls-ca ca.pem \\
        --island 0 --credential island_0.token [--shard-island] RUN FLAGS
    atoll island --syncer ... --island 1 ...            # an island of one rank, without torchrun

Every rank prepares the same data and model shapes as the syncer (the same run settings); the leader (rank 0)
joins (a new session; its inner steps so far, should it be a restart) and holds the island's control
connection (step leases, heartbeats, the commit of a push, ``Leave``); every rank pulls its slice of each
newest global fragment over its own bulk connection (:mod:`~atoll.runtime.service.exchange`) and the ranks
run the learner's loop shared with the Ray runtime (:meth:`IslandWorker.run
<atoll.strategies.decoupled.island.IslandWorker.run>`), each on its rows of the island's batch (the run's
batch split over the ranks: the same tokens per inner step as an island of one rank), the gradient averaged
inside the island (torch DDP, or FSDP2's reduce-scatter). When the step budget is spent the island pushes
what it has not pushed, waits for those exchanges, reports its counters (``Leave``) and exits 0. A rank that
dies ends its island's job (its peers fail their next collective at once and exit with status 3); started
again (torchrun ``--max-restarts``, or the same command), it rejoins from the newest global fragments; its
un-pushed work is lost. The other islands never wait for it beyond the syncer's grace window.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import torch

from atoll.config import TrainConfig
from atoll.config.run_record import digest as record_digest
from atoll.config.run_record import run_record
from atoll.config.runtimes import ServiceConfig
from atoll.errors import ConfigError
from atoll.job.divergence import inject_fault
from atoll.job.island import Island, inner_optimizer
from atoll.runtime.collective.failure import EXIT_PEER_FAILURE, PeerFailure
from atoll.runtime.collective.rank_island import RankIsland
from atoll.runtime.decoupled_job import island_steps, job_of
from atoll.runtime.service import flow, schema
from atoll.runtime.service.client import SyncerClient
from atoll.runtime.service.exchange import ServiceTransport, SlicePlan
from atoll.runtime.service.group import IslandGroup
from atoll.runtime.service.lease import StepLease
from atoll.runtime.service.syncer_shards import shard_map
from atoll.strategies.base import codec_of
from atoll.strategies.decoupled.island import IslandWorker, Job


def read_token(path: Path) -> str:
    """The island's secret from the file ``atoll syncer`` made for it.

    Raises:
        ConfigError: unreadable or empty.
    """
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"credential: cannot read '{path}' ({e.strerror or e}); pass the island_<i>.token file "
                          "atoll syncer made for this island") from None
    if not token:
        raise ConfigError(f"credential: '{path}' is empty; pass the island_<i>.token file atoll syncer made")
    return token


class RankWorker(IslandWorker):
    """A rank of an island job of ``group.size`` ranks: its rows of each batch, the gradient averaged with its
    peers (torch DDP's all-reduce, or FSDP2's reduce-scatter when ``sharded``), the loss the island's mean: its
    :class:`~atoll.runtime.collective.rank_island.RankIsland`, as the collective runtime's ranks.

    A test's kill hook (:mod:`atoll.job.faults`, ``ATOLL_TEST_KILL_RANK_AT_STEP=RANK:STEP[:STOP]`` with RANK
    this island's rank and STEP its inner step, 1-based) is told each step of the job's first start (not of a
    torchrun restart) with ``kind="start"``, as the collective runtime tells its ranks.
    """

    def __init__(self, index: int, job: Job, total_steps: int, group: IslandGroup, rank_island: RankIsland,
                 island: Island, held: list[Any] | None = None, pace: StepPace | None = None) -> None:
        super().__init__(index, job, total_steps, group.device, island=island, held=held)
        self.group, self.rank_island = group, rank_island
        self.pace = pace or StepPace(None)
        self.first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def forward_backward(self, batch: torch.Tensor) -> None:
        if self.first_start:  # a test's kill hook (see the class docstring)
            inject_fault(self.island, self.steps, "start", rank=self.group.rank)
        self.pace.wait()
        self.rank_island.forward_backward(self.island, batch)


class StepPace:
    """The least wall time of one inner step (``emulate_step_s``, seconds; None: no wait): :meth:`wait`, called
    at the start of every inner step, sleeps until ``step_s`` after the previous step's start. It makes the
    declared ``island_speeds`` real for islands sharing one host's CPUs in a benchmark (each island's period is
    set, whatever its ranks or the host's load, as long as its own step is shorter); a step already longer
    (or a wait for a lease or a rejoin between two steps) is not made up for later."""

    def __init__(self, step_s: float | None) -> None:
        self.step_s = step_s
        self.last: float | None = None  # the previous step's start (monotonic seconds)
        self.waited_s = 0.0  # seconds slept in all

    def wait(self) -> None:
        if self.step_s is None:
            return
        now = time.monotonic()
        if self.last is not None and (due := self.last + self.step_s) > now:
            time.sleep(due - now)
            self.waited_s += due - now
            now = due
        self.last = now


def _build(config: TrainConfig, index: int, group: IslandGroup) -> tuple[RankWorker, SlicePlan, Job]:
    """The rank's worker (its island: the whole model under DDP, or its FSDP2 shard, built by its
    :class:`~atoll.runtime.collective.rank_island.RankIsland`) and the slice plan."""
    from atoll.job.run import prepare_inputs

    settings = ServiceConfig.of_run(config)
    sharded = settings.shard_island
    data, model = prepare_inputs(config, notes=group.leader, meta=sharded)  # sharded: shapes only
    job = job_of(config, data, model)
    total = island_steps(config)[index]
    leader_moves = settings.slice_transfer == "leader"
    pace = StepPace(settings.emulate_step_s)
    rank_island = RankIsland(group.size, group.rank, group.device, sharded, group=group.world)
    island = rank_island.build(index, copy.deepcopy(model), job.settings.lasting(total), inner_optimizer(job.own),
                               ddp=group.size > 1 and not sharded, seed=job.facts.seed, init_from=job.facts.init_from)
    if rank_island.layout is not None:
        plan = SlicePlan.sharded_island(job.index, [p.numel() for p in model.parameters()],
                                        rank_island.layout.counts, group.rank, leader_moves)
        return RankWorker(index, job, total, group, rank_island, island, held=plan.held, pace=pace), plan, job
    plan = SlicePlan.whole(job.index, group.rank, group.size, leader_moves)
    return RankWorker(index, job, total, group, rank_island, island, pace=pace), plan, job


def run_island(config: TrainConfig, island: int, clients: list[SyncerClient], group: IslandGroup) -> dict[str, Any]:
    """Train this rank of island ``island`` against the syncer ``clients`` reach (one client per shard of a
    syncer sharded by fragment, shard 0 first; one: unsharded); return the island's counters (the leader's;
    the other ranks return their own bulk counters).

    Sharded, the leader joins the coordinator (shard 0) with the fragment -> shard map it derives from the
    number of shards (:func:`~atoll.runtime.service.syncer_shards.shard_map`), says ``Hello`` to every
    other shard (the same map, the shard it dialed, the coordinator's grant verifies there), and every rank
    routes each fragment's exchanges to its shard.

    Raises:
        ConfigError: ``island`` is not one of the run's, the syncer's model or map differs, a shard is not the one
            dialed, or the credential is refused.
        SyncerUnreachable: the syncer gave no answer for ``client.give_up_s``.
        PeerFailure: another rank of the island stopped responding.
    """
    if not 0 <= island < config.islands:
        raise ConfigError(f"island: {island} is not one of the run's islands 0..{config.islands - 1}; pass "
                          "--island in that range")
    if config.threads:
        torch.set_num_threads(config.threads)
    worker, plan, job = _build(config, island, group)
    numels = [int(i.numel()) for i in job.index]
    client = clients[0]  # the coordinator: the join, leases, heartbeats, Leave
    owners = shard_map(numels, len(clients))
    record = run_record(config)  # the syncer refuses a join whose run settings differ from its own (one line)
    job = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex  # every attempt of one torchrun launch
    joined = client.call("Join", schema.JoinRequest(numels=numels, shards=owners, settings=record,
                                                    digest=record_digest(record), job=job[:schema.MAX_ID])) \
        if group.leader else {}
    for s, shard in enumerate(clients[1:], 1):  # each shard is the one dialed, with the same map and run key
        shard.grant_source = client
        shard.session = client.session
        if group.leader:
            shard.call("Hello", schema.HelloRequest(numels=numels, shards=owners, shard=s, grant=client.grant))
    session, steps = group.broadcast_ints([int(joined.get("session", 0)), int(joined.get("steps", 0))])
    codec = codec_of(config.strategy_config)
    lease = (StepLease(client, worker.sync_every, worker.sync_every, config.tokens_per_step, worker.fragments,
                       status=lambda: (float(worker.island.last_loss),
                                       float(worker.island.scheduler.get_last_lr()[0])),
                       figures=lambda: {"compute_s": worker.island.settled_compute_s,
                                        "bytes_sent": transport.bytes_sent,
                                        "bytes_received": transport.bytes_received})
             if group.leader else None)
    transport = ServiceTransport(client, group, plan, worker.wire, codec, session, lease,
                                 route=[clients[owners[p]] for p in range(len(numels))], pull_codec=worker.pull_codec)
    worker.send_range = [plan.send_range(p) for p in range(worker.fragments)]
    worker.transport_encodes = True
    t0 = time.monotonic()
    terminated = False
    try:
        pulls = transport.start()  # the newest global fragments, the same versions on every rank
        worker.start_from(pulls)
        worker.steps = steps  # a job started again continues its steps' count and its learning-rate schedule
        worker.island.schedule_to(steps)
        if group.leader:
            ranks = f" ({group.size} ranks{', sharded' if plan.sharded else ''})" if group.size > 1 else ""
            print(f"atoll island {island}{ranks}: joined (session {session}, {steps} inner steps so far), from the "
                  f"global fragments at versions {[p.version for p in pulls]}", flush=True)
        worker.run(transport)
    except Terminated:  # SIGTERM: stop training, and leave the syncer below (its lease returned)
        terminated = True
    finally:
        transport.abort()
        if lease is not None:
            lease.close()
    report = {"steps": worker.steps, "compute_s": worker.island.compute_s, "bytes_sent": transport.bytes_sent,
              "bytes_received": transport.bytes_received,
              "last_loss": worker.island.last_loss, "codec_s": worker.wire.codec_s[0],
              "resets": worker.island.reset_count, "skipped_steps": worker.island.skipped_steps}
    if lease is not None and terminated:  # at once: the signal's sender waits a short while only
        with contextlib.suppress(grpc.RpcError):
            client.call("Leave", schema.LeaveRequest(**report, used=lease.used), timeout_s=10.0, retry=False)
    elif lease is not None:
        client.call("Leave", schema.LeaveRequest(**report, used=lease.used))
    return {**report, "terminated": terminated,
            "island": island, "rank": group.rank, "ranks": group.size, "wall_s": time.monotonic() - t0,
            "retries": sum(c.retries for c in clients),
            "offline_steps": lease.offline_steps_taken if lease is not None else 0,
            "refused_pushes": transport.refused, "lost_pushes": transport.lost, "session": session,
            "lease_fetches": lease.fetches if lease is not None else 0, **transport.counters()}


def island_job(config: TrainConfig) -> dict[str, Any]:
    """This process's rank of the island job ``config`` describes (its ``runtime_config``, a
    :class:`~atoll.config.runtimes.ServiceConfig`: the syncer's addresses, the island, its credential, TLS):
    join the island's ranks, dial every shard of the syncer, train (:func:`run_island`); return its report.
    ``kill -USR1 PID`` prints every thread's stack on stderr (a hang's diagnosis).

    Raises:
        ConfigError: a setting is missing or wrong (the credential unreadable, more shards than fragments...).
        SyncerUnreachable: the syncer gave no answer for ``give_up_s``.
        SystemExit: (status 3, via :func:`lost_peer`) another rank of the island stopped responding.
    """
    import faulthandler

    from atoll.runtime.service.tls import read_certificate

    settings = ServiceConfig.of_run(config)
    settings.require_island_job()
    assert settings.syncer is not None and settings.island is not None and settings.credential is not None
    if sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__)
    token = read_token(settings.credential)
    ca = read_certificate(settings.tls_ca, "tls_ca") if settings.tls_ca is not None else None
    fragments = config.strategy_config.fragments
    if len(settings.syncer) > fragments:
        raise ConfigError(f"syncer: {len(settings.syncer)} shards for {fragments} fragments; give --syncer the "
                          "shards' --shards list")
    group = IslandGroup.from_env(settings.ranks_per_island, config.device, settings.collective_timeout_s)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    clients: list[SyncerClient] = []
    try:
        for address in settings.syncer:  # one client per shard (shard 0 first: the coordinator)
            clients.append(SyncerClient(address, settings.island, token, root_certificates=ca,
                                        plaintext=settings.plaintext, insecure=settings.insecure,
                                        give_up_s=settings.give_up_s, server_name=settings.tls_server_name,
                                        control=group.leader,
                                        window=flow.window_bytes(settings.bulk_window_mib)))
        for client in clients:  # the transport checked before any work: a mistake is one line, in seconds
            client.probe()
        group.start()
        report = run_island(config, settings.island, clients, group)
    except PeerFailure as e:
        lost_peer(e, settings.island, group)  # exits with status 3
        raise
    finally:
        for client in clients:
            client.close()
    group.close()
    return report


class Terminated(Exception):
    """SIGTERM arrived (torchrun's agent stopping the job, a scheduler's preemption): raised on the main thread
    where it runs; :func:`run_island` then leaves the syncer, and the command exits with status 143."""


def _on_sigterm(signum: int, frame: object) -> None:
    """The first SIGTERM stops the island (:class:`Terminated`); a second one ends the process at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated(signum)


def lost_peer(e: PeerFailure, island: int, group: IslandGroup) -> None:
    """A rank of this island stopped responding: one line (the leader's), and exit with status 3 at once (a
    backend with a dead peer can hang in its clean-up); torchrun's agent restarts the job (--max-restarts)."""
    if group.leader or e.suspect is None:
        print(f"atoll: error: island {island}: a rank of this island stopped responding ({e.reason}); restart the "
              "job (torchrun --max-restarts does): it rejoins from the newest global fragments", file=sys.stderr,
              flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_FAILURE)
