"""``diloco``: H inner AdamW steps per island, then an outer Nesterov step on averaged pseudo-gradients.

DiLoCo, Douillard et al. 2023, arXiv:2311.08105, Algorithm 1. Every ``sync_every`` (H) inner steps, each
island sends Δ_i = θ_global − θ_i; the islands all-reduce the token-weighted mean Δ; the outer optimizer
(SGD, Nesterov momentum, lr 0.7, momentum 0.9 by default) updates the global parameters, held on the CPU;
every island restarts from them. Communication drops by a factor H against ``ddp``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from atoll.algorithms.agreement import AgreementScaler
from atoll.algorithms.finite import all_finite
from atoll.algorithms.fused_round import FusedRound
from atoll.analysis.cost import Cost, Setting, codec_bits
from atoll.config.sections import AdamWSection, CodecSection, OuterKernelSection
from atoll.job.divergence import Diverged
from atoll.runtime.network import ring_allreduce_bytes
from atoll.strategies.base import drop_non_finite, make_wire
from atoll.strategies.compiled import CompiledRounds, validate
from atoll.strategies.rounds import OuterRounds, RoundsConfig
from atoll.strategies.spec import StrategySpec, SuiteRun

if TYPE_CHECKING:
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm


class DiLoCoConfig(RoundsConfig, AdamWSection, CodecSection, OuterKernelSection):
    """diloco's config: H, the inner AdamW, the outer optimizer, the codec of its pseudo-gradients, and its
    own adaptive outer step."""

    outer_adapt: Literal["none", "agreement"] = Field(
        "none", description="diloco: an adaptive outer step. agreement: each tensor's share of the outer step "
        "follows how much the islands agree on its pseudo-gradient (its estimated signal share over the "
        "model's mean, at most 2x); the overall outer rate stays outer_lr (atoll.algorithms.agreement).")

    @model_validator(mode="after")
    def _compiled_round_needs(self) -> DiLoCoConfig:
        if self.outer_kernel == "compiled" and self.outer_adapt != "none":
            raise ValueError("outer_kernel: the compiled round takes a plain outer step; pass --outer-adapt none, "
                             "or --outer-kernel eager")
        return self


class DiLoCo(CompiledRounds[FusedRound], OuterRounds):
    """Synchronous DiLoCo with one outer optimizer over all parameters (rounds: :class:`OuterRounds`)."""

    name = "diloco"

    config: DiLoCoConfig

    def __init__(self, config: DiLoCoConfig, islands: list[Island], comm: Comm, seed: int = 0) -> None:
        super().__init__(config, islands, comm, seed)
        self.wire = make_wire(config, comm.local_islands, seed)
        self.agreement = (AgreementScaler([p.numel() for p in islands[0].params])
                          if config.outer_adapt == "agreement" else None)
        numel = sum(p.numel() for p in islands[0].params)
        self.fused = self.build_fused(config, islands, comm, self.wire, lambda f: f.warm_up(len(islands), numel))

    def outer_step(self, steps_done: int) -> None:
        """Average the islands' pseudo-gradients (weighted by tokens since the last sync) and step.

        Raises:
            Diverged: no island of the job had a finite pseudo-gradient, or the global model is not finite.
        """
        if self.fused is not None and self._compiled_round(steps_done):
            return
        # torchft's shape: Δ computed where each island's parameters are, from the (pinned) host globals
        deltas = [island.pseudo_gradient(self.outer.params.detach()) for island in self.islands]
        if self.agreement is not None:  # its per-tensor statistics are taken on the CPU
            deltas = [d.to("cpu") for d in deltas]
        deltas, weights, dropped = drop_non_finite(deltas, self.round_weights())
        self.dropped_updates += sum(dropped)
        mean, total = self.comm.all_reduce_mean_and_weight(deltas, weights=weights, wire=self.wire, key="all")
        if total <= 0:
            raise self.no_contribution(steps_done)
        if self.agreement is not None:  # the mean may be on the comm's device (a codec's exchange runs there)
            stats = [self.agreement.statistics(d, w / total) for d, w in zip(deltas, weights, strict=True)]
            mean = self.agreement.weigh(mean.to("cpu"), self.comm.all_reduce_mean(stats, weights=weights))
        self.commit_round(self.outer.step(mean), dropped, steps_done)

    def _compiled_round(self, steps_done: int) -> bool:
        """The round of ``outer_kernel = "compiled"`` (:class:`FusedRound`), charged to the comm as the eager
        round's all-reduce (its payload: fp32, or the codec's; with a codec, the fused loop's seconds as its codec
        time). Returns False, having changed nothing, where the eager round must run instead: no island trained
        since the last round (with a codec: one island did not, as the eager round does not encode it), the outer
        momentum does not exist yet (torch's SGD starts it from the first pseudo-gradient), an island's error-
        feedback residual does not (its first encode keeps it), an island's parameters are not one vector
        (:meth:`~atoll.job.flat_views.FlatViews.contiguous_params`), or a pseudo-gradient is not finite (the eager
        round leaves it out).

        Raises:
            Diverged: the global model is not finite after the step (the islands then hold it too).
        """
        assert self.fused is not None
        weights = self.round_weights()
        state = self.outer.optimizer.state.get(self.outer.params, {})
        momentum = state.get("momentum_buffer") if self.config.outer_momentum > 0 else None
        if sum(weights) <= 0 or (self.config.outer_momentum > 0 and momentum is None):
            return False
        codec = self.wire.codec
        if codec is not None and min(weights) <= 0:
            return False
        globals_ = self.outer.params.detach()
        inputs = self.compiled_inputs(globals_, "all")
        if inputs is None:
            return False
        views, residuals = inputs
        try:  # a compile that fails does so before anything is written (FusedRound.apply)
            finite = self.fused.apply(globals_, momentum, views, weights, residuals=residuals,
                                      generators=self.wire.generators_for("cpu"))
            if finite is None:  # a pseudo-gradient is not finite: nothing written
                return False
        except Exception as e:  # noqa: BLE001 - any compiler failure means the eager round from now on, said once
            self.give_up(e)
            return False
        codec_s = self.fused.codec_s
        if self.fused.given_up is not None:  # the step's loop failed; the round ended uncompiled
            self.give_up(self.fused.given_up)
        self.outer.version += 1
        if codec is None:
            self.comm.charge_mean(self.numel * 4)  # the all-reduce of the eager round's fp32 mean
        else:
            self.comm.charge_mean(codec.payload_bytes(self.numel), codec_s=codec_s)
        if not (finite or all_finite(globals_)):
            raise Diverged(steps_done, "the global model is not finite after the outer step")
        self.clocks[0].commit(self.islands, steps_done)
        self.compiled_rounds += 1
        return True

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), **self.compiled_summary(self.config.outer_kernel),
                **(self.agreement.summary() if self.agreement is not None else {})}

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), **self.compiled_state(self.config.outer_kernel)}  # + (outer, last_sync_step)
        return state if self.agreement is None else {**state, "agreement": self.agreement.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.load_compiled_state(state)
        if self.agreement is not None and "agreement" in state:
            self.agreement.load_state_dict(state["agreement"])

    def island_state(self, position: int) -> dict[str, Any]:
        return {**super().island_state(position), "wire": self.wire.island_state(position)}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:
        super().load_island_state(position, state)
        self.wire.load_island_state(position, state["wire"])


def project(config: DiLoCoConfig, s: Setting) -> Cost:
    """diloco's cost per inner step: a blocking all-reduce of the b-bit pseudo-gradient (its codec's) every H
    steps::

        X = 2(K-1)/K * N*b/8;   bytes = X/H;   step = t_c + (X*8/B + 2(K-1)L) / H

    Raises:
        ValueError: a codec without fixed bits per element (topk).
    """
    h = config.sync_every
    x = ring_allreduce_bytes(s.params * codec_bits(config.codec) / 8, s.islands)
    t = x * 8 / s.bandwidth_bps + 2 * (s.islands - 1) * s.latency_s if s.islands > 1 else 0.0
    return Cost(s.step_compute_s + t / h, x / h, t, fragments=1, sync_every=h)


SPEC = StrategySpec(
    name="diloco", summary="pseudo-gradients averaged every H inner steps; outer SGD-Nesterov (arXiv:2311.08105)",
    config=DiLoCoConfig, runtimes=("local", "collective"), validate=validate, lockstep=DiLoCo, project=project,
    syncs_per_h=True, shards=True,
    # fp32 (the default) and int4 (the codec of streaming and decoupled); every codec: bench/streaming_codecs.py
    suite=(SuiteRun("diloco", "diloco H={sync_every} {codec} (default)", {"strategy": "diloco"}),
           SuiteRun("diloco_int4", "diloco H={sync_every} int4", {"strategy": "diloco", "codec": "int4"}),
           SuiteRun("diloco_agreement", "diloco H={sync_every} {codec}, agreement-weighted outer step",
                    {"strategy": "diloco", "outer_adapt": "agreement"}),
           # MuLoCo (arXiv:2505.23725): Muon inner steps, at fp32 and int4 against the AdamW rows above
           SuiteRun("diloco_muon", "diloco H={sync_every} {codec}, Muon islands",
                    {"strategy": "diloco", "inner_optimizer": "muon"}),
           SuiteRun("diloco_muon_int4", "diloco H={sync_every} int4, Muon islands",
                    {"strategy": "diloco", "codec": "int4", "inner_optimizer": "muon"})),
)
