"""The emulated-WAN benchmark of Decoupled DiLoCo as deployed across sites: ``atoll syncer`` and one ``atoll island``
job per island (``torchrun``, islands of different sizes and speeds), each in a network namespace of its own,
against synchronous ``diloco`` and ``ddp`` on the ``collective`` runtime over the same links; each failure-free and
with one island SIGKILLed mid-run (issue 36, item 4).

    atoll bench wan-decoupled                         # as root: the study (12 runs, about 2-3 hours on 2 loaded cores)
    atoll bench wan-decoupled --model micro --train-arg vocab_size=512 --train-arg seq_len=32 \
        --train-arg batch_size=4 --train-arg eval_batches=2 --steps 120 --fragments 2 --bandwidths 100 \
        --step-s 0.25 --out /tmp/wd                   # the smoke: every path (6 runs, about 10 minutes)
    python bench/wan_decoupled.py ...                 # the same, writing bench/out/wan_decoupled by default

The default setting, and why. The ``nano`` model (about 0.46M parameters at the pinned vocabulary of 4096) for 400
inner steps per island of 8 x 128 tokens: its held-out loss falls from 8.33 to about 4.7 (3 islands of diloco,
H=50, measured on this machine), still steeply at every target, where the micro model's barely falls (6.9 to
6.46) and time-to-target on its plateau could not tell the methods apart. The targets are at 0.5, 0.75 and 0.9 of
the synchronous failure-free run's loss drop (``--drop-fractions``), not at fractions of its steps: the curve is
convex, so 0.25 of the drop is reached within the first outer round by every method, and fractions of the steps
past the middle sit where the learning-rate schedule has flattened the curve. The time and the useful tokens to
each target are reported (besides the older single target at ``--target-fraction`` of the steps). H=20 keeps the
synchronous curve's resolution at 20 steps and its exchange (about 2.5 MB per island per outer step, fp32 ring over
3 islands) at about a sixth of a round at 10 Mbit/s, so the link matters. Expected run time per run on 2 loaded
cores (startup, the run, the decoupled checkpoints evaluated afterwards): diloco 5-6 minutes, decoupled 4-8,
ddp at 100 Mbit/s 6-8 and at 10 Mbit/s 18-25 (its ring moves about 2.5 MB per step: 2 s at 10 Mbit/s); the study
about 2-3 hours. Only a handful of processes train at once (4 in a decoupled run, 3 in a synchronous one), one
torch thread each.

Islands (``--islands 3``): decoupled island jobs of ``--island-ranks 2,1,1`` ranks at relative speeds
``--island-speeds 1,1,0.5``, made real as ``bench/service_soak.py`` makes them: each island's inner step lasts at
least ``--step-s`` / its speed (its job's ``--emulate-step-s``; the run declares ``island_speeds``, so the slow
island's rounds are s x H steps). ``--step-s`` (0.3 s) must exceed a speed-1 island's own step time on the loaded
host, so that the paces, not the load, set the speeds. The synchronous runs' islands have ``--ranks-per-island``
ranks each (the collective runtime's islands are all one size), paced the same way through the collective ranks'
pace hook (:data:`atoll.job.faults.PACE_HOOK_ENV`), so every lockstep (each step for ddp, each outer step for
diloco) waits for the half-speed island, as it would on slower hardware. The budget is the same: islands x steps
inner steps (decoupled: shared, each island takes what its pace allows; synchronous: steps each).

Links (:class:`~atoll.benchmarks.netns.EmulatedWan`, ``tc tbf`` both ways, the TUN delay forwarder): each island's
link is ``--bandwidths`` Mbit/s (10 and 100) with ``--delay-ms`` (25) one way (every namespace delays what it
sends, so a round trip between any two sites is twice that); the syncer's site has a link of ``--syncer-mbps``
(default 1 Gbit/s, a data centre's) with the same delay. The synchronous runs' islands have the same island links
(no syncer). Every process runs on the CPU with one torch thread.

The decoupled run is deployed as docs/deployment.md says: the syncer listens on its namespace's address with TLS (a
self-signed certificate made for that address; the islands trust it with ``--tls-ca``), makes one credential per
island at its start, and each island's job is given only its own (:mod:`atoll.benchmarks.wan_service`). The kill:
island 1 (every rank of it) is SIGKILLed as it starts inner step ``--kill-step``, in the synchronous runs by the
collective runtime's test hook (its survivors go on without it, ``--min-islands 1``, docs/reliability.md), in
the decoupled run by the harness (the job's process group: torchrun and its ranks), which then starts the same
island command again (it rejoins from the newest global fragments).

Every run trains the same model, data, seeds, codec (``--codec``, default fp32 for all, so that the bytes compare
like for like) and token budget (islands x steps, each island's batch split over its ranks), on the settings of
``atoll bench wan`` (:data:`~atoll.benchmarks.wan.EARLIER_SETTING`). Measured per run
(:mod:`atoll.benchmarks.wan_measures` defines each): the time and useful tokens to each target, and their ratios to
the diloco run with the same failure; steady tokens/s, useful tokens and goodput (over the paced islands'
failure-free rate); the final held-out loss; bytes sent and received per island counted by atoll (summary.json)
and by each namespace's interface (tx and rx) over the whole run; and for the kills when the island was back. The
1-minute load average is recorded beside every run: the CPUs may be shared. Beside the measurement, ``atoll
project``'s prediction for the same setting and at 12B over 2-5 Gbit/s (the paper's claim).

Writes ``<out>/<run>/`` (the run's folders, logs and ``wan.json``), ``<out>/results.json`` and ``<out>/results.md``.
A run whose ``wan.json`` exists is reused (``--fresh`` reruns it); ``--out`` is checked as ``atoll bench wan``'s.
Not root, or no usable ``ip netns``: one line, ``atoll bench wan-decoupled: skipped: <why>``, status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import command_line, default_out
from atoll.benchmarks.folders import (
    RUN_PATHS,
    check_benchmark_run,
    check_out_folder,
    clear_run_dir,
    make_folder,
    register,
)
from atoll.benchmarks.netns import EmulatedWan, LinkShape, WanError, WanUnavailable, unavailable_reason
from atoll.benchmarks.wan import _csv, _flags, pinned, run_in_wan
from atoll.benchmarks.wan_decoupled_report import projections, write_report
from atoll.benchmarks.wan_measures import (
    compare,
    diloco_curve,
    diloco_useful_tokens,
    granted_rate,
    paced_rate,
    rejoin_times,
    without_evals,
)
from atoll.benchmarks.wan_service import Kill, evaluate_snapshots, run_service_in_wan
from atoll.config.applies import applicable

VARIANTS = ("diloco", "decoupled", "ddp", "diloco-kill", "decoupled-kill", "ddp-kill")
SYNCHRONOUS = ("diloco", "ddp")  # on the collective runtime
KILLED = 1  # the island killed in the -kill variants (island 0 writes the synchronous run's folder)
MARKERS = ("wan.json", "rank0.log", "syncer.log")
_SUB = "|".join(f"(?:{p})" for p in RUN_PATHS)
PATTERNS = (r"wan\.json", r"rank\d+\.log", r"kill_stamp", r"syncer\.log", r"island_\d+(?:\.\d+)?\.log",
            r"tls(?:/syncer\.(?:pem|key))?", r"snapshots(?:/step_\d+(?:/state\.(?:json|safetensors))?)?",
            r"syncer/(?:credentials|service|run)", r"syncer/credentials/\.?island_\d+\.token(?:\.tmp)?",
            r"syncer/service/\.?(?:status|left)\.json(?:\.tmp)?", r"syncer/service/\.?syncer\.pid(?:\.tmp)?",
            rf"syncer/(?:{_SUB})", rf"syncer/run/(?:{_SUB})",
            # the syncer's own: its run's timeline, the settings it pinned, its ledger of commits
            r"syncer/run/timeline\.png", r"syncer/\.?settings\.json(?:\.tmp)?",
            r"syncer/syncer/\.?ledger\.json(?:\.tmp)?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by ``atoll bench wan-decoupled`` and ``bench/wan_decoupled.py``)."""
    a = parser.add_argument
    a("--steps", type=int, default=400, help="inner steps per island (the decoupled run's budget: islands x steps) "
      "[400]")
    a("--sync-every", type=int, default=20, help="H of diloco and decoupled, a multiple of 10; also every how many "
      "steps the synchronous runs evaluate [20]")
    a("--bandwidths", type=_csv(float), default=[10.0, 100.0], metavar="MBPS,...",
      help="each island's link in Mbit/s, each direction [10,100]")
    a("--delay-ms", type=float, default=25.0, help="one-way delay of every site's link, ms [25]")
    a("--syncer-mbps", type=float, default=1000.0, help="the syncer's site's link, Mbit/s [1000]")
    a("--islands", type=int, default=3, help="islands, one namespace and one job each [3]")
    a("--ranks-per-island", type=int, default=1, help="ranks of each island's job, both strategies (decoupled: "
      "torchrun --nproc-per-node R; synchronous: the collective runtime's R ranks per island); the island's batch "
      "is split over them [1]")
    a("--fragments", type=int, default=4, help="P of the decoupled run [4]")
    a("--codec", default="fp32", help="pseudo-gradient codec of both strategies [fp32]")
    a("--kill-step", type=int, default=None,
      help="island 1 is SIGKILLed as it starts this inner step, not a multiple of H [0.4 x steps + H/2 off a "
      "boundary]")
    a("--target-fraction", type=float, default=0.5, help="the target loss is the synchronous failure-free run's at "
      "this fraction of its steps (its outer step at or before); take it where its curve still falls [0.5]")
    a("--drop-fractions", type=_optional(_csv(float)), default=[0.5, 0.75, 0.9], metavar="F,...|none",
      help="also targets at these fractions of the synchronous failure-free run's loss drop (first to last "
      "evaluation): time and tokens to each [0.5,0.75,0.9]")
    a("--island-ranks", type=_optional(_csv(int)), default=[2, 1, 1], metavar="R,...|none",
      help="decoupled: ranks of each island's job (islands of one run may differ); none: --ranks-per-island "
      "each; the synchronous runs keep --ranks-per-island (the collective runtime's islands are all one size) "
      "[2,1,1]")
    a("--island-speeds", type=_optional(_csv(float)), default=[1.0, 1.0, 0.5], metavar="S,...|none",
      help="relative speed of each island, the fastest 1, made real with --step-s: an island of speed s takes at "
      "least step_s / s seconds per inner step (decoupled: its job's --emulate-step-s, and the run declares "
      "island_speeds; synchronous: the collective ranks' pace hook, so every lockstep waits for the slowest) "
      "none: all as fast as the host goes [1,1,0.5]")
    a("--step-s", type=float, default=0.3, help="least seconds of a speed-1 island's inner step, with "
      "--island-speeds; must exceed a speed-1 island's own step time on the loaded host [0.3]")
    a("--variants", type=_csv(str), default=list(VARIANTS), metavar="NAME,...",
      help=f"runs per bandwidth, of {','.join(VARIANTS)} [all]")
    a("--model", default="nano", help="model preset or folder [nano]")
    a("--data", default="stdlib", help="corpus [stdlib]")
    a("--cache-dir", type=Path, default=None, help="tokenizer and token cache [$ATOLL_CACHE_DIR or ~/.cache/atoll]")
    a("--seed", type=int, default=0, help="seed [0]")
    a("--train-arg", action="append", default=[], metavar="FLAG=VALUE",
      help="any other run setting for both strategies, e.g. --train-arg vocab_size=512 (repeatable)")
    a("--tbf-latency-ms", type=float, default=200.0, help="longest wait in a tbf queue before a drop, ms [200]")
    a("--mtu", type=int, default=1500, help="MTU of the links [1500]")
    a("--collective-timeout-s", type=float, default=600.0, help="deadline of each collective of the synchronous "
      "runs [600]")
    a("--run-timeout-s", type=float, default=4 * 3600.0, help="deadline of each run [14400]")
    a("--out", type=Path, default=Path("bench/out/wan_decoupled"), help="output folder [bench/out/wan_decoupled]")
    a("--fresh", action="store_true", help="rerun runs whose results exist")


def add_parser(benches: Any, plain: Any) -> None:
    """Add ``atoll bench wan-decoupled`` to the bench subcommands ``benches`` (``plain``: docstring -> help text)."""
    p = benches.add_parser("wan-decoupled", help="decoupled as deployed (atoll syncer + island jobs, TLS) vs "
                           "synchronous diloco, each site in a network namespace, one island killed (needs root)",
                           description=plain(__doc__) + " Needs root; skips (status 0) without it.")
    add_arguments(p)


def kill_step(args: argparse.Namespace) -> int:
    """The inner step island 1 is killed at: ``--kill-step``, or 0.4 x steps moved half a round off an H boundary."""
    if args.kill_step is not None:
        return int(args.kill_step)
    step = max(2, round(0.4 * args.steps))
    return step + args.sync_every // 2 if step % args.sync_every == 0 else step


def _check_args(args: argparse.Namespace) -> str | None:
    if args.sync_every <= 0 or args.sync_every % 10:
        return f"--sync-every: a positive multiple of 10 (train events come every 10 steps); got {args.sync_every}"
    if not 0 < args.target_fraction <= 1:
        return f"--target-fraction: in (0, 1]; got {args.target_fraction}"
    if args.steps * args.target_fraction < args.sync_every:
        return f"--steps: at least --sync-every / --target-fraction ({args.sync_every / args.target_fraction:g})"
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        return f"--variants: {', '.join(VARIANTS)}; got {unknown}"
    if args.islands < 2:
        return "--islands: at least 2 (island 1 is the one killed)"
    if args.ranks_per_island < 1:
        return f"--ranks-per-island: at least 1; got {args.ranks_per_island}"
    k = kill_step(args)
    if not 1 < k < args.steps or k % args.sync_every == 0:
        return f"--kill-step: between 2 and --steps - 1 and not a multiple of H ({args.sync_every}); got {k}"
    if any(b <= 0 for b in args.bandwidths) or args.delay_ms < 0 or args.syncer_mbps <= 0:
        return "--bandwidths and --syncer-mbps must be > 0 and --delay-ms >= 0"
    if any(not 0 < f < 1 for f in args.drop_fractions or []):
        return f"--drop-fractions: each in (0, 1); got {args.drop_fractions}"
    if args.island_ranks is not None and (len(args.island_ranks) != args.islands or min(args.island_ranks) < 1):
        return f"--island-ranks: {args.islands} values of at least 1 (one per island); got {args.island_ranks}"
    if args.island_speeds is not None:
        if len(args.island_speeds) != args.islands or any(not 0 < s <= 1 for s in args.island_speeds) \
                or max(args.island_speeds) != 1:
            return f"--island-speeds: {args.islands} values in (0, 1], the fastest 1 (or none); got " \
                   f"{args.island_speeds}"
        if args.step_s is None or args.step_s <= 0:
            return "--island-speeds needs --step-s > 0 (the seconds of a speed-1 island's inner step)"
    return None


def _optional(parse: Any) -> Any:
    """A flag's parser that reads ``none`` as None (a default list turned off)."""
    def read(text: str) -> Any:
        return None if text.strip().lower() == "none" else parse(text)
    return read


def island_paces(args: argparse.Namespace) -> list[float] | None:
    """Least seconds of each island's inner step: ``--step-s`` over its speed (None: no pacing)."""
    if args.island_speeds is None:
        return None
    return [args.step_s / s for s in args.island_speeds]


def pace_hook(paces: list[float], ranks_per_island: int) -> str:
    """The collective ranks' pace hook (:data:`atoll.job.faults.PACE_HOOK_ENV`): every rank of island i at
    ``paces[i]`` seconds per inner step (island i is global ranks [i*R, (i+1)*R))."""
    return ",".join(f"{i * ranks_per_island + p}:{s:g}" for i, s in enumerate(paces) for p in range(ranks_per_island))


def settings(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    """A run's settings (:func:`atoll.benchmarks.wan.pinned`; ``--train-arg`` last), as its strategy reads them."""
    s: dict[str, Any] = {"strategy": strategy, "islands": args.islands, "steps": args.steps,
                         "sync_every": args.sync_every, "model": args.model, "data": args.data, "seed": args.seed,
                         "codec": args.codec, "threads": 1, "ranks_per_island": args.ranks_per_island}
    if strategy in SYNCHRONOUS:  # an evaluation every H steps: the loss curve; survivors go on after a loss
        s.update(eval_every=args.sync_every, checkpoint_every=0, min_islands=1,
                 collective_timeout_s=args.collective_timeout_s)
    else:  # (atoll syncer refuses --collective-timeout-s under its default runtime: its default, 600 s, holds)
        s.update(fragments=args.fragments, progress=False)
        if args.island_speeds is not None:  # each island's rounds of s x H steps (the paper's learners of two speeds)
            s["island_speeds"] = ",".join(f"{v:g}" for v in args.island_speeds)
    if args.cache_dir is not None:
        s["cache_dir"] = str(args.cache_dir)
    for item in args.train_arg:
        key, _, value = item.partition("=")
        s[key.strip().lstrip("-").replace("-", "_")] = value
    runtime = "collective" if strategy in SYNCHRONOUS else "service"
    return applicable({**pinned(s), "runtime": runtime})


def run_name(variant: str, args: argparse.Namespace, mbps: float) -> str:
    kind, _, kill = variant.partition("-")
    return f"{kind}-H{args.sync_every}{'-kill' if kill else ''}-{mbps:g}mbit-{args.delay_ms:g}ms"


def _tokens_per_step(s: dict[str, Any]) -> int:
    from atoll.config import build_config

    return build_config(None, s).tokens_per_step


def _iface(sampler: Any, sites: int) -> dict[str, list[int]]:
    first, last = sampler.samples[0], sampler.samples[-1]
    return {"iface_tx_bytes": [float(last[1][i] - first[1][i]) for i in range(sites)],
            "iface_rx_bytes": [float(last[2][i] - first[2][i]) for i in range(sites)]}


def _shape(args: argparse.Namespace, mbps: float) -> LinkShape:
    return LinkShape(rate_mbps=mbps, delay_ms=args.delay_ms, tbf_latency_ms=args.tbf_latency_ms, mtu=args.mtu)


def run_synchronous(args: argparse.Namespace, mbps: float, kill: bool, out: Path,
                    strategy: str = "diloco") -> dict[str, Any]:
    """Synchronous diloco or ddp (``strategy``) on the collective runtime in the emulated WAN; its row."""
    from atoll.job.faults import PACE_HOOK_ENV
    from atoll.job.metrics import read_metrics
    from atoll.runtime.collective import KILL_HOOK_ENV

    s = settings(args, strategy)
    r = args.ranks_per_island  # every rank of island KILLED dies as it starts the kill step: the island is lost
    hook = ",".join(f"{rank}:{kill_step(args)}" for rank in range(KILLED * r, (KILLED + 1) * r))
    env = {KILL_HOOK_ENV: hook, "ATOLL_TEST_KILL_STAMP": str(out / "kill_stamp")} if kill else {}
    paces = island_paces(args)
    if paces is not None:
        env[PACE_HOOK_ENV] = pace_hook(paces, r)
    with EmulatedWan(args.islands, _shape(args, mbps)) as wan:  # survivors go on: no grace before killing them
        res = run_in_wan(wan, s, out, args.run_timeout_s, extra_env=env, grace_s=args.run_timeout_s if kill else 30)
        qdisc = wan.qdisc_stats()
    codes = res["exit_codes"]
    expected = [0 if rank // r != KILLED or not kill else -9 for rank in range(args.islands * r)]
    row: dict[str, Any] = {"exit_codes": codes, "ok": codes == expected and (out / "summary.json").is_file(),
                           "error": None if codes == expected else res["error"], "qdisc": qdisc}
    if not row["ok"]:
        return row
    from atoll.benchmarks.wan_report import steady_state

    summary = json.loads((out / "summary.json").read_text())
    events = read_metrics(out / "metrics.jsonl")
    trains = [e for e in events if e["event"] == "train"]
    start = next(e["time"] for e in events if e["event"] == "start")  # the run clock's 0, as diloco_curve's
    tps = _tokens_per_step(s)
    useful = float(diloco_useful_tokens(args.steps, args.islands, args.sync_every if strategy == "diloco" else 1,
                                        tps, {KILLED: kill_step(args) - 1} if kill else {}))
    curve = diloco_curve(events)  # its last point: the final outer step, the evaluations' time taken out
    evals = [e for e in events if e["event"] == "eval"]  # one per point of the curve
    steady = steady_state(trains, summary, res["sampler"], strategy, args.sync_every, args.sync_every)
    without_evals(steady, events)  # the evaluation after every outer step is the benchmark's, not the run's
    row.update({"curve": curve, "evals": [(e["step"], e["eval_loss"]) for e in evals],
                "run_s": curve[-1][0], "train_s": trains[-1]["time"] - start, "eval_s": summary.get("eval_s"),
                "tokens_per_s": steady["tokens_per_s"], "useful_tokens": useful,
                "step_s": summary["compute_s"] / summary["steps"],
                "final_eval_loss": summary["final_eval_loss"], "tokens": summary["tokens"], "params": summary["params"],
                "atoll_bytes": [summary["bytes_sent_per_island"]] * args.islands,
                "atoll_bytes_received": [summary.get("bytes_received_per_island")] * args.islands,
                "steady_window": {k: steady.get(k) for k in ("window_steps", "window_s", "eval_s",
                                                             "atoll_bytes_per_island", "iface_tx_bytes_per_island",
                                                             "iface_over_atoll")},
                **_iface(res["sampler"], args.islands)})
    if kill:
        row["recovery"] = {k: summary.get(k) for k in ("lost_islands", "islands_alive", "recovery_s",
                                                       "interrupted_exchange_s", "membership")}
    return row


def _step_s(summary: dict[str, Any], exclude: set[int]) -> float | None:
    """Compute seconds per inner step of the decoupled run's islands (their mean), from the compute each reported
    at its end; not the islands in ``exclude`` (one restarted reports its last job's compute only, one that
    never left reports none)."""
    wall = summary.get("run_s", summary.get("sim_wall_s"))  # (the service's training clock; older summaries')
    steps = [u * wall / n for i, (u, n) in enumerate(zip(summary["island_utilization"], summary["steps_per_island"],
                                                          strict=True)) if i not in exclude and u > 0 and n > 0]
    return sum(steps) / len(steps) if steps else None


def run_decoupled(args: argparse.Namespace, mbps: float, kill: bool, out: Path) -> dict[str, Any]:
    """Decoupled DiLoCo as a syncer service and island jobs in the emulated WAN; its row."""
    s = settings(args, "decoupled")
    # (each island job's ranks: torchrun's world size; atoll syncer refuses --ranks-per-island, an island's own)
    flags = _flags({k: v for k, v in s.items() if k not in ("strategy", "runtime", "ranks_per_island")})
    shapes = [_shape(args, mbps)] * args.islands + [_shape(args, args.syncer_mbps)]
    plan = Kill(KILLED, kill_step(args)) if kill else None
    ranks = args.island_ranks or [args.ranks_per_island] * args.islands
    paces = island_paces(args)
    own = [[f"--emulate-step-s={p:g}"] for p in paces] if paces is not None else None
    with EmulatedWan(args.islands + 1, shapes=shapes) as wan:
        res = run_service_in_wan(wan, flags, out, args.run_timeout_s, kill=plan, ranks=ranks, island_flags=own)
        qdisc, forwarder = wan.qdisc_stats(), wan.delay_stats()
    row: dict[str, Any] = {"exit_codes": res["exit_codes"], "ok": res["ok"], "error": res["error"], "qdisc": qdisc,
                           "delay_forwarder": forwarder, "kill_record": res["kill"],
                           "stuck_after_end": res["stuck_after_end"]}
    if not res["ok"]:
        return row
    summary = json.loads((out / "syncer" / "run" / "summary.json").read_text())
    points = evaluate_snapshots(s, out / "snapshots")
    shutil.rmtree(out / "snapshots", ignore_errors=True)  # hundreds of MB; the points are kept in wan.json
    status = [(t, st) for t, st in res["status"]]
    tps = _tokens_per_step(s)
    rate = granted_rate(status, args.islands, args.sync_every, tps)
    # until every island left: the syncer's end, not the last merge (older summaries: sim_wall_s)
    wall = summary.get("run_s", summary.get("sim_wall_s"))
    row.update({"curve": [(0.0, summary["initial_eval_loss"])] + [(p["run_s"], p["eval_loss"]) for p in points],
                "tokens_curve": [(0.0, 0.0)] + [(p["run_s"], p["merged_tokens"]) for p in points],
                "commits_evaluated": len(points), "run_s": points[-1]["run_s"] if points else wall,
                "syncer_run_s": wall, "tokens_per_s": rate["tokens_per_s"],
                "steady_window": rate, "useful_tokens": summary["useful_tokens"],
                "step_s": _step_s(summary, exclude={*res["stuck_after_end"], *([KILLED] if kill else [])}),
                "final_eval_loss": summary["final_eval_loss"], "tokens": summary["tokens"], "params": summary["params"],
                # an island that never left (stuck after the end) never reported its count: None
                "atoll_bytes": [None if i in res["stuck_after_end"] else b
                                for i, b in enumerate(summary["bytes_sent_by_island"])],
                "atoll_bytes_received": [None if i in res["stuck_after_end"] else b
                                         for i, b in enumerate(summary.get("bytes_received_by_island")
                                                               or [None] * args.islands)],
                "status_samples": len(status),
                "syncer_summary": {k: summary.get(k) for k in (
                    "commits", "accepted_updates", "rejected_updates", "rejected_by_reason", "stale_updates",
                    "quorum_size_counts", "staleness_max", "refused_calls", "steps_per_island",
                    "merged_tokens_by_island", "rejoins", "rejoin_s", "islands_left", "grace_window_max_s")},
                **_iface(res["sampler"], args.islands + 1)})
    if kill and res["kill"] is not None and res["kill"]["restarted"] is not None:
        row["recovery"] = rejoin_times(status, KILLED, res["kill"]["time"], res["kill"]["restarted"])
    return row


def run_setup(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """What a run trains, beyond its name (which says the strategy, H, link and kill): its settings and the
    benchmark's islands, paces and kill step. A cached ``wan.json`` is reused only when its ``setup`` is this one
    (an earlier benchmark's run of the same name is trained again)."""
    kind, _, kill = variant.partition("-")
    return json.loads(json.dumps({"settings": settings(args, kind), "island_ranks": args.island_ranks,
                                  "ranks_per_island": args.ranks_per_island, "island_speeds": args.island_speeds,
                                  "step_s": args.step_s, "kill_step": kill_step(args) if kill else None,
                                  "fragments": args.fragments, "syncer_mbps": args.syncer_mbps,
                                  "tbf_latency_ms": args.tbf_latency_ms, "mtu": args.mtu}))


def _cached(args: argparse.Namespace, variant: str, mbps: float) -> dict[str, Any] | None:
    """The run's ``wan.json`` row where it may be reused (not ``--fresh``, and its setup is this one), else None."""
    cached = args.out / run_name(variant, args, mbps) / "wan.json"
    if args.fresh or not cached.is_file():
        return None
    try:
        row = json.loads(cached.read_text())
    except ValueError:
        return None
    return row if isinstance(row, dict) and row.get("setup") == run_setup(args, variant) else None


def one_run(args: argparse.Namespace, variant: str, mbps: float) -> dict[str, Any]:
    """Run (or reuse) one variant at one bandwidth; the row of results.json."""
    name = run_name(variant, args, mbps)
    out = args.out / name
    cached = out / "wan.json"
    setup = run_setup(args, variant)
    row = _cached(args, variant, mbps)
    if row is not None:
        return {**row, "reused": True}
    if cached.is_file() and not args.fresh:
        print(f"[wan-decoupled] {name}: its wan.json has other settings (an earlier setting of the benchmark); "
              "trained again", file=sys.stderr, flush=True)
    if check_benchmark_run(args.out, name, MARKERS, PATTERNS):
        clear_run_dir(out, MARKERS, PATTERNS)
    make_folder(args.out)
    register(args.out, name)
    kind, _, kill = variant.partition("-")
    load, uptime = os.getloadavg()[0], _uptime()
    print(f"[wan-decoupled] {name}: {args.islands} islands x {args.steps} steps at {mbps:g} Mbit/s, "
          f"{args.delay_ms:g} ms one way{', island 1 killed' if kill else ''} (load {load:.1f})",
          file=sys.stderr, flush=True)
    t0 = time.time()
    row = run_decoupled(args, mbps, bool(kill), out) if kind == "decoupled" else \
        run_synchronous(args, mbps, bool(kill), out, kind)
    row.update({"run": name, "variant": variant, "strategy": kind, "kill": bool(kill),
                "kill_step": kill_step(args) if kill else None, "mbps": mbps, "delay_ms": args.delay_ms,
                "H": args.sync_every, "steps": args.steps, "islands": args.islands, "wall_s": time.time() - t0,
                "load_start": load, "load_end": os.getloadavg()[0], "uptime_start": uptime, "uptime_end": _uptime(),
                "setup": setup})
    if row["ok"]:
        cached.write_text(json.dumps(row, indent=2))
    else:
        print(f"[wan-decoupled] {name} failed: {row['error']}", file=sys.stderr, flush=True)
    return row


def check_out(args: argparse.Namespace) -> None:
    """Refuse an ``--out`` that is not atoll's before anything runs (as :func:`atoll.benchmarks.wan.check_out`)."""
    check_out_folder(args.out)
    for mbps in args.bandwidths:
        for v in args.variants:
            if _cached(args, v, mbps) is None:
                check_benchmark_run(args.out, run_name(v, args, mbps), MARKERS, PATTERNS)


def _uptime() -> str:
    """``uptime``'s line (the machine's load when a timing was taken)."""
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + " ".join(Path("/proc/loadavg").read_text().split()[:3])



def run_benchmark(args: argparse.Namespace) -> int:
    """The benchmark; the exit status (0: done or skipped; 1: a run failed; 2: bad flags or ``--out``)."""
    reason = unavailable_reason()
    if reason is not None:
        print(f"atoll bench wan-decoupled: skipped: {reason}")
        return 0
    problem = _check_args(args)
    if problem:
        print(f"atoll: error: {problem}", file=sys.stderr)
        return 2
    from atoll.config import build_config
    from atoll.errors import AtollError
    from atoll.job.data import default_cache_dir, prepare_data
    from atoll.job.data.pretrained import tokenizer_source

    try:  # the settings checked and the data prepared once (every process reads the cache)
        check_out(args)
        for strategy in sorted({v.partition("-")[0] for v in args.variants} | {"diloco"}):
            config = build_config(overrides=settings(args, strategy))
        cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache,
                     partition=config.partition, text_field=config.text_field,
                     tokenizer=tokenizer_source(config.model, config.tokenizer), max_documents=config.max_documents)
    except AtollError as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        return 2
    uptime_start = _uptime()
    rows: list[dict[str, Any]] = []
    try:
        for mbps in args.bandwidths:
            for variant in args.variants:
                rows.append(one_run(args, variant, mbps))
                rows[-1]["tokens_per_step"] = config.tokens_per_step
                if args.island_speeds is not None:  # goodput over the paced islands' failure-free rate
                    rows[-1]["ideal_tokens_per_s"] = paced_rate(args.island_speeds, config.tokens_per_step,
                                                                args.step_s)
    except (WanUnavailable, WanError) as e:
        print(f"atoll bench wan-decoupled: {'skipped' if isinstance(e, WanUnavailable) else 'error'}: {e}")
        return 0 if isinstance(e, WanUnavailable) else 1
    except AtollError as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("atoll bench wan-decoupled: interrupted; the emulated network was removed; finished runs are kept "
              "and reused by the next call", file=sys.stderr)
        return 130
    compare(rows, args.target_fraction, args.drop_fractions or ())
    params = next((r["params"] for r in rows if r.get("ok")), None)
    meta = {"islands": args.islands, "ranks_per_island": args.ranks_per_island, "model": args.model, "params": params,
            "steps": args.steps,
            "sync_every": args.sync_every, "fragments": args.fragments, "codec": args.codec,
            "delay_ms": args.delay_ms, "syncer_mbps": args.syncer_mbps, "kill_step": kill_step(args),
            "target_fraction": args.target_fraction, "drop_fractions": args.drop_fractions,
            "island_ranks": args.island_ranks, "island_speeds": args.island_speeds, "step_s": args.step_s,
            "tokens_per_step": config.tokens_per_step, "uptime_start": uptime_start, "uptime_end": _uptime(),
            "trained_now": [r["run"] for r in rows if not r.get("reused")],
            "cpus": os.cpu_count(),
            "command": command_line("wan_decoupled.py")}
    table = write_report(args.out, rows, meta, projections(rows, meta))
    print(table)
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """``python bench/wan_decoupled.py``: the flags (``--out`` defaults to the repository's
    ``bench/out/wan_decoupled``), then the benchmark; the exit status."""
    parser = argparse.ArgumentParser(prog="bench/wan_decoupled.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(out=default_out("wan_decoupled"))
    return run_benchmark(parser.parse_args(argv))
