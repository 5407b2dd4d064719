"""``atoll project --paper-scale``: decoupled at 12B over 2 and 5 Gbit/s, each figure against its formula by
hand, and its flags' one-line refusals."""

from __future__ import annotations

import pytest

from atoll.analysis.cost import Setting
from atoll.analysis.paper_scale import MEASURED, Measured, paper_scale_rows
from atoll.analysis.projection import SCALES, TABLE_SETTINGS, project
from atoll.strategies.registry import spec
from tests.conftest import run_cli


def test_each_figure_is_its_formula_by_hand() -> None:
    measured = Measured(0.5, 0.8, 2.0, 1.0, "hand")
    rows = paper_scale_rows(measured, ("fp32", "int8"), links=(("2 Gbit/s", 2000.0, 35.0),))
    fp32, int8 = rows
    t_c = SCALES[1].step_compute_s  # 12B: 6 x 12e9 x 2^21 / (64 x 989e12 x 0.4), about 5.96 s
    # 12e9 parameters: int4 pushes 4.5 bits each over 2e9 bit/s at half the rate; fp32 pulls 32 bits at 0.8
    assert fp32["push_s"] == pytest.approx(12e9 * 4.5 / 1e9) == pytest.approx(54.0)
    assert fp32["pull_s"] == pytest.approx(12e9 * 32 / 1.6e9) == pytest.approx(240.0)
    assert int8["pull_s"] == pytest.approx(12e9 * 8.5 / 1.6e9)
    assert fp32["both_ways_s"] == pytest.approx(294.0)
    assert fp32["hide_step_s"] == pytest.approx(2.40)  # the slower direction's round over H = 100
    assert fp32["step_s"] == pytest.approx(t_c) and fp32["utilization"] == pytest.approx(1.0)
    # 4 islands' pushes in (6.75 GB each at 2 s/GB) and pulls out (48 GB each at 1 s/GB) per H x step, 4 shards
    transfer = 4 * (6.75 * 2 + 48 * 1) / (100 * t_c) / 4
    merge = 12e9 * 33.4 * 4 / 2 * 1e-9 / (100 * t_c) / 4  # the merge window of 2 islands, scaled to 4
    assert fp32["transfer_cores_per_shard"] == pytest.approx(transfer)
    assert fp32["syncer_cores_per_shard"] == pytest.approx(transfer + merge)
    # int8 pulls: one encode per commit of the 12e9 parameters at 0.490 GB/s of float32 input
    assert int8["merge_cores_per_shard"] == pytest.approx(12e9 * (33.4 * 2 + 4 / 0.490) * 1e-9 / (100 * t_c) / 4)
    sync = Setting(params=12e9, step_compute_s=t_c, islands=4, bandwidth_mbps=2000.0, latency_ms=35.0)  # full rate
    assert fp32["speed_vs_ddp"] == pytest.approx(project(sync, "ddp").step_s / t_c)
    diloco = project(sync, "diloco", spec("diloco").config(**TABLE_SETTINGS["diloco"])).step_s
    assert fp32["speed_vs_diloco"] == pytest.approx(diloco / t_c)


def test_a_slow_link_makes_the_exchange_the_step() -> None:
    rows = paper_scale_rows(Measured(0.1, 0.1, 0.0, 0.0, "hand"), ("fp32",), links=(("x", 100.0, 35.0),))
    (r,) = rows
    assert r["hide_step_s"] == pytest.approx(12e9 * 32 / 1e7 / 100)
    with pytest.raises(ValueError, match="link shares"):
        paper_scale_rows(Measured(1e-320, 0.5, 0.0, 0.0, "hand")) and r["step_s"] == r["hide_step_s"] > r["t_c"]
    assert r["utilization"] == pytest.approx(r["t_c"] / r["step_s"]) and r["transfer_cores_per_shard"] == 0.0


def test_the_help_states_the_defaults_the_command_uses(capsys: pytest.CaptureFixture[str]) -> None:
    """``atoll project --help``'s defaults are those it runs with: the measured link shares and the decoupled
    strategy's pull codec (which ``atoll train`` uses too)."""
    import re

    from atoll.cli import build_parser
    from atoll.strategies.registry import spec

    with pytest.raises(SystemExit):
        build_parser().parse_args(["project", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"[default: measured, {MEASURED.push_share}]" in text
    assert f"[default: measured, {MEASURED.pull_share}]" in text
    pull = spec("decoupled").config.model_fields["pull_codec"].default
    assert re.search(rf"\[default: {pull}, as atoll train\]", text) and pull != "fp32"
    assert run_cli("project", "--paper-scale").stdout == run_cli("project", "--paper-scale", "--push-share",
                                                                  str(MEASURED.push_share)).stdout


def test_the_command_prints_the_table_and_refuses_what_it_does_not_read() -> None:
    r = run_cli("project", "--paper-scale")
    assert r.returncode == 0 and "| 12B | 2 Gbit/s | fp32 | 4.5 / 32 |" in r.stdout
    assert f"push {MEASURED.push_share:.3f}" in r.stdout and ">20x" in r.stdout
    assert run_cli("project", "--paper-scale", "--pull-codec", "int8").stdout.count("| 12B |") == 2
    for args, field in ((("--paper-scale", "--push-share", "1.5"), "push_share"),
                        (("--paper-scale", "--islands", "8"), "islands"),
                        (("--paper-scale", "--sync-every", "50"), "sync_every"),  # its default value, typed: unread
                        (("--table", "--latency-ms", "10"), "latency_ms"),
                        (("--table", "--push-share", "0.5"), "push_share"),
                        (("--table", "--pull-share", "0.5"), "pull_share"),
                        (("--push-share", "0.5", "--params", "1e9", "--step-compute-s", "1"), "push_share"),
                        (("--paper-scale", "--pull-codec", "int3"), "pull_codec"),
                        (("--params", "1e9", "--step-compute-s", "1", "--strategy", "ddp", "--pull-codec", "x"),
                         "pull_codec")):
        bad = run_cli("project", *args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and field in bad.stderr, (args, bad.stderr)
