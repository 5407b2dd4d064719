"""What the syncer service keeps across its restarts, and how a restarted one continues: its checkpoint (the
syncer's state and the service's, written off the critical path after every commit) and its ledger (the shared
budget and the token ledger, ``ledger.json``, written at every grant, release, join and leave).

:class:`DurableService` is the base of :class:`~atoll.runtime.service.syncer.SyncerService`: the service's
figures it writes and restores are the service's attributes (the budget taken, each island's record, the
rejoin times, the restarts, the run's clock, a shard's entries).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from atoll.job.async_save import LatestStateWriter
from atoll.job.checkpoint import save_checkpoint
from atoll.runtime.service import syncer_shards as sharding
from atoll.runtime.service.island_state import IslandState, RejoinTimes
from atoll.strategies.decoupled.island import save_path

if TYPE_CHECKING:
    from atoll.strategies.decoupled.syncer import Syncer


class RunFacts(Protocol):
    """What a restart reads of the run (:class:`~atoll.runtime.service.syncer.SyncerRun`): its islands, and per
    island the tokens of one honest push (granted again to each when a checkpoint has no ledger beside it)."""

    @property
    def islands(self) -> int: ...

    @property
    def push_tokens(self) -> tuple[int, ...]: ...

#: the file beside the syncer's checkpoints that holds its budget and token ledger (:meth:`DurableService._save_ledger`)
LEDGER = "ledger.json"


class DurableService:
    """The syncer service's checkpoints and ledger (see the module docstring); its clock, continued across
    restarts (:meth:`_now`)."""

    # the service's attributes (set by SyncerService.__init__) this part writes and restores
    run: RunFacts
    syncer: Syncer
    out: Path
    t0: float
    reserved: int
    islands: list[IslandState]
    rejoins: RejoinTimes
    restarts: int
    first_step_s: float | None
    shard: sharding.ShardSpec | None
    grants: sharding.GrantBook | None
    issuer: sharding.GrantIssuer | None
    writer: LatestStateWriter
    last_write_error: Exception | None

    def _restore(self) -> dict[str, Any] | None:
        """Continue a restarted syncer (None: a new run): from the newest readable checkpoint and the ledger
        beside it, or from the ledger alone (killed before its first commit's checkpoint). Returns the
        checkpoint's state (None: none).

        Raises:
            CheckpointError: a checkpoint that does not fit this run, or none readable (one line each).
        """
        from atoll.errors import CheckpointError

        state = self._newest_state()
        if state is not None:
            try:
                self.syncer.load_state_dict(state["syncer"])
            except (KeyError, ValueError, TypeError, RuntimeError) as e:  # another model's, or another run's
                raise CheckpointError(f"resume: the syncer's checkpoint in '{save_path(self.out)}' does not fit this "
                                      f"run ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                                      "restart with the settings it was started with, or choose another --out"
                                      ) from None
            ledger = self._load_ledger()
            if ledger is None:  # (a checkpoint written without one, or a shard that grants no steps)
                self.syncer.grant_since_checkpoint(list(self.run.push_tokens))
            service = {**state.get("service", {}), **(ledger or {})}
            # continue the checkpoint's clock: restored buffers' grace windows (opened_at) are on it
            self._continue(service, float(state.get("service", {}).get("clock_s", 0.0)))
            sharding.restore_shard(self.shard, self.grants, service, save_path(self.out))
        elif (ledger := self._load_ledger()) is not None:  # killed before its first commit's checkpoint: the budget
            self._continue(ledger, float(ledger.get("clock_s", 0.0)))  # and the ledger it had granted go on
            print(f"atoll syncer: restarted before its first commit: {self.reserved} inner steps granted so far go "
                  f"on (from {save_path(self.out) / LEDGER})", flush=True)
        return state

    def _open_writer(self) -> None:
        """The checkpoints' writer thread (:class:`~atoll.job.async_save.LatestStateWriter`, two kept)."""
        folder = save_path(self.out)
        # a write that fails (a full disk) is one line; merging goes on and the next commit's state is written
        self.last_write_error: Exception | None = None
        # the syncer's state is lent (its copies of globals, momenta and shadows), given back once the writer is
        # done with it, so the next commits copy into memory already touched (atoll/algorithms/snapshot.py)
        self.writer = LatestStateWriter(lambda item: save_checkpoint(folder, item[0], item[1], keep=2),
                                        on_error=self._write_failed,
                                        on_done=self._given_back)

    def _newest_state(self) -> dict[str, Any] | None:
        """The state of the newest readable checkpoint in ``out/syncer`` (None: no checkpoint folder, a new
        run). Newer ones that are unreadable (damaged, or disagreeing with their checksums) are named in one
        line each and set aside (:func:`~atoll.job.checkpoint.set_aside`), so the rotation never deletes this
        run's new checkpoints as older than them.

        Raises:
            CheckpointError: there are checkpoints, and none is readable (one line: the folder and the fix;
                never a silent fresh start).
        """
        from atoll.job.checkpoint import checkpoint_folders, load_newest_readable, set_aside

        folder = save_path(self.out)
        if not checkpoint_folders(folder / "checkpoints"):
            return None

        def whole(state: dict[str, Any]) -> None:
            if not (isinstance(state, dict) and isinstance(state.get("syncer"), dict)):
                raise ValueError("it holds no syncer state")

        step, state, path, skipped = load_newest_readable(folder, whole)
        for bad, why in skipped:
            moved = set_aside(bad)
            print(f"atoll: warning: syncer: checkpoint '{bad}' is unreadable ({why}); continuing from the newest "
                  f"readable one, {path.name} (commit {step}); the damaged one kept as '{moved.name}'",
                  file=sys.stderr, flush=True)
        return state

    def _given_back(self, item: tuple[int, dict[str, Any]]) -> None:
        """(The writer's thread, or the committing one.) The writer no longer reads a state :meth:`_save` handed
        it: its copies go back to the syncer for a later commit's to reuse. A failure here (a bug: a copy not
        lent) is one line; it costs only that memory's reuse, never a commit."""
        try:
            self.syncer.release(item[1]["syncer"])
        except ValueError as e:
            print(f"atoll: warning: syncer: the copies of checkpoint {item[0]} could not be given back ({e}); "
                  "their memory is not reused", file=sys.stderr, flush=True)

    def _write_failed(self, error: Exception) -> None:
        """(The writer's thread.) A checkpoint could not be written (a full disk, a read-only folder): one line
        per failed write; the syncer keeps merging and answering, and writes the state of its next commit (the
        checkpoint on disk stays the last one written whole)."""
        self.last_write_error = error
        what = f"{error.strerror or error}" if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
        print(f"atoll: warning: syncer: checkpoint not written ({what}; {self.writer.failed} failed so far); "
              "merging goes on and the next commit's state is written; free space on the disk of "
              f"'{save_path(self.out)}'", file=sys.stderr, flush=True)

    def _save(self, wait: bool = False) -> None:
        """Checkpoint the syncer and the shared budget atomically (``out/syncer``), off the critical path: the
        state is snapshotted here (copies of the globals and momenta) and written and fsynced by the
        :class:`~atoll.job.async_save.LatestStateWriter` thread, so the islands' calls are answered meanwhile;
        ``wait``: return once it is on disk (the end of the run). A write that fails is one line
        (:meth:`_write_failed`), never an error of the call that merged."""
        service = self.service_state()
        if self.issuer is not None:  # a copy of the grant epoch: recovered from it if coordinator.json is lost
            service["grant_epoch"] = self.issuer.epoch
        self.writer.submit((self.syncer.commits, {"service": service, "syncer": self.syncer.state_dict(lend=True)}))
        if wait:
            self.writer.flush()

    def service_state(self) -> dict[str, Any]:
        """The service's part of its checkpoint (JSON-able, bounded however long the run): the budget, each
        island's record, the rejoin times, restarts, the clock, and a shard's entries."""
        service = {"reserved": self.reserved, "islands": [i.state_dict() for i in self.islands],
                   "rejoins": self.rejoins.state_dict(), "restarts": self.restarts, "clock_s": self._now(),
                   "first_step_s": self.first_step_s}
        service.update(sharding.shard_entries(self.shard, self.grants))
        return service

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _save_ledger(self) -> None:
        """The shared budget and the token ledger as they are now (steps granted, leases, sessions, tokens
        granted per island) in ``out/syncer/ledger.json``, beside the checkpoint: written at every grant,
        release, join and leave (the checkpoint only at commits), so a restarted syncer continues from them
        instead of granting each island a push of tokens more: the steps it counts as trained are every step it
        granted, and the merged tokens never exceed them."""
        from atoll.job.checkpoint import write_text_atomic

        granted = self.syncer.bounds.granted
        if granted is None:
            return
        ledger = {"reserved": self.reserved, "islands": [i.state_dict() for i in self.islands],
                  "granted": list(granted), "first_step_s": self.first_step_s, "clock_s": self._now()}
        save_path(self.out).mkdir(parents=True, exist_ok=True)
        write_text_atomic(save_path(self.out) / LEDGER, json.dumps(ledger))

    def _continue(self, record: dict[str, Any], clock_s: float) -> None:
        """Continue a restarted syncer from ``record``: its checkpoint's service part overlaid by
        :meth:`_save_ledger`'s newer record, or the ledger alone (killed after granting steps, before its first
        commit; the global model is then the initial one). The budget taken, each island's record, the rejoin
        times, the restarts (one more), the first step's time, the tokens granted (where the record has them)
        and the clock, which goes on from ``clock_s`` (seconds)."""
        self.reserved = int(record.get("reserved", 0))
        self.islands = [IslandState.of(x) for x in record["islands"]] if "islands" in record \
            else IslandState.of_lists(record, self.run.islands)
        self.rejoins = RejoinTimes.of(record.get("rejoins", record.get("rejoin_s", [])))
        self.restarts = int(record.get("restarts", 0)) + 1
        self.first_step_s = record.get("first_step_s")
        if "granted" in record:
            self.syncer.bounds.granted = [int(x) for x in record["granted"]]
        self.t0 = time.monotonic() - clock_s

    def _load_ledger(self) -> dict[str, Any] | None:
        """:meth:`_save_ledger`'s record, or None: none, unreadable, or not this run's islands."""
        try:
            ledger = json.loads((save_path(self.out) / LEDGER).read_text(encoding="utf-8"))
            if len(ledger["islands"]) != self.run.islands or len(ledger["granted"]) != self.run.islands:
                return None
            [IslandState.of(x) for x in ledger["islands"]]  # noqa: B018 - readable, else None
            int(ledger["reserved"])
            return ledger
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
