"""Streaming DiLoCo and the codec layer at equal tokens (issue: streaming and codecs).

    python bench/streaming_codecs.py --steps 300 --table-steps 300   # about 30 minutes on 2 CPU cores

Measured on the earlier default benchmark setting, the TrainConfig defaults before the nano regime (tiny
Llama, 4096-token vocabulary, batch 8 of 128 tokens per island, warmup 50, outer Nesterov momentum 0.9, an
evaluation every 100 steps; stdlib corpus, 4 islands), now pinned in every run (:data:`EARLIER_SETTING`) so
the committed results reproduce; the current default setting is measured by ``python bench/fidelity.py``.
Every run at H = 50 on a simulated 10 Mbit/s link (the consumer upload of the DisTrO report; the link changes
only the simulated clock, never the training maths):
1. a table of every codec on ``diloco``: eval loss, bytes per island, reduction against what ddp would
   send for the same steps (``--table-steps``, default half of ``--steps``);
2. ``streaming`` with 4 fragments, int4, overlap tau = 5 inner steps, mixing alpha = 0.5, against
   ``diloco`` fp32 and int4 without overlap at the same steps (``--steps``). When the table runs at
   ``--steps`` too, its fp32 and int4 rows are those references; otherwise ``diloco`` int4 is run and
   ``diloco`` fp32 is bench/diloco_vs_ddp's H=50 run, its simulated wall time moved from 100 to 10 Mbit/s
   exactly (its collectives block, so the clock is compute plus the sum of the transfers; ``wall_at``).
The ddp reference (same tokens) is bench/diloco_vs_ddp's ``ddp`` run, run here if missing.
Writes bench/out/streaming_codecs/results.json and results.md (``--out``: elsewhere), one atoll run folder
per run; a finished run is reused (:func:`atoll.benchmarks.common.train_once`), ``--fresh`` reruns all.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # ``python bench/streaming_codecs.py``: the repository root on the path, for bench.<study>
    sys.path.append(_REPO)

from atoll.algorithms.codecs import make_codec
from atoll.benchmarks.common import (
    default_out,
    parse_args,
    pct,
    script_error,
    study_settings,
    train_once,
    write_results,
)
from atoll.errors import AtollError
from bench import diloco_vs_ddp

CODECS = ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int8", "int4", "topk")

#: The defaults before the nano regime (TrainConfig up to commit 568f3bb) that differ from today's, which the
#: committed results were measured on: bench/streaming_codecs.toml's [earlier] (why each, there).
EARLIER_SETTING: dict[str, Any] = study_settings(__file__, "earlier")


def pinned(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's settings over :data:`EARLIER_SETTING`: what it trains with."""
    return {**EARLIER_SETTING, **settings}


def planned_runs(steps: int, table_steps: int) -> list[tuple[str, dict[str, Any]]]:
    """(name, own settings) of every run of this benchmark's folder, in training order (to train with
    :func:`pinned`); no training. At ``table_steps`` below ``steps``, diloco fp32 at ``steps`` is
    bench/diloco_vs_ddp's H=50 run (:func:`bench.diloco_vs_ddp.reference`)."""
    s = {"sync_every": 50, "link_bandwidth_mbps": 10.0}
    runs = [(f"codec_{codec}_{table_steps}", {"strategy": "diloco", "codec": codec, "steps": table_steps,
                                              **({"error_feedback": True} if codec == "topk" else {}), **s})
            for codec in CODECS]
    runs.append(("streaming_int4", {"strategy": "streaming", "codec": "int4", "fragments": 4, "overlap_steps": 5,
                                    "mixing_alpha": 0.5, "steps": steps, **s}))
    if table_steps != steps:
        runs.append(("diloco_int4", {"strategy": "diloco", "codec": "int4", "steps": steps, **s}))
    return runs


def wall_at(summary: dict, bandwidth_mbps: float) -> float:
    """Simulated wall time of a run whose collectives all block (diloco, ddp) at another link bandwidth.

    Each blocking ring all-reduce adds ``2(K-1)/K * B * 8 / bandwidth + 2(K-1) * latency`` after the
    slowest island's compute, so only the bandwidth term changes: bytes per island * 8 * (1/new - 1/old).
    """
    bits = summary["bytes_sent_per_island"] * 8
    return summary["sim_wall_s"] + bits / (bandwidth_mbps * 1e6) - bits / (summary["link_bandwidth_mbps"] * 1e6)


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/streaming_codecs.py [--steps N] [--table-steps N] [--out DIR] [--fresh]``; the exit
    status (2: bad input)."""
    args = parse_args(__doc__.splitlines()[0], "streaming_codecs", argv, table_steps=True)
    try:
        benchmark(args)
    except AtollError as e:
        return script_error("streaming_codecs", e)
    return 0


def benchmark(args: argparse.Namespace) -> None:
    """Train (or reuse) every run, write results.json and results.md, print the table."""
    suite = args.out or default_out("streaming_codecs")
    steps, table_steps = args.steps, args.table_steps or args.steps // 2
    runs: dict[str, dict] = {name: train_once(suite, name, args.fresh, **pinned(own))
                             for name, own in planned_runs(steps, table_steps)}
    if table_steps == steps:
        fp32, int4 = runs[f"codec_fp32_{steps}"], runs[f"codec_int4_{steps}"]
    else:
        int4 = runs["diloco_int4"]
        # bench/diloco_vs_ddp's H=50 run (100 Mbit/s), its clock moved to 10 Mbit/s (see wall_at)
        ref = default_out("diloco_vs_ddp")
        name = "default_cli" if (ref / "default_cli" / "summary.json").exists() else "diloco_H50"
        fp32 = dict(train_once(ref, name, False, **diloco_vs_ddp.reference(name, steps)))
        fp32["sim_wall_s"] = wall_at(fp32, 10.0)
        fp32["compute_utilization"] = fp32["compute_s"] / fp32["sim_wall_s"]
        fp32["link_bandwidth_mbps"] = 10.0
        runs["diloco_fp32"] = fp32

    rows = []
    for name, r in runs.items():
        base = fp32 if r["steps"] == steps else runs[f"codec_fp32_{table_steps}"]
        rows.append({
            "run": name, "steps": r["steps"], "strategy": r["strategy"], "codec": r["codec"],
            "fragments": r["fragments"], "overlap": r["overlap_steps"], "final_eval_loss": r["final_eval_loss"],
            "gap_vs_diloco_fp32_pct": pct(r["final_eval_loss"], base["final_eval_loss"]),
            "bytes_sent_per_island": r["bytes_sent_per_island"],
            "reduction_vs_ddp": r["ddp_bytes_per_island"] / r["bytes_sent_per_island"],
            "peak_bytes_per_exchange": r["peak_bytes_per_exchange"],
            "compute_utilization": r["compute_utilization"], "sim_wall_s": r["sim_wall_s"],
        })
    st = runs["streaming_int4"]
    # the best any split into P fragments can do: P equal fragments, each with its own partial last scale block
    int4_codec, p = make_codec("int4"), st["fragments"]
    ideal_peak_ratio = int4_codec.payload_bytes(st["params"]) / int4_codec.payload_bytes(-(-st["params"] // p))
    checks = {
        "streaming_int4_gap_vs_diloco_fp32_pct": pct(st["final_eval_loss"], fp32["final_eval_loss"]),
        "streaming_int4_reduction_vs_ddp": st["ddp_bytes_per_island"] / st["bytes_sent_per_island"],
        "peak_ratio_diloco_int4_over_streaming_int4": int4["peak_bytes_per_exchange"] / st["peak_bytes_per_exchange"],
        "peak_ratio_of_equal_fragments": ideal_peak_ratio,
        "streaming_int4_utilization_10mbps": st["compute_utilization"],
        "diloco_fp32_utilization_10mbps": fp32["compute_utilization"],
    }
    table = write_results(
        suite, {"runs": runs, "rows": rows, "checks": checks},
        [("run", "run"), ("steps", "steps"), ("codec", "codec"), ("P", "fragments"), ("tau", "overlap"),
         ("eval loss", "final_eval_loss"), ("gap vs diloco fp32 %", "gap_vs_diloco_fp32_pct"),
         ("bytes/island", "bytes_sent_per_island"), ("reduction vs ddp", "reduction_vs_ddp"),
         ("peak bytes/exchange", "peak_bytes_per_exchange"), ("utilization @10Mb/s", "compute_utilization"),
         ("sim wall s", "sim_wall_s")],
        rows, "streaming and codecs: tiny model, 4 islands, H=50, 10 Mbit/s link",
        notes=[f"checks: {checks}", "reduction vs ddp: against what ddp sends for the same steps (fp32 gradient "
               "every step)", "topk keeps 1% of entries with error feedback",
               "peak ratio: P equal fragments reach P less a hair, as each fragment's last int4 scale block is "
               "partial (peak_ratio_of_equal_fragments gives that bound for this model)",
               f"command: python bench/streaming_codecs.py --steps {steps} --table-steps {table_steps}"],
    )
    print(table)



if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
