"""The report of ``atoll bench wan-decoupled``: the table, ``atoll project``'s predictions beside the measurement,
and ``results.json`` / ``results.md`` (through :func:`atoll.benchmarks.common.write_results`).

Used by :mod:`atoll.benchmarks.wan_decoupled`; the measurements are defined in :mod:`atoll.benchmarks.wan_measures`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import Column, cell, write_results


def _ratio(r: dict[str, Any]) -> list[float | None]:
    """Per island: the bytes its interface sent over the bytes atoll counted (whole run)."""
    return [tx / a if a else None for tx, a in zip(r.get("iface_tx_bytes", []), r.get("atoll_bytes", []), strict=False)]


def _back(r: dict[str, Any]) -> float | None:
    """Seconds from the kill until the killed island's work was merged again (decoupled), or until the survivors'
    first exchange without it ended (synchronous: ``recovery_s``)."""
    rec = r.get("recovery") or {}
    if r.get("strategy") == "decoupled":
        return rec.get("back_merged_s")
    return (rec.get("recovery_s") or [None])[0]


COLUMNS: list[Column] = [
    ("run", "run"), ("Mbit/s", "mbps"), ("kill", "kill_text"), ("time to target s", "time_to_target_s"),
    ("x sync (target)", "speedup_to_target"), ("step s", "step_s"), ("to target, step times", "time_to_target_steps"),
    ("x sync (step times)", "speedup_to_target_steps"), ("tokens to target", "tokens_to_target"),
    ("time to targets s", "times_to_targets_s"), ("x sync (targets)", "speedups_to_targets"),
    ("tokens to targets", "tokens_to_targets"), ("tokens / sync's (targets)", "tokens_ratio_to_targets"),
    ("tokens/s", "tokens_per_s"), ("x sync (tokens/s)", "tokens_per_s_ratio"),
    ("utilization", "steady_utilization"), ("x sync (utilization)", "utilization_ratio"),
    ("goodput", "goodput"), ("useful tokens", "useful_tokens"), ("eval loss", "final_eval_loss"),
    ("bytes/island sent (atoll)", "atoll_bytes"), ("bytes/island received (atoll)", "atoll_bytes_received"),
    ("bytes/island (iface tx)", "iface_tx_islands"), ("bytes/island (iface rx)", "iface_rx_islands"),
    ("iface/atoll", "iface_over_atoll"), ("back after kill s", "back_s"), ("load", "load_text"),
    ("wall s", "wall_s")]


def _table_row(r: dict[str, Any]) -> dict[str, Any]:
    """A row as the table shows it; a failed run keeps its name and says ``FAILED``."""
    if not r.get("ok"):
        return {"run": r.get("run"), "mbps": r.get("mbps"), "kill_text": "FAILED"}
    islands = r["islands"]
    return {**r, "kill_text": f"island 1 at {r['kill_step']}" if r["kill"] else "-",
            "iface_tx_islands": r["iface_tx_bytes"][:islands], "iface_rx_islands": r["iface_rx_bytes"][:islands],
            "iface_over_atoll": _ratio(r), "back_s": _back(r),
            "load_text": f"{r['load_start']:.1f} / {r['load_end']:.1f}"}


def projections(rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """``atoll project`` beside the measurement: per bandwidth, its prediction for this setting (the measured seconds
    per inner step, the links, H, P, the codec) of diloco's and decoupled's step time; and at 12B over 2 and 5
    Gbit/s (``atoll project --table``'s rows), decoupled against ddp (the paper's "conventional synchronization")
    and against diloco."""
    from atoll.analysis.cost import CODEC_BITS, Setting
    from atoll.analysis.projection import PUBLISHED, project, real_scale_table
    from atoll.strategies.decoupled import DecoupledConfig
    from atoll.strategies.diloco import DiLoCoConfig

    here = []
    for mbps in sorted({r["mbps"] for r in rows}):
        steps = [r["step_s"] for r in rows if r["mbps"] == mbps and r.get("ok") and not r["kill"]]
        if not steps or not meta.get("params"):
            continue
        s = Setting(params=float(meta["params"]), step_compute_s=sum(steps) / len(steps), islands=meta["islands"],
                    bandwidth_mbps=mbps, latency_ms=meta["delay_ms"])
        own = {"sync_every": meta["sync_every"], "codec": meta["codec"] if meta["codec"] in CODEC_BITS else "fp32"}
        sync, ddp = project(s, "diloco", DiLoCoConfig(**own)), project(s, "ddp")
        dec = project(s, "decoupled", DecoupledConfig(**own, fragments=meta["fragments"]))
        measured = next((r.get("utilization_ratio") for r in rows if r["mbps"] == mbps and r.get("ok")
                         and r["strategy"] == "decoupled" and not r["kill"]), None)
        here.append({"mbps": mbps, "step_compute_s": s.step_compute_s, "diloco_step_s": sync.step_s,
                     "decoupled_step_s": dec.step_s, "ddp_step_s": ddp.step_s,
                     "predicted_decoupled_over_diloco": sync.step_s / dec.step_s,
                     "predicted_decoupled_over_ddp": ddp.step_s / dec.step_s,
                     "measured_decoupled_over_diloco_utilization": measured})
    at_scale = []
    table = real_scale_table()
    for link in ("WAN 5 Gbit/s", "WAN 2 Gbit/s"):
        by = {r["strategy"]: r for r in table if r["model"] == "12B" and r["link"] == link}
        at_scale.append({"model": "12B", "link": link, "decoupled_over_ddp": by["decoupled"]["speedup_vs_ddp"],
                         "decoupled_over_diloco": by["diloco"]["step_s"] / by["decoupled"]["step_s"],
                         "goodput_heavy_failures": {k: by[k]["goodput_heavy_failures"]
                                                    for k in ("ddp", "diloco", "decoupled")}})
    return {"this_setting": here, "12B": at_scale, "paper_speedup_2_5gbps": PUBLISHED["decoupled_speedup_2_5gbps"]}


def landing(rows: list[dict[str, Any]], projected: dict[str, Any]) -> str:
    """One sentence: where the measured decoupled-over-synchronous figures land beside ``atoll project`` (this
    setting, and 12B at 2-5 Gbit/s) and the paper's claim, which is over ddp ("conventional synchronization")."""
    parts = []
    for r in rows:
        if r.get("ok") and r["strategy"] == "decoupled":
            parts.append(f"{r['mbps']:g} Mbit/s{' with the kill' if r['kill'] else ''}: "
                         f"{cell(r.get('speedup_to_target'))}x to target by the clock, "
                         f"{cell(r.get('speedup_to_target_steps'))}x in step times, "
                         f"{cell(r.get('utilization_ratio'))}x steady utilization")
    here = "; ".join(f"{p['predicted_decoupled_over_diloco']:.2f}x at {p['mbps']:g} Mbit/s"
                     for p in projected["this_setting"])
    scale = "; ".join(f"{p['decoupled_over_ddp']:.1f}x ddp and {p['decoupled_over_diloco']:.2f}x diloco over "
                      f"{p['link']}" for p in projected["12B"])
    return (f"where this lands: measured decoupled over synchronous diloco, {'; '.join(parts) or 'none'}; atoll "
            f"project predicts {here or '-'} for this setting (step time only: no sample efficiency, no load); the "
            f"paper's >{projected['paper_speedup_2_5gbps']:g}x is over ddp at 12B (atoll project: {scale}); this "
            "benchmark's ddp runs share its links but train a model 4-5 orders of magnitude smaller")


def write_report(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any], projected: dict[str, Any]) -> str:
    """``results.json`` (``meta``, ``rows``, ``projection``) and ``results.md`` in ``out``; returns the Markdown."""
    ranks = int(meta.get("ranks_per_island") or 1)
    own = meta.get("island_ranks")
    jobs = (f"of {','.join(map(str, own))} ranks" if own else f"of {ranks} rank{'s' if ranks > 1 else ''}")
    speeds = meta.get("island_speeds")
    paced = (f", island speeds {','.join(f'{s:g}' for s in speeds)} ({meta['step_s']:g} s per inner step at "
             "speed 1)" if speeds else "")
    title = (f"Decoupled DiLoCo deployed (atoll syncer + {meta['islands']} island jobs {jobs}, TLS) against "
             f"synchronous diloco and ddp (collective runtime, {ranks} rank{'s' if ranks > 1 else ''} per island): "
             f"{meta['model']} model ({cell(meta.get('params'))} parameters), H={meta['sync_every']}, "
             f"{meta['steps']} steps per island{paced}, {meta['delay_ms']:g} ms one way, syncer link "
             f"{meta['syncer_mbps']:g} Mbit/s")
    target = next((r for r in rows if r.get("target_loss") is not None), None)
    notes = [
        (f"target: {target['target_loss']:.4f}, the synchronous failure-free run's held-out loss after its outer "
         f"step at inner step {target['target_step']} ({meta.get('target_fraction', 0.5):g} of its steps)")
        if target else "target: none (no diloco run)",
        *([f"targets: {', '.join(f'{x:.4f}' for x in target['targets'])}, at "
           f"{', '.join(f'{f:g}' for f in meta['drop_fractions'])} of the synchronous failure-free run's loss drop "
           "(its evaluation at step 0 to its last); time and useful tokens to each (- never reached); x sync: the "
           "diloco run's time with the same failure over this one's; tokens / sync's: this run's tokens over the "
           "diloco run's with the same failure (the goal: decoupled at most 1.05 without the kill)"]
          if target and target.get("targets") else []),
        *(["speeds: each island's inner steps paced at step_s / its speed (decoupled: the island job's "
           "--emulate-step-s; synchronous: the collective ranks' pace hook, every lockstep waiting for the slowest); "
           "goodput: over those paces' failure-free rate, every island computing all the time"] if speeds else []),
        "time to target: run clock (from the first inner step) until the global model's held-out loss is at or below "
        "it (synchronous: after each outer step, its evaluations' time taken out; decoupled: the syncer's "
        "checkpoint after each commit, evaluated afterwards with the same batches); x sync: the synchronous run's "
        "with the same failure over this one's; step s: the run's measured compute seconds per inner step (the "
        "load slows it); to target, step times: the time to target over that, the comparison that holds when "
        "runs met different loads; tokens to target: the useful tokens in the global model when it got there",
        "tokens/s: steady state (after every island's first H steps; synchronous until the last H boundary, "
        "decoupled until the step budget was spent; the synchronous run's evaluation after every outer step is "
        "taken out of its window); utilization: that over every island computing all the time "
        "at the run's seconds per step; goodput: useful tokens (merged into the global model) per "
        "second of run clock until the last outer step or commit, over every island computing all the time at the "
        "run's measured seconds per inner step",
        "bytes: whole run per island, sent / received; atoll = decoupled: pushes / pulls per island (the killed "
        "island's first job's counts die with it); synchronous: the ring all-reduce's send / receive halves, the "
        "run's mean per island (summary.json's one figure, the killed island shown at it too); iface = its "
        "namespace's interface, tx / rx (TCP/IP, TLS, gRPC, heartbeats, step grants)",
        "back after kill: decoupled, seconds from the SIGKILL until the restarted job's first push was merged; "
        "synchronous, the survivors' first exchange without the lost island (recovery_s)",
        f"load: the 1-minute load average at each run's start / end on {meta['cpus']} CPUs (results.json: each "
        f"run's uptime line where it has one); uptime at this invocation's start: '{meta['uptime_start']}', at its "
        f"end: '{meta['uptime_end']}' ({len(meta['trained_now'])} of {len(rows)} runs trained by it, the others "
        "reused); every timing is under that load",
    ]
    for r in rows:
        if r.get("stuck_after_end"):
            notes.append(f"{r['run']}: island {', '.join(map(str, r['stuck_after_end']))} did not end after the "
                         "syncer ended the run (collective_timeout_s after the budget was spent, while its last "
                         "pushes waited for a grace window); the harness killed it 30 s later; every token was "
                         "merged, its own byte count never reached the syncer (-)")
    for r in rows:
        rejoin = (r.get("syncer_summary") or {}).get("rejoin_s")
        if r.get("ok") and r["strategy"] == "decoupled" and r["kill"] and rejoin:
            notes.append(f"{r['run']}: the syncer saw the restarted job join {', '.join(f'{x:.1f}' for x in rejoin)} s "
                         "after the killed one's last call (rejoin_s); back after kill counts until its first merge")
    for p in projected["this_setting"]:
        measured = p["measured_decoupled_over_diloco_utilization"]
        notes.append(f"atoll project, this setting at {p['mbps']:g} Mbit/s (t_c {p['step_compute_s']:.3f} s "
                     f"measured): diloco {p['diloco_step_s']:.3f} s/step, decoupled {p['decoupled_step_s']:.3f}, "
                     f"ddp {p['ddp_step_s']:.3f}: decoupled {p['predicted_decoupled_over_diloco']:.2f}x diloco "
                     f"(measured, steady utilization: {cell(measured)}x), {p['predicted_decoupled_over_ddp']:.1f}x ddp")
    for p in projected["12B"]:
        g = p["goodput_heavy_failures"]
        notes.append(f"atoll project --table, 12B over {p['link']}: decoupled {p['decoupled_over_ddp']:.1f}x ddp "
                     f"(paper: >{projected['paper_speedup_2_5gbps']:g}x at 2-5 Gbit/s), "
                     f"{p['decoupled_over_diloco']:.2f}x diloco; goodput under heavy failures ddp {g['ddp']:.0%}, "
                     f"diloco {g['diloco']:.0%}, decoupled {g['decoupled']:.0%}")
    notes.append(landing(rows, projected))
    notes.append(f"command: {meta['command']}")
    results = {"meta": meta, "rows": rows, "projection": projected}
    return write_results(out, json.loads(json.dumps(results, default=str)), COLUMNS, [_table_row(r) for r in rows],
                         title, notes, fmt=functools.partial(cell, mega_digits=2))
