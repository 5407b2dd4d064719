"""A resumed run's metrics.jsonl reads as one run: resuming a finished run with no more steps writes no
event twice (decoupled wrote its final ``eval`` and ``checkpoint`` again), for every strategy."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from atoll.config import build_config, load_run_config
from atoll.config.applies import applicable
from atoll.job.metrics import read_metrics
from atoll.train import train


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
