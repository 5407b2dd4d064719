"""The same summary numbers, bit for bit, before and after a change that must not change behaviour.

    python bench/same_numbers.py --write     # record the reference (on the code before the change)
    python bench/same_numbers.py             # run the same set again and compare with the reference
    python bench/same_numbers.py --only sparseloco --write   # record (or compare) some runs; the others kept

A fixed set of small runs through the ``atoll train`` command (micro model, 512-token vocabulary, a few
dozen inner steps, one torch thread): ddp, diloco, streaming int4 with error feedback, demo, sparseloco,
decoupled with failures and unequal speeds, the collective runtime with 2 islands x 2 ranks, and for each a
resume (the
run's folder as it was at its half-way checkpoint, then ``--resume`` to the end, which must give the whole
run's numbers). Every number of every ``summary.json`` that does not measure time is compared exactly
(floats as their ``repr``); measured seconds (``wall_s``, ``compute_s``, ``codec_s``, ``startup_s``,
``eval_s``, ``outer_s``, and the ``sim_wall_s`` and utilization of the lockstep strategies, whose clock adds
measured compute and codec seconds) and the host memory measured at start-up differ from run to run and are
left out. The reference lives in ``bench/out/same_numbers/reference.json`` of the repository
(``--out``: another folder); the comparison is written to ``bench/out/same_numbers/results.md``. Exit status 1
when a number differs. ``--only NAME,NAME`` runs those runs (and their resumes) alone: compared with their
entries of the reference, or with ``--write`` recorded into it with every other entry left as it was (a change
that means to change one strategy's numbers re-records that strategy's only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import default_out

COMMON = ["--model", "micro", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--threads", "1",
          "--no-progress", "--eval-every", "10", "--eval-batches", "2", "--seed", "3"]
STEPS = 40

#: name -> flags on top of COMMON (each run also checkpoints half-way for its resume)
RUNS: dict[str, list[str]] = {
    "ddp": ["--strategy", "ddp", "--islands", "2"],
    "diloco": ["--strategy", "diloco", "--islands", "3", "--sync-every", "10", "--outer-lr", "0.7",
               "--outer-momentum", "0.9"],
    "streaming_int4_ef": ["--strategy", "streaming", "--islands", "2", "--sync-every", "10", "--fragments", "2",
                          "--overlap-steps", "2", "--mixing-alpha", "0.5", "--codec", "int4", "--error-feedback",
                          "--codec-rounding", "stochastic"],
    "demo": ["--strategy", "demo", "--islands", "2", "--demo-topk", "8", "--demo-chunk", "16"],
    # three islands: the median-norm clip takes the middle one's norm
    "sparseloco": ["--strategy", "sparseloco", "--islands", "3", "--sync-every", "10", "--sparseloco-chunk", "1024",
                   "--sparseloco-topk", "16"],
    "decoupled_chaos_speeds": ["--strategy", "decoupled", "--islands", "3", "--sync-every", "8", "--fragments", "2",
                               "--island-speeds", "1,0.5,1", "--chaos", "1.5:0.3", "--codec", "int8",
                               "--sim-step-s", "0.1"],
    "collective_2x2": ["--strategy", "diloco", "--runtime", "collective", "--islands", "2",
                       "--ranks-per-island", "2", "--sync-every", "10"],
}

#: summary keys that hold measured time (or depend on it) in the runs where time is real or measured, and the
#: host memory measured at start-up (``startup_host_bytes``: what the process holds, not what it computed)
TIMED = {"wall_s", "compute_s", "sim_wall_s", "compute_utilization", "measured_compute_s", "strategy_s", "out",
         "codec_s", "startup_s", "merge_s", "eval_s", "outer_s", "startup_host_bytes"}
#: decoupled's clock is simulated with a fixed step: its times are deterministic and compared
DETERMINISTIC_CLOCK = {"decoupled"}


def _train(args: list[str], cwd: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["atoll", "train", *args], cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0:
        raise SystemExit(f"atoll train {' '.join(args)} failed ({r.returncode}): {r.stderr[-1500:]}")
    flag = "--out" if "--out" in args else "--resume"
    out = Path(cwd) / args[args.index(flag) + 1]
    return json.loads((out / "summary.json").read_text())


def numbers(summary: dict[str, Any]) -> dict[str, str]:
    """The comparable numbers of a summary, flattened to ``key[.sub] -> repr``."""
    timed = TIMED - ({"compute_s", "sim_wall_s", "compute_utilization"}
                     if summary.get("strategy") in DETERMINISTIC_CLOCK else set())
    flat: dict[str, str] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)
        else:
            flat[prefix] = repr(v)

    for key, value in summary.items():
        if key not in timed:
            walk(key, value)
    return flat


def run_all(cwd: Path, names: Sequence[str] | None = None) -> dict[str, dict[str, str]]:
    """The runs ``names`` of :data:`RUNS` (all by default), whole and resumed; their comparable numbers."""
    results: dict[str, dict[str, str]] = {}
    for name in names or list(RUNS):
        flags = RUNS[name]
        print(f"[same_numbers] {name}", file=sys.stderr, flush=True)
        whole = _train([*COMMON, *flags, "--steps", str(STEPS), "--checkpoint-every", str(STEPS // 2),
                        "--out", f"{name}"], cwd)
        results[name] = numbers(whole)
        # the resume: the same run's folder as it was at its half-way checkpoint (later ones removed), then
        # --resume; an exact resume ends with the whole run's numbers
        half = cwd / f"{name}_resumed"
        shutil.copytree(cwd / name, half, symlinks=True)  # checkpoints/latest is a link
        for ckpt in (half / "checkpoints").glob("step_*"):
            if int(ckpt.name.split("_")[1]) > STEPS // 2:
                shutil.rmtree(ckpt)
        (half / "checkpoints" / "latest").unlink()
        resumed = _train(["--resume", half.name, "--no-progress"], cwd)
        results[f"{name}_resumed"] = numbers(resumed)
    return results


def compare(reference: dict[str, dict[str, str]], now: dict[str, dict[str, str]]) -> list[str]:
    """Lines naming every number that differs (or is missing on one side)."""
    diffs = []
    for run in sorted(set(reference) | set(now)):
        a, b = reference.get(run, {}), now.get(run, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{run}: {key}: reference {a.get(key, '(absent)')} now {b.get(key, '(absent)')}")
    return diffs


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/same_numbers.py [--write] [--out DIR]``; the exit status (1: a number differs)."""
    out = default_out("same_numbers")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the reference instead of comparing")
    parser.add_argument("--out", type=Path, default=out, help=f"folder of the reference and results [{out}]")
    parser.add_argument("--only", default=None, help=f"comma-separated runs of {', '.join(RUNS)} (and their "
                        "resumes): only these, the reference's other entries kept [all]")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        print(f"same_numbers: error: only: {unknown[0] if unknown else 'no run'} is not a run; pass --only with "
              f"some of {', '.join(RUNS)}", file=sys.stderr)
        return 2
    ref_path = args.out / "reference.json"
    if not args.write and not ref_path.is_file():  # said before the runs, not after them
        print(f"same_numbers: error: out: no reference at '{ref_path}'; record one with --write (on the code "
              "before the change) or pass the --out that holds it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as cwd:
        now = run_all(Path(cwd), names)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.write:
        kept = json.loads(ref_path.read_text()) if args.only and ref_path.is_file() else {}
        ref_path.write_text(json.dumps({**kept, **now}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {ref_path}: {sum(len(v) for v in now.values())} numbers of {len(now)} runs"
              + (f" ({len(kept)} other entries kept)" if kept else ""))
        return 0
    reference = json.loads(ref_path.read_text())
    if args.only:
        reference = {run: v for run, v in reference.items() if run in now}
    diffs = compare(reference, now)
    total = sum(len(v) for v in reference.values())
    command = " ".join(["python bench/same_numbers.py", *(["--only", args.only] if args.only else [])])
    lines = [f"### Same numbers (`{command}`)", "",
             f"{len(reference)} runs, {total} numbers compared with the reference: "
             + ("all equal, bit for bit." if not diffs else f"{len(diffs)} differ:"), ""]
    lines += [f"- {d}" for d in diffs]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if diffs else 0


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
