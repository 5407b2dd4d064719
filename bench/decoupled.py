"""Decoupled DiLoCo under failures and on islands of unequal speed, against synchronous DiLoCo.

    python bench/decoupled.py --jobs 2                       # tiny model, 600 inner steps per island
    python bench/decoupled.py --jobs 2 --model micro --fragments 2   # the measured run (about 20 minutes)
    python bench/decoupled.py --steps 20 --model micro --fragments 2 --out /tmp/dc   # a smoke run

Measured on the earlier default benchmark setting, the TrainConfig defaults before the nano regime (model
from ``--model``, default tiny; 4096-token vocabulary, batch 8 of 128 tokens per island, warmup 50, fp32
exchanges, outer Nesterov momentum 0.5 for decoupled and 0.9 for synchronous diloco; stdlib corpus), now
pinned in every run (:data:`EARLIER_SETTING`) so the committed results reproduce; the current default setting
is measured by ``python bench/fidelity.py``.

(a) Failures: 8 islands, local runtime, simulated step time ``--sim-step-s`` (0.1 s), H = 25, 4 fragments.
    One seeded failure trace (:func:`atoll.analysis.chaos.standard_chaos`: DOWN = 1/20 of the failure-free compute
    time and MTBF = 9 DOWN: every island down about 10% of the time; the realized fraction is reported).
    An island that fails loses the work it has not pushed, about H/2 inner steps, so H is kept well below
    the MTBF (270 steps at 600 steps per island): at H = 50 that loss alone costs about 4 points of goodput. Runs:
    decoupled without and with the trace, and synchronous diloco without failures. Synchronous diloco *under* the trace
    is not trained: its wall time follows from the trace on the same simulated clock
    (:func:`atoll.analysis.chaos.synchronous_under_failures`: every failure stops every island until the island is back,
    and the round in progress is redone; checkpoints at every outer step, the most favourable case for it; step time
    ``sim_step_s``, one all-reduce of the fp32 model per round at the same link), and its loss is that of the
    failure-free run, since redoing rounds does not change the weights. Reported: goodput of both, and decoupled's eval
    loss with failures against without, at the same tokens processed.
(b) Heterogeneous speeds 1,1,0.5,0.25 (4 islands): every island's compute utilization, and the eval loss
    at equal total tokens against a homogeneous decoupled run (speeds 1,1,1,1), with synchronous diloco's
    utilization of each island under the same speeds beside it (computed on the simulated clock: every
    round waits for the slowest island).

Writes bench/out/decoupled/results.json and results.md (``--out``: elsewhere), one atoll run folder per trained
run; a finished run is reused (:func:`atoll.benchmarks.common.train_once`), ``--fresh`` reruns all.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from atoll.analysis.chaos import FailureTrace, standard_chaos, synchronous_under_failures
from atoll.benchmarks.common import (
    add_common_arguments,
    default_out,
    pct,
    script_error,
    study_settings,
    train_once,
    write_results,
)
from atoll.errors import AtollError
from atoll.runtime.network import Link

SPEEDS = [1.0, 1.0, 0.5, 0.25]  # (b): relative speeds of the 4 islands

#: The defaults before the nano regime (TrainConfig up to commit 568f3bb) that differ from today's, which the
#: committed results were measured on: bench/decoupled.toml's [earlier] (why each, there).
EARLIER_SETTING: dict[str, Any] = study_settings(__file__, "earlier")
#: what synchronous diloco's runs add to :data:`EARLIER_SETTING`: its outer momentum then ([earlier_diloco])
EARLIER_DILOCO: dict[str, Any] = study_settings(__file__, "earlier_diloco")
#: what decoupled's runs add: the syncer's merge before the paper's rules became the defaults ([earlier_decoupled])
EARLIER_DECOUPLED: dict[str, Any] = study_settings(__file__, "earlier_decoupled")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, "decoupled", steps_help="inner steps per island (budget)")
    parser.add_argument("--model", default="tiny", help="model preset [tiny]")
    parser.add_argument("--sim-step-s", type=float, default=0.1, help="simulated seconds per inner step [0.1]")
    parser.add_argument("--sync-every", type=int, default=25, help="H [25; capped at steps // 2]")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, one core each [1]")
    parser.add_argument("--train-sync", action="store_true",
                        help="also train synchronous diloco on 8 islands, for its eval loss (its clock needs no run)")
    parser.add_argument("--fragments", type=int, default=4, help="decoupled fragments [4; micro has 2 layers: 2]")
    return parser.parse_args(argv)


def shared_settings(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    """H, the settings every run shares (its own, from the flags ``args``) and the failure trace's spec."""
    h = max(4, min(args.sync_every, args.steps // 2))
    common = {"steps": args.steps, "model": args.model, "sync_every": h, "sim_step_s": args.sim_step_s,
              "eval_every": max(1, args.steps // 6), "checkpoint_every": 0}
    chaos = standard_chaos(args.steps * args.sim_step_s)  # down 1/20 of the run, MTBF 9x that
    return h, common, chaos


def pinned(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's settings over :data:`EARLIER_SETTING` (and :data:`EARLIER_DILOCO` for diloco): what it trains with.

    A decoupled run's quorum is pinned to the earlier default, half the islands rounded up (now: every island),
    and its merge to the earlier one (:data:`EARLIER_DECOUPLED`).
    """
    earlier = {**EARLIER_SETTING, **(EARLIER_DILOCO if settings.get("strategy") == "diloco" else {})}
    if settings.get("strategy", "decoupled") == "decoupled":
        earlier.update(EARLIER_DECOUPLED)
        if "quorum" not in settings:
            earlier["quorum"] = -(-int(settings.get("islands", 4)) // 2)
    return {**earlier, **settings}


def planned_runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(name, own settings) of every run the flags ``args`` train, largest first (so that ``--jobs 2``
    balances the cores), to train with :func:`pinned`; no training."""
    _, common, chaos = shared_settings(args)
    dc = {"strategy": "decoupled", "fragments": args.fragments, **common}
    return [
        ("a_decoupled_free", dict(islands=8, **dc)),
        ("a_decoupled_chaos", dict(islands=8, chaos=chaos, **dc)),
        *([("a_diloco_free", dict(strategy="diloco", islands=8, **common))] if args.train_sync else []),
        ("b_decoupled_homogeneous", dict(islands=4, **dc)),
        ("b_decoupled_speeds", dict(islands=4, island_speeds=list(SPEEDS), **dc)),
    ]


def sync_accounting(r: dict[str, Any], speeds: list[float], trace: FailureTrace | None, sim_step_s: float,
                    sync_every: int) -> dict[str, Any]:
    """Synchronous diloco on the simulated clock of run ``r``'s settings (see the module docstring)."""
    link = Link.from_config(r["link_bandwidth_mbps"], r["link_latency_ms"])
    sync_s = link.allreduce_seconds(4 * r["params"], len(speeds))
    tokens_per_step = r["tokens"] // (r["islands"] * r["steps"])
    return synchronous_under_failures(trace, r["steps"], sync_every, [sim_step_s / s for s in speeds], sync_s,
                                      tokens_per_step)


def _train(job: tuple[Path, str, bool, dict[str, Any]]) -> dict[str, Any]:
    suite, name, fresh, settings = job
    return train_once(suite, name, fresh, **settings)


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/decoupled.py [--jobs N] [--model M] [--fragments P] [--steps N] [--out DIR] ...``; the exit
    status (2: bad input)."""
    args = parse_args(argv)
    try:
        benchmark(args, list(sys.argv[1:] if argv is None else argv))
    except AtollError as e:
        return script_error("decoupled", e)
    return 0


def benchmark(args: argparse.Namespace, argv: list[str]) -> None:
    """Train (or reuse) every run, write results.json and results.md, print the table; ``argv`` for its
    command line."""
    suite = args.out or default_out("decoupled")
    h, common, chaos = shared_settings(args)
    results: dict[str, Any] = {"settings": {**common, "chaos": chaos, "seed": 0}}

    speeds = SPEEDS
    specs = {name: pinned(own) for name, own in planned_runs(args)}  # largest first: --jobs 2 balances the cores
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            done = dict(zip(specs, pool.map(_train, [(suite, n, args.fresh, s) for n, s in specs.items()]),
                            strict=True))
    else:
        done = {n: train_once(suite, n, args.fresh, **s) for n, s in specs.items()}

    # (a) failures, 8 islands
    free, hit, sync = done["a_decoupled_free"], done["a_decoupled_chaos"], done.get("a_diloco_free")
    trace = FailureTrace.from_spec(chaos, 8, 0)
    # the synchronous clock needs only the model size, the link and the tokens: the same as decoupled's
    sync_free = sync_accounting(free, [1.0] * 8, None, args.sim_step_s, h)
    sync_hit = sync_accounting(free, [1.0] * 8, trace, args.sim_step_s, h)
    down = [sum(min(u, hit["sim_wall_s"]) - d for d, u in trace.until(i, hit["sim_wall_s"])) / hit["sim_wall_s"]
            for i in range(8)]
    results.update(a_decoupled_free=free, a_decoupled_chaos=hit, a_diloco_free=sync,
                   a_diloco_sync_free_clock=sync_free, a_diloco_sync_chaos_clock=sync_hit,
                   a_realized_down_fraction=down)

    # (b) heterogeneous speeds, 4 islands
    homo, het = done["b_decoupled_homogeneous"], done["b_decoupled_speeds"]
    sync_het = sync_accounting(homo, speeds, None, args.sim_step_s, h)
    results.update(b_decoupled_homogeneous=homo, b_decoupled_speeds=het, b_diloco_speeds_clock=sync_het)

    def util(u: list[float]) -> str:
        return " / ".join(f"{x:.0%}" for x in u)

    def row(name: str, r: dict[str, Any] | None, ref: float | None, acct: dict[str, Any] | None = None,
            **extra: Any) -> dict[str, Any]:
        loss = r["final_eval_loss"] if r else None
        return {"run": name, "goodput": (acct or r or {}).get("goodput"),
                "utilization": util((acct or r or {}).get("island_utilization", [])),
                "sim_wall_s": (acct or {}).get("wall_s", (r or {}).get("sim_wall_s")),
                "eval_loss": loss, "vs_ref": pct(loss, ref) if loss is not None and ref else None,
                "useful_tokens": (r or {}).get("useful_tokens"), "rejected": (r or {}).get("rejected_updates"),
                "staleness": (r or {}).get("staleness_mean"), "quorum": (r or {}).get("quorum_size_mean"),
                "failures": sum(r["failures"]) if r and "failures" in r else None,
                "rejoin_s": (sum(r["rejoin_s"]) / len(r["rejoin_s"]) if r and r.get("rejoin_s") else None), **extra}

    ref_a, ref_b = free["final_eval_loss"], homo["final_eval_loss"]
    rows = [
        row("(a) decoupled, no failures", free, ref_a),
        row(f"(a) decoupled, chaos {chaos}", hit, ref_a),
        row("(a) diloco, no failures" + (" (trained)" if sync else " (clock)"), sync, ref_a, sync_free),
        row(f"(a) diloco, chaos {chaos} (clock from the trace)"
            + (f", gave up after {sync_hit['steps_done']} steps" if sync_hit["gave_up"] else ""), None, None, sync_hit,
            eval_loss=sync["final_eval_loss"] if sync else None),
        row("(b) decoupled, speeds 1,1,1,1", homo, ref_b),
        row("(b) decoupled, speeds 1,1,0.5,0.25", het, ref_b),
        row("(b) diloco, speeds 1,1,0.5,0.25 (clock)", None, None, sync_het),
    ]
    columns = [("run", "run"), ("goodput", "goodput"), ("utilization per island", "utilization"),
               ("sim wall s", "sim_wall_s"), ("eval loss", "eval_loss"), ("vs failure-free / homogeneous %", "vs_ref"),
               ("useful tokens", "useful_tokens"), ("rejected", "rejected"), ("mean staleness", "staleness"),
               ("mean quorum", "quorum"), ("failures", "failures"), ("mean rejoin s", "rejoin_s")]
    checks = {  # the marks, computed from the runs above
        "failures_goodput": hit["goodput"], "failures_goodput_at_least_85pct": hit["goodput"] >= 0.85,
        "failures_goodput_vs_sync": hit["goodput"] / sync_hit["goodput"] if sync_hit["goodput"] else None,
        "failures_goodput_at_least_2x_sync": hit["goodput"] >= 2 * sync_hit["goodput"],
        "failures_loss_gap_pct": pct(hit["final_eval_loss"], ref_a),
        "failures_loss_within_3pct": abs(pct(hit["final_eval_loss"], ref_a)) <= 3.0,
        "failures_loss_at_most_3pct_worse": pct(hit["final_eval_loss"], ref_a) <= 3.0,
        "speeds_min_utilization": min(het["island_utilization"]),
        "speeds_every_island_at_least_90pct": min(het["island_utilization"]) >= 0.9,
        "speeds_loss_gap_pct": pct(het["final_eval_loss"], ref_b),
        "speeds_loss_within_3pct": abs(pct(het["final_eval_loss"], ref_b)) <= 3.0,
        "speeds_loss_at_most_3pct_worse": pct(het["final_eval_loss"], ref_b) <= 3.0,
        "sync_speeds_utilization": sync_het["island_utilization"],
    }
    results["checks"] = checks
    notes = [f"model {args.model}, {args.steps} inner steps per island (a budget shared by speed in decoupled), "
             f"H={h}, decoupled with {args.fragments} fragments, simulated step {args.sim_step_s} s, seed 0.",
             "realized down fraction per island of the chaos run: "
             + " / ".join(f"{x:.1%}" for x in down) + f" (mean {sum(down) / len(down):.1%}).",
             "goodput: useful (merged) tokens per simulated second over the failure-free compute rate "
             "(every island computing all the time); see atoll/strategies/decoupled.py.",
             "diloco rows marked 'clock' are computed from the trace and the step-time model "
             "(atoll.analysis.chaos.synchronous_under_failures), not trained; its weights are those of the "
             "failure-free run.",
             "command: python bench/decoupled.py " + " ".join(a for a in argv if a != "--fresh"),
             "checks: " + ", ".join(f"{k} = {v:.3g}" if isinstance(v, float) else f"{k} = {v}"
                                    for k, v in checks.items() if not isinstance(v, list))]
    print(write_results(suite, results, columns, rows, "Decoupled DiLoCo: failures and heterogeneous speeds", notes))



if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
