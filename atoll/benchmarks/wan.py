"""The emulated-WAN benchmark: ``ddp`` against ``diloco`` under the ``collective`` runtime over shaped links.

    atoll bench wan                                     # as root; the full benchmark (hours on 2 cores)
    atoll bench wan --steps 50 --sync-every 20 --out /tmp/wan-smoke   # a smoke run (minutes)
    python bench/wan.py ...                             # the same, writing bench/out/wan by default

For every bandwidth (``--bandwidths``, Mbit/s) it builds an :class:`~atoll.benchmarks.netns.EmulatedWan`
(one network namespace per island, veth pairs to a bridge, ``tc tbf`` both ways, optional ``--delay-ms``)
and runs ``ddp`` and ``diloco`` at each H (``--sync-every``) on the same tokens, every rank started inside
its island's namespace (``ip netns exec NS python -m atoll.cli train --runtime collective``) with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set, so the rendezvous store and all gloo traffic (``GLOO_SOCKET_IFNAME
=wan0``) cross the shaped links. It runs on the CPU (``CUDA_VISIBLE_DEVICES=""``), one torch thread per rank.

Measured on the earlier default benchmark setting, the TrainConfig defaults before the nano regime (``--model``,
default tiny; 4096-token vocabulary, batch 8 of 128 tokens per island, warmup 50, outer Nesterov momentum 0.9),
now pinned in every run (:data:`EARLIER_SETTING`; ``--train-arg`` still overrides any of them) so the committed
results reproduce; the current default setting is measured by ``python bench/fidelity.py``.

Reported per run, in steady state: tokens per second of wall time, from the ``train`` events of
``metrics.jsonl`` between the end of the first outer round (step H; for ``ddp`` the smallest H of the
benchmark) and the last H boundary, so start-up and the first round are left out; compute utilization
(the slowest island's compute over that window's wall time, its compute taken as the run's ``compute_s``
pro rata of steps); bytes per island counted by atoll (``bytes_sent_per_island``) over the window; and the
bytes each island's interface sent over the same window (``/proc/net/dev`` of its namespace, sampled every
0.05 s; at the events' timestamps the first sample after them for diloco, whose link is then idle,
interpolated for ddp, whose link never is), with their ratio (:mod:`atoll.benchmarks.wan_report`). The interfaces
also carry TCP/IP and Ethernet headers (about 5% at a 1500-byte MTU), the ACKs of the bytes received,
heartbeats and the counters that atoll does not count. Events come every 10 inner steps, so H must be a
multiple of 10; two outer rounds in the window need ``steps >= 3 H``.

Writes ``<out>/<run>/`` (an atoll run folder, plus ``rank<N>.log`` and ``wan.json``), ``<out>/results.json``
and ``<out>/results.md``, and prints the table. A run whose ``wan.json`` exists is reused (``--fresh``
reruns it). Before anything runs, ``--out`` is checked as the suite's is (:func:`check_out`): a folder of
other files, a results.json or results.md that no benchmark wrote, or a run folder to retrain that holds a
file atoll did not write or that this benchmark did not train there (``.atoll-bench.json``) is refused in one
line, status 2, and nothing is deleted or written.
Not root, or no usable ``ip netns``: one line, ``atoll bench wan: skipped: <why>``, status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import command_line, default_out
from atoll.benchmarks.folders import (
    check_benchmark_run,
    check_out_folder,
    clear_run_dir,
    make_folder,
    register,
)
from atoll.benchmarks.netns import (
    IFNAME,
    EmulatedWan,
    LinkShape,
    WanError,
    WanUnavailable,
    unavailable_reason,
)
from atoll.benchmarks.wan_report import steady_state, write_report
from atoll.config.applies import applicable

LOG_EVERY = 10  # atoll.training logs a ``train`` event every 10 inner steps

#: The defaults before the nano regime (TrainConfig up to commit 568f3bb) that differ from today's and that the
#: runs do not set themselves (model, steps, H, evaluation and checkpoints are the flags'): the committed results
#: were measured on them, so every run takes them under its own settings (and ``--train-arg``) and the results
#: reproduce. The evaluation (once, at the end: eval_every = steps) now takes 8 held-out windows per batch
#: whatever the batch size, where it took batch_size windows: at batch 8 that is the same evaluation set as
#: before, so final_eval_loss stays comparable.
EARLIER_SETTING: dict[str, Any] = {"vocab_size": 4096, "batch_size": 8, "warmup_steps": 50, "outer_momentum": 0.9}

MASTER_PORT = 29500  # free: island 0's namespace holds nothing else

#: what the benchmark writes into a run folder besides the run's own files: files that mark the folder as
#: the benchmark's (names), and every such file (regular expressions); :func:`atoll.benchmarks.folders.clear_run_dir`
WAN_MARKERS = ("wan.json", "rank0.log")
WAN_FILES = (r"wan\.json", r"rank\d+\.log")


def _csv(kind: type) -> Any:
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by ``atoll bench wan`` and ``bench/wan.py``)."""
    a = parser.add_argument
    a("--steps", type=int, default=600, help="inner steps per island, every run [600: 3 rounds of H=200]")
    a("--ddp-steps", type=int, default=None,
      help="inner steps of the ddp runs only (a shortcut at low bandwidth: ddp's rate is steady after a few "
      "steps, but the runs then no longer see the same tokens) [default: --steps]")
    a("--bandwidths", type=_csv(float), default=[10.0, 100.0], metavar="MBPS,...",
      help="link rates in Mbit/s, each direction of each island [10,100]")
    a("--sync-every", type=_csv(int), default=[100, 200], metavar="H,...",
      help="diloco's H values, multiples of 10 [100,200]")
    a("--strategies", type=_csv(str), default=["ddp", "diloco"], metavar="NAME,...",
      help="strategies to run: ddp, diloco [ddp,diloco]")
    a("--delay-ms", type=float, default=0.0,
      help="one-way delay added to every link by the TUN forwarder, ms [0]")
    a("--tbf-latency-ms", type=float, default=200.0, help="longest wait in a tbf queue before a drop, ms [200]")
    a("--mtu", type=int, default=1500, help="MTU of the links [1500]")
    a("--islands", type=int, default=2, help="islands, one namespace each [2]")
    a("--ranks-per-island", type=int, default=1, help="ranks per island (all in its namespace) [1]")
    a("--model", default="tiny", help="model preset or folder [tiny]")
    a("--data", default="stdlib", help="corpus [stdlib]")
    a("--cache-dir", type=Path, default=None, help="tokenizer and token cache [$ATOLL_CACHE_DIR or ~/.cache/atoll]")
    a("--seed", type=int, default=0, help="seed [0]")
    a("--train-arg", action="append", default=[], metavar="FLAG=VALUE",
      help="any other 'atoll train' setting for every run, e.g. --train-arg vocab_size=512 (repeatable)")
    a("--collective-timeout-s", type=float, default=600.0,
      help="deadline of each collective; a ddp step's all-reduce at 1 Mbit/s takes minutes [600]")
    a("--run-timeout-s", type=float, default=6 * 3600.0, help="deadline of each run [21600]")
    a("--out", type=Path, default=Path("bench/out/wan"), help="output folder [bench/out/wan]")
    a("--fresh", action="store_true", help="rerun runs whose results exist")


# ----------------------------------------------------------------------------------------------------------
# one run inside the emulated WAN


def _flags(settings: dict[str, Any]) -> list[str]:
    out = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return out


def run_in_wan(wan: EmulatedWan, settings: dict[str, Any], out: Path, timeout_s: float,
               extra_env: dict[str, str] | None = None, grace_s: float = 30.0,
               sampler_interval_s: float = 0.05) -> dict[str, Any]:
    """Run ``atoll train --runtime collective`` with every rank inside its island's namespace.

    Island i's ranks are global ranks [i*R, (i+1)*R); rank 0 (island 0) hosts the rendezvous store at
    island 0's address, so every byte between islands crosses the shaped links. Logs go to
    ``out/rank<N>.log``. When a rank fails, the others get ``grace_s`` to stop by themselves (they detect it
    and exit with status 3), then they are killed; so is every rank still running at ``timeout_s``.

    Returns:
        ``exit_codes`` (per rank; -N: ended by signal N, e.g. killed at the deadline), ``ok``, ``wall_s``,
        ``error`` (the last
        lines of the first failing rank's log), and ``sampler`` (the interface counters over the run).
    """
    islands, r_count = int(settings["islands"]), int(settings.get("ranks_per_island", 1))
    world = islands * r_count
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                        "MASTER_PORT") and not k.startswith("TORCHELASTIC_")}
    env.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(r_count), "MASTER_ADDR": wan.island_ip(0),
                "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **(extra_env or {})})
    argv = [sys.executable, "-m", "atoll.cli", "train",  # the flags its strategy reads (ddp: no H, no outer step)
            *_flags(applicable({**settings, "runtime": "collective", "progress": False, "out": str(out)}))]
    sampler = wan.sampler(sampler_interval_s)
    procs, logs = [], []
    t0 = time.time()
    try:
        for rank in range(world):
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank % r_count),
                        "GROUP_RANK": str(rank // r_count)}
            procs.append(wan.popen(rank // r_count, argv, env=rank_env, stdout=log, stderr=log))
        deadline, first = t0 + timeout_s, None
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            if first is None:
                first = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if first is not None:
                    deadline = min(deadline, time.time() + grace_s)
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    finally:
        sampler.stop()
        for log in logs:
            log.close()
    wall = time.time() - t0
    codes = [p.returncode for p in procs]
    timed_out = wall >= timeout_s
    ok = all(c == 0 for c in codes) and not timed_out
    error = None
    if not ok:
        bad = next((r for r, c in enumerate(codes) if c != 0), 0)
        tail = (out / f"rank{bad}.log").read_text(errors="replace").strip().splitlines()[-3:]
        error = (f"timed out after {timeout_s:.0f} s; " if timed_out else "") + \
            f"rank {bad} exited with {codes[bad]}: " + " | ".join(tail)
    return {"exit_codes": codes, "ok": ok, "wall_s": wall, "error": error, "sampler": sampler}


# ----------------------------------------------------------------------------------------------------------
# the benchmark


def _run_name(strategy: str, h: int, mbps: float, delay_ms: float) -> str:
    name = f"{strategy}-H{h}" if strategy == "diloco" else strategy
    return f"{name}-{mbps:g}mbit" + (f"-{delay_ms:g}ms" if delay_ms else "")


def pinned(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's settings over :data:`EARLIER_SETTING`: what it trains with."""
    return {**EARLIER_SETTING, **settings}


def planned_runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(name, own settings) of every run the flags ``args`` train, in order, to train with :func:`pinned` (as
    ``atoll train`` flags, :func:`_flags`, under ``--runtime collective``); no training."""
    warmup = min(args.sync_every)
    runs = []
    for mbps in args.bandwidths:
        if "ddp" in args.strategies:
            runs.append((_run_name("ddp", warmup, mbps, args.delay_ms), _own_settings(args, "ddp", warmup)))
        if "diloco" in args.strategies:
            runs += [(_run_name("diloco", h, mbps, args.delay_ms), _own_settings(args, "diloco", h))
                     for h in args.sync_every]
    return runs


def _settings(args: argparse.Namespace, strategy: str, h: int) -> dict[str, Any]:
    """A run's settings: its own (:func:`_own_settings`) over :data:`EARLIER_SETTING`."""
    return pinned(_own_settings(args, strategy, h))


def _own_settings(args: argparse.Namespace, strategy: str, h: int) -> dict[str, Any]:
    """A run's own settings: from the flags ``args`` (``--train-arg`` last)."""
    steps = args.ddp_steps if strategy == "ddp" and args.ddp_steps else args.steps
    s: dict[str, Any] = {"strategy": strategy, "islands": args.islands, "ranks_per_island": args.ranks_per_island,
                         "sync_every": h, "steps": steps, "model": args.model, "data": args.data,
                         "seed": args.seed, "eval_every": steps, "checkpoint_every": 0, "threads": 1,
                         "collective_timeout_s": args.collective_timeout_s}
    if args.cache_dir is not None:
        s["cache_dir"] = str(args.cache_dir)
    for item in args.train_arg:
        key, _, value = item.partition("=")
        s[key.strip().lstrip("-").replace("-", "_")] = value
    return s


def _check_args(args: argparse.Namespace) -> str | None:
    if any(h <= 0 or h % LOG_EVERY for h in args.sync_every):
        return f"--sync-every: every H must be a positive multiple of {LOG_EVERY} (train events come every " \
               f"{LOG_EVERY} steps); got {args.sync_every}"
    unknown = [s for s in args.strategies if s not in ("ddp", "diloco")]
    if unknown:
        return f"--strategies: ddp and diloco only; got {unknown}"
    if args.steps < 1 or (args.ddp_steps is not None and args.ddp_steps < 1):
        return "--steps/--ddp-steps: at least 1"
    if any(b <= 0 for b in args.bandwidths) or args.delay_ms < 0:
        return "--bandwidths must be > 0 and --delay-ms >= 0"
    return None


def one_run(args: argparse.Namespace, strategy: str, h: int, mbps: float, warmup_step: int) -> dict[str, Any]:
    """Run (or reuse) one configuration; the row of results.json."""
    name = _run_name(strategy, h, mbps, args.delay_ms)
    out = args.out / name
    cached = out / "wan.json"
    if cached.is_file() and not args.fresh:
        return json.loads(cached.read_text())
    if check_benchmark_run(args.out, name, WAN_MARKERS, WAN_FILES):  # never a folder atoll did not write
        clear_run_dir(out, WAN_MARKERS, WAN_FILES)
    make_folder(args.out)
    register(args.out, name)  # this benchmark trains it: a later --fresh may replace it
    settings = _settings(args, strategy, h)
    print(f"[wan] {name}: {settings['steps']} steps at {mbps:g} Mbit/s"
          + (f", {args.delay_ms:g} ms one-way" if args.delay_ms else ""), file=sys.stderr, flush=True)
    shape = LinkShape(rate_mbps=mbps, delay_ms=args.delay_ms, tbf_latency_ms=args.tbf_latency_ms, mtu=args.mtu)
    with EmulatedWan(args.islands, shape) as wan:
        res = run_in_wan(wan, settings, out, args.run_timeout_s)
        qdisc = wan.qdisc_stats()
        delay = wan.delay_stats()
    row: dict[str, Any] = {"run": name, "strategy": strategy, "H": h if strategy == "diloco" else None,
                           "mbps": mbps, "delay_ms": args.delay_ms, "steps": settings["steps"],
                           "islands": args.islands, "ranks_per_island": args.ranks_per_island,
                           "exit_codes": res["exit_codes"], "ok": res["ok"], "error": res["error"],
                           "wall_s": res["wall_s"], "qdisc": qdisc, "delay_forwarder": delay}
    if res["ok"]:
        from atoll.job.metrics import read_metrics

        summary = json.loads((out / "summary.json").read_text())
        events = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"]
        row.update(steady_state(events, summary, res["sampler"], strategy, h, warmup_step))
        row.update({"tokens": summary["tokens"], "final_eval_loss": summary["final_eval_loss"],
                    "bytes_sent_per_island": summary["bytes_sent_per_island"],
                    "run_compute_utilization": summary["compute_utilization"], "compute_s": summary["compute_s"]})
        cached.write_text(json.dumps(row, indent=2))
    else:
        print(f"[wan] {name} failed: {res['error']}", file=sys.stderr, flush=True)
    return row


def check_out(args: argparse.Namespace) -> None:
    """Refuse ``--out`` before anything is trained, deleted or written: it must be new, empty or a benchmark's
    folder, with a benchmark's results.json and results.md (written over at the end), and every run folder the
    flags would train (not reused: no ``wan.json`` yet, or ``--fresh``) must be absent or one that this
    benchmark trained there, holding only atoll's files (:func:`atoll.benchmarks.folders.check_benchmark_run`).

    Raises:
        ConfigError: the first folder or file that is not atoll's, named, with the fix.
    """
    check_out_folder(args.out)
    for name, _ in planned_runs(args):
        if args.fresh or not (args.out / name / "wan.json").is_file():
            check_benchmark_run(args.out, name, WAN_MARKERS, WAN_FILES)



def run_benchmark(args: argparse.Namespace) -> int:
    """The benchmark; returns the exit status (0: done or skipped; 1: a run failed; 2: bad flags)."""
    reason = unavailable_reason()
    if reason is not None:
        print(f"atoll bench wan: skipped: {reason}")
        return 0
    problem = _check_args(args)
    if problem:
        print(f"atoll: error: {problem}", file=sys.stderr)
        return 2
    from atoll.config import build_config
    from atoll.errors import AtollError
    from atoll.job.data import default_cache_dir, prepare_data
    from atoll.job.data.pretrained import tokenizer_source

    try:  # refuse an --out that is not atoll's, validate the settings, prepare the data once (the ranks read the cache)
        check_out(args)
        config = build_config(overrides={**_settings(args, "diloco", args.sync_every[0]), "runtime": "collective"})
        cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache,
                     partition=config.partition, text_field=config.text_field,
                     tokenizer=tokenizer_source(config.model, config.tokenizer), max_documents=config.max_documents)
    except AtollError as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        return 2
    warmup = min(args.sync_every)
    rows: list[dict[str, Any]] = []
    try:
        for mbps in args.bandwidths:
            group = []
            if "ddp" in args.strategies:
                group.append(one_run(args, "ddp", warmup, mbps, warmup))
            if "diloco" in args.strategies:
                group += [one_run(args, "diloco", h, mbps, warmup) for h in args.sync_every]
            ddp = next((r for r in group if r["strategy"] == "ddp" and r.get("tokens_per_s")), None)
            for r in group:
                if ddp is not None and r.get("tokens_per_s"):
                    r["speedup_vs_ddp"] = r["tokens_per_s"] / ddp["tokens_per_s"]
            rows += group
    except (WanUnavailable, WanError) as e:
        print(f"atoll bench wan: {'skipped' if isinstance(e, WanUnavailable) else 'error'}: {e}")
        return 0 if isinstance(e, WanUnavailable) else 1
    except AtollError as e:  # e.g. a run's folder in --out that atoll did not write
        print(f"atoll: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("atoll bench wan: interrupted; the emulated network was removed; finished runs are kept and "
              "reused by the next call", file=sys.stderr)
        return 130
    meta = {"islands": args.islands, "model": args.model, "delay_ms": args.delay_ms,
            "tbf_latency_ms": args.tbf_latency_ms, "mtu": args.mtu,
            "command": command_line("wan.py")}
    table = write_report(args.out, rows, meta)
    print(table)
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """``python bench/wan.py``: parse the flags (``--out`` defaults to the repository's ``bench/out/wan``), run
    the benchmark; the exit status."""
    parser = argparse.ArgumentParser(prog="bench/wan.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(out=default_out("wan"))
    return run_benchmark(parser.parse_args(argv))
