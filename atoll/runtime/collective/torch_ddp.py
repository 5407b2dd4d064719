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

Used when it applies (:func:`applies`): the collective runtime, ``--codec fp32``, islands not sharded, and no
island allowed to be lost (a lost peer re-forms the process groups, which a DDP module cannot follow); the
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
    from atoll.config import TrainConfig
    from atoll.job.island import Island


def applies(config: TrainConfig) -> bool:
    """Whether the run's ``ddp`` averages its gradients with torch's DDP hooks (see the module docstring)."""
    return (config.strategy == "ddp" and config.runtime == "collective" and config.codec == "fp32"
            and not config.shard_island and config.min_islands >= config.islands and not config.max_restarts)


def healthy_sum_hook(island, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations here
    """DDP comm hook (``bucket``: a ``dist.GradBucket``; returns a ``torch.futures.Future`` of its tensor):
    the sum over every rank of the bucket's gradients, a rank whose loss is not finite contributing zeros
    (``island.loss_finite``, a 0-d bool on the device; nothing is read on the host)."""
    buffer = bucket.buffer()
    if island.loss_finite is not None:
        buffer.masked_fill_(~island.loss_finite, 0.0)
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap(island: Island, config: TrainConfig, device: torch.device) -> Island:
    """Put ``island``'s model under DDP (default process group: every rank of the job) with
    :func:`healthy_sum_hook`; its training forward pass goes through the DDP module (compiled with
    ``--compile``); returns the island. The replicas start identical (the same seed), so no initial
    broadcast is needed."""
    # no buffer sync in the forward pass (the argument's name changed in torch 2.13; the old one warns there)
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
               inspect.signature(DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False})
    ddp = DistributedDataParallel(island.model, device_ids=[device.index] if device.type == "cuda" else None,
                                  init_sync=False, gradient_as_bucket_view=True, **no_sync)
    ddp.register_comm_hook(island, healthy_sum_hook)
    island.ddp = ddp
    island.forward = CompiledForward(ddp) if config.compile else ddp
    return island


def finish_mean(island: Island, ranks_per_island: int) -> torch.Tensor:
    """After the backward pass: divide the summed gradients by the ranks that contributed; returns that
    count over ``ranks_per_island`` (the islands that contributed; a 0-d float32 on the device, not read).
    Collective over every rank of the job."""
    count = island.loss_finite.to(torch.float32).reshape(1) if island.loss_finite is not None \
        else torch.ones(1, device=island.device)
    dist_call(dist.all_reduce, count)
    grads = [p.grad for p in island.params if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, count[0])  # 0 contributors: 0/0, a NaN mean, and every island skips the step
    return (count / ranks_per_island)[0]


def describe(config: Any) -> dict[str, Any]:
    """What ``summary.json`` says about it: ``{"gradient_sync": "torch_ddp"}`` where it applies."""
    return {"gradient_sync": "torch_ddp"} if applies(config) else {}
