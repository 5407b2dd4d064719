"""``demo``: DeMo / DisTrO. Every step, islands all-gather the top-k DCT components of a decoupled momentum.

Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization" (arXiv:2411.19870), the optimizer
behind Nous Research's DisTrO preliminary report (Aug 2024). Each island keeps its own momentum and sends
only its fast-moving components (top-k per DCT chunk); every island decodes all islands' components in
the same order, averages them and applies the sign. All islands apply the same update and stay identical,
so the inner optimizer *is* the exchange: no outer step. The per-step payload is ``n`` indices (int16
for a 64 x 64 tile) plus ``ceil(n / 4)`` bytes of 2-bit signs per tensor (``n = chunks x k``; ``4n``
bytes of float32 values with ``--no-demo-sign-values``; see
:func:`atoll.algorithms.demo_payload.payload_bytes`), instead of ddp's 4 bytes per parameter.
"""

from __future__ import annotations

import re
import time
import warnings
from typing import Any

import torch
from pydantic import Field, model_validator

from atoll.algorithms.demo import DeMo, DemoPayload
from atoll.analysis.cost import Cost, Setting
from atoll.config.section import StrategyConfig
from atoll.runtime.network import ring_allgather_bytes
from atoll.strategies.base import Strategy
from atoll.strategies.repair import DIVERGED, HEALTHY, reset_from_peer
from atoll.strategies.spec import StrategySpec, SuiteRun


class DeMoConfig(StrategyConfig):
    """DeMo's config, all its own: the sign step's rate, the DCT chunks, the top-k and the momentum decay (it
    brings its own inner optimizer: no AdamW settings, no codec, no outer rounds)."""

    instead = {"lr": "demo reads --demo-lr instead", "weight_decay": "demo has no weight decay",
               "inner_optimizer": "demo brings its own inner optimizer (DeMo)"}

    demo_lr: float = Field(3e-3, gt=0, le=10, description="demo: peak learning rate of the sign update.")
    demo_topk: int = Field(32, ge=1, description="demo: DCT components kept per chunk.")
    demo_chunk: int = Field(64, ge=1, description="demo: DCT chunk size along each axis.")
    demo_beta: float = Field(0.999, ge=0, lt=1, description="demo: decay of the decoupled momentum.")
    demo_sign_values: bool = Field(
        True, description="demo: send only the signs of the kept values, {-1, 0, +1} packed 2 bits each; "
        "--no-demo-sign-values sends float32 values (about 2.7x the bytes; docs/results.md, DeMo).",
    )

    @model_validator(mode="after")
    def _topk_fits(self) -> DeMoConfig:
        """A chunk must hold the top-k it keeps.

        Raises:
            ValueError: ``demo_topk`` > ``demo_chunk``².
        """
        if self.demo_topk > self.demo_chunk * self.demo_chunk:
            raise ValueError(f"demo_topk ({self.demo_topk}) exceeds a chunk's {self.demo_chunk}x{self.demo_chunk} "
                             "components; lower --demo-topk")
        return self


def make_optimizer(groups: list[dict[str, Any]], config: DeMoConfig) -> torch.optim.Optimizer:
    """Each island's inner optimizer: :class:`~atoll.algorithms.demo.DeMo` with the section's settings."""
    return DeMo(groups, lr=config.demo_lr, beta=config.demo_beta, chunk=config.demo_chunk, topk=config.demo_topk,
                sign_values=config.demo_sign_values)


def mark_diverged(payloads: list[DemoPayload]) -> None:
    """Mark a diverged island's payloads as empty, in place: the first one's indices become -1 (no index
    is negative), so the payload keeps its size and layout on the wire (every island all-gathers the same
    shapes) and travels as any other."""
    payloads[0].indices.fill_(-1)


def is_marked(payloads: list[DemoPayload]) -> bool:
    """Whether an island's payloads were marked by :func:`mark_diverged`."""
    return bool(payloads) and payloads[0].indices.numel() > 0 and int(payloads[0].indices.reshape(-1)[0]) == -1


class DeMoStrategy(Strategy):
    """Runs each island's :class:`~atoll.algorithms.demo.DeMo` optimizer in lockstep through ``comm``."""

    name = "demo"

    def step(self, step: int) -> None:
        """Encode, all-gather, apply. A gradient that is not finite counts as zero (the island still sends
        its momentum's components); an island whose loss is not finite sends a payload marked as empty
        (:func:`mark_diverged`), which nobody applies, and is then reset from a healthy replica with a zero
        momentum (:mod:`atoll.strategies.repair`)."""
        payloads = []
        for island in self.islands:
            with island.timed():
                diverged = island.diverged  # read at the exchange (every step), which waits for it anyway
                if diverged or not island.clip_gradients():  # a gradient not finite counts as zero
                    for p in island.params:
                        p.grad = torch.zeros_like(p)
                payloads.append(island.optimizer.encode_step())
                if diverged:
                    mark_diverged(payloads[-1])
        optimizer: DeMo = self.islands[0].optimizer  # type: ignore[assignment]
        # the payload is of whole tensors, the same on every rank of a sharded island (its ranks select
        # together: atoll.runtime.collective.sharded_demo), so it travels once per island
        gathered = self.comm.all_gather(payloads, payload_bytes=optimizer.bytes_per_step(), replicated=True)
        job_status = [DIVERGED if is_marked(pls) else HEALTHY for pls in gathered]
        applied = [pls for pls, s in zip(gathered, job_status, strict=True) if s == HEALTHY]
        signs, decode_s = None, 0.0
        if applied and len(self.islands) > 1 and all(i.device.type == "cpu" for i in self.islands):
            # islands in one process apply the same update: decoded once (each island is charged the decode,
            # as it would run it alone), applied to each: the same floats as each decoding its own
            t0 = time.perf_counter()
            signs = optimizer.decoded_signs(applied)
            decode_s = time.perf_counter() - t0
        for island in self.islands:
            with island.timed(), warnings.catch_warnings():
                # the scheduler cannot see apply_step() as an optimizer step; the schedule is unaffected
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                if applied:  # the mean of the healthy islands' components (none: the job diverged)
                    island.optimizer.apply_step(applied, signs)  # type: ignore[attr-defined]
                island.finish_step()
            if signs is not None:
                island.charge(decode_s)
        self.dropped_updates += job_status.count(DIVERGED)
        reset_from_peer(self.comm, self.islands, job_status, step, keep_optimizer=False)

    def global_params(self) -> torch.Tensor:
        return self.islands[0].flat_params()

    def state_dict(self) -> dict[str, Any]:
        return {}


def projected_payload_bytes(config: DeMoConfig, params: float) -> float:
    """Bytes one island's DeMo payload holds per step for ``params`` parameters: N/c^2 chunks x k x (2-byte
    index + value bytes); value bytes: 1/4 for 2-bit sign values (``demo_sign_values``), 4 for float32 values."""
    k = min(config.demo_topk, config.demo_chunk ** 2)
    return params / config.demo_chunk ** 2 * k * (2 + (0.25 if config.demo_sign_values else 4))


def project(config: DeMoConfig, s: Setting) -> Cost:
    """demo's cost per inner step: a ring all-gather of each island's top-k DCT components every step (k per
    chunk of c x c elements, each a 2-byte index and a value of v bytes: 1/4 for 2-bit sign values, 4 for
    float32; :func:`projected_payload_bytes`)::

        S = N * k*(2+v)/c^2;   bytes = (K-1)S;   step = t_c + bytes*8/B + (K-1)L
    """
    x = ring_allgather_bytes(projected_payload_bytes(config, s.params), s.islands)
    t = x * 8 / s.bandwidth_bps + (s.islands - 1) * s.latency_s if s.islands > 1 else 0.0
    return Cost(s.step_compute_s + t, x, t)


SPEC = StrategySpec(
    name="demo",
    summary="top-k DCT components (indices, 2-bit signs) of a decoupled momentum, every inner step; sign of "
            "the average applied (DeMo, arXiv:2411.19870)",
    config=DeMoConfig, runtimes=("local", "collective"), lockstep=DeMoStrategy,
    # sign-SGD learns best at a constant rate after warmup (bench/demo_sweep.py)
    defaults={"min_lr_ratio": 1.0}, inner_optimizer=make_optimizer, project=project, shards=True,
    suite=(SuiteRun("demo", "demo top-k {demo_topk} of {demo_chunk}x{demo_chunk}, 2-bit signs",
                    {"strategy": "demo"}),),
)
