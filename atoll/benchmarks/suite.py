"""Every strategy and the main codecs on the default benchmark at equal tokens: one table, one set of plots.

    atoll bench suite                       # the default run of every strategy (about 2 hours on 2 cores)
    atoll bench suite --quick               # micro model, 20 steps, into bench/out/suite-quick: about a minute

Runs (:func:`runs`: each strategy's rows of its spec, so a new strategy brings its own): one island alone
(``ddp --islands 1``, the reference), ``ddp``, ``diloco`` H=50 with fp32 and int4 pseudo-gradients, ``streaming`` (P=4,
int4, overlap tau=1, alpha=0.5), ``demo`` (top-k 32 of 64x64 DCT chunks, 2-bit sign values) and ``decoupled``
(when the config accepts that strategy; otherwise listed as not available). Every run trains once, on the ``local``
runtime; its clock trace (:class:`atoll.runtime.network.ClockTrace`: measured compute per island, bytes
and rounds of every collective, who waited for which) is then re-timed at 10 Mbit/s, 100 Mbit/s, 1 Gbit/s
and 10 Gbit/s by :func:`atoll.runtime.network.replay`, overlapped exchanges included: the link changes
only the clock, never the training maths.

Writes into ``--out`` (default ``bench/out/suite``, ``bench/out/suite-quick`` with ``--quick``): one atoll run folder
per run, ``results.json``, ``results.md`` (a Markdown table: final eval loss and its gap to ddp, bytes per island and
the reduction against ddp, simulated wall time and compute utilization at each bandwidth, goodput under the standard
failure trace where the strategy reports one), ``suite.png`` (loss, bytes, utilization and wall time
against bandwidth) and ``loss_curves.png`` (held-out loss of every run against tokens and simulated time).
A finished run whose ``config.json`` matches (with its clock trace) is reused
(:func:`atoll.benchmarks.common.train_once`); ``--fresh`` reruns all. A folder in ``--out`` named like a run but
not written by atoll is never removed: the suite stops with one line (status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from atoll.analysis.chaos import STANDARD_DOWN_FRACTION, STANDARD_MTBF_FRACTION, standard_chaos
from atoll.benchmarks.common import Column, default_out, finished, train_once, write_results
from atoll.benchmarks.folders import check_out_folder
from atoll.errors import AtollError, ConfigError

#: link bandwidths every run is re-timed at, Mbit/s
BANDWIDTHS_MBPS = (10.0, 100.0, 1000.0, 10000.0)

def runs() -> tuple[tuple[str, str, dict[str, Any]], ...]:
    """The runs, in table order: (name, label, settings), each strategy's rows of its spec
    (:attr:`atoll.strategies.registry.StrategySpec.suite`). Settings are TrainConfig fields on top of the base;
    the label is formatted with the run's final settings (--quick shortens H and P)."""
    from atoll.strategies.registry import specs

    return tuple((r.name, r.label, dict(r.settings)) for s in specs() for r in s.suite)


#: The standard failure trace is :func:`atoll.analysis.chaos.standard_chaos` (also bench/decoupled.py's): ``decoupled``
#: trains under it (``--chaos``, T = steps x sim_step_s) and reports the goodput it measured; a synchronous
#: strategy's goodput under it is computed from its failure-free clock by :func:`synchronous_goodput`.


def synchronous_goodput(summary: dict[str, Any]) -> float:
    """Goodput of a synchronous run (ddp, diloco, streaming, demo) under the standard failure trace.

    Replays the trace (:func:`atoll.analysis.chaos.synchronous_under_failures`) on the run's failure-free clock: each
    inner step takes ``sim_wall_s / steps`` seconds (its exchanges included), a round is H steps (1 for ddp
    and demo), any island's failure stops every island until it is back, and the round in progress is redone
    (a checkpoint at every round: the most favourable case for the synchronous run). Goodput is useful tokens
    per second over the failure-free rate (1.0 without failures).
    """
    from atoll.analysis.chaos import FailureTrace, synchronous_under_failures

    islands, steps, wall = int(summary["islands"]), int(summary["steps"]), float(summary["sim_wall_s"])
    from atoll.strategies.registry import spec

    h = int(summary["sync_every"]) if spec(summary["strategy"]).syncs_per_h else 1
    trace = FailureTrace.from_spec(standard_chaos(wall), islands, int(summary["seed"]))
    tokens_per_step = int(summary["tokens"]) // (islands * steps)
    return float(synchronous_under_failures(trace, steps, h, [wall / steps] * islands, 0.0, tokens_per_step)["goodput"])

#: the default benchmark: the TrainConfig defaults (model, corpus, 4 islands, steps), one torch thread
FULL: dict[str, Any] = {}
#: --quick: the micro model and a few steps (used by tests)
QUICK = {"model": "micro", "steps": 20, "seq_len": 32, "batch_size": 4, "eval_batches": 2, "eval_every": 10}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="micro model, 20 steps, H=10, 2 fragments "
                        "(a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="inner steps per island [the default; --quick: 20]")
    parser.add_argument("--out", type=Path, default=None, help="output folder "
                        "[default: bench/out/suite of the repository; --quick: bench/out/suite-quick]")
    parser.add_argument("--data", default=None, help="corpus (as atoll train --data) [default: stdlib]")
    parser.add_argument("--cache-dir", type=Path, default=None, help="tokenizer/token cache (as atoll train)")
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (as atoll train)")
    parser.add_argument("--only", default=None, help="comma-separated run names to run (default: all): "
                        + ", ".join(name for name, _, _ in runs()))
    parser.add_argument("--fresh", action="store_true", help="rerun every run, ignoring finished ones")


def base_settings(args: argparse.Namespace) -> dict[str, Any]:
    """TrainConfig settings shared by every run of the suite."""
    base: dict[str, Any] = {"progress": False, "threads": 1, "checkpoint_every": 0,
                            "link_bandwidth_mbps": 100.0, **(QUICK if args.quick else FULL)}
    if args.steps is not None:
        base["steps"] = args.steps
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"steps: must be at least 1 (got {args.steps}); set --steps")
    for key in ("data", "cache_dir", "vocab_size"):
        if getattr(args, key) is not None:
            base[key] = str(getattr(args, key)) if key == "cache_dir" else getattr(args, key)
    return base


def run_settings(base: dict[str, Any], settings: dict[str, Any], quick: bool) -> dict[str, Any]:
    """One run's settings, plus failure settings for its strategy; --quick: H=10 and 2 fragments (the micro
    model has 2 layers)."""
    from atoll.config.sections import RunSection
    from atoll.strategies.decoupled import DecoupledConfig

    s = {**base, **settings}
    if quick:  # read only by the strategies that sync every H steps, fragment by fragment
        s.setdefault("sync_every", 10)
        s.setdefault("fragments", 2)
    if s.pop("standard_chaos", False):
        steps = s.get("steps", RunSection.model_fields["steps"].default)
        s["chaos"] = standard_chaos(steps * DecoupledConfig.model_fields["sim_step_s"].default)
    return s


def available(settings: dict[str, Any]) -> bool:
    """Whether this atoll's config accepts the run's strategy (``decoupled`` lands separately)."""
    from atoll.config import build_config

    try:
        build_config(overrides={"strategy": settings["strategy"]})
        return True
    except ConfigError:
        return False


def retime(run_dir: Path, summary: dict[str, Any], bandwidth_mbps: float) -> dict[str, float]:
    """Simulated wall time and compute utilization of a finished run at ``bandwidth_mbps`` (same latency)."""
    from atoll.runtime.network import Link, load_trace, replay

    trace = load_trace(run_dir / "clock_trace.json")
    return replay(trace, Link.from_config(bandwidth_mbps, summary["link_latency_ms"]))


def _label(label: str, settings: dict[str, Any] | None) -> str:
    """A row's label formatted with the run's resolved settings (its strategy's defaults included)."""
    from atoll.config import build_config

    if settings is None:
        return label
    config = build_config(base={k: v for k, v in settings.items() if k not in ("progress", "out")})
    return label.format(**config.model_dump())


def collect(suite_dir: Path, names: list[str], summaries: dict[str, dict[str, Any]],
            used: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rows of the table from the runs' summaries and re-timed clocks (``used``: each run's settings)."""
    from atoll.strategies.registry import spec

    ddp = summaries.get("ddp")
    rows = []
    for name, label, settings in runs():
        if name not in names:
            continue
        label = _label(label, used.get(name)) if name in used else label.replace("{", "").replace("}", "")
        s = summaries.get(name)
        if s is None:
            rows.append({"run": name, "label": label, "strategy": settings["strategy"], "available": False})
            continue
        row: dict[str, Any] = {
            "run": name, "label": label, "strategy": s["strategy"], "codec": s["codec"], "islands": s["islands"],
            "available": True, "steps": s["steps"], "tokens": s["tokens"], "final_eval_loss": s["final_eval_loss"],
            "gap_vs_ddp_pct": (100 * (s["final_eval_loss"] - ddp["final_eval_loss"]) / ddp["final_eval_loss"]
                               if ddp else None),
            "bytes_sent_per_island": s["bytes_sent_per_island"],
            "reduction_vs_ddp": (ddp["bytes_sent_per_island"] / s["bytes_sent_per_island"]
                                 if ddp and s["bytes_sent_per_island"] else None),
            "compute_s": s["compute_s"],
        }
        if spec(s["strategy"]).lockstep is None:  # asynchronous: its own event clock, no clock trace
            # its own event clock (fixed sim_step_s per step): goodput measured under the trace when trained
            # under it; its wall time is not comparable with the measured clocks of the others
            row["goodput"] = s.get("goodput")  # failure-free: its exchanges' cost alone
            for bw in BANDWIDTHS_MBPS:
                row[f"sim_wall_s@{bw:g}"] = row[f"utilization@{bw:g}"] = None
        else:
            row["goodput"] = synchronous_goodput(s)
            for bw in BANDWIDTHS_MBPS:
                t = retime(suite_dir / name, s, bw)
                row[f"sim_wall_s@{bw:g}"] = t["sim_wall_s"]
                row[f"utilization@{bw:g}"] = t["compute_utilization"]
        rows.append(row)
    return {"bandwidths_mbps": list(BANDWIDTHS_MBPS),
            "failure_trace": {"mtbf_fraction": STANDARD_MTBF_FRACTION, "down_fraction": STANDARD_DOWN_FRACTION},
            "rows": rows, "runs": summaries}


def _bw_label(bw: float) -> str:
    return f"{bw / 1000:g} Gbit/s" if bw >= 1000 else f"{bw:g} Mbit/s"


def _loss(v: float) -> str:
    return f"{v:.3f}"


def _pct(v: float) -> str:
    return f"{v:+.1f}%"


def _bytes(v: float) -> str:
    from atoll.job.metrics import human_bytes

    return human_bytes(v)


def _times(v: float) -> str:
    return f"{v:,.0f}x"


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _wall_util(v: tuple[float | None, float | None]) -> str:
    return f"{_seconds(v[0])} / {_share(v[1])}"


def table(results: dict[str, Any], command: str) -> tuple[list[Column], list[dict[str, Any]], list[str]]:
    """The columns, rows and notes of ``results.md`` (:func:`atoll.benchmarks.common.markdown_table`)."""
    bws = results["bandwidths_mbps"]
    columns: list[Column] = [("run", "label"), ("eval loss", "final_eval_loss", _loss),
                             ("vs ddp", "gap_vs_ddp_pct", _pct), ("bytes/island", "bytes_sent_per_island", _bytes),
                             ("less than ddp", "reduction_vs_ddp", _times)]
    columns += [(f"wall s / util @{_bw_label(b)}", f"wall_util@{b:g}", _wall_util) for b in bws]
    columns.append(("goodput (failure trace)", "goodput", _share))
    rows = []
    for r in results["rows"]:
        if not r["available"]:  # one cell across: the others empty
            rows.append({"label": r["label"], "final_eval_loss": f"not available (strategy '{r['strategy']}' not in "
                         "this atoll)", **{c[1]: "" for c in columns[2:]}})
            continue
        rows.append({**r, **{f"wall_util@{b:g}": (r[f"sim_wall_s@{b:g}"], r[f"utilization@{b:g}"]) for b in bws}})
    first = next((r for r in results["rows"] if r["available"] and r["islands"] > 1), None)
    notes = [f"Equal tokens: {first['steps']} inner steps per island ({first['tokens']:,} tokens for "
             f"{first['islands']} islands). Wall time: the run's clock trace re-timed at each bandwidth (10 ms "
             "latency); decoupled runs on its own event clock (a fixed simulated step), not re-timed. Goodput under "
             "the standard failure trace (each island down about 10% of the time, seeded): trained for decoupled "
             "(its plain row: without failures), replayed on the failure-free clock for the synchronous strategies "
             "(atoll.benchmarks.suite.synchronous_goodput)."] if first else []
    return columns, rows, [*notes, f"command: {command}"]


def plot(results: dict[str, Any], out_png: Path) -> Path:
    """Four panels: final loss, bytes per island, utilization and wall time against bandwidth."""
    from atoll.job.figures import pyplot

    plt = pyplot()

    rows = [r for r in results["rows"] if r["available"]]
    names = [r["run"] for r in rows]
    bws = results["bandwidths_mbps"]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    ax[0, 0].barh(names, [r["final_eval_loss"] for r in rows], color="tab:blue")
    losses = [r["final_eval_loss"] for r in rows]
    ax[0, 0].set_xlim(min(losses) - 0.1 * (max(losses) - min(losses) + 0.1), max(losses) + 0.05)
    ax[0, 0].set_xlabel("final held-out loss (nats/token)")
    ax[0, 0].invert_yaxis()
    sent = [max(r["bytes_sent_per_island"], 1.0) for r in rows]
    ax[0, 1].barh(names, sent, color="tab:orange")
    ax[0, 1].set_xscale("log")
    ax[0, 1].set_xlabel("bytes sent per island (log)")
    ax[0, 1].invert_yaxis()
    for r in rows:
        if r[f"utilization@{bws[0]:g}"] is None:  # decoupled: its own event clock, not re-timed
            continue
        ax[1, 0].plot(bws, [r[f"utilization@{b:g}"] for b in bws], marker="o", label=r["run"])
        ax[1, 1].plot(bws, [r[f"sim_wall_s@{b:g}"] for b in bws], marker="o", label=r["run"])
    ax[1, 0].set_ylabel("compute utilization")
    ax[1, 1].set_ylabel("simulated wall time (s)")
    ax[1, 1].set_yscale("log")
    for a in (ax[1, 0], ax[1, 1]):
        a.set_xscale("log")
        a.set_xlabel("link bandwidth (Mbit/s)")
        a.grid(alpha=0.3)
    ax[1, 0].legend(fontsize=7)
    fig.suptitle("atoll bench suite: equal tokens, 4 islands")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def run_suite(args: argparse.Namespace) -> int:
    """``atoll bench suite``: train (or reuse) every run, write results.json, results.md and the plots."""
    names = [n for n, _, _ in runs()]
    if args.only is not None:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        if not wanted:
            raise ConfigError(f"only: no run named; use some of {', '.join(names)}")
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise ConfigError(f"only: unknown run '{unknown[0]}'; use some of {', '.join(names)}")
        names = [n for n in names if n in wanted]
    base = base_settings(args)
    # --quick never writes over the committed results of the full suite
    suite_dir = Path(args.out) if args.out is not None else default_out("suite-quick" if args.quick else "suite")
    check_out_folder(suite_dir, keys=("rows", "runs", "command"))  # a user's results.json lacks them
    try:
        suite_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out: cannot make the folder '{suite_dir}' ({e.strerror or e}); "
                          "pass another --out") from None
    from atoll.config import build_config

    summaries: dict[str, dict[str, Any]] = {}
    used: dict[str, dict[str, Any]] = {}
    for name, _, settings in runs():
        if name in names:
            used[name] = run_settings(base, settings, args.quick)
            build_config(base={k: v for k, v in used[name].items() if k != "progress"})  # every run checked
    for name, s in used.items():  # before any is trained or replaced
        if not available(s):
            print(f"[suite] {name}: not available (strategy '{s['strategy']}' is not in this atoll)", file=sys.stderr)
            continue
        summaries[name] = train_once(suite_dir, name, args.fresh, tag="suite", **s)
    if not summaries:
        raise AtollError("suite: no run was available to run; check --only")
    if args.only is not None:  # the table still holds every other run already finished here (none is trained)
        for name, _, settings in runs():
            s = run_settings(base, settings, args.quick)
            if name not in used and available(s) and finished(suite_dir / name, s):
                used[name] = s
                summaries[name] = train_once(suite_dir, name, False, tag="suite", **s)
        names = [n for n, _, _ in runs() if n in used]
        summaries = {n: summaries[n] for n in names if n in summaries}  # in the suite's order
    flags = [("--only", args.only), ("--steps", args.steps), ("--data", args.data), ("--cache-dir", args.cache_dir),
             ("--vocab-size", args.vocab_size), ("--out", args.out)]
    command = "atoll bench suite" + (" --quick" if args.quick else "") + "".join(
        f" {flag} {value}" for flag, value in flags if value is not None)
    results = collect(suite_dir, names, summaries, used)
    results["command"] = command
    columns, rows, notes = table(results, command)
    from atoll.benchmarks import targets

    results["time_to_target"] = targets.time_to_target(suite_dir, summaries)
    text = write_results(suite_dir, results, columns, rows, notes=notes, bullets=False)
    plot(results, suite_dir / "suite.png")
    labels = {r["run"]: r["label"] for r in results["rows"]}
    if results["time_to_target"]:
        text += "\n### Time to a target loss\n\n" + targets.markdown(results["time_to_target"], labels)
        (suite_dir / "results.md").write_text(text)
        targets.plot(results["time_to_target"], suite_dir / "time_to_target.png", labels)
    from atoll.job.report import plot_runs

    trained = [n for n in names if n in summaries]
    plot_runs([suite_dir / n for n in trained], suite_dir / "loss_curves.png", labels=[labels[n] for n in trained])
    print(text)
    print(f"wrote {suite_dir}/results.json, results.md, suite.png, time_to_target.png, loss_curves.png")
    return 0

