"""The decoupled pull codec: loss and bytes both ways per island with pulls in fp32, bf16, int8 and int4.

    python bench/pull_codec.py [--out DIR] [--model micro] [--steps 300] [--codecs fp32,int8,int4,bf16]
    python bench/pull_codec.py --benchmark default --out bench/out/pull_codec_default   # the default benchmark

Three islands of speeds 1, 1, 0.5 (H = 16 x speed), the embedded default corpus, 2 fragments, int4 pushes (the
decoupled default), 0.1 s simulated per speed-1 step, the ``local`` runtime (its clock simulated, so every
number but the wall time is deterministic for a seed); failure-free with two seeds, and under a seeded failure
trace (``--chaos 30:3``: rejoins pull the whole model in float32, slow islands fall several versions behind).
Each case with every ``--pull-codec`` (``--cases``, ``--codecs``: some of them; runs already made are kept).
One torch thread, one run at a time; each run's wall seconds and the machine's 1-minute load average when it
ended are recorded beside it. Writes ``results.json`` and ``results.md`` under ``--out`` (default
bench/out/pull_codec); ``--from``: tabulate runs already made.

``--benchmark default``: the default benchmark instead (the TrainConfig defaults: the nano model, 4 islands at
equal speeds, 800 inner steps per island, H = 50, 4 fragments, int4 pushes, the local runtime), failure-free
with seeds 0 and 1 (cases ``default s0``, ``default s1``); ``--model`` and ``--steps`` do not apply.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

COMMON = ["--strategy", "decoupled", "--islands", "3", "--island-speeds", "1,1,0.5", "--sync-every", "16",
          "--fragments", "2", "--codec", "int4", "--sim-step-s", "0.1", "--threads", "1", "--no-progress",
          "--eval-batches", "16", "--checkpoint-every", "0"]
#: name -> (seed, extra flags)
CASES: dict[str, tuple[int, list[str]]] = {
    "failure-free s1": (1, []),
    "chaos 30:3 s1": (1, ["--chaos", "30:3"]),
    "failure-free s2": (2, []),
}
#: the default benchmark: the TrainConfig defaults, one torch thread, no checkpoints (what the runs compare)
DEFAULT_COMMON = ["--strategy", "decoupled", "--threads", "1", "--no-progress", "--checkpoint-every", "0"]
DEFAULT_CASES: dict[str, tuple[int, list[str]]] = {"default s0": (0, []), "default s1": (1, [])}
KEYS = ("final_eval_loss", "bytes_sent_per_island", "bytes_received_per_island", "bytes_sent_by_island",
        "bytes_received_by_island", "sim_wall_s", "goodput", "commits", "failures", "params")


def folder(case: str, codec: str) -> str:
    return f"{case.replace(' ', '_').replace(':', '-')}_{codec}"


def run(runs: Path, case: str, codec: str, model: str, steps: int) -> dict[str, float]:
    if case in DEFAULT_CASES:  # the default benchmark: every setting the TrainConfig default but these
        seed, extra = DEFAULT_CASES[case]
        common = DEFAULT_COMMON
    else:
        seed, extra = CASES[case]
        common = [*COMMON, "--model", model, "--steps", str(steps), "--eval-every", str(max(1, steps // 6))]
    args = [*common, "--seed", str(seed), "--pull-codec", codec, *extra, "--out", str(runs / folder(case, codec))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "atoll", "train", *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"atoll train {' '.join(args)} failed ({r.returncode}): {r.stderr[-1500:]}")
    return {"wall_s": time.perf_counter() - t0, "load_1min": os.getloadavg()[0]}


def numbers(runs: Path, case: str, codec: str) -> dict[str, Any]:
    out = runs / folder(case, codec)
    s = json.loads((out / "summary.json").read_text())
    row = {k: s.get(k) for k in KEYS}
    row["failures"] = sum(s["failures"])
    timing = out / "bench_timing.json"
    if timing.is_file():
        row.update(json.loads(timing.read_text()))
    return row


def table(rows: dict[str, dict[str, Any]], codecs: list[str], cases: list[str]) -> str:
    lines = ["| case | pull codec | final eval loss | Δ loss vs fp32 | sent / island (MB) | received / island (MB) | "
             "received vs fp32 | sent by island (MB) | received by island (MB) | sim wall (s) | "
             "goodput | commits | wall (s) | load |",
             "|" + "---|" * 14]
    for case in cases:
        base = rows[folder(case, "fp32")] if "fp32" in codecs else None
        for codec in codecs:
            r = rows[folder(case, codec)]
            d = f"{r['final_eval_loss'] - base['final_eval_loss']:+.4f}" if base else "-"
            x = f"{base['bytes_received_per_island'] / r['bytes_received_per_island']:.2f}x fewer" if base else "-"
            per = ", ".join(f"{b / 1e6:.2f}" for b in r["bytes_received_by_island"])
            up = ", ".join(f"{b / 1e6:.2f}" for b in r["bytes_sent_by_island"])
            lines.append(f"| {case} | {codec} | {r['final_eval_loss']:.4f} | {d} | "
                         f"{r['bytes_sent_per_island'] / 1e6:.3f} | {r['bytes_received_per_island'] / 1e6:.3f} | {x} | "
                         f"{up} | {per} | {r['sim_wall_s']:.1f} | {r['goodput']:.3f} | {r['commits']} | "
                         f"{r.get('wall_s', float('nan')):.0f} | {r.get('load_1min', float('nan')):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/pull_codec"))
    parser.add_argument("--from", dest="runs", type=Path, default=None, help="runs already made (their folder)")
    parser.add_argument("--model", default="micro")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--codecs", default="fp32,int8,int4,bf16")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated cases to run and tabulate [{','.join(CASES)}; --benchmark default: "
                             f"{','.join(DEFAULT_CASES)}]")
    parser.add_argument("--benchmark", choices=["study", "default"], default="study",
                        help="study: 3 islands of speeds 1,1,0.5 on --model for --steps; default: the default "
                             "benchmark (module docstring) [study]")
    args = parser.parse_args(argv)
    codecs = args.codecs.split(",")
    known = DEFAULT_CASES if args.benchmark == "default" else CASES
    cases = args.cases.split(",") if args.cases else list(known)
    if unknown := [c for c in cases if c not in known]:
        parser.error(f"--cases: {', '.join(unknown)} not one of {', '.join(known)} (--benchmark {args.benchmark})")
    runs = args.runs if args.runs is not None else args.out / "runs"
    if args.runs is None:
        for case in cases:
            for codec in codecs:
                if (runs / folder(case, codec) / "bench_timing.json").is_file():
                    continue  # made already (a bench stopped part-way and started again)
                print(f"[pull_codec] {case} {codec}", file=sys.stderr, flush=True)
                timing = run(runs, case, codec, args.model, args.steps)
                (runs / folder(case, codec) / "bench_timing.json").write_text(json.dumps(timing) + "\n")
    rows = {folder(c, k): numbers(runs, c, k) for c in cases for k in codecs}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.benchmark == "default":
        meta = {"benchmark": "default", "common": DEFAULT_COMMON, "cases": {c: DEFAULT_CASES[c] for c in cases}}
        command = "python bench/pull_codec.py --benchmark default"
    else:
        meta = {"model": args.model, "steps": args.steps, "common": COMMON, "cases": {c: CASES[c] for c in cases}}
        command = f"python bench/pull_codec.py --model {args.model} --steps {args.steps}"
    (args.out / "results.json").write_text(json.dumps({"settings": meta, "runs": rows}, indent=1, sort_keys=True)
                                           + "\n")
    text = (f"# decoupled pull codec (`{command}`)\n\n"
            + table(rows, codecs, cases) + "\n")
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
