"""The measurements of ``atoll bench wan-decoupled`` from a run's records: loss curves over wall time, the target
loss and the time to reach it, steady-state tokens per second, useful tokens and goodput. Pure arithmetic over
events, no processes (unit-tested in tests/test_wan_decoupled.py).

Definitions (the same for the synchronous and the decoupled run, so their ratio means what it says):

- **run clock**: seconds from the run's first inner step (start-up, data and model preparation left out). The
  synchronous run's starts at its ``start`` event (after the initial evaluation, just before the first inner
  step); the decoupled run's is the syncer's (its first step granted).
- **loss curve**: (run clock, held-out loss of the global model) at every point where the global model
  changed: after each outer step of the synchronous run (its ``eval`` events, ``--eval-every H``, the time of
  the outer step's ``train`` event minus the evaluations before it, which the decoupled run does not pay), and
  after each commit of the decoupled syncer (its checkpoints, evaluated afterwards with the same evaluation).
- **target loss**: the synchronous failure-free run's held-out loss after the outer step at half its inner
  steps (:func:`target_loss`); **time to target**: the first point of a curve at or below it
  (:func:`time_to_target`; None if never); **tokens to target**: the useful tokens in the global model at that
  point (:func:`value_at` of the tokens curve: sample efficiency apart from speed); **in step times**: the time
  over the run's own measured compute seconds per inner step, so that runs measured under different loads of a
  shared machine compare (the load slows compute, which dominates these runs, far more than the shaped links).
- **steady tokens/s**: tokens trained per second between the end of the first round (every island past H
  steps) and the last H boundary (synchronous, :func:`atoll.benchmarks.wan_report.steady_state`) or the moment
  the step budget was spent (decoupled, :func:`granted_rate`); **steady utilization**: that over every island
  computing all the time at the run's measured seconds per step (comparable across loads).
- **useful tokens**: tokens that reached the global model: the decoupled syncer's merged tokens; for the
  synchronous run every island's tokens up to the last outer step it took part in (:func:`diloco_useful_tokens`).
- **goodput**: useful tokens per second of the run clock over the failure-free rate, every island computing all
  the time at the run's measured seconds per inner step (:func:`goodput`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def diloco_curve(events: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(run clock s, held-out loss) of the synchronous run from its ``metrics.jsonl`` events (time order).

    The point of an ``eval`` event at step s is the time of the ``train`` event at s (logged once the outer
    step is done) minus the seconds spent in earlier evaluations (each from its step's ``train`` event to its
    ``eval`` event); the initial evaluation is (0, its loss).

    Raises:
        ValueError: no ``start`` event.
    """
    start = next((e["time"] for e in events if e["event"] == "start"), None)
    if start is None:
        raise ValueError("events: no 'start' event")
    trained = {int(e["step"]): float(e["time"]) for e in events if e["event"] == "train"}
    points: list[tuple[float, float]] = []
    spent = 0.0
    for e in events:
        if e["event"] != "eval":
            continue
        step = int(e["step"])
        if step == 0:
            points.append((0.0, float(e["eval_loss"])))
            continue
        at = trained.get(step, float(e["time"]))
        points.append((at - start - spent, float(e["eval_loss"])))
        spent += max(0.0, float(e["time"]) - at)
    return points


def eval_seconds(events: Sequence[dict[str, Any]], begin: float, end: float) -> float:
    """Seconds the synchronous run spent evaluating between run times ``begin`` and ``end`` (``time`` of
    ``metrics.jsonl`` events, seconds since the epoch): each ``eval`` event's time minus its step's ``train`` event
    time (as :func:`diloco_curve` takes them out of the loss curve), for the evaluations whose ``train`` event is
    at or after ``begin`` and before ``end``. Taken out of the steady tokens/s window, whose islands would
    otherwise be charged for the benchmark's own evaluation after every outer step."""
    trained = {int(e["step"]): float(e["time"]) for e in events if e["event"] == "train"}
    total = 0.0
    for e in events:
        at = trained.get(int(e.get("step", -1)))
        if e["event"] == "eval" and at is not None and begin <= at < end:
            total += max(0.0, float(e["time"]) - at)
    return total


def without_evals(steady: dict[str, Any], events: Sequence[dict[str, Any]]) -> None:
    """Take the synchronous run's evaluations out of its steady-state window (in place): ``eval_s`` (seconds, by
    :func:`eval_seconds` between the window's first and last ``train`` events) is set and ``tokens_per_s`` is the
    window's tokens over ``window_s - eval_s``. A window without tokens/s is left as it is."""
    if not steady.get("tokens_per_s"):
        return
    trained = {int(e["step"]): float(e["time"]) for e in events if e["event"] == "train"}
    first, last = (trained[s] for s in steady["window_steps"])
    steady["eval_s"] = eval_seconds(events, first, last)
    steady["tokens_per_s"] *= steady["window_s"] / max(1e-9, steady["window_s"] - steady["eval_s"])


def target_loss(curve_steps: Sequence[tuple[int, float]], steps: int, fraction: float = 0.5) -> tuple[int, float]:
    """(step, loss) of the synchronous run at a fraction of its inner steps (half by default): the evaluation at the
    largest step at or below ``fraction x steps`` (an outer step's, with ``--eval-every H``).

    Args:
        curve_steps: (inner step, held-out loss) of its ``eval`` events.
        fraction: of its steps, in (0, 1]. Take it where the curve still falls: on a plateau, when a run first gets
            within noise of the target says little about its speed.

    Raises:
        ValueError: no evaluation after step 0 and at or below ``fraction x steps``.
    """
    below = [(s, loss) for s, loss in curve_steps if 0 < s <= steps * fraction]
    if not below:
        raise ValueError(f"target: no evaluation between step 1 and {steps * fraction:g}; evaluate every H steps")
    return max(below)


def drop_targets(curve_steps: Sequence[tuple[int, float]], fractions: Sequence[float]) -> list[float]:
    """Target losses at ``fractions`` of the synchronous failure-free run's loss drop: ``L0 - f x (L0 - L_end)``,
    ``L0`` its held-out loss at step 0 and ``L_end`` at its last evaluation (held-out loss, nats per token).
    Fractions of the drop, not of the steps, put every target on the falling part of the curve whatever its
    shape (a target at a fraction of the steps sits on a plateau when the loss has stopped falling there).

    Args:
        curve_steps: (inner step, held-out loss) of its ``eval`` events, step order, the first at step 0.
        fractions: each in (0, 1).

    Raises:
        ValueError: no evaluation at step 0 and after it, a fraction outside (0, 1), or a curve that did not fall.
    """
    if any(not 0 < f < 1 for f in fractions):
        raise ValueError(f"fractions: each in (0, 1); got {list(fractions)}")
    first = next((loss for s, loss in curve_steps if s == 0), None)
    later = [loss for s, loss in curve_steps if s > 0]
    if first is None or not later:
        raise ValueError("targets: need the evaluation at step 0 and one after it; evaluate every H steps")
    drop = first - later[-1]
    if not drop > 0:
        raise ValueError(f"targets: the loss did not fall ({first:.4f} -> {later[-1]:.4f}); train longer")
    return [first - f * drop for f in fractions]


def time_to_target(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first time of ``curve`` ((seconds, loss), in time order) whose loss is at or below ``target``; None if
    it never gets there. No interpolation: the global model is that loss from that point on, not before."""
    return next((t for t, loss in curve if loss <= target), None)


def value_at(curve: Sequence[tuple[float, float]], t: float) -> float | None:
    """The value of ``curve`` ((seconds, value), in time order) at time ``t``: its last point at or before ``t``
    (None before its first)."""
    return next((v for s, v in reversed(curve) if s <= t), None)


def granted_rate(status: Sequence[tuple[float, dict[str, Any]]], islands: int, sync_every: int,
                 tokens_per_step: int) -> dict[str, Any]:
    """Steady tokens/s of a decoupled run from the syncer's status over time (``[time, status]``, time order):
    the inner steps granted between the first sample where every island was granted ``sync_every`` steps
    (the first round done) and the first sample where the budget was spent (or the last), per second.

    Returns ``tokens_per_s`` (None: fewer than two samples in that window), ``window_s`` and ``window_steps``
    (granted steps at its two ends).
    """
    rows = [(t, s) for t, s in status if s.get("steps_by_island")]
    begin = next(((t, s) for t, s in rows if min(s["steps_by_island"][:islands]) >= sync_every), None)
    if begin is None:
        return {"tokens_per_s": None, "window_s": None, "window_steps": None}
    end = next(((t, s) for t, s in rows if s["reserved"] >= s["budget"]), rows[-1])
    if end[0] <= begin[0]:
        return {"tokens_per_s": None, "window_s": None, "window_steps": None}
    steps = end[1]["reserved"] - begin[1]["reserved"]
    return {"tokens_per_s": steps * tokens_per_step / (end[0] - begin[0]), "window_s": end[0] - begin[0],
            "window_steps": [begin[1]["reserved"], end[1]["reserved"]]}


def diloco_useful_tokens(steps: int, islands: int, sync_every: int, tokens_per_step: int,
                         lost_after: dict[int, int]) -> int:
    """Tokens that reached the synchronous run's global model: every island's ``steps`` inner steps, except that
    island i in ``lost_after`` (died after completing that many inner steps) contributed only up to its last
    outer step, ``floor(n / H) x H`` steps; its later work died with it."""
    total = 0
    for i in range(islands):
        n = steps if i not in lost_after else (min(lost_after[i], steps) // sync_every) * sync_every
        total += n * tokens_per_step
    return total


def goodput(useful_tokens: float, run_s: float, islands: int, tokens_per_step: int, step_s: float) -> float | None:
    """Useful tokens per second of the run clock over the failure-free rate (every island computing all the
    time: ``islands x tokens_per_step / step_s``, ``step_s`` the run's measured compute seconds per inner step);
    None if a time is not positive."""
    if run_s <= 0 or step_s <= 0:
        return None
    return useful_tokens / run_s / (islands * tokens_per_step / step_s)


def rejoin_times(status: Sequence[tuple[float, dict[str, Any]]], island: int, killed_at: float,
                 restarted_at: float, settle_s: float = 1.0) -> dict[str, Any]:
    """After island ``island``'s job was killed at ``killed_at`` and started again at ``restarted_at`` (the
    harness's clock): when the syncer granted the new job its first inner step (``back_steps_s``: it rejoined)
    and when a push of the new job was first merged (``back_merged_s``), each in seconds after the kill (None:
    never); and the other islands' granted steps per second from the kill until the island was back, over their
    rate before the kill (``others_rate_ratio``: 1.0 = they never slowed down; None: too few samples).

    The status lags the syncer by a poll or two, so steps granted to the old job just before the kill show up
    after it: the new job's steps are counted from the first sample ``settle_s`` after the kill or after the
    restart, whichever is later (a restarted job takes seconds to start, prepare and join before its first
    step); the old job's pushes still buffered at the kill may be merged later, so the new job's merge is
    counted from its first step.
    """
    rows = [(t, s) for t, s in status if s.get("steps_by_island")]
    before = [(t, s) for t, s in rows if t <= killed_at]
    settled = [(t, s) for t, s in rows if t >= max(killed_at + settle_s, restarted_at)]
    none = {"back_steps_s": None, "back_merged_s": None, "others_rate_ratio": None}
    if not before or not settled:
        return none
    low = settled[0][1]["steps_by_island"][island]  # its count may fall at the rejoin (the killed lease returned)
    after = settled[1:]
    back = None
    for t, s in after:
        if s["steps_by_island"][island] > low:
            back = (t, s)
            break
        low = min(low, s["steps_by_island"][island])
    merged = None
    if back is not None:
        merged0 = back[1]["merged_tokens_by_island"][island]
        merged = next((t for t, s in after if t >= back[0] and s["merged_tokens_by_island"][island] > merged0), None)

    def others(s: dict[str, Any]) -> int:
        return sum(n for i, n in enumerate(s["steps_by_island"]) if i != island)

    ratio = None
    first = next(((t, s) for t, s in before if others(s) > 0), None)
    until = back[0] if back is not None else rows[-1][0]
    outage = [(t, s) for t, s in rows if killed_at < t <= until]
    if first is not None and outage and before[-1][0] > first[0] and outage[-1][0] > before[-1][0]:
        rate_before = (others(before[-1][1]) - others(first[1])) / (before[-1][0] - first[0])
        rate_during = (others(outage[-1][1]) - others(before[-1][1])) / (outage[-1][0] - before[-1][0])
        ratio = rate_during / rate_before if rate_before > 0 else None
    return {"back_steps_s": None if back is None else back[0] - killed_at,
            "back_merged_s": None if merged is None else merged - killed_at, "others_rate_ratio": ratio}


def paced_rate(speeds: Sequence[float], tokens_per_step: int, step_s: float) -> float:
    """Tokens per second of islands paced at relative ``speeds`` (each inner step of an island of speed s lasts
    ``step_s / s`` seconds), every island computing all the time: the failure-free rate of goodput when the
    benchmark sets the islands' paces (``--island-speeds``, ``--step-s``).

    Raises:
        ValueError: a speed or ``step_s`` not above 0.
    """
    if step_s <= 0 or any(s <= 0 for s in speeds):
        raise ValueError(f"speeds and step_s must be > 0; got {list(speeds)}, {step_s}")
    return sum(speeds) * tokens_per_step / step_s


def _per_target(r: dict[str, Any], targets: list[float]) -> None:
    """A run's time (run clock s) and useful tokens to each of ``targets`` (None: never reached), in place."""
    times = [time_to_target(r["curve"], t) for t in targets]
    r["targets"] = targets
    r["times_to_targets_s"] = times
    r["tokens_to_targets"] = [value_at(r["tokens_curve"], t) if t is not None and r.get("tokens_curve") else None
                              for t in times]


def _ratios(mine: list[float | None] | None, base: list[float | None] | None,
            inverse: bool) -> list[float | None] | None:
    """Per target: base / mine (``inverse``: a speed-up) or mine / base; None where either is missing (all of
    them: None)."""
    if not mine or not base:
        return None
    return [(b / m if inverse else m / b) if m and b else None for m, b in zip(mine, base, strict=True)]


def compare(rows: list[dict[str, Any]], target_fraction: float = 0.5,
            drop_fractions: Sequence[float] = ()) -> None:
    """Per bandwidth: the target loss (the synchronous failure-free run's at ``target_fraction`` of its steps,
    :func:`target_loss`), every run's time to it, goodput, and the other runs' speed-ups over the synchronous
    (diloco) run with the same failure (in place). With ``drop_fractions``, also the targets at those fractions of
    that run's loss drop (:func:`drop_targets`): per run ``targets``, ``times_to_targets_s``, ``tokens_to_targets``,
    and against the diloco run with the same failure ``speedups_to_targets`` (its time over this one's) and
    ``tokens_ratio_to_targets`` (this one's tokens over its). A row with ``ideal_tokens_per_s`` (paced islands,
    :func:`paced_rate`) takes its goodput over that rate. ddp rows (``strategy`` ``ddp``) count useful tokens per
    inner step (H = 1)."""
    for mbps in sorted({r["mbps"] for r in rows}):
        group = [r for r in rows if r["mbps"] == mbps and r.get("ok")]
        sync = next((r for r in group if r["variant"] == "diloco"), None)
        target = target_loss(sync["evals"], sync["steps"], target_fraction) if sync else None
        targets = drop_targets(sync["evals"], drop_fractions) if sync and drop_fractions else []
        for r in group:
            r["target_step"], r["target_loss"] = target if target else (None, None)
            r["time_to_target_s"] = time_to_target(r["curve"], target[1]) if target else None
            r["time_to_target_steps"] = (r["time_to_target_s"] / r["step_s"]
                                         if r["time_to_target_s"] is not None and r.get("step_s") else None)
            if r["strategy"] in ("diloco", "ddp"):  # the useful tokens after each evaluation (outer step)
                lost = {1: r["kill_step"] - 1} if r["kill"] else {}  # island 1, SIGKILLed as it started kill_step
                h = r["H"] if r["strategy"] == "diloco" else 1
                r["tokens_curve"] = [(t, float(diloco_useful_tokens(int(step), r["islands"], h,
                                                                    r["tokens_per_step"], lost)))
                                     for (t, _), (step, _) in zip(r["curve"], r["evals"], strict=True)]
            if targets:
                _per_target(r, targets)
            r["tokens_to_target"] = (value_at(r["tokens_curve"], r["time_to_target_s"])
                                     if r["time_to_target_s"] is not None and r.get("tokens_curve") else None)
            r["goodput"] = goodput(r["useful_tokens"], r["run_s"], r["islands"], r["tokens_per_step"], r["step_s"]) \
                if r.get("tokens_per_step") and r.get("step_s") else None
            if r.get("ideal_tokens_per_s") and r["run_s"] > 0:
                r["goodput"] = r["useful_tokens"] / r["run_s"] / r["ideal_tokens_per_s"]
            # steady tokens/s over every island computing all the time: the throughput that holds across loads
            r["steady_utilization"] = (r["tokens_per_s"] * r["step_s"] / (r["islands"] * r["tokens_per_step"])
                                       if r.get("tokens_per_s") and r.get("step_s") and r.get("tokens_per_step")
                                       else None)
        for r in group:
            base = next((b for b in group if b["strategy"] == "diloco" and b["kill"] == r["kill"]), None)
            tt, bt = r.get("time_to_target_s"), base.get("time_to_target_s") if base else None
            r["speedup_to_target"] = bt / tt if tt and bt else None
            tt, bt = r.get("time_to_target_steps"), base.get("time_to_target_steps") if base else None
            r["speedup_to_target_steps"] = bt / tt if tt and bt else None
            r["tokens_per_s_ratio"] = (r["tokens_per_s"] / base["tokens_per_s"]
                                       if base and r.get("tokens_per_s") and base.get("tokens_per_s") else None)
            r["utilization_ratio"] = (r["steady_utilization"] / base["steady_utilization"]
                                      if base and r.get("steady_utilization") and base.get("steady_utilization")
                                      else None)
            if targets:
                r["speedups_to_targets"] = _ratios(r["times_to_targets_s"], base and base.get("times_to_targets_s"),
                                                   inverse=True)
                r["tokens_ratio_to_targets"] = _ratios(r["tokens_to_targets"],
                                                       base and base.get("tokens_to_targets"), inverse=False)
