"""Errors that the ``atoll`` command turns into a one-line message and exit status 2."""

from __future__ import annotations


class AtollError(Exception):
    """A user-facing error: bad configuration, missing data, unusable checkpoint.

    The message is one line that names the offending field (or path) and the fix.
    The command line prints ``atoll: error: <message>`` and exits with status 2.
    """


class ConfigError(AtollError, ValueError):
    """A configuration value is invalid. The message names the field and the fix."""


class DataError(AtollError, ValueError):
    """The data source cannot be read (missing path, unknown format, offline hub)."""


class CheckpointError(AtollError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


class RunFailed(Exception):
    """A run of several processes stopped because one of them failed (not a user-input error).

    The message is the run's one line: what only the launcher knows (a rank killed by a signal), or the line a
    rank stopped by a peer's failure handed to the launcher; empty where the failing rank printed its own (an
    error of its own, or a store that did not take the line).

    Attributes:
        exit_code: the status the command exits with: the first failing rank's exit status, or 128 + N
            for a rank killed by signal N (as a shell reports it).
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class PeerWriteError(OSError):
    """A checkpoint of several processes failed where another process said why (the collective runtime's
    ranks: the first rank that could not write its part, or rank 0 for a part written in the background). Raised
    on the other ranks so that they stop alike (exit status 1) without repeating the one line."""


class Interrupted(KeyboardInterrupt):
    """The run stopped on SIGINT or SIGTERM after writing a checkpoint of the step it had reached
    (:mod:`atoll.job.stop`). A ``KeyboardInterrupt``, so that no ``except Exception`` swallows it.

    Attributes:
        signum: the signal's number (2 for SIGINT, 15 for SIGTERM).
        step: the inner step of the checkpoint written, or None where none could be.
        out: the run folder.
        advice: what to do next (default: ``atoll train --resume OUT``).
        exit_code: 128 + ``signum``, as a shell reports a process ended by that signal (130, 143).
    """

    def __init__(self, signum: int, step: int | None, out: object, advice: str | None = None) -> None:
        import signal

        self.signum, self.step, self.out = signum, step, out
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        advice = advice or f"resume with 'atoll train --resume {out}'"
        where = f"checkpoint written at step {step}; {advice}" if step is not None else "no checkpoint written"
        super().__init__(f"stopped by {name}: {where}")


def disk_error_line(e: OSError, advice: str) -> str:
    """The one line a run stopped by ``e`` (a full disk, a folder made read-only) ends with: the error, the file
    it names, and ``advice`` (how to resume) after freeing space."""
    where = f" ('{e.filename}')" if e.filename else ""
    return f"atoll: error: {e.strerror or e}{where}; free disk space or make the folder writable, then {advice}"


def exception_line(e: BaseException, limit: int = 200) -> str:
    """``e`` as one line: its type and its message's first line (at most ``limit`` characters), for a warning or
    an error that says why something was given up (a compiler's failure, say)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:limit]}"
