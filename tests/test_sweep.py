"""atoll sweep: the grid from comma lists, runs reused, equal-token and equal-time comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from atoll.benchmarks.sweep import distinct, grid, point_name, trim
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


def test_the_grid_skips_for_each_strategy_the_settings_it_does_not_read() -> None:
    shared, points = grid({"steps": "20", "strategy": "ddp,diloco,demo", "sync_every": "10,50", "outer_lr": "0.5,1"})
    kept, notes = trim(shared, points)
    assert kept == [{"strategy": "ddp"},
                    {"strategy": "diloco", "sync_every": "10", "outer_lr": "0.5"},
                    {"strategy": "diloco", "sync_every": "10", "outer_lr": "1"},
                    {"strategy": "diloco", "sync_every": "50", "outer_lr": "0.5"},
                    {"strategy": "diloco", "sync_every": "50", "outer_lr": "1"},
                    {"strategy": "demo"}]
    assert notes == ["ddp does not read sync_every, outer_lr: one run instead of 4",
                     "demo does not read sync_every, outer_lr: one run instead of 4"]
    # a strategy given once: one point; a grid every point reads is left as it is
    assert trim({"strategy": "ddp"}, grid({"sync_every": "10,50"})[1]) == (
        [{}], ["ddp does not read sync_every: one run instead of 2"])
    shared, points = grid({"strategy": "diloco,streaming", "sync_every": "10,50", "fragments": "2"})
    assert trim(shared, points) == (points, [])
    # lr is read by ddp, not by demo: ddp keeps its 2 points
    shared, points = grid({"strategy": "ddp,demo", "lr": "1e-3,3e-3"})
    assert trim(shared, points) == ([{"strategy": "ddp", "lr": "1e-3"}, {"strategy": "ddp", "lr": "3e-3"},
                                     {"strategy": "demo"}], ["demo does not read lr: one run instead of 2"])


def test_a_bad_point_stops_before_anything_trains(tmp_path: Path) -> None:
    r = run_cli("sweep", "--sync-every", "10,0", "--out", str(tmp_path / "sw"))
    assert r.returncode == 2 and r.stderr.startswith("atoll: error: sync_every") and not (tmp_path / "sw").exists()


@pytest.mark.parametrize("flag, value", [("--at-mbps", "0"), ("--at-mbps", "-5"), ("--at-mbps", "nan"),
                                         ("--at-mbps", "inf"), ("--at-latency-ms", "-1"), ("--at-latency-ms", "nan"),
                                         ("--step-s", "-1"), ("--step-s", "0"), ("--step-s", "inf")])
def test_a_bad_link_or_step_time_stops_before_anything_trains(tmp_path: Path, flag: str, value: str) -> None:
    r = run_cli("sweep", "--sync-every", "5,10", flag, value, "--out", str(tmp_path / "sw"))
    name = flag[2:].replace("-", "_")
    assert r.returncode == 2 and not (tmp_path / "sw").exists()
    assert r.stderr.startswith(f"atoll: error: {name}: {flag} ") and r.stderr.count("\n") == 1, r.stderr


def test_points_the_same_once_parsed_train_once() -> None:
    points = [{"outer_lr": "0.7", "sync_every": "5"}, {"outer_lr": "0.70", "sync_every": "5"},
              {"outer_lr": "0.7", "sync_every": "10"}, {"outer_lr": "0.70", "sync_every": "10"}]
    settings = [{"outer_lr": 0.7, "sync_every": 5}, {"outer_lr": 0.7, "sync_every": 5},
                {"outer_lr": 0.7, "sync_every": 10}, {"outer_lr": 0.7, "sync_every": 10}]
    assert distinct(points, settings) == ([0, 2], ["outer_lr 0.70 = 0.7"])
    assert distinct(points[:1], settings[:1]) == ([0], [])


def strict_json(path: Path) -> dict:
    """``path`` read as strict JSON: NaN and Infinity refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{path} holds {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


TINY = ["--model", "micro", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--threads", "1",
        "--no-progress", "--islands", "2", "--steps", "20", "--fragments", "2"]


@pytest.mark.slow
def test_a_mixed_grid_times_lockstep_runs_at_their_own_median(corpus_file: Path, cache_dir: Path,
                                                               tmp_path: Path) -> None:
    r = run_cli("sweep", "--data", str(corpus_file), "--cache-dir", str(cache_dir), *TINY, "--sync-every", "5",
                "--strategy", "diloco,decoupled", "--outer-lr", "0.7,0.70", "--out", str(tmp_path / "sw"))
    assert r.returncode == 0, r.stderr
    dropped = [line for line in r.stderr.splitlines() if "duplicate" in line]
    assert dropped == ["atoll: warning: 2 duplicate points dropped, the same settings once parsed "
                       "(outer_lr 0.70 = 0.7): each trains once"]
    assert r.stderr.count("[sweep]") == 2  # diloco and decoupled at 0.7, once each
    results = strict_json(tmp_path / "sw" / "results.json")
    assert [row["point"] for row in results["rows"]] == ["strategy-diloco_outer_lr-0.7",
                                                         "strategy-decoupled_outer_lr-0.7"]
    diloco = json.loads((tmp_path / "sw" / "strategy-diloco_outer_lr-0.7" / "summary.json").read_text())
    # decoupled's simulated step (sim_step_s) is not a measured step time: diloco is timed at its own
    assert results["step_s_measured"] == [diloco["compute_s"] / diloco["steps"], None]
    assert results["step_s"] == diloco["compute_s"] / diloco["steps"]
    assert results["equal_time_s"] == results["rows"][0]["wall_s_on_link"]
    assert results["rows"][1]["wall_s_on_link"] is None and results["rows"][1]["loss_at_equal_time"] is None
    header = (tmp_path / "sw" / "results.md").read_text().splitlines()[2]
    assert header.count("| strategy |") == 1 and header.startswith("| strategy | outer_lr |")
    assert "(2 points)" in r.stdout


@pytest.mark.slow
def test_asynchronous_runs_alone_have_no_equal_time(corpus_file: Path, cache_dir: Path, tmp_path: Path) -> None:
    r = run_cli("sweep", "--data", str(corpus_file), "--cache-dir", str(cache_dir), *TINY, "--strategy", "decoupled",
                "--sync-every", "1000", "--out", str(tmp_path / "sw"))
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if "sync_every" in line and "warning" in line]
    assert warned == ["atoll: warning: sync_every is larger than steps (run: 1000 > 20): no outer sync before the "
                      "final one; pass --sync-every at most --steps"]
    results = strict_json(tmp_path / "sw" / "results.json")
    assert results["equal_time_s"] is None and results["step_s"] is None and results["best"] == {
        "final_eval_loss": "run"}
    assert results["rows"][0]["loss_at_equal_time"] is None and results["rows"][0]["time_curve"]
    table = (tmp_path / "sw" / "results.md").read_text()
    assert table.startswith("### atoll sweep (1 point)\n") and "loss at equal time" in table and "nan" not in table
    assert "no equal-time comparison" in table and "timed at" not in table
    assert (tmp_path / "sw" / "sweep.png").is_file()


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
    assert ((tmp_path / "sw" / "sweep.png").is_file()
            and "| sync_every |" in (tmp_path / "sw" / "results.md").read_text())
    again = run_cli(*args)
    assert again.returncode == 0 and "[sweep]" not in again.stderr  # every point reused


def _sweep_args(fast_config: dict, out: Path, *grid: str) -> list[str]:
    return ["sweep", "--data", fast_config["data"], "--cache-dir", fast_config["cache_dir"], "--model", "micro",
            "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--steps", "10", "--islands", "2",
            "--eval-every", "5", "--eval-batches", "2", "--threads", "1", *grid, "--out", str(out)]


@pytest.mark.slow
def test_an_extended_grid_reuses_every_point_and_shows_them_all(fast_config: dict, tmp_path: Path) -> None:
    out = tmp_path / "sw"
    first = run_cli(*_sweep_args(fast_config, out, "--sync-every", "5,10"))
    assert first.returncode == 0 and first.stderr.count("[sweep]") == 2, first.stderr
    # another grid: its outer_lr 0.7 points (the default) are the runs sync_every-5 and -10 already trained
    wider = run_cli(*_sweep_args(fast_config, out, "--sync-every", "5,10", "--outer-lr", "0.7,1"))
    assert wider.returncode == 0, wider.stderr
    assert sorted(line.split(":")[0] for line in wider.stderr.splitlines() if line.startswith("[sweep]")) == [
        "[sweep] sync_every-10_outer_lr-1", "[sweep] sync_every-5_outer_lr-1"]
    rows = {r["point"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"sync_every-5", "sync_every-10", "sync_every-5_outer_lr-1", "sync_every-10_outer_lr-1"}
    assert rows["sync_every-5"]["outer_lr"] == 0.7 and rows["sync_every-5_outer_lr-1"]["outer_lr"] == 1.0
    # a narrower grid trains nothing and its table still shows every point the folder holds, by both settings
    narrow = run_cli(*_sweep_args(fast_config, out, "--sync-every", "5,10"))
    assert narrow.returncode == 0 and "[sweep]" not in narrow.stderr, narrow.stderr
    table = (out / "results.md").read_text()
    assert "(4 points)" in table and "| sync_every | outer_lr |" in table
    assert len(json.loads((out / "results.json").read_text())["rows"]) == 4
    # a point whose summary.json was cut short: one warning line, trained again, no traceback
    summary = out / "sync_every-10" / "summary.json"
    summary.write_text(summary.read_text()[:40])
    again = run_cli(*_sweep_args(fast_config, out, "--sync-every", "5,10"))
    assert again.returncode == 0, again.stderr
    assert [line for line in again.stderr.splitlines() if "damaged" in line] == [
        f"atoll: warning: '{summary}' is damaged (cut short, not JSON); training sync_every-10 again"]
    assert "Traceback" not in again.stderr and json.loads(summary.read_text())["steps"] == 10


@pytest.mark.parametrize(("name", "text"), [("results.md", "my notes on the runs\n"),
                                            ("results.json", "[1, 2, 3]\n")])
def test_a_sweep_never_writes_over_a_users_results(tmp_path: Path, name: str, text: str) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text(text)
    r = run_cli("sweep", "--sync-every", "5,10", "--steps", "2", "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"'{out / name}'" in r.stderr, r.stderr
    assert (out / name).read_text() == text and sorted(p.name for p in out.iterdir()) == [name]


@pytest.mark.slow
def test_a_grid_of_strategies_and_h_trains_ddp_once(corpus_file: Path, cache_dir: Path, tmp_path: Path) -> None:
    args = ["sweep", "--data", str(corpus_file), "--cache-dir", str(cache_dir), "--model", "micro", "--vocab-size",
            "512", "--seq-len", "32", "--batch-size", "4", "--threads", "1", "--islands", "2", "--steps", "4",
            "--eval-every", "2", "--strategy", "ddp,diloco", "--sync-every", "2,4", "--out", str(tmp_path / "sw")]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "does not read" in line] == [
        "atoll: note: ddp does not read sync_every: one run instead of 2"]
    assert r.stderr.count("[sweep]") == 3  # ddp once, diloco at H=2 and H=4
    assert sorted(p.name for p in (tmp_path / "sw").iterdir() if (p / "summary.json").is_file()) == [
        "strategy-ddp", "strategy-diloco_sync_every-2", "strategy-diloco_sync_every-4"]
    results = strict_json(tmp_path / "sw" / "results.json")
    assert results["swept"] == ["strategy", "sync_every"]
    rows = [(row["point"], row["strategy"], row["sync_every"]) for row in results["rows"]]
    assert rows == [("strategy-ddp", "ddp", None), ("strategy-diloco_sync_every-2", "diloco", 2),
                    ("strategy-diloco_sync_every-4", "diloco", 4)]  # ddp's row shows no H, not its default
    sent = [row["bytes_sent_per_island"] for row in results["rows"]]  # 4 all-reduces, then 2 and 1 outer rounds
    assert sent[0] == 2 * sent[1] == 4 * sent[2] > 0
    table = (tmp_path / "sw" / "results.md").read_text().splitlines()
    assert table[0] == "### atoll sweep (3 points)" and table[2].startswith("| strategy | sync_every | tokens |")
    assert [line.split(" | ")[:2] for line in table[4:7]] == [["| ddp", "-"], ["| diloco", "2"], ["| diloco", "4"]]
    again = run_cli(*args)  # the same grid again trains nothing: every point reused, the same three rows
    assert again.returncode == 0 and "[sweep]" not in again.stderr
    assert [row["point"] for row in strict_json(tmp_path / "sw" / "results.json")["rows"]] == [p for p, _, _ in rows]


def test_a_setting_no_point_reads_is_refused_as_train_refuses_it(tmp_path: Path) -> None:
    """``--pull-codec bogus`` beside ``--strategy diloco`` ran one point and said nothing; a setting that no
    point's strategy reads is one line and exit 2 before anything trains, as ``atoll train`` says it (a setting
    some points read stays a note)."""
    for flags, field in ((["--strategy", "diloco", "--pull-codec", "bogus"], "pull_codec"),
                         (["--strategy", "diloco", "--fragments", "0"], "fragments"),
                         (["--strategy", "ddp,diloco", "--no-realign-pushes"], "realign_pushes")):
        out = tmp_path / field
        r = run_cli("sweep", "--model", "micro", "--islands", "2", "--steps", "4", *flags, "--out", str(out))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"atoll: error: {field}: the "), r.stderr
        assert not out.exists()
