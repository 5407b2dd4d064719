"""The projection (atoll.analysis.projection) against measured runs, its formulas' limits, and ``atoll project``."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import run_atoll, run_cli

from atoll.analysis.projection import (
    CODEC_BITS,
    STRATEGIES,
    Setting,
    config_from_summary,
    format_table,
    fragment_syncs,
    project,
    project_run,
    real_scale_table,
    setting_from_summary,
)
from atoll.strategies.registry import spec

FIXTURE = Path(__file__).parent / "fixtures" / "measured_runs.json"
RESULTS = [Path(__file__).parents[1] / "bench" / "out" / s / "results.json"
           for s in ("diloco_vs_ddp", "streaming_codecs")]


def measured_runs() -> dict[str, dict]:
    """Summaries of measured runs: the committed bench results when present, else the copy in fixtures/."""
    runs = {}
    if all(p.is_file() for p in RESULTS):
        for p in RESULTS:
            runs.update({f"{p.parent.name}/{k}": v for k, v in json.loads(p.read_text())["runs"].items()})
    else:
        runs = json.loads(FIXTURE.read_text())["runs"]
    # topk: not a fixed bits-per-element codec; None: a strategy with its own encoding (demo, sparseloco)
    return {k: r for k, r in runs.items() if r["codec"] in CODEC_BITS or r["codec"] is None}


def _err(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured else abs(predicted)


def test_fixture_matches_the_committed_results() -> None:
    fixture = json.loads(FIXTURE.read_text())["runs"]
    if not all(p.is_file() for p in RESULTS):
        pytest.skip("bench/out results not present")
    for key, run in measured_runs().items():
        assert fixture[key]["sim_wall_s"] == run["sim_wall_s"]


@pytest.mark.parametrize("key", sorted(measured_runs()))
def test_projection_within_15_percent_of_measured_runs(key: str) -> None:
    run = measured_runs()[key]
    p = project_run(setting_from_summary(run), run["strategy"], run["steps"], config_from_summary(run))
    assert _err(p["sim_wall_s"], run["sim_wall_s"]) < 0.15
    assert _err(p["compute_utilization"], run["compute_utilization"]) < 0.15
    assert _err(p["bytes"], run["bytes_sent_per_island"]) < 0.15 if run["bytes_sent_per_island"] else p["bytes"] == 0


def test_calibration_covers_every_measured_kind() -> None:
    runs = measured_runs()
    assert {r["strategy"] for r in runs.values()} >= {"ddp", "diloco", "streaming"}
    assert {r["link_bandwidth_mbps"] for r in runs.values()} == {10.0, 100.0}
    # bytes are exact (the ring formula and the codecs' bits per element), not just within 15%
    for r in runs.values():
        p = project_run(setting_from_summary(r), r["strategy"], r["steps"], config_from_summary(r))
        assert p["bytes"] == pytest.approx(r["bytes_sent_per_island"], rel=1e-4, abs=1)


def _own(strategy: str, **settings):
    """The strategy's own config with ``settings``."""
    return spec(strategy).config(**settings)


def test_limits_of_the_formulas() -> None:
    s = Setting(params=1e6, step_compute_s=0.1, islands=4, bandwidth_mbps=10, latency_ms=10)
    diloco = _own("diloco", sync_every=50)
    streaming = _own("streaming", sync_every=50, fragments=4, overlap_steps=5, codec="fp32")
    ddp = project(s, "ddp")
    assert ddp.bytes_per_step == pytest.approx(1.5 * 4e6)           # 2(K-1)/K x 4N
    assert ddp.step_s == pytest.approx(0.1 + 6e6 * 8 / 1e7 + 6 * 0.01)
    # diloco with H=1 sends what ddp sends; with H=50, 50x less
    assert project(s, "diloco", _own("diloco", sync_every=1)).bytes_per_step == pytest.approx(ddp.bytes_per_step)
    assert project(s, "diloco", diloco).bytes_per_step == pytest.approx(ddp.bytes_per_step / 50)
    # streaming with one fragment and no overlap is diloco
    one = _own("streaming", sync_every=50, fragments=1, overlap_steps=0, codec="fp32")
    assert project(s, "streaming", one).step_s == pytest.approx(project(s, "diloco", diloco).step_s)
    # overlap hides a fragment's exchange when tau compute steps outlast it: 1.2 MB/4 at 10 Mbit/s ~ 0.3 s
    fast = streaming.model_copy(update={"codec": "int4"})
    assert project(s, "streaming", fast).step_s == pytest.approx(0.1)
    # ... and does not when the link is the bottleneck: the link-bound rate P/H x T_f
    slow = replace(s, bandwidth_mbps=0.1)
    t_f = 1.5 * 4e6 / 4 * 8 / 1e5 + 6 * 0.01
    assert project(slow, "streaming", streaming).step_s == pytest.approx(max(0.1 + 4 / 50 * (t_f - 0.5), 4 / 50 * t_f))
    # DeMo: k x (2-byte index + 2-bit sign) per 64x64 chunk, all-gathered to K-1 peers; float32 values: k x 6
    assert project(s, "demo").bytes_per_step == pytest.approx(3 * 1e6 / 4096 * 32 * 2.25)
    floats = _own("demo", demo_sign_values=False)
    assert project(s, "demo", floats).bytes_per_step == pytest.approx(3 * 1e6 / 4096 * 32 * 6)
    # one island sends nothing and computes all the time
    for name in STRATEGIES:
        alone = project(replace(s, islands=1), name)
        assert alone.bytes_per_step == 0 and alone.compute_utilization == pytest.approx(1.0)


def test_the_projection_reads_only_the_strategys_own_config() -> None:
    """Each strategy is priced from its own config (H, P, the codec's bits are its settings, not the run's): a
    strategy's config of another strategy is refused, and a summary's settings of another strategy are not read."""
    s = Setting(params=1e6, step_compute_s=0.1, islands=4, bandwidth_mbps=10, latency_ms=10)
    assert project(s, "diloco", _own("diloco", codec="int8")).bytes_per_step == pytest.approx(
        project(s, "diloco").bytes_per_step * CODEC_BITS["int8"] / 32)
    with pytest.raises(TypeError, match="DiLoCoConfig"):
        project(s, "diloco", _own("streaming"))
    ddp = {"strategy": "ddp", "sync_every": 50, "fragments": 1, "overlap_steps": 0, "codec": "fp32"}  # an old one
    assert config_from_summary(ddp) == _own("ddp")
    assert config_from_summary({**ddp, "strategy": "demo", "codec": None}) == _own("demo")
    with pytest.raises(ValueError, match="no simulated links"):
        setting_from_summary({"runtime": "collective", "params": 1, "compute_s": 1.0, "steps": 1, "islands": 2})


def test_goodput_synchronous_against_decoupled() -> None:
    s = Setting(params=1e9, step_compute_s=1.0, islands=4, bandwidth_mbps=2000,
                mtbf_s=2400, downtime_s=600, checkpoint_every_s=1800)
    sync = project(s, "ddp").goodput
    assert sync == pytest.approx(1 / (1 + 4 / 2400 * (600 + 900)))
    for name in ("diloco", "streaming", "demo"):
        assert project(s, name, _own(name, **({"sync_every": 100} if name != "demo" else {}))).goodput == \
            pytest.approx(sync)
    dec = project(s, "decoupled", _own("decoupled", sync_every=100))
    assert dec.goodput == pytest.approx(1 / (1 + (600 + 100 * dec.step_s / 2) / 2400))
    assert dec.goodput > 2.5 * sync
    assert project(replace(s, mtbf_s=math.inf), "ddp").goodput == 1.0


def test_fragment_schedule_counts() -> None:
    assert fragment_syncs(300, 4, 50) == (24, 3)   # measured: 27 exchanges
    assert fragment_syncs(600, 1, 50) == (12, 0)
    assert fragment_syncs(620, 1, 50) == (12, 1)


def test_real_scale_table() -> None:
    rows = real_scale_table()
    assert len(rows) == 3 * 4 * len(STRATEGIES)
    by = {(r["model"], r["link"], r["strategy"]): r for r in rows}
    # 12B over a 2 Gbit/s WAN: the low-communication strategies are far faster than ddp
    assert by[("12B", "WAN 2 Gbit/s", "decoupled")]["speedup_vs_ddp"] > 20
    assert by[("12B", "WAN 2 Gbit/s", "ddp")]["compute_utilization"] < 0.1
    assert by[("12B", "WAN 5 Gbit/s", "streaming")]["compute_utilization"] > 0.9
    for r in rows:
        assert 0 < r["compute_utilization"] <= 1 and 0 < r["goodput_heavy_failures"] <= 1
    text = format_table(rows)
    assert "857x" in text and "88%" in text and "27%" in text and "t_c =" in text


@pytest.mark.slow
def test_project_cli() -> None:
    r = run_atoll("project", "--params", "12e9", "--step-compute-s", "6", "--bandwidth-mbps", "2000",
                  "--codec", "int4", "--sync-every", "100")
    assert r.returncode == 0, r.stderr
    assert "| decoupled |" in r.stdout and "| ddp |" in r.stdout
    r = run_cli("project", "--table")
    assert r.returncode == 0 and "100B" in r.stdout and "consumer 10 Mbit/s" in r.stdout


@pytest.mark.parametrize("args,field", [
    (["--params", "0", "--step-compute-s", "1"], "params"),
    (["--params", "1e9"], "params"),
    (["--params", "1e9", "--step-compute-s", "1", "--codec", "int3"], "codec"),
    (["--params", "1e9", "--step-compute-s", "1", "--sync-every", "2", "--fragments", "4"], "sync_every"),
    (["--params", "1e9", "--step-compute-s", "1", "--strategy", "nope"], "strategy"),
])
def test_project_cli_bad_input_one_line_exit_2(args: list[str], field: str) -> None:
    r = run_cli("project", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"atoll: error: {field}")


def test_a_flag_beside_table_is_refused_not_ignored() -> None:
    """``--table`` prints its own fixed settings: ``--params`` beside it was silently ignored."""
    r = run_cli("project", "--table", "--params", "1e9")
    assert r.returncode == 2, r.stderr
    assert r.stderr == "atoll: error: params: --table prints a fixed table of its own settings; drop --params or " \
                       "--table\n", r.stderr
    assert run_cli("project", "--table").returncode == 0
