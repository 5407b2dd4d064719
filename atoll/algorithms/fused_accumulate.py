"""SparseLoCo's accumulation for islands in one process, compiled into one loop.

Each round SparseLoCo (arXiv:2508.15706, Algorithm 1) folds every island's pseudo-gradient into its error-feedback
accumulator and measures what the summary reports. The eager round (``SparseLoCo.outer_step``) does it in
whole-vector passes of their own: Δ_i = θ − θ_i into a buffer, a finite check of it, ``Σ w_i Δ_i`` and its norm
(the step ratio's plain step), ``e_i ← β e_i + α Δ_i``, and ‖e_i‖² (the sent energy's "before"). Where every
island lives in this process on the CPU, all of it is elementwise, and one compiled loop reads θ, each θ_i and
each e_i once and writes each new accumulator once::

    Δ_i = θ − θ_i     e_i' = β e_i + α Δ_i     (into a second buffer)
    returns Σ Δ_i (per island: not finite where Δ_i is not, or where the sum overflowed), ‖e_i'‖² (per island),
    ‖Σ_i w_i Δ_i‖²

The new accumulators go to a second buffer per island, kept from round to round, so an island whose Δ_i is not
finite leaves every accumulator untouched (the eager round leaves it out, and its accumulator as it was): the
caller then runs the eager round, and swaps the buffers otherwise. That costs one more accumulator per island in
memory (4 bytes per parameter per island). bench/out/fused_round measures the round both ways, and the
reference's selection alone beside them.

The reference's own kernels (the tiles' top-k, their 2-bit values, the aggregation) are not part of this loop and
run as in the eager round, on the accumulators this loop wrote.

The floats are not the eager round's bit for bit: the loop adds in its own order and may contract ``β e + α Δ``
into one multiply-add, and its sums are float32 reductions in inductor's order (the eager round's norms are
:func:`~atoll.algorithms.finite.l2_norm`'s: row-wise norms combined in float64). So it is a setting,
``outer_kernel = "compiled"``, not the default (tests/test_compiled_sparseloco.py bounds the difference).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from atoll.algorithms.compiled_loop import compiled_loop, warm_up_numel

__all__ = ["FusedAccumulate"]


def _accumulate(g: torch.Tensor, islands: list[torch.Tensor], errors: list[torch.Tensor], outs: list[torch.Tensor],
                beta: torch.Tensor, rate: torch.Tensor, weights: list[torch.Tensor]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """``outs[i] = β errors[i] + α (g − islands[i])`` (module docstring), every tensor float32 (numel,); returns
    each island's Σ(g − θ_i), each ‖outs[i]‖², and ‖Σ_i w_i (g − θ_i)‖² (0-d float32). ``beta``, ``rate`` and
    ``weights`` are 0-d float32 tensors (a Python float is a constant of the graph: one compile per value)."""
    sums, energies, plain = [], [], None
    for p, e, out, w in zip(islands, errors, outs, weights, strict=True):
        delta = g - p
        sums.append(delta.sum())
        new = e * beta + delta * rate
        out.copy_(new)
        energies.append((new * new).sum())
        plain = delta * w if plain is None else plain + delta * w
    assert plain is not None
    return sums, energies, (plain * plain).sum()


class FusedAccumulate:
    """SparseLoCo's accumulation of K islands held in this process on the CPU (module docstring).

    Args:
        beta: the accumulators' decay β (``sparseloco_beta``).
        rate: the outer rate α folded into them (``outer_lr``: the reference puts it into the accumulator).
    """

    def __init__(self, beta: float, rate: float) -> None:
        self.beta = torch.tensor(beta, dtype=torch.float32)
        self.rate = torch.tensor(rate, dtype=torch.float32)
        self._spare: list[torch.Tensor] = []  # the accumulators' second buffers, kept from round to round

    def warm_up(self, islands: int, numel: int) -> None:
        """Compile the loop for ``islands`` islands over vectors of ``numel`` elements, on zeros of a length on
        their side of 4096 (:func:`~atoll.algorithms.compiled_loop.warm_up_numel`), so that a machine that cannot
        compile says so before training starts, and no round compiles.

        Raises:
            Exception: whatever torch.compile raises (no C++ compiler: ``InvalidCxxCompiler``; the process's
                recompile limit reached: ``FailOnRecompileLimitHit``, ...).
        """
        n = warm_up_numel(numel)

        def zeros() -> list[torch.Tensor]:
            return [torch.zeros(n) for _ in range(islands)]

        with torch.no_grad():
            compiled_loop(_accumulate, fuse_reads=True)(torch.zeros(n), zeros(), zeros(), zeros(), self.beta, self.rate,
                                       [torch.tensor(1.0) for _ in range(islands)])

    def apply(self, globals_: torch.Tensor, islands: Sequence[torch.Tensor], errors: Sequence[torch.Tensor],
              weights: Sequence[float]) -> tuple[list[torch.Tensor], list[float], float] | None:
        """Every island's new accumulator, in the second buffers.

        Args:
            globals_: θ, float32 (numel,) on the CPU.
            islands: each island's flat parameters θ_i, float32 (numel,) on the CPU (read only).
            errors: each island's accumulator e_i, float32 (numel,) on the CPU (read only: the caller keeps the
                returned buffers in their place, and this keeps the old ones as the next round's second buffers;
                where the caller passes one of those again, fresh second buffers are made).
            weights: each island's token weight w_i (the step ratio's plain step, ``Σ w_i Δ_i``).

        Returns:
            None where an island's Δ_i is not finite (nothing of the caller's written; a sum that overflowed reads
            as not finite too: the eager round then checks element by element); else the new accumulators
            (float32 (numel,) each), each one's squared norm ‖e_i'‖², and ‖Σ w_i Δ_i‖².

        Raises:
            ValueError: a vector that does not fit the globals (shape, dtype), or counts that differ.
            Exception: whatever torch.compile raises.
        """
        shape = globals_.shape
        if not (len(islands) == len(errors) == len(weights) > 0):
            raise ValueError(f"{len(islands)} islands, {len(errors)} accumulators and {len(weights)} weights")
        for t in (globals_, *islands, *errors):
            if t.dim() != 1 or t.shape != shape or t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"a vector of {t.dtype} {tuple(t.shape)} on {t.device} for globals of float32 "
                                 f"{tuple(shape)} on the CPU")
        held = {e.data_ptr() for e in errors}
        if len(self._spare) != len(errors) or any(s.shape != shape or s.data_ptr() in held for s in self._spare):
            self._spare = [torch.empty_like(e) for e in errors]  # (never the caller's accumulators)
        outs = self._spare
        with torch.no_grad():
            sums, energies, plain = compiled_loop(_accumulate, fuse_reads=True)(
                globals_, list(islands), list(errors), outs, self.beta, self.rate,
                [torch.tensor(float(w), dtype=torch.float32) for w in weights])
        if not all(math.isfinite(float(s)) for s in sums):
            return None
        self._spare = list(errors)
        return outs, [float(e) for e in energies], float(plain)
