"""Checkpoints written off the critical path: a thread that writes the newest state it was handed.

The Ray syncer commits an outer step while every island waits on its answers (pushes, step reservations,
pulls); writing and fsyncing its whole state on that thread at every commit stalls every island behind the
disk. :class:`LatestStateWriter` takes a snapshot (tensors already copied by the caller) and writes it on its
own thread with :func:`atoll.job.checkpoint.save_checkpoint` (atomic, as before). States handed in while a
write runs replace each other: only the newest is written next, so a slow disk never builds a queue, and the
checkpoint on disk is at most the write in progress behind (a crash loses at most the commits since the last
finished write; the islands' pushes from the versions it lost are refused as ``version`` and answered with the
global fragment, from which they go on).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LatestStateWriter"]


class LatestStateWriter:
    """Writes the newest of the states :meth:`submit` hands it, one at a time, on a daemon thread.

    Args:
        write: ``write(state)`` writes one state durably (e.g. ``save_checkpoint`` bound to a folder); it runs
            on the writer's thread only, never two at once.
        on_error: ``on_error(error)`` is told of each write that raised an ``Exception`` (a full disk), on the
            writer's thread, instead of the error being kept for the caller; the next state handed in is
            written as usual (a retry at the next commit). None: the error is kept (below).
        on_done: ``on_done(state)`` is told of each state handed in once the writer no longer reads it: after
            its write (written or failed, on the writer's thread), when a newer one replaced it before its write,
            or when :meth:`submit` refused it for an earlier error (both in :meth:`submit`, the caller's thread),
            e.g. to reuse the memory of its copies; it must be thread-safe. An ``Exception`` it raises is handled
            as a write's (told to ``on_error``, or kept), never raised into the :meth:`submit` that told it.

    Attributes:
        written: states written so far; ``coalesced``: states replaced by a newer one before their write.

    Without ``on_error``, the first exception a write raises is kept and raised again by the next :meth:`submit`
    or :meth:`flush` (the caller's thread), so a full disk is not silent; later states are still written.
    """

    def __init__(self, write: Callable[[Any], Any], on_error: Callable[[Exception], None] | None = None,
                 on_done: Callable[[Any], None] | None = None) -> None:
        self._write = write
        self._on_error = on_error
        self._on_done = on_done
        self.failed = 0  # writes that raised
        self._cond = threading.Condition()
        self._next: Any = None
        self._pending = False
        self._busy = False
        self._error: BaseException | None = None
        self.written = 0
        self.coalesced = 0
        self._thread = threading.Thread(target=self._loop, name="atoll-checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, state: Any) -> None:
        """Hand over a state to write (it must not change afterwards); returns at once.

        Raises:
            BaseException: the error of an earlier write (once).
        """
        replaced: list[Any] = []
        try:
            with self._cond:
                self._raise()
                if self._pending:
                    self.coalesced += 1
                    replaced.append(self._next)
                self._next, self._pending = state, True
                self._cond.notify_all()
        except BaseException:
            replaced.append(state)  # refused: no write will read it
            raise
        finally:
            for old in replaced:  # given back at once: a slow write never holds a queue of states
                try:
                    self._done(old)
                except Exception as e:  # noqa: BLE001 - handled as a write's failure, not the caller's
                    self._failed(e)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every state handed over is written (or ``timeout`` seconds passed: False).

        Raises:
            BaseException: the error of a write (once).
        """
        with self._cond:
            done = self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)
            self._raise()
            return done

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending)
                state, self._next, self._pending, self._busy = self._next, None, False, True
            try:
                self._write(state)
                with self._cond:
                    self.written += 1
            except BaseException as e:  # told, or kept for the caller's thread
                with self._cond:
                    self.failed += 1
                self._failed(e)
            finally:
                try:
                    self._done(state)
                except BaseException as e:  # noqa: BLE001 - handled as a write's failure
                    self._failed(e)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _done(self, state: Any) -> None:
        if self._on_done is not None:
            self._on_done(state)

    def _failed(self, e: BaseException) -> None:
        """A write's failure (the writer's thread), or ``on_done``'s (either thread): told to ``on_error``, or kept
        for the caller's thread."""
        if self._on_error is not None and isinstance(e, Exception):
            try:
                self._on_error(e)
            except Exception as told:  # noqa: BLE001 - the teller's own failure: kept as the write's
                with self._cond:
                    self._error = self._error or told
        else:
            with self._cond:
                self._error = self._error or e
