"""The decision a user faces: which strategy reaches a given loss first on my link?

For the suite's runs (:mod:`atoll.benchmarks.suite`), the simulated wall time each needs to reach a target loss
at link rates from 10 Mbit/s to 10 Gbit/s. The target is the loss ddp reaches at half its tokens (interpolated
on its held-out curve), a quality the good strategies reach within the run. Each lockstep run's clock trace is
re-timed at every rate (:func:`atoll.analysis.curves.loss_vs_time`) with every inner step's compute set to
one reference time (the median of the runs' measured step times: the runs were measured on a shared
machine, and its load must not pick the winner); the time is that of the first evaluation at or below the
target, interpolated between evaluations. An asynchronous strategy (decoupled) keeps its own simulated clock
(a fixed step, its transfers overlapping compute); its time is given at the link it trained on, its clock
scaled to the same reference step time. "never": the run did not reach the target.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: link rates of the table, Mbit/s: consumer 10 and 100 Mbit/s, WAN 1 and 10 Gbit/s
RATES_MBPS = (10.0, 100.0, 1000.0, 10000.0)


def time_to_target(suite_dir: Path, summaries: dict[str, dict[str, Any]], latency_ms: float = 10.0,
                   rates_mbps: tuple[float, ...] = RATES_MBPS) -> dict[str, Any]:
    """Seconds each run needs to reach the target loss at each rate (None where not timed, inf: never).

    Args:
        suite_dir: the folder of the runs (``suite_dir/<name>/``).
        summaries: the runs' summaries by name; one named ``ddp`` sets the target.
        latency_ms: one-way latency of every link.
        rates_mbps: the link rates.

    Returns:
        ``{"target_loss", "target_tokens", "step_s", "rates_mbps", "runs": {name: {rate: seconds}}}``; an
        empty dict without a ddp run.
    """
    from atoll.analysis.curves import loss_vs_time, loss_vs_tokens, reference_step_s
    from atoll.strategies.registry import spec

    ddp = summaries.get("ddp")
    if ddp is None:
        return {}
    target_tokens = ddp["tokens"] / 2
    target = loss_vs_tokens(suite_dir / "ddp").at(target_tokens)
    lockstep = {n: s for n, s in summaries.items() if spec(s["strategy"]).lockstep is not None}
    step_s = reference_step_s(list(summaries.values()))  # ddp is lockstep: never None here
    runs: dict[str, dict[str, float | None]] = {}
    for name, s in summaries.items():
        if name in lockstep:
            runs[name] = {f"{r:g}": loss_vs_time(suite_dir / name, r, latency_ms, step_s=step_s).first_below(target)
                          for r in rates_mbps}
        else:  # its own clock: sim_step_s per step, at the link it trained on
            own = loss_vs_time(suite_dir / name)
            scaled = own.first_below(target) * step_s / float(s.get("sim_step_s") or step_s)
            runs[name] = {f"{r:g}": scaled if r == s["link_bandwidth_mbps"] else None for r in rates_mbps}
    return {"target_loss": target, "target_tokens": target_tokens, "step_s": step_s,
            "rates_mbps": list(rates_mbps), "runs": runs}


def cell(seconds: float | None) -> str:
    """A table cell: ``-`` (not timed), ``never``, or the seconds."""
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return "never"
    return f"{seconds:,.0f}" if seconds >= 100 else f"{seconds:.1f}"


def markdown(result: dict[str, Any], labels: dict[str, str]) -> str:
    """The table: one row per run, one column per rate, the fastest at each rate in bold."""
    rates = [f"{r:g}" for r in result["rates_mbps"]]
    head = "| run | " + " | ".join(f"s to {result['target_loss']:.3f} @{_rate(float(r))}" for r in rates) + " |"
    lines = [head, "|" + "---|" * (len(rates) + 1)]
    best = {r: min((v[r] for v in result["runs"].values() if v[r] is not None), default=None) for r in rates}
    for name, times in result["runs"].items():
        cells = [f"**{cell(times[r])}**" if times[r] is not None and times[r] == best[r] and math.isfinite(times[r])
                 else cell(times[r]) for r in rates]
        lines.append(f"| {labels.get(name, name)} | " + " | ".join(cells) + " |")
    lines += ["", f"Target: the held-out loss ddp reaches at half its tokens ({result['target_tokens']:,.0f} tokens): "
              f"{result['target_loss']:.4f}. Every inner step timed at {result['step_s']:.3g} s of compute (the "
              "runs' median); 10 ms latency. Decoupled on its own clock, at the link it trained on."]
    return "\n".join(lines) + "\n"


def _rate(mbps: float) -> str:
    return f"{mbps / 1000:g} Gbit/s" if mbps >= 1000 else f"{mbps:g} Mbit/s"


def plot(result: dict[str, Any], out_png: Path, labels: dict[str, str]) -> Path:
    """Seconds to the target against the link rate, one line per run (log-log; runs that never reach it left out)."""
    from atoll.job.figures import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    rates = result["rates_mbps"]
    for name, times in result["runs"].items():
        pts = [(r, times[f"{r:g}"]) for r in rates if times[f"{r:g}"] is not None and math.isfinite(times[f"{r:g}"])]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=labels.get(name, name))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate per island (Mbit/s)")
    ax.set_ylabel(f"simulated seconds to held-out loss {result['target_loss']:.3f}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title("time to the loss ddp reaches at half its tokens")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
