"""An island of R ranks as one of its ranks sees it: its rows, its gradient mean, its loss, its tokens; built
whole (torch DDP) or sharded (FSDP2).

One piece for both places an island spans several processes: the collective runtime (island i of a lockstep job
of ``islands x R`` ranks, :class:`~atoll.runtime.collective.runtime.CollectiveRuntime`) and the service's island
job (``atoll island`` under torchrun, :class:`~atoll.runtime.service.island.RankWorker`). Each inner step, rank
``position`` takes rows ``[position * n, (position + 1) * n)`` of the island's batch of ``R * n`` rows (the same
tokens per inner step as an island of one rank), and ends with the island's mean gradient and mean loss:

- whole, under torch DDP (:func:`~atoll.runtime.collective.torch_ddp.wrap`): DDP's hooks sum the gradient in
  the backward pass, :func:`~atoll.runtime.collective.torch_ddp.finish_mean` divides it by the ranks that
  contributed;
- sharded (:mod:`~atoll.runtime.collective.sharding`, FSDP2): the reduce-scatter of the last micro-batch's
  backward pass leaves this rank's piece of the mean gradient;
- whole without DDP (the collective runtime's host path, which survives a lost island): the gradients and the
  loss concatenated and summed over the island's ranks in one all-reduce, run by ``resilient`` (the comm's
  retry over the survivors' groups), then divided by R.

The loss (a 0-d tensor, left on the device) is the ranks' mean, the same on every rank (a diverged island is
reset alike everywhere); the island's tokens are counted as one rank of the whole batch would count them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from atoll.runtime.collective import torch_ddp
from atoll.runtime.collective.failure import dist_call, hooked_call

if TYPE_CHECKING:
    from atoll.config.facts import IslandSettings
    from atoll.job.island import InnerOptimizer, Island
    from atoll.runtime.collective.sharding import ShardLayout

T = TypeVar("T")


def _once(op: Callable[[], T]) -> T:
    return op()


class RankIsland:
    """Rank ``position`` of an island of ``ranks`` ranks over the process group ``group``.

    Args:
        ranks: R, the island's ranks (1: every collective below is skipped).
        position: this rank's place in the island, 0..R-1 (its rows of each batch; its piece of a sharded model).
        device: where the island's model and its gradient collectives live.
        sharded: the island's model is sharded over its ranks (FSDP2), else each rank holds it whole.
        group: the island's process group (None with one rank); its owner replaces it when the groups are formed
            again (the collective runtime, after a lost island).
        resilient: runs the host path's all-reduce (``resilient(op)`` returns ``op()``; the collective runtime's
            :meth:`~atoll.runtime.collective.comm.DistComm.resilient` runs it again over the survivors' groups);
            default: once.

    Attributes:
        layout: a sharded island's layout of the shards (:class:`~atoll.runtime.collective.sharding.ShardLayout`),
            once :meth:`build` made it; None for a whole island.
    """

    def __init__(self, ranks: int, position: int, device: torch.device, sharded: bool, group: Any = None,
                 resilient: Callable[[Callable[[], torch.Tensor]], torch.Tensor] = _once) -> None:
        self.ranks, self.position, self.device, self.sharded = ranks, position, device, sharded
        self.group = group
        self.resilient = resilient
        self.layout: ShardLayout | None = None

    # --- built whole or sharded -----------------------------------------------------------------------------
    def build(self, index: int, model: torch.nn.Module, settings: IslandSettings, optimizer: InnerOptimizer,
              ddp: bool, seed: int, init_from: Path | None = None, cross_group: Any = None) -> Island:
        """Island ``index`` of this rank around ``model`` (this rank's copy; a sharded island's may be on the meta
        device), from the island ``settings`` and its inner ``optimizer`` factory
        (:func:`~atoll.job.island.build_island`).

        Whole: ``model`` moved to :attr:`device`; with ``ddp`` put under torch DDP over the default process group
        (:func:`~atoll.runtime.collective.torch_ddp.wrap`: the service's island job, whose default group is the
        island's ranks; the collective runtime's ``ddp`` strategy, whose is every rank of the job). Sharded: the
        model sharded over :attr:`group` before the inner optimizer is built, so it holds this rank's piece only
        (a meta model initialised from ``seed``, or the weights of run folder ``init_from``:
        :func:`~atoll.runtime.collective.sharding.build_sharded_island`), :attr:`layout` set; with ``ddp`` its
        gradient piece is also summed across the islands over ``cross_group`` in the backward pass
        (:func:`~atoll.runtime.collective.torch_ddp.hook_sharded`)."""
        from atoll.job.island import build_island

        if not self.sharded:
            island = build_island(index, model.to(self.device), settings, optimizer)
            return torch_ddp.wrap(island, settings, self.device) if ddp else island
        from atoll.runtime.collective.sharding import build_sharded_island

        island, self.layout = build_sharded_island(index, model, settings, optimizer, self.group, self.device, seed,
                                                   init_from)
        return torch_ddp.hook_sharded(island, self.group, cross_group) if ddp else island

    # --- each inner step ------------------------------------------------------------------------------------
    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the island's ``batch`` (int64 (R * n, seq_len + 1)): a view, (n, seq_len + 1)."""
        n = batch.shape[0] // self.ranks
        return batch[self.position * n:(self.position + 1) * n]

    def forward_backward(self, island: Island, batch: torch.Tensor) -> None:
        """This rank's rows of the island's ``batch``, forward and backward; then ``island``'s gradient is the
        island's mean (see the module docstring), its ``last_loss`` the ranks' mean and its ``tokens`` the whole
        batch's. Collective over the island's ranks (DDP's and a ``ddp`` run's: over every rank of the job).

        Raises:
            PeerFailure: another rank stopped responding (and ``resilient`` did not recover).
        """
        mine = self.rows(batch)
        if island.ddp is not None:  # DDP's hooks sum every rank's gradient in the backward pass: a peer lost
            hooked_call(island.forward_backward, mine)  # there is a PeerFailure, as in any collective
            island.sync_islands = hooked_call(torch_ddp.finish_mean, island, self.ranks)
        else:
            island.forward_backward(mine)  # its grad_accum micro-batches (a sharded island syncs on the last)
        if self.ranks == 1:
            return
        island.tokens += (self.ranks - 1) * mine[:, 1:].numel()  # the island's tokens, as one rank would count
        if self.sharded or island.ddp is not None:  # the gradient is averaged: the loss's ranks' mean
            loss = island.loss_tensor.reshape(1).to(torch.float32)
            dist_call(dist.all_reduce, loss, group=self.group)
            island.last_loss = loss.div_(self.ranks)[0]  # stays on the device until read
            return
        self._mean_on_host(island)

    def _mean_on_host(self, island: Island) -> None:
        """The gradients and the loss summed over the island's ranks in one all-reduce, divided by R."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in island.params]
        loss = island.loss_tensor.reshape(1).to(grads[0].dtype)
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss])
        flat = self.resilient(lambda: self._sum(flat))
        flat.div_(self.ranks)
        offset = 0
        for p in island.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        island.last_loss = flat[-1].clone()  # (not a view keeping the gradients' buffer)

    def _sum(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat``'s sum over the island's ranks (a new tensor; the group read now: it may have been replaced)."""
        out = flat.clone()
        dist_call(dist.all_reduce, out, group=self.group)
        return out
