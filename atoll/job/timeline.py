"""The timeline of an asynchronous (decoupled) run: each island's inner steps, pushes and outages and the
syncer's merges against the run's clock, read from the run events of ``metrics.jsonl`` and drawn to
``timeline.png`` in the run folder.

The run events (:data:`RUN_EVENTS`), each one line of ``metrics.jsonl`` with ``step`` (the islands' mean inner
step), ``count`` (how many of its kind so far) and ``sim_wall_s`` (the run's clock: simulated seconds on the
``local`` runtime, real seconds from the first inner step on Ray):

- ``failure``: an island failed (``island``; ``lost_tokens`` where known); ``rejoin``: it trains again
  (``island``, ``rejoin_s``: seconds from its failure);
- ``reset``: an island diverged and was put back to the global model (``island``), every strategy;
- ``push``: a push reached the syncer (``island``, ``fragment``, ``island_step``: the island's inner steps then,
  ``outcome``: ``accepted``, ``stale`` or ``refused``);
- ``refusal``: the syncer refused a push (``island``, ``fragment``, ``reason``: the check it failed,
  :mod:`atoll.strategies.decoupled.trust` and :mod:`~atoll.strategies.decoupled.bounds`);
- ``merge``: the syncer committed an outer step of a fragment (``fragment``, ``version``, ``islands``: those
  merged).

Failures, rejoins, resets and refusals also reach the trackers (``events/<kind>s``: the count so far).

    from atoll.job.timeline import plot_timeline
    plot_timeline("runs/decoupled/metrics.jsonl", "timeline.png")
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atoll.job.figures import pyplot
from atoll.job.metrics import read_metrics

#: the kinds of run event besides ``start``/``train``/``eval``/``checkpoint``/``end`` (the module docstring)
RUN_EVENTS = ("failure", "rejoin", "reset", "refusal", "push", "merge")

#: the run events the trackers receive, as ``events/<kind>s`` (pushes and merges are too many to plot so)
TRACKED_EVENTS = ("failure", "rejoin", "reset", "refusal")

_OUTCOME_STYLE = {"accepted": ("tab:green", "|"), "stale": ("tab:orange", "|"), "refused": ("tab:red", "x")}


@dataclass
class Timeline:
    """What :func:`read_timeline` found, per island (index i of each list) and for the syncer.

    Attributes:
        islands: islands of the run.
        steps: per island, (seconds, inner steps done) points in time order.
        pushes: per island, (seconds, outcome) of each push that reached the syncer.
        outages: per island, (failed at, back at, or None when it never came back) in seconds.
        resets: per island, seconds at which it was reset (diverged).
        merges: (seconds, fragment) of each outer step the syncer committed.
        end_s: the last time any event names (the run's clock at its end), seconds.
    """

    islands: int
    steps: list[list[tuple[float, int]]] = field(default_factory=list)
    pushes: list[list[tuple[float, str]]] = field(default_factory=list)
    outages: list[list[tuple[float, float | None]]] = field(default_factory=list)
    resets: list[list[float]] = field(default_factory=list)
    merges: list[tuple[float, int]] = field(default_factory=list)
    end_s: float = 0.0


def _time(event: dict[str, Any]) -> float | None:
    t = event.get("sim_wall_s")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


def _island(event: dict[str, Any], islands: int) -> int | None:
    i = event.get("island")
    return i if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < islands else None


def read_timeline(events: list[dict[str, Any]]) -> Timeline:
    """The timeline of a run from its events (:func:`atoll.job.metrics.read_metrics`); events without a time
    or naming no island of the run are passed over.

    Raises:
        ValueError: the events hold no ``start`` event with the run's config (not a whole run's log).
    """
    start = next((e for e in events if e.get("event") == "start" and isinstance(e.get("config"), dict)), None)
    if start is None or not isinstance(start["config"].get("islands"), int):
        raise ValueError("the events hold no 'start' event with the run's config")
    k = start["config"]["islands"]
    tl = Timeline(k, [[] for _ in range(k)], [[] for _ in range(k)], [[] for _ in range(k)], [[] for _ in range(k)])
    for e in events:
        t = _time(e)
        if t is None:
            continue
        tl.end_s = max(tl.end_s, t)
        kind, i = e.get("event"), _island(e, k)
        if kind == "train" and isinstance(e.get("island_steps"), list) and len(e["island_steps"]) == k:
            for j, n in enumerate(e["island_steps"]):
                tl.steps[j].append((t, int(n)))
        elif kind == "merge" and isinstance(e.get("fragment"), int):
            tl.merges.append((t, e["fragment"]))
        elif i is None:
            continue
        elif kind == "push":
            tl.pushes[i].append((t, str(e.get("outcome", "accepted"))))
            if isinstance(e.get("island_step"), int):
                tl.steps[i].append((t, e["island_step"]))
        elif kind in ("failure", "lost"):  # (lost: the syncer service's island that went silent)
            tl.outages[i].append((t, None))
        elif kind in ("rejoin", "back") and tl.outages[i] and tl.outages[i][-1][1] is None:  # (back: service)
            tl.outages[i][-1] = (tl.outages[i][-1][0], t)
        elif kind == "reset":
            tl.resets[i].append(t)
    for s in tl.steps:
        s.sort()
    return tl


def plot_timeline(metrics: Path | str, out: Path | str, runtime: str | None = None) -> Path:
    """Draw a run's timeline (:func:`read_timeline` of its ``metrics.jsonl``) to ``out`` (PNG); return ``out``.

    Top: each island's inner steps against the run's clock (a slower island climbs more slowly, an outage is
    flat). Bottom: one lane per island, its pushes (green: accepted, orange: stale, red x: refused), outages
    (red spans) and resets (black diamonds), and a lane for the syncer's merges (a tick per outer step,
    coloured by fragment).

    Raises:
        DataError: ``metrics`` is damaged (:func:`atoll.job.metrics.read_metrics`).
        ValueError: it holds no ``start`` event.
        OSError: ``out`` cannot be written.
    """
    events = read_metrics(Path(metrics))
    tl = read_timeline(events)
    if runtime is None:
        runtime = next((e["config"].get("runtime") for e in events if e.get("event") == "start"), None)
    plt = pyplot()
    fig, (ax_steps, ax_lanes) = plt.subplots(2, 1, figsize=(10, 3 + 0.45 * (tl.islands + 1)), sharex=True,
                                             gridspec_kw={"height_ratios": [2, 1 + 0.25 * tl.islands]})
    for i, points in enumerate(tl.steps):
        if points:
            ax_steps.step([t for t, _ in points], [n for _, n in points], where="post", label=f"island {i}")
    ax_steps.set_ylabel("inner steps")
    if any(tl.steps):
        ax_steps.legend(loc="upper left", fontsize="small", ncol=min(4, max(1, tl.islands)))
    ax_steps.grid(alpha=0.3)
    end = tl.end_s or 1.0
    for i in range(tl.islands):
        y = tl.islands - i
        for down, up in tl.outages[i]:
            ax_lanes.barh(y, (up if up is not None else end) - down, left=down, height=0.6, color="tab:red",
                          alpha=0.35)
        for outcome, (color, marker) in _OUTCOME_STYLE.items():
            ts = [t for t, o in tl.pushes[i] if o == outcome]
            if ts:
                ax_lanes.scatter(ts, [y] * len(ts), c=color, marker=marker, s=60 if marker == "|" else 30)
        if tl.resets[i]:
            ax_lanes.scatter(tl.resets[i], [y] * len(tl.resets[i]), c="black", marker="D", s=20)
    if tl.merges:
        cmap = plt.get_cmap("tab10")
        ax_lanes.scatter([t for t, _ in tl.merges], [0] * len(tl.merges), marker="|", s=120,
                         c=[cmap(f % 10) for _, f in tl.merges])
    ax_lanes.set_yticks(range(tl.islands + 1), ["syncer"] + [f"island {i}" for i in reversed(range(tl.islands))])
    ax_lanes.set_ylim(-0.7, tl.islands + 0.7)
    clock = "simulated seconds" if runtime == "local" else "seconds from the first inner step"
    ax_lanes.set_xlabel(f"run clock ({clock}); pushes: green accepted, orange stale, red x refused; "
                        "red spans: outages")
    ax_lanes.grid(axis="x", alpha=0.3)
    fig.suptitle("decoupled run timeline")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


class RunEvents:
    """The run events of one run (:data:`RUN_EVENTS`), each written by ``emit`` (``metrics.jsonl`` and the
    trackers: :meth:`atoll.job.run.Run.emit`) with ``count``, how many of its kind the run has logged.

    Args:
        emit: writes one event: ``emit(kind, **fields)``.
        islands: islands of the run (for :meth:`note_resets`).
    """

    def __init__(self, emit: Callable[..., dict[str, Any]], islands: int) -> None:
        # a bound method of the run is held weakly: no reference cycle keeps a failed run (its folder lock) alive
        self.emit = weakref.WeakMethod(emit) if inspect.ismethod(emit) else lambda: emit
        self.counts = dict.fromkeys(RUN_EVENTS, 0)
        self.resets_seen = [0] * islands  # per island, resets logged as ``reset`` events

    def restore(self, history: list[dict[str, Any]]) -> None:
        """A resumed run: the counts go on from the events of ``history`` (``metrics.jsonl`` as kept)."""
        for event in history:
            if event.get("event") in self.counts:
                self.counts[event["event"]] += 1
                if event["event"] == "reset" and (i := _island(event, len(self.resets_seen))) is not None:
                    self.resets_seen[i] += 1

    def log(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        """Write a run event at inner step ``step`` (the islands' mean); return it.

        Raises:
            ValueError: ``event`` is not one of :data:`RUN_EVENTS`.
        """
        if event not in self.counts:
            raise ValueError(f"{event!r} is not a run event; one of {', '.join(RUN_EVENTS)}")
        self.counts[event] += 1
        emit = self.emit()
        if emit is None:
            raise ValueError("the run these events belong to is gone")
        return emit(event, step=step, count=self.counts[event], **fields)

    def note_resets(self, step: int, resets: list[int], sim_wall_s: float | None = None) -> None:
        """A ``reset`` event for every island reset (diverged, put back to a healthy model) since the last call:
        ``resets`` holds each island's count so far (:attr:`atoll.job.island.Island.reset_count`)."""
        for i, n in enumerate(resets):
            for _ in range(self.resets_seen[i], n):
                self.log("reset", step, island=i, sim_wall_s=sim_wall_s)
            self.resets_seen[i] = max(self.resets_seen[i], n)
