"""What the driver of a decoupled run on Ray shows and logs while the islands train."""

from __future__ import annotations

import time
from typing import Any

from atoll.config.facts import RunFacts
from atoll.job.metrics import ProgressDisplay
from atoll.job.run import Run
from atoll.strategies.decoupled.progress import progress_detail


class RayReport:
    """What the driver shows and logs of a Ray run while it trains, from the syncer's :meth:`progress
    <atoll.runtime.ray.actors.SyncerService.progress>` at each of the driver's checks
    (:attr:`atoll.runtime.ray.watch.Watch.poll_s`): the progress line
    (steps per island, merges, staleness, goodput so far), a ``train`` event (the islands' last losses, their
    steps and bytes) and the run events (pushes, merges, refusals, rejoins; the driver's own: failures).

    Goodput so far is the merged tokens per second of the run's clock over the fastest rate of inner steps the
    run has shown between two looks (the failure-free rate is measured only at the end).
    """

    def __init__(self, facts: RunFacts, run: Run, bar: ProgressDisplay) -> None:
        self.facts, self.run, self.bar = facts, run, bar
        self.step = self.logged = 0    # the islands' mean inner step at the last look; of the last train event
        self.run_s = 0.0               # the run's clock at the last look
        self.at = time.monotonic()     # this process's clock at the last look
        self.peak_rate = 0.0           # tokens per second: the fastest seen between two looks
        self.reserved = 0

    def show(self, p: dict[str, Any]) -> None:
        """Show and log how the run stands: ``p``, the syncer's progress."""
        run = self.run
        tps, k = self.facts.tokens_per_step, self.facts.islands
        if p["run_s"] > self.run_s and p["reserved"] > self.reserved:
            self.peak_rate = max(self.peak_rate, (p["reserved"] - self.reserved) * tps / (p["run_s"] - self.run_s))
        self.step, self.run_s, self.reserved, self.at = p["reserved"] // k, p["run_s"], p["reserved"], time.monotonic()
        for kind, fields in p["events"]:
            run.events.log(kind, self.step, **fields)
        losses, lrs = p["loss_by_island"], p["lr_by_island"]
        known = [x for x in losses if x is not None]
        bytes_sent = sum(p["bytes_by_island"]) / k
        if known and self.step > self.logged:
            self.logged = self.step
            run.log_train(self.step, p["reserved"] * tps, sum(known) / len(known), bytes_sent, p["run_s"],
                          next(x for x in lrs if x is not None),
                          island_loss=losses if len(known) == k else None, island_bytes_sent=p["bytes_by_island"],
                          island_steps=p["steps_by_island"])
        goodput = p["merged_tokens"] / p["run_s"] / self.peak_rate if self.peak_rate > 0 and p["run_s"] > 0 else None
        self.bar.update(max(1, self.step), sum(known) / len(known) if known else float("nan"),
                        p["reserved"] * tps / max(1e-9, p["run_s"]), bytes_sent,
                        detail=progress_detail(p["steps_by_island"], p["commits"], p["staleness"], goodput))

    def failure(self, island: int) -> None:
        """Island ``island``'s process died (a ``failure`` event, at the run's clock as last seen plus since)."""
        self.run.events.log("failure", self.step, island=island,
                           sim_wall_s=self.run_s + time.monotonic() - self.at)
