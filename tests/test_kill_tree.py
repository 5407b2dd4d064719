"""atoll.benchmarks.common.descendants and kill_tree: odd process names, and workers in sessions of their own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from atoll.benchmarks.common import descendants, kill_tree

NAMER = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, bytes.fromhex(sys.argv[1]), 0, 0, 0); "
         "print(flush=True); time.sleep(60)")


def _named(name: bytes) -> subprocess.Popen:
    """A child of this process whose comm (/proc/PID/stat's second field) is ``name``."""
    p = subprocess.Popen([sys.executable, "-c", NAMER, name.hex()], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline()
    return p


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@pytest.mark.parametrize("name", [b") 1 2 (x", b"a b) S 1", "entra\u00eenement".encode()[:6], b"\xff\xfe"],
                         ids=["paren-spaces", "fake-fields", "utf8-cut", "not-utf8"])
def test_descendants_reads_any_process_name(name: bytes) -> None:
    """A process's name is any 15 bytes (prctl PR_SET_NAME, or an executable's name cut at 15 bytes, which can
    cut a UTF-8 character in two): descendants still finds this process's children, and kill_tree kills them,
    whatever the names of the machine's processes."""
    child = _named(name)
    try:
        assert child.pid in descendants(os.getpid())
        kill_tree(child.pid)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_kill_tree_kills_workers_in_sessions_of_their_own() -> None:
    """A parent (as torchrun's agent) whose child runs in a session of its own, and that child's child: all
    three are killed."""
    script = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', \"import subprocess, sys, "
              "time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)\"], "
              "start_new_session=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(below := descendants(parent.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kill_tree(parent.pid)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in below):
            assert time.monotonic() < deadline, [(_state(p), p) for p in below]
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "gone"
