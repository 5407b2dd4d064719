"""The measurements and the report of ``atoll bench wan``: the steady-state window of one run, the
issue's checks, and ``results.json`` / ``results.md`` (through :func:`atoll.benchmarks.common.write_results`).

Used by :mod:`atoll.benchmarks.wan` (launch it with ``atoll bench wan`` or ``python bench/wan.py``); see its
docstring for what the window is and why.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import Column, cell, write_results
from atoll.benchmarks.counters import CounterSampler


def steady_state(events: list[dict[str, Any]], summary: dict[str, Any], sampler: CounterSampler,
                 strategy: str, sync_every: int, warmup_step: int) -> dict[str, Any]:
    """Tokens/s, utilization and bytes over the steady-state window of one run (see :mod:`atoll.benchmarks.wan`).

    Args:
        events: the run's ``train`` events (``step``, ``time``, ``tokens``, ``bytes_sent_per_island``).
        summary: its ``summary.json`` (``steps``, ``compute_s``, ``islands``).
        sampler: its interface counters.
        strategy, sync_every: the run's strategy and H.
        warmup_step: for ``ddp``, the step the window starts at (the benchmark's smallest H).
    """
    by_step = {int(e["step"]): e for e in events}
    logged = sorted(by_step)
    if strategy == "diloco":
        bounds = [s for s in logged if s % sync_every == 0]
        start, end = (bounds[0], bounds[-1]) if bounds else (logged[0], logged[-1])
        round_steps = sync_every
    else:
        start = next((s for s in logged if s >= warmup_step), logged[0])
        end, round_steps = logged[-1], 1
    note = "steady state"
    if start >= end:  # too few steps for a window past the first round: the whole logged run
        start, end, note = logged[0], logged[-1], "whole run (too few steps for a steady-state window)"
    if start == end:
        return {"window": "none (fewer than two train events: run more steps)", "window_steps": [start, end],
                "tokens_per_s": None, "steady_utilization": None, "iface_over_atoll": []}
    a, b = by_step[start], by_step[end]
    dt = max(1e-9, b["time"] - a["time"])
    islands = int(summary["islands"])
    counted = b["bytes_sent_per_island"] - a["bytes_sent_per_island"]
    # diloco's link is idle after a boundary event (both islands finished the exchange, then the counters'
    # all-reduce): read the first sample after it. ddp's is always busy: interpolate.
    after = strategy == "diloco" and note == "steady state"

    def delta(i: int, key: str) -> float:
        return sampler.at(b["time"], i, key, after) - sampler.at(a["time"], i, key, after)

    seen = [delta(i, "tx") for i in range(islands)]
    seen_rx = [delta(i, "rx") for i in range(islands)]
    compute = summary["compute_s"] * (end - start) / summary["steps"]
    first, last = sampler.samples[0], sampler.samples[-1]
    return {
        "window": note, "window_steps": [start, end], "window_rounds": (end - start) / round_steps,
        "window_s": dt, "tokens_per_s": (b["tokens"] - a["tokens"]) / dt,
        "steady_utilization": min(1.0, compute / dt),
        "atoll_bytes_per_island": counted,
        "iface_tx_bytes_per_island": seen, "iface_rx_bytes_per_island": seen_rx,
        "iface_over_atoll": [s / counted if counted else None for s in seen],
        "run_iface_tx_bytes_per_island": [last[1][i] - first[1][i] for i in range(islands)],
    }


COLUMNS: list[Column] = [("run", "run"), ("Mbit/s", "mbps"), ("H", "H"), ("steps", "steps"),
           ("window steps", "window_steps"), ("rounds", "window_rounds"), ("tokens/s", "tokens_per_s"),
           ("x ddp", "speedup_vs_ddp"), ("utilization", "steady_utilization"),
           ("bytes/island (atoll)", "atoll_bytes_per_island"), ("bytes/island (iface tx)", "iface_tx_bytes_per_island"),
           ("iface/atoll", "iface_over_atoll"), ("eval loss", "final_eval_loss"), ("wall s", "wall_s")]


def checks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, where the runs they need exist: ratio, speed-up at 10 Mbit/s, utilization at 100."""
    out: dict[str, Any] = {}
    ok = [r for r in rows if r.get("ok") and r.get("tokens_per_s")]
    for r in ok:
        if r["strategy"] == "diloco" and r["mbps"] == 10:
            out[f"10mbit_diloco_H{r['H']}_speedup_vs_ddp"] = r.get("speedup_vs_ddp")
        if r["strategy"] == "diloco" and r["mbps"] == 100:
            out[f"100mbit_diloco_H{r['H']}_utilization"] = r["steady_utilization"]
    ratios = [x for r in ok for x in r["iface_over_atoll"] if x is not None]
    if ratios:
        out["iface_over_atoll_range"] = [min(ratios), max(ratios)]
    pass_: dict[str, bool] = {}
    if "10mbit_diloco_H100_speedup_vs_ddp" in out and out["10mbit_diloco_H100_speedup_vs_ddp"] is not None:
        pass_["10mbit_diloco_H100_at_least_15x_ddp"] = out["10mbit_diloco_H100_speedup_vs_ddp"] >= 15
    if "100mbit_diloco_H100_utilization" in out:
        pass_["100mbit_diloco_H100_utilization_at_least_90pct"] = out["100mbit_diloco_H100_utilization"] >= 0.9
    if ratios:
        pass_["iface_within_10pct_of_atoll"] = all(abs(x - 1) <= 0.10 for x in ratios)
    out["pass"] = pass_
    return out


def _table_row(r: dict[str, Any]) -> dict[str, Any]:
    """The row as the table shows it: a failed run keeps its name and settings, ``FAILED``, and ``-`` elsewhere."""
    if r.get("ok"):
        return r
    return {**{k: r.get(k) for k in ("run", "mbps", "H", "steps")}, "window_steps": "FAILED"}


def write_report(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``results.json`` (``meta``, ``rows``, ``checks``) and ``results.md`` in ``out``; returns the Markdown table."""
    found = checks(rows)
    delay = f", {meta['delay_ms']:g} ms one-way delay" if meta["delay_ms"] else ""
    title = (f"Emulated WAN: {meta['islands']} islands of the {meta['model']} model, collective runtime, "
             f"tc tbf links{delay}")
    notes = [f"checks: {json.dumps(found)}",
             "tokens/s, utilization and bytes over the steady-state window (from the end of the first "
             "outer round to the last H boundary; ddp: from the smallest H); iface = bytes the island's "
             "veth sent (with TCP/IP headers, ACKs, heartbeats), one value per island",
             f"command: {meta['command']}"]
    return write_results(out, {"meta": meta, "rows": rows, "checks": found}, COLUMNS,
                         [_table_row(r) for r in rows], title, notes, fmt=functools.partial(cell, mega_digits=2))
