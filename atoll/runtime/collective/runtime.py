"""The collective runtime as the lockstep loop sees it: one island per process, its Comm, who writes."""

from __future__ import annotations

import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.errors import CheckpointError, ConfigError
from atoll.job.checkpoint import resume_advice
from atoll.job.device import resolve_device
from atoll.runtime.base import Runtime
from atoll.runtime.collective.comm import DistComm
from atoll.runtime.collective.failure import (
    EXIT_PEER_FAILURE,
    HEARTBEAT_STALE_S,
    KILL_HOOK_ENV,
    PeerFailure,
    dist_call,
)
from atoll.runtime.collective.heartbeat import _Heartbeat
from atoll.runtime.network import SimClock

if TYPE_CHECKING:
    from atoll.config import TrainConfig
    from atoll.job.island import Island
    from atoll.strategies.base import Strategy

# ----------------------------------------------------------------------------------------------------------
# the runtime


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


def _parse_kill_hook() -> tuple[int, int] | None:
    value = os.environ.get(KILL_HOOK_ENV)
    if not value:
        return None
    try:
        rank, step = value.split(":")
        return int(rank), int(step)
    except ValueError:
        raise ConfigError(f"{KILL_HOOK_ENV}: expected RANK:STEP (e.g. 1:7), got {value!r}") from None


class CollectiveRuntime(Runtime):
    """This process is one rank of one island; the job is ``islands x ranks_per_island`` processes.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets
    them. :meth:`start` joins the process groups (deadline ``collective_timeout_s``).

    Args:
        config: the run's configuration.

    Raises:
        ConfigError: ``WORLD_SIZE`` is not ``islands x ranks_per_island``.
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.islands, self.ranks_per_island = config.islands, config.ranks_per_island
        if self.world != self.islands * self.ranks_per_island:
            raise ConfigError(f"ranks_per_island: {self.world} processes were started but islands x "
                              f"ranks_per_island = {self.islands} x {self.ranks_per_island}; start that many "
                              "(torchrun --nnodes x --nproc-per-node) or change --islands/--ranks-per-island")
        self.island, self.position = divmod(self.rank, self.ranks_per_island)
        self.local_islands = [self.island]
        self.is_main = self.rank == 0
        kind = resolve_device(config.device)
        if kind == "mps":
            raise ConfigError("device: the collective runtime runs on CPUs (gloo) or CUDA GPUs (NCCL), not mps; "
                              "pass --device cpu or use the local runtime")
        self.backend = "nccl" if kind == "cuda" else "gloo"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local_rank) if self.backend == "nccl" else torch.device("cpu")
        self.timeout = timedelta(seconds=config.collective_timeout_s)
        self.kill_at = _parse_kill_hook()
        self.step: int | None = None  # the 0-based inner step in progress, once the loop runs
        self.heartbeat: _Heartbeat | None = None
        self._aborting = threading.Lock()

    # --- joining and leaving ----------------------------------------------------------------------
    def start(self) -> None:
        """Join the default group, one island group per island, one cross-island group per position."""
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        dist_call(dist.init_process_group, self.backend, timeout=self.timeout)
        r_count, k = self.ranks_per_island, self.islands
        island_groups = ([dist_call(dist.new_group, list(range(i * r_count, (i + 1) * r_count)),
                                timeout=self.timeout) for i in range(k)] if r_count > 1 else [None] * k)
        cross_groups = [dist_call(dist.new_group, [i * r_count + p for i in range(k)], timeout=self.timeout)
                        for p in range(r_count)]
        # checkpoints and counters travel as CPU objects: a gloo group even when the collectives use NCCL
        self.control = (dist_call(dist.new_group, backend="gloo", timeout=self.timeout)
                        if self.backend == "nccl" else dist.group.WORLD)
        self.island_group = island_groups[self.island]
        self.comm = DistComm(k, self.island, r_count, self.position, cross_groups[self.position],
                             self.island_group, self.device, sharded=self.config.shard_island)
        nonce = [uuid.uuid4().hex if self.is_main else None]
        dist_call(dist.broadcast_object_list, nonce, src=0, group=self.control)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.heartbeat = _Heartbeat(self.rank, self.world, f"atoll/{nonce[0]}/",
                                    min(HEARTBEAT_STALE_S, self.config.collective_timeout_s),
                                    lambda rank, reason: self.abort(reason, rank, wait=False),
                                    store_host=None if agent_store else 0)
        dist_call(dist.barrier, group=self.control)
        self.heartbeat.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM,
                          lambda *_: self.abort("stopped by SIGTERM", wait=False, signalled=True))

    @contextmanager
    def guard(self) -> Iterator[None]:
        """A lost peer (in a collective, or a silent heartbeat) ends this process: one line, status 3."""
        try:
            yield
            if self.heartbeat is not None:
                self.heartbeat.leave()
                dist_call(dist.barrier, group=self.control)  # every rank is done: nobody needs the store
                dist.destroy_process_group()
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except PeerFailure as e:
            self.abort(e.reason, e.suspect)

    def abort(self, reason: str, suspect: int | None = None, wait: bool = True,
              signalled: bool = False) -> None:
        """Print why this rank stops and exit with :data:`EXIT_PEER_FAILURE` (does not return).

        Called from the main thread (a failed collective), the heartbeat thread or the SIGTERM handler;
        the first caller wins, later callers return at once (``wait=False``) or block until the exit.
        """
        if not self._aborting.acquire(blocking=wait):
            return
        if self.heartbeat is not None:
            self.heartbeat.leave()
            if suspect is None:
                suspect = self.heartbeat.find_dead()
        where = f"at inner step {self.step + 1}" if self.step is not None else "while starting"
        resume = resume_advice(self.config.out)
        if signalled and suspect is None:
            line = f"atoll: error: stopped by SIGTERM {where}; {resume}"
        else:
            who = f"island {suspect // self.ranks_per_island}" if suspect is not None else "another island"
            line = f"atoll: error: {who} stopped responding {where} ({reason}); {resume}"
        try:
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
        finally:
            os._exit(EXIT_PEER_FAILURE)

    # --- sharded islands (shard_island; atoll.runtime.collective.sharding) ---------------------------
    def make_island(self, index: int, model: torch.nn.Module, config: Any,
                    optimizer: Callable[..., torch.optim.Optimizer] | None = None) -> Island:
        """The island of this rank; with ``shard_island`` its model is sharded over the island's ranks
        (FSDP2) before the inner optimizer is built, so the optimizer holds this rank's shard only."""
        if not self.config.shard_island:
            return super().make_island(index, model, config, optimizer)
        from atoll.job.island import make_island
        from atoll.runtime.collective.sharding import ShardedIsland, ShardLayout, shard_model

        shard_model(model, self.island_group, self.device)
        island = make_island(index, model, config, None, optimizer=optimizer, island_type=ShardedIsland)
        self.layout = ShardLayout(island.params, self.island_group, self.device)
        return island

    def full_params(self, params: torch.Tensor) -> torch.Tensor:
        """Sharded islands: every rank's shard of ``params`` gathered into the whole vector (collective)."""
        return self.layout.gather(params) if self.config.shard_island else params

    def summary(self) -> dict[str, Any]:
        """Sharded islands: ``shard_island`` and ``params_per_rank`` (elements of each position's shard)."""
        if not self.config.shard_island:
            return {}
        return {"shard_island": True, "params_per_rank": self.layout.numel_per_rank}

    # --- what the loop asks ------------------------------------------------------------------------
    def forward_backward(self, island: Island, batch: torch.Tensor, step: int) -> None:
        """This rank's rows of the island's batch, then the gradient averaged over the island's ranks
        (all-reduced here; reduce-scattered by FSDP2 in the backward pass of a sharded island)."""
        self.step = step
        if self.kill_at == (self.rank, step + 1):
            os.kill(os.getpid(), signal.SIGKILL)  # test hook (see the module docstring)
        r_count = self.ranks_per_island
        rows = batch.shape[0] // r_count
        mine = batch[self.position * rows:(self.position + 1) * rows]
        island.forward_backward(mine)
        if r_count == 1:
            return
        island.tokens += (r_count - 1) * mine[:, 1:].numel()  # the island's tokens, as one rank would count
        if self.config.shard_island:
            loss = torch.tensor([island.last_loss], dtype=torch.float32, device=self.device)
            dist_call(dist.all_reduce, loss, group=self.island_group)
            island.last_loss = float(loss.div_(r_count)[0])
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in island.params]
        loss = torch.tensor([island.last_loss], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss])
        dist_call(dist.all_reduce, flat, group=self.island_group)
        flat.div_(r_count)
        offset = 0
        for p in island.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        island.last_loss = float(flat[-1])

    def totals(self, islands: list[Island]) -> tuple[float, int]:
        first = self.position == 0  # one rank per island reports it
        buf = torch.tensor([sum(i.last_loss for i in islands) if first else 0.0,
                            sum(i.tokens for i in islands) if first else 0.0], dtype=torch.float64)
        dist_call(dist.all_reduce, buf, group=self.control)
        return float(buf[0]) / self.islands, int(buf[1])

    def island_counts(self, islands: list[Island]) -> tuple[list[int], list[int]]:
        buf = torch.zeros(2 * self.islands, dtype=torch.float64)
        if self.position == 0:  # one rank per island reports it
            for i in islands:
                buf[i.index], buf[self.islands + i.index] = i.skipped_steps, i.reset_count
        dist_call(dist.all_reduce, buf, group=self.control)
        return [int(x) for x in buf[:self.islands]], [int(x) for x in buf[self.islands:]]

    def compute_s(self, islands: list[Island]) -> float:
        buf = torch.tensor([max(i.compute_s for i in islands)], dtype=torch.float64)
        dist_call(dist.all_reduce, buf, op=dist.ReduceOp.MAX, group=self.control)
        return float(buf[0])

    def run_wall_s(self, real_s: float) -> float:
        return real_s

    def job_state(self, islands: list[Island], strategy: Strategy, **extra: Any) -> dict[str, Any] | None:
        """Gather every island's state on rank 0 (``gather_object``), in the ``local`` runtime's format.

        Every rank takes the strategy's state (it may finish an exchange in flight, an island collective);
        one rank per island sends it with its islands' states. The clock entry is a
        :class:`~atoll.runtime.network.SimClock` state at the real wall time ``extra["wall_s"]``, so the
        ``local`` runtime can resume the checkpoint.
        """
        if self.config.shard_island:
            return self._sharded_job_state(islands, strategy, **extra)
        shared = strategy.state_dict()
        mine = ((self.island, [_to_cpu(i.state_dict()) for i in islands],
                 [_to_cpu(strategy.island_state(p)) for p in range(len(islands))]) if self.position == 0 else None)
        gathered: list[Any] | None = [None] * self.world if self.is_main else None
        dist_call(dist.gather_object, mine, gathered, dst=0, group=self.control)
        if gathered is None:
            return None
        entries = sorted((g for g in gathered if g is not None), key=lambda g: g[0])
        wall = float(extra.get("wall_s", 0.0))
        return {"islands": [s for e in entries for s in e[1]], "strategy": _to_cpu(shared),
                "strategy_islands": [s for e in entries for s in e[2]],
                "comm": self.comm.state_dict(),
                "clock": SimClock(self.islands, [wall] * self.islands).state_dict(), **extra}

    def _sharded_job_state(self, islands: list[Island], strategy: Strategy, **extra: Any) -> dict[str, Any] | None:
        """:meth:`job_state` of sharded islands: the islands' whole states (gathered by the island's ranks
        together), the strategy's state per rank position (each holds its shard's): ``strategy_shards``
        [position] and ``strategy_islands`` [island][position], and ``shard_ranks`` = R."""
        states = [_to_cpu(i.state_dict()) for i in islands]  # every rank of the island: a collective
        shared = _to_cpu(strategy.state_dict()) if self.island == 0 else None
        mine = (self.island, self.position, states if self.position == 0 else None,
                [_to_cpu(strategy.island_state(p)) for p in range(len(islands))], shared)
        gathered: list[Any] | None = [None] * self.world if self.is_main else None
        dist_call(dist.gather_object, mine, gathered, dst=0, group=self.control)
        if gathered is None:
            return None
        entries = sorted(gathered, key=lambda g: (g[0], g[1]))  # (island, position)
        r_count = self.ranks_per_island
        wall = float(extra.get("wall_s", 0.0))
        return {"islands": [s for e in entries if e[1] == 0 for s in e[2]],
                "strategy_shards": [e[4] for e in entries if e[0] == 0],
                "strategy_islands": [[e[3][0] for e in entries[i * r_count:(i + 1) * r_count]]
                                     for i in range(self.islands)],
                "shard_ranks": r_count, "comm": self.comm.state_dict(),
                "clock": SimClock(self.islands, [wall] * self.islands).state_dict(), **extra}

    def load_job_state(self, state: dict[str, Any], islands: list[Island], strategy: Strategy) -> None:
        """Each rank loads its own island's entry (the checkpoint must be readable on every node); a sharded
        island's ranks each keep their pieces of the whole tensors, and their position's strategy state.

        Raises:
            CheckpointError: another number of islands, or sharded over another number of ranks.
        """
        if len(state["islands"]) != self.islands:
            raise CheckpointError(f"resume: the checkpoint holds {len(state['islands'])} islands, this run "
                                  f"{self.islands}; resume with the run's own --islands")
        saved = state.get("shard_ranks")
        if self.config.shard_island:
            if saved != self.ranks_per_island:
                raise CheckpointError(f"resume: the checkpoint's islands are sharded over {saved} ranks, this "
                                      f"run's over {self.ranks_per_island}; resume with --ranks-per-island {saved}")
            for island in islands:
                island.load_state_dict(state["islands"][island.index])
            strategy.load_state_dict(state["strategy_shards"][self.position])
            for position, island in enumerate(islands):
                strategy.load_island_state(position, state["strategy_islands"][island.index][self.position])
            self.comm.load_state_dict(state["comm"])
            return
        for island in islands:
            island.load_state_dict(state["islands"][island.index])
        strategy.load_state_dict(state["strategy"])
        for position, island in enumerate(islands):
            strategy.load_island_state(position, state["strategy_islands"][island.index])
        self.comm.load_state_dict(state["comm"])


