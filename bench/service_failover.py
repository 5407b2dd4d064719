"""A rank of an island job SIGKILLed: how soon its island is back and pushing, and whether the other island paused.

    python bench/service_failover.py                          # tiny model, island 0: 2 ranks, island 1: 1 rank
    python bench/service_failover.py --model micro --kill-at 60 --out /tmp/service_failover

``atoll syncer`` (plaintext, loopback) and two island jobs: island 0 is ``torchrun --nproc-per-node 2
--max-restarts 1``, island 1 one process (``--other-ranks 2``: a torchrun job too). Rank 1 of island 0 kills
itself with SIGKILL as it starts its ``--kill-at``-th inner step (the collective runtime's test hook, which a
restarted rank does not repeat). The script polls the syncer's ``status.json`` every 0.1 s and the pids of
island 0's ranks every 0.05 s, and records, from the kill:

- ``peer_exit_s``: when island 0's other rank had exited (it noticed its lost peer: its next collective
  failed; or torchrun's agent stopped it);
- ``rejoin_s``: when the restarted job joined the syncer again (a new session, from the newest fragments);
- ``pushing_s``: when a push of the restarted island had been merged (its merged tokens grew);
- the other island's inner steps per second (the steps the syncer granted it, in leases of its H) over the
  ``--window`` seconds before the kill and from the kill to ``pushing_s``, and their ratio.

Targets (issue 23): back and pushing within 30 s; the other island's rate over the outage within 5% of before.
With ``--pin`` (default on a machine of 2 or more CPUs) island 0's job runs on CPU 0 and the syncer and island
1 on the others, so island 0's restart (imports, data, model) does not take island 1's cores; other jobs on
a shared machine still do: its load is written beside the figures. The run is stopped once island 0 pushes
again (the figures are taken; its end is not).

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/service_failover``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atoll.benchmarks.common import default_out, kill_tree, script_error, write_results  # noqa: E402
from bench import service_launch as sl  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model preset [tiny]")
    parser.add_argument("--kill-at", type=int, default=600,
                        help="island 0's inner step its rank 1 dies at [600: a rate over 30 s of steady training "
                        "before it on an idle machine]")
    parser.add_argument("--other-ranks", type=int, default=1, help="ranks of island 1 [1]")
    parser.add_argument("--window", type=float, default=30.0,
                        help="seconds before the kill the rate is taken over [30]")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                        help="island 0 on CPU 0, the rest on the other CPUs [on with 2+ CPUs]")
    parser.add_argument("--repeats", type=int, default=3, help="trials (a median row follows) [3]")
    parser.add_argument("--quorum", type=int, default=None,
                        help="the syncer's quorum [the run's default: every island]")
    parser.add_argument("--grace-window", choices=("round", "slack"), default=None,
                        help="the syncer's grace window [the run's default]")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up a trial after this many seconds [900]")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/service_failover]")
    return parser.parse_args(argv)


def _import_s(env: dict[str, str], pin: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds a fresh process takes to import what an island job imports before it can join
    (torch, transformers, atoll's island): most of a restart on a loaded machine."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([*pin, sys.executable, "-c", "import atoll.runtime.service.island, atoll.job.run"],
                            env=env)
    _, _, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def _rate(samples: list[tuple[float, dict]], start: float, end: float, island: int = 1) -> float:
    """An island's granted inner steps per second between ``start`` and ``end``, from edge to edge: the steps are
    granted in leases of H, so the count is a staircase; the rate is the steps between the first and the last
    grant seen inside the interval over the time between them (a difference of samples at the interval's ends
    would count a lease more or less, +-H steps, by where the ends fall)."""
    edges: list[tuple[float, int]] = []
    last = None
    for t, s in samples:
        if not s.get("steps_by_island"):
            continue
        count = s["steps_by_island"][island]
        if last is not None and count != last and start <= t <= end:
            edges.append((t, count))
        last = count
    if len(edges) < 2 or edges[-1][0] <= edges[0][0]:
        return float("nan")
    return (edges[-1][1] - edges[0][1]) / (edges[-1][0] - edges[0][0])


def _per_push(samples: list[tuple[float, dict]], method: str) -> float:
    """The syncer's calls of ``method`` per ``Push`` over the trial (its last status; ``calls``)."""
    calls = next((s["calls"] for _, s in reversed(samples) if s.get("calls")), {})
    return calls.get(method, 0) / calls["Push"] if calls.get("Push") else float("nan")


def trial(args: argparse.Namespace, tmp: Path, flags: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One run of the scenario (the module docstring); its figures. Raises RuntimeError: no result."""
    port, syncer_out, stamp = sl.free_port(), tmp / "syncer", tmp / "killed"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin0 = ["taskset", "-c", str(cpus[0])] if args.pin and len(cpus) >= 2 else []
    pin1 = ["taskset", "-c", ",".join(map(str, cpus[1:]))] if args.pin and len(cpus) >= 2 else []

    def launch(cmd: list[str], name: str, extra: dict[str, str] | None = None) -> subprocess.Popen:
        return sl.launch(cmd, tmp / f"{name}.log", env, extra)

    def island(i: int) -> list[str]:
        return sl.island_args(i, [f"127.0.0.1:{port}"], syncer_out / "credentials", flags)

    torchrun = sl.TORCHRUN
    procs: list[subprocess.Popen] = []
    samples: list[tuple[float, dict]] = []
    marks: dict[str, float] = {}
    load_before = os.getloadavg()[0]
    import_wall, import_cpu = _import_s(env, pin0)
    try:
        procs.append(launch([*pin1, *sl.syncer_command(syncer_out, f"127.0.0.1:{port}", flags)], "syncer"))
        deadline = time.monotonic() + args.timeout
        while not (syncer_out / "credentials" / "island_1.token").is_file():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the syncer did not start; see {tmp / 'syncer.log'}")
            time.sleep(0.2)
        procs.append(launch([*pin0, *torchrun, "--nproc-per-node", "2", "--max-restarts", "1", "-m", "atoll",
                             *island(0)], "island_0",
                            {"ATOLL_TEST_KILL_RANK_AT_STEP": f"1:{args.kill_at}", "ATOLL_TEST_KILL_STAMP": str(stamp)}))
        other = ([*torchrun, "--nproc-per-node", str(args.other_ranks), "-m", "atoll"] if args.other_ranks > 1
                 else [sys.executable, "-m", "atoll"])
        procs.append(launch([*pin1, *other, *island(1)], "island_1"))
        ranks0: list[int] = []
        merged_at_rejoin = None
        while time.monotonic() < deadline:
            now, s = time.time(), sl.read_status(syncer_out)
            samples.append((now, s))
            if len(ranks0) < 2:
                ranks0 = sl.children(procs[1].pid)
            if stamp.is_file() and "killed" not in marks:
                marks["killed"] = float(stamp.read_text())
            if "killed" in marks and "peer_exit" not in marks and ranks0 and not any(
                    Path(f"/proc/{pid}").exists() for pid in ranks0):
                marks["peer_exit"] = now
            joins = s.get("joins", [0, 0])
            if "killed" in marks and joins[0] >= 2 and "rejoin" not in marks:
                marks["rejoin"], merged_at_rejoin = now, s["merged_tokens_by_island"][0]
            if merged_at_rejoin is not None and s["merged_tokens_by_island"][0] > merged_at_rejoin:
                marks["pushing"] = now
                break
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a process ended early; see the logs in {tmp}")
            time.sleep(0.05 if "killed" in marks and "peer_exit" not in marks else 0.1)
        else:
            raise RuntimeError(f"island 0 was not back and pushing within {args.timeout:g} s; see {tmp}")
    finally:
        for p in procs:  # with torchrun's workers, which run in sessions of their own
            if p.poll() is None:  # (a pid reaped already may name another process by now)
                kill_tree(p.pid)
            p.wait()
    k = marks["killed"]
    before = _rate(samples, k - args.window, k)
    during = _rate(samples, k, marks["pushing"])
    trace = tmp / "trace.json"  # the syncer's status over the trial, for a look at the rates
    trace.write_text(json.dumps([(t, s.get("steps_by_island"), s.get("versions")) for t, s in samples if s]))
    return {"island0_rate_before": _rate(samples, k - args.window, k, island=0),
            "peer_exit_s": marks.get("peer_exit", float("nan")) - k, "rejoin_s": marks["rejoin"] - k,
            "pushing_s": marks["pushing"] - k, "other_rate_before": before, "other_rate_outage": during,
            "other_rate_ratio": during / before if before else float("nan"), "pinned": bool(pin0),
            "import_wall_s": import_wall, "import_cpu_s": import_cpu, "load_before": load_before,
            "buffered_calls_per_push": _per_push(samples, "Buffered"),
            "load_after": os.getloadavg()[0]}


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/service_failover.py [flags]``; the exit status (2: bad flags, 1: no result)."""
    args = parse_args(argv)
    if args.kill_at < 2 or args.other_ranks < 1 or args.repeats < 1:
        return script_error("service_failover", ValueError("kill-at: must be >= 2; other-ranks, repeats: >= 1"))
    out = args.out or default_out("service_failover")
    env = sl.study_env()
    rows = []
    for r in range(args.repeats):
        tmp = Path(tempfile.mkdtemp(prefix="atoll-service-failover-"))
        corpus = sl.write_corpus(tmp / "corpus.txt")
        flags = ["--data", str(corpus), "--cache-dir", str(tmp / "cache"), "--model", args.model, "--vocab-size",
                 "512", "--seq-len", "32", "--batch-size", "4", "--islands", "2", "--steps", "100000",
                 "--sync-every", "10", "--fragments", "2", "--eval-batches", "1", "--threads", "1", "--no-progress",
                 "--collective-timeout-s", "300", *(["--quorum", str(args.quorum)] if args.quorum else []),
                 *(["--grace-window", args.grace_window] if args.grace_window else [])]
        try:
            row = trial(args, tmp, flags, env)
        except RuntimeError as e:
            print(f"service_failover: error: {e}", file=sys.stderr)
            return 1
        rows.append({"trial": str(r + 1), **row})
        print(f"[service_failover] trial {r + 1}: back and pushing {row['pushing_s']:.1f} s after the kill; the "
              f"other island at {row['other_rate_ratio']:.3f} x its rate before (load {row['load_before']:.1f})",
              flush=True)
    keys = [k for k, v in rows[0].items() if isinstance(v, float)]
    median = {"trial": "median", **{k: statistics.median(r[k] for r in rows) for k in keys}}
    from atoll.strategies.decoupled import DecoupledConfig

    grace = args.grace_window or DecoupledConfig.model_fields["grace_window"].default
    machine = {"cpus": os.cpu_count(), "threads": 1, "model": args.model, "quorum": args.quorum,
               "grace_window": grace, "island0_ranks": 2,
               "island1_ranks": args.other_ranks, "kill_at_step": args.kill_at, "pinned": rows[0]["pinned"]}
    pinned = "pinned to CPU 0, the syncer and island 1 to the others" if rows[0]["pinned"] else "not pinned"
    columns = [("trial", "trial"), ("load (1 min) before", "load_before"), ("peer rank exited, s", "peer_exit_s"),
               ("rejoined, s", "rejoin_s"), ("back and pushing, s", "pushing_s"),
               ("island 0 steps/s before", "island0_rate_before"),
               ("other island steps/s before", "other_rate_before"), ("over the outage", "other_rate_outage"),
               ("ratio", "other_rate_ratio"), ("Buffered calls per push", "buffered_calls_per_push"),
               ("a fresh process's imports, s wall", "import_wall_s"),
               ("s CPU", "import_cpu_s")]
    quorum = f"quorum {args.quorum}" if args.quorum else "quorum: every island (the default)"
    default = "" if args.grace_window else " (the default)"
    notes = [f"{args.model} model, {quorum}, grace window {grace}{default}; island 0: 2 ranks (torchrun "
             "--max-restarts 1), rank 1 SIGKILLed at "
             f"inner step {args.kill_at}; island 1: {args.other_ranks} rank(s); seconds from the kill. The other "
             "island's rate: inner steps the syncer granted it per second, over the "
             f"{args.window:g} s before the kill and from the kill until island 0 pushed again (granted in leases "
             "of its H = 10 steps: from the first grant to the last inside each interval). A fresh process's "
             "imports (torch, transformers, atoll's island; measured before each trial): most of a restart when "
             "the machine is loaded.",
             "targets: back and pushing within 30 s; the other island's rate over the outage within 5% of before. "
             f"Island 0 {pinned}; machine: {machine['cpus']} CPUs, shared with other jobs (their load is in the "
             "table)."]
    print(write_results(out, {"machine": machine, "trials": rows, "median": median}, columns, [*rows, median],
                        title="A rank SIGKILLed: back and pushing, and the other island "
                        "(`python bench/service_failover.py`)", notes=notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
