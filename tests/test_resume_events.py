"""A resumed run's metrics.jsonl reads as one run: resuming a finished run with no more steps writes no
event twice (decoupled wrote its final ``eval`` and ``checkpoint`` again), for every strategy; ``atoll train
--resume`` of a finished run says so in one line and writes nothing."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import cli_flags, run_cli

from atoll.config import build_config, load_run_config
from atoll.config.applies import applicable
from atoll.job.metrics import read_metrics
from atoll.training import train


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "extra"), [
    ("decoupled", {"fragments": 2}), ("diloco", {}), ("ddp", {}), ("streaming", {"fragments": 2}),
])
def test_resuming_a_finished_run_writes_no_event_twice(fast_config: dict, tmp_path: Path, strategy: str,
                                                       extra: dict) -> None:
    config = build_config(overrides=applicable({**fast_config, "strategy": strategy, **extra}))
    first = train(config)
    again = train(load_run_config(Path(config.out)), resume=True)
    events = read_metrics(Path(config.out) / "metrics.jsonl")
    # run events (pushes, merges, ...) are many per step: each has its own running count
    counts = Counter((e["event"], e["step"], e.get("count")) for e in events if e["event"] != "train")
    assert {k: n for k, n in counts.items() if n > 1} == {}, "an event written twice"
    assert counts[("end", 20, None)] == 1 and counts[("eval", 20, None)] == 1 and counts[("checkpoint", 20, None)] == 1
    assert again["final_eval_loss"] == first["final_eval_loss"] and again["tokens"] == first["tokens"]


def _files(out: Path) -> dict[str, bytes]:
    """Every file under the run folder ``out`` (checkpoints included, links followed) -> its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_in_one_line_and_writes_nothing(fast_config: dict) -> None:
    settings = {**fast_config, "steps": 4, "sync_every": 2, "eval_every": 2, "checkpoint_every": 2}
    out = Path(settings["out"])
    r = run_cli("train", *cli_flags(settings))
    assert r.returncode == 0, r.stderr
    before = _files(out)
    assert "summary.json" in before and "checkpoints/step_0000004/state.safetensors" in before
    assert "checkpoints/step_0000004/model/model.safetensors" in before
    r = run_cli("train", "--resume", str(out))
    assert r.returncode == 0 and r.stdout == ""  # no table again, as if it had trained
    assert r.stderr == (f"atoll: resume: {out} already finished its 4 steps; nothing to train (pass --steps N "
                        "with N > 4 to train further)\n")
    assert _files(out) == before  # summary.json, the checkpoints, metrics.jsonl, config.json: byte for byte
    r = run_cli("train", "--resume", str(out), "--steps", "4")  # the same number given: the same answer
    assert r.returncode == 0 and r.stderr.count("\n") == 1 and "already finished its 4 steps" in r.stderr
    assert _files(out) == before
    r = run_cli("train", "--resume", str(out), "--steps", "6")  # more steps still train on
    assert r.returncode == 0, r.stderr
    assert "already finished" not in r.stderr and "run folder:" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens"] == 2 * 6 * 4 * 32
