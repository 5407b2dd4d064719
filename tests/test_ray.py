"""The ray runtime of decoupled: an island process SIGKILLed mid-run restarts, rejoins, and nothing committed is
lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import syncer_commits_on_disk

pytestmark = pytest.mark.slow  # real processes (and Ray) in every test

pytest.importorskip("ray")


def _kill_mid_run(fast_config: dict, out: Path, steps: int, victim: str, min_commits: int,
                  *flags: str) -> tuple[int, str, int, int]:
    """A 2-island micro decoupled run on Ray whose process ``victim`` (``island_1`` or ``syncer``) is SIGKILLed
    once the syncer has committed ``min_commits`` outer steps; returns (exit status, output, the killed pid,
    commits on disk when it died)."""
    cmd = [sys.executable, "-m", "atoll.cli", "train", "--strategy", "decoupled", "--runtime", "ray",
           "--islands", "2", "--fragments", "2", "--sync-every", "4", "--steps", str(steps), "--model", "micro",
           "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--data", fast_config["data"],
           "--cache-dir", fast_config["cache_dir"], "--eval-batches", "2", "--threads", "1", "--no-progress",
           *flags, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        pid_file = out / "ray" / f"{victim}.pid"
        while syncer_commits_on_disk(out) < min_commits or not pid_file.is_file():  # up, the syncer committing
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no commit within 240 s"
            time.sleep(0.2)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
        committed_before = syncer_commits_on_disk(out)  # on disk when it died: nothing of it may be lost
        output, _ = proc.communicate(timeout=300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and the local Ray it started
        proc.wait()
        raise
    return proc.returncode, output, pid, committed_before


def test_killed_island_restarts_and_rejoins(fast_config: dict, tmp_path: Path) -> None:
    out = tmp_path / "ray-run"
    returncode, output, pid, committed_before = _kill_mid_run(
        fast_config, out, 400, "island_1", 2, "--ray-island-resources", "region_a=1;region_b=1", "--quorum", "2")
    assert returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == [0, 1] and summary["rejoins"] == [0, 1], summary
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]  # the failure and the rejoin are run events too, with their island
    assert [e["island"] for e in events if e["event"] in ("failure", "rejoin")] == [1, 1], kinds
    assert kinds.index("failure") < kinds.index("rejoin")
    assert kinds.count("merge") == summary["commits"] and kinds.count("train") > 0  # progress while it trained
    assert (out / "timeline.png").is_file()
    assert summary["rejoin_s"] and max(summary["rejoin_s"]) < 30, summary["rejoin_s"]
    assert int((out / "ray" / "island_1.pid").read_text()) != pid, "a new process runs island 1"
    # the syncer kept committing, and lost no committed step: every commit is a version of a fragment,
    # and its last atomic checkpoint holds them all
    assert summary["commits"] > committed_before
    assert sum(summary["versions"]) == summary["commits"] == syncer_commits_on_disk(out)
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
    returncode, output, pid, committed_before = _kill_mid_run(fast_config, out, 300, "syncer", 4)
    assert returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["syncer_restarts"] == 1, summary
    assert int((out / "ray" / "syncer.pid").read_text()) != pid, "a new process runs the syncer"
    # it went on from its checkpoint: every commit before the crash is among the final ones
    assert summary["commits"] > committed_before
    assert sum(summary["versions"]) == summary["commits"] == syncer_commits_on_disk(out)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert sum(summary["steps_per_island"]) >= 2 * 300
