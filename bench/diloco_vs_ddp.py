"""DiLoCo against data parallel and one island alone, at equal inner steps (issue: the main job).

    python bench/diloco_vs_ddp.py            # about 35 minutes on 2 CPU cores

Measured on the earlier default benchmark setting, the TrainConfig defaults before the nano regime (tiny
~1.8M Llama, 4096-token vocabulary, batch 8 of 128 tokens per island, 600 inner steps, warmup 50, outer
Nesterov momentum 0.9, an evaluation every 100 steps; stdlib corpus, 4 islands), now pinned in every run
(:data:`EARLIER_SETTING`) so the committed results reproduce. The current default setting is measured by
``python bench/fidelity.py``. Runs:
1. ``atoll train`` with the earlier defaults as flags (diloco, H=50; no argument when it was measured),
   timed as a user runs it;
2. one island alone (``--strategy ddp --islands 1``: plain AdamW, the DiLoCo paper's baseline);
3. ``ddp`` with 4 islands (the same tokens as diloco);
4. ``diloco`` with H = 10, 25, 100 (H=50 is run 1);
5. a warm start as in the DiLoCo paper (which starts from a pretrained model): from the final weights of
   run 3 (``--init-from``), ``diloco`` (H=50) and ``ddp`` each train half the steps more, on equal tokens;
6. the outer optimizer at H=50 from scratch: (outer lr, Nesterov momentum) in (1, 0) (plain parameter
   averaging, FedAvg) and (0.7, 0.5) beside the paper's (0.7, 0.9) of run 1. In steady state Nesterov
   moves the globals by lr * (1 + m / (1 - m)) times the averaged pseudo-gradient: 1, 1.4 and 7.
Writes bench/out/diloco_vs_ddp/results.json and results.md (``--out``: elsewhere), one atoll run folder per
run; a finished run is reused (:func:`atoll.benchmarks.common.train_once`), ``--fresh`` reruns all.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import (
    clear_run_dir,
    default_out,
    parse_args,
    pct,
    run_matches,
    script_error,
    study_settings,
    train_once,
    write_results,
)
from atoll.errors import AtollError

OUTER_SWEEP = ((1.0, 0.0), (0.7, 0.5))  # (outer lr, outer momentum); run 1 is (0.7, 0.9)

#: The defaults before the nano regime (TrainConfig up to commit 568f3bb) that differ from today's, which the
#: committed results were measured on: bench/diloco_vs_ddp.toml's [earlier] (why each, there).
EARLIER_SETTING: dict[str, Any] = study_settings(__file__, "earlier")


def pinned(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's settings over :data:`EARLIER_SETTING`: what it trains with."""
    return {**EARLIER_SETTING, **settings}


def planned_runs(steps: int, suite: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, own settings) of every run, in training order (to train with :func:`pinned`); no training.

    ``default_cli`` (at the earlier default of 600 steps) is ``atoll train`` with no setting of its own: its
    flags are :data:`EARLIER_SETTING`; at other steps ``diloco_H50`` is trained as the other runs. The warm
    starts read ``suite/ddp``.
    """
    s = {"steps": steps}
    first = ("default_cli", {}) if steps == EARLIER_SETTING["steps"] else \
        ("diloco_H50", {"strategy": "diloco", "sync_every": 50, **s})
    warm = {"steps": steps // 2, "init_from": str(suite / "ddp")}
    return [
        first,
        ("one_island", {"strategy": "ddp", "islands": 1, **s}),
        ("ddp", {"strategy": "ddp", **s}),
        *[(f"diloco_H{h}", {"strategy": "diloco", "sync_every": h, **s}) for h in (10, 25, 100)],
        *[(f"diloco_H50_outer_{lr:g}_{m:g}", {"strategy": "diloco", "sync_every": 50, "outer_lr": lr,
                                               "outer_momentum": m, **s}) for lr, m in OUTER_SWEEP],
        ("warm_then_ddp", {"strategy": "ddp", **warm}),
        ("warm_then_diloco_H50", {"strategy": "diloco", "sync_every": 50, **warm}),
    ]


def reference(name: str, steps: int) -> dict[str, Any]:
    """The pinned settings other benchmarks reuse a run of this one with (``ddp``, ``one_island``, and
    ``diloco_H50`` or ``default_cli``: diloco at H=50), at ``steps``."""
    own = {"ddp": {"strategy": "ddp"}, "one_island": {"strategy": "ddp", "islands": 1}}.get(
        name, {"strategy": "diloco", "sync_every": 50})
    return pinned({**own, "steps": steps})


def cli_flags(settings: dict[str, Any]) -> list[str]:
    """``atoll train`` flags of ``settings`` (``--model tiny``, ...)."""
    return [x for k, v in settings.items() for x in ("--" + k.replace("_", "-"), str(v))]


def outer_setting(run_dir: Path) -> str:
    """``"lr/momentum"`` of a run's outer optimizer, from its resolved ``config.json``."""
    import json

    config = json.loads((run_dir / "config.json").read_text())
    return f"{config['outer_lr']:g}/{config['outer_momentum']:g}"


def default_cli_run(suite: Path, fresh: bool) -> dict:
    """``atoll train`` with the earlier defaults as flags (:data:`EARLIER_SETTING`; it had no argument when
    measured), in a scratch folder; its run folder is moved into the suite."""
    import json
    import shutil

    target = suite / "default_cli"
    if (target / "summary.json").is_file() and not fresh and run_matches(target, pinned({})):
        return json.loads((target / "summary.json").read_text())
    clear_run_dir(target)  # only a run folder (atoll's files), never another folder
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.perf_counter()
        # one OpenMP thread (as the other benchmark runs): the command line itself holds only the settings
        r = subprocess.run(["atoll", "train", "--no-progress", *cli_flags(pinned({}))], cwd=cwd,
                           capture_output=True, text=True, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        elapsed = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"atoll train failed ({r.returncode}): {r.stderr[-2000:]}")
        run_dir = next((Path(cwd) / "runs").iterdir())
        shutil.move(str(run_dir), target)
    summary = json.loads((target / "summary.json").read_text())
    summary["command_wall_s"] = elapsed
    (target / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/diloco_vs_ddp.py [--steps N] [--out DIR] [--fresh]``; the exit status (2: bad input)."""
    args = parse_args(__doc__.splitlines()[0], "diloco_vs_ddp", argv)
    try:
        benchmark(args)
    except AtollError as e:
        return script_error("diloco_vs_ddp", e)
    return 0


def benchmark(args: argparse.Namespace) -> None:
    """Train (or reuse) every run, write results.json and results.md, print the table."""
    suite = args.out or default_out("diloco_vs_ddp")
    steps = args.steps
    results: dict[str, dict] = {}
    for name, own in planned_runs(steps, suite):
        if name == "default_cli":
            results["diloco_H50"] = default_cli_run(suite, args.fresh)
        else:
            results[name] = train_once(suite, name, args.fresh, **pinned(own))

    ddp_loss = results["ddp"]["final_eval_loss"]
    one_loss = results["one_island"]["final_eval_loss"]
    rows = []
    for name, r in results.items():
        ref = results["warm_then_ddp"]["final_eval_loss"] if name.startswith("warm") else ddp_loss
        rows.append({
            "run": name, "strategy": r["strategy"], "islands": r["islands"],
            "H": r["sync_every"] if r["strategy"] == "diloco" else None, "tokens": r["tokens"],
            "outer": outer_setting(suite / ("default_cli" if name == "diloco_H50" and steps == 600 else name))
            if r["strategy"] == "diloco" else None,
            "final_eval_loss": r["final_eval_loss"], "gap_vs_ddp_pct": pct(r["final_eval_loss"], ref),
            "gap_vs_one_island_pct": None if name.startswith("warm") else pct(r["final_eval_loss"], one_loss),
            "bytes_sent_per_island": r["bytes_sent_per_island"],
            "reduction_vs_ddp": r["reduction_vs_ddp"], "sim_wall_s": r["sim_wall_s"],
            "compute_utilization": r["compute_utilization"], "wall_s": r.get("command_wall_s", r["wall_s"]),
        })
    d50 = results["diloco_H50"]
    checks = {
        "default_cli_wall_s": d50.get("command_wall_s"),
        "default_loss_drop": d50["initial_eval_loss"] - d50["final_eval_loss"],
        "diloco_H50_beats_one_island": d50["final_eval_loss"] < one_loss,
        "diloco_H50_reduction_vs_ddp": d50["reduction_vs_ddp"],
        "diloco_H50_outer_beating_one_island": [
            f"{lr:g}/{m:g}" for lr, m in ((0.7, 0.9), *OUTER_SWEEP)
            if results["diloco_H50" if (lr, m) == (0.7, 0.9) else f"diloco_H50_outer_{lr:g}_{m:g}"]["final_eval_loss"]
            < one_loss],
    }
    table = write_results(
        suite, {"runs": results, "rows": rows, "checks": checks},
        [("run", "run"), ("strategy", "strategy"), ("K", "islands"), ("H", "H"), ("outer lr/m", "outer"),
         ("tokens", "tokens"), ("eval loss", "final_eval_loss"), ("gap vs ddp %", "gap_vs_ddp_pct"),
         ("gap vs 1 island %", "gap_vs_one_island_pct"), ("bytes/island", "bytes_sent_per_island"),
         ("reduction vs ddp", "reduction_vs_ddp"), ("sim wall s @100Mb/s", "sim_wall_s"),
         ("utilization", "compute_utilization"), ("real wall s", "wall_s")],
        rows, f"diloco vs ddp vs one island: tiny model, stdlib corpus, {steps} inner steps per island",
        notes=[f"checks: {checks}", "warm_* rows: gap against warm_then_ddp (same warm start, same tokens)",
               "command: python bench/diloco_vs_ddp.py"],
    )
    print(table)



if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
