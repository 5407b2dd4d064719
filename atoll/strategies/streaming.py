"""``streaming``: Streaming DiLoCo. Fragments synced in turn, overlapped with inner steps, then mixed.

Douillard et al. 2025, arXiv:2501.18512. The parameters are split into P fragments of strided layers, with
the embedding and final norm cut into P row blocks so the fragments are equal in size
(:func:`atoll.algorithms.fragments.fragment_slices`: views of the parameters, the same on every island). Fragment p is
synchronised once every H inner steps, at its own offset inside the window, so at most one fragment is in flight and
peak bandwidth drops about P-fold. Its pseudo-gradient (optionally quantized, e.g. int4, accumulated in
fp32) is all-reduced *while* the islands run ``overlap_steps`` (tau) further inner steps; then the outer
optimizer of that fragment steps and each island mixes: θ_local ← α·θ_local + (1−α)·θ_global.

With one fragment, tau = 0 and alpha = 0 this is exactly ``diloco``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from atoll.algorithms.fragments import fragments_due
from atoll.algorithms.fused_round import FusedRound
from atoll.algorithms.layout import Layout
from atoll.algorithms.outer import OuterOptimizer
from atoll.analysis.cost import Cost, Setting, codec_bits
from atoll.config.sections import AdamWSection, Codec, CodecSection, FragmentsSection, OuterKernelSection
from atoll.runtime.comm import Work
from atoll.runtime.network import ring_allreduce_bytes
from atoll.strategies import compiled
from atoll.strategies.base import drop_non_finite, make_wire, model_fragments
from atoll.strategies.rounds import Rounds, RoundsConfig
from atoll.strategies.spec import StrategySpec, SuiteRun

if TYPE_CHECKING:
    from atoll.config.section import RunSettings
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm


class StreamingConfig(RoundsConfig, AdamWSection, CodecSection, OuterKernelSection, FragmentsSection):
    """Streaming DiLoCo's config: H, the inner AdamW, the outer optimizer, the codec (the paper's 4-bit outer
    gradients by default, accumulated in fp32), the fragments (shared with decoupled) and its own overlap and
    mixing."""

    codec: Codec = "int4"

    overlap_steps: int = Field(
        1, ge=0, description="streaming: tau, inner steps that overlap a fragment's exchange before it is merged."
    )
    mixing_alpha: float = Field(
        0.5, ge=0, le=1,
        description="streaming: alpha; after an exchange a fragment becomes alpha*local + (1-alpha)*global.",
    )


    @model_validator(mode="after")
    def _check_schedule(self) -> StreamingConfig:
        """Each fragment syncs once per H steps, and an exchange overlaps fewer than H steps.

        Raises:
            ValueError: H < P or tau >= H (one line naming the fix).
        """
        if self.sync_every < self.fragments:
            raise ValueError(f"sync_every ({self.sync_every}) must be at least fragments ({self.fragments}) "
                             "so each fragment syncs once per H steps; raise --sync-every or lower --fragments")
        if self.overlap_steps >= self.sync_every:
            raise ValueError(f"overlap_steps ({self.overlap_steps}) must be below sync_every "
                             f"({self.sync_every}); lower --overlap-steps")
        return self


def validate(own: StreamingConfig, run: RunSettings) -> None:
    """The run's model can be cut into ``own.fragments`` fragments (its layers bound them), and the compiled round
    runs where it can (:func:`atoll.strategies.compiled.validate`).

    Raises:
        ValueError: too many fragments for the model, or the compiled round where it cannot run (one line naming
            the fix).
    """
    from atoll.job.model import check_fragments  # transformers only when a config is checked

    check_fragments(run.model, own.fragments)
    compiled.validate(own, run)


@dataclass
class _InFlight:
    fragment: int
    merge_after_step: int  # 0-based inner step after which the result is merged
    work: Work
    dropped: tuple[bool, ...] = ()  # islands whose contribution was not finite: they adopt the global fragment
    compiled: bool = False  # the mean came from the compiled loop (outer_kernel compiled)


class StreamingDiLoCo(compiled.CompiledRounds[FusedRound], Rounds):
    """Streaming DiLoCo with one outer optimizer (globals and Nesterov momentum, on the CPU) per fragment
    (rounds, resets and checkpointed round state per fragment: :class:`~atoll.strategies.rounds.Rounds`).

    With ``outer_kernel = "compiled"`` a fragment's round runs as two compiled loops over its spans
    (:class:`~atoll.algorithms.fused_round.FusedRound`): at the start, the islands' (quantized) mean, handed to
    the comm as an exchange in flight; at the merge, the outer step and the mixing into every island. A half
    that cannot run compiled runs eager (:meth:`_compiled_start`, :meth:`_compiled_merge` say when)."""

    name = "streaming"
    fragmented = True

    config: StreamingConfig

    def __init__(self, config: StreamingConfig, islands: list[Island], comm: Comm, seed: int = 0) -> None:
        shapes = [(n, tuple(p.shape)) for n, p in islands[0].named_params.items()]
        # fragments are ranges of the whole model; an island holds them all, a sharded island's rank its
        # shard's part of each (exchanged, coded and stepped per slice)
        index = [islands[0].local_fragment(f) for f in model_fragments(shapes, config.fragments)]
        super().__init__(config, islands, comm, seed, index=index)
        self.in_flight: list[_InFlight] = []
        self.wire = make_wire(config, comm.local_islands, seed)
        self.layouts = [Layout.of(f) for f in self.index]  # each fragment's spans of an island's flat vector
        # the compiled merge's mixing weight: alpha 0 copies the globals, as the eager merge does (0 x a NaN would
        # keep a diverged island's NaN)
        self.mix = config.mixing_alpha if config.mixing_alpha > 0 else None
        self.fused = self.build_fused(config, islands, comm, self.wire, lambda f: f.warm_up_layouts(
            len(islands), self.layouts, self.mix))

    @property
    def outer(self) -> list[OuterOptimizer]:
        """Each fragment's outer optimizer (:attr:`~atoll.strategies.rounds.Rounds.outers`)."""
        return self.outers

    def after_inner(self, step: int) -> None:
        for job in [j for j in self.in_flight if j.merge_after_step == step]:
            self._merge(job)
        for p in fragments_due(step, len(self.index), self.config.sync_every):
            self._start(p, step)

    def _start(self, p: int, step: int, overlap: int | None = None) -> None:
        """Send fragment p's pseudo-gradient; merge it now (tau = 0) or after ``overlap`` more steps."""
        self.reset_diverged()  # a diverged island restarts from the global model before its fragment is taken
        weights = self.clocks[p].weights(self.islands)
        work = self._compiled_start(p, weights) if self.fused is not None else None
        dropped, compiled_mean = [False] * len(self.islands), work is not None
        if work is None:
            frag, base = self.index[p], self.outers[p].params.detach()
            deltas = [island.pseudo_gradient(base, frag) for island in self.islands]  # the fragment's views only
            deltas, weights, dropped = drop_non_finite(deltas, weights)
            self.dropped_updates += sum(dropped)
            if sum(weights) == 0:  # nothing usable: a zero pseudo-gradient still moves the outer momentum
                weights = [1.0] * len(weights)
            work = self.comm.start_all_reduce_mean(deltas, weights=weights, wire=self.wire, key=f"fragment{p}")
        self.clocks[p].commit(self.islands, step + 1)
        tau = self.config.overlap_steps if overlap is None else overlap
        job = _InFlight(p, step + tau, work, tuple(dropped), compiled=compiled_mean)
        if tau == 0:
            self._merge(job)
        else:
            self.in_flight.append(job)

    def _compiled_start(self, p: int, weights: list[float]) -> Work | None:
        """Fragment p's mean by the compiled loop (:meth:`FusedRound.mean`), started on the comm as the eager
        exchange is (its payload: fp32, or the codec's; with a codec, the loop's seconds as its codec time). None,
        having changed nothing, where the eager start must run: no island trained since the fragment's last round
        (with a codec: one did not, as the eager exchange does not encode it), an island's parameters are not one
        vector, an island's error-feedback residual does not exist yet (its first encode keeps it), a
        pseudo-gradient is not finite (the eager start leaves it out), or the loop failed to compile (given up)."""
        assert self.fused is not None
        codec, key = self.wire.codec, f"fragment{p}"
        if sum(weights) <= 0 or (codec is not None and min(weights) <= 0):
            return None
        base, layout = self.outers[p].params.detach(), self.layouts[p]
        inputs = self.compiled_inputs(base, key)
        if inputs is None:
            return None
        views, residuals = inputs
        try:  # a compile that fails does so before anything is written (FusedRound.mean)
            mean = self.fused.mean(key, base, views, layout, weights, residuals=residuals,
                                   generators=self.wire.generators_for("cpu"))
        except Exception as e:  # noqa: BLE001 - any compiler failure means the eager round from now on, said once
            self.give_up(e)
            return None
        if mean is None:
            return None
        payload = layout.numel * 4 if codec is None else codec.payload_bytes(layout.numel)
        return self.comm.start_charged_mean(mean, payload, self.fused.codec_s, weight=float(sum(weights)))

    def _merge(self, job: _InFlight) -> None:
        """Outer step of the fragment with the averaged pseudo-gradient, then mix into every island."""
        p, alpha = job.fragment, self.config.mixing_alpha
        if not self._compiled_merge(job):
            new_global = self.outers[p].step(job.work.wait())
            for i, island in enumerate(self.islands):
                faulty = i < len(job.dropped) and job.dropped[i]
                island.mix_params(new_global, 0.0 if faulty else alpha, self.index[p])
        if job in self.in_flight:
            self.in_flight.remove(job)

    def _compiled_merge(self, job: _InFlight) -> bool:
        """Fragment ``job.fragment``'s outer step and mixing by the compiled loop (:meth:`FusedRound.merge`).
        False, having changed nothing, where the eager merge must run: compiled rounds given up, an island left
        out of the mean (it adopts the globals instead of mixing), the fragment's outer momentum not started yet
        (torch's SGD starts it from the first pseudo-gradient), or an island's parameters not one vector."""
        if self.fused is None or any(job.dropped):
            return False
        p = job.fragment
        outer = self.outers[p]
        momentum = outer.optimizer.state.get(outer.params, {}).get("momentum_buffer")
        views = [island.contiguous_params() for island in self.islands]
        if (self.config.outer_momentum > 0 and momentum is None) or any(v is None for v in views):
            return False
        self.fused.merge(outer.params.detach(), momentum if self.config.outer_momentum > 0 else None,
                         job.work.wait(), views, self.layouts[p], self.mix)
        if self.fused.given_up is not None:  # the loop failed; this merge ran uncompiled
            self.give_up(self.fused.given_up)
        outer.version += 1
        self.compiled_rounds += int(job.compiled)
        return True

    def drain(self) -> None:
        """Merge every exchange in flight."""
        for job in list(self.in_flight):
            self._merge(job)

    def sync(self, part: int, steps_done: int) -> None:
        """Sync fragment ``part`` with no overlap."""
        self._start(part, steps_done - 1, overlap=0)

    def summary(self) -> dict[str, Any]:
        return {"fragments": len(self.index), "overlap_steps": self.config.overlap_steps,
                **self.compiled_summary(self.config.outer_kernel)}

    def state_dict(self) -> dict[str, Any]:
        in_flight = [{"fragment": j.fragment, "merge_after_step": j.merge_after_step, "done_at": j.work.done_at,
                      "result": j.work.result_for_checkpoint(), "compiled": j.compiled} for j in self.in_flight]
        # + the rounds' (outer, last_sync_step) per fragment
        return {**super().state_dict(), "in_flight": in_flight, **self.compiled_state(self.config.outer_kernel)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.load_compiled_state(state)
        self.in_flight = [_InFlight(int(j["fragment"]), int(j["merge_after_step"]),
                                    self.comm.restore_work(j["result"], float(j["done_at"])),
                                    (False,) * len(self.islands), bool(j.get("compiled", False)))
                          for j in state["in_flight"]]

    def island_state(self, position: int) -> dict[str, Any]:
        # whether this island's contribution to each exchange in flight was left out (not finite): it then
        # adopts the merged fragment instead of mixing its faulty one in
        return {**super().island_state(position),  # tokens_at_sync, per fragment
                "in_flight_dropped": [j.dropped[position] for j in self.in_flight],
                "wire": self.wire.island_state(position)}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:
        super().load_island_state(position, state)
        for job, dropped in zip(self.in_flight, state["in_flight_dropped"], strict=True):  # after load_state_dict
            job.dropped = tuple(bool(dropped) if i == position else d for i, d in enumerate(job.dropped))
        self.wire.load_island_state(position, state["wire"])

def project(config: StreamingConfig, s: Setting) -> Cost:
    """streaming's cost per inner step: one fragment of N/P every H/P steps, overlapped with tau inner steps;
    exchanges share the link one after another::

        X = 2(K-1)/K * N*b/8;   T_f = X/P*8/B + 2(K-1)L;   bytes = X/H
        step = max(t_c + P/H * max(0, T_f - tau*t_c), P/H * T_f)

    Raises:
        ValueError: a codec without fixed bits per element (topk).
    """
    h, p, tau = config.sync_every, config.fragments, config.overlap_steps
    x = ring_allreduce_bytes(s.params * codec_bits(config.codec) / 8, s.islands)
    t = x / p * 8 / s.bandwidth_bps + 2 * (s.islands - 1) * s.latency_s if s.islands > 1 else 0.0
    per = p / h
    step = max(s.step_compute_s + per * max(0.0, t - tau * s.step_compute_s), per * t)
    return Cost(step, x / h, t, fragments=p, overlapped=True, sync_every=h)


SPEC = StrategySpec(
    name="streaming",
    summary="one fragment's pseudo-gradient at a time, quantized, overlapped with tau inner steps, mixed with "
            "alpha (arXiv:2501.18512)",
    config=StreamingConfig, runtimes=("local", "collective"), validate=validate, lockstep=StreamingDiLoCo,
    project=project, syncs_per_h=True, shards=True,
    suite=(SuiteRun("streaming", "streaming H={sync_every} P={fragments} {codec} tau={overlap_steps} "
                    "alpha={mixing_alpha}", {"strategy": "streaming"}),),
)
