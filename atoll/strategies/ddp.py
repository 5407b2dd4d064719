"""``ddp``: the data-parallel baseline. Gradients are averaged across islands at every inner step.

The maths is that of one model trained with K times the batch: the mean of the islands' mean-loss
gradients is the gradient of the mean loss over all K batches. Every island applies the same averaged
gradient with identically initialised AdamW states, so the replicas stay identical.
"""

from __future__ import annotations

import torch

from atoll.strategies.base import Strategy


class DDP(Strategy):
    """Ring all-reduce of the full float32 gradient every inner step."""

    name = "ddp"

    def step(self, step: int) -> None:
        grads = [island.flat_grads() for island in self.islands]
        mean = self.comm.all_reduce_mean(grads, weights=[1.0] * len(grads))
        for island in self.islands:
            island.set_flat_grads(mean)
            island.inner_step()

    def global_params(self) -> torch.Tensor:
        return self.islands[0].flat_params()
