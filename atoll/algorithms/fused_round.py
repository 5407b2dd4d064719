"""DiLoCo's and Streaming DiLoCo's outer rounds for islands in one process, compiled into few passes.

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

Torch compiles each function once per island count, momentum (0 or not), error feedback and rounding, all as the
strategy is built (no round compiles), at most :data:`~atoll.algorithms.compiled_loop.RECOMPILE_LIMIT` of them in
one process (:mod:`atoll.algorithms.compiled_loop`); past that (a sweep of many settings in one process), the
strategy runs the eager round instead and says so once. A machine that cannot compile at all (no C++ compiler) is
refused before training starts.

With a block-integer codec (``int8`` / ``int4``, :class:`~atoll.algorithms.quantize._IntCodec`), the mean is of
what the wire carries: each island's target t_i = θ − θ_i (+ its error-feedback residual r_i) is cut into blocks of
``block_size`` elements, and per block::

    s = max|t_i| / q_max           q = clamp(round(t_i / s), −q_max, q_max)     (stochastic: floor(t_i / s + u))
    Δ̂_i = q s                      r_i ← t_i − Δ̂_i                              Δ̄ = Σ_i a_i Δ̂_i

one compiled loop over the blocks into a buffer kept for the mean, then a second for the step and the restart
(one function for both measured slower: inductor split it into two loops anyway, and laid the mean out in fresh
memory at every call). Without error feedback the first loop writes nothing of the caller's, so it is the finite
check too: a block's scale is NaN or inf where one of its elements is, and the scales' sum per island is read
with them (the separate check's pass saved); with error feedback it writes the residuals, and the separate check
runs first. The integers, scales and residuals are the codec's own bit for bit on the same inputs (the same
float32 operations; stochastic rounding draws ``u`` from each island's random source as the codec does:
tests/test_fused_round.py), and nothing is packed: the islands are in one process, so the bytes are counted from
the codec's payload size, not sent. A partial last block runs the same function uncompiled.

The floats are not the eager round's bit for bit: the compiled loop adds in its own order and may contract a
multiply and an add into one (bench/out/fused_round; tests/test_fused_round.py bounds it). With a codec the next
round quantizes globals that differ in their last bits, so a value on the edge of a rounding step may round the
other way; with error feedback that difference is carried on, and a few elements drift apart by up to one step of
the codec's rounding (still the codec's error, not a wrong sum). So it is a setting, ``outer_kernel =
"compiled"``, not the default.

Streaming DiLoCo (arXiv:2501.18512) splits a fragment's round in two halves τ inner steps apart, so the mean
reaches memory once between them: :meth:`FusedRound.mean` (the (quantized) mean, over the fragment's spans of
each island's vector, :class:`~atoll.algorithms.layout.Layout`; its own sums are the finite check, as above) and
:meth:`FusedRound.merge` (the outer step, then θ_i ← α θ_i + (1 − α) θ over the spans). diloco's quantized
round is the same two halves over one span; its fp32 round stays one loop.

Compiling takes a few seconds, once per process (inductor's C++ backend: it needs a C++ compiler on the
machine).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from atoll.algorithms.codec_base import Codec
from atoll.algorithms.compiled_loop import compiled_loop, warm_up_numel
from atoll.algorithms.layout import Layout
from atoll.algorithms.quantize import _IntCodec
from atoll.errors import exception_line

__all__ = ["FusedRound"]

def _delta_sums(gs: list[torch.Tensor], islands: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Σ(θ − θ_i) for each island over the spans of a :class:`Layout` (``gs[j]`` and ``islands[i][j]`` span j's
    elements): 0-d float32 tensors (read only)."""
    return [sum((g - p).sum() for g, p in zip(gs, spans, strict=True)) for spans in islands]


def _means(gs: list[torch.Tensor], islands: list[list[torch.Tensor]], shares: list[torch.Tensor],
           outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 mean Δ̄ = Σ a_i (θ − θ_i) into ``outs``, span by span (as :func:`_delta_sums`); returns each
    island's Σ(θ − θ_i), finite exactly when its pseudo-gradient is (the loop writes only ``outs``, so it is the
    finite check too)."""
    sums = [torch.zeros(()) for _ in islands]
    for j, (g, out) in enumerate(zip(gs, outs, strict=True)):
        mean = None
        for i, (spans, a) in enumerate(zip(islands, shares, strict=True)):
            delta = g - spans[j]
            sums[i] = sums[i] + delta.sum()
            mean = delta * a if mean is None else mean + delta * a
        out.copy_(mean)
    return sums


def _quantized_mean(g: torch.Tensor, islands: list[torch.Tensor], residuals: list[torch.Tensor] | None,
                    draws: list[torch.Tensor] | None, shares: list[torch.Tensor], out: torch.Tensor,
                    qmax: torch.Tensor) -> list[torch.Tensor]:
    """Σ a_i Δ̂_i into ``out`` (module docstring), every tensor float32 ``(blocks, block_size)``; each island's
    residual updated in place; ``draws``: each island's U[0, 1) draws (stochastic rounding), else None. Returns
    each island's Σ of its block scales (0-d float32), finite exactly when its target is (a block's max|t_i| is
    NaN or inf where one element is; a sum that overflowed reads as not finite: the caller's eager round then checks
    element by element), at the cost of one read of the scales. ``qmax``
    is a 0-d float32 tensor, not a Python float: compiled with a float there, inductor (torch 2.13, one thread)
    gave int8's q_max = 127 wrong means for one and three islands, where a tensor gives the codec's own."""
    mean, sums = None, []
    for i, (p, a) in enumerate(zip(islands, shares, strict=True)):
        t = g - p
        if residuals is not None:
            t = t + residuals[i]
        scale = t.abs().amax(dim=1, keepdim=True) / qmax
        sums.append(scale.sum())
        y = t / torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (y.round() if draws is None else (y + draws[i]).floor()).clamp(-qmax, qmax)
        decoded = q * scale
        if residuals is not None:
            residuals[i].copy_(t - decoded)
        mean = decoded * a if mean is None else mean + decoded * a
    out.copy_(mean)
    return sums


def _quantized_means(gs: list[torch.Tensor], islands: list[list[torch.Tensor]],
                     residuals: list[list[torch.Tensor]] | None, draws: list[list[torch.Tensor]] | None,
                     shares: list[torch.Tensor], outs: list[torch.Tensor], qmax: torch.Tensor) -> list[torch.Tensor]:
    """:func:`_quantized_mean` over chunks of whole blocks (``gs[j]``, ``islands[i][j]``, ... chunk j, each
    ``(blocks, block_size)``), in one loop; returns each island's Σ of its block scales over every chunk."""
    sums = [torch.zeros(()) for _ in islands]
    for j, g in enumerate(gs):
        part = _quantized_mean(g, [spans[j] for spans in islands],
                               None if residuals is None else [r[j] for r in residuals],
                               None if draws is None else [u[j] for u in draws], shares, outs[j], qmax)
        sums = [s + x for s, x in zip(sums, part, strict=True)]
    return sums


def _step(g: torch.Tensor, m: torch.Tensor | None, islands: list[torch.Tensor], mean: torch.Tensor,
          lr: torch.Tensor, mu: torch.Tensor, alpha: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The outer step from the mean Δ̄, then the islands: restarted from the new θ (``alpha`` None), or mixed,
    θ_i ← α θ_i + (1 − α) θ (Streaming DiLoCo, arXiv:2501.18512 §2.3; ``alpha`` = (α, 1 − α), 0-d float32); in
    place; returns Σ of the new θ (0-d float32)."""
    if m is None:  # plain SGD (outer momentum 0)
        new_g = g - mean * lr
    else:
        new_m = m * mu + mean
        new_g = g - (mean + new_m * mu) * lr
        m.copy_(new_m)
    g.copy_(new_g)
    for p in islands:
        p.copy_(new_g if alpha is None else p * alpha[0] + new_g * alpha[1])
    return new_g.sum()


def _merge(gs: list[torch.Tensor], ms: list[torch.Tensor] | None, means: list[torch.Tensor],
           islands: list[list[torch.Tensor]], lr: torch.Tensor, mu: torch.Tensor,
           alpha: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """:func:`_step` span by span (as :func:`_delta_sums`); returns Σ of the new θ (0-d float32)."""
    total = torch.zeros(())
    for j, g in enumerate(gs):
        total = total + _step(g, None if ms is None else ms[j], [spans[j] for spans in islands], means[j], lr, mu,
                              alpha)
    return total


def _round(g: torch.Tensor, m: torch.Tensor | None, islands: list[torch.Tensor], shares: list[torch.Tensor],
           lr: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """The round, in place (module docstring); returns Σ of the new θ (0-d float32)."""
    mean = (g - islands[0]) * shares[0]
    for p, a in zip(islands[1:], shares[1:], strict=True):
        mean = mean + (g - p) * a
    return _step(g, m, islands, mean, lr, mu)  # (traced into the same loop: the mean never reaches memory)


def _warm_up_blocks(blocks: int, block_size: int) -> int:
    """A count of blocks to compile the quantized mean at, reused by a model's ``blocks``: on its side of 4096
    (inductor specializes its reductions there), other than the block size (a count equal to it would leave a
    guard that the two be equal), and 1 only for 1 (a count of 1 is a graph of its own)."""
    if blocks > 4096:
        return 8192 if block_size != 8192 else 8193
    if blocks == 1:
        return 1
    return 2 if block_size != 2 else 3


def _compiled(name: str) -> Any:
    """The compiled function ``name`` (:func:`~atoll.algorithms.compiled_loop.compiled_loop`)."""
    return compiled_loop({"delta_sums": _delta_sums, "round": _round, "quantized_means": _quantized_means,
                          "means": _means, "merge": _merge}[name])


class FusedRound:
    """The compiled outer round of K islands held in this process on the CPU (module docstring).

    Each island's parameters are one 1-D float32 vector here (its parameters made contiguous:
    :meth:`atoll.job.flat_views.FlatViews.make_contiguous`): each loop is then one call over a few spans, where one
    call per parameter tensor would pay a compiled call's fixed cost (its guards) per tensor, more than the
    arithmetic of a small one (bench/out/fused_round).

    Two ways to use it: :meth:`apply`, diloco's whole round at once; or :meth:`mean` then, later, :meth:`merge`,
    Streaming DiLoCo's two halves of a fragment's round (the mean is exchanged while the islands train on, then
    the outer step and the mixing), over the fragment's :class:`Layout`.

    Args:
        lr: the outer learning rate η.
        momentum: the outer Nesterov momentum μ (0: plain SGD).
        codec: the exchange's codec: None (fp32), or a block-integer codec (``int8`` / ``int4``: its block size,
            q_max and rounding are read).
        error_feedback: whether each island's codec error is kept and added to its next pseudo-gradient
            (:class:`~atoll.algorithms.wire.ErrorFeedback`; with a codec only).

    Raises:
        ValueError: a codec that is not a block-integer one.
    """

    def __init__(self, lr: float, momentum: float, codec: Codec | None = None, error_feedback: bool = False) -> None:
        self.lr = torch.tensor(lr, dtype=torch.float32)
        self.mu = torch.tensor(momentum, dtype=torch.float32)
        if codec is not None and not isinstance(codec, _IntCodec):
            raise ValueError(f"codec: the compiled round quantizes int8 and int4 only, not {codec.name}")
        self.codec = codec
        self.qmax = torch.tensor(float(codec.qmax) if codec is not None else 0.0, dtype=torch.float32)
        self.error_feedback = codec is not None and error_feedback
        self._means: dict[str, torch.Tensor] = {}  # per key, its mean Δ̄, kept from round to round (page faults once)
        self._draws: list[torch.Tensor] = []  # stochastic rounding's U[0, 1) per island, kept likewise
        self.codec_s = 0.0  # seconds the last quantized mean took (wall clock): its codec work
        self.given_up: str | None = None  # why the step's compiled loop failed (the round then ended uncompiled)

    @property
    def separate_check(self) -> bool:
        """Whether :meth:`apply` runs :meth:`finite_deltas` before its loops: fp32 (its one loop writes the
        islands), or a codec with error feedback (the mean's loop writes the residuals); else the block scales are
        the check."""
        return self.codec is None or self.error_feedback

    def _blockwise(self, islands: int) -> Any:
        """The quantized mean's function over whole blocks: compiled, but for one island with error feedback,
        which inductor (torch 2.13) cannot build (a KeyError in its outer-loop fusion): the same operations
        uncompiled."""
        return _quantized_means if islands == 1 and self.error_feedback else _compiled("quantized_means")

    @staticmethod
    def _check(globals_: torch.Tensor, islands: Sequence[torch.Tensor], layout: Layout | None = None) -> None:
        numel = globals_.numel() if layout is None else layout.flat_numel
        if layout is not None and layout.numel != globals_.numel():
            raise ValueError(f"layout of {layout.numel} elements for globals of {globals_.numel()}")
        for p in islands:
            if p.dim() != 1 or p.numel() < numel or (layout is None and p.numel() != numel) or (
                    p.dtype != torch.float32):
                raise ValueError(f"island of {p.dtype} {tuple(p.shape)} for globals of float32 "
                                 f"{tuple(globals_.shape)}")

    def _shares(self, weights: Sequence[float], residuals: Sequence[torch.Tensor] | None,
                generators: Sequence[torch.Generator] | None, numel: int) -> list[torch.Tensor]:
        """The islands' shares a_i (0-d float32), once the weights, residuals and generators are found right."""
        total = float(sum(weights))
        if total <= 0 or (self.codec is not None and min(weights) <= 0):
            raise ValueError("weights sum to zero" if total <= 0 else "an island of weight 0 is not encoded")
        stochastic = self.codec is not None and self.codec.rounding == "stochastic"
        if (residuals is not None) != self.error_feedback or (generators is not None) != stochastic:
            raise ValueError("residuals are needed exactly with error feedback, generators with stochastic rounding")
        for r in residuals or []:
            if r.shape != (numel,) or r.dtype != torch.float32:
                raise ValueError(f"residual of {r.dtype} {tuple(r.shape)} for a vector of float32 ({numel},)")
        return [torch.tensor(float(w) / total, dtype=torch.float32) for w in weights]

    def _momentum(self, momentum: torch.Tensor | None) -> None:
        if (momentum is None) != (float(self.mu) == 0.0):
            raise ValueError("the momentum buffer is needed exactly when the outer momentum is not 0")

    def finite_deltas(self, globals_: torch.Tensor, islands: Sequence[torch.Tensor],
                      layout: Layout | None = None) -> list[bool]:
        """Whether each island's pseudo-gradient θ − θ_i is finite: one read of θ and every θ_i.

        Args:
            globals_: θ, float32 (numel,) on the CPU.
            islands: each island's flat parameters, float32 (numel,) on the CPU; with ``layout``, its spans'.
            layout: where θ's elements lie in the islands' vectors (default: the whole model, one span).

        Returns:
            One bool per island (a finite sum proves every element finite; a sum that overflowed reads as not
            finite, and the caller's eager round then checks element by element).

        Raises:
            ValueError: an island's vector does not fit the globals (shape, dtype).
        """
        self._check(globals_, islands, layout)
        layout = layout or Layout.whole(globals_.numel())
        with torch.no_grad():  # (the round's grad mode: one graph for both)
            sums = _compiled("delta_sums")(layout.of_vector(globals_), [layout.of_flat(p) for p in islands])
        return [math.isfinite(float(s)) for s in sums]

    def warm_up(self, islands: int, numel: int) -> None:
        """Compile the loops :meth:`apply` calls for ``islands`` islands over vectors of ``numel`` elements, so
        that a machine that cannot compile says so before training starts, and no round compiles.

        On zeros of lengths on the model's side of 4096 elements (blocks, for the quantized mean), where inductor
        specializes its reductions (:func:`~atoll.algorithms.compiled_loop.warm_up_numel`); the shapes are dynamic
        otherwise, so the model's vectors reuse the graphs (tests/test_fused_round.py counts the graphs compiled
        during a run: none).

        Raises:
            Exception: whatever torch.compile raises (no C++ compiler: ``InvalidCxxCompiler``; the process's
                recompile limit reached: ``FailOnRecompileLimitHit``, ...).
        """
        n = warm_up_numel(numel)
        momentum = None if float(self.mu) == 0.0 else torch.zeros(n)
        shares = [torch.tensor(1.0 / islands) for _ in range(islands)]
        with torch.no_grad():
            if self.separate_check:
                self.finite_deltas(torch.zeros(n), [torch.zeros(n) for _ in range(islands)])
            if self.codec is None:
                _compiled("round")(torch.zeros(n), momentum, [torch.zeros(n) for _ in range(islands)], shares,
                                   self.lr, self.mu)
                return
            _compiled("merge")([torch.zeros(n)], None if momentum is None else [momentum], [torch.zeros(n)],
                               [[torch.zeros(n)] for _ in range(islands)], self.lr, self.mu, None)
            bs, blocks = self.codec.block_size, numel // self.codec.block_size
            if blocks == 0 or self._blockwise(islands) is _quantized_means:  # (uncompiled)
                return
            rows = _warm_up_blocks(blocks, bs)

            def zeros() -> list[torch.Tensor]:
                return [torch.zeros(rows, bs)]

            _compiled("quantized_means")(
                zeros(), [zeros() for _ in range(islands)],
                [zeros() for _ in range(islands)] if self.error_feedback else None,
                [zeros() for _ in range(islands)] if self.codec.rounding == "stochastic" else None,
                shares, zeros(), self.qmax)

    def warm_up_layouts(self, islands: int, layouts: Sequence[Layout], alpha: float | None) -> None:
        """Compile the loops :meth:`mean` and :meth:`merge` (with ``alpha``) call for ``islands`` islands over each
        of ``layouts`` (a strategy's fragments), on zeros of their own shapes (so no round compiles: a loop's graph
        is kept per count of spans and pattern of equal lengths among them, and per side of 4096 elements).

        Raises:
            Exception: whatever torch.compile raises (as :meth:`warm_up`).
        """
        flats = [torch.zeros(max((lay.flat_numel for lay in layouts), default=0)) for _ in range(islands)]
        seen: set[tuple[tuple[int, int, int], ...]] = set()
        for layout in layouts:
            if layout.spans in seen or not layout.numel:
                continue
            seen.add(layout.spans)
            n = layout.numel
            g = torch.zeros(n)
            residuals = [torch.zeros(n) for _ in range(islands)] if self.error_feedback else None
            generators = ([torch.Generator() for _ in range(islands)]
                          if self.codec is not None and self.codec.rounding == "stochastic" else None)
            mean = self.mean("warm-up", g, flats, layout, [1.0] * islands, residuals, generators)
            assert mean is not None
            with torch.no_grad():
                _compiled("merge")(*self._merge_args(g, None if float(self.mu) == 0.0 else torch.zeros(n), mean, flats,
                                                     layout, alpha))
        self._means.pop("warm-up", None)

    def apply(self, globals_: torch.Tensor, momentum: torch.Tensor | None, islands: Sequence[torch.Tensor],
              weights: Sequence[float], residuals: Sequence[torch.Tensor] | None = None,
              generators: Sequence[torch.Generator] | None = None) -> bool | None:
        """One diloco round in place: θ, m, every island's parameters and, with error feedback, residuals (module
        docstring), once every island's pseudo-gradient θ − θ_i is found finite: by :meth:`finite_deltas` first,
        or, with a codec and no error feedback (whose loop writes nothing of the caller's until the step), by the
        block scales of the quantized mean.

        Args:
            globals_: θ, float32 (numel,) on the CPU (the outer optimizer's parameters).
            momentum: m, float32 (numel,) (the SGD optimizer's ``momentum_buffer``); None with μ = 0.
            islands: each island's parameters, float32 (numel,) on the CPU (written).
            weights: per island, its weight w_i (tokens since the last round); their sum must be positive (with a
                codec each must be: an island of weight 0 is not encoded, and the caller's eager round skips it).
            residuals: with error feedback, each island's residual r_i, float32 (numel,) (written).
            generators: with stochastic rounding, each island's CPU random source; each draws ``numel`` U[0, 1)
                values, as the codec's encode does.

        Returns:
            None where a pseudo-gradient is not finite: nothing written (the random sources set back to their
            state before), and the caller's eager round leaves that island out. Where the step's compiled loop
            fails (the quantized mean, and residuals, already this round's), the round ends with the same
            operations uncompiled and :attr:`given_up` says why. Else whether the sum of the new θ
            is finite (when not, θ, m and the islands hold what the step gave). With a codec, :attr:`codec_s` then
            holds the seconds its quantized mean took.

        Raises:
            ValueError: the weights sum to zero or less (or one is zero, with a codec), the momentum buffer is
                given with μ = 0 or missing with μ > 0, residuals or generators are given where not needed or
                missing where needed, or a vector differs from the globals in shape or dtype.
            Exception: whatever torch.compile raises where a loop must compile (a recompile limit reached, ...),
                before anything is written (the random sources set back).
        """
        self._check(globals_, islands)
        self._momentum(momentum)
        shares = self._shares(weights, residuals, generators, globals_.numel())
        if self.codec is None:
            if not all(self.finite_deltas(globals_, islands)):
                return None
            with torch.no_grad():
                total_sum = _compiled("round")(globals_, momentum, list(islands), shares, self.lr, self.mu)
            return math.isfinite(float(total_sum))
        layout = Layout.whole(globals_.numel())
        mean = self.mean("all", globals_, islands, layout, weights, residuals, generators)
        if mean is None:
            return None
        return self.merge(globals_, momentum, mean, islands, layout)

    def mean(self, key: str, globals_: torch.Tensor, islands: Sequence[torch.Tensor], layout: Layout,
             weights: Sequence[float], residuals: Sequence[torch.Tensor] | None = None,
             generators: Sequence[torch.Generator] | None = None) -> torch.Tensor | None:
        """The first half of a round: the islands' token-weighted mean pseudo-gradient Δ̄ = Σ a_i Δ_i, of what the
        wire carries (module docstring), in one compiled loop over ``layout``'s spans (a block codec: its whole
        blocks; the few across two spans' borders and a partial last block uncompiled, on gathered copies). It
        writes nothing of the caller's but, with error feedback, the residuals; the islands are only read.

        Args:
            key: names the buffer the mean is written into, kept from call to call (one per fragment).
            globals_: θ, float32 (layout.numel,) on the CPU.
            islands: each island's flat parameters, float32 (≥ layout.flat_numel,) on the CPU (read).
            layout: where θ's elements lie in the islands' vectors.
            weights, residuals, generators: as :meth:`apply`'s (residuals of θ's length).

        Returns:
            Δ̄, float32 (layout.numel,): the buffer of ``key``, valid until the next call with that key. None where
            a pseudo-gradient is not finite (the loop's own sums; with error feedback :meth:`finite_deltas`
            first): nothing of the caller's written, the random sources set back. With a codec, :attr:`codec_s`
            then holds the seconds it took.

        Raises:
            ValueError: as :meth:`apply` (and a layout that does not fit the vectors).
            Exception: whatever torch.compile raises (the random sources set back, nothing written).
        """
        self._check(globals_, islands, layout)
        shares = self._shares(weights, residuals, generators, globals_.numel())
        if self.error_feedback and not all(self.finite_deltas(globals_, islands, layout)):
            return None
        out = self._means.get(key)
        if out is None or out.numel() != layout.numel:
            out = self._means[key] = torch.empty(layout.numel)
        states = None if generators is None else [gen.get_state() for gen in generators]
        t0 = time.perf_counter()
        with torch.no_grad():
            try:  # a compile that fails does so before the loop writes anything; the draws are set back
                if self.codec is None:
                    sums = _compiled("means")(layout.of_vector(globals_), [layout.of_flat(p) for p in islands],
                                              shares, layout.of_vector(out))
                    finite = [math.isfinite(float(x)) for x in sums]
                else:
                    finite = self._quantized_mean(globals_, list(islands), layout, residuals, generators, shares, out)
            except Exception:
                self._set_back(generators, states)
                raise
        self.codec_s = time.perf_counter() - t0 if self.codec is not None else 0.0
        if not all(finite):  # (with error feedback: checked before)
            self._set_back(generators, states)
            return None
        return out

    def _merge_args(self, globals_: torch.Tensor, momentum: torch.Tensor | None, mean: torch.Tensor,
                    islands: Sequence[torch.Tensor], layout: Layout, alpha: float | None) -> tuple[Any, ...]:
        mix = None if alpha is None else (torch.tensor(alpha, dtype=torch.float32),
                                          torch.tensor(1 - alpha, dtype=torch.float32))
        return (layout.of_vector(globals_), None if momentum is None else layout.of_vector(momentum),
                layout.of_vector(mean), [layout.of_flat(p) for p in islands], self.lr, self.mu, mix)

    def merge(self, globals_: torch.Tensor, momentum: torch.Tensor | None, mean: torch.Tensor,
              islands: Sequence[torch.Tensor], layout: Layout, alpha: float | None = None) -> bool:
        """The second half of a round, in place, in one compiled loop over ``layout``'s spans: the outer step of θ
        and m from Δ̄ (torch's SGD, Nesterov), then every island restarted from the new θ (``alpha`` None: diloco)
        or mixed, θ_i ← α θ_i + (1 − α) θ (Streaming DiLoCo, arXiv:2501.18512 §2.3; the eager round's two products
        and sum, which the loop may contract into one fused multiply-add).

        Args:
            globals_, momentum: θ and m, float32 (layout.numel,) (m None with μ = 0).
            mean: Δ̄, float32 (layout.numel,) (:meth:`mean`'s, or a restored checkpoint's).
            islands: each island's flat parameters (written: the spans only).
            layout: where θ's elements lie in the islands' vectors.
            alpha: the mixing weight α of the islands' own parameters, or None.

        Returns:
            Whether the sum of the new θ is finite. Where the compiled loop fails, the same operations run
            uncompiled and :attr:`given_up` says why.

        Raises:
            ValueError: a vector that does not fit (shape, dtype), or the momentum buffer given with μ = 0 or
                missing with μ > 0.
        """
        self._check(globals_, islands, layout)
        self._momentum(momentum)
        if mean.shape != globals_.shape:
            raise ValueError(f"mean of {tuple(mean.shape)} for globals of {tuple(globals_.shape)}")
        args = self._merge_args(globals_, momentum, mean, islands, layout, alpha)
        with torch.no_grad():
            try:
                total_sum = _compiled("merge")(*args)
            except Exception as e:  # noqa: BLE001 - the mean (and residuals) are this round's: it ends uncompiled
                self.given_up = exception_line(e)
                total_sum = _merge(*args)
        return math.isfinite(float(total_sum))

    @staticmethod
    def _set_back(generators: Sequence[torch.Generator] | None, states: list[torch.Tensor] | None) -> None:
        for gen, state in zip(generators or [], states or [], strict=True):
            gen.set_state(state)

    def _quantized_mean(self, globals_: torch.Tensor, islands: list[torch.Tensor], layout: Layout,
                        residuals: Sequence[torch.Tensor] | None, generators: Sequence[torch.Generator] | None,
                        shares: list[torch.Tensor], out: torch.Tensor) -> list[bool]:
        """Σ a_i Δ̂_i into ``out``: the chunks of whole blocks in one compiled call, the rest uncompiled.
        Returns, per island, whether its target was finite (its block scales' sum)."""
        assert self.codec is not None
        n, bs = layout.numel, self.codec.block_size
        draws = None
        if generators is not None:
            if len(self._draws) != len(generators) or self._draws[0].numel() < n:
                self._draws = [torch.empty(n) for _ in generators]
            draws = [torch.rand(n, generator=gen, out=u[:n]) for gen, u in zip(generators, self._draws, strict=True)]
        chunks, rest = layout.chunks(bs)
        parts = []
        if chunks:
            def vector(t: torch.Tensor) -> list[torch.Tensor]:
                return [t[o:o + size].view(-1, bs).detach() for o, _, size in chunks]

            parts.append(self._blockwise(len(islands))(
                vector(globals_), [[p[s:s + size].view(-1, bs).detach() for _, s, size in chunks] for p in islands],
                None if residuals is None else [vector(r) for r in residuals],
                None if draws is None else [vector(u) for u in draws], shares, vector(out), self.qmax))
        for a, b in rest:  # whole blocks across spans' borders, then a partial last block: uncompiled
            whole = a + (b - a) // bs * bs
            for x, y in ((a, whole), (whole, b)):
                if y == x:
                    continue
                size = min(bs, y - x)

                def piece(t: torch.Tensor, x: int = x, y: int = y, size: int = size) -> list[torch.Tensor]:
                    return [t[x:y].view(-1, size)]

                parts.append(_quantized_means(
                    piece(globals_), [[layout.gather(p, x, y).view(-1, size)] for p in islands],
                    None if residuals is None else [piece(r) for r in residuals],
                    None if draws is None else [piece(u) for u in draws], shares, piece(out), self.qmax))
        return [all(math.isfinite(float(part[i])) for part in parts) for i in range(len(islands))]
