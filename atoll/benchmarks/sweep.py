"""``atoll sweep``: a grid of runs on your own setting, compared at equal tokens and at equal wall time on a link.

    atoll sweep --outer-lr 0.5,0.7,1.0 --outer-momentum 0,0.5,0.9 --sync-every 10,25,50 --at-mbps 100
    atoll sweep --model PATH --data FILE --sync-every 25,50,100 --codec fp32,int4 --at-mbps 1000 --step-s 2.5

Every ``atoll train`` flag may be given a comma-separated list; the grid is every combination of the flags
given several values (the others are shared by every run), less, for each point, those its strategy or runtime
does not read (:func:`trim`: ddp in a grid of H trains once). Each point trains once into ``<out>/<point>/``
(a finished run whose settings match is reused, so a sweep can be extended or interrupted and resumed; its
runs are normal atoll run folders; a point that a sweep of another grid trained in ``<out>`` under another name,
with the same settings, is reused too, and every point the folder holds is in the table, by every setting its
grids swept), then the sweep compares them:

- at equal tokens: each run's final held-out loss (every point sees the same tokens unless the grid varies
  ``steps``, ``batch_size``, ``seq_len`` or ``islands``);
- at equal wall time on the chosen link (``--at-mbps``, ``--at-latency-ms``): each lockstep run's clock trace
  re-timed there (:func:`atoll.analysis.curves.loss_vs_time`), with every inner step's compute set to
  ``--step-s`` seconds (default: the median of the lockstep runs' measured step times, so that the machine's
  load does not pick the winner), and the loss each reached when the fastest run finished;
- the time each needs to reach the worst final loss of the grid (a quality every point reaches).

An asynchronous strategy (decoupled) runs on its own simulated clock; its times are shown at the link it
trained on only, and a grid of such runs alone has no equal-time comparison. Points whose settings are the
same once parsed (``--outer-lr 0.7,0.70``) train once. ``<out>`` is checked first as the suite's
(:func:`atoll.benchmarks.folders.check_out_folder`); a point whose ``summary.json`` is damaged trains again.
Writes ``<out>/results.json``, ``results.md`` (one row per point, best marked) and
``sweep.png`` (loss against tokens and against time on the link).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import finished, read_summary, train_once, write_results
from atoll.benchmarks.folders import check_out_folder, registered
from atoll.errors import ConfigError

#: what a sweep's results.json holds (a user's JSON object in --out lacks them: left untouched)
SWEEP_KEYS = ("rows", "swept", "command")

#: settings whose single value is itself a comma-separated list: not sweepable
NOT_SWEPT = ("island_speeds", "ray_island_resources", "tracker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's own flags (every ``atoll train`` flag is added by the command line, as lists)."""
    parser.add_argument("--at-mbps", type=float, default=100.0, help="the link to compare wall times on, "
                        "Mbit/s per island [default: 100]")
    parser.add_argument("--at-latency-ms", type=float, default=10.0, help="its one-way latency [default: 10]")
    parser.add_argument("--step-s", type=float, default=None, help="seconds of compute of one inner step of one "
                        "island to time every run with (your hardware's) [default: the runs' median, measured]")
    parser.add_argument("--fresh", action="store_true", help="train every point again")


def grid(values: dict[str, str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(settings shared by every point, one dict of swept settings per point) from flag values as given.

    Raises:
        ConfigError: an empty value in a list, or a list given to a setting that cannot be swept.
    """
    shared: dict[str, Any] = {}
    swept: dict[str, list[str]] = {}
    for name, value in values.items():
        parts = [p.strip() for p in str(value).split(",")] if isinstance(value, str) else [value]
        if len(parts) > 1 and name not in NOT_SWEPT:
            if any(p == "" for p in parts):
                raise ConfigError(f"{name}: '{value}' has an empty value; give a comma-separated list such as 1,2")
            swept[name] = list(dict.fromkeys(parts))
        else:
            shared[name] = value
    points = [dict(zip(swept, combo, strict=True)) for combo in itertools.product(*swept.values())]
    return shared, points or [{}]


def trim(shared: dict[str, Any], points: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """(the points, each without the swept settings its strategy and runtime do not read, those that become the
    same kept once, in order; one line per strategy whose points were merged so: ``ddp does not read sync_every:
    one run instead of 2``). Which settings a run reads is :func:`atoll.config.applies.applicable`'s."""
    from atoll.config import TrainConfig
    from atoll.config.applies import applicable

    kept: dict[str, dict[str, Any]] = {}
    merged: dict[str, tuple[list[int], set[str], dict[str, None]]] = {}  # who -> (points, runs, settings unread)
    for p in points:
        read = applicable({**shared, **p})
        q = {k: v for k, v in p.items() if k in read}
        key = json.dumps(q, sort_keys=True, default=str)
        kept.setdefault(key, q)
        unread = [k for k in p if k not in read]
        if unread:
            run = {**shared, **p}
            who = str(run.get("strategy", TrainConfig.model_fields["strategy"].default))
            if "runtime" in p:
                who += f" on the {p['runtime']} runtime"
            count, runs, names = merged.setdefault(who, ([0], set(), {}))
            count[0] += 1
            runs.add(key)
            names.update(dict.fromkeys(unread))
    notes = [f"{who} does not read {', '.join(names)}: "
             f"{'one run' if len(runs) == 1 else f'{len(runs)} runs'} instead of {count[0]}"
             for who, (count, runs, names) in merged.items()]
    return list(kept.values()), notes


def check_link(args: argparse.Namespace) -> None:
    """The sweep's own numbers, before anything trains: ``--at-mbps`` finite above 0, ``--at-latency-ms`` finite
    and 0 or more, ``--step-s`` (when given) finite above 0.

    Raises:
        ConfigError: one of them is not (one line naming the flag and what to pass).
    """
    for name, value, zero_ok, what in (
            ("at_mbps", args.at_mbps, False, "a finite number of Mbit/s above 0, e.g. --at-mbps 100"),
            ("at_latency_ms", args.at_latency_ms, True, "a finite number of ms, 0 or more, e.g. --at-latency-ms 10"),
            ("step_s", args.step_s, False, "a finite number of seconds above 0, e.g. --step-s 0.5, or leave it out "
             "(the runs' median)")):
        if value is not None and not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
            raise ConfigError(f"{name}: --{name.replace('_', '-')} {value:g} is not allowed; pass {what}")


def distinct(points: list[dict[str, Any]], settings: list[dict[str, Any]]) -> tuple[list[int], list[str]]:
    """(indices of the points to train: the first of those whose parsed settings are the same, the
    duplicates each dropped point differs by as text: ``outer_lr 0.70 = 0.7``)."""
    first: dict[str, int] = {}
    keep: list[int] = []
    dropped: dict[str, None] = {}
    for i, s in enumerate(settings):
        j = first.setdefault(json.dumps(s, sort_keys=True), i)
        if j == i:
            keep.append(i)
        else:
            dropped.update({f"{k} {v} = {points[j][k]}": None for k, v in points[i].items() if v != points[j][k]})
    return keep, list(dropped)


def point_name(point: dict[str, Any]) -> str:
    """A run folder name for a point of the grid: ``sync_every-25_outer_lr-0.7``, or ``run`` for no grid."""
    return "_".join(f"{k}-{v}" for k, v in point.items()).replace("/", "-") or "run"


def compare(out: Path, names: list[str], points: list[dict[str, Any]], summaries: list[dict[str, Any]],
            link_mbps: float, latency_ms: float, step_s: float | None) -> dict[str, Any]:
    """The comparison of a grid's finished runs (see the module docstring), each in ``out/<name>`` with the
    swept settings ``point``; rows in that order."""
    from atoll.analysis.curves import loss_vs_time, loss_vs_tokens, reference_step_s
    from atoll.strategies.registry import spec

    dirs = [out / n for n in names]
    timed = [spec(s["strategy"]).lockstep is not None for s in summaries]  # an asynchronous run keeps its clock
    measured = [s["compute_s"] / s["steps"] if t else None for s, t in zip(summaries, timed, strict=True)]
    step = (step_s if step_s is not None else reference_step_s(summaries)) if any(timed) else None
    curves = [loss_vs_time(d, link_mbps, latency_ms, step_s=step) if t else loss_vs_time(d)
              for d, t in zip(dirs, timed, strict=True)]
    finish = [c.xs[-1] for c in curves]
    t_equal = min(f for f, t in zip(finish, timed, strict=True) if t) if any(timed) else None
    target = max(s["final_eval_loss"] for s in summaries)
    rows = []
    for name, point, s, curve, t in zip(names, points, summaries, curves, timed, strict=True):
        rows.append({"point": name, **point, "strategy": s["strategy"],
                     "tokens": s["tokens"], "final_eval_loss": s["final_eval_loss"],
                     "bytes_sent_per_island": s["bytes_sent_per_island"],
                     "wall_s_on_link": curve.xs[-1] if t else None,
                     "loss_at_equal_time": curve.at(t_equal) if t and t_equal is not None else None,
                     "time_to_target_s": curve.first_below(target) if t else None,
                     "tokens_curve": list(zip(*(lambda c: (c.xs, c.losses))(loss_vs_tokens(out / name)),
                                              strict=True)),
                     "time_curve": list(zip(curve.xs, curve.losses, strict=True))})
    best = {key: min((r for r in rows if r[key] is not None), key=lambda r: r[key])["point"]
            for key in ("final_eval_loss", "loss_at_equal_time", "time_to_target_s")
            if any(r[key] is not None for r in rows)}
    return {"link_mbps": link_mbps, "link_latency_ms": latency_ms, "step_s": step, "step_s_measured": measured,
            "equal_time_s": t_equal, "target_loss": target, "best": best, "rows": rows}


def plot(results: dict[str, Any], out_png: Path) -> None:
    """Loss against tokens and against time on the link, one line per point."""
    from atoll.job.figures import pyplot

    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results["rows"]:
        a.plot(*zip(*r["tokens_curve"], strict=True), marker=".", label=r["point"])
        b.plot(*zip(*r["time_curve"], strict=True), marker=".", label=r["point"])
    a.set_xlabel("training tokens (all islands)")
    b.set_xlabel(f"seconds at {results['link_mbps']:g} Mbit/s, {results['step_s']:.3g} s per inner step"
                 if results["step_s"] is not None else "seconds on each run's own simulated clock")
    for ax in (a, b):
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
    if results["equal_time_s"] is not None:
        b.axvline(results["equal_time_s"], color="grey", lw=0.8)
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


#: settings that do not change what a run computes: a point trained with others is the same point
NOT_THE_RUN = ("out", "progress", "progress_every")
#: a row's own entries in results.json (the rest of a row are the settings swept)
ROW_KEYS = ("point", "strategy", "tokens", "final_eval_loss", "bytes_sent_per_island", "wall_s_on_link",
            "loss_at_equal_time", "time_to_target_s", "tokens_curve", "time_curve")


def run_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Every setting of the run that :func:`~atoll.benchmarks.common.train_once` trains for a point's ``settings``
    (no progress bar, one thread unless set), as its ``config.json`` holds them, less :data:`NOT_THE_RUN`:
    what makes two points the same run."""
    from atoll.config import build_config

    full = build_config(base={"progress": False, "threads": 1, **settings}, overrides={})
    return {k: v for k, v in json.loads(full.model_dump_json()).items() if k not in NOT_THE_RUN}


def earlier_points(out: Path) -> dict[str, dict[str, Any]]:
    """The finished runs a sweep trained in ``out`` (any grid): folder name -> its settings (as
    :func:`run_settings`); a run whose ``summary.json`` is damaged is left out (it trains again when its
    point is asked for)."""
    points = {}
    for name in sorted(registered(out)) if out.is_dir() else []:
        try:
            config = json.loads((out / name / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(config, dict) and finished(out / name, {k: config[k] for k in ("strategy", "runtime")
                                                             if k in config}):
            points[name] = {k: v for k, v in config.items() if k not in NOT_THE_RUN}
    return points


def previous_swept(out: Path) -> list[str]:
    """The settings swept by the grids whose table ``out/results.json`` holds (in order; none if none)."""
    try:
        results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    if not isinstance(results, dict):
        return []
    if isinstance(results.get("swept"), list):
        return [str(k) for k in results["swept"]]
    rows = results.get("rows") if isinstance(results.get("rows"), list) else []
    return list(dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r if k not in ROW_KEYS))


def never_read(shared: dict[str, Any], points: list[dict[str, Any]]) -> str | None:
    """The one-line refusal of the first setting given once (``shared``) that no point's strategy and runtime
    read (:func:`atoll.config.applies.unused_setting` of the first point), as ``atoll train`` refuses it; None
    when every one is read by some point. A setting some points read and others not is a note of :func:`trim`."""
    from atoll.config import TrainConfig
    from atoll.config.applies import unused_setting
    from atoll.strategies.registry import names

    default_strategy = TrainConfig.model_fields["strategy"].default
    default_runtime = TrainConfig.model_fields["runtime"].default
    for name in shared:
        lines = []
        for p in points:
            run = {**shared, **p}
            strategy, runtime = str(run.get("strategy", default_strategy)), str(run.get("runtime", default_runtime))
            lines.append(unused_setting(strategy, runtime, [name]) if strategy in names() else None)
        if all(lines):
            return lines[0]
    return None


def _settings_read(run: Path) -> dict[str, Any]:
    """The settings in the ``config.json`` of the run folder ``run`` that its strategy and runtime read
    (:func:`atoll.config.applies.applicable`: a ddp run shows no ``sync_every``); empty if unreadable."""
    from atoll.config.applies import applicable

    try:
        config = json.loads((run / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return applicable(config) if isinstance(config, dict) else {}


def run_sweep(args: argparse.Namespace, values: dict[str, str], out: Path) -> int:
    """``atoll sweep``: train (or reuse) every point, compare, write the results; return the exit status."""
    check_link(args)
    shared, points = grid(values)
    axes = list(points[0])  # the settings swept, also those some points do not read (one column each)
    points, unread = trim(shared, points)
    if never := never_read(shared, points):  # (as atoll train refuses a setting its strategy does not read)
        raise ConfigError(never)
    from atoll.config import build_config
    from atoll.config.sections import SyncSection
    from atoll.strategies.registry import spec

    settings, configs = [], []
    for p in points:  # every point valid before anything trains (one line naming the setting otherwise)
        # typed values: a finished run's config matches; the shared settings are a base (a grid of strategies
        # shares --fragments with the points that read it), a point's own value must be read by its strategy
        configs.append(build_config(base=shared, overrides=p))
        settings.append(json.loads(configs[-1].model_dump_json(include={*shared, *p})))
    # as the suite: a file, a folder of other files, a user's results.* (before the warnings)
    check_out_folder(out, keys=SWEEP_KEYS)
    keep, dropped = distinct(points, settings)
    if dropped:
        print(f"atoll: warning: {len(points) - len(keep)} duplicate point{'s' * (len(points) - len(keep) != 1)} "
              f"dropped, the same settings once parsed ({', '.join(dropped)}): each trains once", file=sys.stderr)
    points, settings, configs = ([x[i] for i in keep] for x in (points, settings, configs))
    # H of the strategies that own it (a strategy without outer rounds has none)
    h = [c.strategy_config.sync_every if isinstance(c.strategy_config, SyncSection) else 0 for c in configs]
    long_h = [(point_name(p), c, n) for p, c, n in zip(points, configs, h, strict=True) if n > c.steps
              and (spec(c.strategy).syncs_per_h or spec(c.strategy).lockstep is None)]
    if long_h:
        name, c, n = long_h[0]
        print(f"atoll: warning: sync_every is larger than steps ({name}: {n} > {c.steps}"
              f"{f' and {len(long_h) - 1} more' if len(long_h) > 1 else ''}): no outer sync before the final one; "
              "pass --sync-every at most --steps", file=sys.stderr)
    for line in unread:  # e.g. ddp in a grid of strategies and H: it trains once, not once per H
        print(f"atoll: note: {line}", file=sys.stderr)
    # a point already trained under another name (by a sweep of another grid in this folder) is reused
    earlier = {} if args.fresh else earlier_points(out)
    current, names = {point_name(p) for p in points}, []
    for p, setting in zip(points, settings, strict=True):
        name = point_name(p)
        if not args.fresh and not finished(out / name, setting):
            full = run_settings(setting)
            name = next((n for n, f in earlier.items() if f == full and n not in current and n not in names), name)
        names.append(name)
    summaries = [train_once(out, n, args.fresh, tag="sweep", **s) for n, s in zip(names, settings, strict=True)]
    # every point the folder holds is in the table: those of earlier grids too, by every setting ever swept
    swept = list(dict.fromkeys([*axes, *previous_swept(out)]))
    others = [n for n in earlier if n not in names]
    names += others
    summaries += [read_summary(out / n) for n in others]  # type: ignore[misc]
    shown_points = [{k: read.get(k) for k in swept} for read in map(_settings_read, (out / n for n in names))]
    results = compare(out, names, shown_points, summaries, args.at_mbps, args.at_latency_ms, args.step_s)
    results["shared"] = {k: str(v) for k, v in shared.items()}
    results["swept"] = swept
    results["command"] = "atoll sweep " + " ".join(sys.argv[2:])
    best = results["best"]
    timed = results["equal_time_s"] is not None

    def shown(r: dict[str, Any], key: str, digits: int) -> str | None:
        if r[key] is None:
            return None
        text = f"{r[key]:.{digits}f}" if math.isfinite(r[key]) else "never"
        return f"**{text}**" if best.get(key) == r["point"] else text

    table_rows = [{**r, **{f"{k}_shown": shown(r, k, d) for k, d in (("final_eval_loss", 4),
                                                                     ("loss_at_equal_time", 4),
                                                                     ("time_to_target_s", 1))}}
                  for r in results["rows"]]
    columns = [(k, k) for k in swept] + [c for c in [
        ("strategy", "strategy"), ("tokens", "tokens"), ("bytes/island", "bytes_sent_per_island"),
        ("eval loss (equal tokens)", "final_eval_loss_shown"), (f"wall s @{args.at_mbps:g} Mbit/s", "wall_s_on_link"),
        (f"loss at {results['equal_time_s']:.4g} s" if timed else "loss at equal time", "loss_at_equal_time_shown"),
        (f"s to reach {results['target_loss']:.4f}", "time_to_target_s_shown")] if c[1] not in swept]
    link = f"link {args.at_mbps:g} Mbit/s, {args.at_latency_ms:g} ms; best in bold"
    note = (f"every inner step timed at {results['step_s']:.4g} s of compute; {link}" if timed else
            f"no lockstep run to re-time on the link, so no equal-time comparison (an asynchronous run keeps "
            f"its own simulated clock); {link}")
    if timed and not all(r["wall_s_on_link"] is not None for r in results["rows"]):
        note += "; asynchronous runs keep their own simulated clock and are not compared in time"
    if others:
        note += f"; {len(others)} point{'s' * (len(others) != 1)} of earlier grids in this folder shown too"
    table = write_results(out, results, columns, table_rows, notes=[note, f"command: {results['command']}"],
                          title=f"atoll sweep ({len(names)} point{'s' * (len(names) != 1)})")
    plot(results, out / "sweep.png")
    print(table)
    print(f"wrote {out}/results.json, results.md, sweep.png")
    return 0
