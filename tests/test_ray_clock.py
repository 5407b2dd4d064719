"""The clock of a decoupled run on Ray starts at the first inner step; start-up is reported apart."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from atoll.config import build_config  # noqa: E402
from atoll.runtime.ray.actors import SyncerService  # noqa: E402


def test_syncer_clock_starts_at_the_first_inner_step(fast_config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake monotonic clock: the syncer starts at 100 s, the islands join (their start-up: data and model
    prepared) at 130 s and 140 s, take their first steps at 141 s and 143 s, and the run finishes at 150 s.
    The run's clock counts 9 s (from the first step), not 50 s; island 1 started 2 s after island 0."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    config = build_config(overrides={**fast_config, "strategy": "decoupled", "runtime": "ray", "fragments": 2})
    syncer = SyncerService(config.model_dump_json(), fast_config["out"])
    for island, t in ((0, 130.0), (1, 140.0)):
        now[0] = t
        syncer.join(island)
    for island, t in ((0, 141.0), (1, 143.0), (0, 144.0)):
        now[0] = t
        assert syncer.reserve_step(island)[0]
    now[0] = 150.0
    final = syncer.finish()
    assert final["run_s"] == 9.0
    assert final["island_start_s"] == [0.0, 2.0]
    restarted = SyncerService(config.model_dump_json(), fast_config["out"])  # a syncer restarted from its checkpoint
    assert restarted.first_step_s == 41.0 and [i.first_step_s for i in restarted.islands] == [41.0, 43.0]


def test_islands_start_together(fast_config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """No island starts before every island joined (or the start timeout since the first join passed): a CI
    run under load saw island 1's actor start so late that island 0 had spent the shared budget, and island 1's
    run ended at once. The gate is the gRPC server's too (it asks the service)."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    config = build_config(overrides={**fast_config, "strategy": "decoupled", "runtime": "ray", "fragments": 2})
    syncer = SyncerService(config.model_dump_json(), fast_config["out"])
    assert not syncer.wait_start(0, timeout_s=60.0)  # nobody joined
    syncer.join(0)
    now[0] = 150.0
    assert not syncer.wait_start(0, timeout_s=60.0)  # island 1 has not joined yet
    assert syncer.islands[0].heard == syncer._now()  # waiting is heard (the watch does not take it for silence)
    now[0] = 151.0
    syncer.join(1)
    assert syncer.wait_start(0, timeout_s=60.0) and syncer.wait_start(1, timeout_s=60.0)
    with pytest.raises(ValueError, match="wait_start"):
        syncer.wait_start(2)
    late = SyncerService(config.model_dump_json(), str(Path(fast_config["out"]) / "late"))
    late.join(0)
    now[0] = 212.0  # 61 s after the first join: it starts without island 1
    assert late.started(60.0) and late.wait_start(0, timeout_s=60.0)


@pytest.mark.slow
def test_ray_run_reports_startup_apart_from_its_clock(fast_config: dict, tmp_path: Path) -> None:
    """A 2-island run on a local Ray: ``sim_wall_s`` (the run's clock) and ``startup_s`` together fit in the
    command's ``wall_s``; utilization and goodput are over the run's clock; both islands' codec seconds are
    measured; the final evaluation is logged at the run's clock."""
    import subprocess
    import sys

    out = tmp_path / "ray-run"
    cmd = [sys.executable, "-m", "atoll.cli", "train", "--strategy", "decoupled", "--runtime", "ray", "--islands", "2",
           "--fragments", "2", "--sync-every", "4", "--steps", "12", "--model", "micro", "--vocab-size", "512",
           "--seq-len", "32", "--batch-size", "4", "--data", fast_config["data"], "--cache-dir",
           fast_config["cache_dir"], "--eval-batches", "2", "--threads", "1", "--no-progress", "--codec", "int4",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["startup_s"] > 0 and s["sim_wall_s"] > 0
    assert s["sim_wall_s"] + s["startup_s"] <= s["wall_s"]
    # each island that trained pulled the whole model at its join (float32), and the fragments it pushed after
    assert all(r >= 4 * s["params"] and r % 4 == 0
               for r, n in zip(s["bytes_received_by_island"], s["steps_per_island"], strict=True) if n > 0)
    assert s["bytes_received_per_island"] > s["bytes_sent_per_island"] > 0
    # None for an island that started after the shared 24-step budget was spent (a slow start-up)
    starts = [t for t in s["island_start_s"] if t is not None]
    assert starts and min(starts) == 0.0 and all(t >= 0 for t in starts)
    assert len(s["codec_s"]) == 2 and all(c > 0 for c, t in zip(s["codec_s"], s["island_start_s"], strict=True)
                                          if t is not None)
    assert s["compute_utilization"] == pytest.approx(s["compute_s"] / s["sim_wall_s"])
    assert max(s["island_utilization"]) == pytest.approx(s["compute_s"] / s["sim_wall_s"])
    last_eval = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["event"] == "eval"][-1]
    assert last_eval["sim_wall_s"] == s["sim_wall_s"]
    assert s["eval_s"] > 0  # the driver's evaluations, on the device the run names (here: the CPU)


def test_a_syncer_restarted_before_every_island_joined_still_starts_after_the_timeout(
        fast_config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Island 0 joined, then the syncer crashed and Ray restarted it from its ledger before island 1 (whose actor
    keeps failing at start) joined: island 0 does not join again (it only asks wait_start), so the restarted
    syncer's first join is never seen; the start timeout must still run (from the restart), else island 0 waits
    for ever and the run never ends."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    config = build_config(overrides={**fast_config, "strategy": "decoupled", "runtime": "ray", "fragments": 2})
    syncer = SyncerService(config.model_dump_json(), fast_config["out"])
    syncer.join(0)
    now[0] = 110.0
    restarted = SyncerService(config.model_dump_json(), fast_config["out"])  # from the ledger the join wrote
    assert restarted.islands[0].joins > 0
    assert not restarted.wait_start(0, timeout_s=60.0)  # island 1 has not joined yet
    now[0] = 500.0  # long past the start timeout: it starts without island 1
    assert restarted.wait_start(0, timeout_s=60.0)
