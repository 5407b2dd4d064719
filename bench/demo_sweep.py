"""DeMo / DisTrO: learning-rate sweep, top-k sweep, against one island, diloco and ddp (issue: DeMo).

    python bench/demo_sweep.py --sweep-steps 150    # about 25 minutes on 2 CPU cores

On the default benchmark (tiny Llama, stdlib corpus, 4 islands):
1. sign-SGD needs its own step size: ``demo_lr`` in {3e-4, 1e-3, 3e-3, 1e-2}, top-k 32, at ``--sweep-steps``
   (default half the steps);
2. and its own schedule: at the best step size, the cosine floor ``min_lr_ratio`` in {0, 0.1, 1} (1 is a
   constant rate after warmup);
3. at the best step size and schedule and ``--sweep-steps``: top-k in {4, 8, 16, 32} (chunk 64), and top-k
   32 with sign-only values, with eval loss and bytes per island per step;
4. at the best step size and schedule and the full steps: top-k 32;
5. beside them, from bench/diloco_vs_ddp: one island alone, diloco H=50 (about the same bytes as
   top-k 32) and ddp (run here if missing).
Writes bench/out/demo_sweep/results.json and results.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import OUT, parse_args, pct, run, write_results  # noqa: E402

LRS = (3e-4, 1e-3, 3e-3, 1e-2)
TOPKS = (4, 8, 16, 32)
FLOORS = (0.0, 0.1, 1.0)
DEFAULT_FLOOR = 0.1  # the floor of the step-size sweep (AdamW's default; demo's default is now the sweep's best)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], sweep_steps=True)
    suite = args.out or OUT / "demo_sweep"
    steps = args.steps
    half = args.sweep_steps or steps // 2
    sweep = {lr: run(suite, f"lr_{lr:g}_{half}", args.fresh, strategy="demo", demo_lr=lr,
                 min_lr_ratio=DEFAULT_FLOOR, steps=half) for lr in LRS}
    best_lr = min(sweep, key=lambda lr: sweep[lr]["final_eval_loss"])
    schedules = {ratio: sweep[best_lr] if ratio == DEFAULT_FLOOR else run(
        suite, f"floor_{ratio:g}_{half}", args.fresh, strategy="demo", demo_lr=best_lr, min_lr_ratio=ratio, steps=half)
        for ratio in FLOORS}
    best_floor = min(schedules, key=lambda r: schedules[r]["final_eval_loss"])
    best = {"strategy": "demo", "demo_lr": best_lr, "min_lr_ratio": best_floor}
    topk_sweep = {k: schedules[best_floor] if k == 32 else run(suite, f"topk_{k}_{half}", args.fresh, demo_topk=k,
                                                                steps=half, **best) for k in TOPKS}
    topk_sweep["32 sign"] = run(suite, f"topk_32_sign_{half}", args.fresh, demo_topk=32, demo_sign_values=True,
                                steps=half, **best)
    runs = {"topk_32": run(suite, "topk_32", args.fresh, demo_topk=32, steps=steps, **best)}

    # references from bench/diloco_vs_ddp (waits for that benchmark if it is training them)
    ref_suite = OUT / "diloco_vs_ddp"
    ddp = run(ref_suite, "ddp", False, strategy="ddp", steps=steps)
    one = run(ref_suite, "one_island", False, strategy="ddp", islands=1, steps=steps)
    diloco = run(ref_suite, "default_cli" if (ref_suite / "default_cli").exists() else "diloco_H50", False,
                 strategy="diloco", sync_every=50, steps=steps)

    rows = [{"run": f"lr {lr:g}, top-k 32 ({half} steps)", "final_eval_loss": r["final_eval_loss"],
             "bytes_sent_per_island": r["bytes_sent_per_island"], "bytes_per_step": r["bytes_sent_per_island"] / half}
            for lr, r in sweep.items()]
    rows += [{"run": f"lr {best_lr:g}, cosine floor {ratio:g} ({half} steps)", "final_eval_loss": r["final_eval_loss"]}
             for ratio, r in schedules.items()]
    rows += [{"run": f"top-k {k}, lr {best_lr:g}, floor {best_floor:g} ({half} steps)", "final_eval_loss": r["final_eval_loss"],
              "bytes_sent_per_island": r["bytes_sent_per_island"], "bytes_per_step": r["bytes_sent_per_island"] / half,
              "reduction_vs_ddp": r["ddp_bytes_per_island"] / r["bytes_sent_per_island"]}
             for k, r in topk_sweep.items()]
    for name, r in {**runs, "one_island": one, "diloco_H50": diloco, "ddp": ddp}.items():
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
        "best_demo_lr": best_lr,
        "best_min_lr_ratio": best_floor,
        "topk32_beats_one_island": t32["final_eval_loss"] < one["final_eval_loss"],
        "topk32_beats_diloco_H50": t32["final_eval_loss"] < diloco["final_eval_loss"],
        "topk32_bytes_vs_diloco_H50": t32["bytes_sent_per_island"] / diloco["bytes_sent_per_island"],
        "topk32_reduction_vs_ddp_per_step": ddp["bytes_sent_per_island"] / t32["bytes_sent_per_island"],
        "topk32_gap_vs_ddp_pct": pct(t32["final_eval_loss"], ddp["final_eval_loss"]),
    }
    table = write_results(
        suite, {"lr_sweep": {str(k): v for k, v in sweep.items()},
                "schedule_sweep": {str(k): v for k, v in schedules.items()},
                "topk_sweep": {str(k): v for k, v in topk_sweep.items()}, "runs": runs, "rows": rows,
                "checks": checks},
        [("run", "run"), ("eval loss", "final_eval_loss"), ("gap vs ddp %", "gap_vs_ddp_pct"),
         ("bytes/island", "bytes_sent_per_island"), ("bytes/island/step", "bytes_per_step"),
         ("reduction vs ddp", "reduction_vs_ddp")],
        rows, f"DeMo: tiny model, 4 islands, {steps} inner steps (sweeps at {half})",
        notes=[f"checks: {checks}", "command: python bench/demo_sweep.py"],
    )
    print(table)


if __name__ == "__main__":
    main()
