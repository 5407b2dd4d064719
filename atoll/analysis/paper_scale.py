"""Where ``decoupled`` lands at its paper's scale: a 12B model, 4 regions joined by 2 and 5 Gbit/s.

    atoll project --paper-scale                               # the measured link shares and syncer CPU
    atoll project --paper-scale --push-share 1 --pull-share 1  # an ideal link

Decoupled DiLoCo (arXiv:2604.21428) reports its 12B model over 2-5 Gbit/s between 4 US regions as more than 20x
faster than conventional synchronization. This prices atoll's own wire at that scale, per outer round (every
fragment pushed and pulled once, each every H inner steps), with what atoll measured of its service:

- the share of the link rate a transfer reaches (:data:`MEASURED`: one island's push and pull of 125m-sized
  fragments over an emulated 1 Gbit/s link with 35 ms each way, TLS, ``bench/out/service_link``). The push
  share is fp32 pushes', whatever the push codec: a 125m fragment's int4 push (16 MB) reaches less of the link
  (same table) because the round trips and the commit that each fragment costs do not shrink with its payload,
  and at 12B a fragment's int4 payload is about 100 times larger, so those fixed costs are a small part of it
  as they are of a 125m fp32 push; the syncer's decode of the pushed blocks at the commit is counted in the
  merge cores below, not in the link's time;
- the syncer's CPU seconds per GB it receives and sends (4 islands pushing at once over loopback with TLS, the
  same table), from which the cores a shard needs;
- the pull codec (``--pull-codec``: float32, or bf16/int8/int4 changes; one change per pull, the steady state of
  an island that keeps up).

Per island and outer round, with N parameters, b and c bits per parameter pushed and pulled, B the link's rate
each way (full duplex), e_push and e_pull the shares reached::

    push_s = N*b / (B*e_push);   pull_s = N*c / (B*e_pull);   both_ways_s = push_s + pull_s
    hide_step_s = max(push_s, pull_s) / H      (below this inner-step time the exchange cannot hide behind compute)
    step_s = max(t_c, hide_step_s)             (the island never waits otherwise: fragments stream behind compute)
    transfer cores per shard = K * (N*b/8 * in_s_per_byte + N*c/8 * out_s_per_byte) / (H * step_s) / shards
    merge cores per shard = N * (merge_ns * K/2 + pull_encode_ns) * 1e-9 / (H * step_s) / shards

and the ratio of ddp's and synchronous diloco's step time (:func:`~atoll.analysis.projection.project`, on the
ideal link: their collectives are not atoll's gRPC transfers, and charging them atoll's measured share would
inflate the ratio) to decoupled's. The transfer's CPU per GB was measured on fp32 pushes with nothing merged;
the merge's own work comes from bench/out/outer_round (one window of the syncer with K = 2 islands' int4
pushes: decode, merge, outer step, per parameter; scaled by K/2, the decode being the part that grows with K)
and a quantized pull's one encode per commit from bench/out/codec_speed (4 bytes per parameter at its encode
GB/s). Each fragment is taken as merged once per outer round (all islands in one merge); split merges cost
more. No torch; a pure function of its inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from atoll.analysis.cost import CODEC_BITS, Setting, codec_bits
from atoll.analysis.projection import SCALES, TABLE_SETTINGS, ModelScale, check_pull_codec, flags_given, project
from atoll.errors import ConfigError
from atoll.strategies.registry import spec


@dataclass(frozen=True)
class Measured:
    """What atoll measured of its service's wire, the inputs of :func:`paper_scale_rows`.

    Attributes:
        push_share: a push's payload rate over the link rate (0..1].
        pull_share: a pull's, likewise.
        syncer_in_s_per_gb: the syncer's CPU seconds per 10^9 bytes it receives (pushes).
        syncer_out_s_per_gb: its CPU seconds per 10^9 bytes it sends (pulls).
        source: where the figures come from.
        merge_ns_per_param: CPU ns per parameter of one merge window of K = 2 islands' int4 pushes.
        pull_encode_ns_per_param: per pull codec, CPU ns per parameter of encoding one change (fp32: none).
    """

    push_share: float
    pull_share: float
    syncer_in_s_per_gb: float
    syncer_out_s_per_gb: float
    source: str
    merge_ns_per_param: float = 33.4
    pull_encode_ns_per_param: tuple[tuple[str, float], ...] = (("fp32", 0.0), ("bf16", 4 / 0.360),
                                                               ("int8", 4 / 0.490), ("int4", 4 / 0.435))


#: bench/out/service_link (2026-12-06): TLS, 8 MiB windows, one fragment at a time, MTU 9000 (push 0.735, the
#: mean of the three rows with the commit riding on the upload, 0.716-0.758; pull 0.841 of 1 Gbit/s at 70 ms
#: RTT); the syncer's CPU with 4 islands pushing at once (2.559 s/GB in, 0.931 out);
#: the merge window 33.4 ns per parameter (bench/out/outer_round_36, decoupled at 58.7M, one thread) and the
#: encode GB/s of bench/out/codec_speed (bf16 0.360, int8 0.490, int4 0.435 GB/s of float32 input)
MEASURED = Measured(0.735, 0.841, 2.559, 0.931, "bench/out/service_link: 1 Gbit/s, 70 ms RTT, TLS, one fragment "
                    "at a time; syncer CPU of 4 islands at once over loopback")

#: the least share of the link rate the table takes (below, the times overflow to nothing a table can say)
MIN_SHARE = 0.01

#: the paper's links: (label, Mbit/s each way, one-way latency ms)
PAPER_LINKS = (("2 Gbit/s", 2000.0, 35.0), ("5 Gbit/s", 5000.0, 35.0))


def add_arguments(parser: Any) -> None:
    """``atoll project --paper-scale``'s link shares, ``--push-share`` and ``--pull-share``, defaulting to
    :data:`MEASURED`'s (the flags of the projection itself: :func:`atoll.analysis.projection.add_arguments`)."""
    parser.add_argument("--push-share", type=float, default=None, help="--paper-scale: the share of the link rate a "
                        f"push reaches, (0, 1] [default: measured, {MEASURED.push_share}]")
    parser.add_argument("--pull-share", type=float, default=None, help="--paper-scale: a pull's share, (0, 1] "
                        f"[default: measured, {MEASURED.pull_share}]")


def paper_scale_rows(measured: Measured = MEASURED, pull_codecs: tuple[str, ...] = ("fp32", "int8", "int4"),
                     scale: ModelScale = SCALES[1], islands: int = 4,
                     links: tuple[tuple[str, float, float], ...] = PAPER_LINKS) -> list[dict[str, Any]]:
    """One row per (link, pull codec): decoupled with :data:`~atoll.analysis.projection.TABLE_SETTINGS`' H, P
    and push codec, ``scale`` (default 12B: 2M tokens per step on 64 H100s, t_c about 6 s), ``islands``
    regions, one syncer shard per fragment. Figures as the module docstring defines them (seconds, bits per
    parameter, cores).

    Raises:
        ValueError: a share outside (0, 1], a negative CPU figure, or a codec without fixed bits.
    """
    if not (MIN_SHARE <= measured.push_share <= 1 and MIN_SHARE <= measured.pull_share <= 1):
        raise ValueError(f"link shares must be in [{MIN_SHARE}, 1], got push {measured.push_share}, pull "
                         f"{measured.pull_share}")
    if measured.syncer_in_s_per_gb < 0 or measured.syncer_out_s_per_gb < 0:
        raise ValueError("syncer CPU seconds per GB must not be negative")
    own = TABLE_SETTINGS["decoupled"]
    h, shards, b = own["sync_every"], own["fragments"], codec_bits(own["codec"])
    n, t_c = scale.params, scale.step_compute_s
    rows = []
    for label, mbps, latency_ms in links:
        rate = mbps * 1e6
        # ddp and synchronous diloco over the same link at its full rate (their collectives, not atoll's gRPC)
        sync = Setting(params=n, step_compute_s=t_c, islands=islands, bandwidth_mbps=mbps,
                       latency_ms=latency_ms, tokens_per_step=scale.tokens_per_step)
        ddp_s = project(sync, "ddp").step_s
        diloco_s = project(sync, "diloco", spec("diloco").config(**TABLE_SETTINGS["diloco"])).step_s
        for pull_codec in pull_codecs:
            c = codec_bits(pull_codec)
            push_s = n * b / (rate * measured.push_share)
            pull_s = n * c / (rate * measured.pull_share)
            hide = max(push_s, pull_s) / h
            step_s = max(t_c, hide)
            per_round_bytes_in, per_round_bytes_out = n * b / 8, n * c / 8
            transfer = islands * (per_round_bytes_in * measured.syncer_in_s_per_gb
                                  + per_round_bytes_out * measured.syncer_out_s_per_gb) / 1e9 / (h * step_s) / shards
            encode_ns = dict(measured.pull_encode_ns_per_param).get(pull_codec, 0.0)
            merge = n * (measured.merge_ns_per_param * islands / 2 + encode_ns) * 1e-9 / (h * step_s) / shards
            cores = transfer + merge
            rows.append({"model": scale.name, "link": label, "pull_codec": pull_codec, "push_bits": b,
                         "pull_bits": c, "push_s": push_s, "pull_s": pull_s, "both_ways_s": push_s + pull_s,
                         "hide_step_s": hide, "t_c": t_c, "step_s": step_s, "utilization": t_c / step_s,
                         "syncer_cores_per_shard": cores, "transfer_cores_per_shard": transfer,
                         "merge_cores_per_shard": merge, "speed_vs_ddp": ddp_s / step_s,
                         "speed_vs_diloco": diloco_s / step_s, "ddp_step_s": ddp_s, "diloco_step_s": diloco_s})
    return rows


def format_paper_scale(rows: list[dict[str, Any]], measured: Measured = MEASURED) -> str:
    """The rows as Markdown, the inputs and the paper's figure under them."""
    lines = ["| model | link | pull | bits/param per outer step, push / pull | outer round: push / pull / both "
             "ways s | hides below t_c of | t_c / step s | utilization | syncer cores per shard (transfers + merge) | "
             "speed vs ddp | "
             "speed vs sync diloco |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['link']} | {r['pull_codec']} | {r['push_bits']:g} / {r['pull_bits']:g} | "
                     f"{r['push_s']:.1f} / {r['pull_s']:.1f} / {r['both_ways_s']:.1f} | {r['hide_step_s']:.2f} s | "
                     f"{r['t_c']:.2f} / {r['step_s']:.2f} | {r['utilization']:.0%} | "
                     f"{r['syncer_cores_per_shard']:.2f} ({r['transfer_cores_per_shard']:.2f} + "
                     f"{r['merge_cores_per_shard']:.2f}) | {r['speed_vs_ddp']:.1f}x | {r['speed_vs_diloco']:.2f}x |")
    own = TABLE_SETTINGS["decoupled"]
    lines += ["", f"decoupled H={own['sync_every']}, P={own['fragments']} (one syncer shard each), {own['codec']} "
              f"pushes, 4 regions; link shares push {measured.push_share:.3f}, pull {measured.pull_share:.3f}; "
              f"syncer {measured.syncer_in_s_per_gb:g} CPU s/GB in, {measured.syncer_out_s_per_gb:g} out "
              f"({measured.source}); merge {measured.merge_ns_per_param:g} CPU ns per parameter per window of 2 "
              "islands, scaled by K/2, plus a quantized pull's encode, each fragment merged once per round. ddp and "
              "synchronous diloco (H=100, fp32) priced on the same links at their "
              "full rate. Published: Decoupled DiLoCo, >20x faster than conventional synchronization (12B, "
              "2-5 Gbit/s)."]
    return "\n".join(lines)


def run_cli(args: Any) -> str:
    """What ``atoll project --paper-scale`` prints: :func:`format_paper_scale` of :data:`MEASURED`, its shares
    replaced by ``--push-share`` / ``--pull-share``, one ``--pull-codec`` or fp32, int8 and int4.

    Raises:
        ConfigError: a share outside (0, 1], an unknown pull codec, or another flag beside it (one line).
    """
    if given := flags_given(args, keep=("paper_scale", "push_share", "pull_share", "pull_codec")):
        raise ConfigError(f"{given[0]}: --paper-scale prints a fixed table of its own settings (12B, 4 regions, "
                          f"decoupled H=100 P=4 int4); drop --{given[0].replace('_', '-')} or --paper-scale")
    shares = {}
    for name in ("push_share", "pull_share"):
        value = getattr(args, name)
        if value is not None and not (MIN_SHARE <= value <= 1 and math.isfinite(value)):
            raise ConfigError(f"{name}: a share of the link rate in [{MIN_SHARE}, 1], got {value!r}; set "
                              f"--{name.replace('_', '-')}")
        shares[name] = getattr(MEASURED, name) if value is None else float(value)
    check_pull_codec(args.pull_codec)
    measured = Measured(shares["push_share"], shares["pull_share"], MEASURED.syncer_in_s_per_gb,
                        MEASURED.syncer_out_s_per_gb, MEASURED.source if shares == {
                            "push_share": MEASURED.push_share, "pull_share": MEASURED.pull_share}
                        else "shares given; " + MEASURED.source.split("; ")[-1])
    codecs = (args.pull_codec,) if args.pull_codec is not None else ("fp32", "int8", "int4")
    assert all(c in CODEC_BITS for c in codecs)
    return format_paper_scale(paper_scale_rows(measured, codecs), measured)
