"""Decoupled DiLoCo's merge as the paper describes it, setting by setting, against atoll's syncer of today.

    nohup env OMP_NUM_THREADS=1 python bench/decoupled_merge.py --jobs 2 &          # the default benchmark
    python bench/decoupled_merge.py --model micro --fragments 2 --out bench/out/decoupled_merge_micro --jobs 2
    python bench/decoupled_merge.py --steps 20 --model micro --fragments 2 --out /tmp/dm   # a smoke run

The paper's syncer (arXiv:2604.21428, as third-party readings describe it) merges at a minimum quorum K = 1
with an adaptive grace window bounded by the slack the compute overlap leaves, weighs a push by tokens x
(tokens / steps), and averages non-embedding tensors radial-directionally. Each is a setting of the decoupled
strategy (``--grace-window slack``, ``--push-weight tokens_x_tokens_per_step``, ``--merge-average
radial_directional``); the variants and the settings of today they are compared with are the tables of
bench/decoupled_merge.toml (every run takes ``[today]``, then its variant's table).

Every variant trains twice on the default benchmark (the TrainConfig defaults: the nano model, 4 islands, the
default steps, H and fragments, the local runtime's simulated clock): at equal speeds and at speeds
1,1,0.5,0.25; ``--chaos`` adds a run under the standard failure trace at equal speeds
(:func:`atoll.analysis.chaos.standard_chaos`), where the grace window matters most. The primary figure is the
final held-out loss at equal tokens; the speeds run should stay within 2% of the equal-speed one.

Writes results.json and results.md into ``--out`` (default bench/out/decoupled_merge), one atoll run folder per
run (a finished run is reused: :func:`atoll.benchmarks.common.train_once`; ``--fresh`` trains all again), with
the machine's load (``os.getloadavg``) before and after and the command.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from atoll.analysis.chaos import standard_chaos
from atoll.benchmarks.common import default_out, pct, script_error, train_once, write_results
from atoll.errors import AtollError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SPEEDS = [1.0, 1.0, 0.5, 0.25]
#: every table of bench/decoupled_merge.toml: the variants, "today" first
VARIANTS: dict[str, dict[str, Any]] = tomllib.loads(Path(__file__).with_suffix(".toml").read_text(encoding="utf-8"))
TODAY = VARIANTS["today"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated tables of bench/decoupled_merge.toml [{','.join(VARIANTS)}]")
    parser.add_argument("--model", default=None, help="model preset [the default: nano]")
    parser.add_argument("--fragments", type=int, default=None, help="fragments [the default: 4; micro: 2]")
    parser.add_argument("--steps", type=int, default=None, help="inner steps per island [the default]")
    parser.add_argument("--seed", type=int, default=None, help="seed of every run [the default: 0]")
    parser.add_argument("--conditions", default="equal,speeds",
                        help="comma-separated conditions: equal, speeds (1,1,0.5,0.25) [equal,speeds]")
    parser.add_argument("--chaos", action="store_true", help="also train each variant under the standard failure "
                        "trace, at equal speeds")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, one core each [1]")
    parser.add_argument("--fresh", action="store_true", help="train every run again")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/decoupled_merge]")
    return parser.parse_args(argv)


def shared_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of every run from the flags: only those given (the rest are today's defaults)."""
    given = {"model": args.model, "fragments": args.fragments, "steps": args.steps, "seed": args.seed}
    return {"checkpoint_every": 0, **{k: v for k, v in given.items() if v is not None}}


def planned_runs(args: argparse.Namespace) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(run name, variant, condition, settings) of every run the flags ask for, conditions ``equal``,
    ``speeds`` and (``--chaos``) ``chaos``; no training.

    Raises:
        AtollError: a variant that is no table of bench/decoupled_merge.toml (a ConfigError, exit status 2).
    """
    from atoll.errors import ConfigError

    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ConfigError(f"variants: {', '.join(unknown) or 'none'} not in bench/decoupled_merge.toml; pass some "
                          f"of {', '.join(VARIANTS)}")
    shared = shared_settings(args)
    wanted = [c for c in args.conditions.split(",") if c]
    if not wanted or any(c not in ("equal", "speeds") for c in wanted):
        raise ConfigError(f"conditions: '{args.conditions}' is not a list of equal, speeds; pass --conditions "
                          "equal,speeds or one of them")
    conditions = {**({"equal": {}} if "equal" in wanted else {}),
                  **({"speeds": {"island_speeds": list(SPEEDS)}} if "speeds" in wanted else {}),
                  **({"chaos": {"chaos": chaos_spec(args)}} if args.chaos else {})}
    return [(f"{variant}_{cond}", variant, cond, {**TODAY, **VARIANTS[variant], **shared, **extra})
            for variant in names for cond, extra in conditions.items()]


def chaos_spec(args: argparse.Namespace) -> str:
    """The standard failure trace of the runs' failure-free simulated time (steps x the default step)."""
    from atoll.config.sections import RunSection
    from atoll.strategies.decoupled import DecoupledConfig

    steps = args.steps if args.steps is not None else RunSection.model_fields["steps"].default
    return standard_chaos(steps * DecoupledConfig.model_fields["sim_step_s"].default)


def _train(job: tuple[Path, str, bool, dict[str, Any]]) -> tuple[str, dict[str, Any], float]:
    suite, name, fresh, settings = job
    t0 = time.monotonic()
    summary = train_once(suite, name, fresh, tag="decoupled_merge", **settings)
    return name, summary, time.monotonic() - t0


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/decoupled_merge.py [--variants A,B] [--model M] [--jobs N] [--chaos] ...``; the exit
    status (2: bad input)."""
    args = parse_args(argv)
    try:
        study(args, list(sys.argv[1:] if argv is None else argv))
    except AtollError as e:
        return script_error("decoupled_merge", e)
    return 0


def study(args: argparse.Namespace, argv: list[str]) -> None:
    """Train (or reuse) every run, write results.json and results.md, print the table."""
    suite = args.out or default_out("decoupled_merge")
    runs = planned_runs(args)
    load_before = os.getloadavg()
    jobs = [(suite, name, args.fresh, settings) for name, _, _, settings in runs]
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            done = {name: (summary, s) for name, summary, s in pool.map(_train, jobs)}
    else:
        done = {name: (summary, s) for name, summary, s in map(_train, jobs)}
    load_after = os.getloadavg()

    def loss(variant: str, cond: str) -> float | None:
        got = done.get(f"{variant}_{cond}")
        return got[0]["final_eval_loss"] if got else None

    rows, per_run = [], {}
    for variant in dict.fromkeys(v for _, v, _, _ in runs):
        own = {k: v for k, v in VARIANTS[variant].items() if k != "strategy"}
        row: dict[str, Any] = {"variant": variant, "settings": ", ".join(f"{k}={v}" for k, v in own.items())
                               if variant != "today" else "(the reference)"}
        for cond in ("equal", "speeds", "chaos"):
            got = done.get(f"{variant}_{cond}")
            if got is None:
                continue
            r, seconds = got
            per_run[f"{variant}_{cond}"] = {**r, "bench_wall_s": seconds}
            row[f"loss_{cond}"] = r["final_eval_loss"]
            ref = loss("today", cond)
            row[f"vs_today_{cond}"] = pct(r["final_eval_loss"], ref) if ref is not None else None
            row[f"quorum_{cond}"] = r.get("quorum_size_mean")
            row[f"staleness_{cond}"] = r.get("staleness_mean")
            row[f"commits_{cond}"] = r.get("commits")
            row[f"goodput_{cond}"] = r.get("goodput")
        if row.get("loss_speeds") is not None and row.get("loss_equal") is not None:
            row["speeds_vs_equal"] = pct(row["loss_speeds"], row["loss_equal"])
        rows.append(row)

    columns = [("variant", "variant"), ("settings over today's", "settings"),
               ("eval loss, equal speeds", "loss_equal"), ("equal: vs today %", "vs_today_equal"),
               ("eval loss, speeds 1,1,0.5,0.25", "loss_speeds"), ("speeds: vs today %", "vs_today_speeds"),
               ("speeds vs equal %", "speeds_vs_equal"),
               ("mean quorum (equal / speeds)", "quorum_pair"), ("mean staleness (equal / speeds)", "stale_pair"),
               ("commits (equal / speeds)", "commits_pair")]
    if args.chaos:
        columns += [("eval loss, failure trace", "loss_chaos"), ("failures: vs today %", "vs_today_chaos"),
                    ("goodput, failure trace", "goodput_chaos"), ("mean quorum, failure trace", "quorum_chaos")]
    for row in rows:
        row["quorum_pair"] = [row.get("quorum_equal"), row.get("quorum_speeds")]
        row["stale_pair"] = [row.get("staleness_equal"), row.get("staleness_speeds")]
        row["commits_pair"] = [row.get("commits_equal"), row.get("commits_speeds")]
    first = next(iter(done.values()))[0]
    notes = [f"model {first['model']}, {first['islands']} islands, {first['steps']} inner steps per island (a budget "
             f"shared by speed), H = {first['sync_every']}, {first['fragments']} fragments, codec {first['codec']}, "
             f"simulated step {first['sim_step_s']} s, seed {first['seed']}; the final held-out loss at equal tokens.",
             "every run takes [today] of bench/decoupled_merge.toml, then its variant's table; the conditions: "
             + ", ".join({"equal": "equal speeds", "speeds": "speeds 1,1,0.5,0.25"}[c]
                         for c in args.conditions.split(",") if c)
             + (f", and the standard failure trace --chaos {chaos_spec(args)} at equal speeds" if args.chaos else "")
             + ".",
             f"machine load (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, after "
             f"{', '.join(f'{x:.2f}' for x in load_after)} (2 cores, shared); wall seconds of each run in "
             "results.json (runs.*.wall_s; bench_wall_s is this invocation's, about 0 for a run it reused), not a "
             "measured figure here: the simulated clock sets the schedule.",
             "command: python bench/decoupled_merge.py " + " ".join(a for a in argv if a != "--fresh")]
    results = {"settings": shared_settings(args), "variants": {v: VARIANTS[v] for v in dict.fromkeys(
        v for _, v, _, _ in runs)}, "rows": rows, "runs": per_run, "load_before": list(load_before),
        "load_after": list(load_after), "command": notes[-1].removeprefix("command: ")}
    print(write_results(suite, results, columns, rows, "Decoupled DiLoCo's merge: the paper's settings against "
                        "today's", notes))


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
