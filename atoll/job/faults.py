"""A test's process faults: a rank of the collective runtime killed (or frozen) as it starts an inner step.

A fault hook like :func:`atoll.job.divergence.nan_faults`, installed the same way: by a test in its own process
(:func:`atoll.job.divergence.set_fault_hook`), or in a process started for a test from :data:`KILL_HOOK_ENV`,
read once as the process starts (:func:`atoll.job.divergence.install_fault_hook_from_env`: ``atoll``'s entry,
each launched rank), never in a step. The collective runtime calls the hook with ``kind="start"`` as a rank
starts an inner step, telling it the rank and the inner steps done at the job's first rejoin
(:meth:`atoll.runtime.collective.runtime.CollectiveRuntime.inner_steps`); nothing else does, so the hook is
inert in the other runtimes.

``ATOLL_TEST_KILL_RANK_AT_STEP=RANK:N[:STOP]``: global rank RANK kills itself with SIGKILL (or freezes with
SIGSTOP) as it starts inner step N (1-based); entries are separated by commas (``1:40,2:80``), ``+N`` counts
from the job's first rejoin (``1:8,2:+5``), and a restarted rank keeps the hook (its environment is its
predecessor's). ``ATOLL_TEST_KILL_STAMP``: a file where the killed rank notes when it died
(``bench/survivors.py``).

``ATOLL_TEST_STEP_S=RANK:S[,RANK:S...]``: global rank RANK's inner steps last at least S seconds each (it sleeps at
a step's start until S after the previous step's start, as ``atoll island --emulate-step-s`` paces an island job),
so islands sharing one host run at declared relative speeds (``atoll bench wan-decoupled --island-speeds``); a
step already longer is not made up for later.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from atoll.errors import ConfigError

if TYPE_CHECKING:
    from atoll.job.island import Island

KILL_HOOK_ENV = "ATOLL_TEST_KILL_RANK_AT_STEP"
KILL_STAMP_ENV = "ATOLL_TEST_KILL_STAMP"
PACE_HOOK_ENV = "ATOLL_TEST_STEP_S"


class KillAt(NamedTuple):
    """One entry of the kill hook: global rank ``rank`` gets ``signal`` as it starts inner step ``step``
    (1-based), or, with ``after_rejoin``, ``step`` inner steps after the job's first rejoin."""

    rank: int
    step: int
    signal: signal.Signals
    after_rejoin: bool = False


def parse_kill_hook(spec: str) -> list[KillAt]:
    """The entries of ``spec``: one or more ``RANK:STEP[:STOP|KILL]`` separated by commas; ``STEP`` as ``+N``
    counts from the job's first rejoin. ``1:40,2:80``: rank 1 dies at step 40, rank 2 at 80; ``1:8,1:+5``
    kills rank 1 at step 8 and its restarted process 5 steps after it rejoined (``1:8,2:+5``: rank 2 dies 5
    steps after rank 1 rejoined).

    Raises:
        ConfigError: a malformed value (names :data:`KILL_HOOK_ENV` and the format).
    """
    entries = []
    try:
        for entry in spec.split(","):
            rank, step, *how = entry.strip().split(":")
            if how not in ([], ["STOP"], ["KILL"]):
                raise ValueError(spec)
            entries.append(KillAt(int(rank), int(step), signal.SIGSTOP if how == ["STOP"] else signal.SIGKILL,
                                  after_rejoin=step.startswith("+")))
    except ValueError:
        raise ConfigError(f"{KILL_HOOK_ENV}: expected RANK:STEP[:STOP] entries separated by commas, STEP as N or "
                          f"+N after the first rejoin (e.g. 1:7 or 1:7,2:+5), got {spec!r}") from None
    return entries


def kill_faults(spec: str, stamp: str | None = None) -> Callable[..., None]:
    """The fault hook of ``spec`` (:func:`parse_kill_hook`, parsed now): at ``kind="start"`` of a step an entry
    names for this rank, the process sends itself the entry's signal, after noting the time in ``stamp``.

    Raises:
        ConfigError: a malformed ``spec``.
    """
    entries = parse_kill_hook(spec)

    def hook(island: Island, step: int, kind: str, *, rank: int | None = None, first_rejoin: int | None = None,
             **_: Any) -> None:
        if kind != "start" or rank is None:
            return
        for entry in entries:
            base = first_rejoin if entry.after_rejoin else 0
            if base is not None and (entry.rank, base + entry.step) == (rank, step + 1):
                if stamp:  # when it died, for bench/survivors.py
                    Path(stamp).write_text(repr(time.time()))
                os.kill(os.getpid(), entry.signal)

    return hook


def kill_faults_from_env() -> Callable[..., None] | None:
    """The kill hook of :data:`KILL_HOOK_ENV` (with :data:`KILL_STAMP_ENV`), or None where it is unset.

    Raises:
        ConfigError: a malformed value.
    """
    value = os.environ.get(KILL_HOOK_ENV)
    return kill_faults(value, os.environ.get(KILL_STAMP_ENV)) if value else None


def parse_pace_hook(spec: str) -> dict[int, float]:
    """Seconds per inner step of each global rank of ``spec``, ``RANK:S`` entries separated by commas
    (``0:0.5,1:1.0``).

    Raises:
        ConfigError: a malformed value or an S not above 0 (names :data:`PACE_HOOK_ENV` and the format).
    """
    try:
        paces = {int(rank): float(s) for rank, s in (entry.strip().split(":") for entry in spec.split(","))}
    except ValueError:
        paces = {}
    if not paces or any(not s > 0 for s in paces.values()):
        raise ConfigError(f"{PACE_HOOK_ENV}: expected RANK:SECONDS entries separated by commas, seconds > 0 "
                          f"(e.g. 0:0.5,1:1.0), got {spec!r}")
    return paces


def pace_faults(spec: str, clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> Callable[..., None]:
    """The pace hook of ``spec`` (:func:`parse_pace_hook`, parsed now): at ``kind="start"`` of an inner step of a
    rank it names, sleep until its seconds after the start of that rank's previous step (``clock``, seconds).

    Raises:
        ConfigError: a malformed ``spec``.
    """
    paces = parse_pace_hook(spec)
    last: dict[int, float] = {}  # each rank's previous step's start

    def hook(island: Island, step: int, kind: str, *, rank: int | None = None, **_: Any) -> None:
        if kind != "start" or rank not in paces:
            return
        now = clock()
        if rank in last and (due := last[rank] + paces[rank]) > now:
            sleep(due - now)
            now = due
        last[rank] = now

    return hook


def pace_faults_from_env() -> Callable[..., None] | None:
    """The pace hook of :data:`PACE_HOOK_ENV`, or None where it is unset.

    Raises:
        ConfigError: a malformed value.
    """
    value = os.environ.get(PACE_HOOK_ENV)
    return pace_faults(value) if value else None
