"""Experiment trackers (TensorBoard, W&B), the progress lines of a run whose stderr is not a terminal, and the
status line of a long step."""

from __future__ import annotations

import importlib.util
import io
import json
import struct
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import run_atoll, run_cli
from rich.console import Console

from atoll.config import build_config
from atoll.job.metrics import ProgressDisplay, read_metrics, status
from atoll.job.trackers import WandbTracker, scalars

ROOT = Path(__file__).resolve().parents[1]


def _without(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """Make ``packages`` look uninstalled to ``importlib.util.find_spec``."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in packages else real(name, *a))


def test_tracker_flag_takes_a_comma_list_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # both look installed
    assert build_config(overrides={"tracker": "tensorboard, wandb"}).tracker == ["tensorboard", "wandb"]
    assert build_config(overrides={"tracker": "none"}).tracker == []
    assert build_config().tracker == []


def test_a_tracker_not_installed_exits_2_with_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "tensorboard")
    r = run_cli("train", "--tracker", "tensorboard", "--steps", "1")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("atoll: error: tracker: tensorboard is not installed; pip install atoll[tensorboard]")
    r = run_cli("train", "--tracker", "mlflow")
    assert r.returncode == 2 and "tracker" in r.stderr


def test_trackers_are_not_imported_by_the_command_line() -> None:
    code = ("import sys; from atoll.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('tensorboard', 'wandb', 'torch.utils.tensorboard') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_scalars_name_global_and_per_island_metrics() -> None:
    train = {"event": "train", "step": 10, "tokens": 2560, "loss": 6.0, "bytes_sent_per_island": 100.0,
             "sim_wall_s": 0.5, "lr": 1e-3, "island_loss": [6.1, 5.9], "island_bytes_sent": [90.0, 110.0]}
    assert scalars(train) == {"train/loss": 6.0, "train/lr": 1e-3, "train/tokens": 2560.0, "islands/loss_0": 6.1,
                              "islands/loss_1": 5.9, "islands/bytes_sent_0": 90.0, "islands/bytes_sent_1": 110.0,
                              "comm/bytes_sent_per_island": 100.0, "time/sim_wall_s": 0.5}
    ev = {"event": "eval", "step": 10, "tokens": 2560, "eval_loss": 5.5, "perplexity": None,
          "bytes_sent_per_island": 100.0, "sim_wall_s": 0.5}
    assert scalars(ev) == {"eval/loss": 5.5, "comm/bytes_sent_per_island": 100.0, "time/sim_wall_s": 0.5}
    end = {"event": "end", "time": 1.0, "strategy": "diloco", "final_eval_loss": 5.5, "goodput": float("nan")}
    assert scalars(end) == {"summary/final_eval_loss": 5.5}


class _FakeRun:
    def __init__(self, **kwargs: object) -> None:
        self.init = kwargs
        self.defined: dict[str, dict] = {}
        self.logged: list[tuple[dict, int]] = []
        self.summary: dict[str, float] = {}
        self.finished = False

    def define_metric(self, name: str, **kwargs: object) -> None:
        self.defined[name] = kwargs

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished = True


def test_wandb_tracker_calls_the_documented_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[_FakeRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    tracker = WandbTracker(tmp_path / "run", {"strategy": "diloco"})
    run = runs[0]
    run_id = (tmp_path / "run" / "wandb" / "atoll-run-id").read_text().strip()
    assert run.init == {"project": "atoll", "name": "run", "dir": str(tmp_path / "run"), "id": run_id,
                        "resume": "allow", "config": {"strategy": "diloco"}}
    assert run.defined["eval_vs_bytes/loss"] == {"step_metric": "x/bytes_sent_per_island"}
    assert run.defined["eval_vs_sim_time/loss"] == {"step_metric": "x/sim_wall_s"}
    tracker.log({"event": "eval", "step": 20, "tokens": 5120, "eval_loss": 5.25, "perplexity": 190.6,
                 "bytes_sent_per_island": 4096.0, "sim_wall_s": 1.5})
    values, step = run.logged[0]
    assert step == 20 and values["eval/loss"] == values["eval_vs_bytes/loss"] == 5.25
    assert values["x/bytes_sent_per_island"] == 4096.0 and values["x/sim_wall_s"] == 1.5 and values["x/tokens"] == 5120
    tracker.log({"event": "end", "step": 20, "final_eval_loss": 5.25})
    tracker.close()
    assert run.summary == {"summary/final_eval_loss": 5.25} and run.finished
    # a resumed run continues the same W&B run
    WandbTracker(tmp_path / "run", {"strategy": "diloco"}, start_step=10)
    assert runs[1].init["id"] == run_id


def _train_with(fast_config: dict, tracker: str, env: dict[str, str] | None = None) -> Path:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in fast_config.items() if k != "progress"]
    r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", *args, "--no-progress", "--tracker", tracker],
                       capture_output=True, text=True, timeout=300, env={**__import__("os").environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-2000:]
    return Path(fast_config["out"])


@pytest.mark.slow
def test_tensorboard_scalars_equal_metrics_jsonl(fast_config: dict) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = _train_with(fast_config, "tensorboard")
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()

    def tb(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    events = read_metrics(out / "metrics.jsonl")
    trains = [e for e in events if e["event"] == "train"]
    evals = [e for e in events if e["event"] == "eval"]
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - TensorBoard stores float32
    assert tb("train/loss") == [(e["step"], f32(e["loss"])) for e in trains] and len(trains) == 2
    for i in range(2):  # each island's own loss, and the global loss is their mean
        assert tb(f"islands/loss_{i}") == [(e["step"], f32(e["island_loss"][i])) for e in trains]
    assert all(e["loss"] == pytest.approx(sum(e["island_loss"]) / 2) for e in trains)
    assert tb("eval/loss") == [(e["step"], f32(e["eval_loss"])) for e in evals] and len(evals) == 3
    # bytes and simulated milliseconds as the x-axis of the held-out loss
    assert tb("eval_vs_bytes/loss") == [(round(e["bytes_sent_per_island"]), f32(e["eval_loss"])) for e in evals]
    assert tb("eval_vs_sim_time/loss") == [(round(1000 * e["sim_wall_s"]), f32(e["eval_loss"])) for e in evals]
    summary = json.loads((out / "summary.json").read_text())
    assert tb("summary/final_eval_loss") == [(20, f32(summary["final_eval_loss"]))]


def _wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file (W&B's LevelDB-style log: 32 KiB blocks of CRC-framed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        chunk += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


@pytest.mark.slow
def test_wandb_offline_history_equals_metrics_jsonl(fast_config: dict, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    out = _train_with(fast_config, "wandb", {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                                             "WANDB_CACHE_DIR": str(tmp_path / "wbcache"),
                                             "WANDB_CONFIG_DIR": str(tmp_path / "wbconfig")})
    [run_file] = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(row["_step"], {}).update(row)
    events = read_metrics(out / "metrics.jsonl")
    for e in events:
        if e["event"] == "train":
            assert by_step[e["step"]]["train/loss"] == e["loss"]
            assert by_step[e["step"]]["islands/loss_1"] == e["island_loss"][1]
        if e["event"] == "eval":
            assert by_step[e["step"]]["eval/loss"] == e["eval_loss"]
            assert by_step[e["step"]]["x/bytes_sent_per_island"] == e["bytes_sent_per_island"]
            assert by_step[e["step"]]["x/sim_wall_s"] == e["sim_wall_s"]


def test_progress_prints_plain_lines_where_stderr_is_not_a_terminal() -> None:
    buf = io.StringIO()
    with ProgressDisplay(20, 0, True, console=Console(file=buf), every=5) as bar:
        for step in range(1, 21):
            bar.update(step, 6.0 - step / 10, 1000.0, 2048.0 * step, eval_loss=5.5 if step in (8, 20) else None)
    lines = buf.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == [f"atoll: step {s}/20 ({s / 20:.0%})"
                                                        for s in (5, 8, 10, 15, 20)]
    assert "| loss 5.200 | eval 5.500 | 1,000 tok/s | sent 16.4 KB/island |" in lines[1]
    assert "eval" not in lines[0] and "\x1b" not in buf.getvalue() and "eta" in lines[-1]
    both = io.StringIO()
    with ProgressDisplay(20, 0, True, console=Console(file=both), every=20) as bar:
        bar.update(20, 5.0, 1000.0, 2048.0, bytes_received=4096.0)
    assert "| sent 2.0 KB, received 4.1 KB/island |" in both.getvalue()
    quiet = io.StringIO()
    with ProgressDisplay(20, 0, False, console=Console(file=quiet), every=5) as bar:
        bar.update(5, 6.0, 1000.0, 0.0)
    assert quiet.getvalue() == ""


def test_status_is_one_plain_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    status("training a tokenizer ...")
    assert capsys.readouterr().err == "atoll: training a tokenizer ...\n"


@pytest.mark.slow
def test_a_run_logging_to_a_file_says_what_it_does(fast_config: dict, tmp_path: Path) -> None:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in fast_config.items() if k not in ("progress", "cache_dir")]
    r = run_atoll("train", *args, f"--cache-dir={tmp_path / 'fresh-cache'}", "--progress-every", "5")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()  # stderr is a pipe here, as in a log file or a cluster job
    assert lines[0].startswith("atoll: training a 512-token BPE tokenizer on ")
    steps = [line.split(" | ")[0] for line in lines if line.startswith("atoll: step")]
    assert steps == [f"atoll: step {s}/20 ({s / 20:.0%})" for s in (5, 10, 15, 20)]


def test_time_left_is_this_sessions_mean_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    import atoll.job.metrics as metrics

    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    bar = ProgressDisplay(100, 20, False, console=Console(file=io.StringIO()))  # resumed at step 20
    assert bar.eta_s(20) is None  # no step yet: no estimate
    now[0] = 130.0  # a slow first step (compilation, a cold cache) weighs as one step of many
    assert bar.eta_s(21) == pytest.approx(30.0 * 79)
    now[0] = 160.0
    assert bar.eta_s(40) == pytest.approx(60.0 / 20 * 60)


def test_a_resumed_tensorboard_folder_reads_as_one_run(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from atoll.job.trackers import TensorBoardTracker

    def ev(step: int, loss: float) -> dict:
        return {"event": "eval", "step": step, "tokens": 100 * step, "eval_loss": loss,
                "bytes_sent_per_island": 1000.0 * step, "sim_wall_s": step / 10}

    first = TensorBoardTracker(tmp_path, {})
    before = [ev(0, 6.0), ev(5, 5.5), ev(10, 5.0)]
    for record in [*before, ev(15, 4.5)]:  # the run stopped after step 15; its checkpoint is step 10's
        first.log(record)
    first.close()
    resumed = TensorBoardTracker(tmp_path, {}, start_step=10, history=before)
    for record in (ev(15, 4.25), ev(20, 4.0)):
        resumed.log(record)
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    expected = [(0, 6.0), (5, 5.5), (10, 5.0), (15, 4.25), (20, 4.0)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == expected
    assert [(e.step, e.value) for e in acc.Scalars("eval_vs_bytes/loss")] == [(1000 * s, v) for s, v in expected]
    assert [(e.step, e.value) for e in acc.Scalars("eval_vs_tokens/loss")] == [(100 * s, v) for s, v in expected]
