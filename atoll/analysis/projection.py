"""Projection to real scale: step time, compute utilization, bytes and goodput of each strategy, by arithmetic.

    atoll project --params 12e9 --step-compute-s 6 --islands 4 --bandwidth-mbps 2000 --latency-ms 35
    atoll project --table          # 1B, 12B, 100B over 4 regions (2, 5 Gbit/s) and consumer links (100, 10 Mbit/s)

No training and no torch: the cost model of atoll's simulated network clock
(:mod:`atoll.runtime.network`) in closed form, checked against measured runs in ``tests/test_projection.py``.
Units: parameters (elements), seconds, bytes (8 bits), bits per second. Symbols: N parameters, t_c compute
seconds of one inner step of one island, K islands, B link bandwidth (bit/s, each island's, full duplex),
L one-way latency (s), H inner steps per outer round, P fragments, tau overlapped inner steps, b bits per
exchanged element.

Per inner step (steady state), each strategy prices itself (``SPEC.project`` in its module under
:mod:`atoll.strategies`, with the formula in its docstring) from its own config (H, P, tau, its codec's b, its
top-k: :class:`~atoll.config.section.StrategyConfig`) and the facts of the run (:class:`Setting`: N, t_c, K, B, L,
failures): a :class:`Cost` of seconds per step, bytes per step and seconds per exchange. Nothing here reads a
setting the strategy does not own. Exchanges are ring collectives (Patarasuk & Yuan 2009): an all-reduce of B
bytes sends 2(K-1)/K*B per island in 2(K-1) rounds, an all-gather of B per island (K-1)*B in K-1 rounds
(:func:`atoll.runtime.network.ring_allreduce_bytes`, :func:`~atoll.runtime.network.ring_allgather_bytes`, the
formulas of the simulated clock).

Compute utilization = t_c / step. Goodput = useful tokens per second over the failure-free rate, with
independent island failures at rate 1/MTBF, each taking ``downtime`` seconds to detect and replace:

- a synchronous strategy (ddp, diloco, streaming, demo) stops every island on any island's failure and
  rolls back to its last checkpoint (every ``checkpoint_every_s``: half an interval lost on average;
  Young 1974, Daly 2006): ``goodput = 1 / (1 + K/MTBF * (downtime + checkpoint_every_s/2))``;
- an asynchronous strategy (``decoupled``) loses only the failed island's time and its unsent pseudo-gradient
  (H/2 steps on average), the others keep going and the syncer merges a quorum:
  ``goodput = 1 / (1 + (downtime + H*step/2)/MTBF)``.

Published figures to hold these against (:data:`PUBLISHED`): DisTrO's 857x fewer bytes than an AdamW
all-reduce (1.2B model), Decoupled DiLoCo's >20x speed over synchronous training on 2-5 Gbit/s WAN (12B model,
4 US regions) and its 88% against 27% goodput under heavy injected failures.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from atoll.analysis.cost import CODEC_BITS, Cost, Setting, codec_bits
from atoll.config.parse import format_validation_error
from atoll.config.section import StrategyConfig
from atoll.config.sections import PULL_CODECS
from atoll.errors import ConfigError
from atoll.job.metrics import human_bytes
from atoll.runtime.network import ring_allgather_bytes, ring_allreduce_bytes
from atoll.strategies.registry import STRATEGIES, spec
from atoll.strategies.spec import StrategySpec

__all__ = ["CODEC_BITS", "STRATEGIES", "Cost", "Projection", "Setting", "codec_bits", "config_from_summary", "project",
           "project_run", "ring_allgather_bytes", "ring_allreduce_bytes", "setting_from_summary"]

#: published figures, for the table beside the projection
PUBLISHED = {
    "distro_byte_reduction": 857.0,  # DisTrO preliminary report (Aug 2024): 74.4 GB -> 86.8 MB per step, 1.2B
    "decoupled_speedup_2_5gbps": 20.0,  # Decoupled DiLoCo: >20x faster than synchronous, 12B, 4 regions, 2-5 Gbit/s
    "decoupled_goodput_heavy_failures": 0.88,  # Decoupled DiLoCo, heavy injected failures
    "data_parallel_goodput_heavy_failures": 0.27,  # the same, data parallel
}


@dataclass(frozen=True)
class Projection:
    """What one strategy costs in one :class:`Setting`, per inner step of one island (steady state).

    Attributes:
        strategy: its name.
        step_s: seconds per inner step, communication included.
        compute_utilization: t_c / step_s.
        bytes_per_step: bytes one island sends per inner step.
        goodput: useful tokens/s over the failure-free rate under the setting's failures (1.0 without).
        exchange_s: seconds of one exchange (a whole one; a fragment's for streaming).
    """

    strategy: str
    step_s: float
    compute_utilization: float
    bytes_per_step: float
    goodput: float
    exchange_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    bytes_received_per_step: float = math.nan  # bytes one island receives per inner step (NaN: not given)

    def __post_init__(self) -> None:
        if math.isnan(self.bytes_received_per_step):  # a ring collective's: as many in as out
            object.__setattr__(self, "bytes_received_per_step", self.bytes_per_step)


def _sync_goodput(s: Setting) -> float:
    """Synchronous job: any of K islands failing stops all for the downtime plus half a checkpoint interval."""
    if math.isinf(s.mtbf_s):
        return 1.0
    return 1.0 / (1.0 + s.islands / s.mtbf_s * (s.downtime_s + s.checkpoint_every_s / 2))


def _spec(strategy: str) -> StrategySpec:
    try:
        own = spec(strategy)
    except KeyError:
        raise ConfigError(f"strategy: unknown strategy '{strategy}'; use one of {', '.join(STRATEGIES)}") from None
    if own.project is None:
        raise ConfigError(f"strategy: the {strategy} strategy has no cost model (its spec's project); "
                          f"use one of {', '.join(s for s in STRATEGIES if spec(s).project is not None)}")
    return own


def _cost(s: Setting, strategy: str, config: StrategyConfig | None) -> tuple[StrategySpec, Cost]:
    """The strategy's spec and its cost formula's answer for its ``config`` (None: its defaults) in ``s``."""
    own = _spec(strategy)
    config = own.config() if config is None else config
    if not isinstance(config, own.config):
        raise TypeError(f"the {strategy} strategy's cost takes its {own.config.__name__}, not a "
                        f"{type(config).__name__}")
    assert own.project is not None  # (_spec)
    return own, own.project(config, s)


def project(s: Setting, strategy: str, config: StrategyConfig | None = None) -> Projection:
    """Steady-state cost of ``strategy`` with its own ``config`` (its spec's config; None: its defaults) in the
    setting ``s`` (its spec's formula; goodput as the module says).

    Raises:
        ConfigError: an unknown strategy, or one without a cost model.
        TypeError: ``config`` is not the strategy's config.
        ValueError: a codec without fixed bits per element (topk).
    """
    own, c = _cost(s, strategy, config)
    if own.lockstep is None:  # asynchronous: only the failed island's time and its unsent work are lost
        goodput = 1.0 if math.isinf(s.mtbf_s) else 1.0 / (1.0 + (s.downtime_s + c.sync_every * c.step_s / 2) / s.mtbf_s)
    else:
        goodput = _sync_goodput(s)
    return Projection(strategy, c.step_s, s.step_compute_s / c.step_s, c.bytes_per_step, goodput, c.exchange_s,
                      bytes_received_per_step=c.received_per_step)


def fragment_syncs(steps: int, fragments: int, sync_every: int) -> tuple[int, int]:
    """(scheduled fragment syncs, end-of-run flushes) of a run of ``steps`` inner steps.

    Fragment p syncs after ``offset_p + j*H`` steps, ``offset_p = round((p+1)H/P)``
    (:func:`atoll.algorithms.fragments.fragment_sync_steps`); at the end, every fragment trained since its
    last sync is synced once more, blocking. With P = 1 this is diloco's schedule.
    """
    from atoll.algorithms.fragments import fragment_sync_steps  # the schedule the strategies run

    scheduled = flushes = 0
    for off in fragment_sync_steps(fragments, sync_every):
        n = (steps - off) // sync_every + 1 if steps >= off else 0
        last = off + (n - 1) * sync_every if n else 0
        scheduled += n
        flushes += int(last != steps)
    return scheduled, flushes


def project_run(s: Setting, strategy: str, steps: int, config: StrategyConfig | None = None) -> dict[str, float]:
    """A whole run of ``steps`` inner steps of ``strategy`` with its ``config`` (None: its defaults):
    ``sim_wall_s``, ``compute_s``, ``compute_utilization``, ``bytes`` (sent by one island), ``bytes_received``.

    The steady state of :func:`project` times ``steps``, plus the end of the run as atoll's strategies do it:
    a strategy on the fragment schedule (diloco, streaming) syncs what was trained since the last sync,
    blocking (:func:`fragment_syncs`; its H and P are its cost's).

    Raises:
        as :func:`project`.
    """
    p = project(s, strategy, config)
    _, c = _cost(s, strategy, config)
    compute = steps * s.step_compute_s
    wall, sent, received = steps * p.step_s, steps * p.bytes_per_step, steps * p.bytes_received_per_step
    if c.fragments and s.islands > 1:
        scheduled, flushes = fragment_syncs(steps, c.fragments, c.sync_every)
        sent = (scheduled + flushes) * c.bytes_per_step * c.sync_every / c.fragments
        received = (scheduled + flushes) * c.received_per_step * c.sync_every / c.fragments
        if not c.overlapped:
            wall = compute + (scheduled + flushes) * p.exchange_s
        else:  # the steady state, plus the blocking flushes at the end
            wall += flushes * p.exchange_s
    return {"sim_wall_s": wall, "compute_s": compute, "compute_utilization": compute / wall, "bytes": sent,
            "bytes_received": received}


def setting_from_summary(summary: dict[str, Any]) -> Setting:
    """The :class:`Setting` of a measured run of the ``local`` runtime, from its ``summary.json``: its model,
    islands and simulated links (t_c = compute_s / steps).

    Raises:
        ValueError: the summary has no simulated links (a runtime on a real clock).
    """
    if "link_bandwidth_mbps" not in summary:
        raise ValueError(f"a {summary.get('runtime')} run's summary has no simulated links (link_bandwidth_mbps): "
                         "project a run of the local runtime")
    return Setting(
        params=summary["params"], step_compute_s=summary["compute_s"] / summary["steps"],
        islands=summary["islands"], bandwidth_mbps=summary["link_bandwidth_mbps"],
        latency_ms=summary["link_latency_ms"],
    )


def config_from_summary(summary: dict[str, Any]) -> StrategyConfig:
    """The strategy's own config of a measured run, from its ``summary.json``: the settings of the summary that
    the strategy's config has (its H, fragments, overlap, codec...; None: not set), the config's defaults for
    the others. An entry of another strategy's (an older summary's ``sync_every`` of a ddp run) is not read.

    Raises:
        ConfigError: an unknown strategy, or a value its config refuses (one line naming it).
    """
    own = _spec(summary["strategy"])
    given = {k: v for k, v in summary.items() if k in own.config.model_fields and v is not None}
    try:
        return own.config(**given)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


# --- real scale --------------------------------------------------------------------------------------

#: H100 SXM dense bf16 peak, FLOP/s
H100_BF16_FLOPS = 989e12


@dataclass(frozen=True)
class ModelScale:
    """A model at real scale and the compute one inner step takes on one island.

    ``step_compute_s = 6 * params * tokens_per_step / (gpus_per_island * H100_BF16_FLOPS * mfu)`` (the
    6ND training FLOPs of Kaplan et al. 2020).
    """

    name: str
    params: float
    tokens_per_step: float
    gpus_per_island: int
    mfu: float = 0.4

    @property
    def step_compute_s(self) -> float:
        return 6 * self.params * self.tokens_per_step / (self.gpus_per_island * H100_BF16_FLOPS * self.mfu)


SCALES = (
    ModelScale("1B", 1e9, 2 ** 19, 8),       # 0.5M tokens per island step on 8 H100: ~1.0 s
    ModelScale("12B", 12e9, 2 ** 21, 64),    # 2M tokens on 64 H100: ~6.0 s
    ModelScale("100B", 100e9, 2 ** 22, 512),  # 4M tokens on 512 H100: ~12.4 s
)

#: (label, Mbit/s, one-way latency ms): 4 regions over a WAN, and consumer links
LINKS = (("WAN 5 Gbit/s", 5000.0, 35.0), ("WAN 2 Gbit/s", 2000.0, 35.0),
         ("consumer 100 Mbit/s", 100.0, 20.0), ("consumer 10 Mbit/s", 10.0, 20.0))

#: the heavy-failure scenario of the table: each island fails every 40 minutes on average and is back 10
#: minutes later; a synchronous job checkpoints every 30 minutes.
HEAVY_FAILURES = {"mtbf_s": 40 * 60.0, "downtime_s": 10 * 60.0, "checkpoint_every_s": 30 * 60.0}

#: each strategy's own settings at real scale, for its config (DiLoCo's H of hundreds of steps; Streaming
#: DiLoCo's int4 fragments); a strategy not named here: its config's defaults
TABLE_SETTINGS: dict[str, dict[str, Any]] = {
    "ddp": {}, "diloco": {"sync_every": 100, "codec": "fp32"},
    "streaming": {"sync_every": 100, "fragments": 4, "overlap_steps": 5, "codec": "int4"},
    "demo": {"demo_topk": 32, "demo_chunk": 64, "demo_sign_values": True},
    "sparseloco": {"sync_every": 100, "sparseloco_topk": 64, "sparseloco_chunk": 4096, "sparseloco_bits": 2},
    "decoupled": {"sync_every": 100, "fragments": 4, "codec": "int4", "pull_codec": "int4"},
}


def real_scale_table(islands: int = 4) -> list[dict[str, Any]]:
    """One row per (model, link, strategy) for :data:`SCALES` x :data:`LINKS`, with heavy failures."""
    rows = []
    for scale in SCALES:
        for label, mbps, lat in LINKS:
            base = Setting(params=scale.params, step_compute_s=scale.step_compute_s, islands=islands,
                           bandwidth_mbps=mbps, latency_ms=lat, tokens_per_step=scale.tokens_per_step,
                           **HEAVY_FAILURES)
            ddp_step = project(base, "ddp").step_s
            for strategy in STRATEGIES:
                p = project(base, strategy, spec(strategy).config(**TABLE_SETTINGS.get(strategy, {})))
                rows.append({"model": scale.name, "link": label, "strategy": strategy, "step_s": p.step_s,
                             "compute_utilization": p.compute_utilization, "bytes_per_step": p.bytes_per_step,
                             "bytes_received_per_step": p.bytes_received_per_step,
                             "reduction_vs_ddp": (project(base, "ddp").bytes_per_step / p.bytes_per_step
                                                  if p.bytes_per_step else math.inf),
                             "reduction_vs_ddp_total": (2 * project(base, "ddp").bytes_per_step
                                                        / (p.bytes_per_step + p.bytes_received_per_step)
                                                        if p.bytes_per_step + p.bytes_received_per_step
                                                        else math.inf),
                             "speedup_vs_ddp": ddp_step / p.step_s, "goodput_heavy_failures": p.goodput})
    return rows


def check_pull_codec(name: str | None) -> None:
    """``--pull-codec`` of the projections: None (the strategy's own) or one of the pull codecs.

    Raises:
        ConfigError: ``name`` is not one of :data:`~atoll.config.sections.PULL_CODECS`.
    """
    if name is not None and name not in PULL_CODECS:
        raise ConfigError(f"pull_codec: unknown '{name}'; use one of {', '.join(PULL_CODECS)}")


def format_table(rows: list[dict[str, Any]]) -> str:
    """The real-scale table as Markdown, with the assumptions and the published figures under it."""
    lines = ["| model | link | strategy | step s | utilization | sent/island/step | received/island/step | "
             "less than ddp (sent) | less than ddp (both) | speed vs ddp | goodput (heavy failures) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['link']} | {r['strategy']} | {r['step_s']:.2f} | "
                     f"{r['compute_utilization']:.1%} | {human_bytes(r['bytes_per_step'])} | "
                     f"{human_bytes(r['bytes_received_per_step'])} | {r['reduction_vs_ddp']:.0f}x | "
                     f"{r['reduction_vs_ddp_total']:.0f}x | {r['speedup_vs_ddp']:.1f}x | "
                     f"{r['goodput_heavy_failures']:.0%} |")
    assumptions = "; ".join(f"{m.name}: {m.tokens_per_step / 2 ** 20:g}M tokens/step on {m.gpus_per_island} H100 "
                            f"at {m.mfu:.0%} MFU -> t_c = {m.step_compute_s:.2f} s" for m in SCALES)
    from atoll.strategies.demo import projected_payload_bytes

    demo_red = 4 * 1.2e9 / projected_payload_bytes(spec("demo").config(**TABLE_SETTINGS["demo"]), 1.2e9)
    lines += [
        "",
        f"Assumptions: 4 islands; t_c = 6*N*tokens / (GPUs * 989 TFLOP/s * MFU): {assumptions}. "
        "ddp not overlapped with backward; diloco H=100 fp32; streaming H=100 P=4 tau=5 int4; demo top-k 32 "
        "of 64x64 DCT chunks, 2-bit sign values; sparseloco H=100 top-64 of 4096, 2-bit values; decoupled H=100 "
        "int4 pushes, int4 pulls, syncer link not the bottleneck. Heavy failures: island "
        "MTBF 40 min, 10 min to replace, synchronous checkpoints every 30 min.",
        "",
        "Published, beside the projection:",
        f"- DisTrO (1.2B): {PUBLISHED['distro_byte_reduction']:.0f}x fewer bytes than an AdamW all-reduce. This "
        f"model: a DeMo top-k 32 payload is {demo_red:.0f}x smaller than the fp32 gradient (per island, before "
        "the all-gather's K-1); the report's 857x counts its own, unpublished encoding.",
        "- Decoupled DiLoCo (12B, 4 regions, 2-5 Gbit/s): >20x faster than synchronous data parallel. This "
        "model: decoupled vs ddp in the 12B WAN rows above.",
        "- Decoupled DiLoCo, heavy injected failures: goodput 88% vs 27% for data parallel. This model: the "
        "goodput column (decoupled vs ddp) under the scenario above.",
    ]
    return "\n".join(lines)


#: the budget of :func:`exchange_table`: the outer round's host work at most this share of the inner compute
EXCHANGE_BUDGET = 0.05


def exchange_share(ns_per_param: float, tokens_per_step: float, sync_every: int, mfu: float = 0.4,
                   flops: float = H100_BF16_FLOPS) -> float:
    """The outer round's host seconds over the inner compute of the H steps between rounds, per GPU.

    An island of G GPUs computes ``H * 6 * N * T / (G * flops * mfu)`` seconds per round (``T`` tokens per
    island step); each of its ranks runs the outer round over the N/G parameters it holds (a sharded island),
    ``ns_per_param * 1e-9 * N / G`` seconds. N and G cancel::

        share = ns_per_param * 1e-9 * flops * mfu / (6 * H * T)

    An unsharded island's ranks each run the round over all N parameters: G times this share.
    ``ns_per_param``: measured (bench/outer_round.py), ns per parameter on one CPU thread.
    """
    return ns_per_param * 1e-9 * flops * mfu / (6 * sync_every * tokens_per_step)


def min_h_tokens(ns_per_param: float, budget: float = EXCHANGE_BUDGET, mfu: float = 0.4,
                 flops: float = H100_BF16_FLOPS) -> float:
    """The least H x tokens per island step at which :func:`exchange_share` stays within ``budget``."""
    return ns_per_param * 1e-9 * flops * mfu / (6 * budget)


def exchange_table(measured: dict[str, dict[str, float]], sync_every: int = 50) -> list[dict[str, Any]]:
    """Rows per (strategy case, model of :data:`SCALES` up to 12B): the outer round's share of the inner
    compute at that scale's tokens per island step and at 32k (the batch that fits a 1B step on one 80 GB GPU
    without gradient accumulation), H = ``sync_every``, and the least H x tokens within
    :data:`EXCHANGE_BUDGET`, before and after. ``measured``: per case, ``{"before": ns, "after": ns}``."""
    rows = []
    for case, ns in measured.items():
        for scale in SCALES[:2]:
            row: dict[str, Any] = {"case": case, "model": scale.name, "gpus_per_island": scale.gpus_per_island,
                                   "tokens_per_step": scale.tokens_per_step, "sync_every": sync_every}
            for variant in ("before", "after"):
                row[f"ns_per_param_{variant}"] = ns[variant]
                row[f"round_s_per_gpu_{variant}"] = ns[variant] * 1e-9 * scale.params / scale.gpus_per_island
                row[f"share_{variant}"] = exchange_share(ns[variant], scale.tokens_per_step, sync_every, scale.mfu)
                row[f"share_32k_{variant}"] = exchange_share(ns[variant], 2 ** 15, sync_every, scale.mfu)
                row[f"min_h_tokens_{variant}"] = min_h_tokens(ns[variant], mfu=scale.mfu)
            rows.append(row)
    return rows


def format_exchange_table(rows: list[dict[str, Any]]) -> str:
    """:func:`exchange_table` as Markdown, with its assumptions."""
    lines = ["| case | model | ns/param before -> after | round s/GPU (after) | share at H x T (before -> after) | "
             "share at H x 32k (before -> after) | least H x tokens for <= 5% (before -> after) |",
             "|---|---|---|---:|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['model']} ({r['gpus_per_island']} GPUs/island) | {r['ns_per_param_before']:.1f} -> "
            f"{r['ns_per_param_after']:.1f} | {r['round_s_per_gpu_after']:.2f} | H={r['sync_every']}, "
            f"T={r['tokens_per_step'] / 2 ** 20:g}M: {r['share_before']:.1%} -> {r['share_after']:.1%} | "
            f"{r['share_32k_before']:.1%} -> {r['share_32k_after']:.1%} | "
            f"{r['min_h_tokens_before'] / 1e6:.1f}M -> {r['min_h_tokens_after'] / 1e6:.1f}M |")
    lines += ["", "Per GPU of a sharded island (each rank runs the round over its N/G parameters; an unsharded "
              "island's ranks each run it over all N: G times the share). Inner step: 6*N*T FLOPs at 40% MFU of "
              "989 TFLOP/s (H100 bf16). The round's host work is CPU ns/param as measured on one thread "
              "(memory-bound, flat from 50M up), so the least H x tokens is the same at 1B and 12B; the link's "
              "time is apart (`atoll project --table`). decoupled: one window of the syncer and K = 2 islands."]
    return "\n".join(lines)


#: the values of ``atoll project``'s flags left unset (their parser defaults are None, so that a flag typed
#: with its default value beside ``--table`` or ``--paper-scale``, which read none of them, is refused too)
DEFAULTS: dict[str, Any] = {"strategy": "all", "islands": 4, "bandwidth_mbps": 100.0, "latency_ms": 10.0,
                            "sync_every": 50, "fragments": 4, "overlap_steps": 1, "mtbf_h": math.inf,
                            "downtime_min": 0.0, "checkpoint_min": 0.0}


def add_arguments(parser: Any) -> None:
    """Flags of ``atoll project`` (one per :class:`Setting` field, plus ``--table`` and ``--paper-scale``; its
    link shares: :func:`atoll.analysis.paper_scale.add_arguments`); unset ones read as :data:`DEFAULTS`."""
    pull_default = spec("decoupled").config.model_fields["pull_codec"].default
    parser.add_argument("--table", action="store_true", help="print the real-scale table (1B, 12B, 100B; "
                        "4 regions at 2 and 5 Gbit/s, consumer links at 100 and 10 Mbit/s) and exit")
    parser.add_argument("--paper-scale", action="store_true", help="print where decoupled lands at its paper's "
                        "scale (12B, 4 regions, 2 and 5 Gbit/s) with the link shares and syncer CPU atoll measured "
                        "(atoll/analysis/paper_scale.py), and exit; takes --push-share, --pull-share, --pull-codec")
    parser.add_argument("--strategy", default=None, help=f"one of {', '.join(STRATEGIES)}, or all "
                        "[default: all]")
    parser.add_argument("--params", type=float, default=None, help="model parameters N (e.g. 12e9)")
    parser.add_argument("--step-compute-s", type=float, default=None,
                        help="seconds of compute of one inner step of one island, t_c")
    parser.add_argument("--islands", type=int, default=None, help="K [default: 4]")
    parser.add_argument("--bandwidth-mbps", type=float, default=None, help="link Mbit/s [default: 100]")
    parser.add_argument("--latency-ms", type=float, default=None, help="one-way latency ms [default: 10]")
    parser.add_argument("--sync-every", type=int, default=None, help="H [default: 50]")
    parser.add_argument("--fragments", type=int, default=None, help="P (streaming, decoupled) [default: 4]")
    parser.add_argument("--overlap-steps", type=int, default=None, help="tau (streaming) [default: 1, as atoll train]")
    parser.add_argument("--codec", default=None, help=f"pseudo-gradient codec: {', '.join(CODEC_BITS)} "
                        "[default: each strategy's, as atoll train: int4 for streaming and decoupled, else fp32]")
    parser.add_argument("--pull-codec", default=None, help="decoupled: the pull's codec, fp32, bf16, int8, int4 "
                        f"(one change per pull) [default: {pull_default}, as atoll train]")
    parser.add_argument("--mtbf-h", type=float, default=None, help="island MTBF, hours [default: inf]")
    parser.add_argument("--downtime-min", type=float, default=None, help="minutes to replace a failed island "
                        "[default: 0]")
    parser.add_argument("--checkpoint-min", type=float, default=None,
                        help="minutes between checkpoints of a synchronous job [default: 0]")


def run_cli(args: Any) -> str:
    """What ``atoll project`` prints.

    Raises:
        ConfigError: a missing or invalid setting (one line naming the flag).
    """
    if args.table:
        # its settings are its own: a flag beside it is unread (the link shares: --paper-scale's, defined there)
        shares = [k for k in ("push_share", "pull_share") if getattr(args, k, None) is not None]
        if given := flags_given(args, keep=("table",)) + shares:
            raise ConfigError(f"{given[0]}: --table prints a fixed table of its own settings; drop "
                              f"--{given[0].replace('_', '-')} or --table")
        return format_table(real_scale_table())
    if args.push_share is not None or args.pull_share is not None:
        raise ConfigError("push_share: --push-share and --pull-share are read by --paper-scale only; add "
                          "--paper-scale or drop them")
    args = argparse.Namespace(**{k: DEFAULTS[k] if v is None and k in DEFAULTS else v for k, v in vars(args).items()})
    if args.params is None or args.step_compute_s is None:
        raise ConfigError("params: --params and --step-compute-s are required (or pass --table or --paper-scale)")
    if args.codec is not None and args.codec not in CODEC_BITS:
        raise ConfigError(f"codec: unknown codec '{args.codec}'; use one of {', '.join(CODEC_BITS)}")
    check_pull_codec(args.pull_codec)  # whatever strategy
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    if args.strategy != "all" and args.strategy not in STRATEGIES:
        raise ConfigError(f"strategy: unknown strategy '{args.strategy}'; use all or one of {', '.join(STRATEGIES)}")
    s = Setting(params=args.params, step_compute_s=args.step_compute_s, islands=args.islands,
                bandwidth_mbps=args.bandwidth_mbps, latency_ms=args.latency_ms, mtbf_s=args.mtbf_h * 3600,
                downtime_s=args.downtime_min * 60, checkpoint_every_s=args.checkpoint_min * 60)
    ddp = project(s, "ddp")
    lines = ["| strategy | codec | step s | utilization | sent/island/step | received/island/step | "
             "less than ddp (sent) | less than ddp (both) | goodput |", "|---|---|---|---|---|---|---|---|---|"]
    for name in strategies:
        config = cli_config(args, name)
        # the strategy's own codec, as atoll train (ddp is priced as the fp32 baseline); demo and sparseloco
        # have their own encodings
        codec = getattr(config, "codec", None) if name != "ddp" else "fp32"
        p = project(s, name, config)
        red = f"{ddp.bytes_per_step / p.bytes_per_step:.0f}x" if p.bytes_per_step else "-"
        both = p.bytes_per_step + p.bytes_received_per_step
        red_both = f"{2 * ddp.bytes_per_step / both:.0f}x" if both else "-"
        lines.append(f"| {name} | {codec or '-'} | {p.step_s:.3f} | {p.compute_utilization:.1%} | "
                     f"{human_bytes(p.bytes_per_step)} | {human_bytes(p.bytes_received_per_step)} | {red} | "
                     f"{red_both} | {p.goodput:.1%} |")
    return "\n".join(lines)


def flags_given(args: Any, keep: tuple[str, ...]) -> list[str]:
    """The flags of ``atoll project`` (:func:`add_arguments`) given in ``args`` (not None, or a store-true flag
    set), those named in ``keep`` left out: what a fixed table would leave unread."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    return [k for k, v in vars(defaults.parse_args([])).items() if k not in keep and getattr(args, k, v) != v]


#: the flags of ``atoll project`` that are settings of a strategy's own config (each read by those that own it)
CONFIG_FLAGS = ("sync_every", "fragments", "overlap_steps", "codec", "pull_codec")


def cli_config(args: Any, strategy: str) -> StrategyConfig:
    """The ``strategy``'s own config of ``atoll project``'s flags: those of :data:`CONFIG_FLAGS` its config has
    (``--codec`` unset: its own default codec; ddp keeps its fp32 baseline), its defaults for the others.

    Raises:
        ConfigError: a value its config refuses, or H below P for a strategy of fragments (one line naming the
            setting).
    """
    own = _spec(strategy).config
    given = {k: getattr(args, k) for k in CONFIG_FLAGS if k in own.model_fields and getattr(args, k) is not None}
    if strategy == "ddp":
        given.pop("codec", None)
    try:
        config = own(**given)
    except ValidationError as e:
        text = format_validation_error(e)
        if "atoll train --help" in text:  # a value out of its range: the fix is this command's flag
            text = f"{text.split('; ')[0]}; set --{text.split(':')[0].replace('_', '-')}"
        raise ConfigError(text) from None
    h, p = given.get("sync_every"), given.get("fragments")
    if h is not None and p is not None and h < p:  # (as atoll train refuses it: streaming's config, decoupled's checks)
        raise ConfigError(f"sync_every ({h}) must be at least fragments ({p}); raise --sync-every or lower --fragments")
    return config
