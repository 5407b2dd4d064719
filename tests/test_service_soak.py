"""bench/service_soak.py's figures, from records made by hand: rates from leased grants, the share of a run an
island was up, the islands up at a merge, participation, rejoin percentiles, committed steps lost; and the
shared launch helpers (bench/service_launch.py) that bench/service_failover.py uses too. Nothing is started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import service_failover, service_launch, service_soak


def test_edge_rate_counts_from_the_first_grant_to_the_last() -> None:
    grants = [(0.0, [0, 0]), (1.0, [40, 10]), (3.0, [80, 10]), (5.0, [120, 20]), (9.0, [160, 30])]
    assert service_soak.edge_rate(grants, 0, 0.5, 6.0) == pytest.approx((120 - 40) / (5 - 1))
    assert service_soak.edge_rate(grants, 1, 0.0, 10.0) == pytest.approx((30 - 10) / (9 - 1))
    assert service_soak.edge_rate(grants, 1, 0.5, 4.0) is None  # one grant inside


def test_rates_add_what_grew_between_the_first_grant_and_the_last() -> None:
    grants = [(0.0, [0, 0]), (10.0, [40, 10]), (20.0, [80, 20]), (25.0, [0, 0]), (30.0, [40, 10])]
    rates, first, last = service_soak.rates({"grants": grants})
    assert (first, last) == (10.0, 30.0)
    assert rates[:2] == pytest.approx([80 / 20, 20 / 20])  # the fall at 25 s (a ledger lost) adds nothing


def test_up_share_and_live_islands() -> None:
    phase = {"outages": [[[10.0, 20.0]], [], [[50.0, None]]]}
    assert service_soak.up_share(phase, 0, 0.0, 100.0) == pytest.approx(0.9)
    assert service_soak.up_share(phase, 1, 0.0, 100.0) == pytest.approx(1.0)
    assert service_soak.up_share(phase, 2, 0.0, 100.0) == pytest.approx(0.5)  # never back: down to the end
    assert service_soak.live_at(phase, 15.0) == {1, 2}
    assert service_soak.live_at(phase, 30.0) == {0, 1, 2}
    assert service_soak.live_at(phase, 60.0) == {0, 1}
    assert service_soak.live_at(phase, 30.0, done=[100.0, 25.0, 30.0]) == {0, 2}  # island 1 pushed its last


def test_an_island_past_its_last_push_is_not_counted_live() -> None:
    # the budget spent, islands 3-5 have pushed their last steps at 40 s: the merge at 50 s holds every island
    # still training
    merges = [{"t": 40.0, "shard": 0, "merges": 1, "islands": [0, 1, 2, 3, 4, 5]},
              {"t": 50.0, "shard": 0, "merges": 1, "islands": [0, 1, 2]}]
    assert service_soak.last_pushes({"outages": [[]] * 6, "merges": merges}) == [50.0] * 3 + [40.0] * 3
    row = service_soak.figures(_phase(merges=merges), None)
    assert row["participation_mean"] == pytest.approx(1.0) and row["merges_full"] == 2


def test_percentile_nearest_rank() -> None:
    assert service_soak.percentile([], 0.5) is None
    assert service_soak.percentile([3.0, 1.0, 2.0, 10.0], 0.5) == 2.0
    assert service_soak.percentile([3.0, 1.0, 2.0, 10.0], 0.9) == 10.0


def _phase(**extra: object) -> dict:
    base = {"name": "faults", "wall_s": 120.0, "load_end": (1.0, 1.0, 1.0), "faults": [], "shard_restarts": [],
            "outages": [[] for _ in service_soak.RANKS], "merges": [], "proc_samples": [],
            "grants": [(10.0, [0] * 6), (11.0, [10] * 6), (111.0, [110] * 6)], "ended_by_itself": True,
            "exit_codes": {"shard_0": 0}, "summary": {"useful_tokens": 600 * 128, "tokens": 660 * 128,
                                                       "final_eval_loss": 4.0}}
    return {**base, **extra}


def test_figures_goodput_participation_rejoins_and_lost_commits() -> None:
    outages = [[[20.0, 40.0]], [], [], [], [], []]
    merges = [{"t": 30.0, "shard": 0, "merges": 1, "islands": [1, 2, 3, 4, 5]},  # island 0 down: all 5 live in
              {"t": 50.0, "shard": 1, "merges": 1, "islands": [0, 1, 2]},  # 3 of 6
              {"t": 100.0, "shard": 0, "merges": 1, "islands": [0, 1, 2, 3, 4, 5]}]  # all 6 still train
    faults = [{"t": 20.0, "kind": "rank", "island": 0, "rejoin_s": 20.0, "pushing_s": 25.0},
              {"t": 60.0, "kind": "shard", "shard": 1}]
    restarts = [{"t": 60.0, "kind": "shard", "shard": 1, "commits_before": 7, "restarted_commits": 6}]
    row = service_soak.figures(_phase(outages=outages, merges=merges, faults=faults, shard_restarts=restarts),
                               None)
    assert row["run_s"] == pytest.approx(100.0)  # the first grant at 11 s, the last at 111 s
    rate = 100 / 100  # each island: 100 steps over 100 s
    tps = service_soak.SETTINGS["batch_size"] * service_soak.SETTINGS["seq_len"]  # tokens per inner step
    bound = sum(rate * share * tps for share in [0.8, 1, 1, 1, 1, 1])
    assert row["alive_bound_tok_s"] == pytest.approx(bound)
    assert row["goodput_vs_alive"] == pytest.approx(600 * 128 / 100 / bound)
    assert row["participation_mean"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert row["merges_full"] == 2 and row["merges_seen"] == 3
    assert row["rejoins"] == 1 and row["rejoin_p50_s"] == 20.0 and row["pushing_max_s"] == 25.0
    assert row["committed_lost"] == 1
    assert row["faults_by_kind"] == {"rank": 1, "shard": 1}


def test_proc_sample_reads_this_process() -> None:
    found = service_soak.proc_sample(os.getpid())
    assert found is not None and found["rss_mib"] > 1 and found["threads"] >= 1 and found["fds"] >= 3
    assert service_soak.proc_sample(2 ** 22 + 12345) is None


def test_launch_helpers(tmp_path: Path) -> None:
    assert service_launch.read_status(tmp_path) == {}
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "status.json").write_text('{"commits": 3}')
    assert service_launch.read_status(tmp_path) == {"commits": 3}
    cmd = service_launch.syncer_command(tmp_path, "127.0.0.1:1", ["--islands", "2"], shard=1,
                                        shards=["127.0.0.1:1", "127.0.0.1:2"])
    assert cmd[3:] == ["syncer", "--shard", "1", "--shards", "127.0.0.1:1,127.0.0.1:2", "--listen", "127.0.0.1:1",
                       "--out", str(tmp_path), "--islands", "2"]
    args = service_launch.island_args(3, ["a:1", "b:2"], tmp_path, ["--x"])
    assert args[:3] == ["island", "--syncer", "a:1,b:2"] and str(tmp_path / "island_3.token") in args
    assert service_launch.study_env()["OMP_NUM_THREADS"] == "1"
    assert service_failover.sl is service_launch  # one set of helpers for both studies
