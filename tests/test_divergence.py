"""Divergence: a diverged island is reset and counted, a diverged job stops with one line and keeps its summary.

The strategies run on in-process islands (fast); whole runs inject NaN weights or gradients with the fault
hook of :mod:`atoll.job.divergence` (the ``fault_hook`` fixture in this process; ``ATOLL_TEST_NAN_AT``, read once
at a child process's start) under the local, event and collective runtimes.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_island, run_cli
from rich.console import Console
from test_strategy_plugin import fedavg  # noqa: F401 (the FedAvg plugin's fixture)

from atoll.config import TrainConfig, build_config
from atoll.config.applies import applicable
from atoll.errors import ConfigError
from atoll.job.divergence import (
    FAULT_HOOK_ENV,
    RESET_LIMIT,
    Diverged,
    eval_diverged,
    inject_fault,
    install_fault_hook_from_env,
    message,
    record,
    resets_diverged,
    set_fault_hook,
)
from atoll.job.metrics import read_metrics, summary_table
from atoll.job.model import build_model
from atoll.runtime.local import LocalComm
from atoll.runtime.network import Link, SimClock
from atoll.strategies.ddp import DDP
from atoll.strategies.demo import DeMoStrategy, make_optimizer
from atoll.strategies.diloco import DiLoCo
from atoll.strategies.sparseloco import SparseLoCo
from atoll.strategies.streaming import StreamingDiLoCo
from atoll.training import train

VOCAB, SEQ, BATCH = 300, 16, 4


OWN = {DeMoStrategy: {"demo_chunk": 16, "demo_topk": 8}, StreamingDiLoCo: {"fragments": 2, "overlap_steps": 1}}


def _setup(strategy_cls, k: int, **cfg):
    base = {"strategy": strategy_cls.name, "islands": k, "steps": 12, "lr": 1e-2, "warmup_steps": 0, "seq_len": SEQ,
            "batch_size": BATCH, "codec": "fp32"}  # lr and codec where the strategy reads them
    config = TrainConfig(**{**applicable(base), **OWN.get(strategy_cls, {}), **cfg})
    model = build_model("micro", VOCAB, SEQ, seed=0)
    clock = SimClock(k)
    comm = LocalComm(k, Link.from_config(100, 10), clock)
    inner = make_optimizer if strategy_cls is DeMoStrategy else None
    islands = [make_island(i, copy.deepcopy(model), config, clock, optimizer=inner) for i in range(k)]
    return config, comm, islands, strategy_cls(config.strategy_config, islands, comm, config.seed)


def _batch(i: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * i + step))


def _poison_weights(island) -> None:
    with torch.no_grad():
        for p in island.params:
            p.fill_(float("nan"))


def _forward(islands, step: int, bad_weights: tuple[int, ...] = (), bad_grad: tuple[int, ...] = ()) -> None:
    for island in islands:
        if island.index in bad_weights:
            _poison_weights(island)
        island.forward_backward(_batch(island.index, step))
        if island.index in bad_grad:
            for p in island.params:
                p.grad.fill_(float("nan"))


def _same_and_finite(islands) -> bool:
    flats = [i.flat_params() for i in islands]
    return all(torch.isfinite(f).all() and torch.equal(f, flats[0]) for f in flats)


# --- lockstep strategies on in-process islands ---------------------------------------------------------------


@pytest.mark.parametrize("strategy_cls", [DDP, DeMoStrategy])
def test_an_island_with_nan_weights_is_reset_from_a_healthy_replica(strategy_cls) -> None:
    # before: ddp skipped every later step on every island (the NaN island's gradient poisoned the mean);
    # demo stopped with DeMo's "no parameter has a gradient"
    config, comm, islands, strategy = _setup(strategy_cls, 3)
    for step in range(5):
        _forward(islands, step, bad_weights=(1,) if step == 2 else ())
        strategy.step(step)
        assert _same_and_finite(islands), step  # the replicas are one model again at once
        if step == 2 and strategy_cls is DeMoStrategy:  # a reset island starts a fresh momentum
            assert not islands[1].optimizer.state and islands[0].optimizer.state
    assert [i.reset_count for i in islands] == [0, 1, 0]
    assert strategy.dropped_updates == 1
    assert sum(i.skipped_steps for i in islands) == 0


def test_ddp_leaves_a_nan_gradient_out_of_the_mean_instead_of_skipping_the_step() -> None:
    config, comm, islands, ddp = _setup(DDP, 3)
    reference = make_island(0, copy.deepcopy(islands[0].model), config, None)
    _forward(islands, 0, bad_grad=(1,))
    grads = [i.flat_grads() for i in islands]
    ddp.step(0)
    reference.set_flat_grads((grads[0] + grads[2]) / 2)  # the mean of the two healthy islands
    reference.inner_step()
    assert _same_and_finite(islands)
    torch.testing.assert_close(islands[0].flat_params(), reference.flat_params(), rtol=0, atol=1e-7)
    assert sum(i.skipped_steps for i in islands) == 0 and ddp.dropped_updates == 1


def test_demo_counts_a_nan_gradient_as_zero_and_goes_on() -> None:
    # before: RuntimeError("DeMo.encode_step: no parameter has a gradient") ended the run
    config, comm, islands, demo = _setup(DeMoStrategy, 2)
    before = islands[0].flat_params()
    for step in range(3):
        _forward(islands, step, bad_grad=(1,) if step == 1 else ())
        demo.step(step)
    assert _same_and_finite(islands) and not torch.equal(islands[0].flat_params(), before)
    assert [i.skipped_steps for i in islands] == [0, 1] and [i.reset_count for i in islands] == [0, 0]


@pytest.mark.parametrize("strategy_cls", [DDP, DeMoStrategy])
def test_every_island_diverged_is_the_job_diverged(strategy_cls) -> None:
    config, comm, islands, strategy = _setup(strategy_cls, 2)
    _forward(islands, 0)
    strategy.step(0)
    _forward(islands, 1, bad_weights=(0, 1))
    with pytest.raises(Diverged) as e:
        strategy.step(1)
    assert e.value.step == 2 and "every island" in e.value.what


@pytest.mark.parametrize("strategy_cls", [DiLoCo, StreamingDiLoCo, SparseLoCo])
def test_an_island_with_nan_weights_is_reset_from_the_global_model(strategy_cls) -> None:
    # before: diloco and streaming (and sparseloco until issue 24) kept training the NaN replica until its
    # pseudo-gradient was dropped at the sync, its AdamW state kept, and nothing counted it. Since issue 25
    # nothing is read on the host in an inner step: the reset waits for the loop's logging step (here) or the
    # next exchange (the test below)
    config, comm, islands, strategy = _setup(strategy_cls, 2, sync_every=4)
    global_before = strategy.global_params()
    for step in range(3):  # step 2 is no exchange (streaming's fragments start at steps 1 and 3)
        _forward(islands, step, bad_weights=(1,) if step == 2 else ())
        strategy.step(step)
    assert islands[1].reset_count == 0 and islands[1].skipped_steps == 0  # its NaN step skipped, not counted
    assert strategy.reset_diverged(3) == 1  # the loop's logging step
    assert torch.equal(islands[1].flat_params(), strategy.global_params())  # back to the global model
    if strategy_cls is not StreamingDiLoCo:  # no outer step yet (streaming merged fragment 0 at step 2)
        assert torch.equal(strategy.global_params(), global_before)
    assert islands[1].reset_count == 1 and not islands[1].optimizer.state  # a fresh AdamW
    assert islands[0].reset_count == 0 and islands[0].optimizer.state
    assert strategy.reset_diverged(3) == 0  # reset once: the NaN loss was of the lost weights
    for step in range(3, 8):
        _forward(islands, step)
        strategy.step(step)
    strategy.finish(8)
    assert torch.isfinite(strategy.global_params()).all() and not torch.equal(strategy.global_params(), global_before)


@pytest.mark.parametrize("strategy_cls", [DiLoCo, StreamingDiLoCo, SparseLoCo])
def test_a_diverged_island_is_reset_as_the_next_exchange_starts_before_its_state_is_exchanged(strategy_cls) -> None:
    config, comm, islands, strategy = _setup(strategy_cls, 2, sync_every=4)
    global_before = strategy.global_params()
    reset_at = None
    for step in range(8):
        exchanges = comm.exchanges
        _forward(islands, step, bad_weights=(1,) if step == 1 else ())
        strategy.step(step)  # no logging step: only the exchanges look
        if reset_at is None and islands[1].reset_count:
            reset_at = step
            assert comm.exchanges > exchanges  # at the first exchange after the fault, not before
        elif reset_at is None:
            assert step < 1 or comm.exchanges == exchanges
    assert reset_at == (1 if strategy_cls is StreamingDiLoCo else 3)  # streaming: fragment 0 starts at step 1
    assert [i.reset_count for i in islands] == [0, 1] and strategy.dropped_updates == 0  # reset, never sent
    strategy.finish(8)
    new_global = strategy.global_params()
    assert torch.isfinite(new_global).all() and not torch.equal(new_global, global_before)
    assert all(torch.isfinite(i.flat_params()).all() for i in islands)


@pytest.mark.parametrize("strategy_cls", [DiLoCo, SparseLoCo])
def test_no_finite_pseudo_gradient_at_a_sync_is_the_job_diverged(strategy_cls) -> None:
    # before: the outer step was skipped silently and every island restarted from the old global model
    config, comm, islands, diloco = _setup(strategy_cls, 2, sync_every=2)
    for step in range(2):
        _forward(islands, step)
        for island in islands:
            island.inner_step()
    for island in islands:
        with torch.no_grad():
            island.params[0].fill_(float("inf"))
    with pytest.raises(Diverged) as e:
        diloco.outer_step(2)
    assert e.value.step == 2 and "pseudo-gradient" in e.value.what


def test_sparseloco_drops_a_non_finite_island_at_the_sync_and_resets_it() -> None:
    config, comm, islands, strategy = _setup(SparseLoCo, 2, sync_every=2)
    for step in range(2):
        _forward(islands, step)
        for island in islands:
            island.inner_step()
    with torch.no_grad():
        islands[1].params[0].fill_(float("inf"))
    strategy.outer_step(2)
    assert strategy.dropped_updates == 1 and islands[1].reset_count == 1 and not islands[1].optimizer.state
    assert islands[0].reset_count == 0 and islands[0].optimizer.state
    assert _same_and_finite(islands) and torch.equal(islands[0].flat_params(), strategy.global_params())
    assert float(strategy.error[1].abs().max()) == 0.0  # its accumulator took nothing of the bad round


def test_sparseloco_with_a_non_finite_global_model_is_the_job_diverged() -> None:
    config, comm, islands, strategy = _setup(SparseLoCo, 2, sync_every=2, outer_lr=1e38)
    for step in range(2):
        _forward(islands, step)
        for island in islands:
            island.inner_step()
    with pytest.raises(Diverged) as e:
        strategy.outer_step(2)
    assert e.value.step == 2 and "global model is not finite" in e.value.what


def test_decoupled_island_with_nan_weights_is_reset_from_its_last_pull() -> None:
    # before: its pushes were refused (non_finite) for the rest of the run and it never recovered
    from atoll.runtime.decoupled_job import job_of
    from atoll.strategies.decoupled.island import IslandWorker

    config = TrainConfig(strategy="decoupled", islands=2, steps=12, lr=1e-2, warmup_steps=0, seq_len=SEQ,
                         batch_size=BATCH, fragments=2, sync_every=4)
    model = build_model("micro", VOCAB, SEQ, seed=0)
    rng = np.random.default_rng(0)
    data = SimpleNamespace(island_tokens=[rng.integers(0, VOCAB, 5000).astype(np.uint16) for _ in range(2)])
    job = job_of(config, data, model)  # type: ignore[arg-type]
    worker = IslandWorker(1, job, 12)
    worker.train_step()
    worker.push(0)  # an exchange in progress: the reset drops it
    pulled = job.init_flat.clone()
    _poison_weights(worker.island)
    assert math.isnan(worker.train_step())
    assert worker.island.reset_count == 1 and torch.equal(worker.island.flat_params(), pulled)
    assert worker.at_push == [None, None] and worker.tokens_since == [0, 0] and not worker.island.optimizer.state
    assert math.isfinite(worker.train_step()) and worker.tokens_since == [config.tokens_per_step] * 2


# --- the rules and what is shown -----------------------------------------------------------------------------


def test_divergence_rules_and_the_line() -> None:
    assert eval_diverged(float("nan"), 512) and eval_diverged(float("inf"), 512)
    assert "above 10 x ln(vocabulary)" in eval_diverged(1000.0, 512)
    assert eval_diverged(27.0, 512) is None and eval_diverged(6.2, 512) is None  # a spike that recovers
    assert resets_diverged(RESET_LIMIT * 2, 2) is None and "reset 11 times" in resets_diverged(RESET_LIMIT * 2 + 1, 2)
    line = message({"step": 7, "reason": "x", "fix": "lower --lr (it is 10)"})
    assert line == "training diverged at step 7: x; lower --lr (it is 10)"


def test_the_advice_names_only_flags_the_strategy_or_the_run_accepts(fedavg: str) -> None:  # noqa: F811
    """Every registered strategy's advice (the FedAvg plugin's too: plain averaging, no outer optimizer) names
    only its own config's settings and the run's: ddp, demo and FedAvg are never told of --outer-lr."""
    import re

    from atoll.config.applies import run_settings
    from atoll.strategies.registry import specs

    for own in specs():
        config = build_config(overrides={"strategy": own.name})
        fix = record(config.strategy_config, config, Diverged(3, "x"))["fix"]
        flags = {f.replace("-", "_") for f in re.findall(r"--([a-z][a-z0-9-]*)", fix)}
        assert flags and flags <= set(own.config.model_fields) | run_settings(), (own.name, fix)
        assert ("outer_lr" in flags) == ("outer_lr" in own.config.model_fields), (own.name, fix)
        assert {"lr", "demo_lr"} & flags, (own.name, fix)  # an inner rate: its own
    assert {s.name for s in specs()} >= {"ddp", "demo", fedavg}
    config = build_config(overrides={"strategy": fedavg, "lr": 0.5, "grad_clip": 0})
    fix = record(config.strategy_config, config, Diverged(3, "x"))["fix"]
    assert fix == "lower --lr (it is 0.5), raise --warmup-steps (it is 40), keep --grad-clip on, and start again"
    short = build_config(overrides={"strategy": "diloco", "steps": 60})  # 40 steps of warmup, capped at 6
    fix = record(short.strategy_config, short, Diverged(3, "x"))["fix"]
    assert "lengthen the warmup with --steps (--warmup-steps 40 is capped at a tenth of --steps 60: 6)" in fix, fix


def test_the_fault_hook_names_its_format(monkeypatch, fault_hook) -> None:
    config, comm, islands, ddp = _setup(DDP, 1)
    with pytest.raises(ConfigError, match=FAULT_HOOK_ENV):
        fault_hook("weights:0")
    monkeypatch.setenv(FAULT_HOOK_ENV, "weights:0")  # a child process's: refused as it starts
    with pytest.raises(ConfigError, match=FAULT_HOOK_ENV):
        install_fault_hook_from_env()
    inject_fault(islands[0], 0, "weights")  # no hook installed: nothing happens
    assert torch.isfinite(islands[0].flat_params()).all()
    fault_hook("grad:0:2,weights:0:1")
    monkeypatch.setenv(FAULT_HOOK_ENV, "weights:0")  # the environment is not read in a step
    inject_fault(islands[0], 0, "weights")
    assert not torch.isfinite(islands[0].flat_params()).any()


def test_a_child_process_is_told_its_faults_once_as_it_starts(monkeypatch) -> None:
    config, comm, islands, ddp = _setup(DDP, 2)
    monkeypatch.setenv(FAULT_HOOK_ENV, "weights:1:2")
    install_fault_hook_from_env()
    monkeypatch.delenv(FAULT_HOOK_ENV)
    inject_fault(islands[1], 0, "weights")
    inject_fault(islands[0], 1, "weights")
    assert torch.isfinite(islands[1].flat_params()).all() and torch.isfinite(islands[0].flat_params()).all()
    inject_fault(islands[1], 1, "weights")
    assert not torch.isfinite(islands[1].flat_params()).any()
    assert set_fault_hook(None) is not None


def test_the_table_shows_skipped_steps_resets_divergence_and_an_overflowing_perplexity() -> None:
    base = {"strategy": "ddp", "islands": 2, "params": 1, "tokens": 1, "initial_eval_loss": 6.2,
            "final_eval_loss": 1000.0, "final_perplexity": None, "bytes_sent_per_island": 0.0,
            "ddp_bytes_per_island": 0.0, "reduction_vs_ddp": None, "compute_s": 1.0, "link_bandwidth_mbps": 100,
            "sim_wall_s": 1.0, "compute_utilization": 1.0, "wall_s": 1.0}
    console = Console(width=120, record=True)
    console.print(summary_table({**base, "skipped_steps": 3, "island_resets": [0, 2],
                                 "diverged": {"step": 9, "reason": "x", "fix": "y"}}))
    text = console.export_text()
    assert "exp of the loss overflows" in text and "5184705528587072045056" not in text
    assert "steps skipped (gradient not finite)" in text and "0 / 2" in text and "diverged at step" in text
    console = Console(width=120, record=True)
    console.print(summary_table({**base, "final_eval_loss": 5.0, "final_perplexity": 148.41, "skipped_steps": 0}))
    text = console.export_text()
    assert "148.41" in text and "skipped" not in text and "reset" not in text


# --- whole runs ---------------------------------------------------------------------------------------------

COMMON = ["--model", "micro", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--threads", "1",
          "--no-progress", "--warmup-steps", "0", "--weight-decay", "0", "--eval-batches", "2"]


def _run(tmp_path: Path, corpus_file: Path, cache_dir: Path, *flags: str):
    out = tmp_path / "run"
    common = list(COMMON)
    if "demo" in flags:  # demo steps with its own optimizer: it refuses --weight-decay
        at = common.index("--weight-decay")
        del common[at:at + 2]
    r = run_cli("train", *common, "--data", str(corpus_file), "--cache-dir", str(cache_dir), "--out", str(out),
                *flags)
    return r, out


def _assert_stopped(r, out: Path, step: int) -> dict:
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"atoll: error: training diverged at step {step}: ") and "start again" in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"]["step"] == step and summary["diverged"]["fix"] in line
    end = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "end"]
    assert len(end) == 1 and end[0]["step"] == step and end[0]["diverged"] == summary["diverged"]
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--strategy", "ddp", "--islands", "1", "--lr", "10"],
                                   ["--strategy", "demo", "--islands", "2", "--demo-lr", "10"],
                                   ["--strategy", "diloco", "--islands", "2", "--sync-every", "1", "--lr", "10"],
                                   ["--strategy", "sparseloco", "--islands", "2", "--sync-every", "1", "--lr", "10"]],
                         ids=["ddp", "demo", "diloco", "sparseloco"])
def test_a_huge_learning_rate_stops_with_one_line_and_keeps_a_summary(tmp_path, corpus_file, cache_dir,
                                                                       flags) -> None:
    # before: a traceback (OverflowError in the perplexity) and no summary; then exit 0 with a loss in the
    # thousands and a made-up perplexity in the table
    r, out = _run(tmp_path, corpus_file, cache_dir, *flags, "--steps", "2")
    summary = _assert_stopped(r, out, 1)
    assert summary["final_eval_loss"] > 10 * math.log(512)
    assert "--lr" in summary["diverged"]["fix"] or "--demo-lr" in summary["diverged"]["fix"]
    if summary["final_perplexity"] is None:  # exp overflows: the table says so instead of making one up
        assert "exp of the loss overflows" in r.stdout


@pytest.mark.slow
def test_every_island_diverged_stops_the_run_with_its_summary(tmp_path, corpus_file, cache_dir, fault_hook) -> None:
    # before: ddp skipped every step from then on and exited 0 (its skipped steps shown nowhere)
    fault_hook("weights:0:3,weights:1:3")
    r, out = _run(tmp_path, corpus_file, cache_dir, "--strategy", "ddp", "--islands", "2", "--steps", "8")
    summary = _assert_stopped(r, out, 3)
    assert "every island" in summary["diverged"]["reason"] and math.isfinite(summary["final_eval_loss"])


@pytest.mark.slow
def test_too_many_resets_stop_the_run(tmp_path, corpus_file, cache_dir, fault_hook) -> None:
    # H = 1: every step an exchange, where a diverged island is reset; island 1 healthy (the rounds go on)
    fault_hook(",".join(f"weights:0:{s}" for s in range(1, 12)))
    r, out = _run(tmp_path, corpus_file, cache_dir, "--strategy", "diloco", "--islands", "2", "--sync-every", "1",
                  "--steps", "30")
    summary = _assert_stopped(r, out, 20)  # the limit (5 per island) is checked at logging steps: 10 resets at 10
    assert summary["island_resets"] == [11, 0] and "reset 11 times" in summary["diverged"]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "diloco", "sparseloco", "streaming", "demo", "decoupled"])
def test_a_run_resets_a_diverged_island_and_shows_it(tmp_path, corpus_file, cache_dir, fault_hook,
                                                     strategy) -> None:
    fault_hook("weights:1:3")
    fragments = ["--fragments", "2"] if strategy in ("streaming", "decoupled") else []  # others refuse them
    rounds = ["--sync-every", "4"] if strategy not in ("ddp", "demo") else []
    r, out = _run(tmp_path, corpus_file, cache_dir, "--strategy", strategy, "--islands", "2", "--steps", "12",
                  *rounds, *fragments, "--eval-every", "6")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["island_resets"] == [0, 1] and "diverged" not in summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert "islands reset (diverged), per island" in r.stdout and "0 / 1" in r.stdout
    resets = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "reset"]  # a run event too
    assert [(e["island"], e["count"]) for e in resets] == [(1, 1)], resets
    if strategy == "decoupled":  # nothing refused: the island never pushed its NaN weights
        assert "non_finite" not in summary["rejected_by_reason"]


@pytest.mark.slow
def test_collective_resets_and_stops_as_local(tmp_path, corpus_file, cache_dir, fault_hook) -> None:
    flags = [*COMMON, "--data", str(corpus_file), "--cache-dir", str(cache_dir), "--strategy", "ddp",
             "--islands", "2", "--steps", "6", "--eval-every", "6", "--collective-timeout-s", "60"]

    def collective(out: Path, faults: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "atoll.cli", "train", *flags, "--runtime", "collective",
                               "--out", str(out)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, FAULT_HOOK_ENV: faults})

    fault_hook("weights:1:3")
    local = train(build_config(overrides={"data": str(corpus_file), "cache_dir": str(cache_dir), "model": "micro",
                                          "vocab_size": 512, "seq_len": 32, "batch_size": 4, "threads": 1,
                                          "progress": False, "warmup_steps": 0, "weight_decay": 0,
                                          "eval_batches": 2, "strategy": "ddp", "islands": 2, "steps": 6,
                                          "eval_every": 6, "out": str(tmp_path / "local")}))
    r = collective(tmp_path / "reset", "weights:1:3")
    assert r.returncode == 0, r.stderr[-2000:]
    coll = json.loads((tmp_path / "reset" / "summary.json").read_text())
    assert coll["island_resets"] == local["island_resets"] == [0, 1]
    assert coll["rejected_updates"] == local["rejected_updates"] == 1
    assert coll["final_eval_loss"] == pytest.approx(local["final_eval_loss"], abs=1e-4)
    r = collective(tmp_path / "stop", "weights:0:2,weights:1:2")
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("atoll: error: training diverged at step 2: every island")
    assert json.loads((tmp_path / "stop" / "summary.json").read_text())["diverged"]["step"] == 2
