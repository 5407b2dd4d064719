"""The actors of a decoupled run on Ray: the syncer (:class:`SyncerService`, the Ray-free
:class:`~atoll.runtime.service.syncer.SyncerService` built in the actor's process) and the islands
(:class:`IslandService`, which reach the syncer through :class:`RayTransport`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import ray
import torch

from atoll.config import TrainConfig
from atoll.job.divergence import install_fault_hook_from_env
from atoll.runtime.decoupled_job import island_steps, prepare_job
from atoll.runtime.service import syncer as service
from atoll.strategies.decoupled.island import IslandWorker
from atoll.strategies.decoupled.protocol import Pull, Push

__all__ = ["MAX_RESTARTS", "IslandService", "RayTransport", "SyncerService"]

#: how often an actor may be restarted after its process died
MAX_RESTARTS = 4
#: seconds between an island's asks whether the run has started (every island joined)
START_POLL_S = 0.05


class SyncerService(service.SyncerService):
    """The syncer actor: a :class:`~atoll.runtime.service.syncer.SyncerService` built in the actor's own
    process from the run's settings, JSON across the process boundary (it prepares the job's fragments and
    initial model from them, as the island actors do: :func:`~atoll.runtime.service.syncer.prepare`)."""

    def __init__(self, config_json: str, out: str, credentials: list[str] | None = None) -> None:
        run, index, syncer, _ = service.prepare(TrainConfig.model_validate_json(config_json), credentials)
        super().__init__(run, index, syncer, out)


class RayTransport:
    """How an island actor reaches the syncer actor (:class:`~atoll.strategies.decoupled.island.Transport`).

    A push is sent without waiting; the syncer answers it with the merged global fragment once the push is
    merged (at once if it completes a quorum; else the island learns from a later :meth:`reserve_step` that its
    push left the buffer, and pulls). At most one exchange per fragment is in progress; its stage is
    ``push`` (sent, answer not read), ``wait`` (buffered at the syncer) or ``pull`` (the merged fragment asked).
    """

    def __init__(self, syncer: Any, island: int, fragments: int, credential: str = "", session: int = 0,
                 status: Any = None) -> None:
        self.syncer, self.island, self.credential, self.session = syncer, island, credential, session
        self.status = status  # () -> (last loss, lr) of the island, sent with each step's reservation
        self.pulled_at = [time.monotonic()] * fragments
        self.exchanges: dict[int, dict[str, Any]] = {}  # fragment -> {"stage", "ref"}
        self.buffered: list[int] = []                   # fragments whose buffer holds this island's push
        self.bytes_sent = 0.0      # its pushes' encoded bytes
        self.bytes_received = 0.0  # the global fragments it pulled (float32), its join's whole model included

    def reserve_step(self) -> bool:
        loss, lr = self.status() if self.status is not None else (None, None)
        go, self.buffered = ray.get(self.syncer.reserve_step.remote(self.island, self.credential, loss, lr))
        return go

    def send(self, push: Push) -> None:
        self.bytes_sent += push.nbytes
        msg = Push(push.island, push.fragment, push.delta, push.tokens, push.base_version, push.nbytes,
                   round_s=time.monotonic() - self.pulled_at[push.fragment], session=self.session,
                   credential=self.credential)
        self.exchanges[push.fragment] = {"stage": "push", "ref": self.syncer.push.remote(msg),
                                         "have": push.base_version}  # the version it holds (pull_codec)

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
                e["stage"], e["ref"] = "pull", self.syncer.pull.remote(p, self.island, e["have"])  # its merge's answer
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
            self.bytes_received += reply.nbytes
            self.pulled_at[p] = time.monotonic()
            del self.exchanges[p]
        return pulls


class IslandService:
    """One island as a Ray actor; on a restart it rejoins from the syncer's newest global parameters.

    ``credential``: this island's secret (from the driver), carried by each of its pushes."""

    def __init__(self, config_json: str, index: int, syncer: Any, out: str, credential: str = "") -> None:
        install_fault_hook_from_env()  # a test's faults, told as the actor's process starts (atoll.job.divergence)
        config = TrainConfig.model_validate_json(config_json)
        self.index, self.credential = index, credential
        self.syncer = syncer
        job = prepare_job(config)
        # an island given GPUs (ray_gpus_per_island) trains on the one Ray made visible to it
        # a GPU when Ray gave the actor one and the run does not pin the CPU (--device cpu)
        gpus = config.runtime_config.ray_gpus_per_island
        device = "cuda" if gpus > 0 and config.device != "cpu" and torch.cuda.is_available() else "cpu"
        self.worker = IslandWorker(index, job, island_steps(config)[index], device)
        flat, versions, steps, self.session = ray.get(syncer.join.remote(index, credential))
        self.joined_bytes = float(flat.numel() * flat.element_size())  # the whole model, pulled at its join
        self.worker.rejoin(flat, versions)
        self.worker.steps = steps
        self.start_timeout_s = config.runtime_config.collective_timeout_s
        pid_dir = Path(out) / "ray"
        pid_dir.mkdir(parents=True, exist_ok=True)
        tmp = pid_dir / f".island_{index}.pid.tmp"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, pid_dir / f"island_{index}.pid")  # readers never see a half-written file

    def run(self) -> dict[str, Any]:
        """Train until the shared step budget is spent (the learner's loop,
        :meth:`~atoll.strategies.decoupled.island.IslandWorker.run`); return this island's counters."""
        transport = RayTransport(self.syncer, self.index, self.worker.fragments, self.credential, self.session,
                                 status=self.status)
        transport.bytes_received = self.joined_bytes
        # the islands start together (SyncerService.started): one whose process started late under load does
        # not find the shared budget spent by the others
        while not ray.get(self.syncer.wait_start.remote(self.index, self.credential, self.start_timeout_s)):
            time.sleep(START_POLL_S)
        self.worker.run(transport)
        island = self.worker.island
        return {"island": self.index, "steps": self.worker.steps, "compute_s": island.compute_s,
                "bytes_sent": transport.bytes_sent, "bytes_received": transport.bytes_received,
                "last_loss": island.last_loss,
                "codec_s": self.worker.wire.codec_s[0],
                "resets": island.reset_count, "skipped_steps": island.skipped_steps,
                "node_id": ray.get_runtime_context().get_node_id()}

    def status(self) -> tuple[float, float]:
        """(last training loss, inner learning rate) of this island, for the driver's progress."""
        island = self.worker.island
        return float(island.last_loss), float(island.scheduler.get_last_lr()[0])

    def pid(self) -> int:
        return os.getpid()

    def kill_self(self) -> None:
        """SIGKILL this actor's process (for tests of failures)."""
        os.kill(os.getpid(), signal.SIGKILL)


