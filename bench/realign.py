"""realign_pushes off against on: participation, loss, merges and merged tokens of the local runtime.

    python bench/realign.py [--out DIR] [--from RUNS_DIR]

Six islands of speeds 1,1,0.5,0.5,0.25,0.25 (each island's H = speed x 16, so all push each fragment at one
simulated cadence of 1.6 s), the micro model, 2 fragments, int8 pushes, 0.1 s simulated per speed-1 step,
two seeds, failure-free and under three seeded failure traces (``--chaos MTBF_S:DOWNTIME_S``), each with
``--realign-pushes`` off (the paper's fixed schedule) and on. Participation is the run's ``participation``:
per merge, the islands it held over the islands alive then, the mean over merges. One torch thread; the
clock is simulated, so every number is deterministic for a seed. ``--from``: tabulate runs already made with
these flags (folders ``<name>_s<seed>_<off|on>``) instead of running them. Writes ``results.md`` and
``results.json`` under ``--out`` (default bench/out/realign).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

COMMON = ["--model", "micro", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--threads", "1",
          "--no-progress", "--eval-every", "50", "--eval-batches", "16", "--strategy", "decoupled",
          "--islands", "6", "--island-speeds", "1,1,0.5,0.5,0.25,0.25", "--sync-every", "16", "--fragments", "2",
          "--codec", "int8", "--sim-step-s", "0.1"]
#: name -> (steps, extra flags)
CASES: dict[str, tuple[int, list[str]]] = {
    "failure-free": (300, []),
    "chaos 15:2": (300, ["--chaos", "15:2"]),
    "chaos 30:3": (300, ["--chaos", "30:3"]),
    "chaos 60:6": (600, ["--chaos", "60:6"]),
}
SEEDS = (3, 4)
SHORT = {"failure-free": "ff", "chaos 15:2": "c15", "chaos 30:3": "c30", "chaos 60:6": "c60"}
KEYS = ("participation", "merges_all_live", "commits", "final_eval_loss", "useful_tokens", "goodput",
        "quorum_size_mean", "deferred_pushes")


def folder(case: str, seed: int, on: bool) -> str:
    return f"m_{SHORT[case]}_s{seed}_{'on' if on else 'off'}"


def run(runs: Path, case: str, seed: int, on: bool) -> None:
    steps, extra = CASES[case]
    args = [*COMMON, "--steps", str(steps), *extra, "--seed", str(seed), "--out", str(runs / folder(case, seed, on))]
    args.append("--realign-pushes" if on else "--no-realign-pushes")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "atoll", "train", *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"atoll train {' '.join(args)} failed ({r.returncode}): {r.stderr[-1500:]}")


def numbers(runs: Path, case: str, seed: int, on: bool) -> dict[str, Any]:
    s = json.loads((runs / folder(case, seed, on) / "summary.json").read_text())
    return {k: s[k] for k in KEYS} | {"failures": sum(s["failures"])}


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| case | seed | failures | realign | participation | merges all live / merges | final eval loss | "
             "merged tokens | goodput | mean quorum | deferred pushes |", "|" + "---|" * 11]
    for case in CASES:
        for seed in SEEDS:
            for on in (False, True):
                r = rows[folder(case, seed, on)]
                lines.append(f"| {case} | {seed} | {r['failures']} | {'on' if on else 'off'} | "
                             f"{r['participation']:.3f} | {r['merges_all_live']} / {r['commits']} | "
                             f"{r['final_eval_loss']:.4f} | {r['useful_tokens']:,.0f} | {r['goodput']:.3f} | "
                             f"{r['quorum_size_mean']:.2f} | {r['deferred_pushes']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/realign"))
    parser.add_argument("--from", dest="runs", type=Path, default=None, help="runs already made (their folder)")
    args = parser.parse_args(argv)
    runs = args.runs if args.runs is not None else args.out / "runs"
    if args.runs is None:
        for case in CASES:
            for seed in SEEDS:
                for on in (False, True):
                    print(f"[realign] {case} seed {seed} {'on' if on else 'off'}", file=sys.stderr, flush=True)
                    run(runs, case, seed, on)
    rows = {folder(c, s, on): numbers(runs, c, s, on) for c in CASES for s in SEEDS for on in (False, True)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    (args.out / "results.md").write_text("# realign_pushes off against on (`python bench/realign.py`)\n\n"
                                         + table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
