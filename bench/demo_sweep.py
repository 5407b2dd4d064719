"""DeMo / DisTrO: learning-rate sweep, top-k sweep, against one island, diloco and ddp (issue: DeMo).

    python bench/demo_sweep.py --sweep-steps 150    # about 40 minutes on one core

Measured on the earlier default benchmark setting, the TrainConfig defaults before the nano regime (tiny
Llama, 4096-token vocabulary, batch 8 of 128 tokens per island, warmup 50, outer Nesterov momentum 0.9, an
evaluation every 100 steps; stdlib corpus, 4 islands), now pinned in every run (:data:`EARLIER_SETTING`) so
the committed results reproduce; the current default setting is measured by ``python bench/fidelity.py``.
With the ``demo`` strategy's defaults (value format ``demo_sign_values``, chunk 64) except what is swept:
1. sign-SGD needs its own step size: ``demo_lr`` in {1e-3, 3e-3, 1e-2}, top-k 32, at the default cosine floor
   and ``--sweep-steps`` (default half the steps);
2. and its own schedule: at the best step size, the floor ``min_lr_ratio`` in {0.1, 1} (1 is a constant rate
   after warmup);
3. at the best step size and schedule and ``--sweep-steps``: top-k in {4, 8, 16, 32}, with eval loss and
   bytes per island per step; and top-k 32 with the other value format (float32 values when sign values
   are the default, sign values otherwise) for comparison;
4. at the best step size and schedule and the full steps: top-k 32;
5. beside them, from bench/diloco_vs_ddp: one island alone, diloco H=50 (about the same bytes as
   top-k 32) and ddp (run here if missing).
Run names carry the value format (``sign_...``, ``f32_...``): a run is reused only if its config.json
matches, and names keep runs of the two formats apart. Writes bench/out/demo_sweep/results.json and
results.md (``--out``: elsewhere), one atoll run folder per run; a finished run is reused
(:func:`atoll.benchmarks.common.train_once`), ``--fresh`` reruns all.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # ``python bench/demo_sweep.py``: the repository root on the path, for bench.<study>
    sys.path.append(_REPO)

from atoll.benchmarks.common import (
    default_out,
    parse_args,
    pct,
    script_error,
    study_settings,
    train_once,
    write_results,
)
from atoll.config import build_config
from atoll.errors import AtollError
from bench import diloco_vs_ddp

LRS = (1e-3, 3e-3, 1e-2)
TOPKS = (4, 8, 16, 32)
FLOORS = (0.1, 1.0)

#: The defaults before the nano regime (TrainConfig up to commit 568f3bb) that differ from today's, which the
#: committed results were measured on: bench/demo_sweep.toml's [earlier] (why each, there).
EARLIER_SETTING: dict[str, Any] = study_settings(__file__, "earlier")


def pinned(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's settings over :data:`EARLIER_SETTING`: what it trains with."""
    return {**EARLIER_SETTING, **settings}


def _tag(sign_values: bool) -> str:
    return "sign" if sign_values else "f32"


def demo_defaults() -> tuple[bool, float, int]:
    """The ``demo`` strategy's value format, cosine floor and chunk by default (the sweeps start from them)."""
    defaults = build_config(base=pinned({"strategy": "demo"}))
    own = defaults.strategy_config
    return own.demo_sign_values, defaults.min_lr_ratio, own.demo_chunk


def demo_run(sign_values: bool, lr: float, floor: float, topk: int, n_steps: int, chunk: int) -> tuple[str, dict]:
    """(name, own settings) of one demo run (to train with :func:`pinned`)."""
    return (f"{_tag(sign_values)}_topk_{topk}_lr_{lr:g}_floor_{floor:g}_{n_steps}",
            {"strategy": "demo", "demo_sign_values": sign_values, "demo_lr": lr, "min_lr_ratio": floor,
             "demo_topk": topk, "demo_chunk": chunk, "steps": n_steps})


def planned_runs(steps: int, half: int, best_lr: float, best_floor: float) -> list[tuple[str, dict[str, Any]]]:
    """(name, own settings) of every run of this benchmark's folder, in training order, given the step size and
    floor the sweeps pick (the benchmark picks them from the losses as it goes); no training. A name may
    repeat (a run that two stages share, trained once). The references are bench/diloco_vs_ddp's
    (:func:`bench.diloco_vs_ddp.reference`)."""
    sign, floor0, chunk = demo_defaults()
    return [*(demo_run(sign, lr, floor0, 32, half, chunk) for lr in LRS),
            *(demo_run(sign, best_lr, floor, 32, half, chunk) for floor in FLOORS),
            *(demo_run(sign, best_lr, best_floor, k, half, chunk) for k in TOPKS),
            demo_run(not sign, best_lr, best_floor, 32, half, chunk),
            demo_run(sign, best_lr, best_floor, 32, steps, chunk)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/demo_sweep.py [--sweep-steps N] [--steps N] [--out DIR] [--fresh]``; the exit status
    (2: bad input)."""
    args = parse_args(__doc__.splitlines()[0], "demo_sweep", argv, sweep_steps=True)
    try:
        benchmark(args)
    except AtollError as e:
        return script_error("demo_sweep", e)
    return 0


def benchmark(args: argparse.Namespace) -> None:
    """Train (or reuse) every run, write results.json and results.md, print the table."""
    suite = args.out or default_out("demo_sweep")
    steps = args.steps
    half = args.sweep_steps or steps // 2
    sign, floor0, chunk = demo_defaults()

    def demo(sign_values: bool, lr: float, floor: float, topk: int, n_steps: int) -> dict:
        name, own = demo_run(sign_values, lr, floor, topk, n_steps, chunk)
        return train_once(suite, name, args.fresh, **pinned(own))

    sweep = {lr: demo(sign, lr, floor0, 32, half) for lr in LRS}
    best_lr = min(sweep, key=lambda lr: sweep[lr]["final_eval_loss"])
    schedules = {floor: demo(sign, best_lr, floor, 32, half) for floor in FLOORS}
    best_floor = min(schedules, key=lambda f: schedules[f]["final_eval_loss"])
    topk_runs = [(sign, k, demo(sign, best_lr, best_floor, k, half)) for k in TOPKS]
    topk_runs.append((not sign, 32, demo(not sign, best_lr, best_floor, 32, half)))  # the other value format
    runs = {"topk_32": demo(sign, best_lr, best_floor, 32, steps)}

    # references from bench/diloco_vs_ddp (waits for that benchmark if it is training them)
    ref_suite = default_out("diloco_vs_ddp")
    ddp = train_once(ref_suite, "ddp", False, **diloco_vs_ddp.reference("ddp", steps))
    one = train_once(ref_suite, "one_island", False, **diloco_vs_ddp.reference("one_island", steps))
    d50 = "default_cli" if (ref_suite / "default_cli").exists() else "diloco_H50"
    diloco = train_once(ref_suite, d50, False, **diloco_vs_ddp.reference(d50, steps))

    fmt = _tag(sign)
    rows = [{"run": f"{fmt}, lr {lr:g}, floor {floor0:g}, top-k 32 ({half} steps)",
             "final_eval_loss": r["final_eval_loss"]} for lr, r in sweep.items()]
    rows += [{"run": f"{fmt}, lr {best_lr:g}, floor {floor:g}, top-k 32 ({half} steps)",
              "final_eval_loss": r["final_eval_loss"]} for floor, r in schedules.items() if floor != floor0]
    rows += [{"run": f"{_tag(sv)}, lr {best_lr:g}, floor {best_floor:g}, top-k {k} ({half} steps)",
              "final_eval_loss": r["final_eval_loss"], "bytes_sent_per_island": r["bytes_sent_per_island"],
              "bytes_per_step": r["bytes_sent_per_island"] / half,
              "reduction_vs_ddp": r["ddp_bytes_per_island"] / r["bytes_sent_per_island"]}
             for sv, k, r in topk_runs]
    for name, r in {f"{fmt} topk_32": runs["topk_32"], "one_island": one, "diloco_H50": diloco, "ddp": ddp}.items():
        per_step = r["bytes_sent_per_island"] / r["steps"]
        rows.append({
            "run": name, "final_eval_loss": r["final_eval_loss"],
            "gap_vs_ddp_pct": pct(r["final_eval_loss"], ddp["final_eval_loss"]),
            "bytes_sent_per_island": r["bytes_sent_per_island"], "bytes_per_step": per_step,
            "reduction_vs_ddp": ddp["bytes_sent_per_island"] / r["bytes_sent_per_island"]
            if r["bytes_sent_per_island"] else None,
        })
    t32 = runs["topk_32"]
    checks = {
        "sign_values": sign,
        "best_demo_lr": best_lr,
        "best_min_lr_ratio": best_floor,
        "topk32_loss_by_values_sweep_steps": {_tag(sv): r["final_eval_loss"] for sv, k, r in topk_runs if k == 32},
        "topk32_beats_one_island": t32["final_eval_loss"] < one["final_eval_loss"],
        "topk32_beats_diloco_H50": t32["final_eval_loss"] < diloco["final_eval_loss"],
        "topk32_bytes_vs_diloco_H50": t32["bytes_sent_per_island"] / diloco["bytes_sent_per_island"],
        "topk32_reduction_vs_ddp_per_step": ddp["bytes_sent_per_island"] / t32["bytes_sent_per_island"],
        "topk32_at_least_50x_less_than_ddp": ddp["bytes_sent_per_island"] / t32["bytes_sent_per_island"] >= 50,
        "topk32_gap_vs_ddp_pct": pct(t32["final_eval_loss"], ddp["final_eval_loss"]),
    }
    command = "python bench/demo_sweep.py" + (f" --sweep-steps {args.sweep_steps}" if args.sweep_steps else "")
    table = write_results(
        suite, {"lr_sweep": {str(k): v for k, v in sweep.items()},
                "schedule_sweep": {str(k): v for k, v in schedules.items()},
                "topk_sweep": {f"{_tag(sv)} {k}": r for sv, k, r in topk_runs},
                "runs": runs, "rows": rows, "checks": checks},
        [("run", "run"), ("eval loss", "final_eval_loss"), ("gap vs ddp %", "gap_vs_ddp_pct"),
         ("bytes/island", "bytes_sent_per_island"), ("bytes/island/step", "bytes_per_step"),
         ("reduction vs ddp", "reduction_vs_ddp")],
        rows, f"DeMo: tiny model, 4 islands, {steps} inner steps (sweeps at {half}); values: "
              f"{'sign, 2 bits' if sign else 'float32'} unless the row says otherwise",
        notes=[f"checks: {checks}", f"command: {command}"],
    )
    print(table)



if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
