"""Stopping at a signal without losing work: SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption) ask the
run to stop; the driver finishes the inner step in progress, writes an atomic checkpoint of it and raises
:class:`~atoll.errors.Interrupted`, which the command line turns into one line and exit status 128 + N (130
for SIGINT, 143 for SIGTERM, as a shell reports a process ended by that signal). A second signal ends the
process at once with the same status (a checkpoint being written is a temporary folder, removed at the next
one; the previous checkpoint stays whole). A resume from that checkpoint continues exactly as the
uninterrupted run would have (the checkpoint is the one ``--checkpoint-every`` writes, at another step).

Drivers read :func:`requested` at the end of each inner step (a flag: no system call); processes of one job
that must stop at the same step agree on it themselves (the collective runtime, through its store).

    with stop.on_signals():          # train() does this on the main thread
        for step in ...:
            ...
            if stop.requested():
                save the checkpoint; raise stop.interrupted(step, out)

The torchtitan trainer checkpoints at SIGTERM the same way (its ``checkpoint`` on ``SIGTERM`` handling).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from atoll.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_signum: int | None = None  # the signal that asked the run to stop (None: none yet)
_signalled = False  # a signal arrived in this process (not only a peer's request relayed): the next one is a second
_depth = 0  # nesting of on_signals()
_at_once: list[Callable[[], None]] = []  # what a second signal does before the process exits (end children)


def requested() -> int | None:
    """The number of the signal that asked this process to stop (or that a peer process relayed), else None."""
    return _signum


def request(signum: int) -> None:
    """Ask the run to stop as if ``signum`` had arrived (a peer's stop relayed; tests). Idempotent."""
    global _signum
    if _signum is None:
        _signum = int(signum)


def reset() -> None:
    """Forget a stop request (a new run in the same process)."""
    global _signum, _signalled
    _signum, _signalled = None, False


def _handler(signum: int, frame: object) -> None:
    """A signal: the first asks the run to stop after its step; a second one *here* ends the process at once. A
    request a peer relayed first (:func:`request`: a collective run's rank whose store poller saw another rank's
    signal before its own arrived) is no first signal of this process: the signal that follows it is its first."""
    global _signum, _signalled
    if _signalled:  # the second signal: at once (the checkpoint being written is a temporary folder)
        _say(f"atoll: {signal.Signals(signum).name} again: stopping at once, without a checkpoint of this step")
        for hook in list(_at_once):
            with contextlib.suppress(Exception):
                hook()
        os._exit(128 + signum)
    _signalled = True
    if _signum is None:
        _signum = signum
    _say(f"atoll: {signal.Signals(signum).name}: finishing this inner step and writing a checkpoint "
         "(send it again to stop at once)")


def _say(line: str) -> None:
    """``line`` on stderr in one write, newline included: a signal to a process group reaches a collective run's
    launcher and every rank at once, and their lines share one stderr (``print`` writes the newline apart, so
    two processes' lines could run into one)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def on_signals() -> Iterator[None]:
    """Route SIGINT and SIGTERM to :func:`requested` while the block runs (main thread only; elsewhere, or
    nested, nothing changes); the previous handlers are restored after it."""
    global _depth
    if threading.current_thread() is not threading.main_thread() or _depth:
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    reset()
    _depth += 1
    try:
        for s in SIGNALS:
            signal.signal(s, _handler)
        yield
    finally:
        _depth -= 1
        for s, h in previous.items():
            signal.signal(s, h)


def reinstall() -> None:
    """Route the signals here again inside :func:`on_signals` (after a library set its own: ``ray.init`` sets a
    SIGTERM handler that exits)."""
    if _depth and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _handler)


@contextlib.contextmanager
def at_once(hook: Callable[[], None]) -> Iterator[None]:
    """While the block runs, a second signal calls ``hook`` (e.g. kill child processes) before exiting."""
    _at_once.append(hook)
    try:
        yield
    finally:
        _at_once.remove(hook)


def interrupted(step: int | None, out: Path | str, advice: str | None = None) -> Interrupted:
    """The exception a driver raises once it has written the checkpoint of inner step ``step`` (None: none)."""
    return Interrupted(_signum or signal.SIGINT, step, out, advice)
