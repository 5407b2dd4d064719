"""A storm, measured: a sharded syncer and six island jobs on loopback under a seeded fault injector, against the
failure-free run of the same settings (``python bench/service_soak.py``).

    python bench/service_soak.py                                   # 20 minutes, 60 faults per hour, then the baseline
    python bench/service_soak.py --minutes 3 --faults-per-hour 120 --out bench/out/service_soak/smoke

Two ``atoll syncer`` shards (``--shard 0/1 --shards``, plaintext on loopback, each in a session of its own) and six
``atoll island`` jobs, each a ``torchrun --max-restarts`` job (islands 0, 2, 4 of 2 ranks, 1, 3, 5 of one), with
the speeds of ``bench/service_soak.toml`` (1, 1, 0.5, 0.5, 0.25, 0.25: an island of speed s pushes every s x H
inner steps). The speeds are made real here, as slower hardware would make them: each island job runs with
``--emulate-step-s`` of ``--step-s`` / its speed, so each of its inner steps lasts at least that long (it waits out
the rest; on one shared host the jobs' own rates differ otherwise: a 2-rank job, a 1-rank job, the host's load).
``--step-s`` must exceed a speed-1 island's own step time on the loaded host. The run's budget (``--steps``) is
sized so the failure-free run takes about ``--minutes``.

The fault injector (``random.Random(--seed)``, exponential gaps at ``--faults-per-hour``, from the moment every
island has joined until 85% of the budget is granted) draws one of:

- ``rank``: SIGKILL one rank of a random island; torchrun's agent restarts the job (``--max-restarts``);
- ``island``: SIGKILL a whole island job (agent and ranks); the harness starts the same command again;
- ``stop``: SIGSTOP a whole island job for ``--stop-s`` (30), then SIGCONT (one at a time);
- ``shard``: SIGKILL a syncer shard; the harness starts the same command again (``restarted from commit N``).

Measured (the syncer's ``service/status.json`` of each shard sampled every ``--poll-s``; the processes'
``/proc``; the run's ``summary.json``):

- goodput against the alive bound: merged tokens per second of the run, over the tokens per second the islands
  alive would train at their failure-free rates (each island's rate in the baseline times the share of the run
  it was up: outages are from a kill to its rejoin, and a stop's 30 s);
- participation: for each merge (a fragment's version rising on its shard), the share of the islands up at that
  moment and still training (not past their last merged push: the shared budget spent) whose push is in it
  (their merged tokens on that shard rose with it);
- rejoin times: from a kill to the island's next join (the coordinator's ``joins``), and to its next merged push;
- committed steps lost: per shard restart, the commits (fragment versions) the shard showed before its kill
  minus those it restarted from (must be 0);
- the syncer shards' RSS, threads and open files over time (``/proc/PID/status``, ``/proc/PID/fd``);
- the final held-out loss against the failure-free run's; the faults injected (kind, time, target); each
  process's exit status (every process must end by itself).

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/service_soak``); each phase's
logs and run folder stay in ``/tmp/soak-*`` (named in the results). The machine's load is printed with every
timing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atoll.benchmarks import common  # noqa: E402
from bench import service_launch as sl  # noqa: E402

#: the run settings of every process, both phases (bench/service_soak.toml's [settings])
SETTINGS: dict[str, Any] = common.study_settings(__file__, "settings")
#: ranks of each island's torchrun job
RANKS = (2, 1, 2, 1, 2, 1)
#: the fault kinds and their odds
KINDS = {"rank": 0.4, "island": 0.2, "stop": 0.2, "shard": 0.2}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="about how long each phase runs [20]")
    parser.add_argument("--faults-per-hour", type=float, default=60.0, help="the injector's rate [60]")
    parser.add_argument("--seed", type=int, default=0, help="the injector's random seed [0]")
    parser.add_argument("--steps", type=int, default=None,
                        help="inner steps per island (the budget is islands x steps) [what the islands' paces "
                        "take in --minutes]")
    parser.add_argument("--step-s", type=float, default=0.25,
                        help="the least seconds of a speed-1 island's inner step (an island of speed s: --step-s / "
                        "s, its --emulate-step-s) [0.25]")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="the failure-free run as a second phase [on]")
    parser.add_argument("--only-baseline", action="store_true", help="only the failure-free run")
    parser.add_argument("--stop-s", type=float, default=30.0, help="seconds a stopped island is held [30]")
    parser.add_argument("--max-restarts", type=int, default=100, help="each torchrun job's --max-restarts [100]")
    parser.add_argument("--poll-s", type=float, default=0.2, help="seconds between status samples [0.2]")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between /proc samples of the shards [5]")
    parser.add_argument("--end-timeout-s", type=float, default=900.0,
                        help="seconds past the phase's expected end before it is killed (not ending by itself) [900]")
    parser.add_argument("--run-flag", action="append", default=[], metavar="FLAG",
                        help="a run setting for every process on top of the pinned ones, e.g. "
                        "--run-flag=--grace-window=round (repeat for more) [none]")
    parser.add_argument("--report", type=Path, default=None,
                        help="no run: write the figures of the records in this results.json (into --out)")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/service_soak]")
    return parser.parse_args(argv)


def log(msg: str) -> None:
    """One line on stdout with the time and the machine's load (1, 5, 15 min)."""
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"[service_soak {time.strftime('%H:%M:%S')} load {load}] {msg}", flush=True)


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1, nearest rank) of ``xs``; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def proc_sample(pid: int) -> dict[str, Any] | None:
    """RSS (MiB), threads and open files of process ``pid`` from ``/proc``; None once it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]), "fds": fds}


def signal_pids(pids: Sequence[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` (those gone meanwhile are passed over)."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


@dataclass
class Job:
    """One island job: its command, the current torchrun agent, and what happened to it."""

    island: int
    cmd: list[str]
    proc: subprocess.Popen | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)  # the exit statuses of the agents it killed (none: killed)
    held: bool = False  # stopped by a fault
    down_since: float | None = None  # killed at (until it joins again)
    joins_at_fault: int = 0

    def ranks(self) -> list[int]:
        """The pids of the job's ranks (the agent's descendants) now."""
        return common.descendants(self.proc.pid) if self.proc is not None and self.proc.poll() is None else []


@dataclass
class Shard:
    """One syncer shard: its command, folder, current process, restarts."""

    index: int
    cmd: list[str]
    folder: Path
    proc: subprocess.Popen | None = None
    down: bool = False


class Phase:
    """One run of the settings: the processes, the samples and the injector (``faults``)."""

    def __init__(self, args: argparse.Namespace, name: str, faults: bool, steps: int) -> None:
        self.args, self.name, self.faults_on, self.steps = args, name, faults, steps
        self.tmp = Path(tempfile.mkdtemp(prefix=f"soak-{name}-"))
        self.env = sl.study_env()
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.t0 = time.time()
        corpus = sl.write_corpus(self.tmp / "corpus.txt", large=True)
        flags = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
                 for k, v in SETTINGS.items() if k != "strategy"]
        self.flags = [*flags, f"--steps={steps}", "--data", str(corpus), "--cache-dir", str(self.tmp / "cache"),
                      "--no-progress", "--collective-timeout-s", "300", *args.run_flag]
        self.out = self.tmp / "syncer"
        ports = [sl.free_port(), sl.free_port()]
        addrs = [f"127.0.0.1:{p}" for p in ports]
        self.shards = [Shard(s, sl.syncer_command(self.out, addrs[s], self.flags, shard=s, shards=addrs),
                             self.out / f"shard_{s}") for s in range(2)]
        self.speeds = list(SETTINGS["island_speeds"])
        self.jobs = [Job(i, [*sl.TORCHRUN, "--nproc-per-node", str(RANKS[i]), "--max-restarts",
                             str(args.max_restarts), "-m", "atoll",
                             *sl.island_args(i, addrs, self.out / "credentials", self.flags),
                             f"--emulate-step-s={args.step_s / self.speeds[i]:g}"])
                     for i in range(SETTINGS["islands"])]
        self.faults: list[dict[str, Any]] = []
        self.outages: list[list[list[float | None]]] = [[] for _ in self.jobs]  # per island [start, end]
        self.merges: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []  # /proc of the shards
        self.grants: list[tuple[float, list[int]]] = []  # (time, steps_by_island) at each change
        self.restarts: list[dict[str, Any]] = []  # shard restarts: commits before, restarted from
        self.status: dict[int, dict[str, Any]] = {}
        self.joins: list[int] = [0] * len(self.jobs)
        self.merged_tokens: list[int] = [0] * len(self.jobs)
        self.pending: list[dict[str, Any]] = []  # island faults awaiting their rejoin / merged push

    # --- starting and ending -------------------------------------------------------------------------
    def start_shard(self, shard: Shard, append: bool = False) -> None:
        shard.proc = sl.launch(shard.cmd, self.tmp / f"shard_{shard.index}.log", self.env, append=append)

    def start_job(self, job: Job) -> None:
        job.proc = sl.launch(job.cmd, self.tmp / f"island_{job.island}.log", self.env, append=job.starts > 0)
        job.starts += 1

    def kill_all(self) -> None:
        """SIGKILL every process this phase started that still runs (by pid, with its tree)."""
        for p in [*(s.proc for s in self.shards), *(j.proc for j in self.jobs)]:
            if p is not None and p.poll() is None:
                common.kill_tree(p.pid)
                p.wait()

    # --- the faults ------------------------------------------------------------------------------------
    def inject(self, rng: random.Random) -> None:
        """One fault drawn from :data:`KINDS` among the targets that are up now (none: a skipped draw)."""
        kinds = list(KINDS)
        kind = rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
        now = time.time()
        up = [j for j in self.jobs if j.down_since is None and not j.held and j.proc is not None
              and j.proc.poll() is None]
        record: dict[str, Any] = {"t": now - self.t0, "kind": kind}
        if kind in ("rank", "island", "stop") and not up:
            record["skipped"] = "no island up"
        elif kind == "stop" and any(j.held for j in self.jobs):
            record["skipped"] = "an island is held already"
        elif kind == "shard" and any(s.down for s in self.shards):
            record["skipped"] = "a shard is down already"
        elif kind == "rank":
            job = rng.choice(up)
            ranks = sl.children(job.proc.pid)  # type: ignore[union-attr]
            if not ranks:
                record["skipped"] = f"island {job.island}: no rank found"
            else:
                rank = rng.randrange(len(ranks))
                signal_pids([sorted(ranks)[rank]], signal.SIGKILL)
                record.update(island=job.island, rank=rank)
                self.down(job, now, record)
        elif kind == "island":
            job = rng.choice(up)
            with self.lock:
                common.kill_tree(job.proc.pid)  # type: ignore[union-attr]
                job.exits.append(job.proc.wait())  # type: ignore[union-attr]
                self.down(job, now, record)
                record.update(island=job.island)
                self.start_job(job)
        elif kind == "stop":
            job = rng.choice(up)
            with self.lock:
                job.held = True
                signal_pids([job.proc.pid, *job.ranks()], signal.SIGSTOP)  # type: ignore[union-attr]
            record.update(island=job.island, held_s=self.args.stop_s)
            self.outages[job.island].append([now - self.t0, None])
            timer = threading.Timer(self.args.stop_s, self.release, (job, record))
            timer.daemon = True
            timer.start()
        else:
            shard = self.shards[rng.randrange(len(self.shards))]
            before = sl.read_status(shard.folder)
            with self.lock:
                shard.down = True
                common.kill_tree(shard.proc.pid)  # type: ignore[union-attr]
                code = shard.proc.wait()  # type: ignore[union-attr]
            record.update(shard=shard.index, exit=code, commits_before=before.get("commits"),
                          versions_before=before.get("versions"), starts_before=self.log_count(shard))
            self.restarts.append(record)
            time.sleep(1.0)
            self.start_shard(shard, append=True)
        self.faults.append(record)
        log(f"{self.name}: fault at {record['t']:.1f} s: " + ", ".join(f"{k}={v}" for k, v in record.items()
                                                                          if k not in ("t", "versions_before")))

    def down(self, job: Job, now: float, record: dict[str, Any]) -> None:
        job.down_since, job.joins_at_fault = now, self.log_count(job)
        self.outages[job.island].append([now - self.t0, None])
        self.pending.append({"record": record, "island": job.island, "at": now, "merged": None})

    def release(self, job: Job, record: dict[str, Any]) -> None:
        with self.lock:
            if job.proc is not None:
                signal_pids([job.proc.pid, *job.ranks()], signal.SIGCONT)
            job.held = False
            now = time.time()
            self.outages[job.island][-1][1] = now - self.t0
            self.pending.append({"record": record, "island": job.island, "at": now - self.args.stop_s,
                                 "merged": self.merged_tokens[job.island], "rejoined": True})

    # --- the watch -----------------------------------------------------------------------------------
    def log_count(self, who: Job | Shard) -> int:
        """How many times ``who`` has joined (an island job: its leader's ``joined (session`` lines) or started
        listening (a shard: ``atoll syncer: listening on`` lines), from its log: a count no restart of a syncer
        resets."""
        name, needle = (f"island_{who.island}", ": joined (session") if isinstance(who, Job) \
            else (f"shard_{who.index}", "atoll syncer: listening on")
        try:
            return (self.tmp / f"{name}.log").read_text(errors="replace").count(needle)
        except OSError:
            return 0

    def shard_back(self, shard: Shard, now: float) -> None:
        """A killed shard listens again: when, and from which commit (0: it found no checkpoint)."""
        import re

        for r in self.restarts:
            if r.get("shard") == shard.index and "restarted_commits" not in r:
                text = (self.tmp / f"shard_{shard.index}.log").read_text(errors="replace")
                line = [x for x in text.splitlines() if "atoll syncer: listening on" in x][-1]
                found = re.search(r"restarted from commit (\d+)", line)
                r["restarted_commits"] = int(found.group(1)) if found else 0
                r["back_s"] = now - self.t0 - r["t"]
                log(f"{self.name}: shard {shard.index} back after {r['back_s']:.1f} s, from commit "
                    f"{r['restarted_commits']} (it showed {r['commits_before']} before its kill)")
        shard.down = False

    def poll(self) -> None:
        """Read both shards' status; record merges (with their islands), joins, grants, rejoins."""
        now = time.time()
        for shard in self.shards:
            if shard.down:
                restart = next((r for r in self.restarts if r.get("shard") == shard.index
                                and "restarted_commits" not in r), None)
                if restart is None or self.log_count(shard) > restart["starts_before"]:
                    self.shard_back(shard, now)
                    self.status.pop(shard.index, None)  # its counts restart from its checkpoint
                continue
            s = sl.read_status(shard.folder)
            if not s or "versions" not in s:
                continue
            prev = self.status.get(shard.index)
            if prev is not None and s["versions"] != prev["versions"]:
                grew = [i for i, (a, b) in enumerate(zip(s["merged_tokens_by_island"],
                                                         prev["merged_tokens_by_island"], strict=False)) if a > b]
                steps = sum(max(0, a - b) for a, b in zip(s["versions"], prev["versions"], strict=False))
                self.merges.append({"t": now - self.t0, "shard": shard.index, "merges": steps, "islands": grew})
            self.status[shard.index] = s
            if shard.index == 0 and "joins" in s:
                self.joins = list(s["joins"])
                if not self.grants or self.grants[-1][1] != s["steps_by_island"]:
                    self.grants.append((now - self.t0, list(s["steps_by_island"])))
        totals = [0] * len(self.jobs)
        for s in self.status.values():
            for i, t in enumerate(s.get("merged_tokens_by_island", [])):
                totals[i] += t
        self.merged_tokens = totals
        for job in self.jobs:
            if job.down_since is not None and self.log_count(job) > job.joins_at_fault:
                self.outages[job.island][-1][1] = now - self.t0
                for p in self.pending:
                    if p["island"] == job.island and "rejoined" not in p:
                        p["rejoined"] = True
                        p["record"]["rejoin_s"] = now - p["at"]
                        p["merged"] = self.merged_tokens[job.island]
                job.down_since = None
        for p in list(self.pending):
            if p.get("rejoined") and p["merged"] is not None and self.merged_tokens[p["island"]] > p["merged"]:
                p["record"]["pushing_s"] = now - p["at"]
                self.pending.remove(p)

    def sample(self) -> None:
        """The shards' RSS, threads and open files now."""
        for shard in self.shards:
            if shard.proc is not None and shard.proc.poll() is None:
                found = proc_sample(shard.proc.pid)
                if found:
                    self.samples.append({"t": time.time() - self.t0, "shard": shard.index, "pid": shard.proc.pid,
                                         **found, "load": os.getloadavg()[0]})

    def running(self) -> bool:
        return any(p is not None and p.poll() is None for p in [*(s.proc for s in self.shards),
                                                                 *(j.proc for j in self.jobs)])

    def run(self) -> dict[str, Any]:
        """The phase from start to end (every process ended by itself, or killed at the timeout); its record."""
        args = self.args
        log(f"{self.name}: starting 2 shards and {len(self.jobs)} island jobs ({self.steps} steps per island, "
            f"folder {self.tmp})")
        try:
            self.start_shard(self.shards[0])
            self.start_shard(self.shards[1])
            while not (self.out / "credentials" / f"island_{len(self.jobs) - 1}.token").is_file():
                if self.shards[0].proc.poll() is not None:  # type: ignore[union-attr]
                    raise RuntimeError(f"shard 0 did not start; see {self.tmp / 'shard_0.log'}")
                time.sleep(0.2)
            for job in self.jobs:
                self.start_job(job)
            rng = random.Random(args.seed)
            next_fault: float | None = None
            started = None
            expected_end = time.time() + args.minutes * 60 * 3 + args.end_timeout_s
            last_sample = 0.0
            while self.running():
                self.poll()
                now = time.time()
                if now - last_sample >= args.sample_s:
                    self.sample()
                    last_sample = now
                s0 = self.status.get(0, {})
                if started is None and s0.get("joins") and all(j >= 1 for j in s0["joins"]) and s0.get("reserved"):
                    started = now
                    log(f"{self.name}: every island joined, training ({now - self.t0:.1f} s after the start)")
                    if self.faults_on:
                        next_fault = now + rng.expovariate(args.faults_per_hour / 3600)
                spent = s0.get("budget") and s0.get("reserved", 0) >= 0.85 * s0["budget"]
                if next_fault is not None and now >= next_fault and not spent:
                    self.inject(rng)
                    next_fault = time.time() + rng.expovariate(args.faults_per_hour / 3600)
                for job in self.jobs:  # a job whose agent gave up (restarts spent) is started again, as by hand
                    if job.proc is not None and job.proc.poll() not in (None, 0) and not spent:
                        with self.lock:
                            job.exits.append(job.proc.returncode)
                            log(f"{self.name}: island {job.island}'s job ended with {job.proc.returncode}; started "
                                "again")
                            self.start_job(job)
                if now > expected_end:
                    log(f"{self.name}: not ended {now - self.t0:.0f} s after its start; killing what runs")
                    break
                time.sleep(args.poll_s)
            ended_by_itself = not self.running()
        finally:
            self.stop_event.set()
            self.kill_all()
        wall = time.time() - self.t0
        self.poll()
        summary = common.read_summary(self.out / "run") or {}
        exits = {f"shard_{s.index}": s.proc.returncode if s.proc else None for s in self.shards}
        exits.update({f"island_{j.island}": j.proc.returncode if j.proc else None for j in self.jobs})
        log(f"{self.name}: ended after {wall:.0f} s, by itself: {ended_by_itself}; exit statuses {exits}; final "
            f"loss {summary.get('final_eval_loss')}")
        return {"name": self.name, "folder": str(self.tmp), "wall_s": wall, "ended_by_itself": ended_by_itself,
                "exit_codes": exits, "killed_job_exits": {j.island: j.exits for j in self.jobs if j.exits},
                "job_starts": [j.starts for j in self.jobs], "faults": self.faults, "outages": self.outages,
                "merges": self.merges, "proc_samples": self.samples, "grants": self.grants,
                "shard_restarts": self.restarts, "summary": {k: v for k, v in summary.items()
                                                             if not isinstance(v, dict | list) or len(str(v)) < 2000},
                "load_end": os.getloadavg()}


# --- the figures -------------------------------------------------------------------------------------


def edge_rate(grants: Sequence[tuple[float, list[int]]], island: int, start: float, end: float) -> float | None:
    """An island's granted inner steps per second between ``start`` and ``end`` (seconds), from its first
    grant to its last inside the interval (grants come in leases; a difference of the counts at the ends would
    be off by a lease); None with fewer than two grants inside."""
    edges: list[tuple[float, int]] = []
    last = None
    for t, steps in grants:
        if last is not None and steps[island] != last and start <= t <= end:
            edges.append((t, steps[island]))
        last = steps[island]
    if len(edges) < 2 or edges[-1][0] <= edges[0][0]:
        return None
    return (edges[-1][1] - edges[0][1]) / (edges[-1][0] - edges[0][0])


def rates(phase: dict[str, Any]) -> tuple[list[float], float, float]:
    """Per island its granted inner steps per second from the run's first grant to its last (the steps granted
    after the first, over the time between them: each lease is trained after its grant; a count that falls, a
    coordinator restarted from an older ledger, adds nothing); and those two times (seconds from the phase's
    start)."""
    grants = phase["grants"]
    begin = next((k for k, (_, steps) in enumerate(grants) if sum(steps) > 0), len(grants))
    started = grants[begin:]
    if len(started) < 2:
        return [float("nan")] * len(RANKS), 0.0, 0.0
    first, last = started[0][0], started[-1][0]
    span = last - first
    grown = [0] * len(RANKS)
    for (_, a), (_, b) in zip(started, started[1:], strict=False):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            grown[i] += max(0, y - x)
    return [g / span if span > 0 else float("nan") for g in grown], first, last


def up_share(phase: dict[str, Any], island: int, start: float, end: float) -> float:
    """The share of [start, end] island ``island`` was up (outside its outages; an outage not closed runs to
    the end)."""
    down = 0.0
    for a, b in phase["outages"][island]:
        b = end if b is None else b
        down += max(0.0, min(b, end) - max(a, start))
    return 1.0 - down / (end - start) if end > start else float("nan")


def last_pushes(phase: dict[str, Any]) -> list[float]:
    """Per island the time (seconds from the phase's start) of the last merge that held its push: after it the
    island has no steps left to train (the shared budget is spent), so no merge can hold it (-inf: none)."""
    last = [float("-inf")] * len(phase["outages"])
    for m in phase["merges"]:
        for i in m["islands"]:
            last[i] = max(last[i], m["t"])
    return last


def live_at(phase: dict[str, Any], t: float, done: Sequence[float] | None = None) -> set[int]:
    """The islands up at ``t`` (seconds from the phase's start); with ``done`` (:func:`last_pushes`), only
    those whose last merged push is not before ``t``: still training."""
    return {i for i, spans in enumerate(phase["outages"])
            if not any(a <= t and (b is None or t < b) for a, b in spans) and (done is None or t <= done[i])}


def figures(phase: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The row of a phase: goodput against the alive bound, participation, rejoins, losses, resources."""
    s = phase["summary"]
    tps = SETTINGS["batch_size"] * SETTINGS["seq_len"]
    own_rates, first, last = rates(phase)
    base_rates = rates(baseline)[0] if baseline is not None else own_rates
    run_s = last - first
    useful = s.get("useful_tokens")
    goodput = useful / run_s if useful and run_s > 0 else None
    shares = [up_share(phase, i, first, last) for i in range(len(RANKS))]
    bound = sum(r * u * tps for r, u in zip(base_rates, shares, strict=True))
    parts, full = [], 0
    done = last_pushes(phase)
    for m in phase["merges"]:
        if not first <= m["t"] <= last + 5:
            continue
        live = live_at(phase, m["t"], done)
        if live:
            p = len(set(m["islands"]) & live) / len(live)
            parts.append(p)
            full += p >= 1.0
    kills = [f for f in phase["faults"] if f["kind"] in ("rank", "island") and "skipped" not in f]
    rejoin = [f["rejoin_s"] for f in kills if "rejoin_s" in f]
    pushing = [f["pushing_s"] for f in phase["faults"] if "pushing_s" in f]
    lost = [max(0, (r.get("commits_before") or 0) - r["restarted_commits"]) for r in phase["shard_restarts"]
            if "restarted_commits" in r]
    by_kind: dict[str, int] = {}
    for f in phase["faults"]:
        if "skipped" not in f:
            by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1

    def spread(key: str) -> str:
        xs = [x[key] for x in phase["proc_samples"]]
        if not xs:
            return "-"
        head = [x[key] for x in phase["proc_samples"][:2]]
        return f"{min(head):.0f} / {xs[-1]:.0f} / {max(xs):.0f}"

    return {"phase": phase["name"], "wall_s": phase["wall_s"], "run_s": run_s,
            "load_end": phase["load_end"][0], "faults": sum(by_kind.values()), "faults_by_kind": by_kind,
            "useful_tokens": useful, "trained_tokens": s.get("tokens"), "goodput_tok_s": goodput,
            "merged_le_trained": None if useful is None or s.get("tokens") is None else useful <= s["tokens"],
            "alive_bound_tok_s": bound, "goodput_vs_alive": goodput / bound if goodput and bound else None,
            "island_rates": own_rates, "island_up_share": shares,
            "participation_mean": statistics.fmean(parts) if parts else None,
            "merges_seen": len(parts), "merges_full": full,
            "quorum_size_counts": s.get("quorum_size_counts"),
            "rejoins": len(rejoin), "rejoin_p50_s": percentile(rejoin, 0.5), "rejoin_p90_s": percentile(rejoin, 0.9),
            "rejoin_max_s": max(rejoin, default=None), "pushing_p50_s": percentile(pushing, 0.5),
            "pushing_max_s": max(pushing, default=None),
            "shard_restarts": len(phase["shard_restarts"]), "committed_lost": sum(lost) if lost else 0,
            "rss_mib": spread("rss_mib"), "threads": spread("threads"), "fds": spread("fds"),
            "final_eval_loss": s.get("final_eval_loss"), "ended_by_itself": phase["ended_by_itself"],
            "exits": " ".join(f"{v}" for v in phase["exit_codes"].values())}


def paced_steps(minutes: float, step_s: float) -> int:
    """Inner steps per island that the islands' paces take about ``minutes`` for (the budget is islands x steps,
    shared: the islands take steps at sum(speeds) / ``step_s`` per second together)."""
    return round(minutes * 60 * sum(SETTINGS["island_speeds"]) / (step_s * SETTINGS["islands"]))


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/service_soak.py [flags]``; the exit status (2: bad flags, 1: a phase did not finish)."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM ends the phase as Ctrl-C does: killed
    if args.minutes <= 0 or args.faults_per_hour <= 0 or args.stop_s <= 0 or args.step_s <= 0:
        return common.script_error("service_soak", ValueError("minutes, faults-per-hour, stop-s, step-s: must be "
                                                              "> 0"))
    out = args.out or common.default_out("service_soak")
    if args.report is not None:  # the figures again, from a run's records
        import json

        done = json.loads(args.report.read_text())
        return report(out, args, done["phases"], done["steps"], done.get("command", "?"))
    steps = args.steps or max(SETTINGS["sync_every"] * 2, paced_steps(args.minutes, args.step_s))
    names = [] if args.only_baseline else ["faults"]
    if args.baseline or args.only_baseline:
        names.append("baseline")
    phases: dict[str, dict[str, Any]] = {}
    interrupted = False
    for name in names:
        phase = Phase(args, name, faults=name == "faults", steps=steps)
        try:
            phases[name] = phase.run()
        except KeyboardInterrupt:
            interrupted = True
            break
        except RuntimeError as e:
            print(f"service_soak: error: {e}", file=sys.stderr)
            return 1
    if interrupted or not phases:
        print("service_soak: interrupted; every process it started was killed", file=sys.stderr)
        return 1
    return report(out, args, phases, steps, common.command_line("service_soak.py"))


def report(out: Path, args: argparse.Namespace, phases: dict[str, dict[str, Any]], steps: int,
           command: str) -> int:
    """Write ``results.json`` and ``results.md`` of ``phases`` (their records, :meth:`Phase.run`) into ``out``;
    print the table; return the exit status (1: a phase did not end by itself)."""
    base = phases.get("baseline")
    rows = [figures(p, base) for p in phases.values()]
    if base is not None and "faults" in phases:
        b, f = rows[-1]["final_eval_loss"], rows[0]["final_eval_loss"]
        rows[0]["loss_gap_pct"] = 100 * (f - b) / b if b and f else None
    columns = [("phase", "phase"), ("run s", "run_s"), ("load", "load_end"), ("faults", "faults"),
               ("goodput tok/s", "goodput_tok_s"), ("alive bound tok/s", "alive_bound_tok_s"),
               ("goodput / alive bound", "goodput_vs_alive"), ("participation (mean share of live islands)",
                                                               "participation_mean"),
               ("merges: all live in / seen", "merges_full_of"), ("rejoins", "rejoins"),
               ("rejoin p50 / p90 / max s", "rejoin_cell"), ("back pushing p50 / max s", "pushing_cell"),
               ("shard restarts", "shard_restarts"), ("committed steps lost", "committed_lost"),
               ("shard RSS MiB first / last / max", "rss_mib"), ("threads", "threads"), ("open files", "fds"),
               ("merged <= trained tokens", "merged_le_trained_cell"),
               ("final loss", "final_eval_loss"), ("vs failure-free %", "loss_gap_pct"),
               ("ended by itself", "ended_by_itself"), ("exit statuses (shards, islands)", "exits")]

    def f1(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    for r in rows:
        r["merges_full_of"] = f"{r['merges_full']} / {r['merges_seen']}"
        r["rejoin_cell"] = f"{f1(r['rejoin_p50_s'])} / {f1(r['rejoin_p90_s'])} / {f1(r['rejoin_max_s'])}"
        r["pushing_cell"] = f"{f1(r['pushing_p50_s'])} / {f1(r['pushing_max_s'])}"
        r["ended_by_itself"] = str(r["ended_by_itself"])
        r["merged_le_trained_cell"] = str(r["merged_le_trained"])
    faults = phases.get("faults", {}).get("faults", [])
    fault_lines = ", ".join(
        f"{f['t']:.0f} s {f['kind']}" + (f" island {f['island']}" if "island" in f else "")
        + (f" shard {f['shard']}" if "shard" in f else "") + (" (skipped)" if "skipped" in f else "")
        for f in faults)
    notes = [f"command: `{command}`; "
             f"{steps} inner steps per island (budget {steps * SETTINGS['islands']}), settings "
             "bench/service_soak.toml (micro model, 6 islands of 2,1,2,1,2,1 ranks, speeds 1,1,0.5,0.5,0.25,0.25 "
             f"made real by each job's --emulate-step-s: {args.step_s:g} s / speed, 2 fragments on 2 syncer shards; "
             "corpus: the standard library's top-level modules, 4.7 MB), "
             f"{args.faults_per_hour:g} faults per hour (seed {args.seed}), stops of {args.stop_s:g} s; machine: "
             f"{os.cpu_count()} CPUs, shared (load: 1-minute average at each phase's end).",
             "goodput: merged tokens per second from the first grant to the last; alive bound: each island's "
             "failure-free rate (the baseline's) times the share of that time it was up. Participation: per merge "
             "seen in the shards' status (sampled every "
             f"{args.poll_s:g} s), the islands up whose merged tokens rose with it over the islands up and still "
             "training (not past their last merged push). Rejoin: "
             "kill to the coordinator counting its next join; back pushing: to its next merged push (a stop: "
             "from the stop). Committed steps lost: commits a shard showed before its kill minus those it "
             "restarted from. Shard RSS / threads / open files: the first samples' lowest, the last, the highest.",
             f"faults (seconds from the phase's start): {fault_lines or 'none'}."]
    results = {"command": command, "settings": SETTINGS, "steps": steps,
               "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "phases": phases}
    title = "A storm, measured: 2 syncer shards, 6 island jobs, faults injected (`python bench/service_soak.py`)"
    print(common.write_results(out, results, columns, rows, title=title, notes=notes))
    return 0 if all(p["ended_by_itself"] for p in phases.values()) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
