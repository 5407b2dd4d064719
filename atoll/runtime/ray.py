"""The ``ray`` runtime of ``decoupled``: the syncer and every island as Ray actors, on real clocks.

Launch::

    atoll train --strategy decoupled --runtime ray --islands 4            # starts a local Ray by itself
    ray start --head --port 6379                                           # or: a cluster, on the head node
    ray start --address HEAD_IP:6379                                       # on every other node
    atoll train --strategy decoupled --runtime ray --ray-address HEAD_IP:6379 --islands 8

The driver (this process) prepares the data and the initial model, then starts one :class:`SyncerActor`
(holding the :class:`~atoll.syncer.Syncer`, on the CPU, 0 CPUs reserved) and ``islands`` island actors
(each ``ray_cpus_per_island`` CPUs, ``ray_gpus_per_island`` GPUs; Ray places them on the cluster). Every
island runs :meth:`~atoll.strategies.decoupled.island.IslandWorker.run` (the learner's loop) at its own pace: inner steps, then on the
fragment schedule a push to the syncer and a pull of the newest global fragment, which it adopts when it
arrives while it trains on (communication overlaps compute). Nobody waits for another island. The syncer
merges a quorum at once, and closes a buffer's grace window (a multiple of the measured round time) on the
next call it receives; it checkpoints itself atomically after every merge
(``<out>/syncer/``), so no committed outer step is lost.

Failures: island actors are created with ``max_restarts``; a killed island process (SIGKILL, a lost node)
is restarted by Ray, pulls the newest global parameters from the syncer, and rejoins with a fresh inner
optimizer; its un-pushed work is lost. The driver re-issues the island's ``run`` call, which failed with
the process. Once one island has finished (the step budget is spent), the others must finish within
``collective_timeout_s``; a hung island is then killed and reported (``abandoned_islands``), so a run never
waits forever. The syncer's ``rejoin_s`` is the time from the island's last call before it died to its first
pull after the restart.

The syncer actor has ``max_restarts`` too: a syncer process that dies is restarted by Ray from its last
atomic checkpoint (``<out>/syncer/``, written at every commit with the shared step budget), so no committed
outer step is lost (``syncer_restarts`` in the summary). The islands' calls wait for it and are retried
(``max_task_retries``); pushes buffered after its last commit are lost with it, and the steps granted since
that checkpoint are granted again, so the run may take a few more inner steps than its budget.

Ray's token authentication (on by default in Ray 2.60) is left on; joining a cluster needs its token as
``ray start`` documents. Ray is imported only by this module, which ``atoll train`` imports only for
``--runtime ray``. A local Ray gets this process's ``PYTHONPATH`` plus the folder atoll is imported from,
and ``OMP_NUM_THREADS`` (``--threads``, default 1), so its workers import the same atoll.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

from atoll.config import TrainConfig
from atoll.errors import ConfigError
from atoll.job.run import Run
from atoll.strategies.decoupled import make_syncer
from atoll.strategies.decoupled.island import IslandWorker, Job, expected_steps, save_path
from atoll.strategies.decoupled.protocol import Pull, Push

#: how often an island actor may be restarted after its process died
MAX_RESTARTS = 4


class SyncerService:
    """The syncer as a Ray actor: pushes, pulls, the shared step budget and atomic checkpoints.

    Args:
        config_json: the run's :class:`TrainConfig` as JSON.
        out: the run folder (checkpoints go to ``out/syncer``).
    """

    def __init__(self, config_json: str, out: str) -> None:
        from atoll.errors import CheckpointError
        from atoll.job.checkpoint import latest_checkpoint, load_checkpoint

        self.config = TrainConfig.model_validate_json(config_json)
        torch.set_num_threads(1)
        job = Job.prepare(self.config)
        self.syncer = make_syncer(self.config, job.init_flat, job.index)
        self.out = Path(out)
        self.t0 = time.monotonic()
        self.budget = self.config.islands * self.config.steps
        self.reserved = 0
        self.steps_by_island = [0] * self.config.islands
        self.last_seen = [0.0] * self.config.islands
        self.joins = [0] * self.config.islands
        self.rejoin_s: list[float] = []
        self.restarts = 0
        try:  # a restart after a crash: continue from the last checkpoint (written at every commit)
            _, state = load_checkpoint(latest_checkpoint(save_path(self.out)))
        except CheckpointError:
            state = None
        if state is not None:
            self.syncer.load_state_dict(state["syncer"])
            service = state.get("service", {})
            self.reserved = int(service.get("reserved", 0))
            self.steps_by_island = [int(x) for x in service.get("steps_by_island", self.steps_by_island)]
            self.joins = [int(x) for x in service.get("joins", self.joins)]
            self.rejoin_s = [float(x) for x in service.get("rejoin_s", [])]
            self.restarts = int(service.get("restarts", 0)) + 1
            # continue the checkpoint's clock: restored buffers' grace windows (opened_at) are on it
            self.t0 = time.monotonic() - float(service.get("clock_s", 0.0))
        pid_dir = self.out / "ray"
        pid_dir.mkdir(parents=True, exist_ok=True)
        (pid_dir / ".syncer.pid.tmp").write_text(str(os.getpid()))
        os.replace(pid_dir / ".syncer.pid.tmp", pid_dir / "syncer.pid")

    def _save(self) -> None:
        """Checkpoint the syncer and the shared budget atomically (``out/syncer``)."""
        self.syncer.save(save_path(self.out), extra={"service": {
            "reserved": self.reserved, "steps_by_island": self.steps_by_island, "joins": self.joins,
            "rejoin_s": self.rejoin_s, "restarts": self.restarts, "clock_s": self._now()}})

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _poll(self) -> None:
        if self.syncer.poll(self._now()):
            self._save()

    def join(self, island: int) -> tuple[torch.Tensor, list[int], int]:
        """An island (re)starts: (global params (numel,), versions, its inner steps so far)."""
        now = self._now()
        self.joins[island] += 1
        if self.joins[island] > 1:
            self.rejoin_s.append(now - self.last_seen[island])
        self.last_seen[island] = now
        self._poll()
        return (self.syncer.global_params(), [self.syncer.version(p) for p in range(self.syncer.fragments)],
                self.steps_by_island[island])

    def reserve_step(self, island: int) -> tuple[bool, list[int]]:
        """Take one inner step from the shared budget of ``islands x steps``.

        Returns (False once the budget is spent; the fragments whose buffer still holds a push of
        ``island``, see :meth:`buffered`).
        """
        self.last_seen[island] = self._now()
        self._poll()
        if self.reserved >= self.budget:
            return False, self._buffered(island)
        self.reserved += 1
        self.steps_by_island[island] += 1
        return True, self._buffered(island)

    def buffered(self, island: int) -> list[int]:
        """Fragments whose buffer holds a push of ``island`` not merged yet (closing due grace windows first)."""
        self._poll()
        return self._buffered(island)

    def _buffered(self, island: int) -> list[int]:
        return [p for p, b in enumerate(self.syncer.buffers) if any(x.island == island for x in b.pushes)]

    def push(self, msg: Push) -> tuple[bool, Pull | None]:
        """Take a push: (accepted, the answer: the global fragment, or None while the push waits in the buffer).

        The answer comes back at once when the push is merged (it completed a quorum) or refused; while it
        waits in the buffer the island pulls once :meth:`buffered` no longer lists it.
        """
        now = self._now()
        self.last_seen[msg.island] = now
        self._poll()
        result = self.syncer.push(msg, now=now)
        if result.committed:
            self._save()
        if result.accepted and msg.fragment in self._buffered(msg.island):
            return True, None
        return result.accepted, self.syncer.pull(msg.fragment)

    def pull(self, fragment: int) -> Pull:
        """The newest global fragment."""
        self._poll()
        return self.syncer.pull(fragment)

    def finish(self) -> dict[str, Any]:
        """Merge every open buffer, checkpoint, and return the statistics and the global parameters."""
        self.syncer.flush()
        self._save()
        return {"stats": self.syncer.stats(), "global": self.syncer.global_params(), "syncer_restarts": self.restarts,
                "merged_tokens": self.syncer.merged_tokens, "rejoin_s": self.rejoin_s,
                "joins": self.joins, "steps_by_island": self.steps_by_island,
                "versions": [self.syncer.version(p) for p in range(self.syncer.fragments)]}

    def progress(self) -> dict[str, Any]:
        """Commits and versions so far (for the driver and tests)."""
        self._poll()
        return {"commits": self.syncer.commits, "reserved": self.reserved,
                "versions": [self.syncer.version(p) for p in range(self.syncer.fragments)]}


class RayTransport:
    """How an island actor reaches the syncer actor (:class:`~atoll.strategies.decoupled.island.Transport`).

    A push is sent without waiting; the syncer answers it with the merged global fragment once the push is
    merged (at once if it completes a quorum; else the island learns from a later :meth:`reserve_step` that its
    push left the buffer, and pulls). At most one exchange per fragment is in progress; its stage is
    ``push`` (sent, answer not read), ``wait`` (buffered at the syncer) or ``pull`` (the merged fragment asked).
    """

    def __init__(self, syncer: Any, island: int, fragments: int) -> None:
        self.syncer, self.island = syncer, island
        self.pulled_at = [time.monotonic()] * fragments
        self.exchanges: dict[int, dict[str, Any]] = {}  # fragment -> {"stage", "ref"}
        self.buffered: list[int] = []                   # fragments whose buffer holds this island's push
        self.bytes_sent = 0.0

    def reserve_step(self) -> bool:
        go, self.buffered = ray.get(self.syncer.reserve_step.remote(self.island))
        return go

    def send(self, push: Push) -> None:
        self.bytes_sent += push.nbytes
        msg = Push(push.island, push.fragment, push.delta, push.tokens, push.base_version, push.nbytes,
                   round_s=time.monotonic() - self.pulled_at[push.fragment])
        self.exchanges[push.fragment] = {"stage": "push", "ref": self.syncer.push.remote(msg)}

    def arrived(self) -> list[Pull]:
        return self._advance(block=False)

    def settle(self, fragment: int) -> list[Pull]:
        pulls: list[Pull] = []
        while fragment in self.exchanges:  # bounded by the syncer's grace window
            self.buffered = ray.get(self.syncer.buffered.remote(self.island))
            pulls += self._advance(block=True, only=fragment)
        return pulls

    def close(self) -> None:
        ray.get([e["ref"] for e in self.exchanges.values() if e["stage"] != "wait"])  # every push reached it

    def _advance(self, block: bool, only: int | None = None) -> list[Pull]:
        """Move exchanges on: a push answered, a merge seen (no longer buffered: pull), a pull arrived."""
        pulls = []
        for p in [q for q in list(self.exchanges) if only is None or q == only]:
            e = self.exchanges[p]
            if e["stage"] == "wait":
                if p in self.buffered:
                    if block:
                        time.sleep(0.01)  # the syncer merges at the quorum or when the grace window closes
                    continue
                e["stage"], e["ref"] = "pull", self.syncer.pull.remote(p)
            ready, _ = ray.wait([e["ref"]], timeout=None if block else 0)
            if not ready:
                continue
            reply = ray.get(e["ref"])
            if e["stage"] == "push":
                _, reply = reply
                if reply is None:  # buffered: answered when merged
                    e["stage"] = "wait"
                    continue
            pulls.append(reply)
            self.pulled_at[p] = time.monotonic()
            del self.exchanges[p]
        return pulls


class IslandService:
    """One island as a Ray actor; on a restart it rejoins from the syncer's newest global parameters."""

    def __init__(self, config_json: str, index: int, syncer: Any, out: str) -> None:
        config = TrainConfig.model_validate_json(config_json)
        self.index = index
        self.syncer = syncer
        job = Job.prepare(config)
        # an island given GPUs (ray_gpus_per_island) trains on the one Ray made visible to it
        device = "cuda" if config.ray_gpus_per_island > 0 and torch.cuda.is_available() else "cpu"
        self.worker = IslandWorker(index, job, expected_steps(config)[index], device)
        flat, versions, steps = ray.get(syncer.join.remote(index))
        self.worker.rejoin(flat, versions)
        self.worker.steps = steps
        pid_dir = Path(out) / "ray"
        pid_dir.mkdir(parents=True, exist_ok=True)
        tmp = pid_dir / f".island_{index}.pid.tmp"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, pid_dir / f"island_{index}.pid")  # readers never see a half-written file

    def run(self) -> dict[str, Any]:
        """Train until the shared step budget is spent (the learner's loop,
        :meth:`~atoll.strategies.decoupled.island.IslandWorker.run`); return this island's counters."""
        transport = RayTransport(self.syncer, self.index, self.worker.fragments)
        self.worker.run(transport)
        island = self.worker.island
        return {"island": self.index, "steps": self.worker.steps, "compute_s": island.compute_s,
                "bytes_sent": transport.bytes_sent, "last_loss": island.last_loss,
                "node_id": ray.get_runtime_context().get_node_id()}

    def pid(self) -> int:
        return os.getpid()

    def kill_self(self) -> None:
        """SIGKILL this actor's process (for tests of failures)."""
        os.kill(os.getpid(), signal.SIGKILL)


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast when nothing answers at ``address`` (``host:port`` or ``ray://host:port``; ``auto`` unchecked).

    ``ray.init`` retries an unreachable cluster for minutes; a TCP connect with a deadline tells at once.

    Raises:
        ConfigError: malformed address, or no listener at it within ``timeout_s`` seconds.
    """
    import socket

    if not address or address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray_address: '{address}' is not HOST:PORT (ray start --head prints it, e.g. "
                          "10.0.0.1:6379); fix --ray-address")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"ray_address: no Ray cluster answers at {address} ({e.strerror or e}); start one with "
                          "`ray start --head` there or fix --ray-address") from None


def _init_ray(config: TrainConfig) -> bool:
    """Connect to ``ray_address``, or start a local Ray; True if this call started or connected it."""
    if ray.is_initialized():
        return False
    if config.ray_address:
        ray.init(address=config.ray_address, logging_level="warning")
        return True
    import atoll

    paths = [str(Path(atoll.__file__).resolve().parent.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    threads = str(config.threads or 1)
    cpus = max(os.cpu_count() or 1, math.ceil(config.islands * config.ray_cpus_per_island) + 1)
    # a local Ray is one node: it declares the custom resources the islands ask for (regions, hardware
    # generations), so a run meant for a cluster can be tried on one machine
    custom: dict[str, float] = {}
    for res in island_resources(config):
        for name, amount in res.items():
            custom[name] = custom.get(name, 0.0) + amount
    ray.init(num_cpus=cpus, resources=custom or None, include_dashboard=False, logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
                                       "OMP_NUM_THREADS": threads}})
    return True


def island_resources(config: TrainConfig) -> list[dict[str, float]]:
    """Each island's custom Ray resources (``ray_island_resources``; one entry applies to every island)."""
    res = config.ray_island_resources or [{}]
    return [dict(r) for r in (res * config.islands if len(res) == 1 else res)]


def _wait_restarted(actor: Any, timeout_s: float = 120.0) -> None:
    """Block until a restarting island actor answers again (calls fail while Ray restarts it).

    Raises:
        RayActorError: the actor died for good (its restarts are used up) or did not answer in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.pid.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return
        except ray.exceptions.ActorDiedError:
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _run_actors(config: TrainConfig, out: Path) -> tuple[dict[str, Any], dict[int, dict[str, Any]], list[int]]:
    """Start the syncer and the islands, re-run an island whose process died, until the budget is spent."""
    cfg = config.model_dump_json()
    # a crashed syncer is restarted by Ray from its last checkpoint; the islands' calls wait and are retried
    syncer = ray.remote(num_cpus=0, max_restarts=MAX_RESTARTS, max_task_retries=-1)(SyncerService).remote(cfg, str(out))
    island_cls = ray.remote(num_cpus=config.ray_cpus_per_island, num_gpus=config.ray_gpus_per_island,
                            max_restarts=MAX_RESTARTS, max_task_retries=0)(IslandService)
    islands = [island_cls.options(resources=res).remote(cfg, i, syncer, str(out)) if res else
               island_cls.remote(cfg, i, syncer, str(out)) for i, res in enumerate(island_resources(config))]
    running = {isl.run.remote(): i for i, isl in enumerate(islands)}
    results: dict[int, dict[str, Any]] = {}
    failures = [0] * config.islands
    abandoned: list[int] = []
    while running:
        # once one island has finished, the budget is spent: the others must finish within the deadline
        ready, _ = ray.wait(list(running), num_returns=1, timeout=config.collective_timeout_s if results else None)
        if not ready:  # hung islands: stop waiting for them (their un-pushed work is lost)
            for i in running.values():
                abandoned.append(i)
                ray.kill(islands[i], no_restart=True)
            print(f"atoll: warning: islands {sorted(abandoned)} did not finish within {config.collective_timeout_s:g} s "
                  "of the others; their un-pushed work is lost", file=sys.stderr)
            break
        i = running.pop(ready[0])
        try:
            results[i] = ray.get(ready[0])
        except ray.exceptions.RayTaskError:  # the island's code raised (e.g. the syncer died for good): its
            raise                            # process lives, so running it again would fail again at once
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            failures[i] += 1  # the process died: Ray restarts the actor, which rejoins; run it again
            _wait_restarted(islands[i])
            running[islands[i].run.remote()] = i
    final = ray.get(syncer.finish.remote())
    final["abandoned"] = sorted(abandoned)
    return final, results, failures


def train_ray(config: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Run a ``decoupled`` job on Ray (local, or the cluster at ``ray_address``); return its summary.

    Raises:
        ConfigError: ``resume`` (only the syncer's state is saved), or no Ray cluster at ``ray_address``.
    """
    if resume:
        raise ConfigError("resume: a decoupled run on Ray cannot be resumed (only its syncer state is saved, under "
                          "<out>/syncer); start a new run from its final model with --init-from RUN_DIR")
    check_ray_address(config.ray_address)  # before any folder is made
    run = Run(config)  # fills the tokenizer and token caches before the actors read them
    run.begin()
    out = run.out.resolve()
    started = _init_ray(config)
    try:
        final, results, failures = _run_actors(config, out)
    finally:
        if started:
            ray.shutdown()
    wall_s = run.wall_s()
    tps = config.tokens_per_step
    tokens = sum(final["steps_by_island"]) * tps
    idle = {"steps": 0, "compute_s": 0.0, "bytes_sent": 0.0}
    res = [results.get(i, idle) for i in range(config.islands)]
    bytes_sent = [r["bytes_sent"] for r in res]
    run.log_eval(config.steps, tokens, final["global"], sum(bytes_sent) / config.islands, wall_s)
    run.save_checkpoint(config.steps, {"strategy": "decoupled", "versions": final["versions"]}, final["global"])
    step_rate = sum(r["steps"] / r["compute_s"] for r in res if r["compute_s"] > 0)  # failure-free steps/s
    return run.finish(
        tokens=tokens, bytes_sent_per_island=sum(bytes_sent) / config.islands,
        compute_s=max(r["compute_s"] for r in res), sim_wall_s=wall_s,
        bytes_sent_by_island=bytes_sent, fragments=config.fragments, **final["stats"],
        steps_per_island=final["steps_by_island"], useful_tokens=final["merged_tokens"],
        # measured: useful tokens per second of wall time over the islands' summed failure-free step rate
        goodput=final["merged_tokens"] / wall_s / (step_rate * tps) if step_rate > 0 else None,
        island_utilization=[r["compute_s"] / wall_s for r in res], failures=failures,
        rejoins=[j - 1 for j in final["joins"]], rejoin_s=final["rejoin_s"], versions=final["versions"],
        abandoned_islands=final["abandoned"], syncer_restarts=final["syncer_restarts"],
        island_resources=island_resources(config), island_nodes=[r.get("node_id") for r in res])
