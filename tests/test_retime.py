"""Re-timing a finished run at another link from its clock trace (atoll.runtime.network.replay)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atoll.config import build_config
from atoll.config.applies import applicable
from atoll.job.metrics import read_metrics
from atoll.runtime.network import ClockTrace, Link, SimClock, load_trace, replay
from atoll.training import train


def test_replay_of_a_hand_made_trace_matches_the_clock() -> None:
    link = Link.from_config(10, 5)
    clock = SimClock(2, trace=ClockTrace(2))
    clock.compute(0, 1.0)
    clock.compute(1, 2.0)
    clock.collective(link.transfer_seconds(1e6, 2), (1e6, 2))      # blocking: ends at 2 + 0.8 + 0.01
    end = clock.start_collective(link.transfer_seconds(2.5e6, 2), (2.5e6, 2))  # overlapped: 2 s + 0.01
    ident = clock.last_collective
    clock.compute(0, 0.5)
    clock.compute(1, 3.0)
    clock.wait_until(0, end, ident)
    clock.wait_until(1, end, ident)
    trace = clock.trace.to_dict()
    same = replay(trace, link)
    assert same["sim_wall_s"] == pytest.approx(clock.wall_s)
    assert same["sim_wall_s"] == pytest.approx(2.81 + 3.0)  # island 1's 3 s hide the 2.01 s exchange
    fast = replay(trace, Link.from_config(1000, 5))
    assert fast["sim_wall_s"] == pytest.approx(2.0 + 0.008 + 0.01 + 3.0)
    slow = replay(trace, Link.from_config(1, 5))  # 8 s + 20 s: the overlapped exchange is exposed
    assert slow["sim_wall_s"] == pytest.approx(2.0 + 8.01 + 20.01)
    assert slow["compute_s"] == pytest.approx(5.0)
    assert slow["compute_utilization"] == pytest.approx(5.0 / slow["sim_wall_s"])


def test_incomplete_trace_is_refused() -> None:
    clock = SimClock(1, trace=ClockTrace(1))
    clock.wait_until(0, 1.0)  # a wait the trace cannot attribute
    with pytest.raises(ValueError, match="resumed"):
        replay(clock.trace.to_dict(), Link.from_config(10, 5))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,extra", [
    ("ddp", {}), ("diloco", {}), ("demo", {}),
    ("streaming", {"fragments": 2, "overlap_steps": 2, "codec": "int4"}),
])
def test_run_trace_replays_to_its_own_sim_wall(fast_config: dict, strategy: str, extra: dict) -> None:
    cfg = {**fast_config, "steps": 10, "eval_every": 5, "checkpoint_every": 0, "strategy": strategy,
           "link_bandwidth_mbps": 1.0, **extra}
    summary = train(build_config(overrides=applicable(cfg)))
    trace = load_trace(Path(cfg["out"]) / "clock_trace.json")
    assert trace["link_bandwidth_mbps"] == 1.0
    same = replay(trace, Link.from_config(1.0, 10.0))
    assert same["sim_wall_s"] == pytest.approx(summary["sim_wall_s"], rel=1e-9)
    assert same["compute_s"] == pytest.approx(summary["compute_s"], rel=1e-9)
    faster = replay(trace, Link.from_config(1000.0, 10.0))
    assert faster["sim_wall_s"] < same["sim_wall_s"]
    if strategy != "streaming":  # blocking collectives: only the bandwidth term moves (bits / bandwidth)
        bits = summary["bytes_sent_per_island"] * 8
        assert faster["sim_wall_s"] == pytest.approx(summary["sim_wall_s"] - bits / 1e6 + bits / 1e9, rel=1e-9)
    saved = json.loads((Path(cfg["out"]) / "summary.json").read_text())
    assert saved["sim_wall_s"] == summary["sim_wall_s"]
    # the evaluations are marks of the trace: re-timed at the link it trained on, they fall where they did
    evals = {e["step"]: e["sim_wall_s"] for e in read_metrics(Path(cfg["out"]) / "metrics.jsonl")
             if e["event"] == "eval" and e["step"] > 0}
    assert set(same["marks"]) == set(evals) == {5, 10}
    for step, t in evals.items():
        assert same["marks"][step] == pytest.approx(t, rel=1e-9)
        assert faster["marks"][step] <= t
    # scaled compute: a reference step time moves the compute, not the exchanges
    double = replay(trace, Link.from_config(1.0, 10.0), compute_scale=2.0)
    assert double["compute_s"] == pytest.approx(2 * same["compute_s"], rel=1e-9)
