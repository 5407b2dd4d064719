"""How long a checkpoint stops training: written in the foreground against ``--async-checkpoint``, same run.

    python bench/async_checkpoint.py                       # 20m, 2 islands x 1 rank, writes bench/out/async_checkpoint/
    python bench/async_checkpoint.py --model micro --trials 1 --out /tmp/ac   # a quick look

Each trial trains the same collective run twice, interleaved (foreground, then background): ``--islands`` x
``--ranks-per-island`` ranks, one torch thread each, a checkpoint every ``--every`` inner steps. For each
periodic checkpoint (not the last, which is always written in the foreground) the run's ``checkpoint`` event
gives ``blocked_s``: the seconds rank 0's training thread stood still for it (the foreground: the whole write
and the ranks' agreement; the background: the copies to host buffers and any wait for the one before), and
``write_s``: the background thread's seconds. Also the run's wall seconds and its final evaluation loss (equal
in both: the same arithmetic).

On this 2-core machine the writer thread competes with the ranks for the cores (on a GPU host it has a core of
its own), so the ratio of wall times understates what the background gains there; ``blocked_s`` is the stall
itself. Each run's checkpoints are removed once read. Writes ``results.json`` and ``results.md`` with the
1-minute load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from atoll.benchmarks.common import command_line, write_results


def _load() -> float:
    return os.getloadavg()[0]


def _train(out: Path, args: argparse.Namespace, background: bool) -> dict:
    flags = ["--runtime", "collective", "--islands", str(args.islands), "--ranks-per-island",
             str(args.ranks_per_island), "--model", args.model, "--steps", str(args.steps), "--sync-every",
             str(args.every), "--checkpoint-every", str(args.every), "--eval-every", str(args.steps),
             "--eval-batches", "1", "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--threads", "1", "--no-progress", "--out", str(out)]
    if args.shard_island:
        flags.append("--shard-island")
    if background:
        flags.append("--async-checkpoint")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before, t0 = _load(), time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", *flags], capture_output=True, text=True,
                       env=env, timeout=3600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"async_checkpoint: the run in {out} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    checkpoints = [e for e in events if e.get("event") == "checkpoint" and e["step"] < args.steps]
    summary = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out / "checkpoints")  # hundreds of MB per run at 20m: the figures are in the events
    return {"background": background, "wall_s": wall, "load_before": before, "load_after": _load(),
            "blocked_s": [e["blocked_s"] for e in checkpoints], "write_s": [e.get("write_s") for e in checkpoints],
            "steps": [e["step"] for e in checkpoints], "final_eval_loss": summary["final_eval_loss"],
            "params": summary["params"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="20m")
    parser.add_argument("--islands", type=int, default=2)
    parser.add_argument("--ranks-per-island", type=int, default=1)
    parser.add_argument("--shard-island", action="store_true")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4, help="inner steps between checkpoints (and exchanges)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/out/async_checkpoint"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for trial in range(args.trials):
        for background in (False, True):
            folder = args.out / f"trial{trial}-{'background' if background else 'foreground'}"
            if folder.exists():
                shutil.rmtree(folder)
            runs.append({"trial": trial, **_train(folder, args, background)})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "write_s"}), flush=True)
    rows = []
    for background in (False, True):
        mine = [r for r in runs if r["background"] == background]
        blocked = [b for r in mine for b in r["blocked_s"]]
        writes = [w for r in mine for w in r["write_s"] if w is not None]
        rows.append({"mode": "background (--async-checkpoint)" if background else "foreground",
                     "checkpoints": len(blocked), "blocked": statistics.median(blocked),
                     "write": statistics.median(writes) if writes else None,
                     "wall": statistics.median(r["wall_s"] for r in mine),
                     "loss": mine[0]["final_eval_loss"],
                     "load": ", ".join(f"{r['load_before']:.1f}-{r['load_after']:.1f}" for r in mine)})
    rows[1]["ratio"] = rows[1]["blocked"] / rows[0]["blocked"]
    same_loss = len({r["final_eval_loss"] for r in runs}) == 1
    params = runs[0]["params"]
    notes = [f"Command: `{command_line('async_checkpoint.py')}`; {args.model} ({params / 1e6:.1f}M parameters), "
             f"{args.islands} islands x {args.ranks_per_island} rank(s){', sharded' if args.shard_island else ''}, "
             f"{args.steps} steps, a checkpoint (and an exchange) every {args.every}, {args.trials} trial(s) "
             "interleaved; one torch thread per rank.",
             "blocked: median seconds rank 0's training thread stood still per periodic checkpoint; write: the "
             "background thread's seconds (its part, then the commit); wall: the whole run's seconds.",
             f"Final evaluation loss equal in every run: {same_loss}.",
             "Load: the 1-minute load average of this 2-core machine before-after each run."]
    table = write_results(args.out, {"settings": vars(args) | {"out": str(args.out)}, "runs": runs, "rows": rows},
                          [("mode", "mode"), ("periodic checkpoints", "checkpoints"),
                           ("blocked s (median)", "blocked", lambda v: f"{v:.3f}"),
                           ("background / foreground", "ratio", lambda v: f"{v:.3f}"),
                           ("write s (median)", "write", lambda v: f"{v:.3f}"),
                           ("run wall s (median)", "wall", lambda v: f"{v:.1f}"),
                           ("final eval loss", "loss", lambda v: f"{v:.6f}"), ("load", "load")],
                          rows, title="Checkpoint stall, foreground against background", notes=notes)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
