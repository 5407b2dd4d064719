"""The ``ddp`` baseline on torch's own DistributedDataParallel: gradients all-reduced by its backward hooks.

Without it, the collective runtime's ``ddp`` moved every gradient through the host once per inner step, after
the backward pass (a float32 CPU copy, an all-reduce, a copy back): no overlap, and on GPUs the strawman that
every DiLoCo-against-ddp ratio would be measured against. With it, ``torch.nn.parallel.DistributedDataParallel``
(Li et al. 2020, "PyTorch Distributed", arXiv:2006.15704) all-reduces the gradient in buckets while the
backward pass runs, on the device (NCCL on GPUs, gloo on CPUs), over every rank of the job (each island's
ranks and every island: the mean of every rank's rows, which is the mean of the islands' means); with
``--grad-accum`` the micro-batches but the last run in ``no_sync``.

What the host path did for a faulty island is kept on the device: the comm hook (:func:`healthy_sum_hook`)
zeroes the bucket of a rank whose loss is not finite before the all-reduce (``masked_fill``: NaN times 0 would
stay NaN), and :func:`finish_mean` divides the sum by the number of ranks that contributed (one scalar
all-reduced on the device). A diverged island is then reset from a healthy peer by the strategy, as before.
A gradient that is not finite on a finite loss (an overflow) is not left out but makes the mean not finite,
so every island skips that step (the host path left that island out).

A sharded island (``--shard-island``, FSDP2 inside each island) is hybrid sharded the way torchft's HSDP is: FSDP2
reduce-scatters the island's mean gradient over the island's ranks in the backward pass, and its all-reduce
hook (:class:`HybridSync`, ``FSDPModule.set_all_reduce_hook``) sums that shard across the islands, over the
cross-island group of the rank's position, still inside the backward pass, before the next block's
reduce-scatter; a diverged island contributes zeros, decided for the whole island (every rank of it agrees on
one flag), and :func:`finish_mean` divides by the islands that contributed.

Used when it applies (:func:`applies`): the collective runtime, ``--codec fp32``, and no island allowed to be
lost (a lost peer re-forms the process groups, which a DDP module cannot follow; sharded islands never survive a
loss, their FSDP2 groups staying as formed); the
bytes counted per inner step are the host path's, ``2(K-1)/K * 4 * numel`` per island.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from atoll.job.device import CompiledForward
from atoll.runtime.collective.failure import dist_call

if TYPE_CHECKING:
    from atoll.config.facts import RunFacts
    from atoll.config.runtimes import CollectiveConfig
    from atoll.job.island import Island


def applies(config: CollectiveConfig, facts: RunFacts, strategy: Any) -> bool:
    """Whether a ``ddp`` run under the collective runtime (its ``config``, the run's ``facts``, the strategy's
    config ``strategy``) averages its gradients with torch's DDP hooks (see the module docstring)."""
    return (facts.strategy == "ddp" and getattr(strategy, "codec", None) == "fp32"
            and (config.min_islands >= facts.islands or config.shard_island) and not config.max_restarts)


def healthy_sum_hook(island, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations here
    """DDP comm hook (``bucket``: a ``dist.GradBucket``; returns a ``torch.futures.Future`` of its tensor):
    the sum over every rank of the bucket's gradients, a rank whose loss is not finite contributing zeros
    (``island.loss_finite``, a 0-d bool on the device; nothing is read on the host)."""
    buffer = bucket.buffer()
    if island.loss_finite is not None:
        buffer.masked_fill_(~island.loss_finite, 0.0)
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap(island: Island, config: Any, device: torch.device) -> Island:
    """Put ``island``'s model under DDP (default process group: every rank of the job) with
    :func:`healthy_sum_hook`; its training forward pass goes through the DDP module (compiled with
    ``config.compile``: the island settings, or a whole run's config); returns the island. The replicas start
    identical (the same seed), so no initial broadcast is needed."""
    # no buffer sync in the forward pass (the argument's name changed in torch 2.13; the old one warns there)
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
               inspect.signature(DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False})
    ddp = DistributedDataParallel(island.model, device_ids=[device.index] if device.type == "cuda" else None,
                                  init_sync=False, gradient_as_bucket_view=True, **no_sync)
    ddp.register_comm_hook(island, healthy_sum_hook)
    island.ddp = ddp
    island.forward = CompiledForward(ddp) if config.compile else ddp
    return island


class HybridSync:
    """The gradient sync of a sharded island's ``ddp`` (hybrid sharding; ``island.ddp`` holds it): every FSDP2
    unit of the island's model gets an all-reduce hook (:meth:`hook`) that sums its reduce-scattered gradient
    shard (the island's mean, flat, in the policy's reduce dtype) over ``cross_group`` (the ranks at this rank's
    position in every island) in the backward pass; an island whose loss was not finite on any of its ranks
    contributes zeros (:meth:`agreed_finite`).

    Args:
        island: the sharded island (its model already under ``fully_shard``).
        island_group: the island's ranks; cross_group: this position's rank of every island.
    """

    def __init__(self, island: Island, island_group: Any, cross_group: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.island, self.island_group, self.cross_group = island, island_group, cross_group
        #: this step's agreed flag (1.0 or 0.0, float32, shape (1,), on the device); None until agreed
        self.finite: torch.Tensor | None = None
        for module in island.model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self.hook)

    def agreed_finite(self) -> torch.Tensor:
        """Whether every rank of the island had a finite loss this step: agreed once per step over the island's
        group (MIN), at its first all-reduce hook, which every rank of the island reaches in the same order.
        Collective over the island's ranks."""
        if self.finite is None:
            loss_finite = self.island.loss_finite
            flag = (loss_finite.to(torch.float32).reshape(1) if loss_finite is not None
                    else torch.ones(1, device=self.island.device))
            dist_call(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=self.island_group)
            self.finite = flag
        return self.finite

    def hook(self, reduce_output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: zeros if the island is not finite (NaN x 0 would stay NaN), then the sum
        over the islands. Collective over ``cross_group``."""
        reduce_output.masked_fill_(self.agreed_finite() == 0, 0.0)
        dist.all_reduce(reduce_output, group=self.cross_group)

    def finish(self) -> torch.Tensor:
        """After the backward pass: the islands that contributed (0-d float32 on the device, not read); the
        summed shards divided by it. Collective over ``cross_group``."""
        count = self.agreed_finite().clone()
        self.finite = None  # the next step agrees again
        dist_call(dist.all_reduce, count, group=self.cross_group)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in self.island.params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, count[0])  # 0 contributors: a NaN mean, and every island skips the step
        return count[0]


def hook_sharded(island: Island, island_group: Any, cross_group: Any) -> Island:
    """Put a sharded island's gradient sync under :class:`HybridSync` (``island.ddp``); returns the island."""
    island.ddp = HybridSync(island, island_group, cross_group)
    return island


def finish_mean(island: Island, ranks_per_island: int) -> torch.Tensor:
    """After the backward pass: divide the summed gradients by the ranks that contributed (a sharded island:
    by the islands, :meth:`HybridSync.finish`); returns the islands that contributed (a 0-d float32 on the
    device, not read). Collective over every rank of the job."""
    if isinstance(island.ddp, HybridSync):
        return island.ddp.finish()
    count = island.loss_finite.to(torch.float32).reshape(1) if island.loss_finite is not None \
        else torch.ones(1, device=island.device)
    dist_call(dist.all_reduce, count)
    grads = [p.grad for p in island.params if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, count[0])  # 0 contributors: 0/0, a NaN mean, and every island skips the step
    return (count / ranks_per_island)[0]


def describe(applied: bool, sharded: bool) -> dict[str, Any]:
    """What ``summary.json`` says about it where it ``applied``: ``{"gradient_sync": "torch_ddp"}``, or
    ``"fsdp_hybrid"`` for ``sharded`` islands (:class:`HybridSync`)."""
    if not applied:
        return {}
    return {"gradient_sync": "fsdp_hybrid" if sharded else "torch_ddp"}
