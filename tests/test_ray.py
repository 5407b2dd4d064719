"""The ray runtime of decoupled: an island process SIGKILLed mid-run restarts, rejoins, and nothing committed is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")


def _latest_commits(out: Path) -> int:
    latest = out / "syncer" / "checkpoints" / "latest"
    try:
        return int(latest.read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_killed_island_restarts_and_rejoins(fast_config: dict, tmp_path: Path) -> None:
    out = tmp_path / "ray-run"
    cmd = [sys.executable, "-m", "atoll.cli", "train", "--strategy", "decoupled", "--runtime", "ray",
           "--islands", "2", "--fragments", "2", "--sync-every", "4", "--steps", "400", "--model", "micro",
           "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--data", fast_config["data"],
           "--cache-dir", fast_config["cache_dir"], "--eval-batches", "2", "--threads", "1", "--no-progress",
           "--ray-island-resources", "region_a=1;region_b=1", "--quorum", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        pid_file = out / "ray" / "island_1.pid"
        while _latest_commits(out) < 2 or not pid_file.is_file():  # both islands up, the syncer committing
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no commit within 240 s"
            time.sleep(0.2)
        committed_before = _latest_commits(out)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and the local Ray it started
        proc.wait()
        raise
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == [0, 1] and summary["rejoins"] == [0, 1], summary
    assert summary["rejoin_s"] and max(summary["rejoin_s"]) < 30, summary["rejoin_s"]
    assert int((out / "ray" / "island_1.pid").read_text()) != pid, "a new process runs island 1"
    # the syncer kept committing, and lost no committed step: every commit is a version of a fragment,
    # and its last atomic checkpoint holds them all
    assert summary["commits"] > committed_before
    assert sum(summary["versions"]) == summary["commits"] == _latest_commits(out)
    # a full quorum (2 of 2) is needed to merge at once: while island 1 was down, island 0's pushes were
    # merged alone when their grace window closed, never held longer than the window (plus the gap between
    # two calls, which is when the syncer's clock advances on Ray: one inner step; 5 s is generous)
    assert summary["quorum_size_min"] == 1 and summary["grace_window_max_s"] > 0, summary
    assert summary["merge_overrun_max_s"] < 5.0, summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert sum(summary["steps_per_island"]) == 2 * 400
    # each island was placed by its custom resource (the local Ray declared them), on this machine's node
    assert summary["island_resources"] == [{"region_a": 1.0}, {"region_b": 1.0}]
    assert len(set(summary["island_nodes"])) == 1 and None not in summary["island_nodes"]


def test_killed_syncer_restarts_from_its_checkpoint(fast_config: dict, tmp_path: Path) -> None:
    out = tmp_path / "ray-syncer"
    cmd = [sys.executable, "-m", "atoll.cli", "train", "--strategy", "decoupled", "--runtime", "ray",
           "--islands", "2", "--fragments", "2", "--sync-every", "4", "--steps", "300", "--model", "micro",
           "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--data", fast_config["data"],
           "--cache-dir", fast_config["cache_dir"], "--eval-batches", "2", "--threads", "1", "--no-progress",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        pid_file = out / "ray" / "syncer.pid"
        while _latest_commits(out) < 4 or not pid_file.is_file():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no commit within 240 s"
            time.sleep(0.2)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
        committed_before = _latest_commits(out)  # on disk when it died: nothing of it may be lost
        output, _ = proc.communicate(timeout=300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["syncer_restarts"] == 1, summary
    assert int(pid_file.read_text()) != pid, "a new process runs the syncer"
    # it went on from its checkpoint: every commit before the crash is among the final ones
    assert summary["commits"] > committed_before
    assert sum(summary["versions"]) == summary["commits"] == _latest_commits(out)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert sum(summary["steps_per_island"]) >= 2 * 300
