"""The ``local`` runtime of an asynchronous strategy (decoupled): a discrete-event simulation in one process.

Every island runs in this process on its own simulated clock: an inner step costs ``sim_step_s / speed``
simulated seconds (a fixed cost, so the order of events, hence the run, is deterministic for a seed; the
real compute is measured and reported beside it); a push or pull of B bytes takes ``B·8/bandwidth + latency``
on the island's uplink or downlink (:class:`~atoll.runtime.network.Link`; one transfer at a time per
direction, queued behind the previous one) while the island trains on. Pushes are encoded by the run's codec
and counted as bytes sent; pulls are counted as bytes received and timed at their size on the wire: float32
fragments, or with ``pull_codec`` the encoded changes since the island's version
(:mod:`~atoll.strategies.decoupled.downlink`); a rejoin pulls the whole model in float32. A fragment whose
previous push or pull is still on the wire when its next push is due is pushed at the next due step instead
(``deferred_pushes``; its tokens wait). Events are processed in simulated-time order from a priority queue
(ties by island index), one method per kind of event: :meth:`Simulation.on_step`, :meth:`~Simulation.on_push`,
:meth:`~Simulation.on_pull`, :meth:`~Simulation.on_fail`, :meth:`~Simulation.on_rejoin`; the syncer's grace
windows close in between. ``--steps`` is a budget of ``islands x steps`` inner steps over all islands (the
tokens of every other strategy at equal ``--steps``), shared by speed.

Failures (``--chaos MTBF_S:DOWNTIME_S``, :class:`~atoll.analysis.chaos.FailureTrace`): a step that an outage
interrupts is not taken; the island loses the work it has not pushed, stays down for the outage, then rejoins
by itself: it pulls every global fragment (timed), clears its inner optimizer state and restarts its fragment
schedule; its pushes still on the wire are lost with it. Failures strike while the island computes (it always
does, except while it pulls the model to rejoin; one that begins then takes effect when that pull ends). The
syncer does not wait for a dead island: its grace window closes and it merges without it.

Metrics in ``summary.json`` besides every run's:

- ``goodput``: useful tokens per simulated second over the failure-free rate. Useful tokens are those merged
  into the global model: every merged push's tokens times its fragment's share of the parameters (pushes
  rejected, dropped as stale, or lost with a failed island do not count). The failure-free rate is
  ``Σ_i tokens_per_step · speed_i / sim_step_s``: every island computing all the time, with no failure and no
  communication. So ``goodput = merged_tokens / sim_wall_s / that rate``, in [0, 1].
- ``island_utilization``: per island, simulated compute seconds (lost work included) over ``sim_wall_s``.
- ``rejected_updates`` (by reason, and per island and reason), ``stale_updates``, ``quorum_size_*``, ``staleness_*``,
  ``commits``, ``failures``, ``rejoin_s`` (per rejoin: seconds from failure until training again), ``lost_tokens`` (lost
  to failures: un-pushed at a failure, or pushed but on the wire when the island failed, ``lost_pushes``),
  ``deferred_pushes``, ``steps_per_island``, and every trained token in one bucket per island
  (:mod:`atoll.strategies.decoupled.accounting`: merged, stale, rejected, lost, in flight).
- ``codec_s``, ``eval_s``: measured encode and decode seconds per island, evaluation seconds (real, not simulated).

Checkpoints (every ``checkpoint_every`` mean inner steps, at the end, and at SIGINT or SIGTERM: :mod:`atoll.job.stop`;
named by the mean steps done, rounded down), written atomically, hold all it takes to continue exactly (syncer,
islands, clocks, pending events); ``<out>/syncer/`` holds the syncer's state alone.
"""

from __future__ import annotations

import heapq
import math
import secrets
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from atoll.analysis.chaos import GIVE_UP_FACTOR, FailureTrace
from atoll.config.facts import RunFacts
from atoll.errors import CheckpointError
from atoll.job import stop
from atoll.job.device import island_devices
from atoll.job.divergence import Diverged, check_eval, check_resets, island_extras, until_diverged
from atoll.job.evaluation import IslandEvaluator
from atoll.job.metrics import ProgressDisplay
from atoll.job.run import Run
from atoll.runtime.decoupled_job import job_of
from atoll.runtime.decoupled_job import own as decoupled_config
from atoll.runtime.network import Link
from atoll.runtime.sim_state import SimState, Transfer, Waiter
from atoll.strategies.decoupled import DecoupledConfig, make_syncer
from atoll.strategies.decoupled.accounting import token_buckets
from atoll.strategies.decoupled.island import IslandWorker, Job, expected_steps, save_path
from atoll.strategies.decoupled.journal import Merged
from atoll.strategies.decoupled.progress import progress_detail, syncer_events
from atoll.strategies.decoupled.protocol import Pull

if TYPE_CHECKING:
    from atoll.config import TrainConfig
    from atoll.config.runtimes import LocalConfig
    from atoll.config.sections import ScheduleSection

LOG_EVERY = 10  # mean inner steps per island between two ``train`` events


class Simulation:
    """A decoupled run's islands and syncer in one process, on simulated clocks (see the module docstring).

    Args:
        own: the decoupled strategy's settings (speeds, the simulated step, failures, codec, fragments).
        link: the ``local`` runtime's simulated links (bandwidth, latency).
        facts: the run's facts (islands, steps, seed, device, tokens per step, evaluation and checkpoint cadence).
        schedule: the run's learning-rate schedule (a diverged run's advice names its settings).
        run: the run's bookkeeping (its data, model, events and checkpoints).
        job: what every island shares (its fragments, data and initial parameters).
    """

    def __init__(self, own: DecoupledConfig, link: LocalConfig, facts: RunFacts, schedule: ScheduleSection,
                 run: Run, job: Job) -> None:
        self.own, self.facts, self.lr_schedule, self.run, self.job = own, facts, schedule, run, job
        self.K, self.speeds = facts.islands, list(facts.speeds)
        self.credentials = [secrets.token_hex(16) for _ in range(self.K)]  # each island pushes only as itself
        self.syncer = make_syncer(own, facts, self.job.init_flat, self.job.index, self.credentials, timeout_s=None)
        self.link = Link.from_config(link.link_bandwidth_mbps, link.link_latency_ms)
        self.trace = FailureTrace.from_spec(own.chaos, self.K, facts.seed) if own.chaos else None
        devices = island_devices(self.K, facts.device)  # GPUs round-robin, or all on one device
        steps = expected_steps(own, facts.islands, facts.steps)
        self.workers = [IslandWorker(i, self.job, n, devices[i]) for i, n in enumerate(steps)]
        self.frag_bytes = [int(idx.numel()) * 4 for idx in self.job.index]
        self.budget = self.K * facts.steps
        self.st = SimState.new(self.K, self.syncer.fragments)
        self.gave_up = False
        self.starved = ""  # why the run stopped early because an island's pushes were all refused ("": it did not)
        self.diverged: Diverged | None = None  # set when the job diverged (atoll.job.divergence): it stopped
        self.restored_done: int | None = None  # inner steps done at the checkpoint resumed (None: a new run)
        self.bar: ProgressDisplay | None = None  # the live progress (train_simulated sets it)
        self.ideal_rate = sum(facts.tokens_per_step * s / own.sim_step_s for s in self.speeds)  # tokens/s
        self.evaluator = IslandEvaluator(self.workers[0].island, run.val, self.job.init_flat)

    @classmethod
    def of_run(cls, config: TrainConfig, run: Run) -> Simulation:
        """The simulation of a whole run's ``config`` (its driver's, :func:`train_simulated`)."""
        return cls(decoupled_config(config), config.runtime_config, RunFacts.of(config), config, run,
                   job_of(config, run.data, run.model))

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (the syncer, every island, the clocks and pending events)."""
        if "sim" not in state:
            raise CheckpointError(f"resume: the checkpoint of '{self.run.out}' holds no decoupled run state; "
                                  "start a new run")
        self.syncer.load_state_dict(state["syncer"])
        for w, s in zip(self.workers, state["islands"], strict=True):
            w.load_state_dict(s)
        self.st = SimState.from_state(state["sim"])
        self.restored_done = self.st.done

    # --- the loop ------------------------------------------------------------------------------------
    def run_events(self, resumed: bool) -> None:
        """Process events in simulated-time order until the budget is spent and every buffer is merged."""
        st, syncer = self.st, self.syncer
        if not resumed:
            for i in range(self.K):
                self.next_step(i)
        else:  # islands idle at the checkpoint (the end of a shorter run) go on, if the budget grew
            busy = {e[1] for e in st.queue if e[3] in ("step", "fail", "rejoin")}  # transfers run beside compute
            for i in range(self.K):
                if i in busy:
                    continue
                if st.failed_at[i] is not None and st.clock[i] <= st.failed_at[i]:  # down: rejoin after the outage
                    self.schedule(i, self.trace.next_outage(i, st.failed_at[i])[1], "rejoin")  # type: ignore[union-attr, arg-type]
                else:
                    self.next_step(i)
        give_up_at = GIVE_UP_FACTOR * self.facts.steps * self.own.sim_step_s / min(self.speeds)
        handlers = {"step": self.on_step, "push": self.on_push, "pull": self.on_pull, "fail": self.on_fail,
                    "rejoin": self.on_rejoin}
        while st.queue or syncer.next_deadline() is not None:
            if not st.queue:  # only open buffers are left: close them and answer the islands they hold, so no
                close_at = syncer.next_deadline()[0]  # type: ignore[index]  # final push repeats merged work
                if math.isfinite(close_at):
                    self.close_windows(close_at)
                else:  # no round time measured yet: no window to wait for
                    self.close_windows(st.last_arrival, flush=True)
                continue
            t, i, seq, event, p = st.queue[0]
            if syncer.starved():  # an island's pushes are all refused: its work would never train the model
                self.starved = syncer.starved_message()
                print(f"atoll: warning: {self.starved}; stopped at simulated {t:.3g} s with {st.done} of "
                      f"{self.budget} inner steps done", file=sys.stderr)
                break
            if t > give_up_at:
                self.gave_up = True
                print(f"atoll: warning: chaos: {self.own.chaos} leaves almost no up-time for a step; stopped at "
                      f"simulated {t:.3g} s ({GIVE_UP_FACTOR:g}x the failure-free time) with {st.done} of "
                      f"{self.budget} inner steps done (raise MTBF_S or lower DOWNTIME_S)", file=sys.stderr)
                break
            deadline = syncer.next_deadline()
            if deadline is not None and deadline[0] <= t:  # a grace window closes: merge without the missing
                self.close_windows(deadline[0])
                continue
            heapq.heappop(st.queue)
            handlers[event](i, t, seq, p)

    def schedule(self, i: int, at: float, event: str, p: int = -1) -> int:
        """Queue island i's ``event`` at simulated time ``at``; return the event's seq (its key in in_flight)."""
        heapq.heappush(self.st.queue, (at, i, self.st.seq, event, p))
        self.st.seq += 1
        return self.st.seq - 1

    def next_step(self, i: int) -> None:
        """Start island i's next inner step at its clock, or its failure if an outage interrupts it."""
        st = self.st
        if st.started >= self.budget:
            return  # the budget is spent: the island stops
        t, dur = st.clock[i], self.own.sim_step_s / self.speeds[i]
        if self.trace is not None:
            down, _ = self.trace.next_outage(i, t)
            if down < t + dur:
                self.schedule(i, max(down, t), "fail")
                return
        st.started += 1
        self.syncer.grant(i, self.facts.tokens_per_step)  # the ledger that bounds the island's token claims
        self.schedule(i, t + dur, "step")

    # --- one method per event ----------------------------------------------------------------------------
    def on_step(self, i: int, t: float, seq: int, p: int) -> None:
        """Island i finished an inner step at t: push a due fragment (beside compute), start the next step."""
        st, w = self.st, self.workers[i]
        st.last_loss[i] = w.train_step()
        st.clock[i], st.compute[i] = t, st.compute[i] + self.own.sim_step_s / self.speeds[i]
        st.done += 1
        due = w.due()  # at most one fragment is due per step
        if due and st.awaiting[i][due[0]]:  # its previous push or pull is still on the wire: next time
            st.deferred_pushes += 1
        elif due:  # push it on the island's uplink and train on: the transfers overlap compute
            push = replace(w.push(due[0]), session=self.syncer.admission.session[i])  # its session: not a replay
            st.bytes_sent[i] += push.nbytes
            st.uplink_free[i] = arrive = max(t, st.uplink_free[i]) + self.link.transfer_seconds(push.nbytes, 1)
            st.awaiting[i][push.fragment] = True
            st.in_flight[self.schedule(i, arrive, "push", push.fragment)] = Transfer(i, st.epoch[i], push=push)
        self.next_step(i)
        self.report(w)

    def on_push(self, i: int, t: float, seq: int, p: int) -> None:
        """Island i's push of fragment p reaches the syncer at t; it is answered once merged (or at once if
        refused)."""
        st = self.st
        msg = st.in_flight.pop(seq)
        if msg.epoch != st.epoch[i]:  # the island failed while it was on the wire: lost (tokens counted then)
            st.lost_pushes += 1
            return
        # owned: IslandWorker.push made this Δ for this push alone, so the syncer buffers it without a copy
        result = self.syncer.push(replace(msg.push, round_s=t - st.pulled_at[i][p], credential=self.credentials[i]),  # type: ignore[type-var]
                                  now=t, owned=True)
        st.last_arrival = max(st.last_arrival, t)
        self.log_push(i, p, t, result.accepted, result.reason, self.workers[i].steps)
        waiter = Waiter(i, msg.epoch, msg.push.base_version)  # type: ignore[union-attr]  # the version it holds
        if result.accepted:
            st.waiting[p].append(waiter)
            self.answer(p, t)  # if it completed a quorum: everyone in the merge gets the new global fragment
        else:  # refused (invalid or stale): answered at once with the global fragment as it is
            self.send_pull(p, t, [waiter])

    def on_pull(self, i: int, t: float, seq: int, p: int) -> None:
        """The answer to island i's push of fragment p arrives at t: adopt it, keeping the work done since."""
        st = self.st
        msg = st.in_flight.pop(seq)
        if msg.epoch != st.epoch[i]:
            return
        self.workers[i].adopt(msg.pull)  # type: ignore[arg-type]
        st.bytes_received[i] += msg.pull.nbytes  # type: ignore[union-attr]
        st.awaiting[i][p] = False
        st.pulled_at[i][p] = t

    def on_fail(self, i: int, t: float, seq: int, p: int) -> None:
        """Island i fails at t: its un-pushed work and its pushes on the wire are lost; it rejoins later."""
        st = self.st
        st.failures[i] += 1
        st.failed_at[i] = t
        lost = self.workers[i].lose_work() + self.on_the_wire(i)  # pushes still on the wire die with the island
        st.lost_tokens += lost
        st.lost_by_island[i] += lost
        st.epoch[i] += 1
        st.awaiting[i] = [False] * self.syncer.fragments
        self.run.events.log("failure", st.done // self.K, island=i, sim_wall_s=t, lost_tokens=lost)
        _, up = self.trace.next_outage(i, t)  # type: ignore[union-attr]
        st.clock[i] = t
        self.schedule(i, up, "rejoin")

    def on_rejoin(self, i: int, t: float, seq: int, p: int) -> None:
        """Island i is back at t: it pulls every global fragment (blocking), then trains on."""
        st, syncer = self.st, self.syncer
        if st.started >= self.budget:
            return  # the run is over: the island stays down
        self.workers[i].rejoin(syncer.pulled_params(), [syncer.version(q) for q in range(syncer.fragments)])
        syncer.rejoin(i)  # a new session: it may push from the versions of its pushes before the failure
        st.clock[i] = t + self.link.transfer_seconds(sum(self.frag_bytes), 1)  # nothing to train on yet
        st.bytes_received[i] += sum(self.frag_bytes)  # the whole model, float32
        st.uplink_free[i] = st.downlink_free[i] = st.clock[i]
        st.pulled_at[i] = [st.clock[i]] * syncer.fragments
        st.rejoin_s.append(st.clock[i] - st.failed_at[i])  # type: ignore[operator]
        st.rejoins[i] += 1
        self.run.events.log("rejoin", st.done // self.K, island=i, sim_wall_s=st.clock[i], rejoin_s=st.rejoin_s[-1])
        self.next_step(i)

    # --- the syncer's answers ------------------------------------------------------------------------
    def send_pull(self, p: int, t: float, waiters: list[Waiter], merged: bool = False) -> None:
        """Send the global fragment p as it is at time t to each waiting island, over its downlink (``merged``:
        the answer to its push's merge, which says how far behind it arrived, with ``realign_pushes``)."""
        st = self.st
        pulls: dict[int, Pull] = {}  # by the version the island holds (pull_codec: the changes since it)
        for m in waiters:
            i = m.island
            if m.version not in pulls:
                pulls[m.version] = self.syncer.pull(p, m.version)
            pull = pulls[m.version]
            st.downlink_free[i] = arrive = (max(t, st.downlink_free[i])
                                            + self.link.transfer_seconds(pull.nbytes, 1))
            mine = replace(pull, realign=self.syncer.take_behind(i, p)) if merged and self.syncer.realign else pull
            st.in_flight[self.schedule(i, arrive, "pull", p)] = Transfer(i, m.epoch, pull=mine)

    def close_windows(self, at: float, flush: bool = False) -> None:
        """Merge the buffers whose grace window has closed by ``at`` (``flush``: every open buffer) and
        answer the islands whose pushes they held."""
        if flush:
            self.syncer.flush()
        else:
            self.syncer.poll(at)
        for q in range(self.syncer.fragments):
            self.answer(q, at)

    def answer(self, p: int, t: float) -> None:
        """Fragment p's buffer was merged (or emptied) by time t: answer every island whose push it held."""
        st = self.st
        self.log_syncer(t)
        if not self.syncer.buffers[p].pushes and st.waiting[p]:
            waiters, st.waiting[p] = st.waiting[p], []
            self.send_pull(p, t, [m for m in waiters if m.epoch == st.epoch[m.island]], merged=True)

    # --- events, checkpoints and the end -----------------------------------------------------------------
    def log_push(self, i: int, p: int, t: float, accepted: bool, reason: str | None, island_step: int) -> None:
        """A ``push`` run event (:mod:`atoll.job.timeline`), and the syncer's merges and refusals since."""
        outcome = "accepted" if accepted else "stale" if reason == "stale" else "refused"
        self.run.events.log("push", self.st.done // self.K, island=i, fragment=p, sim_wall_s=t, outcome=outcome,
                           island_step=island_step)
        self.log_syncer(t)

    def log_syncer(self, t: float) -> None:
        """The syncer's merges and refusals since the last call, as run events (the mean step of now), and
        each merge's participation: the islands it held over the islands alive then (not down for a failure;
        the run's ``participation`` is the mean over merges, ``merges_all_live`` those that held them all)."""
        st = self.st
        records = self.syncer.journal.drain()
        alive = sum(1 for i in range(self.K) if st.failed_at[i] is None or st.clock[i] > st.failed_at[i])
        for r in records:
            if isinstance(r, Merged):
                st.merges_seen += 1
                st.participation_sum += min(1.0, len(r.islands) / max(1, alive))
                st.merges_all_live += len(r.islands) >= alive
        for event, fields in syncer_events(records):
            self.run.events.log(event, st.done // self.K, **fields)

    def on_the_wire(self, i: int) -> float:
        """Tokens (times fragment share) of island i's pushes on the wire in its present epoch."""
        return sum((m.push.tokens * self.job.shares[m.push.fragment] for m in self.st.in_flight.values()
                    if m.island == i and m.epoch == self.st.epoch[i] and m.push is not None), 0.0)

    def report(self, w: IslandWorker) -> None:
        """The ``train``/``eval`` events and checkpoints due after a finished inner step."""
        st, facts, run, K = self.st, self.facts, self.run, self.K
        tps = facts.tokens_per_step
        if st.done % (K * LOG_EVERY) == 0:
            run.log_train(st.done // K, st.done * tps, sum(st.last_loss) / K, sum(st.bytes_sent) / K, max(st.clock),
                          w.island.scheduler.get_last_lr()[0], island_loss=list(st.last_loss),
                          island_bytes_sent=list(st.bytes_sent), island_steps=[w.steps for w in self.workers],
                          bytes_received_per_island=sum(st.bytes_received) / K,
                          island_bytes_received=list(st.bytes_received))
            run.events.note_resets(st.done // K, resets := [w.island.reset_count for w in self.workers], max(st.clock))
            check_resets(st.done // K, sum(resets), K)
        eval_loss = None
        if st.done % (K * facts.evaluate_every) == 0 and st.done < self.budget:
            eval_loss = run.log_eval(int(st.done / K), st.done * tps, self.syncer.global_params(),
                                     sum(st.bytes_sent) / K, max(st.clock), sum(st.bytes_received) / K)
            check_eval(st.done // K, eval_loss, run.data.vocab_size)
        if checkpointed := (facts.checkpoint_every and st.done % (K * facts.checkpoint_every) == 0
                            and st.done < self.budget):
            self.checkpoint(st.done // K)
        if st.done % K == 0 and st.done < self.budget:  # once per mean inner step; the last one: finish()
            self.show_progress(eval_loss, max(st.clock))
        if stop.requested() is not None and st.done < self.budget:  # SIGINT/SIGTERM (atoll.job.stop): this
            if not checkpointed:  # event's state is whole, as at a periodic checkpoint (written once); then stop
                self.checkpoint(st.done // K)
            raise self.run.interrupt(st.done // K)

    def show_progress(self, eval_loss: float | None, now: float) -> None:
        """The progress line at the mean step done: goodput so far (merged tokens by simulated second ``now``)."""
        if self.bar is None:
            return
        st, K = self.st, self.K
        stepped = [x for x in st.last_loss if not math.isnan(x)]  # islands that have not stepped: no loss yet
        self.bar.update(st.done // K, sum(stepped) / len(stepped) if stepped else None,
                        (st.done - K * self.run.start_step) * self.facts.tokens_per_step
                        / max(1e-9, self.run.wall_s() - self.run.prior_wall_s), sum(st.bytes_sent) / K,
                        eval_loss=eval_loss, detail=progress_detail(
                            [w.steps for w in self.workers], self.syncer.commits, self.syncer.staleness.recent,
                            self.syncer.merged_tokens / now / self.ideal_rate if now > 0 else None,
                            [i for i in range(K) if st.failed_at[i] is not None and st.clock[i] <= st.failed_at[i]]),
                        bytes_received=sum(st.bytes_received) / K)

    def checkpoint(self, step: int) -> None:
        """Everything to continue exactly: syncer, islands, clocks and pending events (atomic)."""
        self.syncer.save(save_path(self.run.out))
        self.run.save_checkpoint(step, {"strategy": "decoupled", "syncer": self.syncer.state_dict(),
                                        "islands": [w.state_dict() for w in self.workers],
                                        "sim": self.st.state_dict()}, self.syncer.global_params())

    def finish(self) -> dict[str, Any]:
        """Every live island pushes what it has not pushed, the syncer merges every buffer; the summary."""
        st, syncer, facts, K, tps = self.st, self.syncer, self.facts, self.K, self.facts.tokens_per_step
        alive = [i for i in range(K) if st.failed_at[i] is None or st.clock[i] > st.failed_at[i]]
        for i in sorted(alive if self.diverged is None else [], key=lambda j: (st.clock[j], j)):
            w = self.workers[i]
            for p in range(syncer.fragments):
                if w.tokens_since[p] > 0:
                    push = replace(w.push(p), session=syncer.admission.session[i])
                    st.bytes_sent[i] += push.nbytes
                    st.uplink_free[i] = arrive = (max(st.clock[i], st.uplink_free[i])
                                                  + self.link.transfer_seconds(push.nbytes, 1))
                    result = syncer.push(replace(push, round_s=arrive - st.pulled_at[i][p],
                                                 credential=self.credentials[i]), now=arrive, owned=True)
                    st.last_arrival = max(st.last_arrival, arrive)
                    self.log_push(i, p, arrive, result.accepted, result.reason, w.steps)
        syncer.flush()
        self.log_syncer(st.last_arrival)
        for i in alive:  # every live island takes the final global fragments, as a pull would: a run continued with
            for p in range(syncer.fragments):  # a longer --steps must not push its final work a second time
                self.workers[i].adopt(syncer.pull(p, self.workers[i].base_version[p]))
        sim_wall_s = max([st.last_arrival] + ([st.clock[i] for i in alive] or [max(st.clock)]))
        self.run.events.note_resets(st.done // K, [w.island.reset_count for w in self.workers], sim_wall_s)
        # a finished run resumed with no more steps: its final eval and checkpoint are in the log already
        again = self.restored_done is not None and st.done == self.restored_done and self.run.start_step == facts.steps
        final_eval = None if again else self.run.log_eval(facts.steps, st.done * tps, syncer.global_params(),
                                                          sum(st.bytes_sent) / K, sim_wall_s,
                                                          sum(st.bytes_received) / K)
        self.show_progress(final_eval, sim_wall_s)  # the last line: after the final merges, as the summary
        if self.diverged is None and not again:  # a diverged run keeps its last good checkpoint
            self.checkpoint(facts.steps)
        stats = syncer.stats()  # the syncer's token buckets, and the run's: lost, on the wire (if it gave up)
        buckets = token_buckets(stats, [w.steps * tps for w in self.workers], st.lost_by_island,
                                [self.on_the_wire(i) for i in range(K)])
        return self.run.finish(
            tokens=st.done * tps, bytes_sent_per_island=sum(st.bytes_sent) / K,
            bytes_received_per_island=sum(st.bytes_received) / K, compute_s=max(st.compute),
            sim_wall_s=sim_wall_s, bytes_sent_by_island=st.bytes_sent, bytes_received_by_island=st.bytes_received,
            fragments=self.own.fragments, overlap_steps=0,
            exchanges=stats["accepted_updates"],
            peak_bytes_per_exchange=float(max(self.frag_bytes)) if self.own.codec == "fp32" else None,
            **stats, skipped_steps=sum(w.island.skipped_steps for w in self.workers),
            island_speeds=self.speeds, sim_step_s=self.own.sim_step_s, chaos=self.own.chaos,
            steps_per_island=[w.steps for w in self.workers], deferred_pushes=st.deferred_pushes,
            lost_pushes=st.lost_pushes,
            participation=st.participation_sum / st.merges_seen if st.merges_seen else None,
            merges_all_live=st.merges_all_live, realign_pushes=self.own.realign_pushes,
            useful_tokens=syncer.merged_tokens, lost_tokens=st.lost_tokens,
            goodput=syncer.merged_tokens / sim_wall_s / self.ideal_rate if sim_wall_s > 0 else 1.0,
            island_utilization=[c / sim_wall_s if sim_wall_s > 0 else 1.0 for c in st.compute],
            failures=st.failures, rejoins=st.rejoins, rejoin_s=st.rejoin_s,
            down_at_end=[i for i in range(K) if i not in alive], gave_up=self.gave_up, **buckets,
            **({"starved_islands": syncer.starved(), "starved": self.starved} if self.starved else {}),
            measured_compute_s=[w.island.compute_s for w in self.workers], eval_s=self.evaluator.seconds,
            codec_s=[w.wire.codec_s[0] for w in self.workers],
            timeline=True,
            **island_extras(self.own, self.lr_schedule, [w.island for w in self.workers], self.diverged))


def train_simulated(config: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Run an asynchronous (decoupled) job as a discrete-event simulation in this process; return its summary.

    Writes the usual run folder: metrics.jsonl (with the run events: pushes, merges, refusals, failures,
    rejoins, resets), summary.json, report.png, timeline.png (:mod:`atoll.job.timeline`), config.json,
    checkpoints/ (the global model and the whole simulation) and syncer/ (the syncer's state alone). Progress
    (steps per island, merges, staleness, goodput so far) is shown as for every run (``--progress``).
    """
    run = Run(config, resume)
    sim = Simulation.of_run(config, run)
    run.evaluator = sim.evaluator  # on the islands' device (island 0's), as lockstep runs
    run.begin(restore=sim.restore)
    with ProgressDisplay(config.steps, run.start_step, config.progress, every=config.progress_every) as sim.bar:
        sim.diverged = until_diverged(sim.run_events, resume)  # a diverged job stops; its summary says where
        return sim.finish()
