"""atoll sweep: the grid from comma lists, runs reused, equal-token and equal-time comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from atoll.bench.sweep import grid, point_name
from atoll.errors import ConfigError


def test_grid_is_every_combination_of_the_lists() -> None:
    shared, points = grid({"steps": "20", "sync_every": "5,10", "outer_momentum": "0,0.9", "island_speeds": "1,0.5"})
    assert shared == {"steps": "20", "island_speeds": "1,0.5"}  # a list-valued setting is not swept
    assert points == [{"sync_every": "5", "outer_momentum": "0"}, {"sync_every": "5", "outer_momentum": "0.9"},
                      {"sync_every": "10", "outer_momentum": "0"}, {"sync_every": "10", "outer_momentum": "0.9"}]
    assert point_name(points[1]) == "sync_every-5_outer_momentum-0.9"
    assert grid({"steps": "20"}) == ({"steps": "20"}, [{}])
    with pytest.raises(ConfigError, match="outer_lr"):
        grid({"outer_lr": "0.5,,1"})


def test_a_bad_point_stops_before_anything_trains(tmp_path: Path) -> None:
    r = run_cli("sweep", "--sync-every", "10,0", "--out", str(tmp_path / "sw"))
    assert r.returncode == 2 and r.stderr.startswith("atoll: error: sync_every") and not (tmp_path / "sw").exists()


@pytest.mark.slow
def test_sweep_compares_at_equal_tokens_and_time_and_reuses_runs(fast_config: dict, tmp_path: Path) -> None:
    args = ["sweep", "--data", fast_config["data"], "--cache-dir", fast_config["cache_dir"], "--model", "micro",
            "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--steps", "10", "--islands", "2",
            "--eval-every", "5", "--threads", "1", "--sync-every", "5,10", "--at-mbps", "10",
            "--out", str(tmp_path / "sw")]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "sw" / "results.json").read_text())
    rows = {row["point"]: row for row in results["rows"]}
    assert set(rows) == {"sync_every-5", "sync_every-10"}
    assert rows["sync_every-5"]["bytes_sent_per_island"] == 2 * rows["sync_every-10"]["bytes_sent_per_island"]
    # at the slower link the run that syncs twice as often finishes later; the equal time is the faster one's
    assert rows["sync_every-5"]["wall_s_on_link"] > rows["sync_every-10"]["wall_s_on_link"]
    assert results["equal_time_s"] == rows["sync_every-10"]["wall_s_on_link"]
    assert results["target_loss"] == max(row["final_eval_loss"] for row in rows.values())
    assert (tmp_path / "sw" / "sweep.png").is_file() and "| sync_every |" in (tmp_path / "sw" / "results.md").read_text()
    again = run_cli(*args)
    assert again.returncode == 0 and "[sweep]" not in again.stderr  # every point reused
