"""The collective runtime as the lockstep loop sees it: one island per process, its Comm, who writes."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from atoll.errors import CheckpointError, ConfigError, Interrupted
from atoll.job.checkpoint import resume_advice
from atoll.job.device import resolve_device
from atoll.job.divergence import inject_fault
from atoll.runtime.base import Runtime
from atoll.runtime.collective import report, torch_ddp
from atoll.runtime.collective.async_checkpoint import BackgroundCheckpoints
from atoll.runtime.collective.comm import DistComm
from atoll.runtime.collective.failure import (
    EXIT_PEER_FAILURE,
    HEARTBEAT_STALE_S,
    LINES_ENV,
    PeerFailure,
    dist_call,
)
from atoll.runtime.collective.heartbeat import _Heartbeat
from atoll.runtime.collective.job_tokens import JobTokens
from atoll.runtime.collective.membership import Membership
from atoll.runtime.collective.quorum import Quorum, recover, store_client
from atoll.runtime.collective.rank_island import RankIsland
from atoll.runtime.collective.rejoin import FINISHED, PREFIX_KEY, REJOIN_ENV, admit, joined_job, wait_for_admission
from atoll.runtime.collective.stop import StopAgreement
from atoll.runtime.collective.transfer import broadcast_state
from atoll.runtime.network import Link

if TYPE_CHECKING:
    from atoll.config.facts import IslandSettings, RunFacts
    from atoll.config.runtimes import CollectiveConfig
    from atoll.job.island import InnerOptimizer, Island
    from atoll.job.run import Run
    from atoll.runtime.collective.sharding import ShardLayout
    from atoll.strategies.base import Strategy

# ----------------------------------------------------------------------------------------------------------
# the runtime


class CollectiveRuntime(Runtime):
    """This process is one rank of one island; the job is ``islands x ranks_per_island`` processes.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets
    them. :meth:`start` joins the process groups (deadline ``collective_timeout_s``).

    Args:
        config: its own settings (ranks, sharding, deadlines, survival, checkpoints in the background).
        facts: the run's (``islands``, ``device``, ``steps``, ``seed``, ``out``...).
        strategy: the strategy's config (whether a ``ddp`` run averages with torch's DDP hooks reads its codec:
            :func:`~.torch_ddp.applies`).

    Raises:
        ConfigError: ``WORLD_SIZE`` is not ``islands x ranks_per_island``.
    """

    def __init__(self, config: CollectiveConfig, facts: RunFacts, strategy: Any = None) -> None:
        self.config, self.facts = config, facts
        self.torch_ddp = torch_ddp.applies(config, facts, strategy)  # ddp's gradients under torch's DDP hooks
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.islands, self.ranks_per_island = facts.islands, config.ranks_per_island
        if self.world != self.islands * self.ranks_per_island:
            raise ConfigError(f"ranks_per_island: {self.world} processes were started but islands x "
                              f"ranks_per_island = {self.islands} x {self.ranks_per_island}; start that many "
                              "(torchrun --nnodes x --nproc-per-node) or change --islands/--ranks-per-island")
        self.island, self.position = divmod(self.rank, self.ranks_per_island)
        self.local_islands = [self.island]
        self.is_main = self.rank == 0
        self.early_checkpoint = True  # a rank can be lost before checkpoint_every: resume from the first sync
        kind = resolve_device(facts.device)
        if kind == "mps":
            raise ConfigError("device: the collective runtime runs on CPUs (gloo) or CUDA GPUs (NCCL), not mps; "
                              "pass --device cpu or use the local runtime")
        self.backend = "nccl" if kind == "cuda" else "gloo"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local_rank) if self.backend == "nccl" else torch.device("cpu")
        self.timeout = timedelta(seconds=config.collective_timeout_s)
        # this rank of its island: its rows, the gradient and loss means, its tokens; its island group, once formed
        self.rank_island = RankIsland(self.ranks_per_island, self.position, self.device, config.shard_island,
                                      resilient=lambda op: self.comm.resilient(op))
        self.step: int | None = None  # the 0-based inner step in progress, once the loop runs
        self.heartbeat: _Heartbeat | None = None
        self.stopping: StopAgreement | None = None  # from start(): the step all ranks stop after on a signal
        self.background = BackgroundCheckpoints()  # --async-checkpoint: the one in flight, its host copies
        self._aborting = threading.Lock()
        self.membership = Membership(self.islands)  # the islands alive, the epoch, losses and rejoins
        self.quorum: Quorum | None = None
        self.recovery_s: list[float] = []
        self._joined: dict[str, Any] | None = None  # the state received on rejoining
        self.job_tokens = JobTokens([0] * self.islands)  # each island's at the last totals(); a rejoin's offset

    # --- joining and leaving ----------------------------------------------------------------------
    def start(self) -> None:
        """Join the default group, one island group per island, one cross-island group per position."""
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        self.comm = DistComm(self.islands, self.island, self.ranks_per_island, self.position, None, None,
                             self.device, sharded=self.config.shard_island,
                             link=Link.from_config(self.config.collective_link_mbps,
                                                   self.config.collective_link_latency_ms),
                             floor_s=self.config.collective_timeout_s)  # each exchange's deadline
        if os.environ.get(REJOIN_ENV):  # restarted by the launcher: join the running job
            self._joined = self._rejoin()
        else:
            dist_call(dist.init_process_group, self.backend, timeout=self.timeout)
            self._form_groups()
            self.comm.regroup(self.islands, self.cross_group, self.island_group)
            nonce = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8)  # a tensor, not pickle
            dist_call(dist.broadcast, nonce, src=0, group=self.control)
            self.prefix = f"atoll/{bytes(nonce.tolist()).hex()}/"
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.heartbeat = _Heartbeat(self.rank, self.world, self.prefix,
                                    min(HEARTBEAT_STALE_S, self.config.collective_timeout_s),
                                    self._on_silent, store_host=None if agent_store else 0,
                                    on_store_lost=self._on_store_lost)
        self.heartbeat.drop([r for r in range(self.world) if r not in self.membership.ranks(self.ranks_per_island)])
        # losses can be survived (agree through the store); not by sharded islands, whose FSDP groups stay
        if self.config.min_islands < self.islands and not self.config.shard_island:
            # without an agent store, rank 0's default group owns the store's server: keep it past that group
            self.rendezvous = distributed_c10d._get_default_store()
            if self._joined is None:
                self.store = store_client(self.config.collective_timeout_s)
            if self.is_main:  # where a restarted rank finds this job's keys
                self.store.set(PREFIX_KEY, self.prefix)
            self.quorum = Quorum(dist.PrefixStore(self.prefix + "quorum/", self.store), self.rank,
                                 self.ranks_per_island, self.heartbeat.is_gone, self.config.collective_timeout_s)
            self.comm.recover = self.recover
        if self._joined is None:  # (a restarted rank's keys exist: the others are training, not waiting)
            dist_call(dist.barrier, group=self.control)
        self.heartbeat.start()
        self.stopping = StopAgreement.of(self)  # SIGINT/SIGTERM: the ranks agree on one step to checkpoint

    def _rejoin(self) -> dict[str, Any]:
        """A restarted rank joins the running job (:mod:`~.rejoin`): admitted into the live islands' membership
        and epoch, it takes their counters; returns the state group rank 0 sent (:func:`~.rejoin.admit`)."""
        self.store = store_client(self.config.collective_timeout_s)
        self.prefix, members = wait_for_admission(self.store, self.rank)
        self.membership.load_state_dict(members)
        self.init_epoch()
        got = broadcast_state(None, self.control)
        self.comm.ops = int(got["ops"])  # the live ranks' operation count: a later loss is agreed on by number
        self.job_tokens.of = [int(t) for t in got["tokens_of"]]
        return got

    def stop_after(self, done: int) -> bool:
        """Whether the ranks stop after step ``done`` on a signal, agreed in the store (:mod:`~.stop`)."""
        return self.stopping is not None and self.stopping.stop_after(done)

    def _form_groups(self) -> None:
        """The island, cross-island and control groups of the islands alive, over the current default group.

        Island ``alive[j]`` is ranks [j*R, (j+1)*R) of the default group; every rank creates every group,
        in the same order (``new_group`` is collective).
        """
        alive = self.membership.alive
        r_count, k = self.ranks_per_island, len(alive)
        island_groups = ([dist_call(dist.new_group, list(range(j * r_count, (j + 1) * r_count)),
                                    timeout=self.timeout) for j in range(k)] if r_count > 1 else [None] * k)
        cross_groups = [dist_call(dist.new_group, [j * r_count + p for j in range(k)], timeout=self.timeout)
                        for p in range(r_count)]
        # checkpoints and counters travel as CPU objects: a gloo group even when the collectives use NCCL
        self.control = (dist_call(dist.new_group, backend="gloo", timeout=self.timeout)
                        if self.backend == "nccl" else dist.group.WORLD)
        self.island_group = island_groups[alive.index(self.island)]
        self.cross_group = cross_groups[self.position]

    def close_groups(self) -> None:
        """Close this rank's connections at once (peers blocked on it fail now, not at the deadline)."""
        for group in list(distributed_c10d._world.pg_map):
            with contextlib.suppress(Exception):
                group.abort()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self.cross_group = self.island_group = self.control = None
        self.comm.regroup(self.comm.islands, None, None)
        for exchange in self.comm.pending:
            exchange.handle = None
        gc.collect()

    def _on_store_lost(self, reason: str) -> None:
        """The launcher (or torchrun's agent) is gone with its store: stop; rank 0 alone says so (one line)."""
        self.abort(reason, wait=False, who="the launcher's rendezvous store", quiet=not self.is_main)

    def _on_silent(self, rank: int | None, reason: str) -> None:
        """The heartbeat found ``rank`` silent: stop, unless losses are survived (the failed collective, or
        the launcher killing the reported rank, then brings the survivors to :meth:`recover`)."""
        if self.quorum is None:
            self.abort(reason, rank, wait=False)

    def recover(self, failure: PeerFailure, op: int) -> None:
        """Go on with the islands alive after ``failure`` in operation ``op``, or end this process
        (:func:`~atoll.runtime.collective.quorum.recover`); note how long it took."""
        self.recovery_s.append(recover(self, failure, op))

    def init_epoch(self) -> None:
        """Join the default group of the membership's epoch (its islands alive, renumbered in island order,
        over ``PrefixStore(f"epoch{n}/", store)``) and form its groups; the comm uses them from now on."""
        r_count, alive = self.ranks_per_island, self.membership.alive
        dist_call(dist.init_process_group, self.backend, timeout=self.timeout,
                  store=dist.PrefixStore(f"{self.prefix}epoch{self.membership.epoch}/", self.store),
                  rank=alive.index(self.island) * r_count + self.position, world_size=len(alive) * r_count)
        self._form_groups()
        self.comm.regroup(len(alive), self.cross_group, self.island_group)

    def admit(self, done: int, islands: list[Island], strategy: Strategy, **extra: Any) -> None:
        """Let restarted islands rejoin at the end of inner step ``done`` (:func:`~.rejoin.admit`)."""
        if self.config.max_restarts:
            admit(self, done, islands, strategy, extra)

    def joined_state(self) -> dict[str, Any] | None:
        """For a restarted rank that rejoined: ``{"step": S, "job": the state, checkpoint format}``; else None."""
        return joined_job(self._joined, self.islands) if self._joined is not None else None

    @contextmanager
    def guard(self) -> Iterator[None]:
        """A lost peer (in a collective, or a silent heartbeat) ends this process: one line, status 3."""
        try:
            yield
            if self.is_main and self.config.max_restarts:  # a rank restarted now has nothing left to join
                with contextlib.suppress(Exception):
                    self.store.set(f"{self.prefix}{FINISHED}", "1")
            if self.heartbeat is not None:
                self.heartbeat.leave()
                try:
                    dist_call(dist.barrier, group=self.control)  # every rank is done: nobody needs the store
                except PeerFailure:
                    if self.quorum is None:  # going on without islands: a loss after the summary is no failure
                        raise
                dist.destroy_process_group()
        except PeerFailure as e:
            self.abort(e.reason, e.suspect)
        except Interrupted:  # every rank stops after the step whose checkpoint rank 0 wrote: none is "lost"
            if self.heartbeat is not None:  # (leaving also ends the stop agreement's poller)
                self.heartbeat.leave()
            raise

    def abort(self, reason: str, suspect: int | None = None, wait: bool = True,
              signalled: bool = False, who: str | None = None, advice: str | None = None,
              quiet: bool = False, warning: bool = False) -> None:
        """Print why this rank stops and exit with :data:`EXIT_PEER_FAILURE` (does not return). Under the
        one-machine launcher (:data:`~atoll.runtime.collective.failure.LINES_ENV`), a peer's failure is handed to
        the launcher instead (:meth:`_Heartbeat.hand_over`), which says it once for the run (printed here if the
        store does not take it).

        ``who`` names the culprit when it is not a rank (the launcher's store); else ``suspect``'s island,
        or the first rank the heartbeats find dead. ``advice`` ends the line (default: how to resume);
        ``quiet`` exits without it (another rank says it); ``warning`` says it as a warning, printed here (this
        rank stops, the run goes on: a dropped island's).

        Called from the main thread (a failed collective), the heartbeat thread or the SIGTERM handler;
        the first caller wins, later callers return at once (``wait=False``) or block until the exit.

        A failed collective while the launcher's store does not answer is the launcher's loss, not the peer's:
        every rank stops on it, and the one that stopped first took its peers' collectives down with it, so the
        line (rank 0's alone, as :meth:`_on_store_lost`'s) names the store, whichever rank's heartbeat or
        collective found it first.
        """
        if not self._aborting.acquire(blocking=wait):
            return
        if self.heartbeat is not None:
            store_lost = self.heartbeat.leave()
            if store_lost is not None and self.heartbeat.store_host is None and who is None and not signalled:
                reason, suspect, who, quiet = store_lost, None, "the launcher's rendezvous store", not self.is_main
            if suspect is None and who is None:
                suspect = self.heartbeat.find_dead()
            if suspect is not None:  # the launcher kills it if it still runs (frozen)
                self.heartbeat.report([suspect])
        where = f"at inner step {self.step + 1}" if self.step is not None else "while starting"
        resume = advice or resume_advice(self.facts.out)
        # a peer's failure that stops the run, under the one-machine launcher: the line goes to the launcher, which
        # says it once for the run
        hand_over = (who is None and not warning and self.heartbeat is not None
                     and os.environ.get(LINES_ENV) == "1")
        if signalled and suspect is None:
            line, hand_over = f"stopped by SIGTERM {where}; {resume}", False
        else:
            if who is None:
                who = (f"island {suspect // self.ranks_per_island} (rank {suspect})" if suspect is not None
                       else "another island")
            line = f"{who} stopped responding {where} ({reason}); {resume}"
        try:
            sys.stdout.flush()
            if not quiet and not (hand_over and self.heartbeat.hand_over(line, suspect)):
                print(f"atoll: {'warning' if warning else 'error'}: {line}", file=sys.stderr, flush=True)
        finally:
            os._exit(EXIT_PEER_FAILURE)

    # --- sharded islands (shard_island; atoll.runtime.collective.sharding) ---------------------------
    def make_island(self, index: int, model: torch.nn.Module, settings: IslandSettings,
                    optimizer: InnerOptimizer) -> Island:
        """The island of this rank (:meth:`RankIsland.build <.rank_island.RankIsland.build>`); with ``shard_island``
        its model is sharded over the island's ranks (FSDP2) before the inner optimizer is built, so the optimizer
        holds this rank's shard only; a ``ddp`` run under torch's hooks (:mod:`~.torch_ddp`) averages across the
        islands in the backward pass."""
        return self.rank_island.build(index, model, settings, optimizer, self.torch_ddp, self.facts.seed,
                                      self.facts.init_from, cross_group=self.cross_group)

    @property
    def island_group(self) -> Any:
        """The process group of this rank's island (None with one rank, or closed): its rank island's."""
        return self.rank_island.group

    @island_group.setter
    def island_group(self, group: Any) -> None:
        self.rank_island.group = group

    @property
    def layout(self) -> ShardLayout:
        """Sharded islands: the layout of the island's shards (:attr:`.rank_island.RankIsland.layout`).

        Raises:
            AttributeError: the island is whole, or not built yet.
        """
        if self.rank_island.layout is None:
            raise AttributeError("layout: the island is not sharded (or not built yet)")
        return self.rank_island.layout

    def make_strategy(self, build: Callable[..., Strategy], config: Any, islands: list[Island], seed: int) -> Strategy:
        """:meth:`Runtime.make_strategy`; on sharded islands SparseLoCo selects from whole tensors
        (:mod:`~.sharded_sparseloco`)."""
        if self.config.shard_island:
            from atoll.runtime.collective.sharded_sparseloco import shard_aware_strategy

            build = shard_aware_strategy(build)
        return super().make_strategy(build, config, islands, seed)

    def evaluate(self, islands: list[Island], params: torch.Tensor | None, batches: list[torch.Tensor]) -> float:
        """The global model's held-out loss, the windows split over the ranks, each on its own device
        (:func:`~.evaluation.split_evaluate`); every rank gets the same number. Collective."""
        from atoll.runtime.collective.evaluation import split_evaluate

        return split_evaluate(self, islands[0], params, batches)

    def full_params(self, params: torch.Tensor) -> torch.Tensor:
        """Sharded islands: every rank's shard of ``params`` gathered into the whole vector (collective)."""
        return self.layout.gather(params) if self.config.shard_island else params

    # --- what the loop asks ------------------------------------------------------------------------
    def inner_steps(self, islands: list[Island], batches: list[torch.Tensor], step: int) -> None:
        """This rank's inner step ``step`` (:meth:`Runtime.inner_steps`), a test's kill hook first: told this
        rank and the job's first rejoin (:mod:`atoll.job.faults`, installed as the rank started)."""
        self.step = step
        for island in islands:
            inject_fault(island, step, "start", rank=self.rank, first_rejoin=self.membership.first_rejoin())
        super().inner_steps(islands, batches, step)

    def forward_backward(self, island: Island, batch: torch.Tensor, step: int) -> None:
        """This rank's rows of the island's batch, then the gradient averaged over the island's ranks
        (all-reduced here; reduce-scattered by FSDP2 in the backward pass of a sharded island):
        :meth:`RankIsland.forward_backward <.rank_island.RankIsland.forward_backward>`."""
        self.rank_island.forward_backward(island, batch)

    def totals(self, islands: list[Island]) -> tuple[float, int]:
        """Mean loss over the islands alive; tokens of every island (:func:`~.report.totals`)."""
        loss, tokens_alive = report.totals(self, islands)
        return loss, self.job_tokens.update(tokens_alive)  # a lost island's stay as last reported

    def island_counts(self, islands: list[Island]) -> tuple[list[int], list[int]]:
        return report.island_counts(self, islands)

    def compute_s(self, islands: list[Island]) -> float:
        return report.compute_s(self, islands)

    def membership_changes(self) -> list[tuple[str, int, dict[str, Any]]]:
        return [("failure" if e.kind == "lost" else "rejoin", e.step, {"island": e.island, "epoch": e.epoch})
                for e in self.membership.changes()]

    def summary(self) -> dict[str, Any]:
        """Sharded islands, the islands lost and rejoined, recovery times (:func:`~.report.summary`)."""
        return report.summary(self)

    def run_wall_s(self, real_s: float) -> float:
        return real_s

    def job_state(self, islands: list[Island], strategy: Strategy, **extra: Any) -> dict[str, Any] | None:
        """Not gathered: a collective checkpoint is written by every rank (:meth:`save_checkpoint`)."""
        raise NotImplementedError("the collective runtime writes per-rank checkpoints (save_checkpoint)")

    def save_checkpoint(self, run: Run, step: int, islands: list[Island], strategy: Strategy,
                        background: bool = False) -> None:
        """Write the checkpoint of inner step ``step`` per rank, nothing of the islands sent to rank 0; in the
        background with ``--async-checkpoint`` (:func:`~.checkpointing.save_rank_checkpoint`); collective."""
        from atoll.runtime.collective.checkpointing import save_rank_checkpoint as save
        save(self, run, step, islands, strategy, background and self.config.async_checkpoint)

    def settle_checkpoints(self, run: Run) -> None:
        """Wait for the one in flight: committed, or its OSError raised on every rank (:mod:`~.checkpointing`)."""
        from atoll.runtime.collective import checkpointing
        checkpointing.settle_checkpoint(self)

    def load_job_state(self, state: dict[str, Any], islands: list[Island], strategy: Strategy) -> None:
        """Each rank loads its own island's entry (the checkpoint must be readable on every node): from its
        own folder (and its owners') of a per-rank checkpoint, or from a state that holds every island's (a
        rejoining rank's, an older checkpoint's)."""
        if state.get("checkpoint_path") is not None:
            from atoll.runtime.collective import checkpointing
            return checkpointing.load_rank_checkpoint(self, state, islands, strategy)
        if len(state["islands"]) != self.islands:
            raise CheckpointError(f"resume: the checkpoint holds {len(state['islands'])} islands, this run "
                                  f"{self.islands}; resume with the run's own --islands")
        if self.config.shard_island:
            from atoll.runtime.collective.sharding import load_sharded_job_state

            load_sharded_job_state(self, state, islands, strategy)
            return
        for island in islands:
            island.load_state_dict(state["islands"][island.index])
        strategy.load_state_dict(state["strategy"])
        for position, island in enumerate(islands):
            strategy.load_island_state(position, state["strategy_islands"][island.index])
        self.comm.load_state_dict(state["comm"])
        if self._joined is not None:  # a live island's state (its tokens drive the weights); totals count ours
            self.job_tokens.rejoined(self.island, sum(i.tokens for i in islands))
