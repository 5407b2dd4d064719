"""Heartbeats through the rendezvous store: a rank that stops without closing its connections is found."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from atoll.runtime.collective.failure import HEARTBEAT_S, LINE_KEY, REPORT_KEY, backend_reason

PAUSE_S = 2.0  # readings this much further apart than a beat: this rank was paused itself (SIGSTOP, a frozen
# VM or container), and so may have been the whole job: every peer gets a fresh window instead of a verdict

# ----------------------------------------------------------------------------------------------------------
# failure detection


class _Heartbeat:
    """Each rank bumps a counter in the rendezvous store every :data:`HEARTBEAT_S` seconds and watches the
    others'; a rank that leaves on purpose (done, or stopping after a failure) says so first. A rank whose
    readings are more than :data:`PAUSE_S` further apart than one beat was not running itself (a job-wide
    pause: SIGSTOP to the process group, a suspended VM or container): it restarts every peer's window
    instead of reporting the peers that have not run yet since the pause; one frozen rank is still found
    by the others, who ran.

    Args:
        rank, world: this rank and the world size.
        prefix: a key prefix unique to this run.
        stale_s: a rank whose counter has not moved for this long is declared dead.
        on_dead: called from the heartbeat thread as ``on_dead(rank or None, reason)``: once per silent rank,
            or (rank = ``store_host``) when the store has been unreachable for ``min(3 s, stale_s)``.
        store_host: the rank hosting the store (0 without a launcher's store), or None: a launcher's or
            torchrun agent's store, whose loss calls ``on_store_lost(reason)``.
    """

    def __init__(self, rank: int, world: int, prefix: str, stale_s: float,
                 on_dead: Callable[[int | None, str], None], store_host: int | None,
                 on_store_lost: Callable[[str], None]) -> None:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=min(10.0, stale_s)))
        self.client, self.store = client, dist.PrefixStore(prefix, client)
        self.rank, self.world, self.stale_s = rank, world, stale_s
        self.on_dead, self.store_host, self.on_store_lost = on_dead, store_host, on_store_lost
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.keys = [f"hb/{r}" for r in range(world)] + [f"bye/{r}" for r in range(world)]
        with self.lock:
            self.store.add(f"hb/{rank}", 1)
            self.store.set(f"bye/{rank}", "0")  # (a restarted rank: not the goodbye of its previous process)
        self.seen = [time.monotonic()] * world  # when each rank's counter last moved (or it said goodbye)
        self.left = [False] * world  # said goodbye
        self.read_at = time.monotonic()  # when this rank last read the others' counters
        self.dropped: set[int] = set()  # ranks of islands the job went on without: not watched
        self.reported: set[int] = set()  # ranks found silent once (reported again only after they rejoin)
        self.thread = threading.Thread(target=self._run, name="atoll-heartbeat", daemon=True)

    def start(self) -> None:
        """Start beating (after every rank created its keys: call it after a barrier)."""
        self.thread.start()

    def _read(self) -> tuple[list[int], list[int]]:
        with self.lock:
            values = [int(v) for v in self.store.multi_get(self.keys)]
        return values[:self.world], values[self.world:]

    def _run(self) -> None:
        last = None
        seen = self.seen
        store_ok = time.monotonic()
        reported = self.reported
        while True:
            slept = time.monotonic()
            if self.stopped.wait(HEARTBEAT_S):
                break
            if time.monotonic() - slept > HEARTBEAT_S + PAUSE_S:  # this thread did not run: no store outage
                store_ok = time.monotonic()
            try:
                with self.lock:
                    self.store.add(f"hb/{self.rank}", 1)
                beats, bye = self._read()
            except Exception as e:  # the store is gone: its host died
                if time.monotonic() - store_ok > min(3.0, self.stale_s):
                    reason = f"rendezvous store unreachable: {backend_reason(e)}"
                    if self.store_host is None:
                        self.on_store_lost(reason)
                    else:
                        self.on_dead(self.store_host, reason)
                continue
            now = time.monotonic()
            paused = now - self.read_at > HEARTBEAT_S + PAUSE_S  # this rank did not run: the others may not either
            store_ok = self.read_at = now
            for r in range(self.world):
                self.left[r] = bool(bye[r])
                if last is None or beats[r] != last[r] or bye[r] or paused:
                    seen[r] = now
            last = beats
            silent = [r for r in range(self.world) if r != self.rank and now - seen[r] > self.stale_s
                      and r not in self.dropped and r not in reported]
            if silent and not self.stopped.is_set():
                reported.update(silent)
                self.report(silent)
                self.on_dead(silent[0], f"no heartbeat for {self.stale_s:.0f} s")

    def report(self, ranks: list[int]) -> None:
        """Tell the launcher (through the store) that ``ranks`` stopped responding: it kills them if they run."""
        try:
            with self.lock:
                for r in ranks:
                    self.client.set(f"{REPORT_KEY}{r}", "1")
        except Exception:
            pass

    def hand_over(self, line: str, suspect: int | None) -> bool:
        """Leave why this rank stops (one line, and the rank it found silent or None: :data:`LINE_KEY`, JSON) in
        the launcher's store, for the launcher to say once for the run. Returns whether the store has it (read
        back on the same connection, so the line is there before this process exits); False when the store's
        client fails, its host gone (the caller prints it). A store that is frozen, not gone, holds the call as
        it held :meth:`leave` just before."""
        key = f"{LINE_KEY}{self.rank}"
        try:
            with self.lock:
                self.client.set(key, json.dumps({"line": line, "suspect": suspect}))
                return self.client.check([key])
        except Exception:  # noqa: BLE001 - whatever the store's client raises: the line is printed instead
            return False

    def is_gone(self, rank: int, silent_s: float) -> bool:
        """Whether ``rank`` said goodbye, or its counter had not moved for ``silent_s`` seconds at this rank's
        last reading (a reader that was itself stalled judges nobody)."""
        return self.left[rank] or self.read_at - self.seen[rank] > silent_s

    def drop(self, ranks: list[int]) -> None:
        """Stop watching ``ranks`` (their island was dropped from the job)."""
        self.dropped.update(ranks)

    def undrop(self, ranks: list[int]) -> None:
        """Watch ``ranks`` again (their island rejoined), as if they had just beaten; a new silence of theirs is
        reported again."""
        now = time.monotonic()
        for r in ranks:
            self.seen[r], self.left[r] = now, False
        self.dropped.difference_update(ranks)
        self.reported.difference_update(ranks)

    def leave(self) -> str | None:
        """Say this rank leaves on purpose, and stop beating. Returns None, or why the store did not take the
        goodbye (it is unreachable: its host is gone)."""
        self.stopped.set()
        try:
            with self.lock:
                self.store.add(f"bye/{self.rank}", 1)
        except Exception as e:  # noqa: BLE001 - whatever the store's client raises
            return f"rendezvous store unreachable: {backend_reason(e)}"
        return None

    def find_dead(self, wait_s: float = 3.0) -> int | None:
        """The lowest rank that neither beats nor said goodbye over ``wait_s`` seconds, or None."""
        try:
            start, _ = self._read()
            alive = {self.rank}
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and len(alive) < self.world:
                time.sleep(0.25)
                beats, bye = self._read()
                alive |= {r for r in range(self.world) if beats[r] != start[r] or bye[r]}
        except Exception:
            return self.store_host
        dead = [r for r in range(self.world) if r not in alive]
        return dead[0] if dead else None


