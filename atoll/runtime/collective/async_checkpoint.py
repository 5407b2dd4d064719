"""Asynchronous per-rank checkpoints of the collective runtime (``--async-checkpoint``).

A synchronous checkpoint stalls every rank for as long as the slowest one takes to write its part (16 bytes per
parameter of an island with AdamW, plus the global model and outer state on island 0) and fsync it. With
``--async-checkpoint`` a rank only copies its part to host buffers (:class:`~atoll.job.rank_checkpoint.HostStaging`,
page-locked on a GPU) and goes on training; a thread of its own writes the copy with DCP's safetensors writer,
as torchtitan's asynchronous mode does (Liang et al. 2024, "TorchTitan", arXiv:2410.06511, section 3.2).

The checkpoint is still written atomically for the whole job, without a collective off the training thread:

1. every rank's writer thread posts its outcome (``ok``, or the ``OSError``) under ``ckpt/<step>/<rank>`` of the
   run's rendezvous store (:func:`outcome_key`);
2. rank 0's writer thread waits for the outcome of every rank (:func:`writers`); an island
   lost while it wrote (gone from the membership, restarted since, or its rank's heartbeat silent) is left
   out of the checkpoint's ``alive`` (a resume takes its state from the first live island's, as it would have
   rejoined), in a job that goes on without it (else the checkpoint fails: the job is stopping); then it
   writes the shared state and the Hugging Face model into the temporary folder, renames it into place,
   points ``latest`` at it and posts ``ok`` (or the error, having removed the folder) under
   ``ckpt/<step>/result`` (the keys are deleted once every rank has read it: :func:`forget`);
3. at the next checkpoint every rank first reads that result (:meth:`InFlight.settle`): at most one checkpoint
   is in flight, a failed write is raised there on every rank as the ``OSError`` the synchronous path raises,
   and rank 0 logs the ``checkpoint`` event. The run's last checkpoint, and a signal's, are written in the
   foreground (after settling the one in flight), so a run that ends has every checkpoint on disk.

A crash while a checkpoint is in flight loses that checkpoint only: its temporary folder is removed by the
next writer (:func:`atoll.job.checkpoint.checkpoint_tmp`) and ``latest`` still names the previous one.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atoll.errors import PeerWriteError
from atoll.job.rank_checkpoint import HostStaging, StagedState, rank_folder, write_rank_state

if TYPE_CHECKING:
    from atoll.job.run import Run
    from atoll.runtime.collective.view import CollectiveView

RESULT = "result"
POLL_S = 0.02  # seconds between two looks at the store for an outcome


def outcome_key(prefix: str, step: int, who: int | str) -> str:
    """The store key under which rank ``who`` (or ``"result"``: rank 0's commit) posts the outcome of the
    checkpoint of inner step ``step`` of the run whose keys start with ``prefix``."""
    return f"{prefix}ckpt/{step}/{who}"


def forget(store: Any, prefix: str, step: int, world: int) -> None:
    """Delete the outcome keys of the checkpoint of ``step`` (every rank's and the result) once every rank has
    read its result (rank 0, after the next checkpoint's barrier), so a long run's store does not grow with
    every checkpoint. A key already gone, or a store gone, is no error."""
    for who in [*range(world), RESULT]:
        with contextlib.suppress(Exception):
            store.delete_key(outcome_key(prefix, step, who))


def writers(alive: list[int], ranks_per_island: int) -> dict[int, list[int]]:
    """Island -> the global ranks whose outcome rank 0 waits for: every rank of every island alive. A sharded
    island's ranks write its pieces; an unsharded one's first rank its state, the others (replicas) an empty
    folder, as in the foreground: waited for too, or a late one would write it after the folder was renamed
    (a stray ``.tmp-step_*`` folder, a checkpoint without it)."""
    return {i: [i * ranks_per_island + p for p in range(ranks_per_island)] for i in alive}


def _error_text(e: BaseException) -> str:
    """``e`` as the outcome posted in the store: ``error``, its errno (EIO where it has none), its message and
    file name, tab-separated, each on one line (:func:`_raise` reads it back)."""
    number = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
    text = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
    where = str(e.filename) if isinstance(e, OSError) and e.filename else ""
    text, where = (" ".join(str(x).split("\t")).strip().split("\n")[0] for x in (text, where))
    return f"error\t{number}\t{text}\t{where}"


def _raise(text: str, who: str, said_elsewhere: bool = False) -> None:
    """Raise the error posted as ``text`` (:func:`_error_text`), ``who`` added to its message; with
    ``said_elsewhere`` as a :class:`~atoll.errors.PeerWriteError` (rank 0 says it; the other ranks stop quietly)."""
    _, number, message, where = (text.split("\t") + ["", "", ""])[:4]
    kind = PeerWriteError if said_elsewhere else OSError
    raise kind(int(number or errno.EIO), f"{message} ({who})", where or None)


@dataclass
class Commit:
    """What rank 0 adds to a checkpoint once every part is on disk.

    Attributes:
        run: the run (its folder, tokenizer, model config; its model's weights are not read).
        state: the job's shared state as of the checkpoint (:meth:`Run.checkpoint_state`); its ``alive`` loses
            the islands lost while their parts were written.
        params: the global parameters, a host copy, flat float32 (numel,).
        meta: more entries of ``state.json`` (the per-rank format).
        writers: island -> the ranks whose outcome is waited for (:func:`writers`).
        epoch: the membership's epoch at the checkpoint (an island with a change after it restarted since).
        silent_s: a writer whose heartbeat has not moved for this long is gone.
        survives: the job goes on without a lost island (``--min-islands`` below the islands, unsharded): a lost
            island is left out of the checkpoint; else it fails the checkpoint (the job is stopping).
    """

    run: Run
    state: dict[str, Any]
    params: torch.Tensor
    meta: dict[str, Any]
    writers: dict[int, list[int]]
    epoch: int
    silent_s: float
    survives: bool = True
    dropped: list[int] = field(default_factory=list)


class BackgroundCheckpoints:
    """A rank's asynchronous checkpoints: the one in flight (None: none), the host buffers its copies go to
    (kept from one checkpoint to the next) and the writer threads' store client (made at the first)."""

    def __init__(self) -> None:
        self.in_flight: InFlight | None = None
        self.staging = HostStaging()
        self.store: Any = None


class InFlight:
    """One checkpoint this rank writes in the background: its own part, and on rank 0 the commit.

    Args:
        rt: the started runtime (its rank, store prefix, membership and heartbeat; read, never changed).
        store: a store client of this object's own (the thread and :meth:`settle` share it under a lock).
        step: the checkpoint's inner step.
        tmp: the temporary folder rank 0 made.
        staged: this rank's part, already copied to host buffers.
        commit: rank 0's commit; None on the other ranks.

    Attributes:
        write_s: seconds this rank's thread took to write its part (and commit it, on rank 0).
    """

    def __init__(self, rt: CollectiveView, store: Any, step: int, tmp: Path, staged: StagedState,
                 commit: Commit | None, blocked_s: float = 0.0) -> None:
        self.rt, self.store, self.step, self.tmp, self.staged, self.commit = rt, store, step, tmp, staged, commit
        self.rank, self.prefix = rt.rank, rt.prefix
        self.lock = threading.Lock()
        self.write_s = 0.0
        self.result: str | None = None  # rank 0: the commit's result, also kept here (the store may be gone)
        self.blocked_s = blocked_s  # seconds the training thread stood still for it (copies, the previous' wait)
        self.thread = threading.Thread(target=self._run, name="atoll-checkpoint-writer", daemon=True)
        self.thread.start()

    def _post(self, who: int | str, text: str) -> None:
        with self.lock:
            self.store.set(outcome_key(self.prefix, self.step, who), text)

    def _get(self, who: int | str) -> str | None:
        key = outcome_key(self.prefix, self.step, who)
        try:
            with self.lock:
                return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # the store is gone (its host, the launcher, died): the heartbeat stops this rank
            return None    # with the one line that says so; until then, nothing has come

    def _run(self) -> None:
        """The thread: write this rank's part, post its outcome, and on rank 0 commit and post the result. Any
        failure is posted (a thread that ended without a word would leave the other ranks waiting for it)."""
        t0 = time.perf_counter()
        try:
            write_rank_state(rank_folder(self.tmp, self.rank), self.staged)
            outcome = "ok"
        except BaseException as e:  # kept for every rank: raised at the next settle
            outcome = _error_text(e)
        self.staged = StagedState(None, {}, [])  # the host buffers stay with the staging, not here
        with contextlib.suppress(Exception):  # the store is gone: the heartbeat stops this rank
            self._post(self.rank, outcome)
        if self.commit is not None:
            try:
                result = self._commit(outcome)
            except BaseException as e:
                shutil.rmtree(self.tmp, ignore_errors=True)
                result = _error_text(e)
            self.write_s, self.result = time.perf_counter() - t0, result
            if result.startswith("ok"):  # logged now, not at the next checkpoint: a crash before it keeps the event
                with contextlib.suppress(Exception):  # (a closed log: the run ended without settling it)
                    self.commit.run.log.log(
                        "checkpoint", step=self.step, path=result.split("\t", 1)[1], blocked_s=round(self.blocked_s, 6),
                        write_s=round(self.write_s, 6), background=True,
                        **({"islands_left_out": self.commit.dropped} if self.commit.dropped else {}))
            with contextlib.suppress(Exception):
                self._post(RESULT, result)
        self.write_s = time.perf_counter() - t0

    def _gone(self, island: int, ranks: list[int]) -> bool:
        """Whether ``island``'s writer is lost (so its part will never come): not in the membership now, changed
        since the checkpoint (lost and restarted), or a writer's heartbeat silent."""
        c, membership = self.commit, self.rt.membership
        assert c is not None
        if island not in list(membership.alive):
            return True
        if any(e.island == island and e.epoch > c.epoch for e in list(membership.events)):
            return True
        heartbeat = self.rt.heartbeat
        return heartbeat is not None and any(heartbeat.is_gone(r, c.silent_s) for r in ranks)

    def _commit(self, own: str) -> str:
        """Rank 0: wait for every writer, then write the shared part and rename the folder; the result text.
        A failed part fails the checkpoint, once every writer is done (or gone): the folder is removed after the
        last write into it, as the foreground does after its all-reduce (a write still under way would make it
        again, a stray ``.tmp-step_*`` folder)."""
        c = self.commit
        assert c is not None
        failure = own if own != "ok" else None
        waiting = dict(c.writers)
        while waiting:
            for island, ranks in list(waiting.items()):
                outcomes = [self._get(r) for r in ranks]
                failure = failure or next((o for o in outcomes if o is not None and o != "ok"), None)
                if all(o is not None for o in outcomes):
                    del waiting[island]
                elif self._gone(island, ranks):
                    if not c.survives:  # the job stops on a loss: no checkpoint of it, as in the foreground
                        failure = failure or _error_text(OSError(
                            errno.EIO, f"island {island} was lost while its part of the checkpoint was written"))
                    c.dropped.append(island)
                    del waiting[island]
            if waiting:
                time.sleep(POLL_S)
        if failure is not None or 0 in c.dropped:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return failure or _error_text(OSError(errno.EIO, "island 0's part of the checkpoint was not written"))
        state = {**c.state, "alive": [i for i in c.state["alive"] if i not in c.dropped]}
        try:
            c.run.write_checkpoint(self.step, state, c.params, self.tmp, meta=c.meta)
            path = c.run.commit_checkpoint(self.step, self.tmp)
        except Exception as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return _error_text(e)
        return f"ok\t{path}"

    def settle(self) -> tuple[Path, float, list[int]]:
        """Wait until the checkpoint is committed or failed (every rank; the training thread).

        Returns:
            (its folder, seconds this call waited, the islands left out of it).

        Raises:
            OSError: a rank could not write its part, or rank 0 could not commit it (the same on every rank;
                the temporary folder is removed, the previous checkpoint stays ``latest``): on rank 0, which says
                it in one line; a :class:`~atoll.errors.PeerWriteError` on the others.
        """
        t0 = time.perf_counter()
        while (result := self._get(RESULT)) is None:
            if self.commit is not None and not self.thread.is_alive():  # rank 0's thread posted it, or the store
                result = self.result or _error_text(OSError(errno.EIO, "the checkpoint writer stopped"))
                break
            time.sleep(POLL_S)
        self.thread.join()
        waited = time.perf_counter() - t0
        if not result.startswith("ok"):
            _raise(result, f"checkpoint of step {self.step}", said_elsewhere=self.rank != 0)
        return Path(result.split("\t", 1)[1]), waited, list(self.commit.dropped) if self.commit else []
