"""The ``collective`` runtime on the CPU (gloo, real processes): same weights as ``local``, failures, resume.

Every run is a subprocess with a timeout, and every exit status is checked. The micro model, 12 steps and
``threads=1`` keep the file at about two minutes on 2 loaded cores.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import cli_flags
from safetensors.torch import load_file

from atoll.config import build_config, load_run_config
from atoll.config.applies import applicable
from atoll.job.metrics import read_metrics
from atoll.runtime.collective import EXIT_PEER_FAILURE, KILL_HOOK_ENV
from atoll.training import train

pytestmark = pytest.mark.slow  # real processes (and Ray) in every test

STEPS = 12


@pytest.fixture()
def settings(corpus_file: Path, cache_dir: Path, tmp_path: Path) -> dict:
    return {"data": str(corpus_file), "cache_dir": str(cache_dir), "model": "micro", "vocab_size": 512,
            "seq_len": 32, "batch_size": 4, "islands": 2, "steps": STEPS, "sync_every": 5, "eval_every": 12,
            "eval_batches": 2, "checkpoint_every": 5, "progress": False, "threads": 1}


def _atoll(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atoll.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _weights(run: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:07d}" / "model" / "model.safetensors"))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                         ranks_per_island: int) -> None:
    assert a.keys() == b.keys()
    if ranks_per_island == 1:
        # the same gradients as local; only the order of the cross-island sums differs
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
        return
    # ranks inside an island sum their half-batch gradients in another order. Adam's first steps divide
    # by |g|, so an element whose gradient is near zero may move by a fraction of lr (3e-3): bound each
    # element well below one step, and the whole model to float round-off.
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-4, msg=k)
    diff = torch.cat([(a[k] - b[k]).flatten() for k in a]).norm()
    assert diff / torch.cat([a[k].flatten() for k in a]).norm() < 1e-5


def _local(settings: dict, out: Path, **extra) -> dict:
    return train(build_config(overrides=applicable({**settings, **extra, "out": str(out)})))


def _collective(settings: dict, out: Path, ranks: int, env: dict | None = None,
                **extra) -> subprocess.CompletedProcess:
    flags = cli_flags({**settings, **extra, "runtime": "collective", "ranks_per_island": ranks, "out": str(out)})
    return _atoll("train", *flags, env=env)


@pytest.mark.parametrize(("strategy", "ranks", "extra"), [
    # (diloco on islands of one rank: diloco-2x2's maths on the layout of ddp-2x1, not run again)
    ("ddp", 1, {}), ("ddp", 2, {}), ("diloco", 2, {}),
    # exchanges in flight over inner steps, int4 with stochastic rounding and error feedback: the encoded
    # payloads are all-gathered and averaged exactly as the local runtime's average_encoded does
    ("streaming", 1, {"fragments": 2, "overlap_steps": 1, "codec": "int4", "codec_rounding": "stochastic",
                      "error_feedback": True}),
    # DeMo payloads (indices and values) all-gathered as bytes: sign values packed 2 bits each, float32
    ("demo", 2, {"demo_sign_values": True}), ("demo", 1, {"demo_sign_values": False}),
], ids=["ddp-2x1", "ddp-2x2", "diloco-2x2", "streaming-int4-2x1", "demo-sign-2x2", "demo-f32-2x1"])
def test_collective_ends_with_the_weights_of_local(settings: dict, tmp_path: Path, strategy: str, ranks: int,
                                                   extra: dict) -> None:
    local = _local(settings, tmp_path / "local", strategy=strategy, **extra)
    r = _collective(settings, tmp_path / "coll", ranks, strategy=strategy, **extra)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_weights(_weights(tmp_path / "local"), _weights(tmp_path / "coll"), ranks)
    coll = json.loads((tmp_path / "coll" / "summary.json").read_text())
    assert coll["runtime"] == "collective"
    # bytes counted from the tensors sent: the same formulas as local's at K = 2
    for key in ("tokens", "bytes_sent_per_island", "exchanges", "peak_bytes_per_exchange",
                "ddp_bytes_per_island"):
        assert coll[key] == local[key], key
    assert coll["final_eval_loss"] == pytest.approx(local["final_eval_loss"], abs=1e-4)
    assert coll["sim_wall_s"] > 0 and coll["compute_s"] > 0
    events = read_metrics(tmp_path / "coll" / "metrics.jsonl")  # written once, by rank 0
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, STEPS]
    assert "run folder:" in r.stdout and r.stdout.count("run folder:") == 1
    if strategy == "diloco" and ranks == 2:
        # the checkpoint is in the local runtime's format: keep step 10 only (islands hold their own inner
        # optimizer states there) and finish the run in-process, under local
        shutil.rmtree(tmp_path / "coll" / "checkpoints" / f"step_{STEPS:07d}")
        (tmp_path / "coll" / "checkpoints" / "latest").unlink()  # a link to the step removed
        (tmp_path / "coll" / "checkpoints" / "latest").write_text("step_0000010\n")  # the text form is read too
        resumed = train(load_run_config(tmp_path / "coll", {"runtime": "local"}), resume=True)
        _assert_same_weights(_weights(tmp_path / "local"), _weights(tmp_path / "coll"), ranks)
        assert resumed["bytes_sent_per_island"] == local["bytes_sent_per_island"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_killed_rank_stops_the_others_with_a_clear_line_under_torchrun_env(settings: dict,
                                                                           tmp_path: Path) -> None:
    """Ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT); rank 1 is SIGKILLed."""
    out = tmp_path / "run"
    flags = cli_flags({**settings, "strategy": "ddp", "runtime": "collective", "out": str(out), "min_islands": 2})
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           KILL_HOOK_ENV: "1:8"}
    procs = [subprocess.Popen([sys.executable, "-m", "atoll.cli", "train", *flags], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    try:
        procs[1].wait(timeout=180)
        killed_at = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9
    assert procs[0].returncode == EXIT_PEER_FAILURE, err[-3000:]
    assert time.monotonic() - killed_at < 60
    line = err.strip().splitlines()[-1]
    assert line.startswith("atoll: error: island 1 (rank 1) stopped responding at inner step 8 (")
    assert line.endswith(f"resume with 'atoll train --resume {out}' (from step 5)")
    assert (out / "checkpoints" / "step_0000005").is_dir()


def test_killed_rank_under_the_launcher_then_resume_finishes_the_run(settings: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    started = time.monotonic()
    r = _collective(settings, out, 2, env={KILL_HOOK_ENV: "3:8"}, strategy="diloco", min_islands=2)
    assert r.returncode == 128 + 9, r.stderr[-3000:]  # the first rank to fail: killed by SIGKILL
    assert time.monotonic() - started < 120
    # one line for the run: the launcher's (the 3 survivors hand theirs over, unsaid)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("atoll: error:")]
    assert errors == [f"atoll: error: rank 3 (island 1) was killed by SIGKILL; resume with 'atoll train --resume "
                      f"{out}' (from step 5)"], errors
    assert os.readlink(out / "checkpoints" / "latest") == "step_0000005"

    r = _atoll("train", "--resume", str(out))  # the saved config says collective, 2 ranks per island
    assert r.returncode == 0, r.stderr[-3000:]
    _local(settings, tmp_path / "local", strategy="diloco")
    _assert_same_weights(_weights(tmp_path / "local"), _weights(out), 2)
    evals = [e["step"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "eval"]
    assert evals == [0, STEPS]


def test_batch_not_divisible_by_ranks_is_a_config_error() -> None:
    r = _atoll("train", "--runtime", "collective", "--batch-size", "6", "--ranks-per-island", "4",
               timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("atoll: error: batch_size (6) must be divisible by ranks_per_island (4)")


def test_launcher_store_listens_on_the_loopback_only() -> None:
    from atoll.runtime.collective.launch import loopback_interface, loopback_store

    store = loopback_store(5.0)
    try:
        store.set("k", "v")
        port = f"{store.port:04X}"
        listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                     + Path("/proc/net/tcp6").read_text().splitlines()[1:]]
        mine = [f[1] for f in listening if f[1].endswith(":" + port) and f[3] == "0A"]  # 0A: LISTEN
        assert mine == ["0100007F:" + port]  # 127.0.0.1 only, no wildcard (0.0.0.0 or ::)
    finally:
        del store
    assert loopback_interface().startswith("lo")


def test_resume_advice_names_what_exists(tmp_path: Path) -> None:
    from atoll.job.checkpoint import resume_advice

    run = tmp_path / "run"
    run.mkdir()
    assert resume_advice(run) == (f"no checkpoint was written yet in '{run}' (see --checkpoint-every); remove it "
                                  "and start again")
    step = run / "checkpoints" / "step_0000040"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_0000040")
    assert resume_advice(run) == f"resume with 'atoll train --resume {run}' (from step 40)"
