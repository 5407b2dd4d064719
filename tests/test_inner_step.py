"""The inner step at scale (issue 25): gradient accumulation equals the larger batch, activation checkpointing
changes no loss, no float32 copy of the logits, no host synchronization outside logging steps, and
``--compile`` guarding only its first call."""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_island, run_cli

from atoll.config import TrainConfig, build_config
from atoll.errors import ConfigError
from atoll.job import loss as loss_mod
from atoll.job import model as model_mod
from atoll.job.device import CompiledForward
from atoll.job.island import Island
from atoll.job.loss import chunked_cross_entropy
from atoll.job.model import build_model
from atoll.training import train

VOCAB, SEQ = 512, 16


def _island(**cfg) -> Island:
    config = TrainConfig(model="micro", vocab_size=VOCAB, seq_len=SEQ, steps=10, warmup_steps=0, **cfg)
    return make_island(0, build_model("micro", VOCAB, SEQ, seed=0), config)


def _batch(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


# --- gradient accumulation -----------------------------------------------------------------------------------

def test_four_micro_batches_give_the_gradient_and_loss_of_one_batch_of_four_times_the_rows() -> None:
    whole, accum = _island(batch_size=32), _island(batch_size=8, grad_accum=4)
    batch = _batch(32)
    assert accum.micro_batches(batch)[0].shape == (8, SEQ + 1)
    for step in range(3):
        losses = [float(i.forward_backward(_batch(32, step))) for i in (whole, accum)]
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        grads = [torch.cat([p.grad.reshape(-1) for p in i.params]) for i in (whole, accum)]
        assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)
        for i in (whole, accum):
            i.inner_step()
    # AdamW's first steps move every weight by about lr = 3e-3: a difference far below that is float rounding
    # (the one weight off by 3e-5 has a gradient of rounding size, which AdamW normalizes)
    assert torch.allclose(whole.flat_params(), accum.flat_params(), atol=1e-4)
    assert whole.tokens == accum.tokens == 3 * 32 * SEQ


def test_rows_that_do_not_split_into_the_micro_batches_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot be cut into 4 equal micro-batches"):
        _island(batch_size=8, grad_accum=4).forward_backward(_batch(30))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_a_grad_accum_run_ends_where_the_larger_batch_ends(fast_config: dict, strategy: str) -> None:
    base = {**fast_config, "strategy": strategy, "steps": 8, "sync_every": 4, "eval_every": 8,
            "checkpoint_every": 0, "seq_len": 16}
    if strategy == "ddp":
        base.pop("sync_every")
    big = train(build_config(overrides={**base, "batch_size": 16, "out": fast_config["out"] + "-big"}))
    small = train(build_config(overrides={**base, "batch_size": 4, "grad_accum": 4}))
    assert small["tokens"] == big["tokens"] == 2 * 8 * 16 * 16  # islands x steps x (4 x 4 rows) x seq_len
    assert small["bytes_sent_per_island"] == big["bytes_sent_per_island"]
    assert small["final_eval_loss"] == pytest.approx(big["final_eval_loss"], abs=2e-4)
    assert small["final_eval_loss"] < small["initial_eval_loss"] - 0.1  # it trained (8 steps)


def test_grad_accum_counts_in_the_tokens_per_step_and_bad_values_exit_2(tmp_path) -> None:
    assert TrainConfig(batch_size=8, grad_accum=4, seq_len=64).tokens_per_step == 4 * 8 * 64
    with pytest.raises(ConfigError, match="^grad_accum"):
        build_config(overrides={"grad_accum": 0})
    for bad in ("0", "x", "1.5"):
        r = run_cli("train", "--grad-accum", bad, "--out", str(tmp_path / "run"))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "grad_accum" in r.stderr
    assert not (tmp_path / "run").exists()
    r = run_cli("train", "--help")
    assert "--grad-accum" in r.stdout and "--activation-checkpointing" in r.stdout


# --- activation checkpointing --------------------------------------------------------------------------------

def test_activation_checkpointing_changes_no_loss_and_no_gradient() -> None:
    plain, checkpointed = _island(batch_size=4), _island(batch_size=4, activation_checkpointing=True)
    assert (model_mod.activation_checkpointing(checkpointed.model)
            and not model_mod.activation_checkpointing(plain.model))
    for step in range(3):
        losses = [float(i.forward_backward(_batch(4, step))) for i in (plain, checkpointed)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
        grads = [torch.cat([p.grad.reshape(-1) for p in i.params]) for i in (plain, checkpointed)]
        assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
        for i in (plain, checkpointed):
            i.inner_step()


def test_activation_checkpointing_keeps_fewer_activations_for_the_backward_pass() -> None:
    def saved_bytes(island: Island) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            island.forward_backward(_batch(4))
        return total

    plain, checkpointed = _island(batch_size=4), _island(batch_size=4, activation_checkpointing=True)
    assert saved_bytes(checkpointed) < 0.75 * saved_bytes(plain)


# --- the loss without a float32 copy of the logits -----------------------------------------------------------

def test_chunked_cross_entropy_equals_the_float32_loss_and_keeps_no_float32_logits() -> None:
    g = torch.Generator().manual_seed(0)
    logits32 = torch.randn(4, 24, 300, generator=g)
    targets = torch.randint(0, 300, (4, 24), generator=g)
    logits = logits32.to(torch.bfloat16).requires_grad_()
    reference = logits.detach().float().requires_grad_()
    expected = torch.nn.functional.cross_entropy(reference.reshape(-1, 300), targets.reshape(-1))
    expected.backward()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = chunked_cross_entropy(logits, targets, chunk_elements=10 * 300)  # 10 rows a chunk
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    # what is kept for the backward pass: nothing float32 of the logits' size (nor of a chunk: recomputed)
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= 10 * 300]
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.allclose(logits.grad.float(), reference.grad, rtol=1e-2, atol=1e-8)  # bf16 rounding


def test_a_bf16_island_makes_no_float32_copy_of_the_logits() -> None:
    island = _island(batch_size=4, precision="bf16")
    logits_elements = 4 * SEQ * VOCAB
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = island.forward_backward(_batch(4))
    assert loss.dtype == torch.float32
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= logits_elements]
    assert [t for t in saved if t.dtype == torch.bfloat16 and t.numel() == logits_elements]  # the logits, bf16


# --- no host synchronization in the inner step ---------------------------------------------------------------

class _HostReads:
    """Count the reads of a tensor's value on the host (what waits for an accelerator's queue) made by atoll's
    own code. (transformers' mask code reads one value per forward pass outside ``torch.compile``, in
    ``masking_utils.find_packed_sequence_indices``: the library's, not counted here.)"""

    NAMES = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                if f"{os.sep}atoll{os.sep}" in sys._getframe(1).f_code.co_filename:
                    self.count += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_the_inner_step_reads_nothing_on_the_host_until_a_logging_step(monkeypatch) -> None:
    # a fused AdamW (the CUDA default; here on the CPU) skips a non-finite step on the device
    config = TrainConfig(model="micro", vocab_size=VOCAB, seq_len=SEQ, batch_size=4, grad_accum=2, steps=10,
                         warmup_steps=0)

    def fused(groups, config):
        return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=True)

    island = make_island(0, build_model("micro", VOCAB, SEQ, seed=0), config, optimizer=fused)
    assert island.skips_on_device
    batches = [_batch(8, s) for s in range(4)]
    reads = _HostReads(monkeypatch)
    before: list[torch.Tensor] = []
    for step, batch in enumerate(batches):
        island.forward_backward(batch)
        if step == 2:  # a gradient that is not finite: skipped on the device, counted there
            for p in island.params:
                p.grad.fill_(float("nan"))
            before = [p.detach().clone() for p in island.params]
        island.inner_step()
        if step == 2:
            assert all(torch.equal(a, p) for a, p in zip(before, island.params, strict=True))
    assert reads.count == 0  # 4 inner steps of 2 micro-batches: nothing read on the host
    loss, skipped = island.last_loss, island.skipped_steps  # the logging step reads them: one read each
    assert reads.count == 2 and skipped == 1 and 0 < loss < 10
    assert island.optimizer.state[island.params[0]]["step"] == 3  # the skipped step did not count


def test_the_loop_and_the_inner_step_read_no_device_value_outside_logging_steps() -> None:
    """An AST check of the functions of the inner step: no ``.item()``, ``float()``, ``int()``, ``bool()``,
    ``.cpu()``, ``.tolist()``, ``math.isfinite`` on a tensor."""
    banned_calls = {"float", "int", "bool"}
    banned_methods = {"item", "cpu", "tolist", "numpy", "isfinite"}

    def offenders(fn) -> list[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in banned_calls and not all(
                        isinstance(a, ast.Constant) for a in node.args):  # float("inf") reads no tensor
                    found.append(f"{f.id}()")
                if isinstance(f, ast.Attribute) and f.attr in banned_methods and not (
                        f.attr == "isfinite" and isinstance(f.value, ast.Name) and f.value.id == "torch"):
                    found.append(f".{f.attr}()")
        return found

    for fn in (Island.forward_backward, Island.micro_batches, Island.inner_step, Island.clip_norm,
               loss_mod.next_token_loss, loss_mod.chunked_cross_entropy, Island.finish_step):
        assert offenders(fn) == [], fn.__qualname__
    # Island.timed on CUDA: events only (its CPU branch uses perf_counter, which reads no tensor)
    assert offenders(Island.timed) == []


def _fused_adamw(groups, config):  # the inner optimizer of a CUDA island: it skips a non-finite step on the device
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=True)


#: per strategy: its settings in the run below, and the most host reads one exchange step may make per island
#: (ddp and demo exchange at every step, and read each island's status there: the exchange waits anyway)
LOOPS = {"ddp": ({}, 3), "demo": ({"demo_chunk": 16, "demo_topk": 8}, 4), "diloco": ({"sync_every": 4}, None),
         "sparseloco": ({"sync_every": 4}, None), "streaming": ({"sync_every": 8, "fragments": 2}, None)}


@pytest.mark.parametrize("strategy", list(LOOPS))
def test_the_training_loop_reads_nothing_on_the_host_outside_logging_and_exchange_steps(
        monkeypatch, fast_config, strategy) -> None:
    """Every read of a tensor's value made by atoll's code in a 20-step run of 2 islands, by inner step: none at a
    step that neither logs (steps 10 and 20) nor exchanges (before: one ``float(loss)`` per island per step,
    the divergence check of ``Rounds.step``, 40 in all)."""
    from atoll.job import island as island_mod
    from atoll.job.divergence import set_fault_hook
    from atoll.runtime.comm import Comm
    from atoll.runtime.local import LocalWork

    settings, per_island = LOOPS[strategy]
    monkeypatch.setattr(island_mod, "adamw", _fused_adamw)  # demo brings its own (DeMo reads on the host)
    step_of = {"now": -1}
    starts: dict[int, int] = {}
    exchanged: set[int] = set()

    def mark(island, step, kind, **where) -> None:  # the fault hook, called as each island's step starts
        if kind == "weights" and step not in starts:
            step_of["now"], starts[step] = step, reads.count

    def exchanging(original):
        def counted(self, *a, **k):
            exchanged.add(step_of["now"])
            return original(self, *a, **k)
        return counted

    previous = set_fault_hook(mark)
    monkeypatch.setattr(Comm, "_count", exchanging(Comm._count))  # a collective issued in that step
    monkeypatch.setattr(LocalWork, "wait", exchanging(LocalWork.wait))  # or one in flight, waited for
    overrides = {**fast_config, "strategy": strategy, "steps": 20, "eval_every": 20, "checkpoint_every": 0,
                 **settings}
    if strategy in ("ddp", "demo"):
        overrides.pop("sync_every")
    reads = _HostReads(monkeypatch)  # after the data and the model are prepared (the first call builds them)
    try:
        summary = train(build_config(overrides=overrides))
    finally:
        set_fault_hook(previous)
    assert summary["tokens"] == 2 * 20 * 4 * 32
    per_step = {s: starts.get(s + 1, reads.count) - starts[s] for s in range(20)}
    logging = {9, 19}  # 0-based steps whose end logs (10, 20); the evaluation is at 20
    quiet = [s for s in range(20) if s not in logging and s not in exchanged]
    assert all(per_step[s] == 0 for s in quiet), {s: per_step[s] for s in quiet if per_step[s]}
    if per_island is None:  # rounds: most steps are quiet ones
        assert len(quiet) >= 10, sorted(exchanged)
    else:  # every step exchanges: a bounded read per island there
        assert exchanged >= set(range(20)) and not quiet
        assert max(per_step[s] for s in range(20) if s not in logging) <= per_island * 2, per_step


def test_ddp_under_torch_ddp_hooks_reads_nothing_in_a_step_and_repairs_at_the_logging_step(monkeypatch) -> None:
    """The hooked path of ddp (:mod:`atoll.runtime.collective.torch_ddp`): the islands the mean left out are summed
    on the device; the logging step reads that sum once and resets the diverged island from a healthy one."""
    import copy

    from atoll.runtime.local import LocalComm
    from atoll.runtime.network import Link, SimClock
    from atoll.strategies.ddp import DDP

    config = TrainConfig(strategy="ddp", islands=2, model="micro", vocab_size=VOCAB, seq_len=SEQ, batch_size=4,
                         steps=10, warmup_steps=0)
    model = build_model("micro", VOCAB, SEQ, seed=0)
    islands = [make_island(i, copy.deepcopy(model), config, optimizer=_fused_adamw) for i in range(2)]
    ddp = DDP(config.strategy_config, islands, LocalComm(2, Link.from_config(100, 10), SimClock(2)))
    reads = _HostReads(monkeypatch)
    for step in range(3):
        for island in islands:
            if step == 1 and island.index == 1:
                with torch.no_grad():
                    for p in island.params:
                        p.fill_(float("nan"))
            island.forward_backward(_batch(4, step))
            island.sync_islands = (island.loss_finite.float() + 1.0) if island.index == 0 else None  # as hooks say
        for island in islands:  # the hooks' mean: island 0's gradient alone (island 1 left out from step 1)
            for mine, other in zip(island.params, islands[0].params, strict=True):
                mine.grad = other.grad.clone()
        islands[0].sync_islands = torch.tensor(2.0 if step == 0 else 1.0)
        ddp.step_hooked(step)
    assert reads.count == 0 and islands[1].reset_count == 0
    assert ddp.reset_diverged(3) == 1  # the logging step: one read of the sum, then the statuses
    assert islands[1].reset_count == 1 and ddp.dropped_updates == 2  # left out at steps 1 and 2
    assert torch.equal(islands[1].flat_params(), islands[0].flat_params())
    assert islands[1].optimizer.state  # kept: every replica's AdamW state is the same
    assert ddp.reset_diverged(4) == 0 and ddp.left_out is None


# --- --compile -----------------------------------------------------------------------------------------------

def test_compile_falls_back_only_at_its_first_call(monkeypatch) -> None:
    calls = {"n": 0}

    def compiled_then_oom(model):
        def call(*a, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("CUDA out of memory inside the compiled graph")
            return model(*a, **k)
        return call

    monkeypatch.setattr(torch, "compile", compiled_then_oom)
    forward = CompiledForward(build_model("micro", VOCAB, SEQ, seed=0))
    ids = _batch(2)[:, :-1]
    forward(input_ids=ids)
    assert forward.skipped is None
    with pytest.raises(RuntimeError, match="out of memory"):  # before: silently eager from here on
        forward(input_ids=ids)
    assert forward.skipped is None


def test_an_out_of_memory_error_at_the_first_call_is_not_a_compile_failure(monkeypatch) -> None:
    def oom(model):
        def call(*a, **k):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return call

    monkeypatch.setattr(torch, "compile", oom)
    forward = CompiledForward(build_model("micro", VOCAB, SEQ, seed=0))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        forward(input_ids=_batch(2)[:, :-1])




def test_micro_batches_but_the_last_skip_the_gradient_sync_of_a_sharded_island(monkeypatch) -> None:
    from types import SimpleNamespace

    from atoll.runtime.collective.sharding import ShardedIsland

    island = _island(batch_size=2, grad_accum=4)
    flags: list[bool] = []
    monkeypatch.setattr(Island, "gradient_sync", lambda self, last: flags.append(last) or contextlib.nullcontext())
    island.forward_backward(_batch(8))
    assert flags == [False, False, False, True]
    calls: list[bool] = []  # a sharded island hands the flag to FSDP2
    fake = SimpleNamespace(model=SimpleNamespace(set_requires_gradient_sync=calls.append))
    with ShardedIsland.gradient_sync(fake, False):  # type: ignore[arg-type]
        pass
    ShardedIsland.gradient_sync(fake, True)  # type: ignore[arg-type]
    assert calls == [False, True]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "extra"), [
    ("diloco", {"shard_island": True}),  # FSDP2: the reduce-scatter on the last micro-batch only
    ("ddp", {"min_islands": 2}),  # torch DDP (a job that survives no loss): no_sync but on the last micro-batch
], ids=["diloco-sharded", "ddp-torch-ddp"])
def test_collective_islands_accumulate_as_the_larger_batch(fast_config: dict, strategy: str, extra: dict) -> None:
    import json
    import subprocess

    from conftest import cli_flags

    base = {**fast_config, "strategy": strategy, "runtime": "collective", "ranks_per_island": 2, "steps": 4,
            "sync_every": 2, "eval_every": 4, "checkpoint_every": 0, "seq_len": 16, **extra}

    def run(out: str, **more) -> dict:
        r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", *cli_flags({**base, **more, "out": out})],
                           capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads((Path(out) / "summary.json").read_text())

    big = run(fast_config["out"] + "-big", batch_size=8)
    small = run(fast_config["out"], batch_size=4, grad_accum=2, activation_checkpointing=True)
    assert small["tokens"] == big["tokens"] == 2 * 4 * 8 * 16
    assert small["bytes_sent_per_island"] == big["bytes_sent_per_island"] > 0
    assert small["final_eval_loss"] == pytest.approx(big["final_eval_loss"], abs=2e-4)
    if strategy == "ddp":
        assert small["gradient_sync"] == big["gradient_sync"] == "torch_ddp"


@pytest.mark.slow
def test_collective_ddp_on_torch_ddp_hooks_equals_the_host_path(fast_config: dict) -> None:
    """torch DDP's bucketed all-reduce in the backward pass (``--min-islands`` = ``--islands``) against the
    elastic host path (``--min-islands 1``): the same weights to float round-off, the same bytes counted; a
    NaN island is left out of the mean and reset from a peer on both. (Its fault falls on a logging step, the
    last: the host path repairs it at once, the hooked path at the next logging step without a host read in
    between, :func:`test_ddp_under_torch_ddp_hooks_reads_nothing_in_a_step_and_repairs_at_the_logging_step`.)"""
    import json
    import subprocess

    from conftest import cli_flags

    base = {**fast_config, "strategy": "ddp", "runtime": "collective", "steps": 6, "eval_every": 6,
            "checkpoint_every": 0, "seq_len": 16}
    base.pop("sync_every")

    def run(out: str, **more) -> dict:
        r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", *cli_flags({**base, **more, "out": out})],
                           capture_output=True, text=True, timeout=400,
                           env={**os.environ, "ATOLL_TEST_NAN_AT": "weights:1:6"})
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads((Path(out) / "summary.json").read_text())

    host = run(fast_config["out"] + "-host", min_islands=1)
    hooked = run(fast_config["out"], min_islands=2)
    assert hooked["gradient_sync"] == "torch_ddp" and "gradient_sync" not in host
    for key in ("tokens", "bytes_sent_per_island", "exchanges", "island_resets", "rejected_updates"):
        assert hooked[key] == host[key], key
    assert hooked["island_resets"] == [0, 1]
    assert hooked["final_eval_loss"] == pytest.approx(host["final_eval_loss"], abs=1e-4)


def test_cuda_timing_is_read_only_when_the_clock_or_compute_s_is(monkeypatch) -> None:
    """The CUDA path's bookkeeping with stand-in events (no GPU here): each timed block records two events
    and nothing waits; the simulated clock and ``compute_s`` read them when they are read."""
    from atoll.runtime.network import SimClock

    waits: list[int] = []

    class Event:  # torch.cuda.Event's interface, 2 ms per block
        count = 0

        def __init__(self, enable_timing: bool = False) -> None:
            Event.count += 1
            self.n = Event.count

        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            waits.append(self.n)

        def elapsed_time(self, end) -> float:
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)  # (the island's device's stream)
    clock = SimClock(1)
    island = _island(batch_size=4)
    island.clock, island.device = clock, torch.device("cuda")  # the CUDA branch of timed(), computing on the CPU
    for _ in range(3):
        with island.timed():
            pass
    assert waits == [] and island._compute_s == 0.0  # recorded, not read
    assert clock.wall_s == pytest.approx(0.006)  # the clock's read settles them: 3 x 2 ms
    assert len(waits) == 3 and island.compute_s == pytest.approx(0.006)
    for _ in range(70):  # many pending: the oldest are read, the last 16 stay pending
        with island.timed():
            pass
    assert 16 <= len(island._timings) <= 64  # bounded, the newest never waited for
    assert island.compute_s == pytest.approx(0.146)
    settled = len(waits)  # the loop's label of the strategy's inner steps: kept with the events, read at the end
    for _ in range(2):
        with island.charging("strategy"), island.timed():
            pass
        with island.timed():
            pass
    assert len(waits) == settled and island.compute_s_of("strategy") == pytest.approx(0.004)
    assert island.compute_s == pytest.approx(0.154)


def test_a_resumed_run_may_switch_activation_checkpointing_on_but_not_change_grad_accum(fast_config) -> None:
    from atoll.config import load_run_config

    out = Path(fast_config["out"])
    out.mkdir(parents=True)
    saved = build_config(overrides={**fast_config, "batch_size": 4, "grad_accum": 2})
    (out / "config.json").write_text(saved.model_dump_json())
    assert load_run_config(out, {"activation_checkpointing": True}).activation_checkpointing
    with pytest.raises(ConfigError, match="^grad_accum: cannot change on resume"):
        load_run_config(out, {"grad_accum": 4})


def test_an_island_is_built_from_its_settings_and_the_strategys_optimizer_not_the_run() -> None:
    """The island takes its own settings (precision, accumulation, clipping, schedule...) and the strategy's
    inner-optimizer factory, without a whole run's config; the same island as one built from the run's."""
    from atoll.config.facts import IslandSettings
    from atoll.job.island import build_island, inner_optimizer
    from atoll.strategies.demo import DeMoConfig, make_optimizer
    from atoll.strategies.diloco import DiLoCoConfig

    settings = IslandSettings(steps=40, warmup_steps=4, min_lr_ratio=0.5, grad_clip=0.5, grad_accum=2)
    island = build_island(0, build_model("micro", VOCAB, SEQ, seed=0), settings,
                          inner_optimizer(DiLoCoConfig(lr=1e-3, weight_decay=0.2)))
    assert (island.grad_accum, island.grad_clip, island.precision) == (2, 0.5, "fp32")
    assert type(island.optimizer) is torch.optim.AdamW and island.optimizer.param_groups[0]["weight_decay"] == 0.2
    assert island.scheduler.get_last_lr()[0] == pytest.approx(1e-3 / 4)  # warmup: 1 of 4 steps
    config = TrainConfig(model="micro", vocab_size=VOCAB, seq_len=SEQ, steps=40, warmup_steps=4, min_lr_ratio=0.5,
                         grad_clip=0.5, grad_accum=2, lr=1e-3, weight_decay=0.2)
    assert IslandSettings.of(config) == IslandSettings(40, 4, 0.5, 0.5, 2, "fp32", False, False)
    twin = make_island(0, build_model("micro", VOCAB, SEQ, seed=0), config)
    assert twin.scheduler.get_last_lr() == island.scheduler.get_last_lr()
    for a, b in zip(island.optimizer.param_groups, twin.optimizer.param_groups, strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
    # a strategy's own optimizer (DeMo) from its own config; its groups carry the AdamW default's weight decay
    demo = build_island(0, build_model("micro", VOCAB, SEQ, seed=0), settings,
                        inner_optimizer(DeMoConfig(), make_optimizer))
    assert type(demo.optimizer).__name__ == "DeMo" and demo.optimizer.param_groups[0]["weight_decay"] == 0.1


def test_an_island_started_again_continues_its_learning_rate_schedule() -> None:
    """An island job started again at its 30th step (the syncer's count at its join) takes the learning rate of
    an island that stepped 30 times, not the warmup's first (a restarted island re-warmed to the peak rate late
    in a run); moving to a step it has passed changes nothing."""
    config = TrainConfig(model="micro", vocab_size=VOCAB, seq_len=SEQ, steps=100, warmup_steps=10)
    stepped = make_island(0, build_model("micro", VOCAB, SEQ, seed=0), config)
    for _ in range(30):
        stepped.optimizer.step()
        stepped.finish_step()
    started = make_island(0, build_model("micro", VOCAB, SEQ, seed=0), config)
    started.schedule_to(30)
    assert started.scheduler.last_epoch == stepped.scheduler.last_epoch == 30
    assert started.scheduler.get_last_lr() == stepped.scheduler.get_last_lr()
    assert started.scheduler.get_last_lr()[0] < config.strategy_config.lr  # past the warmup, decaying
    started.schedule_to(5)
    assert started.scheduler.last_epoch == 30
