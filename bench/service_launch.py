"""Starting the service's processes on loopback for a study: ports, a corpus, the status, ``atoll syncer`` and
``atoll island`` commands, torchrun jobs, each process in a session of its own.

Shared by ``bench/service_failover.py`` and ``bench/service_soak.py``. Not a study: no results of its own.
Every process is started with ``start_new_session=True`` (its own process group, and its own session, so Linux
schedules it as a job of its own, as docs/deployment.md advises for shards), and is ended by the caller by pid
(:func:`atoll.benchmarks.common.kill_tree`), never by name.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: torchrun on one host, its rendezvous its own (a free port per job), its agent watching the workers every 0.1 s
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval", "0.1"]


def study_env() -> dict[str, str]:
    """The environment of every process a study starts: one torch thread (``OMP_NUM_THREADS=1``), this
    checkout's code first on the path (the processes import the code being measured), gRPC's C++ log quiet."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GRPC_VERBOSITY": "ERROR"}


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the kernel's choice; another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_corpus(path: Path, large: bool = False) -> Path:
    """Write a text corpus to ``path``; return ``path``. Small: the sources of Python's ``json`` package, joined
    (48 KB: enough for a study of minutes). ``large``: every top-level module of Python's standard library,
    joined (about 4.7 MB, 1.8 M tokens at the micro preset's vocabulary: a study of millions of tokens, such as
    the soak's 17 M, that the small one would let the model memorise)."""
    std = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(std.glob("*.py")) if large else sorted((std / "json").glob("*.py"))
    path.write_text("\n\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files))
    return path


def read_status(folder: Path) -> dict[str, Any]:
    """A syncer's ``folder/service/status.json`` (a shard's folder is ``OUT/shard_<S>``); ``{}`` where it is
    missing or being replaced."""
    try:
        status = json.loads((folder / "service" / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def children(pid: int) -> list[int]:
    """The live children of ``pid`` (``pgrep -P``; ``[]`` where there is none or no pgrep)."""
    try:
        return [int(x) for x in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True,
                                               check=False).stdout.split()]
    except OSError:
        return []


def launch(cmd: Sequence[str], log: Path, env: dict[str, str], extra: dict[str, str] | None = None,
           append: bool = False) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own, stdout and stderr into ``log`` (appended to with ``append``: a
    restarted process's lines after its predecessor's), with ``env`` and ``extra`` on top."""
    return subprocess.Popen(list(cmd), env={**env, **(extra or {})}, stdout=log.open("a" if append else "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def syncer_command(out: Path, listen: str, flags: Sequence[str], shard: int | None = None,
                   shards: Sequence[str] = ()) -> list[str]:
    """``atoll syncer`` (plaintext, loopback) into ``out``: one syncer, or shard ``shard`` of ``shards``."""
    sharded = ["--shard", str(shard), "--shards", ",".join(shards)] if shard is not None else []
    return [sys.executable, "-m", "atoll", "syncer", *sharded, "--listen", listen, "--out", str(out), *flags]


def island_args(island: int, syncers: Sequence[str], credentials: Path, flags: Sequence[str],
                give_up_s: float = 300) -> list[str]:
    """``island ...``: the arguments of ``atoll island`` (after ``-m atoll``) for island ``island`` dialling
    ``syncers`` (one address, or every shard's) in plaintext, its credential from the folder ``credentials``."""
    return ["island", "--syncer", ",".join(syncers), "--plaintext", "--island", str(island), "--credential",
            str(credentials / f"island_{island}.token"), "--give-up-s", f"{give_up_s:g}", *flags]
