"""DiLoCo's outer round for islands in one process, compiled into one pass over the parameters.

The eager round (``DiLoCo.outer_step``) runs one torch kernel per operation: each island's pseudo-gradient
Δ_i = θ − θ_i into its own buffer, a finite check of each, their token-weighted mean into another, the outer
SGD-Nesterov step, then a copy of the new globals into every island. Every kernel reads and writes whole
vectors, so a round moves each element through memory several times (bench/out/fused_round counts the
passes). Where every island lives in this process on the CPU (the ``local`` runtime), the whole round is
elementwise per parameter, and ``torch.compile`` fuses it into one loop that reads θ, the outer momentum m and
each θ_i once and writes each once (bench/fused_round.py measures both):

    Δ̄ = Σ_i a_i (θ − θ_i)      a_i = w_i / Σ_j w_j, w_i the tokens island i trained since the last round
    m ← μ m + Δ̄                torch's SGD, Nesterov (DiLoCo, arXiv:2311.08105, Algorithm 1; outer lr η, μ)
    θ ← θ − η (Δ̄ + μ m)        (μ = 0: θ ← θ − η Δ̄, and no momentum is kept)
    θ_i ← θ                     every island restarts from the new globals

Before it, another compiled loop reads θ and every θ_i once more for the sums Σ(θ − θ_i): a pseudo-gradient
that is not finite must be left out of the mean (the eager round drops it), and the fused loop overwrites the
islands, so it runs only once every sum is finite. The caller runs the eager round otherwise.

Torch compiles each function once per island count, grad mode and momentum (0 or not), at most 8 of them in
one process; past that, or where compiling fails (no C++ compiler), ``DiLoCo`` runs the eager round instead
and says so once.

The floats are not the eager round's bit for bit: the compiled loop adds in its own order and may contract a
multiply and an add into one (bench/out/fused_round; tests/test_fused_round.py bounds it). So it is a setting,
``outer_kernel = "compiled"``, not the default. Compiling takes a few seconds, once per process (inductor's
C++ backend: it needs a C++ compiler on the machine).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

__all__ = ["FusedRound"]

#: the length the loops are first compiled at: above 4096, where inductor's reductions specialize their
#: accumulation, so that a model's vector (longer) reuses the graphs instead of compiling them again
WARM_UP_NUMEL = 1 << 16


def _delta_sums(g: torch.Tensor, islands: list[torch.Tensor]) -> list[torch.Tensor]:
    """Σ(θ − θ_i) for each island: 0-d float32 tensors (read only)."""
    return [(g - p).sum() for p in islands]


def _round(g: torch.Tensor, m: torch.Tensor | None, islands: list[torch.Tensor], shares: list[torch.Tensor],
           lr: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """The round, in place (module docstring); returns Σ of the new θ (0-d float32)."""
    mean = (g - islands[0]) * shares[0]
    for p, a in zip(islands[1:], shares[1:], strict=True):
        mean = mean + (g - p) * a
    if m is None:  # plain SGD (outer momentum 0)
        new_g = g - mean * lr
    else:
        new_m = m * mu + mean
        new_g = g - (mean + new_m * mu) * lr
        m.copy_(new_m)
    g.copy_(new_g)
    for p in islands:
        p.copy_(new_g)
    return new_g.sum()


@cache
def _compiled(name: str) -> Any:
    """The compiled function ``name`` (one per process; dynamic shapes: one graph for every length)."""
    fn = {"delta_sums": _delta_sums, "round": _round}[name]
    return torch.compile(fn, dynamic=True, fullgraph=True)


class FusedRound:
    """The compiled outer round of K islands held in this process on the CPU (module docstring).

    Each island's parameters are one 1-D float32 vector here, the length of the globals (its parameters made
    contiguous: :meth:`atoll.job.flat_views.FlatViews.make_contiguous`): each loop is then one call, where one
    call per parameter tensor would pay a compiled call's fixed cost (its guards) per tensor, more than the
    arithmetic of a small one (bench/out/fused_round).

    Args:
        lr: the outer learning rate η.
        momentum: the outer Nesterov momentum μ (0: plain SGD).
    """

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = torch.tensor(lr, dtype=torch.float32)
        self.mu = torch.tensor(momentum, dtype=torch.float32)

    @staticmethod
    def _check(globals_: torch.Tensor, islands: Sequence[torch.Tensor]) -> None:
        for p in islands:
            if p.shape != globals_.shape or p.dtype != torch.float32:
                raise ValueError(f"island of {p.dtype} {tuple(p.shape)} for globals of float32 "
                                 f"{tuple(globals_.shape)}")

    def finite_deltas(self, globals_: torch.Tensor, islands: Sequence[torch.Tensor]) -> list[bool]:
        """Whether each island's pseudo-gradient θ − θ_i is finite: one read of θ and every θ_i.

        Args:
            globals_: θ, float32 (numel,) on the CPU.
            islands: each island's parameters, float32 (numel,) on the CPU.

        Returns:
            One bool per island (a finite sum proves every element finite; a sum that overflowed reads as not
            finite, and the caller's eager round then checks element by element).

        Raises:
            ValueError: an island's vector differs from the globals in shape or dtype.
        """
        self._check(globals_, islands)
        with torch.no_grad():  # (the round's grad mode: one graph for both)
            sums = _compiled("delta_sums")(globals_, list(islands))
        return [math.isfinite(float(s)) for s in sums]

    def warm_up(self, islands: int) -> None:
        """Compile both loops for ``islands`` islands on vectors of :data:`WARM_UP_NUMEL` zeros (later calls of
        more than 4096 elements reuse the graphs: their shapes are dynamic), so that a machine that cannot
        compile says so before training starts.

        Raises:
            Exception: whatever torch.compile raises (no C++ compiler: ``InvalidCxxCompiler``, ...).
        """
        n = WARM_UP_NUMEL
        momentum = None if float(self.mu) == 0.0 else torch.zeros(n)
        self.finite_deltas(torch.zeros(n), [torch.zeros(n) for _ in range(islands)])
        self.apply(torch.zeros(n), momentum, [torch.zeros(n) for _ in range(islands)], [1.0] * islands)

    def apply(self, globals_: torch.Tensor, momentum: torch.Tensor | None, islands: Sequence[torch.Tensor],
              weights: Sequence[float]) -> bool:
        """One round in place: θ, m and every island's parameters (module docstring).

        Args:
            globals_: θ, float32 (numel,) on the CPU (the outer optimizer's parameters).
            momentum: m, float32 (numel,) (the SGD optimizer's ``momentum_buffer``); None with μ = 0.
            islands: each island's parameters, float32 (numel,) on the CPU (written).
            weights: per island, its weight w_i (tokens since the last round); their sum must be positive.

        Returns:
            Whether the sum of the new θ is finite (when not, θ, m and the islands hold what the step gave).

        Raises:
            ValueError: the weights sum to zero or less, the momentum buffer is given with μ = 0 or missing
                with μ > 0, or an island's vector differs from the globals in shape or dtype.
        """
        self._check(globals_, islands)
        total = float(sum(weights))
        if total <= 0:
            raise ValueError("weights sum to zero")
        if (momentum is None) != (float(self.mu) == 0.0):
            raise ValueError("the momentum buffer is needed exactly when the outer momentum is not 0")
        shares = [torch.tensor(float(w) / total, dtype=torch.float32) for w in weights]
        with torch.no_grad():
            total_sum = _compiled("round")(globals_, momentum, list(islands), shares, self.lr, self.mu)
        return math.isfinite(float(total_sum))
