"""The service's figures are true: an island's bytes, compute and tokens summed over its sessions, the run's wall
time, no simulated-link field, merged tokens never above trained ones across a syncer restart, no report that
stops the summary, and a syncer state bounded however often islands join."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

CREDS = ["a" * 32, "b" * 32]


def _config(fast_config: dict, **settings: object):  # noqa: ANN202
    from atoll.config import build_config

    base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
    return build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "fragments": 2, **settings})


def _server(config, out: Path):  # noqa: ANN001, ANN202
    from atoll.runtime.service.server import SyncerServer

    return SyncerServer.of_run(config, out, CREDS)


def _push_round(s, island: int, session: int, tokens: int) -> list[bool]:  # noqa: ANN001
    """``island`` pushes a small Δ of each fragment claiming ``tokens``: accepted per fragment."""
    from atoll.strategies.decoupled.protocol import Push

    accepted = []
    for p in range(s.syncer.fragments):
        pull = s.syncer.pull(p)
        delta = 1e-4 * torch.ones_like(pull.params)
        accepted.append(s.push(Push(island, p, delta, tokens, pull.version, session=session, nbytes=100,
                                    credential=CREDS[island]))[0])
    return accepted


def test_an_islands_bytes_compute_and_tokens_sum_over_its_sessions(fast_config: dict, tmp_path: Path) -> None:
    """Island 0's job is killed after a round (it never leaves) and torchrun starts it again: its summary counts
    both sessions' bytes and compute (and lists them), not the last one's; ``wall_s`` is the run's wall time (the
    syncer's clock, here 100 s), ``run_s`` the training clock; no simulated-link field in a real run."""
    from atoll.runtime.service.serve import finish_run

    config = _config(fast_config)
    out = tmp_path / "syncer"
    state = _server(config, out)
    s, tps = state.service, config.tokens_per_step
    s.t0 -= 100.0  # the syncer started 100 s ago (waiting for the islands, training)
    first = s.join(0, CREDS[0])[3]
    s.join(1, CREDS[1])
    assert s.reserve_steps(0, CREDS[0], 5, used=0, compute_s=0.0, bytes_sent=0.0) == 5
    assert s.reserve_steps(0, CREDS[0], 5, used=5, compute_s=2.0, bytes_sent=100.0,
                           bytes_received=800.0) == 5  # killed after this
    second = s.join(0, CREDS[0])[3]  # torchrun's restart: a new session, whose figures start at 0
    assert second > first
    assert s.reserve_steps(0, CREDS[0], 5, used=0, compute_s=0.5, bytes_sent=10.0) == 5
    s.leave_session(0, used=5, compute_s=1.5, bytes_sent=60.0, bytes_received=480.0)
    assert s.reserve_steps(1, CREDS[1], 5, used=0) == 5
    s.leave_session(1, used=5, compute_s=1.0, bytes_sent=40.0)
    state.left = {0: {"compute_s": 1.5, "bytes_sent": 60.0}, 1: {"compute_s": 1.0, "bytes_sent": 40.0}}
    state.final = s.finish()
    summary = finish_run(config, out, state)
    assert summary["bytes_sent_by_island"] == [160.0, 40.0]
    assert summary["bytes_received_by_island"] == [1280.0, 0.0]  # the pulls, summed over the sessions as well
    assert summary["bytes_received_per_island"] == 640.0
    assert summary["compute_s_by_island"] == [3.5, 1.0] and summary["compute_s"] == 3.5
    run_s = summary["run_s"]
    assert 0 < run_s < 100 and summary["island_utilization"] == [3.5 / run_s, 1.0 / run_s]
    assert summary["steps_per_island"] == [10, 5]  # 5 of the killed session's 10 never said used: back
    assert [[(x["steps"], x["compute_s"], x["bytes_sent"], x["tokens"]) for x in island]
            for island in summary["island_sessions"]] == [[(5, 2.0, 100.0, 5 * tps), (5, 1.5, 60.0, 5 * tps)],
                                                          [(5, 1.0, 40.0, 5 * tps)]]
    assert summary["wall_s"] >= 100.0  # the syncer's clock, not the final evaluation's seconds
    assert "sim_wall_s" not in summary and "link_bandwidth_mbps" not in summary
    assert summary["compute_utilization"] == pytest.approx(3.5 / summary["wall_s"])
    on_disk = json.loads((out / "run" / "summary.json").read_text())
    assert on_disk["bytes_sent_by_island"] == [160.0, 40.0] and "sim_wall_s" not in on_disk


@pytest.mark.parametrize("committed", [True, False], ids=["after-a-commit", "before-the-first-commit"])
def test_merged_tokens_never_exceed_trained_tokens_across_a_syncer_restart(fast_config: dict, tmp_path: Path,
                                                                           committed: bool) -> None:
    """Steps granted after the last commit's checkpoint, or before the first (no checkpoint yet), are in the ledger
    a restarted syncer reads (``ledger.json``): it counts them as trained, has started (no island needs to join it
    again: before, every lease waited for joins that never came), accepts the islands' pushes of those steps in
    their sessions, grants no tokens beyond them, and the merged tokens stay at most the tokens trained."""
    config = _config(fast_config)
    out = tmp_path / "syncer"
    s = _server(config, out).service
    tps, h = config.tokens_per_step, config.strategy_config.sync_every
    sessions = [s.join(i, CREDS[i])[3] for i in range(2)]
    for i in range(2):
        assert s.reserve_steps(i, CREDS[i], h) == h
        if committed:
            assert all(_push_round(s, i, sessions[i], h * tps))
    if committed:
        assert s.syncer.commits >= 1
        for i in range(2):  # a round granted after the checkpoint, then the syncer is killed
            assert s.reserve_steps(i, CREDS[i], h, used=h) == h
        assert s.writer.flush(timeout=60)
    else:
        assert s.syncer.commits == 0 and not (out / "syncer" / "checkpoints").exists()
    rounds = 2 if committed else 1
    restarted = _server(config, out).service
    assert restarted.restarts == 1 and restarted.reserved == 2 * rounds * h
    assert [i.steps for i in restarted.islands] == [rounds * h, rounds * h]
    for i in range(2):  # the islands push the round they trained meanwhile: accepted
        assert all(_push_round(restarted, i, sessions[i], h * tps))
        assert not any(_push_round(restarted, i, sessions[i], tps))  # not a token more than granted
    assert restarted.syncer.commits >= 1
    final = restarted.finish()
    trained = sum(final["steps_by_island"]) * tps
    assert final["merged_tokens"] == pytest.approx(trained) and final["merged_tokens"] <= trained


def test_an_unbounded_leave_report_is_refused_and_never_stops_the_summary(fast_config: dict,
                                                                          tmp_path: Path) -> None:
    """``compute_s`` of 10^400 - 1 (a float beyond double's range) is refused by the schema, with the other
    figures that are not finite numbers >= 0; a report saved before (left.json) or reported otherwise can no
    longer stop the finish: the summary is written."""
    from atoll.runtime.service import schema
    from atoll.runtime.service.serve import finish_run

    for bad in (b"9" * 400, b"-1", b"1e400", b"NaN", b"Infinity"):
        with pytest.raises(schema.SchemaError, match="compute_s"):
            schema.parse(schema.LeaveRequest, b'{"compute_s": ' + bad + b"}")
        with pytest.raises(schema.SchemaError, match="bytes_sent"):
            schema.parse(schema.ReserveStepsRequest, b'{"bytes_sent": ' + bad + b"}")
    assert schema.parse(schema.LeaveRequest, b'{"compute_s": 12.5, "last_loss": NaN}').compute_s == 12.5
    config = _config(fast_config)
    out = tmp_path / "syncer"
    state = _server(config, out)
    s = state.service
    for i in range(2):
        s.join(i, CREDS[i])
        s.reserve_steps(i, CREDS[i], 5, compute_s=10**400 - 1, bytes_sent=float("inf"))
        s.leave_session(i, used=5, compute_s=float("nan"), bytes_sent=10**400 - 1)
    state.left = {0: {"compute_s": 10**400 - 1, "bytes_sent": 10**400 - 1}, 1: {"compute_s": "x"}}
    state.final = s.finish()
    summary = finish_run(config, out, state)
    assert summary["compute_s_by_island"] == [0.0, 0.0] and summary["bytes_sent_by_island"] == [0.0, 0.0]
    assert (out / "run" / "summary.json").exists()


def test_the_syncers_state_is_bounded_however_often_islands_join(fast_config: dict, tmp_path: Path) -> None:
    """3,000 Joins (a stranger's spam with a stolen credential, or a crash loop) leave the checkpoint's service
    state and the ledger the size they had after 300: rejoin times kept as a count, sum, max and a window, an
    island's sessions as a window and their totals."""
    from atoll.runtime.service.island_state import REJOIN_WINDOW

    config = _config(fast_config)
    out = tmp_path / "syncer"
    s = _server(config, out).service

    def sizes() -> tuple[int, int]:
        return len(json.dumps(s.service_state())), (out / "syncer" / "ledger.json").stat().st_size

    for _ in range(300):
        s.join(0, CREDS[0])
    after_300 = sizes()
    for _ in range(2700):
        s.join(0, CREDS[0])
    after_3000 = sizes()  # (a few digits more: session numbers, counts, the clock)
    assert all(now <= 1.1 * before for before, now in zip(after_300, after_3000, strict=True)), (after_300, after_3000)
    assert s.islands[0].joins == 3000 and len(s.islands[0].sessions) < 100
    times = s.finish()["rejoin_times"]
    assert times["count"] == 2999 and len(s.rejoins.recent) == REJOIN_WINDOW
    assert times["max_s"] >= times["p90_s"] >= times["p50_s"] >= 0.0


def test_a_checkpoint_of_parallel_lists_loads_as_one_record_per_island() -> None:
    """A syncer checkpoint written before the per-island records (one list per figure, every rejoin time) loads."""
    from atoll.runtime.service.island_state import IslandState, RejoinTimes

    old = {"steps_by_island": [3, 4], "joins": [1, 2], "leased": [5, 0], "lease_used": [2, 0],
           "island_first_step_s": [1.5, None], "rejoin_s": [2.0, 4.0]}
    islands = IslandState.of_lists(old, 2)
    assert [(i.steps, i.joins, i.leased, i.lease_used, i.first_step_s) for i in islands] == \
        [(3, 1, 5, 2, 1.5), (4, 2, 0, 0, None)]
    assert [IslandState.of(i.state_dict()) for i in islands] == islands
    times = RejoinTimes.of(old["rejoin_s"])
    assert times.summary()["count"] == 2 and times.summary()["mean_s"] == 3.0 and times.summary()["max_s"] == 4.0
    assert RejoinTimes.of(times.state_dict()).state_dict() == times.state_dict()
