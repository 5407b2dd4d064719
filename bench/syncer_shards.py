"""The decoupled syncer's merge time per window: one syncer against the same fragments sharded over N processes.

    OMP_NUM_THREADS=1 python bench/syncer_shards.py                  # 125m preset, P = 12, K = 2, N = 1, 2, 4
    python bench/syncer_shards.py --model 20m --fragments 4 --trials 1 --out /tmp/shards   # a quick look
    python bench/syncer_shards.py --report        # rebuild results.md from results.json

What one shard does per window, timed on the CPU with one torch thread per shard process, as ``atoll syncer``
does it (:class:`~atoll.strategies.decoupled.syncer.Syncer` over the shard's own fragments, built by
:func:`~atoll.runtime.decoupled_job.syncer_of` with the run's defaults): for each fragment it owns, each of the
K islands' pushes is decoded from the run's codec (int4 by default, as it arrives on the wire) and handed to
the syncer (its checks: form, identity, freshness, the token and norm bounds), and the quorum's push merges
the fragment (the token-weighted mean and the outer Nesterov step). The K payloads are encoded once before the
timing (an island's cost, not the syncer's). The model is the preset's shapes (``--vocab`` tokens, tied head)
cut into fragments as a run cuts them (:func:`~atoll.strategies.base.model_fragments`), each shard owning the
fragments :func:`~atoll.runtime.service.syncer_shards.shard_map` gives it; the values are random (the
merge's cost does not depend on them).

The N shard processes start each window together (a barrier) and run at once; a window's time is the slowest
shard's (the islands wait for the last fragment). The first window is a warm-up; the median of the others is
reported beside each shard's own CPU seconds, the cores the shards had (their CPU seconds over the wall
seconds), and the 1-minute load average before and after (the machine is shared: its 2 cores run other jobs, and
N shards can gain at most the cores that are free; each shard runs in a session of its own, as a shard started as
a command of its own does, unless ``--one-session``). Every shard count is measured ``--trials`` times, the counts
interleaved, and each speed-up is a ratio to the one-syncer run of the same trial. From the measured CPU seconds
per parameter, the table projects the window of a 12B model on one thread and on N shards' own cores (linear:
the merge is per parameter).

Writes ``results.json`` (every window of every shard) and ``results.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: the paper's 12B model, for the projection (parameters)
PAPER_PARAMS = 12e9


def load() -> float:
    return os.getloadavg()[0]


def fragments_of(model: str, vocab: int, fragments: int) -> list[Any]:
    """The run's fragments (:class:`~atoll.algorithms.fragments.FlatFragment`) of the preset ``model``'s shapes."""
    from atoll.job.model import build_model
    from atoll.strategies.base import model_fragments

    meta = build_model(model, vocab, 256, 0, meta=True)  # shapes only, no storage
    return model_fragments([(n, tuple(p.shape)) for n, p in meta.named_parameters()], fragments)


def shard_worker(shard: int, shards: int, args: dict[str, Any], barrier: Any, results: Any) -> None:
    """One shard: its syncer over its fragments, then ``windows`` windows, each after the barrier."""
    if args["own_session"]:  # a shard started as a command of its own (Linux schedules sessions fairly)
        os.setsid()
    import torch

    torch.set_num_threads(1)
    from atoll.config import TrainConfig
    from atoll.runtime.decoupled_job import syncer_of
    from atoll.runtime.service.syncer_shards import owned, shard_map
    from atoll.strategies.base import codec_of
    from atoll.strategies.decoupled.protocol import Push

    index = fragments_of(args["model"], args["vocab"], args["fragments"])
    numels = [f.numel() for f in index]
    mine = owned(shard_map(numels, shards), shard)
    config = TrainConfig(strategy="decoupled", islands=args["islands"], fragments=args["fragments"],
                         codec=args["codec"], steps=100, sync_every=max(args["fragments"], 24), model=args["model"])
    gen = torch.Generator().manual_seed(shard)
    sizes = [numels[p] for p in mine]
    init = torch.empty(sum(sizes)).normal_(0, 0.02, generator=gen)
    from atoll.algorithms.fragments import FlatFragment

    local, start = [], 0
    for n in sizes:
        local.append(FlatFragment(((start, start + n),)))
        start += n
    syncer = syncer_of(config, init, local)
    del init
    codec = codec_of(config.strategy_config)
    for island in range(args["islands"]):
        syncer.grant(island, 10 ** 15)
    # the islands' pushes as they arrive: the codec's payload of a small Δ per island and fragment
    payloads = [[codec.encode(torch.empty(n).normal_(0, 1e-3, generator=gen)) for n in sizes]
                for _ in range(args["islands"])]
    times, cpu = [], []
    for w in range(args["windows"] + 1):
        barrier.wait()
        t0, c0 = time.perf_counter(), time.process_time()
        for j in range(len(mine)):
            for island in range(args["islands"]):
                delta = codec.decode(payloads[island][j])
                result = syncer.push(Push(island, j, delta, 1000, syncer.version(j)), now=float(w))
                assert result.accepted, result.reason
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert syncer.commits == (args["windows"] + 1) * len(mine)
    results.put({"shard": shard, "fragments": mine, "params": sum(sizes), "window_s": times, "cpu_s": cpu})


def measure(shards: int, args: dict[str, Any]) -> dict[str, Any]:
    """N shard processes at once: every shard's window times, and each window's time (the slowest shard's)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(shards), ctx.Queue()
    procs = [ctx.Process(target=shard_worker, args=(s, shards, args, barrier, results)) for s in range(shards)]
    before = load()
    for p in procs:
        p.start()
    out = [results.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"a shard process exited with {p.exitcode}"
    out.sort(key=lambda r: r["shard"])
    windows = [max(r["window_s"][w] for r in out) for w in range(args["windows"] + 1)][1:]  # warm-up dropped
    cpu = [max(r["cpu_s"][w] for r in out) for w in range(args["windows"] + 1)][1:]
    return {"shards": shards, "per_shard": out, "window_s": windows, "median_s": statistics.median(windows),
            "best_s": min(windows), "cpu_s": cpu, "median_cpu_s": statistics.median(cpu),
            "load_before": before, "load_after": load()}


def autogroup() -> bool | None:
    """Does the kernel schedule by session (``sched_autogroup_enabled``)? None where it does not say."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def cores_used(run: dict[str, Any]) -> float:
    """The cores a run's shards had, median over its timed windows: their CPU seconds over the window's wall."""
    per_window = [sum(r["cpu_s"][w] for r in run["per_shard"]) / run["window_s"][w - 1]
                  for w in range(1, len(run["window_s"]) + 1)]
    return statistics.median(per_window)


def report(summary: dict[str, Any], out: Path) -> str:
    """Write ``results.json`` (``summary``: the settings and every run) and ``results.md`` (the table) in ``out``;
    return the table."""
    runs, params = summary["runs"], summary["params"]
    counts = sorted({r["shards"] for r in runs})
    by_n = {n: [r for r in runs if r["shards"] == n] for n in counts}
    ones = by_n[1]
    per_param = statistics.median(r["median_cpu_s"] for r in ones) / params  # one thread's CPU s per parameter
    summary["ns_per_param_one_thread"] = per_param * 1e9
    rows, table = [], []
    for n in counts:
        rs = by_n[n]
        wall_ratio = [one["median_s"] / r["median_s"] for one, r in zip(ones, rs, strict=True)]
        cpu_ratio = [one["median_cpu_s"] / r["median_cpu_s"] for one, r in zip(ones, rs, strict=True)]
        loads = [x for r in rs for x in (r["load_before"], r["load_after"])]
        largest = max(p["params"] for p in rs[0]["per_shard"])
        row = {"shards": n, "largest_shard_params": largest,
               "wall_s": statistics.median(r["median_s"] for r in rs), "wall_speedup": statistics.median(wall_ratio),
               "wall_speedup_range": [min(wall_ratio), max(wall_ratio)],
               "cpu_s": statistics.median(r["median_cpu_s"] for r in rs), "cpu_speedup": statistics.median(cpu_ratio),
               "cores_used": statistics.median(cores_used(r) for r in rs), "load_range": [min(loads), max(loads)],
               "projected_12b_min": PAPER_PARAMS * per_param / 60 * largest / params}
        rows.append(row)
        table.append(f"| {n} | {largest / 1e6:.1f} | {row['wall_s']:.2f} | {row['wall_speedup']:.2f} "
                     f"({min(wall_ratio):.2f}-{max(wall_ratio):.2f}) | {row['cpu_s']:.2f} | {row['cpu_speedup']:.2f} | "
                     f"{row['cores_used']:.2f} | {min(loads):.1f}-{max(loads):.1f} | {row['projected_12b_min']:.1f} |")
    summary["rows"] = rows
    command, trials, windows = summary["command"], summary["trials"], summary["windows"]
    text = "\n".join([
        f"### The syncer's merge per window: one syncer against N shards (`{command}`)",
        "",
        "| shards | largest shard, M params | wall s per window | wall speed-up over 1 (range) | slowest shard's "
        "CPU s per window | CPU speed-up over 1 | cores the shards had | load (1 min) | projected min per window "
        "at 12B, N shards on cores of their own |",
        "|---|---|---|---|---|---|---|---|---|",
        *table,
        "",
        f"- {summary['model']} preset shapes with a {summary['vocab']:,}-token vocabulary (tied head): "
        f"{params / 1e6:.1f} M parameters in {summary['fragments']} fragments; per window, K = {summary['islands']} "
        f"islands' {summary['codec']} pushes per fragment decoded, checked and merged (token-weighted mean, outer "
        "Nesterov step), as a shard's `atoll syncer` does (its checkpoint after each commit, written by another "
        "thread, and the gRPC transfers are not in the timing); one torch thread per shard process; a window is "
        "its slowest shard's.",
        f"- {trials} trials, each the {', '.join(map(str, counts))} shard counts one after the other; per trial the "
        f"median of {windows} windows after one warm-up; the table gives the median over the trials, and the "
        "speed-ups are the median (and range) of each trial's ratio to its own one-syncer run.",
        "- wall: what the islands wait for on this machine; CPU: the slowest shard's own CPU seconds, what its window "
        "takes on a core of its own; cores the shards had: their CPU seconds over the wall seconds (1.0 = one "
        "whole core).",
        f"- one thread merges {per_param * 1e9:.1f} ns (CPU) per parameter here: a 12B model's window would take "
        f"{PAPER_PARAMS * per_param / 60:.1f} min on one thread; the last column scales it by the largest shard's "
        "share of the parameters (shards on hosts or cores of their own; the merge is per parameter).",
        f"- machine: {summary['cpus']} CPU cores shared with other developers' jobs (the load range above). The "
        f"shards together can use at most the {summary['cpus']} cores (the cores column), so on an idle machine the "
        f"wall time could fall at most {summary['cpus']}x; on a busy one each session gets a share of it, so N shards "
        "in N sessions take N shares from the other jobs (more shards than cores can still gain wall time here): "
        "the wall speed-ups are this machine's at this load, the CPU speed-ups what shards on cores of their own "
        "give.",
        ("- each shard process in a session of its own, as shards started as commands of their own are: the kernel "
         "schedules by session (autogroup), so N shards have N shares of a busy machine"
         if summary["own_session"] else
         "- every shard process in this command's session: under the kernel's autogroup scheduling they share one "
         "session's share of a busy machine, as one syncer did, and the wall time cannot fall")
        + f" (sched_autogroup_enabled: {summary['autogroup']}).",
        "",
    ])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="125m")
    parser.add_argument("--vocab", type=int, default=32000, help="the model's vocabulary (tokens)")
    parser.add_argument("--fragments", type=int, default=12)
    parser.add_argument("--islands", type=int, default=2, help="K: pushes per fragment per window (the quorum)")
    parser.add_argument("--codec", default="int4")
    parser.add_argument("--shards", default="1,2,4")
    parser.add_argument("--windows", type=int, default=5, help="windows timed after one warm-up window")
    parser.add_argument("--trials", type=int, default=3, help="rounds of every --shards count, one after the other")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "syncer_shards")
    parser.add_argument("--report", action="store_true", help="only rebuild results.md from --out's results.json")
    parser.add_argument("--one-session", action="store_true",
                        help="the shard processes in this command's session (one share of the CPU for them all, under "
                        "Linux's autogroup scheduling), not each in a session of its own")
    a = parser.parse_args()
    if a.report:
        print(report(json.loads((a.out / "results.json").read_text()), a.out))
        return
    args = {k: getattr(a, k) for k in ("model", "vocab", "fragments", "islands", "codec", "windows")}
    args["own_session"] = not a.one_session
    params = sum(f.numel() for f in fragments_of(a.model, a.vocab, a.fragments))
    counts = [int(x) for x in a.shards.split(",")]
    if counts[0] != 1:
        parser.error("shards: list 1 first (the unsharded syncer every ratio is over)")
    defaults = a.shards == "1,2,4" and a.model == "125m" and a.windows == 5 and a.trials == 3
    command = "OMP_NUM_THREADS=1 python bench/syncer_shards.py" + ("" if defaults else (
        f" --model {a.model} --vocab {a.vocab} --fragments {a.fragments} --shards {a.shards} --windows {a.windows}"
        f" --trials {a.trials}")) + (" --one-session" if a.one_session else "")
    summary: dict[str, Any] = {"command": command, "model": a.model, "vocab": a.vocab, "params": params,
                               "fragments": a.fragments, "islands": a.islands, "codec": a.codec,
                               "cpus": os.cpu_count(), "trials": a.trials, "windows": a.windows,
                               "own_session": not a.one_session, "autogroup": autogroup(), "runs": []}
    for trial in range(a.trials):  # interleaved: a trial's N shards ran right after its one syncer
        for n in counts:
            run = {**measure(n, args), "trial": trial}
            summary["runs"].append(run)
            print(f"trial {trial}: {n} shard(s): median {run['median_s']:.3f} s per window wall, slowest shard's "
                  f"CPU {run['median_cpu_s']:.3f} s, {cores_used(run):.2f} cores; load {run['load_before']:.1f} -> "
                  f"{run['load_after']:.1f}", flush=True)
    print(report(summary, a.out))


if __name__ == "__main__":
    main()
