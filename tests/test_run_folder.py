"""One process per run folder (the lock), and config.json written atomically."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from atoll.errors import CheckpointError, ConfigError
from atoll.job.checkpoint import latest_checkpoint, write_text_atomic
from atoll.job.lock import LOCK_NAME, RunLock, claim_run_folder

HOLD = """
import sys, time
from pathlib import Path
from atoll.job.lock import RunLock
lock = RunLock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def _holder(out: Path) -> subprocess.Popen:
    """Another process that holds ``out`` as a live run would."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _train_args(fast_config: dict, out: Path) -> list[str]:
    c = fast_config
    return ["train", "--data", c["data"], "--cache-dir", c["cache_dir"], "--model", "micro", "--vocab-size", "512",
            "--seq-len", "32", "--batch-size", "4", "--islands", "2", "--steps", "4", "--sync-every", "2",
            "--checkpoint-every", "2", "--threads", "1", "--no-progress", "--out", str(out)]


def _one_error_line(stderr: str) -> str:
    """The one line of an error that stopped a run: the last line, and the only ``atoll: error:`` one (a first
    run in a fresh cache says first that it trains the tokenizer)."""
    errors = [line for line in stderr.strip().splitlines() if line.startswith("atoll: error:")]
    assert len(errors) == 1 and stderr.strip().splitlines()[-1] == errors[0], stderr
    return errors[0]


def test_a_folder_in_use_is_refused_for_a_new_run_and_for_resume(fast_config, tmp_path) -> None:
    out = tmp_path / "run"
    assert run_cli(*_train_args(fast_config, out)).returncode == 0
    holder = _holder(out)
    try:
        metrics = (out / "metrics.jsonl").read_bytes()
        for args in (_train_args(fast_config, out), ["train", "--resume", str(out), "--steps", "6"]):
            r = run_cli(*args)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
            assert f"in use by another atoll process (pid {holder.pid})" in r.stderr
        assert (out / "metrics.jsonl").read_bytes() == metrics  # nothing written by the refused processes
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # the holder died without cleaning up (SIGKILL): the kernel dropped its lock, so the resume goes on
    r = run_cli("train", "--resume", str(out), "--steps", "6")
    assert r.returncode == 0, r.stderr


def test_lock_is_exclusive_and_released(tmp_path) -> None:
    first = RunLock(tmp_path)
    with pytest.raises(ConfigError, match=rf"pid {os.getpid()}"):
        RunLock(tmp_path)  # a second open file description conflicts, even in the same process
    first.release()
    first.release()  # twice is harmless
    RunLock(tmp_path).release()
    assert (tmp_path / LOCK_NAME).read_text() == str(os.getpid())


def test_a_new_run_in_a_live_runs_folder_is_named_as_in_use(tmp_path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # a live run that has not checkpointed yet
    holder = _holder(out)
    try:
        with pytest.raises(ConfigError, match="in use"):  # not "holds an unfinished run"
            claim_run_folder(out, "diloco", resume=False)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    with pytest.raises(ConfigError, match="unfinished run"):
        claim_run_folder(out, "diloco", resume=False)


def test_config_json_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    path = tmp_path / "config.json"
    write_text_atomic(path, '{"steps": 800}')

    def torn_replace(src, dst):  # the process dies between writing the new file and renaming it
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", torn_replace)
    with pytest.raises(OSError):
        write_text_atomic(path, '{"steps": 1600}')
    assert path.read_text() == '{"steps": 800}'  # the old file, whole


def test_disk_full_mid_run_is_one_line_and_the_last_checkpoint_stays(fast_config, tmp_path, monkeypatch) -> None:
    import errno

    from atoll.job import run as run_module

    real = run_module.save_checkpoint
    calls = []

    def full_disk(out, step, *args, **kwargs):  # the second checkpoint finds the disk full
        calls.append(step)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(out / "checkpoints"))
        return real(out, step, *args, **kwargs)

    monkeypatch.setattr(run_module, "save_checkpoint", full_disk)
    out = tmp_path / "run"
    r = run_cli(*_train_args(fast_config, out))
    line = _one_error_line(r.stderr)
    assert r.returncode == 1 and "No space left on device" in line and f"--resume {out}' (from step 2)" in line
    monkeypatch.setattr(run_module, "save_checkpoint", real)
    r = run_cli("train", "--resume", str(out))  # the step-2 checkpoint is whole: the run goes on from it
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("writer", ["state", "model"])
def test_disk_full_in_safetensors_is_one_line_and_the_last_checkpoint_stays(fast_config, tmp_path, monkeypatch,
                                                                           writer: str) -> None:
    """safetensors raises its own SafetensorError (not an OSError) for a full disk, when atoll writes the run's
    state and when transformers writes the model's weights: the same one line with the resume advice, exit 1."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    from atoll.job import checkpoint

    module, name = (checkpoint, "save_file") if writer == "state" else (transformers.modeling_utils, "safe_save_file")
    real, calls = getattr(module, name), []

    def full_disk(tensors, filename, *args, **kwargs):  # the second checkpoint finds the disk full
        calls.append(filename)
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(module, name, full_disk)
    out = tmp_path / "run"
    r = run_cli(*_train_args(fast_config, out))
    line = _one_error_line(r.stderr)
    assert r.returncode == 1 and line.startswith("atoll: error: No space left on device ('") and "checkpoints" in line
    assert line.endswith(f"free disk space or make the folder writable, then resume with 'atoll train --resume {out}' "
                         "(from step 2)"), line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_0000002"]  # no torn one
    monkeypatch.setattr(module, name, real)
    r = run_cli("train", "--resume", str(out))  # the step-2 checkpoint is whole: the run goes on from it
    assert r.returncode == 0, r.stderr


def test_a_safetensors_error_that_is_not_io_is_not_taken_for_a_full_disk() -> None:
    from safetensors import SafetensorError

    from atoll.job.checkpoint import _writing

    with pytest.raises(OSError) as e, _writing(Path("/run/state.safetensors")):
        raise SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)")
    assert (e.value.errno, e.value.strerror, e.value.filename) == (30, os.strerror(30), "/run/state.safetensors")
    with pytest.raises(SafetensorError), _writing(Path("/run/state.safetensors")):
        raise SafetensorError("Error while serializing: tensor is not contiguous")


def test_out_of_memory_is_one_line(fast_config, tmp_path, monkeypatch) -> None:
    import torch

    from atoll.job.island import Island

    def oom(self, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(Island, "forward_backward", oom)
    r = run_cli(*_train_args(fast_config, tmp_path / "run"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "out of memory; lower --batch-size" in r.stderr


def test_summary_json_is_strict_json_when_a_figure_is_not_finite(tmp_path) -> None:
    import json

    from atoll.job.metrics import write_summary

    write_summary(tmp_path, {"final_eval_loss": float("inf"), "losses": [2.5, float("nan")], "steps": 3})

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert summary == {"final_eval_loss": None, "losses": [2.5, None], "steps": 3}


def test_resume_of_a_run_stopped_before_its_first_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint in"):  # not a run at all
        latest_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="stopped before its first checkpoint.*start again"):
        latest_checkpoint(tmp_path)
