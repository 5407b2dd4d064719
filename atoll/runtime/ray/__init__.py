"""The ``ray`` runtime of ``decoupled``: the syncer and every island as Ray actors, on real clocks.

Launch::

    atoll train --strategy decoupled --runtime ray --islands 4            # starts a local Ray by itself
    ray start --head --port 6379                                           # or: a cluster, on the head node
    ray start --address HEAD_IP:6379                                       # on every other node
    atoll train --strategy decoupled --runtime ray --ray-address HEAD_IP:6379 --islands 8

The driver (this process) prepares the data and the initial model, then starts one :class:`SyncerActor`
(holding the :class:`~atoll.syncer.Syncer`, on the CPU, 0 CPUs reserved) and ``islands`` island actors
(each ``ray_cpus_per_island`` CPUs, ``ray_gpus_per_island`` GPUs; Ray places them on the cluster). Every
island runs :meth:`~atoll.strategies.decoupled.island.IslandWorker.run` (the learner's loop) at its own pace: inner
steps, then on the fragment schedule a push to the syncer and a pull of the newest global fragment, which it adopts when
it arrives while it trains on (communication overlaps compute). Nobody waits for another island. The syncer
merges a quorum at once, and closes a buffer's grace window (a multiple of the measured round time) on the
next call it receives; it checkpoints itself atomically after every merge
(``<out>/syncer/``), so no committed outer step is lost.

Failures: island actors are created with ``max_restarts``; a killed island process (SIGKILL, a lost node)
is restarted by Ray, pulls the newest global parameters from the syncer, and rejoins with a fresh inner
optimizer; its un-pushed work is lost. The driver re-issues the island's ``run`` call, which failed with
the process. When a node dies, Ray restarts its islands on another node that has the resources they ask
for; an island that no live node can run (:func:`~atoll.runtime.ray.cluster.placeable`) is reported lost
once Ray declares the node dead (one warning line, ``lost_islands``), and the others go on without it; so is
an island whose process died for good (its start raised, which Ray does not restart, or its restarts are used
up), with its cause in the line. When every island died so, the run fails in one line naming each cause.
Once one island has finished (the step budget is spent), the others must finish within
``collective_timeout_s``; a hung island is then killed and reported (``abandoned_islands``), so a run never
waits forever. The syncer's ``rejoin_s`` is the time from the island's last call before it died to its first
pull after the restart.

The syncer actor runs on the driver's node, beside the run folder (Ray would place an actor of 0 CPUs on any
node, and a worker node's loss would take it). It has ``max_restarts`` too: a syncer process that dies is
restarted by Ray from its last atomic checkpoint (``<out>/syncer/``, written at every commit with the shared step
budget), so no committed outer step is lost (``syncer_restarts`` in the summary). The islands' calls wait for it and are
retried (``max_task_retries``); pushes buffered after its last commit are lost with it, and the steps granted since
that checkpoint are granted again, so the run may take a few more inner steps than its budget.

The run's clock (``sim_wall_s``, and the ``island_utilization`` and ``goodput`` measured on it) starts at the
first inner step any island takes and stops when the syncer has merged the last push; it is the syncer
process's clock. What came before (preparing the data, starting Ray, creating the actors, each of which
prepares the data and the model again) is reported apart as ``startup_s``: this process's seconds from the
start of the run to the first inner step (its wall time when the syncer finished, minus the run's clock,
so within one call's latency). ``island_start_s``: per island, seconds from the first inner step to its own
(an island whose actor started later). ``codec_s``: per island, measured seconds of encoding and decoding its
pushes (part of the wall time, not of ``compute_s``).

Identity: the driver issues each island a secret (:func:`secrets.token_hex`), given to that island's actor and
to the syncer only; its pushes carry it and the syncer counts a push only as the island whose secret it
carries, and lets only that island open a new session or take an inner step (``reserve_step``, which grants
the step's tokens to the island in the syncer's token ledger: its claims are bounded by them)
(:mod:`atoll.strategies.decoupled.trust`; docs/security.md). Ray's token authentication (on by default in Ray 2.60) is
left on; joining a cluster needs its token as ``ray start`` documents. Ray is imported only by this module, which
``atoll train`` imports only for ``--runtime ray``. A local Ray gets this process's ``PYTHONPATH`` plus the folder atoll
is imported from, and ``OMP_NUM_THREADS`` (``--threads``, default 1), so its workers import the same atoll.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from atoll.config import TrainConfig
from atoll.config.facts import RunFacts
from atoll.errors import ConfigError, RunFailed
from atoll.job import stop
from atoll.job.device import resolve_device
from atoll.job.divergence import Diverged, check_eval, check_resets, record
from atoll.job.evaluation import GlobalEvaluator
from atoll.job.metrics import ProgressDisplay, status
from atoll.job.run import Run
from atoll.runtime.ray.actors import MAX_RESTARTS, IslandService, SyncerService
from atoll.runtime.ray.cluster import (
    IslandLost,
    check_ray_address,
    check_resources,
    init_ray,
    island_demand,
    island_resources,
    wait_restarted,
)
from atoll.runtime.ray.report import RayReport
from atoll.runtime.ray.watch import Watch

__all__ = ["IslandLost", "check_ray_address", "island_resources", "train_ray"]

STOP_POLL_S = 0.5  # seconds between two looks for a stop request while the driver waits for the islands
#: the syncer's and the islands' actors run at the driver's priority. Ray starts its workers at nice 15
#: (``RAY_worker_niceness``) so that its raylet stays responsive; an island actor at nice 15 is starved by any
#: busy process of nice 0 on its node, where it is the run's training (measured: docs/runtimes.md). Ray's job
#: supervisor does the same for itself. Merged with the job's own environment variables.
ACTOR_RUNTIME_ENV: dict[str, Any] = {"env_vars": {"RAY_worker_niceness": "0"}}


def _run_actors(config: TrainConfig, run: Run,
                bar: ProgressDisplay) -> tuple[dict[str, Any], dict[int, dict[str, Any]], list[int]]:
    """Start the syncer and the islands, re-run an island whose process died, until the budget is spent."""
    out, own = run.out.resolve(), config.runtime_config  # (own: the RayConfig)
    cfg = config.model_dump_json()
    # one secret per island, given to that island's actor and to the syncer only: a push counts only as its own
    credentials = [secrets.token_hex(16) for _ in range(config.islands)]
    # a crashed syncer is restarted by Ray from its last checkpoint; the islands' calls wait and are retried. It
    # runs on this process's node, beside the run folder that holds its checkpoints (<out>/syncer); Ray would
    # place an actor of 0 CPUs on any node, even with a soft affinity, and a worker node's loss would take it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    syncer = ray.remote(num_cpus=0, max_restarts=MAX_RESTARTS, max_task_retries=-1, scheduling_strategy=here,
                        runtime_env=ACTOR_RUNTIME_ENV)(SyncerService).remote(cfg, str(out), credentials)
    island_cls = ray.remote(num_cpus=own.ray_cpus_per_island, num_gpus=own.ray_gpus_per_island,
                            max_restarts=MAX_RESTARTS, max_task_retries=0, runtime_env=ACTOR_RUNTIME_ENV)(IslandService)
    islands = [island_cls.options(resources=res).remote(cfg, i, syncer, str(out), credentials[i]) if res else
               island_cls.remote(cfg, i, syncer, str(out), credentials[i])
               for i, res in enumerate(island_resources(own, config.islands))]
    running = {isl.run.remote(): i for i, isl in enumerate(islands)}
    results: dict[int, dict[str, Any]] = {}
    failures = [0] * config.islands
    abandoned: list[int] = []
    lost: list[int] = []  # islands whose node died and that no live node can run, or that died for good
    died: dict[int, str] = {}  # of those, the ones whose process died for good -> why (one line)
    starved = ""
    # no wait on Ray without a deadline: between short waits for the islands, the syncer must answer within
    # collective_timeout_s (else it is killed and restarted from its checkpoint) and every island must have
    # called it within as long (else it is killed and restarted): atoll.runtime.ray.watch
    watch = Watch(syncer, islands, out, own.collective_timeout_s)
    report = RayReport(RunFacts.of(config), run, bar)
    first_done: float | None = None  # when the first island finished or a stop was asked: the others then
    stopping = False  # have the deadline. SIGINT/SIGTERM (atoll.job.stop): the syncer grants no more steps
    while running:
        if not stopping and stop.requested() is not None:
            stopping = True
            first_done = first_done if first_done is not None else time.monotonic()
            with contextlib.suppress(ray.exceptions.GetTimeoutError):
                ray.get(syncer.stop.remote(), timeout=own.collective_timeout_s)
        ready = _wait_one(list(running), watch.poll_s, stopping)
        if not ready:
            if not stopping and stop.requested() is not None:
                continue  # asked to stop while waiting: tell the syncer first
            progress = watch.call("progress")
            report.show(progress)
            if progress["starved"]:  # an island's work never reaches the model: stop rather than train on
                starved = progress["starved"]
                print(f"atoll: warning: {starved}; stopping the islands", file=sys.stderr)
                for i in running.values():
                    ray.kill(islands[i], no_restart=True)
                break
            for i in watch.silent_islands(progress, set(running.values())):
                watch.kill_island(i)  # its run call fails: restarted below like a crashed island
            # the others' deadline runs from the first finish, and again from a silent island's restart
            since = max([first_done] + [k for k in watch.killed_at if k is not None]) if first_done else None
            if since is not None and time.monotonic() - since > own.collective_timeout_s:
                for i in running.values():  # hung islands: stop waiting for them (their un-pushed work is lost)
                    abandoned.append(i)
                    ray.kill(islands[i], no_restart=True)
                print(f"atoll: warning: islands {sorted(abandoned)} did not finish within "
                      f"{own.collective_timeout_s:g} s of the others; their un-pushed work is lost", file=sys.stderr)
                break
            continue
        i = running.pop(ready[0])
        try:
            results[i] = ray.get(ready[0])
            first_done = first_done if first_done is not None else time.monotonic()
        except ray.exceptions.RayTaskError:  # the island's code raised (e.g. the syncer died for good): its
            raise                            # process lives, so running it again would fail again at once
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            failures[i] += 1  # the process died: Ray restarts the actor, which rejoins; run it again
            report.failure(i)
            try:
                wait_restarted(islands[i], island_demand(own, config.islands, i))
            except IslandLost as e:  # its node died and no other can run it: the others go on without it
                lost.append(i)
                ray.kill(islands[i], no_restart=True)
                print(f"atoll: warning: island {i} lost its node and cannot be restarted ({e}); the other islands "
                      "go on without it, its un-pushed work is lost", file=sys.stderr)
                continue
            except ray.exceptions.ActorDiedError as e:  # its start raised (Ray does not restart it) or its
                lost.append(i)                          # restarts are used up: the others go on without it
                died[i] = _cause(e)
                print(f"atoll: warning: island {i} died and cannot be restarted ({died[i]}); the other islands go on "
                      "without it, its un-pushed work is lost", file=sys.stderr)
                continue
            running[islands[i].run.remote()] = i
    if not results and died:  # no island trained: nothing to finish (a start that raises on every node)
        why = "; ".join(f"island {i}: {cause}" for i, cause in sorted(died.items()))
        raise RunFailed(f"error: every island died and cannot be restarted ({why})", 1)
    final = watch.call("finish")
    report.show(watch.call("progress"))  # the run events of the final merges
    final["abandoned"], final["lost"], final["starved"] = sorted(abandoned), sorted(lost), starved
    return final, results, failures


def _wait_one(refs: list[Any], limit_s: float | None, stopping: bool) -> list[Any]:
    """``ray.wait`` for one of ``refs`` within ``limit_s`` seconds (None: no limit); returns [] at the limit, or
    as soon as a stop is asked (:mod:`atoll.job.stop`) while not ``stopping`` yet."""
    t0 = time.monotonic()
    while True:
        left = None if limit_s is None else limit_s - (time.monotonic() - t0)
        if left is not None and left <= 0:
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=STOP_POLL_S if left is None else min(STOP_POLL_S, left))
        if ready or (not stopping and stop.requested() is not None):
            return ready


def evaluation_device(config: TrainConfig) -> torch.device:
    """Where the driver evaluates the global model: ``config.device`` when this node has it (``auto``: its GPU
    when it has one), as the islands compute; else the CPU, said in one line (the islands' nodes may have a
    device the driver's node lacks)."""
    try:
        return torch.device(resolve_device(config.device))
    except ConfigError:
        print(f"atoll: note: this node has no {config.device} device; the driver evaluates the global model on "
              "the CPU", file=sys.stderr)
        return torch.device("cpu")


def train_ray(config: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Run a ``decoupled`` job on Ray (local, or the cluster at ``ray_address``); return its summary.

    Raises:
        ConfigError: ``resume`` (only the syncer's state is saved), or no Ray cluster at ``ray_address``.
    """
    if resume:
        raise ConfigError("resume: a decoupled run on Ray cannot be resumed (only its syncer state is saved, under "
                          "<out>/syncer); start a new run from its final model with --init-from RUN_DIR")
    own = config.runtime_config  # the RayConfig: the cluster, the islands' resources, the deadline
    check_ray_address(own.ray_address)  # before any folder is made
    started = init_ray(own, config.islands, config.threads)
    stop.reinstall()  # ray.init sets a SIGTERM handler that exits: a signal checkpoints the run instead
    try:
        check_resources(own, config.islands)  # islands no node can run are refused here, not queued by Ray forever
        run = Run(config)  # fills the tokenizer and token caches before the actors read them
        # the global model, moved to the device for each evaluation
        run.evaluator = evaluator = GlobalEvaluator(run.model, run.val, evaluation_device(config), config.precision)
        run.begin()
        if config.progress:
            status(f"starting {config.islands} island actors (each prepares the data and the model; progress "
                   "follows from the first inner step)")
        with ProgressDisplay(config.steps, 0, config.progress, every=config.progress_every) as bar:
            final, results, failures = _run_actors(config, run, bar)
        driver_s = run.wall_s()  # when the syncer finished (within one call's latency), before Ray shuts down
    finally:
        if started:
            ray.shutdown()
    # the run's clock: from the first inner step (the syncer's clock); what came before is start-up
    wall_s = final["run_s"]
    startup_s = max(0.0, driver_s - wall_s)
    tps = config.tokens_per_step
    tokens = sum(final["steps_by_island"]) * tps
    idle = {"steps": 0, "compute_s": 0.0, "bytes_sent": 0.0, "bytes_received": 0.0, "codec_s": 0.0}
    res = [results.get(i, idle) for i in range(config.islands)]
    bytes_sent = [r["bytes_sent"] for r in res]
    bytes_received = [r["bytes_received"] for r in res]
    if stop.requested() is not None:  # the islands finished the steps granted: a checkpoint of them, then stop
        step = sum(final["steps_by_island"]) // config.islands
        run.log_eval(step, tokens, final["global"], sum(bytes_sent) / config.islands, wall_s,
                     sum(bytes_received) / config.islands)
        run.save_checkpoint(step, {"strategy": "decoupled", "versions": final["versions"]}, final["global"])
        raise run.interrupt(step, advice=f"a run on Ray cannot be resumed: continue from it with 'atoll train "
                                         f"--init-from {run.out}' (its global model)")
    loss = run.log_eval(config.steps, tokens, final["global"], sum(bytes_sent) / config.islands, wall_s,
                        sum(bytes_received) / config.islands)
    resets = [int(r.get("resets", 0)) for r in res]  # the islands reset themselves (atoll.job.divergence)
    run.events.note_resets(config.steps, resets, wall_s)
    diverged: Diverged | None = None  # checked at the end only: the driver sees the islands when they finish
    try:
        check_resets(config.steps, sum(resets), config.islands)
        check_eval(config.steps, loss, run.data.vocab_size)
    except Diverged as e:
        diverged = e
    if diverged is None:  # a diverged run's model is not saved
        run.save_checkpoint(config.steps, {"strategy": "decoupled", "versions": final["versions"]}, final["global"])
    step_rate = sum(r["steps"] / r["compute_s"] for r in res if r["compute_s"] > 0)  # failure-free steps/s
    return run.finish(
        tokens=tokens, bytes_sent_per_island=sum(bytes_sent) / config.islands,
        bytes_received_per_island=sum(bytes_received) / config.islands,
        compute_s=max(r["compute_s"] for r in res), sim_wall_s=wall_s,
        bytes_sent_by_island=bytes_sent, bytes_received_by_island=bytes_received,
        fragments=config.strategy_config.fragments, **final["stats"],
        steps_per_island=final["steps_by_island"], useful_tokens=final["merged_tokens"],
        # measured: useful tokens per second of wall time over the islands' summed failure-free step rate
        goodput=final["merged_tokens"] / wall_s / (step_rate * tps) if step_rate > 0 and wall_s > 0 else None,
        island_utilization=[r["compute_s"] / wall_s if wall_s > 0 else 0.0 for r in res], failures=failures,
        rejoins=[j - 1 for j in final["joins"]], rejoin_s=final["rejoin_s"], versions=final["versions"],
        abandoned_islands=final["abandoned"], lost_islands=final["lost"], syncer_restarts=final["syncer_restarts"],
        island_resources=island_resources(own, config.islands), island_nodes=[r.get("node_id") for r in res],
        startup_s=startup_s, island_start_s=final["island_start_s"], codec_s=[r["codec_s"] for r in res],
        eval_s=evaluator.seconds,
        skipped_steps=sum(int(r.get("skipped_steps", 0)) for r in res),
        timeline=True, **({"island_resets": resets} if any(resets) else {}),
        **({"starved": final["starved"]} if final["starved"] else {}),
        **({"diverged": record(config.strategy_config, config, diverged)} if diverged is not None else {}))


def _cause(error: Exception) -> str:
    """The one line that says why a Ray actor died: the last line of Ray's message (the raised exception's
    type and message, after Ray's traceback), at most 300 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]
