"""A run's held-out loss curve, re-timed at any link: loss at a given time or tokens, time to reach a loss.

A run's ``metrics.jsonl`` holds its ``eval`` events (inner step, tokens, held-out loss, simulated time); a
lockstep run's clock trace (``clock_trace.json``) marks every evaluation, so :func:`atoll.runtime.network.replay`
gives the time of each at another link. Between two evaluations the loss is interpolated linearly in
time (or tokens); before the first and after the last evaluation nothing is extrapolated. No torch.

Units: seconds, tokens, nats per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atoll.job.metrics import read_metrics


@dataclass(frozen=True)
class Curve:
    """Held-out loss at increasing abscissas (tokens, or seconds); ``xs`` ascending, same length as ``losses``."""

    xs: tuple[float, ...]
    losses: tuple[float, ...]

    def at(self, x: float) -> float:
        """The loss at ``x``, interpolated between evaluations; NaN outside the curve's range."""
        xs, ys = self.xs, self.losses
        if not xs or x < xs[0] or x > xs[-1]:
            return math.nan
        for i in range(1, len(xs)):
            if x <= xs[i]:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return ys[-1]

    def first_below(self, target: float) -> float:
        """The first abscissa at which the loss reaches ``target`` (interpolated); inf if it never does."""
        xs, ys = self.xs, self.losses
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if y <= target:
                if i == 0:
                    return x
                x0, y0 = xs[i - 1], ys[i - 1]
                return x0 + (x - x0) * (y0 - target) / (y0 - y) if y0 != y else x
        return math.inf


def evals(run_dir: Path) -> list[dict[str, Any]]:
    """The ``eval`` events of a run folder, in order (step 0 first)."""
    return [e for e in read_metrics(Path(run_dir) / "metrics.jsonl") if e["event"] == "eval"]


def loss_vs_tokens(run_dir: Path) -> Curve:
    """Held-out loss against training tokens (all islands)."""
    ev = evals(run_dir)
    return Curve(tuple(float(e["tokens"]) for e in ev), tuple(float(e["eval_loss"]) for e in ev))


def loss_vs_time(run_dir: Path, bandwidth_mbps: float | None = None, latency_ms: float | None = None,
                 step_s: float | None = None) -> Curve:
    """Held-out loss against simulated seconds: as the run measured it, or re-timed from its clock trace at
    ``bandwidth_mbps`` (and ``latency_ms``, default the run's), with every inner step's compute scaled to
    ``step_s`` seconds on average (default: as measured).

    Raises:
        ValueError: re-timing asked of a run without a complete clock trace (an asynchronous run, or one resumed
            from a checkpoint of an older atoll).
    """
    from atoll.runtime.network import Link, load_trace, replay

    ev = evals(run_dir)
    if bandwidth_mbps is None and step_s is None:
        return Curve(tuple(float(e["sim_wall_s"]) for e in ev), tuple(float(e["eval_loss"]) for e in ev))
    path = Path(run_dir) / "clock_trace.json"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no clock trace to re-time (an asynchronous strategy keeps its own clock)")
    trace = load_trace(path)
    scale = 1.0
    if step_s is not None:
        compute = replay(trace, Link.from_config(trace["link_bandwidth_mbps"], trace["link_latency_ms"]))
        steps = max(int(e["step"]) for e in ev)
        scale = step_s * steps / compute["compute_s"] if compute["compute_s"] > 0 else 1.0
    link = Link.from_config(bandwidth_mbps if bandwidth_mbps is not None else trace["link_bandwidth_mbps"],
                            latency_ms if latency_ms is not None else trace["link_latency_ms"])
    marks = replay(trace, link, compute_scale=scale)["marks"]
    points = [(0.0, float(ev[0]["eval_loss"]))] + [(marks[int(e["step"])], float(e["eval_loss"]))
                                                  for e in ev[1:] if int(e["step"]) in marks]
    return Curve(tuple(p[0] for p in points), tuple(p[1] for p in points))


def reference_step_s(summaries: list[dict[str, Any]]) -> float | None:
    """The compute seconds of one inner step to re-time runs measured on a shared machine with: the median of
    the lockstep runs' measured ``compute_s / steps`` (an asynchronous run's step is simulated, not measured),
    so that the machine's load does not pick the winner; None without a lockstep run."""
    import statistics

    from atoll.strategies.registry import spec

    measured = [s["compute_s"] / s["steps"] for s in summaries if spec(s["strategy"]).lockstep is not None]
    return statistics.median(measured) if measured else None
