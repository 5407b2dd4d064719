"""One process per run folder: an advisory lock held for the run's lifetime.

Two ``atoll train`` processes writing the same folder (the same ``--out`` twice, or ``--resume`` of a run
that is still training) would interleave their ``metrics.jsonl`` lines and race on checkpoints. The process
that owns a run holds an exclusive ``flock`` on ``<out>/.atoll.lock`` (which also names its pid); a second
one is refused with one line naming that pid. The kernel drops the lock when the owner exits, however it
exits (a crash or SIGKILL leaves no stale lock behind). On platforms without ``fcntl`` (Windows) no lock is
taken.
"""

from __future__ import annotations

import os
from pathlib import Path

from atoll.errors import ConfigError

LOCK_NAME = ".atoll.lock"


class RunLock:
    """An exclusive lock on a run folder, held until :meth:`release` or the process's exit.

    Args:
        out: the run folder (must exist).

    Raises:
        ConfigError: another live process holds the folder (field ``out``: its pid and the fix).
    """

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOCK_NAME
        self.fd: int | None = None
        self.created = False  # set by claim_run_folder when this process made the folder
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no advisory lock
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            # (a collective run's ranks hold it past their launcher)
            if owner.isdigit() and not process_running(int(owner)):
                raise ConfigError(f"out: '{out}' is in use, though atoll process {owner}, which took it, is not "
                                  "running here (a collective run's ranks outlive a killed launcher by seconds; or "
                                  "a process on another host or in another pid namespace holds it); wait for them "
                                  "to end, or choose another --out") from None
            raise ConfigError(f"out: '{out}' is in use by another atoll process (pid {owner}); wait for it to end "
                              "or stop it, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd

    def release(self) -> None:
        """Drop the lock (closing the file releases it); a second call does nothing."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:  # a Run dropped after an exception (in-process callers, tests) frees its folder
        self.release()

    def abandon(self) -> None:
        """Drop the lock of a run that failed before writing anything: a folder this process created and
        that holds only the lock file is removed again, so bad input leaves nothing behind."""
        self.release()
        folder = self.path.parent
        if self.created and folder.is_dir() and {e.name for e in folder.iterdir()} <= {LOCK_NAME}:
            self.path.unlink(missing_ok=True)
            folder.rmdir()


def process_running(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and has not ended (a zombie not yet reaped has), read from
    ``/proc`` on Linux, else by a signal 0 (another user's process counts as running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        if Path("/proc/self/stat").exists():  # Linux: no /proc entry, no process
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def claim_run_folder(out: Path | None, strategy: str, resume: bool) -> tuple[Path, RunLock]:
    """The run folder of this process, locked: ``out`` to resume, or a new one (:func:`new_run_dir`).

    The lock is taken before the folder's contents are judged, so a live run is named as such (not as an
    unfinished one).

    Raises:
        ConfigError: the folder is in use by another process, or (new runs) already holds a run or is not
            writable.
    """
    from atoll.job.checkpoint import new_run_dir

    if resume or (out is not None and Path(out).is_dir()):
        lock = RunLock(Path(out))  # type: ignore[arg-type]
        try:
            return (Path(out) if resume else new_run_dir(out, strategy)), lock  # type: ignore[arg-type]
        except BaseException:
            lock.release()
            raise
    path = new_run_dir(out, strategy)
    lock = RunLock(path)
    lock.created = True
    return path, lock
