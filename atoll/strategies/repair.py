"""Resetting a diverged island from a healthy peer, where every island holds the same replica (ddp, demo).

In ``ddp`` and ``demo`` every island applies the same update every step, so a healthy island's weights are
the model. An island whose loss is not finite (:attr:`atoll.job.island.Island.diverged`) is reset from the
lowest-indexed healthy island: its weights travel as an all-reduce where that island weighs 1 and the
others 0 (float32, exact: ``1 * x + 0 + ... = x``), so every runtime moves them the same way and counts
the bytes. Every island must learn who diverged: :func:`gather_status` is that (small) all-gather, run
only when something went wrong (ddp sees it in the gradient all-reduce's total weight, demo in its
payloads). With no healthy island left the job has diverged (:class:`~atoll.job.divergence.Diverged`).
See docs/reliability.md, "Bad numbers".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atoll.job.divergence import Diverged

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm

#: an island's state at a step: healthy, its gradient not finite (its weights are), or diverged
HEALTHY, BAD_GRADIENT, DIVERGED = 0, 1, 2


def gather_status(comm: Comm, status: list[int]) -> list[int]:
    """Every island's status (one int8 per island, counted as 1 byte) from the local islands' ``status``."""
    gathered = comm.all_gather([torch.tensor([s], dtype=torch.int8) for s in status], payload_bytes=1)
    return [int(t[0]) for t in gathered]


def reset_from_peer(comm: Comm, islands: list[Island], status: list[int], step: int,
                    keep_optimizer: bool) -> int:
    """Reset every diverged island (``status``: of every island of the job) from the first healthy one.

    Args:
        comm: the collectives across every island.
        islands: the islands of this process.
        status: per island of the job, :data:`HEALTHY`, :data:`BAD_GRADIENT` or :data:`DIVERGED`.
        step: the 0-based inner step (for the error).
        keep_optimizer: keep the reset island's inner optimizer state (ddp: every replica's is the same).

    Returns:
        The number of islands of the job that were reset.

    Raises:
        Diverged: every island diverged: none is left to copy from.
    """
    diverged = [i for i, s in enumerate(status) if s == DIVERGED]
    if not diverged:
        return 0
    donors = [i for i, s in enumerate(status) if s != DIVERGED]
    if not donors:
        raise Diverged(step + 1, "every island's training loss is not finite (no healthy replica to reset from)")
    donor = donors[0]
    flats = [island.flat_params() if island.index == donor else torch.zeros(sum(p.numel() for p in island.params))
             for island in islands]
    weights = [1.0 if island.index == donor else 0.0 for island in islands]
    params = comm.all_reduce_mean(flats, weights=weights)
    for island in islands:
        if status[island.index] == DIVERGED:
            island.reset_to(params, keep_optimizer=keep_optimizer)
    return len(diverged)
