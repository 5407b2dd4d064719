"""``sparseloco``: DiLoCo's rounds with a sparse, 2-bit exchange and local error feedback instead of outer momentum.

Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with SparseLoCo"
(arXiv:2508.15706), Algorithm 1, as its released code (and Templar's) computes it. Every ``sync_every`` (H)
inner steps each island i forms its pseudo-gradient Δ_i = θ_global − θ_i and folds it into its own
error-feedback accumulator with the outer rate α, ``e_i ← β e_i + α Δ_i``; it sends only the top-k of every
tile of ``e_i`` with 2-bit values (:class:`~atoll.algorithms.sparse.SparseCompressor`: 64 x 64 tiles, 1-D
runs of 64) and keeps the rest, ``e_i ← e_i − C(e_i)``. The islands all-gather the sparse payloads; each
island's values for a parameter tensor are clipped to the median over the islands of their L2 norm, then each
entry is averaged over the islands that sent it (token-weighted; Templar's ``batch_decompress`` with
``clip_norm=True``, :meth:`~atoll.algorithms.sparse.SparseCompressor.aggregate`), and the outer step is plain
descent with the rate again, ``θ_global ← θ_global − α · agg`` (the reference puts α into the accumulator
and into the step; SparseLoCo's defaults here: α = ``outer_lr`` = 1, no outer momentum). Every island
restarts from the new global parameters. Rounds, divergence and resets:
:class:`~atoll.strategies.rounds.OuterRounds`, as diloco.

Where atoll differs from the reference, by a setting: ``sparseloco_clip = "none"`` (no median-norm clip: the
plain scatter-mean), ``sparseloco_tile_k = "topk"`` (Templar's k in small tiles, where the default scales k as
the release does) and ``sparseloco_layout = "flat"`` (contiguous chunks: atoll's earlier rule); atoll
weighs senders by tokens (equal tokens: the reference), keeps one entry where the reference's 12-bit index
packing keeps at least two, and quantizes values to two magnitude levels per tile with their signs where the
reference uses four bins per tensor (docs/concepts.md).

Bytes per island per round: a ring all-gather of one payload, ``(K − 1) × payload`` (plus 4 bytes for the
token weight), with the payload's exact size from
:meth:`~atoll.algorithms.sparse.SparseCompressor.payload_bytes`.

On sharded islands (``--shard-island``, collective runtime) each rank keeps its rows of the accumulator and
the island's ranks select from each whole tensor in turn, all-gathered inside the island: the unsharded island's
payload and bytes (:mod:`atoll.runtime.collective.sharded_sparseloco`).

With ``outer_kernel = "compiled"`` (the local runtime, CPU islands) the accumulation, the finite check and the
diagnostics' norms run as one compiled loop (:class:`~atoll.algorithms.fused_accumulate.FusedAccumulate`), and the
sent energy's "after" is taken from the kept entries only (:meth:`SparseCompressor.subtract_energy_`); the
reference's kernels run as in the eager round. Not the same floats (summed in the loop's own order): a setting.

With ``sparseloco_topk == sparseloco_chunk`` (density 1), ``sparseloco_bits = 32``, ``sparseloco_beta = 0`` and
``sparseloco_clip = "none"`` the exchange is lossless and nothing is carried over, so with ``outer_lr = 1`` a
round is plain parameter averaging (FedAvg, McMahan et al. 2017): the identity the tests check.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator

from atoll.algorithms.dct import index_dtype_for
from atoll.algorithms.finite import all_finite, l2_norm
from atoll.algorithms.fused_accumulate import FusedAccumulate
from atoll.algorithms.sparse import SparseCompressor
from atoll.analysis.cost import Cost, Setting
from atoll.config.sections import AdamWSection, OuterKernelSection
from atoll.runtime.network import ring_allgather_bytes
from atoll.strategies.compiled import CompiledRounds, validate
from atoll.strategies.rounds import OuterRounds, RoundsConfig
from atoll.strategies.spec import StrategySpec, SuiteRun

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm

WEIGHT_BYTES = 4  # the float32 token weight that travels with each payload


class SparseLoCoConfig(RoundsConfig, AdamWSection, OuterKernelSection):
    """SparseLoCo's config: H, the inner AdamW, the outer step (plain averaged descent by default: the
    accumulator replaces the outer momentum, SparseLoCo §3), how its accumulation runs (eager or compiled) and its
    own top-k per chunk, chunk, accumulator decay, value bits, layout, k in small tiles and clip (it compresses its
    own way: no codec)."""

    outer_lr: float = Field(1.0, gt=0)
    outer_momentum: float = Field(0.0, ge=0, lt=1)

    sparseloco_topk: int = Field(64, ge=1, description="sparseloco: entries kept per full tile (or chunk) of the "
                                 "error-feedback accumulator (64 of 4096: a density of 1.6 percent), scaled to "
                                 "smaller tiles.")
    sparseloco_chunk: int = Field(4096, ge=1, le=2 ** 30, description="sparseloco: elements of a full tile "
                                  "(a square: 4096 is 64 x 64) or of a flat chunk; never straddles two "
                                  "parameters.")
    sparseloco_beta: float = Field(0.95, ge=0, le=1, description="sparseloco: decay of each island's "
                                   "error-feedback accumulator (it replaces the outer momentum).")
    sparseloco_bits: int = Field(2, description="sparseloco: bits per kept value: 2 (sign and one of "
                                            "two per-chunk levels) or 32 (float32).")
    sparseloco_layout: Literal["tiles", "flat"] = Field(
        "tiles", description="sparseloco: how tensors are cut: tiles (the reference: 2-D tensors into tiles of "
        "at most sqrt(chunk) x sqrt(chunk), the largest divisors of each side, k scaled to the tile; 1-D tensors "
        "into runs of at most sqrt(chunk)) or flat (contiguous chunks of chunk elements, topk in each).")
    sparseloco_tile_k: Literal["scaled", "topk"] = Field(
        "scaled", description="sparseloco: entries kept in a tile smaller than a full one: scaled to its size (the "
        "release's rule: about one per 1-D run of sqrt(chunk)) or topk in every tile, at most the tile "
        "(Templar's rule: norms and biases of sqrt(chunk) go whole).")
    sparseloco_clip: Literal["median", "none"] = Field(
        "median", description="sparseloco: before each entry is averaged over the islands that sent it, each "
        "island's values for a tensor are scaled down to the median over the islands of their norm (median: "
        "Templar's rule) or left as sent (none).")

    @model_validator(mode="after")
    def _chunks_fit(self) -> SparseLoCoConfig:
        """A chunk must hold the top-k it keeps; values are 2 or 32 bits.

        Raises:
            ValueError: ``sparseloco_topk`` > ``sparseloco_chunk``, ``sparseloco_bits`` not 2 or 32, a chunk that
                is not a square with tiles, or Templar's k in small tiles without tiles.
        """
        if self.sparseloco_bits not in (2, 32):
            raise ValueError(f"sparseloco_bits: {self.sparseloco_bits} is not 2 or 32; pass --sparseloco-bits 2 "
                             "(sign and two levels per chunk) or 32 (float32 values)")
        side = math.isqrt(self.sparseloco_chunk)
        if self.sparseloco_layout == "tiles" and side * side != self.sparseloco_chunk:
            raise ValueError(f"sparseloco_chunk: {self.sparseloco_chunk} is not a square, as tiles need; pass "
                             "--sparseloco-chunk 4096 (64 x 64 tiles), 1024 (32 x 32), ... or --sparseloco-layout flat")
        if self.sparseloco_tile_k != "scaled" and self.sparseloco_layout != "tiles":
            raise ValueError(f"sparseloco_tile_k: {self.sparseloco_tile_k} applies to tiles, and the layout is "
                             f"{self.sparseloco_layout}; drop --sparseloco-tile-k or pass --sparseloco-layout tiles")
        if self.sparseloco_topk > self.sparseloco_chunk:
            raise ValueError(f"sparseloco_topk ({self.sparseloco_topk}) exceeds a chunk's {self.sparseloco_chunk} "
                             "elements; lower --sparseloco-topk or raise --sparseloco-chunk")
        return self


class SparseLoCo(CompiledRounds[FusedAccumulate], OuterRounds):
    """Synchronous SparseLoCo: per-island error feedback, sparse 2-bit all-gather, averaged outer descent.

    Attributes:
        error: each local island's error-feedback accumulator, float32 (numel,) on the CPU (a sharded island's
            rank: its shard's rows, shaped as its flat vector). With ``outer_kernel = "compiled"`` a round writes
            the new ones into second buffers and swaps them in (:class:`FusedAccumulate`).
        dropped_updates: rounds in which an island's pseudo-gradient was not finite (it sent nothing, weight 0,
            and restarts from the new global model with a fresh inner optimizer).
        sent_energy_sum: the sum, over rounds and local islands that sent, of the share of the accumulator's
            energy its payload delivered, ``1 − ‖e − C(e)‖² / ‖e‖²`` (1 for a lossless payload); over
            ``sent_rounds`` it is the summary's ``sparseloco_sent_energy``.
        step_ratio_sum: the sum over rounds of ``‖α · agg‖ / ‖mean of the local islands' Δ‖``, the outer step's
            size against plain averaging's (diloco with lr 1, no momentum); over ``step_rounds`` it is the
            summary's ``sparseloco_step_ratio`` (1 for the lossless identity).
    """

    name = "sparseloco"

    config: SparseLoCoConfig

    def __init__(self, config: SparseLoCoConfig, islands: list[Island], comm: Comm, seed: int = 0) -> None:
        super().__init__(config, islands, comm, seed)
        # of the whole model's tensors (a sharded island's DTensors have their whole shapes); its tile tables are
        # built when it first compresses
        self.compressor = SparseCompressor([tuple(p.shape) for p in islands[0].params], config.sparseloco_chunk,
                                           config.sparseloco_topk, config.sparseloco_bits, config.sparseloco_layout,
                                           config.sparseloco_tile_k)
        self.error = [torch.zeros(self.numel) for _ in islands]  # (a sharded island's rank: its shard's)
        self.sent_energy_sum, self.sent_rounds = 0.0, 0
        self.step_ratio_sum, self.step_rounds = 0.0, 0
        self.fused = self.build_compiled(config, islands, comm, self._build_accumulate)

    def _build_accumulate(self) -> FusedAccumulate:
        """``outer_kernel = "compiled"``'s loop, compiled for these islands (:meth:`FusedAccumulate.warm_up`)."""
        fused = FusedAccumulate(self.config.sparseloco_beta, self.config.outer_lr)
        fused.warm_up(len(self.islands), self.numel)
        return fused

    def outer_step(self, steps_done: int) -> None:
        """Accumulate, compress and all-gather every island's pseudo-gradient; one averaged descent step.

        Raises:
            Diverged: no island of the job had a finite pseudo-gradient, or the global model is not finite.
        """
        beta, rate = self.config.sparseloco_beta, self.config.outer_lr
        weights = self.round_weights()
        accumulated = self._compiled_accumulate(weights) if self.fused is not None else None
        if accumulated is None:
            # each island's Δ in a buffer it keeps (the same floats as pseudo_gradient(globals, flat_params()))
            deltas = [island.pseudo_gradient(self.outer.params.detach()) for island in self.islands]
            dropped, plain = self._agree(deltas, weights)
        else:  # every accumulator already holds β e + α Δ (every Δ finite), and the norms are taken
            dropped, (plain, energies) = [False] * len(self.islands), accumulated
        payloads = []
        for i, (weight, bad) in enumerate(zip(weights, dropped, strict=True)):
            if bad:  # a diverged island sends an empty update with no weight; its accumulator is untouched
                self.dropped_updates += 1
                payload, weight = self.compressor.empty(), 0
            else:
                if accumulated is None:
                    _decay_add_(self.error[i], beta, deltas[i], rate)  # the reference: the rate into the accumulator
                    payload, before, after = self._send(i)
                else:
                    payload, before, after = self._send_accumulated(i, energies[i])
                if before > 0:
                    self.sent_energy_sum += 1.0 - after / before
                    self.sent_rounds += 1
            payloads.append({**payload, "weight": torch.tensor([weight], dtype=torch.float32)})
        # every rank of an island holds its payload (a sharded island's ranks select together): moved once
        gathered = self.comm.all_gather(payloads, payload_bytes=self.compressor.payload_bytes() + WEIGHT_BYTES,
                                        replicated=True)
        senders = [float(p["weight"][0]) for p in gathered]
        if not any(w > 0 for w in senders):
            raise self.no_contribution(steps_done)
        agg, norm = self._aggregate(gathered, senders)
        if plain > 0:
            self.step_ratio_sum += rate * norm / plain
            self.step_rounds += 1
        self.commit_round(self.outer.step(agg), dropped, steps_done)  # and the rate into the step

    def _compiled_accumulate(self, weights: list[int]) -> tuple[float, list[float]] | None:
        """``outer_kernel = "compiled"``: every island's accumulator ``e_i ← β e_i + α Δ_i`` by the compiled loop
        (:meth:`FusedAccumulate.apply`; the new ones swapped in), with plain averaging's step size
        ``‖Σ w_i Δ_i‖ / Σ w_i`` over the islands of positive weight (as :meth:`_agree`) and each new accumulator's
        ‖e_i‖². None, having changed nothing, where the eager round must run: an island's parameters are not one
        vector, a Δ_i is not finite (the eager round leaves it out), or the loop failed (given up)."""
        assert self.fused is not None
        views = self.contiguous_views()
        if views is None:
            return None
        try:
            out = self.fused.apply(self.outer.params.detach(), views, self.error, weights)
        except Exception as e:  # noqa: BLE001 - any compiler failure means the eager round from now on, said once
            self.give_up(e)
            return None
        if out is None:
            return None
        errors, energies, square = out
        self.error = list(errors)
        self.compiled_rounds += 1
        total = sum(w for w in weights if w > 0)
        return (math.sqrt(square) / total if total > 0 else 0.0), energies

    def _send_accumulated(self, position: int, before: float) -> tuple[dict[str, torch.Tensor], float, float]:
        """:meth:`_send` where ‖e‖² before is known (the compiled loop's): ‖e‖² after from the kept entries only
        (:meth:`SparseCompressor.subtract_energy_`): the entries left out keep ``before − Σ_kept e²`` (at least
        0, as the two sums round differently; none where the payload set every entry, so a lossless payload
        leaves 0, as the eager sum does), the kept ones hold ``Σ_kept (e − v)²``."""
        error = self.error[position]
        payload = self.compressor.compress(error)
        kept_before, kept_after, count = self.compressor.subtract_energy_(error, payload)
        rest = 0.0 if count == error.numel() else max(before - kept_before, 0.0)
        return payload, before, rest + kept_after

    # --- what a sharded island does its own way (atoll.runtime.collective.sharded_sparseloco) ----------------
    def _agree(self, deltas: list[torch.Tensor], weights: list[int]) -> tuple[list[bool], float]:
        """Which local islands leave their pseudo-gradient Δ_i (float32, this process's flat vector) out, not
        being finite, and the size of plain averaging's step, ``‖Σ w_i Δ_i‖ / Σ w_i`` over the islands that send
        (0.0 if none; the summary's step ratio): both summed over an island's ranks (:meth:`_island_sum`)."""
        bad = [not all_finite(d) for d in deltas]
        sending = [(d, w) for d, w, b in zip(deltas, weights, bad, strict=True) if not b and w > 0]
        # accurate at any length, where a float32 norm() drifts with it (l2_norm; tests/test_sparseloco.py)
        square = l2_norm(self._weighted_sum(sending)) ** 2 if sending else 0.0
        sums = self._island_sum(torch.tensor([*map(float, bad), square], dtype=torch.float64)).tolist()
        dropped = [b > 0 for b in sums[:-1]]
        total = sum(w for w, b in zip(weights, dropped, strict=True) if not b and w > 0)
        return dropped, math.sqrt(sums[-1]) / total if total > 0 else 0.0

    def _scratch(self, numel: int) -> torch.Tensor:
        """A float32 (numel,) buffer kept across rounds for the diagnostics' whole-vector intermediates (a fresh
        one costs a page fault per 4 KiB, more than the arithmetic); its contents hold until the next call."""
        buf = self.__dict__.get("_scratch_buf")
        if buf is None or buf.numel() != numel:
            buf = self.__dict__["_scratch_buf"] = torch.empty(numel, dtype=torch.float32)
        return buf

    def _weighted_sum(self, sending: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """``Σ w_i Δ_i``, float32 (numel,), as ``torch.stack([d * w ...]).sum(0)`` computes it (the same floats:
        the stack and its sum over the islands run on slices of 64 Ki elements, each element's sum in the same
        order; for one or two islands, their product and sum without a stack), in :meth:`_scratch`: no (islands,
        numel) stack. Only its norm is used (a zero's sign may differ from the stack's)."""
        out = self._scratch(sending[0][0].numel())
        step = 1 << 16
        if len(sending) <= 2:  # one rounded sum w_0 Δ_0 + w_1 Δ_1 per element, whatever its order: no stack
            small = torch.empty(min(step, out.numel()), dtype=torch.float32)
            for a in range(0, out.numel(), step):
                b = min(a + step, out.numel())
                torch.mul(sending[0][0][a:b], sending[0][1], out=out[a:b])
                if len(sending) == 2:
                    out[a:b].add_(torch.mul(sending[1][0][a:b], sending[1][1], out=small[: b - a]))
            return out  # (a zero's sign may differ from the stack's sum of 0 + ...: only the norm is used)
        for a in range(0, out.numel(), step):
            b = min(a + step, out.numel())
            torch.sum(torch.stack([d[a:b] * w for d, w in sending]), 0, out=out[a:b])
        return out

    def _island_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the ranks of this process's island: itself, an island's ranks each holding
        the whole model (a sharded island's rank sums them)."""
        return values

    def _send(self, position: int) -> tuple[dict[str, torch.Tensor], float, float]:
        """Local island ``position``'s payload of its accumulator, what it sends removed from it (SparseLoCo
        Algorithm 1, ``e ← e − C(e)``), and the accumulator's squared norm before and after."""
        error = self.error[position]
        before = l2_norm(error) ** 2
        payload = self.compressor.compress(error)
        self.compressor.subtract_(error, payload)  # error.sub_(decompress(payload)) without the dense vector
        return payload, before, l2_norm(error) ** 2

    def _aggregate(self, gathered: list[dict[str, torch.Tensor]], weights: list[float]) -> tuple[torch.Tensor, float]:
        """The islands' combined update (:meth:`SparseCompressor.aggregate`), float32 shaped as this process's
        flat vector, and the whole update's norm."""
        out = self.__dict__.get("_agg_buf")
        if out is None or out.numel() != self.compressor.numel:
            out = self.__dict__["_agg_buf"] = torch.empty(self.compressor.numel, dtype=torch.float32)
        agg = self.compressor.aggregate(gathered, weights, self.config.sparseloco_clip, out=out)
        return agg, l2_norm(agg)  # as _agree's (a float32 norm() drifts with the vector's length)

    def summary(self) -> dict[str, Any]:
        c = self.compressor
        return {**self.compiled_summary(self.config.outer_kernel),
                "sparseloco_density": c.density, "sparseloco_payload_bytes": c.payload_bytes() + WEIGHT_BYTES,
                "sparseloco_sent_energy": self.sent_energy_sum / self.sent_rounds if self.sent_rounds else 1.0,
                "sparseloco_step_ratio": self.step_ratio_sum / self.step_rounds if self.step_rounds else 1.0}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.compiled_state(self.config.outer_kernel),  # + (outer, last_sync_step)
                "dropped_updates": self.dropped_updates, "sent_energy_sum": self.sent_energy_sum,
                "sent_rounds": self.sent_rounds, "step_ratio_sum": self.step_ratio_sum, "step_rounds": self.step_rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dropped_updates = int(state.get("dropped_updates", 0))
        self.sent_energy_sum = float(state.get("sent_energy_sum", 0.0))
        self.sent_rounds = int(state.get("sent_rounds", 0))
        self.step_ratio_sum = float(state.get("step_ratio_sum", 0.0))
        self.step_rounds = int(state.get("step_rounds", 0))
        self.load_compiled_state(state)

    def island_state(self, position: int) -> dict[str, Any]:
        return {**super().island_state(position), "error": self.error[position].clone()}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:
        super().load_island_state(position, state)
        self.error[position].copy_(state["error"])

def _decay_add_(error: torch.Tensor, beta: float, delta: torch.Tensor, rate: float) -> None:
    """In place, ``error.mul_(beta).add_(delta, alpha=rate)`` (float32 (numel,) both; the same floats) in slices
    of 64 Ki elements, so the accumulator is read and written once, not once per operation."""
    step = 1 << 16
    for a in range(0, error.numel(), step):
        error[a:a + step].mul_(beta).add_(delta[a:a + step], alpha=rate)


def payload_bytes(config: SparseLoCoConfig, params: float) -> float:
    """Bytes of one island's SparseLoCo payload, for N = ``params`` parameters in N/c chunks of k kept entries
    each: an index (1, 2 or 4 bytes: the smallest integer that holds c - 1) and, at 2 bits, a quarter byte per
    entry plus two float32 levels per chunk (4 bytes per entry at 32 bits); plus the token weight. Exact for the
    flat layout when every parameter is a whole number of chunks; for tiles (the default) exact when every
    matrix is a whole number of full tiles, and within the bias and norm vectors' small share otherwise
    (their runs of sqrt(chunk) keep about one entry each, with the levels of a tile)."""
    k, c = min(config.sparseloco_topk, config.sparseloco_chunk), config.sparseloco_chunk
    chunks = math.ceil(params / c)
    per_entry = index_dtype_for(c).itemsize + (0.25 if config.sparseloco_bits == 2 else 4)
    return chunks * (k * per_entry + (8 if config.sparseloco_bits == 2 else 0)) + WEIGHT_BYTES


def project(config: SparseLoCoConfig, s: Setting) -> Cost:
    """sparseloco's cost per inner step: a ring all-gather of one sparse payload S every H steps::

        bytes = (K-1)S/H;   step = t_c + ((K-1)S*8/B + (K-1)L) / H
    """
    h = config.sync_every
    x = ring_allgather_bytes(payload_bytes(config, s.params), s.islands)
    t = x * 8 / s.bandwidth_bps + (s.islands - 1) * s.latency_s if s.islands > 1 else 0.0
    return Cost(s.step_compute_s + t / h, x / h, t, fragments=1, sync_every=h)


SPEC = StrategySpec(
    name="sparseloco",
    summary="error-feedback accumulators' top-k per 64x64 tile, 2-bit values, all-gathered every H inner steps; "
            "clipped to the median norm, each entry averaged over its senders, plain outer descent "
            "(arXiv:2508.15706)",
    config=SparseLoCoConfig, runtimes=("local", "collective"), validate=validate, lockstep=SparseLoCo, project=project,
    syncs_per_h=True, shards=True,
    suite=(SuiteRun("sparseloco", "sparseloco H={sync_every} top-{sparseloco_topk}/{sparseloco_chunk} 2-bit",
                    {"strategy": "sparseloco"}),
           # ten times the rounds (and the bytes): does SparseLoCo catch diloco when rounds are no limit?
           SuiteRun("sparseloco_h5", "sparseloco H=5 top-{sparseloco_topk}/{sparseloco_chunk} 2-bit",
                    {"strategy": "sparseloco", "sync_every": 5})),
)
