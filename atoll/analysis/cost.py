"""What a strategy's exchanges cost, in closed form: the inputs (:class:`Setting`) and the answer (:class:`Cost`).

The types every strategy's cost formula (``SPEC.project`` in its module) takes and returns; the projection to
real scale (:mod:`atoll.analysis.projection`) runs those formulas. Units: parameters (elements), seconds,
bytes (8 bits), bits per second. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.errors import ConfigError

#: bits per exchanged element of each codec: the value, plus one float32 scale per block of 64 for the
#: block-scaled codecs (atoll.algorithms.codecs).
CODEC_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8-e4m3": 8.5, "fp8-e5m2": 8.5, "int8": 8.5, "int4": 4.5}



@dataclass(frozen=True)
class Setting:
    """One training setting to project.

    Attributes:
        params: N, model parameters (elements).
        step_compute_s: t_c, seconds of one inner step (forward, backward, optimizer) of one island.
        islands: K.
        bandwidth_mbps: each island's link, Mbit/s (10^6 bit/s), each direction.
        latency_ms: one-way latency per message, milliseconds.
        sync_every: H, inner steps per outer round (diloco, streaming, decoupled).
        fragments: P (streaming, decoupled).
        overlap_steps: tau, inner steps that overlap a fragment's exchange (streaming).
        codec_bits: b, bits per exchanged element of pseudo-gradients (diloco, streaming, decoupled); see
            :data:`CODEC_BITS`.
        demo_topk, demo_chunk: DeMo's k components kept per c x c DCT chunk.
        demo_sign_values: DeMo values as 2-bit signs (True, atoll's default) or float32 (False).
        sparseloco_topk, sparseloco_chunk, sparseloco_bits: SparseLoCo's k entries kept per chunk of c
            elements, and the bits per kept value (2 or 32).
        mtbf_s: mean time between failures of one island, seconds (inf: no failures).
        downtime_s: seconds from an island's failure to its replacement computing again.
        checkpoint_every_s: seconds between the checkpoints a synchronous job rolls back to.
        tokens_per_step: tokens one island consumes per inner step (for tokens/s; informative only).
    """

    params: float
    step_compute_s: float
    islands: int = 4
    bandwidth_mbps: float = 100.0
    latency_ms: float = 10.0
    sync_every: int = 50
    fragments: int = 4
    overlap_steps: int = 5
    codec_bits: float = 32.0
    demo_topk: int = 32
    demo_chunk: int = 64
    demo_sign_values: bool = True
    sparseloco_topk: int = 64
    sparseloco_chunk: int = 4096
    sparseloco_bits: int = 2
    mtbf_s: float = math.inf
    downtime_s: float = 0.0
    checkpoint_every_s: float = 0.0
    tokens_per_step: float = 0.0

    def __post_init__(self) -> None:
        flags = {"mtbf_s": "--mtbf-h", "downtime_s": "--downtime-min", "checkpoint_every_s": "--checkpoint-min"}
        for name in ("params", "step_compute_s", "bandwidth_mbps", "codec_bits", "mtbf_s"):
            value = getattr(self, name)
            if not value > 0 or (name != "mtbf_s" and not math.isfinite(value)):
                raise ConfigError(f"{name}: must be positive and finite (got {value!r}); "
                                  f"set {flags.get(name, '--' + name.replace('_', '-'))}")
        for name in ("islands", "sync_every", "fragments", "demo_topk", "demo_chunk", "sparseloco_topk",
                     "sparseloco_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1 (got {getattr(self, name)!r}); "
                                  f"set --{name.replace('_', '-')}")
        for name in ("latency_ms", "downtime_s", "checkpoint_every_s", "overlap_steps"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name}: must be finite and not negative (got {getattr(self, name)!r}); "
                                  f"set {flags.get(name, '--' + name.replace('_', '-'))}")
        if self.sync_every < self.fragments:
            raise ConfigError(f"sync_every ({self.sync_every}) must be at least fragments ({self.fragments}); "
                              "raise --sync-every or lower --fragments")

    @property
    def bandwidth_bps(self) -> float:
        return self.bandwidth_mbps * 1e6

    @property
    def latency_s(self) -> float:
        return self.latency_ms * 1e-3


@dataclass(frozen=True)
class Cost:
    """What one strategy's exchanges cost per inner step of one island, in steady state.

    Attributes:
        step_s: seconds per inner step, communication included.
        bytes_per_step: bytes one island sends per inner step.
        exchange_s: seconds of one exchange (of a fragment where there are several).
        fragments: fragments on the staggered sync schedule (1: every H steps, all at once; 0: no schedule,
            an exchange every step or none), for the end of a run (:func:`project_run`).
        overlapped: whether exchanges overlap compute (their time is inside ``step_s``).
    """

    step_s: float
    bytes_per_step: float
    exchange_s: float
    fragments: int = 0
    overlapped: bool = False


def demo_payload_bytes(s: Setting) -> float:
    """Bytes one island's DeMo payload holds per step: N/c^2 chunks x k x (2-byte index + value bytes).

    Value bytes: 1/4 for 2-bit sign values (``demo_sign_values``), 4 for float32 values.
    """
    k = min(s.demo_topk, s.demo_chunk ** 2)
    return s.params / s.demo_chunk ** 2 * k * (2 + (0.25 if s.demo_sign_values else 4))
