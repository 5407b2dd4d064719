"""How a rank of the collective runtime learns that another failed: exit status, test hook, PeerFailure."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from typing import Any, NamedTuple

from atoll.errors import ConfigError

EXIT_PEER_FAILURE = 3  # exit status of a rank that stopped because another rank stopped responding
KILL_HOOK_ENV = "ATOLL_TEST_KILL_RANK_AT_STEP"
HEARTBEAT_S = 0.5  # seconds between two heartbeats of a rank
HEARTBEAT_STALE_S = 10.0  # a rank silent this long (or collective_timeout_s if shorter) is declared dead
REPORT_KEY = "atoll/reported/"  # + global rank, in the rendezvous store: peers found it silent (the launcher
# kills such a rank at once: a frozen process holds its connections open and would stall the others)


class PeerFailure(Exception):
    """A collective failed or timed out: another rank died, hung or became unreachable.

    Args:
        reason: one line saying what the backend reported.
        suspect: the global rank known to have failed, if known.
    """

    def __init__(self, reason: str, suspect: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.suspect = suspect


def backend_reason(e: BaseException) -> str:
    """The backend's message cut to one short line (no source location, no advice)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    text = text.split(". This is typically")[0].rstrip(". ")
    return text[:160] or type(e).__name__


def dist_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a ``torch.distributed`` call; turn a backend failure (RuntimeError) into :class:`PeerFailure`."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise PeerFailure(backend_reason(e)) from e


#: what a backend's error says when a peer is gone (gloo, NCCL, the store): a RuntimeError raised by a pass
#: whose gradient hooks all-reduce (torch DDP's) is a PeerFailure only then, else the error it is
PEER_GONE = re.compile(r"gloo|nccl|connection|peer|timed ?out|closed|broken pipe|store", re.IGNORECASE)


def hooked_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a computation whose hooks make collectives (a backward pass under torch DDP); turn a backend
    failure into :class:`PeerFailure`, as :func:`dist_call` does for a collective, and re-raise any other error."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        if PEER_GONE.search(str(e)):
            raise PeerFailure(backend_reason(e)) from e
        raise


def in_worker() -> bool:
    """True in a process started by torchrun or by :func:`launch` (``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class KillAt(NamedTuple):
    """One entry of the test hook: global rank ``rank`` gets ``signal`` as it starts inner step ``step``
    (1-based), or, with ``after_rejoin``, ``step`` inner steps after the job's first rejoin."""

    rank: int
    step: int
    signal: signal.Signals
    after_rejoin: bool = False


def parse_kill_hook() -> list[KillAt]:
    """The test hook's entries from ``KILL_HOOK_ENV``, [] if unset: one or more ``RANK:STEP[:STOP|KILL]``
    separated by commas; ``STEP`` as ``+N`` counts from the job's first rejoin. ``1:40,2:80``: rank 1 dies at
    step 40, rank 2 at 80; a restarted rank inherits the hook, so ``1:8,1:+5`` kills rank 1 at step 8 and its
    restarted process 5 steps after it rejoined (``1:8,2:+5``: rank 2 dies 5 steps after rank 1 rejoined).

    Raises:
        ConfigError: a malformed value.
    """
    value = os.environ.get(KILL_HOOK_ENV)
    if not value:
        return []
    entries = []
    try:
        for entry in value.split(","):
            rank, step, *how = entry.strip().split(":")
            if how not in ([], ["STOP"], ["KILL"]):
                raise ValueError(value)
            entries.append(KillAt(int(rank), int(step), signal.SIGSTOP if how == ["STOP"] else signal.SIGKILL,
                                  after_rejoin=step.startswith("+")))
    except ValueError:
        raise ConfigError(f"{KILL_HOOK_ENV}: expected RANK:STEP[:STOP] entries separated by commas, STEP as N or "
                          f"+N after the first rejoin (e.g. 1:7 or 1:7,2:+5), got {value!r}") from None
    return entries
