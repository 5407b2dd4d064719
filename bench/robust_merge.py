"""The robust merges of the decoupled syncer, against one hostile island and on clean runs: loss and merge time.

    python bench/robust_merge.py                               # micro, 5 islands, 200 inner steps each
    python bench/robust_merge.py --steps 40 --out /tmp/rm     # a smoke run

For each ``--robust-merge`` (none, clip, trimmed_mean, median; :mod:`atoll.algorithms.robust`) two decoupled
runs of the local runtime (5 islands, full quorum; the run's other settings from the flags): a clean one,
and one where island 4 is hostile (:func:`flip_pushes`): every push of its carries its honest Δ
sign-flipped and scaled by ``--scale`` (5: within the syncer's norm bound of 10x, so each push is accepted,
as the finite, in-bound attack of issue 12). Reported: the final eval loss of each, the syncer's seconds
computing merges (``merge_s``, measured: the robust merge's cost; not the simulated clock) and pushes
accepted and refused. Beside them, each merge alone: the median seconds of 21 merges of 5 float32 pushes of
one fragment's size (``merge_one_s``, one thread), less noisy than a run's total on a shared machine. The
data are ``--data`` (default the stdlib corpus of the benchmarks).

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/robust_merge``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import default_out, script_error, write_results
from atoll.errors import ConfigError

MERGES = ("none", "clip", "trimmed_mean", "median")


def flip_pushes(syncer: Any, island: int, scale: float) -> None:
    """Make ``island`` hostile at ``syncer``: each of its pushes carries −``scale`` x its honest Δ (float32),
    through the syncer's own :meth:`~atoll.strategies.decoupled.syncer.Syncer.push` (validated as any)."""
    honest_push: Callable[..., Any] = syncer.push

    def push(msg: Any, now: float = 0.0, **facts: Any) -> Any:  # the runtime's own facts (norm, owned) kept
        if msg.island == island:
            msg = replace(msg, delta=-scale * msg.delta)
        return honest_push(msg, now, **facts)

    syncer.push = push


def time_merges(numel: int, pushes: int = 5, repeats: int = 21) -> dict[str, float]:
    """Per merge method, the median seconds of ``repeats`` merges of ``pushes`` float32 tensors (numel,)."""
    import statistics
    import time

    import torch

    from atoll.algorithms.robust import robust_mean

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(numel, generator=gen) for _ in range(pushes)]
    weights = [1.0] * pushes
    out = {}
    for merge in MERGES:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            robust_mean(deltas, weights, merge)
            times.append(time.perf_counter() - t0)
        out[merge] = statistics.median(times)
    return out


def train(settings: dict[str, Any], hostile: int | None, scale: float) -> dict[str, Any]:
    """One decoupled run of the local runtime with ``settings`` (TrainConfig fields), island ``hostile``
    flipping its pushes (None: a clean run); its summary."""
    from atoll.config import TrainConfig
    from atoll.job.divergence import until_diverged
    from atoll.job.run import Run
    from atoll.runtime.events import Simulation

    config = TrainConfig(**settings)
    run = Run(config)
    sim = Simulation.of_run(config, run)
    if hostile is not None:
        flip_pushes(sim.syncer, hostile, scale)
    run.begin(restore=sim.restore)
    sim.diverged = until_diverged(sim.run_events, False)
    return sim.finish()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="inner steps per island [200]")
    parser.add_argument("--model", default="micro", help="model preset [micro]")
    parser.add_argument("--scale", type=float, default=5.0, help="the hostile island's factor [5]")
    parser.add_argument("--data", default=None, help="a text corpus [the benchmarks' stdlib corpus]")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/robust_merge]")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Train the runs, write ``results.json`` and ``results.md``; the exit status."""
    try:
        args = parse_args(argv)
        out = args.out or default_out("robust_merge")
        base = {"strategy": "decoupled", "runtime": "local", "islands": 5, "model": args.model, "vocab_size": 512,
                "seq_len": 32, "batch_size": 4, "steps": args.steps, "sync_every": 10, "fragments": 2,
                "eval_batches": 4, "threads": 1, "progress": False, "seed": 0, "codec": "fp32",
                "merge_average": "mean"}  # the coordinate-wise rules average coordinates
        if args.data:
            base["data"] = args.data
        rows = []
        for merge in MERGES:
            for hostile in (None, 4):
                name = f"{merge}_{'attacked' if hostile is not None else 'clean'}"
                s = train({**base, "robust_merge": merge, "out": str(out / name)}, hostile, args.scale)
                rows.append({"run": name, "robust_merge": merge, "hostile_island": hostile,
                             "final_eval_loss": s["final_eval_loss"], "merge_s": s["merge_s"],
                             "commits": s["commits"], "accepted_updates": s["accepted_updates"],
                             "rejected_updates": s["rejected_updates"],
                             "fragment_numel": round(s["params"] / base["fragments"])})
                print(f"{name}: loss {s['final_eval_loss']:.4f}, merge {s['merge_s'] * 1e3:.1f} ms", flush=True)
        numel = rows[0].pop("fragment_numel")
        one = time_merges(numel)
        for row in rows:
            row.pop("fragment_numel", None)
            row["merge_one_s"] = one[row["robust_merge"]]
            row["merge_one_ms"] = 1e3 * row["merge_one_s"]
        results = {"settings": {**base, "scale": args.scale}, "fragment_numel": numel, "runs": rows}
        columns = [("run", "run"), ("final eval loss", "final_eval_loss"), ("merge s", "merge_s"),
                   ("one merge ms", "merge_one_ms"),
                   ("commits", "commits"), ("accepted", "accepted_updates"), ("refused", "rejected_updates")]
        print(write_results(out, results, columns, rows, title="robust merges: clean and with island 4 hostile"))
        return 0
    except (ConfigError, ValueError) as e:  # bad input: one line, exit status 2
        return script_error("robust_merge", e)


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
