"""The driver's deadlines on Ray: a syncer that stops answering, an island that stops calling.

Ray detects a process that *dies* (its actors are restarted, ``max_restarts``), not one that stops: a
SIGSTOPped or hung syncer leaves every island blocked in its call and the driver waiting, silently, forever.
So the driver never waits on Ray without a deadline (``collective_timeout_s``, seconds): between its waits
for the islands' ``run`` calls (a few seconds each) it asks the syncer for its :meth:`progress
<atoll.runtime.ray.actors.SyncerService.progress>` with that deadline.

- **The syncer does not answer in time**: its process is killed (SIGKILL: it runs on the driver's node, its pid
  is in ``<out>/ray/syncer.pid``; else through Ray), Ray restarts it from its last atomic checkpoint (every
  commit is in it), and the islands' calls, retried, go on. If it does not answer again within the deadline
  (its restarts used up, or it hangs again at once) the run stops: :class:`~atoll.errors.RunFailed`, exit
  status 3, with one line naming the syncer's checkpoint.
- **An island stops calling** (no step, push or poll for the deadline since its last call): its process is
  killed through Ray, which restarts it; it rejoins from the newest global parameters, as a crashed island does.
- **An island's pushes are all refused** (:meth:`~atoll.strategies.decoupled.syncer.Syncer.starved`): the run
  stops with the syncer's one line (exit status 1).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ray

from atoll.errors import RunFailed

#: the exit status of a run whose syncer could not be brought back (as a collective run's lost peer)
EXIT_LOST = 3


class Watch:
    """Deadlines on the syncer actor and the islands of one run.

    Args:
        syncer: the syncer's actor handle; islands: the island actors' handles (index = island).
        out: the run folder (``out/ray/syncer.pid``, ``out/syncer``: its checkpoints).
        deadline_s: how long the syncer may take to answer, and an island may stay silent, seconds.
    """

    def __init__(self, syncer: Any, islands: list[Any], out: Path, deadline_s: float) -> None:
        self.syncer, self.islands, self.out, self.deadline_s = syncer, islands, out, deadline_s
        self.syncer_kills = 0
        self.island_kills = [0] * len(islands)
        self.killed_at: list[float | None] = [None] * len(islands)  # monotonic time of an island's last kill

    @property
    def poll_s(self) -> float:
        """How long the driver waits for the islands between two checks, seconds."""
        return max(0.5, min(5.0, self.deadline_s / 4))

    def call(self, method: str) -> Any:
        """The syncer's ``method()`` (no arguments: ``progress``, ``finish``) within the deadline; a syncer that
        does not answer is killed, Ray restarts it from its checkpoint, and it is asked once more.

        Raises:
            RunFailed: the syncer did not answer again after a restart, or cannot be restarted.
        """
        try:
            return ray.get(getattr(self.syncer, method).remote(), timeout=self.deadline_s)
        except ray.exceptions.GetTimeoutError:
            self.kill_syncer()
        try:
            return ray.get(getattr(self.syncer, method).remote(), timeout=self.deadline_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError,
                ray.exceptions.ActorUnavailableError) as e:
            raise RunFailed(self.lost_message(type(e).__name__), EXIT_LOST) from None

    def kill_syncer(self) -> None:
        """SIGKILL the syncer's process (its pid file on this node), else ask Ray to kill it; Ray restarts it."""
        self.syncer_kills += 1
        print(f"atoll: warning: the syncer did not answer within {self.deadline_s:g} s (--collective-timeout-s); "
              "killed it, Ray restarts it from its last checkpoint", file=sys.stderr)
        try:
            os.kill(int((self.out / "ray" / "syncer.pid").read_text()), signal.SIGKILL)
        except (OSError, ValueError):  # not on this node, or gone: through Ray
            ray.kill(self.syncer, no_restart=False)
        time.sleep(0.5)  # Ray notices the death and restarts it; calls meanwhile are retried

    def lost_message(self, why: str) -> str:
        """One line for a run whose syncer is lost for good: what happened and where its state is."""
        return (f"the syncer did not answer within {self.deadline_s:g} s of its restart ({why}); the run stopped, "
                f"its committed outer steps are in the syncer's checkpoint under {self.out / 'syncer'}; a "
                "decoupled run on Ray cannot be resumed: run it again (with a longer --collective-timeout-s if "
                "the syncer was only slow)")

    def silent_islands(self, progress: dict[str, Any], running: set[int]) -> list[int]:
        """The running islands that made no call to the syncer within the deadline (one killed within the
        last deadline is restarting: not again)."""
        now = time.monotonic()
        return [i for i in sorted(running) if (s := progress["silent_s"][i]) is not None and s > self.deadline_s
                and ((k := self.killed_at[i]) is None or now - k > self.deadline_s)]

    def kill_island(self, island: int) -> None:
        """Kill a silent island's process through Ray (it restarts the actor, which rejoins)."""
        self.island_kills[island] += 1
        self.killed_at[island] = time.monotonic()
        print(f"atoll: warning: island {island} made no call for {self.deadline_s:g} s (--collective-timeout-s); "
              "killed it, Ray restarts it and it rejoins from the newest global parameters", file=sys.stderr)
        ray.kill(self.islands[island], no_restart=False)
