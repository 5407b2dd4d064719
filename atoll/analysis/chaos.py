"""Injected failures: a seeded failure trace per island, and what the same trace costs synchronous training.

``--chaos MTBF_S:DOWNTIME_S`` gives every island an alternating sequence of up-times and outages: each up-time
is exponentially distributed with mean ``MTBF_S`` (failures as a Poisson process, the usual model of
independent hardware faults), each outage lasts exactly ``DOWNTIME_S``. An island is therefore down a
fraction ``DOWNTIME_S / (MTBF_S + DOWNTIME_S)`` of the time on average (``90:10``: 10%). The trace of island
i depends only on (seed, i, MTBF_S, DOWNTIME_S), so a run is reproducible and two strategies can be compared
under the very same failures.

:func:`synchronous_under_failures` replays a trace for synchronous DiLoCo on the simulated clock (computed
from the trace, not trained): every round of H inner steps needs every island, so any failure stops
everyone until the island is back, and the work since the last checkpoint is redone.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from atoll.config.parse import parse_chaos

#: The standard failure trace of the benchmarks (``atoll bench suite``, bench/decoupled.py): every island
#: fails after exponentially distributed up-times of mean 0.45 T and stays down 0.05 T each time (down about
#: 10% of the time), where T is the run's own failure-free simulated time.
STANDARD_MTBF_FRACTION, STANDARD_DOWN_FRACTION = 0.45, 0.05

#: a simulated run under failures stops once its time passes this multiple of its failure-free time: when
#: failures are frequent against a step (or a round) almost nothing commits, and it would run for ever
GIVE_UP_FACTOR = 100.0


def standard_chaos(failure_free_s: float) -> str:
    """The standard failure trace as a ``--chaos MTBF_S:DOWNTIME_S`` spec for a run of ``failure_free_s`` seconds."""
    return f"{STANDARD_MTBF_FRACTION * failure_free_s:g}:{STANDARD_DOWN_FRACTION * failure_free_s:g}"


@dataclass
class FailureTrace:
    """Seeded outages of each island, generated lazily in time order.

    Args:
        islands: number of islands.
        mtbf_s: mean up-time between two failures, seconds (exponential).
        downtime_s: length of every outage, seconds.
        seed: the run's seed.

    Attributes:
        outages: per island, the (down_at, up_at) pairs generated so far, ascending, in seconds.
    """

    islands: int
    mtbf_s: float
    downtime_s: float
    seed: int = 0
    outages: list[list[tuple[float, float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rngs = [random.Random(f"atoll-chaos-{self.seed}-{i}") for i in range(self.islands)]
        self.outages = [[] for _ in range(self.islands)]

    @classmethod
    def from_spec(cls, spec: str, islands: int, seed: int) -> FailureTrace:
        """The trace of ``--chaos MTBF_S:DOWNTIME_S``."""
        mtbf, down = parse_chaos(spec)
        return cls(islands, mtbf, down, seed)

    def _extend(self, island: int) -> None:
        seq = self.outages[island]
        start = seq[-1][1] if seq else 0.0
        down = start + self._rngs[island].expovariate(1.0 / self.mtbf_s)
        seq.append((down, down + self.downtime_s))

    def next_outage(self, island: int, t: float) -> tuple[float, float]:
        """The first outage of ``island`` that ends after time ``t`` (it may already have begun)."""
        seq = self.outages[island]
        while not seq or seq[-1][1] <= t:
            self._extend(island)
        for down, up in seq:
            if up > t:
                return down, up
        raise AssertionError("unreachable")

    def until(self, island: int, t: float) -> list[tuple[float, float]]:
        """Every outage of ``island`` that begins before ``t``."""
        self.next_outage(island, t)
        return [o for o in self.outages[island] if o[0] < t]

    @property
    def down_fraction(self) -> float:
        """Expected fraction of time an island is down: downtime / (MTBF + downtime)."""
        return self.downtime_s / (self.mtbf_s + self.downtime_s)


def synchronous_under_failures(trace: FailureTrace | None, steps: int, sync_every: int, step_s: list[float],
                               sync_s: float, tokens_per_step: int, checkpoint_rounds: int = 1,
                               give_up_factor: float = GIVE_UP_FACTOR) -> dict[str, float | bool | list[float]]:
    """Replay synchronous DiLoCo under ``trace`` on the simulated clock.

    A round is ``H`` inner steps on every island (the slowest island sets its length,
    ``H · max(step_s)``) followed by a blocking all-reduce of ``sync_s`` seconds. A round commits only if no
    island fails during it. When an island fails, every island stops until it is back (later outages of
    others extend the stop), and the job restarts from its last checkpoint, taken every
    ``checkpoint_rounds`` committed rounds (1: at every outer step, the most favourable case for the
    synchronous baseline), so the rounds since then are redone.

    Args:
        trace: the failures, or None for a failure-free run.
        steps: inner steps per island; sync_every: H.
        step_s: simulated seconds of one inner step on each island (``sim_step_s / speed``).
        sync_s: seconds of one outer all-reduce.
        tokens_per_step: tokens one island trains on per inner step.
        checkpoint_rounds: committed rounds between two checkpoints.
        give_up_factor: stop once the wall time exceeds this multiple of the failure-free wall time (when
            failures are frequent against a round, a synchronous job almost never commits a round).

    Returns:
        ``wall_s``; ``goodput`` (useful tokens per simulated second over the failure-free compute rate
        ``Σ_i tokens_per_step / step_s_i``, see :func:`atoll.strategies.decoupled.train_decoupled`);
        ``island_utilization`` (compute seconds of the useful steps over ``wall_s``, per island);
        ``redone_s`` (seconds of rounds lost to failures); ``stopped_s`` (seconds everyone waited);
        ``steps_done`` (committed inner steps per island); ``gave_up`` (stopped at ``give_up_factor``:
        goodput and utilization are then those of the steps committed until then).
    """
    islands = len(step_s)
    t, done, ckpt = 0.0, 0, 0
    redone_s = stopped_s = 0.0
    rounds = math.ceil(steps / sync_every)
    limit = give_up_factor * (steps * max(step_s) + rounds * sync_s)
    while done < steps and t < limit:
        h = min(sync_every, steps - done)
        end = t + h * max(step_s) + sync_s
        hits = [trace.next_outage(i, t) for i in range(islands)] if trace is not None else []
        hits = [o for o in hits if o[0] < end]
        if not hits:
            t, done = end, done + h
            if (done // sync_every) % checkpoint_rounds == 0 or done == steps:
                ckpt = done
            continue
        down = min(o[0] for o in hits)
        if down > t:  # a failure mid-round: the work since the last checkpoint is lost
            redone_s += down - t + (done - ckpt) * max(step_s) + (done - ckpt) / sync_every * sync_s
            done = ckpt
        back = max(o[1] for o in hits if o[0] <= max(down, t))
        stopped_s += back - max(down, t)
        t = back
    ideal_rate = sum(tokens_per_step / s for s in step_s)
    useful = islands * done * tokens_per_step
    return {"wall_s": t, "goodput": useful / t / ideal_rate if t > 0 else 1.0,
            "island_utilization": [done * s / t if t > 0 else 1.0 for s in step_s],
            "redone_s": redone_s, "stopped_s": stopped_s, "steps_done": done, "gave_up": done < steps}
