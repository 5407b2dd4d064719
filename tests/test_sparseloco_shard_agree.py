"""A sharded island's ranks agree to leave a pseudo-gradient out when it is not finite on one rank only."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from atoll.strategies.sparseloco import SparseLoCo


def test_a_pseudo_gradient_not_finite_on_one_rank_is_dropped_on_both() -> None:
    """Two ranks of one island (one local island per process): rank 0's shard holds a NaN, rank 1's is finite.
    ``_agree`` sums the flags over the island (here: a two-party sum in threads), so both drop it, and the plain
    step's size is 0 on both (nothing sent)."""
    barrier, box = threading.Barrier(2), [None, None]

    def island_sum(rank: int):  # noqa: ANN202
        def total(values: torch.Tensor) -> torch.Tensor:
            box[rank] = values.clone()
            barrier.wait()
            return box[0] + box[1]
        return total

    shards = [torch.tensor([float("nan"), 1.0]), torch.tensor([2.0, 3.0])]
    out: list = [None, None]

    def rank(r: int) -> None:
        me = SimpleNamespace(_island_sum=island_sum(r), _scratch=lambda n: torch.empty(n))
        me._weighted_sum = lambda sending: SparseLoCo._weighted_sum(me, sending)
        out[r] = SparseLoCo._agree(me, [shards[r]], [1])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out[0] == out[1] == ([True], 0.0)
