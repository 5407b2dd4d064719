"""The live view of a running ``atoll syncer``: what it shows and logs while the islands train.

A :class:`Monitor` thread looks at the served syncer every :data:`LOOK_S` seconds and

- keeps the **view** (:meth:`Monitor.view`: the islands' states, inner steps, losses and last pushes, merges,
  staleness, goodput, bytes in and out, refusals by reason, the held-out losses so far) that the HTTP status
  page, ``/status.json`` and the Prometheus ``/metrics`` read (:mod:`~atoll.runtime.service.status`);
- prints a **progress line** on stderr every ``progress_every_s`` seconds (:class:`~atoll.config.runtimes.
  ServiceConfig`; 0: none);
- writes the run's **events** to ``<out>/run/metrics.jsonl`` and the trackers (``--tracker``) as they happen
  (the coordinator of a sharded syncer only): ``join`` (an island's session opens; ``rejoin`` too from its
  second), ``leave``, ``lost`` (an island that joined, did not leave and made no call for :data:`LOST_AFTER_S`
  seconds; at the time of its last call), ``back`` (a lost island called again, in the same session), the
  syncer's ``push``, ``merge`` and ``refusal`` run events (:mod:`atoll.job.timeline`), a
  ``refusal`` of a call its gate refused (``call``: true), ``checkpoint`` (each syncer checkpoint on disk),
  ``train`` (the islands' last losses, when their mean inner step grew) and ``eval``: the global model on the
  held-out windows every ``eval_every`` merged inner steps (the merged tokens over the islands' tokens per
  step; an unsharded syncer only, on its CPU).

An island's state: ``waiting`` (not joined yet), ``alive``, ``lost`` (silent for :data:`LOST_AFTER_S`; alive again
once it calls), ``left`` (it said it is done).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atoll.job.metrics import TimedLines, human_bytes, perplexity
from atoll.strategies.decoupled.progress import RECENT

if TYPE_CHECKING:
    from atoll.config.facts import RunFacts
    from atoll.job.run import Run
    from atoll.runtime.service.syncer import SyncerService

#: seconds of silence after which an island that joined and did not leave is ``lost`` (its leader heartbeats
#: every 2 s; a long poll of a buffered push lasts at most 5 s)
LOST_AFTER_S = 10.0
#: seconds between two looks of the monitor at the syncer
LOOK_S = 0.5
#: seconds of the run's clock over which the rate of inner steps is measured (goodput's failure-free rate)
RATE_WINDOW_S = 5.0
#: held-out losses the view keeps (the status page's curve)
EVAL_POINTS = 512


def island_states(service: SyncerService, left: dict[int, Any] | set[int]) -> list[str]:
    """Per island its state now: ``waiting``, ``alive``, ``lost`` or ``left`` (the module docstring). Read under
    the server's lock."""
    now = service._now()
    states = []
    for i, record in enumerate(service.islands):
        heard = record.heard
        if i in left:
            states.append("left")
        elif heard is None or record.joins == 0:
            states.append("waiting")
        else:
            states.append("lost" if now - heard > LOST_AFTER_S else "alive")
    return states


class Monitor:
    """The live view, progress line and live events of one served syncer (see the module docstring).

    Args:
        server: the served syncer, a :class:`~atoll.runtime.service.server.SyncerServer` (which imports this
            module: not named in the hint); its lock is taken for each look, briefly.
        facts: the run's facts (islands, steps, tokens per step, ``evaluate_every``: inner steps per island between
            two evaluations of the global model).
        progress_every_s: seconds between two progress lines (0: none; the syncer's ``progress_every_s``, or 0
            with ``--no-progress``).
        run: the run folder ``<out>/run`` opened for its events (:class:`~atoll.job.run.Run`, begun), or None
            (a shard other than the coordinator: the view and the progress line only).
        out: where a line is written (default: stderr).
    """

    def __init__(self, server: Any, facts: RunFacts, progress_every_s: float, run: Run | None = None,
                 out: Any = None) -> None:
        self.server, self.run = server, run
        self.lines = TimedLines(progress_every_s, out if out is not None else sys.stderr)
        self.islands = server.islands
        self.tps = facts.tokens_per_step
        self.eval_every = facts.evaluate_every
        self.evaluate = run is not None and server.service.shard is None
        self.t0 = time.monotonic()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # what the last look saw (to emit what changed since)
        self.joins = [i.joins for i in server.service.islands]
        self.states = ["waiting"] * self.islands
        self.left: set[int] = set(server.left)
        self.refused_calls: dict[str, int] = dict(server.refused_calls)
        self.last_push_s: list[float | None] = [None] * self.islands  # run clock of each island's last push
        self.logged_step = 0  # the islands' mean inner step of the last train event
        self.evaluated = 0    # merged inner steps of the last evaluation (its multiple of eval_every)
        self.checkpoint = -1  # commits of the newest syncer checkpoint on disk
        self.peak_rate = 0.0  # tokens per second: the fastest seen between two looks
        self.mark = (0.0, 0)  # (run clock, steps reserved) at the last look
        self.evals: list[tuple[int, float]] = []  # (merged inner steps, held-out loss)
        self.lines_written = 0
        self.current: dict[str, Any] = {}
        if run is not None:
            self.evals.append((0, run.initial_eval_loss))

    # --- the thread ---------------------------------------------------------------------------------------
    def start(self) -> Monitor:
        """Look at the syncer every :data:`LOOK_S` seconds on a thread of its own until :meth:`stop`."""
        self.look()
        self.thread = threading.Thread(target=self._loop, name="atoll-monitor", daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop_event.wait(LOOK_S):
            try:
                self.look()
            except Exception as e:  # noqa: BLE001 - the view must never end the run; said once, then stopped
                self.error = e
                print(f"atoll syncer: warning: the live view stopped ({type(e).__name__}: {e})", file=sys.stderr,
                      flush=True)
                return

    def stop(self) -> None:
        """Stop the thread, then take a last look (the events of the final merges), writing a last line."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join()
        if self.error is None:
            self.look(final=True)

    # --- one look -----------------------------------------------------------------------------------------
    def look(self, final: bool = False) -> dict[str, Any]:
        """Read the syncer (under its lock), emit what changed, evaluate when due, print the line when due;
        return the view (also :attr:`current`)."""
        server, service = self.server, self.server.service
        with server.lock:
            p = service.progress(drain=False)
            events = list(server.drained)
            server.drained.clear()
            states = island_states(service, server.left)
            joins, left = [i.joins for i in service.islands], set(server.left)
            refused_calls = dict(server.refused_calls)
            refused_pushes = dict(service.syncer.rejected_by_reason)
            heard = [None if i.heard is None else service._now() - i.heard for i in service.islands]
            bytes_out, out_by_island = server.bulk.bytes_out, list(server.bulk.bytes_out_by_island)
            calls = dict(server.calls)
            params = service.syncer.global_params() if self._eval_due(p) else None
        run_s = p["run_s"]
        step = p["reserved"] // self.islands
        self._rates(p)
        for kind, fields in events:
            if kind == "push" and isinstance(fields.get("island"), int) and 0 <= fields["island"] < self.islands:
                self.last_push_s[fields["island"]] = fields.get("sim_wall_s")
            self._event(kind, step, fields)
        for i in range(self.islands):
            if joins[i] > self.joins[i]:
                self._emit("join", step, island=i, joins=joins[i], sim_wall_s=run_s)
            # a lost island that called again in its session (not a rejoin): back, also when that call was its Leave
            if states[i] in ("alive", "left") and self.states[i] == "lost" and joins[i] == self.joins[i]:
                self._emit("back", step, island=i, sim_wall_s=run_s)
            if i in left and i not in self.left:
                self._emit("leave", step, island=i, island_steps=p["steps_by_island"][i], sim_wall_s=run_s)
            if states[i] == "lost" and self.states[i] != "lost":  # since its last call, on the run's clock
                self._emit("lost", step, island=i, silent_s=heard[i], sim_wall_s=max(0.0, run_s - (heard[i] or 0.0)))
        for reason, n in refused_calls.items():
            for _ in range(self.refused_calls.get(reason, 0), n):
                self._event("refusal", step, {"reason": reason, "call": True, "sim_wall_s": run_s})
        self.joins, self.states, self.left, self.refused_calls = joins, states, left, refused_calls
        self._checkpoint(step, run_s)
        self._train(p, step)
        if params is not None:
            self._eval(p, params)
        view = self._view(p, states, heard, refused_calls, refused_pushes, bytes_out, calls, out_by_island)
        self.current = view
        if self.lines.due() or (final and self.lines.every_s > 0):
            self.lines.write(self.line(view))
            self.lines_written += 1
        return view

    def _rates(self, p: dict[str, Any]) -> None:
        """The fastest rate of inner steps over windows of at least :data:`RATE_WINDOW_S` seconds of the run's
        clock (tokens per second)."""
        run_s, reserved = p["run_s"], p["reserved"]
        if run_s - self.mark[0] < RATE_WINDOW_S:  # a window long enough to hold leases of every island
            return
        if reserved > self.mark[1]:
            self.peak_rate = max(self.peak_rate, (reserved - self.mark[1]) * self.tps / (run_s - self.mark[0]))
        self.mark = (run_s, reserved)

    def _emit(self, kind: str, step: int, **fields: Any) -> None:
        if self.run is not None:
            self.run.emit(kind, step=step, **fields)

    def _event(self, kind: str, step: int, fields: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.events.log(kind, step, **fields)

    def _checkpoint(self, step: int, run_s: float) -> None:
        from atoll.strategies.decoupled.island import save_path

        latest = save_path(self.server.service.out) / "checkpoints" / "latest"
        try:
            name = os.readlink(latest) if latest.is_symlink() else latest.read_text().strip()
            commits = int(Path(name).name.split("_")[1])
        except (OSError, IndexError, ValueError):
            return
        if commits != self.checkpoint:
            self.checkpoint = commits
            self._emit("checkpoint", step, commits=commits, path=str(latest.parent / Path(name).name),
                       sim_wall_s=run_s)

    def _train(self, p: dict[str, Any], step: int) -> None:
        """A ``train`` event when the islands' mean inner step grew and some island reported its loss."""
        losses, lrs = p["loss_by_island"], p["lr_by_island"]
        known = [x for x in losses if x is not None]
        if self.run is None or not known or step <= self.logged_step:
            return
        self.logged_step = step
        self.run.log_train(step, p["reserved"] * self.tps, sum(known) / len(known),
                           sum(p["bytes_by_island"]) / self.islands, p["run_s"],
                           next(x for x in lrs if x is not None),
                           island_loss=losses if len(known) == self.islands else None,
                           island_bytes_sent=p["bytes_by_island"], island_steps=p["steps_by_island"])

    def merged_steps(self, p: dict[str, Any]) -> int:
        """The inner steps per island whose tokens are merged into the global model (merged tokens over the
        islands' tokens per step)."""
        return int(p["merged_tokens"] // max(1, self.islands * self.tps))

    def _eval_due(self, p: dict[str, Any]) -> bool:
        return self.evaluate and self.merged_steps(p) // self.eval_every > self.evaluated // self.eval_every

    def _eval(self, p: dict[str, Any], params: Any) -> None:
        """The held-out loss of the global model ``params`` at the merged inner steps of ``p`` (an ``eval``)."""
        assert self.run is not None
        merged = self.merged_steps(p)
        self.evaluated = merged
        loss = self.run.log_eval(merged, merged * self.islands * self.tps, params,
                                 sum(p["bytes_by_island"]) / self.islands, p["run_s"])
        self.evals = (self.evals + [(merged, loss)])[-EVAL_POINTS:]

    # --- what is shown ------------------------------------------------------------------------------------
    def _view(self, p: dict[str, Any], states: list[str], heard: list[float | None], refused_calls: dict[str, int],
              refused_pushes: dict[str, int], bytes_out: int, calls: dict[str, int],
              out_by_island: list[int] | None = None) -> dict[str, Any]:
        run_s = p["run_s"]
        recent = list(p["staleness"])[-RECENT:]
        goodput = p["merged_tokens"] / run_s / self.peak_rate if self.peak_rate > 0 and run_s > 0 else None
        islands = [{"island": i, "state": states[i], "steps": p["steps_by_island"][i], "loss": p["loss_by_island"][i],
                    "silent_s": heard[i], "since_push_s": None if self.last_push_s[i] is None
                    else max(0.0, run_s - self.last_push_s[i]), "joins": self.joins[i],
                    "bytes_in": p["bytes_by_island"][i],
                    "bytes_out": out_by_island[i] if out_by_island is not None else None}
                   for i in range(self.islands)]
        last_eval = self.evals[-1] if self.evals else None
        return {"uptime_s": time.monotonic() - self.t0, "run_s": run_s, "islands": islands,
                "shard": self.server.service.shard.shard if self.server.service.shard is not None else None,
                "merges": p["commits"], "versions": p["versions"], "reserved": p["reserved"], "budget": p["budget"],
                "merged_tokens": p["merged_tokens"], "merged_steps": self.merged_steps(p),
                "staleness": sum(recent) / len(recent) if recent else None, "goodput": goodput,
                "bytes_in": sum(p["bytes_by_island"]), "bytes_out": bytes_out,
                "refused_pushes": refused_pushes, "refused_calls": refused_calls, "calls": calls,
                "evals": [{"merged_steps": s, "eval_loss": v, "perplexity": perplexity(v)} for s, v in self.evals],
                "eval_loss": last_eval[1] if last_eval is not None else None,
                "checkpoint": self.checkpoint if self.checkpoint >= 0 else None,
                "done": self.server.done.is_set(), "starved": p["starved"]}

    def line(self, view: dict[str, Any]) -> str:
        """The progress line of ``view``: ``atoll syncer: 0:01:05 | islands 2/3 alive: 0 step 40 (push 3s ago),
        ... | merges 12 | staleness 0.25 | goodput 83% | in 1.2 MB, out 3.4 MB | refused replay 2``."""
        from atoll.job.metrics import clock_text

        alive = sum(v["state"] == "alive" for v in view["islands"])
        parts = []
        for v in view["islands"]:
            if v["state"] == "alive":
                push = f"push {v['since_push_s']:.0f}s ago" if v["since_push_s"] is not None else "no push yet"
                parts.append(f"{v['island']} step {v['steps']} ({push})")
            elif v["state"] == "lost":
                parts.append(f"{v['island']} lost (silent {v['silent_s']:.0f}s)")
            else:
                parts.append(f"{v['island']} {v['state']}")
        refused = Counter(view["refused_pushes"]) + Counter(view["refused_calls"])  # (pushes', calls' reasons)
        staleness, goodput = view["staleness"], view["goodput"]
        islands = f"islands {alive}/{self.islands} alive: " + ", ".join(parts) if view["shard"] in (None, 0) \
            else f"shard {view['shard']} (the islands' sessions and steps: shard 0's line)"
        return " | ".join([
            f"atoll syncer: {clock_text(view['uptime_s'])}", islands,
            f"steps {view['reserved']}/{view['budget']}", f"merges {view['merges']}",
            f"staleness {staleness:.2f}" if staleness is not None else "staleness -",
            f"goodput {goodput:.0%}" if goodput is not None else "goodput -",
            f"in {human_bytes(view['bytes_in'])}, out {human_bytes(view['bytes_out'])}",
            *([f"eval {view['eval_loss']:.3f}"] if view["eval_loss"] is not None else []),
            "refused " + (", ".join(f"{k} {n}" for k, n in sorted(refused.items())) or "none")])
