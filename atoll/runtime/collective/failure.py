"""How a rank of the collective runtime learns that another failed: exit status, heartbeat, PeerFailure."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

EXIT_PEER_FAILURE = 3  # exit status of a rank that stopped because another rank stopped responding
HEARTBEAT_S = 0.5  # seconds between two heartbeats of a rank
HEARTBEAT_STALE_S = 10.0  # a rank silent this long (or collective_timeout_s if shorter) is declared dead
REPORT_KEY = "atoll/reported/"  # + global rank, in the rendezvous store: peers found it silent (the launcher
# kills such a rank at once: a frozen process holds its connections open and would stall the others)
LINE_KEY = "atoll/line/"  # + global rank, in the one-machine launcher's store: why that rank stopped on a peer's
# failure, for the launcher to say once for the run (each survivor would otherwise print its own copy)
LINES_ENV = "ATOLL_LAUNCHER_SAYS_WHY"  # "1" in a rank the one-machine launcher started: hand the line over


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
    if len(text) > 160:  # the cause ends the backend's text ("... Connection closed by peer [host]:port"): keep it
        text = f"{text[:60]} ... {text[-95:]}"
    return text or type(e).__name__


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
