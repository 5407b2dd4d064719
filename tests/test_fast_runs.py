"""The smallest whole runs: every driver once end to end (the lockstep loop and the decoupled event simulation
in the fast tier; the collective runtime's processes marked slow: starting them, a fork server that imports
torch and transformers and two ranks that join, is about 8 s of an idle machine, most of what the fast tier's
minute leaves), and every benchmark module's command line."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from atoll.config import build_config
from atoll.job.metrics import read_metrics
from atoll.training import train

BENCHES = ("suite", "diloco_vs_ddp", "streaming_codecs", "demo_sweep", "decoupled", "overhead", "same_numbers")


def _tiny(fast_config: dict, **extra) -> dict:
    return {**fast_config, "steps": 4, "sync_every": 2, "eval_every": 2, "checkpoint_every": 2, "seq_len": 16,
            "batch_size": 2, "eval_batches": 1, **extra}


def test_a_lockstep_run_end_to_end(fast_config: dict) -> None:
    summary = train(build_config(overrides=_tiny(fast_config)))
    out = Path(summary["out"])
    assert json.loads((out / "summary.json").read_text())["final_eval_loss"] == summary["final_eval_loss"]
    assert [e["step"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "eval"] == [0, 2, 4]
    assert (out / "report.png").is_file() and (out / "clock_trace.json").is_file()
    assert summary["bytes_sent_per_island"] > 0 and summary["tokens"] == 2 * 4 * 2 * 16


def test_a_decoupled_run_end_to_end(fast_config: dict) -> None:
    summary = train(build_config(overrides=_tiny(fast_config, strategy="decoupled", fragments=2, sync_every=4,
                                                 island_speeds="1,0.5")))  # the 0.5 island: 2 steps a round
    assert summary["commits"] > 0 and summary["useful_tokens"] > 0 and 0 < summary["goodput"] <= 1
    assert (Path(summary["out"]) / "syncer").is_dir()


def test_a_summary_reports_only_settings_its_owners_have(fast_config: dict) -> None:
    """A ddp run has no H: its summary has no ``sync_every`` (the flat view handed out the default before)."""
    tiny = {k: v for k, v in _tiny(fast_config, strategy="ddp", steps=2, eval_every=2, checkpoint_every=0).items()
            if k != "sync_every"}
    summary = train(build_config(overrides=tiny))
    saved = json.loads((Path(summary["out"]) / "summary.json").read_text())
    assert "sync_every" not in saved and "sync_every" not in summary
    assert (saved["link_bandwidth_mbps"], saved["link_latency_ms"]) == (100.0, 10.0)  # the local runtime's own


def test_the_summary_settings_come_from_the_strategy_and_the_runtime() -> None:
    """The settings a summary reports are those of the run's owners: the local runtime's simulated links, none
    of them under the collective runtime (a real clock); H of a strategy of rounds, none for ddp."""
    from atoll.config import TrainConfig
    from atoll.job.metrics import LINK_SETTINGS, owned_settings

    def settings(**given: object) -> dict:
        config = TrainConfig(**given)
        return owned_settings(config.strategy_config, config.runtime_config, ("sync_every", "codec", *LINK_SETTINGS))

    assert settings(strategy="diloco", sync_every=7, link_bandwidth_mbps=25.0) == {
        "sync_every": 7, "codec": "fp32", "link_bandwidth_mbps": 25.0, "link_latency_ms": 10.0}
    assert settings(strategy="diloco", runtime="collective", sync_every=9) == {"sync_every": 9, "codec": "fp32"}
    assert settings(strategy="ddp", runtime="collective") == {"codec": "fp32"}
    assert settings(strategy="demo") == {"link_bandwidth_mbps": 100.0, "link_latency_ms": 10.0}
    assert settings(strategy="decoupled", runtime="ray", sync_every=8) == {"sync_every": 8, "codec": "int4"}


@pytest.mark.slow  # real processes (tests/test_collective.py holds the others)
def test_a_collective_run_end_to_end(fast_config: dict) -> None:
    summary = train(build_config(overrides=_tiny(fast_config, runtime="collective", steps=2, eval_every=2,
                                                 checkpoint_every=0)))
    assert summary["runtime"] == "collective" and summary["bytes_sent_per_island"] > 0


@pytest.mark.parametrize("name", BENCHES)
def test_benchmark_command_lines(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module("atoll.benchmarks.suite" if name == "suite" else f"bench.{name}")
    if name == "suite":  # a subcommand of atoll bench
        from atoll.cli import main

        with pytest.raises(SystemExit) as info:
            main(["bench", "suite", "--help"])
    else:
        with pytest.raises(SystemExit) as info:
            module.main(["--help"])
    assert info.value.code == 0 and "--out" in capsys.readouterr().out
