"""SIGINT and SIGTERM stop a run with a checkpoint of the step it reached (:mod:`atoll.job.stop`), on every
runtime and strategy; a second signal stops at once; the resume equals the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_flags, run_cli
from safetensors.torch import load_file

from atoll.config.applies import applicable
from atoll.job.checkpoint import latest_checkpoint
from atoll.job.metrics import read_metrics


def _start(settings: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "atoll.cli", "train", *cli_flags(settings), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _signal_mid_run(proc: subprocess.Popen, out: Path, signum: int, timeout: float = 240,
                    group: bool = False) -> tuple[int, str]:
    """Send ``signum`` once the run has logged its first ``train`` event; return (status, stderr)."""
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and '"event": "train"' in metrics.read_text():
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before the signal: {proc.communicate()[1][-2000:]}"
    if group:  # as Ctrl-C in a terminal: the launcher and every rank
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err


def _weights(run: Path) -> dict:
    return load_file(str(latest_checkpoint(run) / "model" / "model.safetensors"))


STEPS = 80  # the signal comes at the first ``train`` event (step 10): 70 steps to spare on a loaded machine


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "extra", "signum", "group"), [
    # the local runtime's lockstep loop (streaming, SIGINT) and its event loop (decoupled, SIGTERM); diloco's
    # outer state under SIGTERM on the collective runtime below
    ("streaming", {"sync_every": 6, "fragments": 2, "overlap_steps": 1}, signal.SIGINT, False),
    ("decoupled", {"sync_every": 6, "fragments": 2}, signal.SIGTERM, False),
    # collective: SIGTERM to the launcher alone (a scheduler's), and SIGINT to every process (Ctrl-C); the
    # ranks agree through the store on one step, which rank 0 checkpoints
    ("diloco", {"sync_every": 7, "runtime": "collective"}, signal.SIGTERM, False),
    ("ddp", {"runtime": "collective", "min_islands": 1}, signal.SIGINT, True),
])
def test_a_signal_mid_run_checkpoints_the_step_reached_and_the_resume_equals_the_whole_run(
        fast_config: dict, tmp_path: Path, strategy: str, extra: dict, signum: int, group: bool) -> None:
    settings = applicable({**fast_config, "strategy": strategy, "steps": STEPS, "eval_every": 1000,
                           "checkpoint_every": 1000, **extra})
    flags = cli_flags({**settings, "out": str(tmp_path / "whole")})
    if settings.get("runtime", "local") == "local":  # the reference in this process (a process start spared)
        whole = run_cli("train", *flags)
    else:
        whole = subprocess.run([sys.executable, "-m", "atoll.cli", "train", *flags], capture_output=True, text=True,
                               timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "cut"
    code, err = _signal_mid_run(_start({**settings, "out": str(out)}), out, signum, group=group)
    assert code == 128 + signum, err[-2000:]
    assert "Traceback" not in err
    ckpt = latest_checkpoint(out)
    step = int(ckpt.name.split("_")[1])
    assert 10 <= step < STEPS, "a checkpoint of the step reached, not of --checkpoint-every (1000)"
    events = read_metrics(out / "metrics.jsonl")
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]  # collective: also after the first exchange
    assert saved[-1] == step and all(s < 10 for s in saved[:-1])
    assert max(e["step"] for e in events if e["event"] == "train") <= step
    assert f"checkpoint written at step {step}" in err.strip().splitlines()[-1]
    assert not (out / "summary.json").exists()  # not a finished run: the resume below finishes it
    resumed = subprocess.run([sys.executable, "-m", "atoll.cli", "train", "--resume", str(out), "--no-progress"],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = _weights(tmp_path / "whole"), _weights(out)
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= 1e-6, k
    full, cont = (json.loads((p / "summary.json").read_text()) for p in (tmp_path / "whole", out))
    assert cont["final_eval_loss"] == pytest.approx(full["final_eval_loss"], abs=1e-6)
    assert cont["tokens"] == full["tokens"] and cont["bytes_sent_per_island"] == full["bytes_sent_per_island"]
    ends = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] in ("checkpoint", "end")]
    assert [(e["event"], e["step"]) for e in ends][-3:] == [("checkpoint", step), ("checkpoint", STEPS), ("end", STEPS)]


def _under_on_signals(tmp_path: Path, *lines: str) -> subprocess.CompletedProcess:
    """A Python process that runs ``lines`` inside ``stop.on_signals()``, then sleeps 120 s (a process a signal
    does not end exits 0 only after that); its status and output."""
    script = tmp_path / "signals.py"
    script.write_text("import os, signal, sys, time\nfrom atoll.job import stop\nwith stop.on_signals():\n"
                      + "".join(f"    {line}\n" for line in lines) + "    time.sleep(120)\nsys.exit(0)\n")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    proc = _under_on_signals(tmp_path, "os.kill(os.getpid(), signal.SIGTERM)",
                             "assert stop.requested() == signal.SIGTERM", "print('asked', flush=True)",
                             "os.kill(os.getpid(), signal.SIGTERM)")
    assert proc.stdout == "asked\n"
    assert proc.returncode == 128 + signal.SIGTERM
    assert "again: stopping at once" in proc.stderr


def test_a_relayed_request_is_not_the_first_signal(tmp_path: Path) -> None:
    """A collective rank's store poller can relay another rank's stop (``stop.request``) before this rank's own
    signal arrives (a signal to the process group): that signal is this process's first, not a second one, so
    it finishes the step and checkpoints (before: it exited at once, without a checkpoint); a second does exit."""
    proc = _under_on_signals(tmp_path, "stop.request(signal.SIGINT)", "os.kill(os.getpid(), signal.SIGTERM)",
                             "assert stop.requested() == signal.SIGINT", "print('still here', flush=True)",
                             "os.kill(os.getpid(), signal.SIGTERM)")
    assert proc.stdout == "still here\n"
    assert proc.returncode == 128 + signal.SIGTERM
    assert proc.stderr.splitlines() == [
        "atoll: SIGTERM: finishing this inner step and writing a checkpoint (send it again to stop at once)",
        "atoll: SIGTERM again: stopping at once, without a checkpoint of this step"]


@pytest.mark.slow
def test_sigterm_to_a_ray_run_checkpoints_the_steps_granted(fast_config: dict, tmp_path: Path) -> None:
    """On Ray the driver's SIGTERM (ray.init sets its own handler, which exited) stops the syncer granting
    steps; the islands finish theirs and push; the global model is checkpointed at the mean steps done."""
    pytest.importorskip("ray")
    out = tmp_path / "ray-run"
    settings = {**fast_config, "strategy": "decoupled", "runtime": "ray", "fragments": 2, "sync_every": 4,
                "steps": 2000, "eval_every": 10000, "checkpoint_every": 10000, "out": str(out)}
    proc = _start(applicable(settings))
    try:
        deadline = time.monotonic() + 240
        while not any((out / "syncer" / "checkpoints").glob("step_*")):  # the syncer has committed: training
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no commit within 240 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and the local Ray it started
        proc.wait()
        raise
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    step = int(latest_checkpoint(out).name.split("_")[1])
    assert 0 < step < 2000 and (latest_checkpoint(out) / "model" / "model.safetensors").is_file()
    last = err.strip().splitlines()[-1]
    assert f"checkpoint written at step {step}" in last and "--init-from" in last, last
    assert not (out / "summary.json").exists()
