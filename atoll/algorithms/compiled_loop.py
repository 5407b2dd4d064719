"""How atoll compiles its outer rounds' loops: once per process, dynamic shapes, and a recompile limit of their own.

The loops are :mod:`atoll.algorithms.fused_round`'s (diloco, streaming) and
:mod:`atoll.algorithms.fused_accumulate`'s (sparseloco). Each is compiled by ``torch.compile`` (inductor's C++
backend: a C++ compiler on the machine) with ``dynamic=True`` and ``fullgraph=True``, so that one graph serves
every vector length on one side of 4096 elements (where inductor's reductions specialize their accumulation):
a strategy compiles its loops at :data:`WARM_UP_NUMEL` as it is built, and no round compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

__all__ = ["FUSE_READS", "RECOMPILE_LIMIT", "WARM_UP_NUMEL", "compiled_loop", "warm_up_numel"]

#: the length the loops are first compiled at: above 4096, where inductor's reductions specialize their
#: accumulation, so that a model's vector (longer) reuses the graphs instead of compiling them again
WARM_UP_NUMEL = 1 << 16

#: graphs each loop may compile in one process: one per island count, momentum (0 or not), error feedback,
#: rounding and side of 4096 elements that the process's runs use (torch's default, 8, is used up by a sweep of a
#: few settings in one process; past this, the eager round)
RECOMPILE_LIMIT = 64


def warm_up_numel(numel: int) -> int:
    """The length to compile a loop at for vectors of ``numel`` elements: their own below 4096, else
    :data:`WARM_UP_NUMEL` (the model's vectors then reuse the graph)."""
    return numel if numel <= 4096 else WARM_UP_NUMEL


#: inductor's count of reads past which it writes an intermediate to memory (its default: 4); raised for a loop
#: whose intermediates are each read a few times (sparseloco's Δ_i: its sum, its accumulator, the weighted sum),
#: so they stay in registers and the loop is one pass (at the default, inductor's generated code wrote the new
#: accumulators twice and read them again in two loops of their own)
FUSE_READS = {"realize_reads_threshold": 1000}


@cache
def compiled_loop(fn: Callable[..., Any], fuse_reads: bool = False) -> Callable[..., Any]:
    """``fn`` compiled (one per process; dynamic shapes: one graph for every length), called with torch's
    recompile limit at :data:`RECOMPILE_LIMIT` (for these functions only); ``fuse_reads``: with
    :data:`FUSE_READS`.

    The returned function raises whatever torch.compile raises on its first call of a new shape (no C++
    compiler: ``InvalidCxxCompiler``; the limit reached: ``FailOnRecompileLimitHit``, ...)."""
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=FUSE_READS if fuse_reads else None)

    def call(*args: Any) -> Any:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args)

    return call
