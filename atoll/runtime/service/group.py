"""An island job's own process group: its R ranks, started by torchrun, and what they do together.

``torchrun --nproc-per-node R -m atoll island ...`` (or ``--nnodes N`` across the island's hosts) starts the
island's ranks; each reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` and joins one process group of the
island alone (torchrun's rendezvous: the island's hosts only, never another island's or the syncer's). The
group carries, inside the island only:

- the gradient average of every inner step (torch DDP's all-reduce, or FSDP2's reduce-scatter with
  ``--shard-island``): NCCL on GPUs, gloo on CPUs;
- a small **agreement** per inner step (:meth:`IslandGroup.agree`: one all-reduce of a few int64 per
  fragment, on a gloo group): the leader's go or stop, and how far each rank's exchange of each fragment has
  come, so every rank adopts a pulled fragment at the same inner step (the replicas stay equal);
- the slices of a fragment (:meth:`IslandGroup.all_gather`, :meth:`IslandGroup.gather`,
  :meth:`IslandGroup.scatter`, :meth:`IslandGroup.broadcast`), on the main thread, in the order the agreement
  fixes.

Every collective has the deadline ``collective_timeout_s``; a rank that dies closes its connections, so its
peers' next collective fails at once (gloo: "Connection closed by peer") with
:class:`~atoll.runtime.collective.failure.PeerFailure`, and torchrun's agent ends (or restarts) the job.
An island of one rank, started without torchrun, has no group: every collective is the identity.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from atoll.errors import ConfigError
from atoll.job.device import resolve_device
from atoll.runtime.collective.failure import dist_call


class IslandGroup:
    """This process as rank ``rank`` of an island job of ``size`` ranks.

    Args:
        rank, size: the rank in the island and the island's ranks (torchrun's ``RANK``, ``WORLD_SIZE``).
        device: where the model and the gradient collectives live (``cuda:LOCAL_RANK`` with NCCL, else the CPU).
        timeout_s: the deadline of every collective (seconds).

    Attributes:
        leader: rank 0, which alone talks to the syncer's control methods.
    """

    def __init__(self, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.size, self.device, self.timeout_s = rank, size, device, timeout_s
        self.leader = rank == 0
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.world: Any = None
        self.control: Any = None

    @classmethod
    def from_env(cls, ranks_per_island: int, device: str, timeout_s: float) -> IslandGroup:
        """The group torchrun's environment describes (one rank without it), checked against the run's
        ``ranks_per_island``.

        Raises:
            ConfigError: torchrun started another number of ranks than ``--ranks-per-island``, or the device
                is not one the island's ranks can share (mps).
        """
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if size != ranks_per_island:
            raise ConfigError(f"ranks_per_island: {ranks_per_island}, but torchrun started {size} ranks for this "
                              f"island; pass --ranks-per-island {size} (or leave it out: torchrun's count is the "
                              "default)")
        kind = resolve_device(device)
        if kind == "mps" and size > 1:
            raise ConfigError("device: an island of several ranks runs on CPUs (gloo) or CUDA GPUs (NCCL), not "
                              "mps; pass --device cpu")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local) if kind == "cuda" else torch.device(kind)
        return cls(rank, size, dev, timeout_s)

    def start(self) -> None:
        """Join the island's process group (torchrun's rendezvous) and its gloo group for the agreement.

        torchrun's agent keeps one store for all its attempts (``TORCHELASTIC_USE_AGENT_STORE``): the process
        group of a restarted job gets keys of its own attempt (``TORCHELASTIC_RESTART_COUNT``), or its ranks
        would read the dead attempt's addresses and fail to connect."""
        if self.size == 1:
            return
        timeout = timedelta(seconds=self.timeout_s)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.size,
                                  is_master=False, timeout=timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"atoll/island/attempt_{attempt}/", agent)
            dist_call(dist.init_process_group, self.backend, store=store, rank=self.rank, world_size=self.size,
                      timeout=timeout)
        else:
            dist_call(dist.init_process_group, self.backend, timeout=timeout)
        self.world = dist.group.WORLD
        self.control = (dist_call(dist.new_group, backend="gloo", timeout=timeout) if self.backend == "nccl"
                        else self.world)

    def close(self) -> None:
        """Leave the group (every rank is done)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # --- the agreement --------------------------------------------------------------------------------------
    def agree(self, local: torch.Tensor) -> torch.Tensor:
        """The element-wise minimum over the island's ranks of ``local`` (int64 (n,), CPU): what every rank
        agrees on (a value only one rank knows is sent by it, the others sending the int64 maximum)."""
        if self.size == 1:
            return local
        out = local.clone()
        dist_call(dist.all_reduce, out, op=dist.ReduceOp.MIN, group=self.control)
        return out

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """The leader's ``values`` (int64) on every rank."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist_call(dist.broadcast, t, src=0, group=self.control)
        return [int(x) for x in t]

    # --- slices of a fragment (float32, on the main thread, in the agreed order) -------------------------------
    def _padded(self, x: torch.Tensor, longest: int) -> torch.Tensor:
        out = torch.zeros(longest, dtype=torch.float32, device=self.device)
        out[:x.numel()] = x.to(self.device, torch.float32)
        return out

    def all_gather(self, mine: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's ``mine`` (rank r's has ``sizes[r]`` values) concatenated in rank order, float32 on the
        CPU (padded to the longest for the backend, trimmed after)."""
        if self.size == 1:
            return mine.to("cpu", torch.float32)
        longest = max(sizes)
        rows = [torch.empty(longest, dtype=torch.float32, device=self.device) for _ in sizes]
        dist_call(dist.all_gather, rows, self._padded(mine, longest), group=self.world)
        return torch.cat([row[:n].cpu() for row, n in zip(rows, sizes, strict=True)])

    def gather(self, mine: torch.Tensor, sizes: list[int]) -> list[torch.Tensor] | None:
        """Every rank's ``mine`` on the leader (a list in rank order, float32 on the CPU); None elsewhere."""
        if self.size == 1:
            return [mine.to("cpu", torch.float32)]
        longest = max(sizes)
        rows = [torch.empty(longest, dtype=torch.float32, device=self.device) for _ in sizes] if self.leader else None
        dist_call(dist.gather, self._padded(mine, longest), rows, dst=0, group=self.world)
        return [row[:n].cpu() for row, n in zip(rows, sizes, strict=True)] if rows is not None else None

    def scatter(self, parts: list[torch.Tensor] | None, sizes: list[int]) -> torch.Tensor:
        """Rank r's ``parts[r]`` (given on the leader) on rank r, float32 on the CPU."""
        if self.size == 1:
            assert parts is not None
            return parts[0].to("cpu", torch.float32)
        longest = max(sizes)
        out = torch.empty(longest, dtype=torch.float32, device=self.device)
        rows = [self._padded(p, longest) for p in parts] if parts is not None else None
        dist_call(dist.scatter, out, rows, src=0, group=self.world)
        return out[:sizes[self.rank]].cpu()

    def broadcast_bytes(self, data: bytes | bytearray | None, size: int) -> bytearray:
        """The leader's ``data`` (``size`` bytes; None on the other ranks) on every rank."""
        if self.size == 1:
            assert data is not None
            return bytearray(data)
        t = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if data is not None and size
             else torch.empty(size, dtype=torch.uint8, device=self.device))
        if size:
            dist_call(dist.broadcast, t, src=0, group=self.world)
        return bytearray(t.cpu().numpy().tobytes())

    def broadcast(self, values: torch.Tensor | None, numel: int) -> torch.Tensor:
        """The leader's ``values`` (float32 (numel,)) on every rank, on the CPU."""
        if self.size == 1:
            assert values is not None
            return values.to("cpu", torch.float32)
        t = self._padded(values, numel) if values is not None else torch.empty(numel, dtype=torch.float32,
                                                                              device=self.device)
        dist_call(dist.broadcast, t, src=0, group=self.world)
        return t.cpu()
