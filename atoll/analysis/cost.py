"""What a strategy's exchanges cost, in closed form: the inputs (:class:`Setting`) and the answer (:class:`Cost`).

The types every strategy's cost formula (``SPEC.project`` in its module) takes and returns: it takes the
strategy's own config (its H, fragments, codec...) and a :class:`Setting` (the facts of any run: model, compute,
islands, links, failures); the projection to real scale (:mod:`atoll.analysis.projection`) runs those
formulas. Units: parameters (elements), seconds, bytes (8 bits), bits per second. No torch.
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
    """The facts of one training setting to project, whatever the strategy: the model, one inner step's compute,
    the islands, their links and their failures. A strategy's own settings (H, fragments, codec, top-k...) are
    its config's (:class:`~atoll.config.section.StrategyConfig`), which its cost formula takes beside this.

    Attributes:
        params: N, model parameters (elements).
        step_compute_s: t_c, seconds of one inner step (forward, backward, optimizer) of one island.
        islands: K.
        bandwidth_mbps: each island's link, Mbit/s (10^6 bit/s), each direction.
        latency_ms: one-way latency per message, milliseconds.
        mtbf_s: mean time between failures of one island, seconds (inf: no failures).
        downtime_s: seconds from an island's failure to its replacement computing again.
        checkpoint_every_s: seconds between the checkpoints a synchronous job rolls back to.
        tokens_per_step: tokens one island consumes per inner step (for tokens/s; informative only).

    Raises:
        ConfigError: a value out of range (one line naming the ``atoll project`` flag).
    """

    params: float
    step_compute_s: float
    islands: int = 4
    bandwidth_mbps: float = 100.0
    latency_ms: float = 10.0
    mtbf_s: float = math.inf
    downtime_s: float = 0.0
    checkpoint_every_s: float = 0.0
    tokens_per_step: float = 0.0

    def __post_init__(self) -> None:
        flags = {"mtbf_s": "--mtbf-h", "downtime_s": "--downtime-min", "checkpoint_every_s": "--checkpoint-min"}
        for name in ("params", "step_compute_s", "bandwidth_mbps", "mtbf_s"):
            value = getattr(self, name)
            if not value > 0 or (name != "mtbf_s" and not math.isfinite(value)):
                raise ConfigError(f"{name}: must be positive and finite (got {value!r}); "
                                  f"set {flags.get(name, '--' + name.replace('_', '-'))}")
        if self.islands < 1:
            raise ConfigError(f"islands: must be at least 1 (got {self.islands!r}); set --islands")
        for name in ("latency_ms", "downtime_s", "checkpoint_every_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name}: must be finite and not negative (got {getattr(self, name)!r}); "
                                  f"set {flags.get(name, '--' + name.replace('_', '-'))}")

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
            an exchange every step or none), for the end of a run
            (:func:`~atoll.analysis.projection.project_run`).
        overlapped: whether exchanges overlap compute (their time is inside ``step_s``).
        sync_every: H, inner steps between an island's exchanges of a fragment (1: every step): the schedule
            of the end of a run, and the work an asynchronous island loses when it fails.
        bytes_received_per_step: bytes one island receives per inner step; None: as many as it sends (every
            exchange a ring collective, whose receive half equals its send half). See :attr:`received_per_step`.
    """

    step_s: float
    bytes_per_step: float
    exchange_s: float
    fragments: int = 0
    overlapped: bool = False
    sync_every: int = 1
    bytes_received_per_step: float | None = None

    @property
    def received_per_step(self) -> float:
        """Bytes one island receives per inner step (:attr:`bytes_received_per_step`, else as many as sent)."""
        return self.bytes_per_step if self.bytes_received_per_step is None else self.bytes_received_per_step


def codec_bits(codec: str) -> float:
    """b, bits per exchanged element of ``codec`` (:data:`CODEC_BITS`).

    Raises:
        ValueError: a codec without a fixed number of bits per element (``topk``: its indices and values).
    """
    if codec not in CODEC_BITS:
        raise ValueError(f"codec {codec!r} has no fixed bits per element (those that do: {', '.join(CODEC_BITS)})")
    return CODEC_BITS[codec]
