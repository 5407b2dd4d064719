"""What an attack on the merged work found (each failed before its fix): look-alike checkpoint names, a file
squatting a checkpoint's name, a checkpoint of the same step written again, a decoupled stop during a periodic
checkpoint, and damaged or foreign files in a benchmark's folder."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from atoll.benchmarks.common import finished, read_summary, run_matches
from atoll.benchmarks.folders import check_out_folder
from atoll.benchmarks.sweep import SWEEP_KEYS
from atoll.config import build_config
from atoll.errors import ConfigError, Interrupted
from atoll.job import stop
from atoll.job.checkpoint import (
    CHECKPOINT_NAME,
    checkpoint_folders,
    load_checkpoint,
    new_run_dir,
    save_checkpoint,
)
from atoll.job.metrics import read_metrics
from atoll.training import train


def test_only_ascii_digits_name_a_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name in ("step_0000001", "step_\uff10\uff10\uff10\uff10\uff10\uff10\uff11", "step_\u0660" * 1 + "\u0660" * 6):
        (root / name).mkdir(parents=True)
    assert [p.name for p in checkpoint_folders(root)] == ["step_0000001"]  # fullwidth and Arabic-Indic digits: yours
    assert CHECKPOINT_NAME.fullmatch("step_\uff10" * 1 + "0" * 6) is None


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_file_or_link_named_like_a_checkpoint_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                        kind: str) -> None:
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    if kind == "file":
        (root / "step_0000010").write_text("mine")
    else:
        (tmp_path / "elsewhere").mkdir()
        (root / "step_0000010").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="is a file or link with a checkpoint's name"):
        new_run_dir(tmp_path / "run", "diloco")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]  # nothing written
    with pytest.raises(OSError, match="a checkpoint's name"):  # and never written over
        save_checkpoint(tmp_path / "run", 10, {"x": torch.ones(2)})
    assert (root / "step_0000010").is_symlink() or (root / "step_0000010").read_text() == "mine"


def test_a_checkpoint_of_the_same_step_again_replaces_it_whole(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 20, {"x": torch.zeros(3)})
    path = save_checkpoint(tmp_path, 20, {"x": torch.ones(3)})
    step, state = load_checkpoint(path)
    assert step == 20 and torch.equal(state["x"], torch.ones(3))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000020"]  # no .old-


@pytest.mark.slow
def test_a_decoupled_stop_during_its_periodic_checkpoint_writes_it_once(fast_config: dict, monkeypatch) -> None:
    from atoll.runtime.events import Simulation

    writes: list[int] = []
    real = Simulation.checkpoint

    def checkpoint_then_signal(self, step: int) -> None:
        real(self, step)
        writes.append(step)
        if len(writes) == 1:
            stop.request(signal.SIGTERM)  # as the handler does when SIGTERM arrives during the write

    monkeypatch.setattr(Simulation, "checkpoint", checkpoint_then_signal)
    config = build_config(overrides={**fast_config, "strategy": "decoupled", "fragments": 2, "sync_every": 4,
                                     "steps": 40, "checkpoint_every": 10})
    try:
        with pytest.raises(Interrupted):
            train(config)
    finally:
        stop.reset()
    assert writes == [10]
    events = [(e["event"], e["step"]) for e in read_metrics(config.out / "metrics.jsonl") if e["event"] == "checkpoint"]
    assert events == [("checkpoint", 10)]


def test_a_foreign_json_object_in_a_sweeps_folder_is_left_untouched(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps({"mine": 1}))
    (tmp_path / "results.md").write_text("| a |\n|---|\n| 1 |\n")
    with pytest.raises(ConfigError, match="results.json' is not a benchmark's results file"):
        check_out_folder(tmp_path, keys=SWEEP_KEYS)
    (tmp_path / "results.json").unlink()  # a user's table alone: no results.json of a sweep beside it
    with pytest.raises(ConfigError, match="results.md' is not a benchmark's results file"):
        check_out_folder(tmp_path, keys=SWEEP_KEYS)
    (tmp_path / "results.json").write_text(json.dumps({"rows": [], "swept": [], "command": "atoll sweep"}))
    check_out_folder(tmp_path, keys=SWEEP_KEYS)  # a sweep's own results are written over


@pytest.mark.parametrize("summary", [{"a": 1}, {"strategy": "ddp"}, "FINAL_ABC", [1]])
def test_a_damaged_summary_is_an_unfinished_point(tmp_path: Path, summary) -> None:
    whole = {"strategy": "ddp", "islands": 2, "steps": 10, "tokens": 5, "initial_eval_loss": 6.0,
             "final_eval_loss": 5.0, "bytes_sent_per_island": 0.0}
    if summary == "FINAL_ABC":
        summary = {**whole, "final_eval_loss": "abc"}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert read_summary(tmp_path) is None
    (tmp_path / "summary.json").write_text(json.dumps(whole))
    assert read_summary(tmp_path) == whole


def test_a_damaged_config_or_metrics_file_is_an_unfinished_point(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1]")
    assert not run_matches(tmp_path, {"strategy": "ddp"})
    whole = {"strategy": "decoupled", "islands": 2, "steps": 10, "tokens": 5, "initial_eval_loss": 6.0,
             "final_eval_loss": 5.0, "bytes_sent_per_island": 0.0}
    (tmp_path / "summary.json").write_text(json.dumps(whole))
    (tmp_path / "config.json").write_text(json.dumps({"strategy": "decoupled"}))
    for metrics in ("", "{bad\n{bad\n"):  # empty, or not events: the curves cannot be drawn from it
        (tmp_path / "metrics.jsonl").write_text(metrics)
        assert not finished(tmp_path, {"strategy": "decoupled"})
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "eval", "step": 0, "eval_loss": 6.0}) + "\n")
    assert finished(tmp_path, {"strategy": "decoupled"})
