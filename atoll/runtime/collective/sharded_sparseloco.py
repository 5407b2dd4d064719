"""SparseLoCo on a sharded island (``--strategy sparseloco --shard-island``): the top-k of whole tensors, one at a time.

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv:2508.15706, Algorithm 1;
:class:`~atoll.strategies.sparseloco.SparseLoCo`) sends the top-k of each 64 x 64 tile (1-D runs of 64) of an
island's error-feedback accumulator. Tiles cross the row boundaries of FSDP2's ``Shard(0)`` pieces (a (64, 32)
matrix over two ranks is one tile, but two pieces of 32 rows), so a rank's piece alone cannot make the
reference's selection. :class:`ShardedSparseLoCo` therefore keeps the accumulator sharded like its parameter
(each rank its rows, in its shard's flat order: the accumulation ``e ← β e + α Δ`` is element-wise and runs on
them) and, for each parameter in turn, all-gathers the island's accumulator inside the island
(``DTensor.full_tensor``), compresses it exactly as the unsharded strategy compresses that tensor
(:meth:`SparseCompressor.of_tensor <atoll.algorithms.sparse.SparseCompressor.of_tensor>`: the same tiles, k
and 2-bit levels), removes what it sends and keeps its own rows of the new accumulator. Every rank of the
island then holds the same payload, the unsharded island's (:meth:`~atoll.algorithms.sparse.SparseCompressor.join`),
which the exchange moves once (``replicated``: cut into one piece per rank, :meth:`DistComm.all_gather
<atoll.runtime.collective.comm.DistComm.all_gather>`): the unsharded island's bytes. The aggregation (each
island's values clipped to the median norm per tensor, each entry the token-weighted mean over its senders)
decodes every island's part of one tensor at a time for the whole tensor
(:meth:`~atoll.algorithms.sparse.SparseCompressor.split`), and each rank applies its own rows of the outer step
to its shard of the global parameters. Whether an island leaves its pseudo-gradient out (not finite on any
rank) is summed over its ranks with the norm of plain averaging's step (one all-reduce of two float64 per
round), so they agree.

Memory: at most one parameter's whole tensor per rank at a time (its accumulator, its tiles' positions, 8 bytes
each, and their values: about 24 bytes per element of the largest tensor at the peak of its compression, 6 GB
for a 128k x 2048 embedding), plus the payloads, never the whole model: the compressor of the model only sizes,
joins and splits payloads, and builds no table of positions. Cost: one all-gather of each parameter's
accumulator per round inside the island (the fast link: 4 bytes per parameter per round), and the selection and
the aggregation computed redundantly on each of the island's R ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from atoll.algorithms.finite import l2_norm
from atoll.runtime.collective.failure import dist_call
from atoll.runtime.collective.sharded_demo import local_rows
from atoll.strategies.base import Strategy
from atoll.strategies.sparseloco import SparseLoCo


class ShardedSparseLoCo(SparseLoCo):
    """:class:`~atoll.strategies.sparseloco.SparseLoCo` over parameters sharded by FSDP2 (``DTensor`` s placed
    ``Shard(0)``): the same payloads and outer step as the unsharded strategy on the whole tensors, to the
    round-off of the island's reduce-scattered gradient (see the module docstring). Collective over the island's
    ranks: each round all-gathers every accumulator and all-reduces two scalars. Its state is
    :class:`SparseLoCo`'s, each rank's accumulator (``error``) and global parameters being its shard's, float32
    (numel of the rank's pieces,) on the CPU."""

    def _island_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the island's ranks (an all-reduce over the parameters' mesh)."""
        p = self.islands[0].params[0]
        out = values.to(p.to_local().device)
        dist_call(dist.all_reduce, out, group=p.device_mesh.get_group())
        return out.cpu()

    def _send(self, position: int) -> tuple[dict[str, torch.Tensor], float, float]:
        """:meth:`SparseLoCo._send` one parameter at a time: the island's whole accumulator of the tensor,
        all-gathered, compressed and reduced by what it sends; this rank keeps its rows. Returns the model's
        payload (the same on every rank of the island) and the whole accumulator's squared norms."""
        island, error = self.islands[position], self.error[position]
        parts, before, after, offset = [], 0.0, 0.0, 0
        for j, (p, piece) in enumerate(zip(island.params, island.local_params(), strict=True)):
            mine = error[offset:offset + piece.numel()]
            offset += piece.numel()
            whole = DTensor.from_local(mine.view(piece.shape).to(piece.device), p.device_mesh, p.placements,
                                       run_check=False, shape=p.shape, stride=p.stride())
            whole = whole.full_tensor().to("cpu", torch.float32).reshape(-1)  # the island's all-gather
            compressor = self.compressor.of_tensor(j)
            parts.append(compressor.compress(whole))
            before += l2_norm(whole) ** 2
            whole.sub_(compressor.decompress(parts[-1]))
            after += l2_norm(whole) ** 2
            mine.copy_(whole.view(p.shape)[local_rows(p)].reshape(-1))
        return self.compressor.join(parts), before, after

    def _aggregate(self, gathered: list[dict[str, torch.Tensor]], weights: list[float]) -> tuple[torch.Tensor, float]:
        """:meth:`SparseLoCo._aggregate` one parameter at a time: every sending island's part of the tensor
        decoded, clipped and averaged for the whole tensor; this rank's rows of it, float32 (numel of its pieces,),
        and the whole update's norm.

        Raises:
            ValueError: a sending island's payload does not have the model's sizes.
        """
        live = [(self.compressor.split(p), w) for p, w in zip(gathered, weights, strict=True) if w > 0]
        island = self.islands[0]
        agg, square, offset = torch.empty(self.numel), 0.0, 0
        for j, (p, piece) in enumerate(zip(island.params, island.local_params(), strict=True)):
            whole = self.compressor.of_tensor(j).aggregate([parts[j] for parts, _ in live], [w for _, w in live],
                                                           self.config.sparseloco_clip)
            square += l2_norm(whole) ** 2
            agg[offset:offset + piece.numel()] = whole.view(p.shape)[local_rows(p)].reshape(-1)
            offset += piece.numel()
        return agg, math.sqrt(square)


def shard_aware_strategy(build: Callable[..., Strategy]) -> Callable[..., Strategy]:
    """A spec's lockstep strategy for sharded islands: :class:`SparseLoCo` becomes :class:`ShardedSparseLoCo`
    (it selects from whole tensors); any other is kept (its exchanges are per flat position, or its optimizer
    selects from whole tensors itself: :func:`~atoll.runtime.collective.sharded_demo.shard_aware`)."""
    return ShardedSparseLoCo if build is SparseLoCo else build

