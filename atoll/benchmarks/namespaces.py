"""Network namespaces from Python: run ``ip``/``tc``, check that namespaces work here, enter one from a thread,
read an interface's counters, and remove the namespaces a dead harness left behind.

The building blocks of the emulated WAN (:mod:`atoll.benchmarks.netns`, used by ``atoll bench wan``); they need
root. Every namespace this package creates is named ``atoll-wan-<pid>-<hex>...`` (``PREFIX``), so that a
later harness can tell whose it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

NETNS_DIR = Path("/var/run/netns")
PREFIX = "atoll-wan"
IFNAME = "wan0"  # each island's link, the same name in every island's namespace (for GLOO_SOCKET_IFNAME)

_CLONE_NEWNET = 0x40000000
_STALE = re.compile(rf"^{PREFIX}-(?:probe-)?(\d+)-[0-9a-f]+(?:-|$)")

T = TypeVar("T")


class WanUnavailable(Exception):
    """The emulated WAN cannot be built on this machine; the message is one line saying why."""


class WanError(RuntimeError):
    """A command that builds or removes the emulated WAN failed; the message names it and its error."""


def run_command(*cmd: str, check: bool = True) -> str:
    """Run an iproute2 command; return its stdout. Raises :class:`WanError` when it fails (``check``)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WanError(f"'{' '.join(cmd)}' failed: {e}") from None
    if check and r.returncode != 0:
        raise WanError(f"'{' '.join(cmd)}' failed: {(r.stderr or r.stdout).strip() or r.returncode}")
    return r.stdout


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why an emulated WAN cannot be built here (one line), or None when it can.

    Checks root, the ``ip`` and ``tc`` commands, and then really builds a scratch namespace with a veth
    pair, a bridge and a ``tbf`` qdisc (and removes it), since containers often refuse one of them.
    """
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc); run it as root, e.g. with sudo"
    missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
    if missing:
        return f"needs iproute2 ('{' and '.join(missing)}' not found); install iproute2"
    name = f"{PREFIX}-probe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        run_command("ip", "netns", "add", name)
    except WanError as e:
        return f"'ip netns' is unavailable here ({e})"
    try:
        run_command("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        run_command("ip", "-n", name, "link", "add", "br0", "type", "bridge")
        run_command("tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit", "burst",
                    "32768", "latency", "100ms")
    except WanError as e:
        return f"namespaces work but veth, bridge or tc tbf do not ({e})"
    finally:
        run_command("ip", "netns", "del", name, check=False)
    return None



# ----------------------------------------------------------------------------------------------------------
# entering a namespace from one thread (network namespaces are per thread)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def setns(fd: int) -> None:
    if _libc().setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_netns(name: str) -> int:
    return os.open(NETNS_DIR / name, os.O_RDONLY)


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` called on a short-lived thread that joined network namespace ``name``; its result.

    Sockets and TUN devices it creates belong to that namespace (and stay usable from any thread).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = open_netns(name)
            try:
                setns(fd)
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name=f"atoll-netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def read_netdev() -> dict[str, dict[str, int]]:
    """``/proc/net/dev`` of the calling thread's namespace: per interface rx/tx bytes and packets."""
    out: dict[str, dict[str, int]] = {}
    with open("/proc/thread-self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            v = [int(x) for x in rest.split()]
            out[name.strip()] = {"rx_bytes": v[0], "rx_packets": v[1], "tx_bytes": v[8], "tx_packets": v[9]}
    return out



def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_pids(name: str) -> list[int]:
    return [int(p) for p in run_command("ip", "netns", "pids", name, check=False).split()]


def remove_stale_namespaces() -> tuple[list[str], int]:
    """Delete the namespaces of this module whose creating process is gone (a run killed with SIGKILL, which
    could not clean up), ending the processes still inside them first: those are that run's ranks, started
    through its namespaces. Returns the namespaces' names and how many processes were ended."""
    removed, ended = [], 0
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(os.listdir(NETNS_DIR)):
            m = _STALE.match(entry)
            if not m or _alive(int(m.group(1))):
                continue
            for pid in netns_pids(entry):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    ended += 1
            run_command("ip", "netns", "del", entry, check=False)
            removed.append(entry)
    return removed, ended


def namespace_exists(name: str) -> bool:
    """True when ``ip netns`` still lists ``name``."""
    return (NETNS_DIR / name).exists()
