"""``atoll bench suite --quick``: every strategy at equal tokens, re-timed at four bandwidths, one report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_atoll, run_cli

from atoll.benchmarks.suite import BANDWIDTHS_MBPS, available, runs, standard_chaos, synchronous_goodput


@pytest.fixture(scope="module")
def quick_suite(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path, cache_dir: Path) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("suite")
    r = run_atoll("bench", "suite", "--quick", "--out", str(out), "--data", str(corpus_file), "--cache-dir",
                  str(cache_dir), "--vocab-size", "512", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


@pytest.mark.slow
def test_quick_suite_writes_its_outputs(quick_suite: tuple[Path, str]) -> None:
    out, stdout = quick_suite
    for name in ("results.json", "results.md", "suite.png", "loss_curves.png", "time_to_target.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert "| ddp |" in stdout and "10 Gbit/s" in stdout and "### Time to a target loss" in stdout
    md = (out / "results.md").read_text()
    if not available({"strategy": "decoupled"}):
        assert "not available" in md


@pytest.mark.slow
def test_quick_suite_values(quick_suite: tuple[Path, str]) -> None:
    out, _ = quick_suite
    results = json.loads((out / "results.json").read_text())
    rows = {r["run"]: r for r in results["rows"]}
    assert [r["run"] for r in results["rows"]] == [name for name, _, _ in runs()]
    ddp, fp32 = rows["ddp"], rows["diloco"]
    summary = results["runs"]["ddp"]
    # the target is reached by ddp itself at half its tokens, sooner on a faster link
    ttt = results["time_to_target"]
    assert ttt["target_tokens"] == ddp["tokens"] / 2
    times = [ttt["runs"]["ddp"][f"{r:g}"] for r in ttt["rates_mbps"]]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    # equal tokens: every 4-island run saw the same tokens, one island a quarter of them
    for r in results["rows"]:
        if r["available"]:
            assert r["tokens"] == ddp["tokens"] // (4 if r["run"] == "one_island" else 1)
    assert ddp["gap_vs_ddp_pct"] == 0 and ddp["reduction_vs_ddp"] == 1
    # diloco fp32 with H=10 sends 10x less than ddp; int4 carries a float32 scale per 64 values
    assert fp32["reduction_vs_ddp"] == pytest.approx(10.0)
    assert rows["diloco_int4"]["reduction_vs_ddp"] == pytest.approx(10 * 32 / 4.5, rel=0.01)
    assert rows["one_island"]["bytes_sent_per_island"] == 0
    # the clock re-timed at the link the runs trained on (100 Mbit/s) is the run's own clock
    assert ddp["sim_wall_s@100"] == pytest.approx(summary["sim_wall_s"], rel=1e-9)
    # blocking collectives: the bandwidth term scales exactly with bits / bandwidth
    bits = ddp["bytes_sent_per_island"] * 8
    assert ddp["sim_wall_s@10"] - ddp["sim_wall_s@100"] == pytest.approx(bits / 10e6 - bits / 100e6, rel=1e-6)
    for r in results["rows"]:
        if not r["available"] or r["strategy"] == "decoupled":  # decoupled: its own event clock, not re-timed
            continue
        walls = [r[f"sim_wall_s@{b:g}"] for b in BANDWIDTHS_MBPS]
        utils = [r[f"utilization@{b:g}"] for b in BANDWIDTHS_MBPS]
        assert walls == sorted(walls, reverse=True), r["run"]
        assert utils == sorted(utils) and all(0 < u <= 1 for u in utils), r["run"]
        assert 0 < r["goodput"] <= 1, r["run"]  # replayed under the standard failure trace
    assert rows["one_island"]["utilization@10"] == pytest.approx(1.0)
    # fewer bytes, more of the time computing: compared at one step time (each run's compute was measured on a
    # shared machine, at its own moment's load, so the table's own utilizations need not be in this order)
    at_10 = [_utilization_at_one_step_time(out / name, results["runs"][name], 10.0)
             for name in ("ddp", "diloco", "diloco_int4")]
    assert at_10 == sorted(at_10) and at_10[0] < at_10[-1], at_10
    if rows["decoupled"]["available"]:
        # trained under the standard trace: goodput measured, below the failure-free run's
        assert 0 < rows["decoupled_chaos"]["goodput"] < rows["decoupled"]["goodput"] <= 1
        assert (results["runs"]["decoupled_chaos"]["failures"]
                and sum(results["runs"]["decoupled_chaos"]["failures"]) > 0)


def _utilization_at_one_step_time(run_dir: Path, summary: dict, mbps: float, step_s: float = 0.05) -> float:
    """The compute utilization of a finished run re-timed at ``mbps`` with every inner step's compute scaled so
    that an island's mean step takes ``step_s`` seconds (its collectives and codec as recorded)."""
    from atoll.runtime.network import Link, load_trace, replay

    trace = load_trace(run_dir / "clock_trace.json")
    compute = sum(event[1][0] for event in trace["events"] if event[0] == "c")
    scale = step_s * summary["steps"] / compute
    return replay(trace, Link.from_config(mbps, summary["link_latency_ms"]), compute_scale=scale)["compute_utilization"]


def test_synchronous_goodput_replays_the_standard_trace() -> None:
    summary = {"islands": 4, "steps": 300, "sim_wall_s": 300.0, "sync_every": 50, "strategy": "diloco", "seed": 0,
               "tokens": 4 * 300 * 1024}
    g = synchronous_goodput(summary)
    # every island is down about 10% of the time and any failure stops all four: well below 0.9
    assert 0 < g < 0.9
    assert synchronous_goodput({**summary, "strategy": "ddp"}) > g  # rounds of 1 step redo less work
    assert standard_chaos(100.0) == "45:5"


@pytest.mark.slow
def test_quick_suite_reuses_finished_runs(quick_suite: tuple[Path, str], corpus_file: Path, cache_dir: Path) -> None:
    out, _ = quick_suite
    r = run_cli("bench", "suite", "--quick", "--out", str(out), "--data", str(corpus_file), "--cache-dir",
                  str(cache_dir), "--vocab-size", "512", "--only", "ddp,diloco_int4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[suite] ddp:" not in r.stderr  # nothing trained again
    import json

    rows = [row["run"] for row in json.loads((out / "results.json").read_text())["rows"]]
    assert "ddp" in rows and "one_island" in rows and len(rows) > 2  # --only keeps the other finished rows
    # the command line written is the one that ran, --only included
    assert "command: atoll bench suite --quick --only ddp,diloco_int4 " in (out / "results.md").read_text()


@pytest.mark.parametrize("args,field", [(["--only", "nope"], "only"), (["--steps", "0"], "steps"),
                                        (["--only", ","], "only"), (["--out", "/dev/null/x"], "out")])
def test_suite_bad_input_one_line_exit_2(tmp_path: Path, args: list[str], field: str) -> None:
    r = run_cli("bench", "suite", "--quick", "--out", str(tmp_path), *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"atoll: error: {field}")


def test_bench_help_lists_suite_and_wan() -> None:
    r = run_cli("bench", "--help")
    assert r.returncode == 0 and "suite" in r.stdout and "wan" in r.stdout


@pytest.mark.slow
def test_quick_fidelity_shares_the_suite_runs(quick_suite: tuple[Path, str], corpus_file: Path, cache_dir: Path,
                                              tmp_path: Path) -> None:
    from bench.fidelity import main as fidelity

    suite_out, _ = quick_suite
    before = (suite_out / "diloco" / "summary.json").read_text()
    out = tmp_path / "fidelity"
    assert fidelity(["--quick", "--only", "h,outer", "--out", str(out), "--suite", str(suite_out), "--data",
                     str(corpus_file), "--cache-dir", str(cache_dir), "--vocab-size", "512"]) == 0
    # the default study's runs are the suite's folders, reused as they were, not trained again
    assert (suite_out / "diloco" / "summary.json").read_text() == before
    assert not (out / "diloco").exists() and (out / "decoupled_speeds" / "summary.json").is_file()
    results = json.loads((out / "results.json").read_text())
    runs_ = results["runs"]
    # the studies train half the default steps, their references too
    assert runs_["diloco"]["steps"] == 20 and runs_["diloco_x0.5"]["steps"] == runs_["fedavg_h1"]["steps"] == 10
    h = {r["x"]: r for r in results["studies"]["h"]}
    assert sorted(h) == [1, 5, 10]
    assert h[10]["diloco"] == runs_["diloco_x0.5"]["final_eval_loss"]
    assert h[1]["diloco"] is None and h[1]["fedavg"] == runs_["fedavg_h1"]["final_eval_loss"]
    assert h[1]["fedavg_vs_ddp"] == pytest.approx(
        100 * (runs_["fedavg_h1"]["final_eval_loss"] / runs_["ddp_x0.5"]["final_eval_loss"] - 1))
    # H=1 averages every step: 10 syncs; FedAvg at H=10: one
    assert runs_["fedavg_h1"]["reduction_vs_ddp"] == pytest.approx(1.0)
    assert runs_["fedavg_h10"]["reduction_vs_ddp"] == pytest.approx(10.0)
    outer = results["studies"]["outer"]
    assert [r["setting"].split()[0] for r in outer] == ["0.7", "1", "0.7"]
    # every target is checked against its measured value
    checks = {c["target"]: c for c in results["checks"]}
    assert len(checks) == 7
    demo = checks["demo below one island"]
    assert demo["holds"] == (runs_["demo"]["final_eval_loss"] < runs_["one_island"]["final_eval_loss"])
    assert ((out / "fidelity.png").stat().st_size > 0
            and "### The default run's targets" in (out / "results.md").read_text())


def test_quick_suite_writes_beside_the_full_suite_not_over_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from atoll.benchmarks import suite
    from atoll.cli import build_parser

    class _Stop(Exception):
        pass

    folders: list[Path] = []
    monkeypatch.setattr(suite, "default_out", lambda name: tmp_path / name)

    def record(suite_dir: Path, *args: object, **kwargs: object) -> None:
        folders.append(suite_dir)
        raise _Stop

    monkeypatch.setattr(suite, "train_once", record)
    for flags, name in ((["--quick"], "suite-quick"), ([], "suite")):
        with pytest.raises(_Stop):
            suite.run_suite(build_parser(train_flags=False).parse_args(["bench", "suite", *flags, "--only", "ddp"]))
        assert folders[-1] == tmp_path / name
