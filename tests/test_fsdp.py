"""Sharded islands (``--shard-island``): FSDP2 inside an island of the collective runtime, on the CPU (gloo).

A 2-island x 2-rank run sharded equals the same run unsharded to float round-off, each rank holds half the
parameters, the bytes of an island are the sum of its ranks' shards, the checkpoint holds whole tensors and
resumes bit for bit. Every run is a subprocess with a timeout and a checked exit status.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_flags, run_cli
from safetensors.torch import load_file

from atoll.algorithms.codecs import make_codec
from atoll.config import build_config
from atoll.config.applies import applicable
from atoll.job.checkpoint import save_checkpoint
from atoll.job.run import prepare_inputs
from atoll.runtime.network import ring_allgather_bytes, ring_allreduce_bytes

STEPS = 12


def _settings(corpus: Path, cache: Path) -> dict:
    return {"data": str(corpus), "cache_dir": str(cache), "model": "micro", "vocab_size": 512, "seq_len": 32,
            "batch_size": 4, "islands": 2, "steps": STEPS, "sync_every": 5, "eval_every": 6,
            "eval_batches": 2, "checkpoint_every": 5, "progress": False, "threads": 1,
            "runtime": "collective", "ranks_per_island": 2}


def _atoll(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atoll.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def _train(settings: dict, out: Path, **extra) -> dict:
    r = _atoll("train", *cli_flags({**settings, **extra, "out": str(out)}))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def _checkpoint(run: Path, name: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    folder = run / "checkpoints" / f"step_{step:07d}"
    return load_file(str(folder / ("model/model.safetensors" if name == "model" else "state.safetensors")))


def _rank_tensors(run: Path, rank: int, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The tensors rank ``rank`` wrote into its own folder of the checkpoint (empty: it wrote none)."""
    files = sorted((run / "checkpoints" / f"step_{step:07d}" / "ranks" / f"rank_{rank:05d}").glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def _every_file(run: Path, step: int = STEPS) -> dict[str, dict[str, torch.Tensor]]:
    folder = run / "checkpoints" / f"step_{step:07d}"
    return {str(f.relative_to(folder)): load_file(str(f)) for f in sorted(folder.rglob("*.safetensors"))}


def _resume_from(source: Path, out: Path, step: int) -> subprocess.CompletedProcess:
    """Copy the run ``source`` to ``out`` without its checkpoints after ``step``, and resume it there."""
    shutil.copytree(source, out, symlinks=True)  # checkpoints/latest is a link to the newest
    for later in (out / "checkpoints").glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "latest").symlink_to(f"step_{step:07d}")
    return _atoll("train", "--resume", str(out))  # the saved config: collective, 2 ranks per island


def assert_resumes_bit_for_bit(source: Path, out: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """Resume the 2x2 run ``source`` from its checkpoint at ``step`` in ``out`` (exit status 0) and check that it
    writes the same files, tensor for tensor, as the uninterrupted run: state, model and four ranks'. Returns the
    uninterrupted run's final files."""
    r = _resume_from(source, out, step)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _every_file(source), _every_file(out)
    assert a.keys() == b.keys() and len(a) == 6  # state, model, four ranks
    for name in a:
        assert a[name].keys() == b[name].keys()
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
    return a


@pytest.fixture(scope="module")
def runs(corpus_file: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """diloco and ddp, each unsharded and sharded, 2 islands x 2 ranks; diloco int8 sharded. Every run starts
    from the same weights (``--init-from`` a checkpoint of the seeded model): sharded islands initialise their
    own pieces on the meta device, whose values differ from the whole model's seeded ones."""
    root, settings = tmp_path_factory.mktemp("fsdp"), _settings(corpus_file, cache_dir)
    _, model = prepare_inputs(build_config(overrides=applicable({**settings, "out": str(root / "seed")})))
    save_checkpoint(root / "seed", 0, {}, model=model)
    settings["init_from"] = str(root / "seed")
    out = {}
    for strategy in ("diloco", "ddp"):
        for shard in (False, True):
            name = f"{strategy}-{'sharded' if shard else 'whole'}"
            out[name] = (root / name, _train(settings, root / name, strategy=strategy, shard_island=shard))
    out["int8-sharded"] = (root / "int8", _train(settings, root / "int8", codec="int8", shard_island=True))
    # the periodic checkpoints (steps 5 and 10) written in the background (unsharded islands' replicas and
    # export: tests/test_async_checkpoint.py, without a run)
    out["diloco-sharded-async"] = (root / "async", _train(settings, root / "async", shard_island=True,
                                                           async_checkpoint=True))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["diloco", "ddp"])
def test_sharded_island_equals_the_unsharded_island(runs: dict, strategy: str) -> None:
    (whole_dir, whole), (sharded_dir, sharded) = runs[f"{strategy}-whole"], runs[f"{strategy}-sharded"]
    assert "params_per_rank" not in whole and sharded["shard_island"] is True
    a, b = _checkpoint(whole_dir, "model"), _checkpoint(sharded_dir, "model")
    assert a.keys() == b.keys()
    # the same element-wise maths; the island's gradient is reduce-scattered instead of all-reduced and the
    # clip norm summed shard by shard: float32 round-off (measured: at most 1.5e-8 here)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    assert sharded["final_eval_loss"] == pytest.approx(whole["final_eval_loss"], abs=1e-6)
    assert sharded["tokens"] == whole["tokens"]
    # each rank holds about half the parameters (Shard(0) of every tensor), together all of them
    per_rank = sharded["params_per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == sharded["params"]
    assert all(abs(n - sharded["params"] / 2) <= 0.05 * sharded["params"] for n in per_rank)
    # fp32: an island sends the sum of its ranks' shard all-reduces, which is the whole vector's
    assert sharded["exchanges"] == whole["exchanges"]
    assert sharded["bytes_sent_per_island"] == pytest.approx(
        sharded["exchanges"] * sum(ring_allreduce_bytes(4 * n, 2) for n in per_rank))
    assert sharded["bytes_sent_per_island"] == pytest.approx(whole["bytes_sent_per_island"])
    # the checkpoint holds each rank's pieces: an island's two ranks together hold its whole tensors, in the
    # unsharded run's layout (and the same values, to round-off)
    for island in (0, 1):
        whole_island = _rank_tensors(whole_dir, 2 * island)
        pieces = [_rank_tensors(sharded_dir, 2 * island + p) for p in (0, 1)]
        model = [k for k in whole_island if k.startswith("island_state.model.")]
        assert model and all(k in pieces[0] and k in pieces[1] for k in model)
        for k in model:
            torch.testing.assert_close(torch.cat([pieces[0][k], pieces[1][k]]), whole_island[k], rtol=1e-5,
                                       atol=1e-6, msg=k)


@pytest.mark.slow
def test_sharded_codec_bytes_are_the_sum_of_the_shards_payloads(runs: dict) -> None:
    _, s = runs["int8-sharded"]
    codec = make_codec("int8")
    # each rank encodes its shard with its own scale blocks: an island sends both shards' payloads
    per_exchange = sum(ring_allgather_bytes(codec.payload_bytes(n), 2) for n in s["params_per_rank"])
    assert s["exchanges"] == STEPS // 5 + 1 and s["bytes_sent_per_island"] == s["exchanges"] * per_exchange
    assert per_exchange != ring_allgather_bytes(codec.payload_bytes(s["params"]), 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharded", "whole"])
def test_checkpoint_is_written_per_rank(runs: dict, kind: str) -> None:
    """Each rank writes its own files (DCP, safetensors): nothing of the islands is gathered to rank 0; the
    global model and the outer state are written once; the Hugging Face export stays."""
    from transformers import AutoModelForCausalLM

    run, summary = runs[f"diloco-{kind}"]
    folder = run / "checkpoints" / f"step_{STEPS:07d}"
    assert sorted(p.name for p in (folder / "ranks").iterdir()) == [f"rank_{r:05d}" for r in range(4)]
    assert not [k for k in _checkpoint(run, "state") if k.startswith(("islands.", "strategy"))]
    ranks = [_rank_tensors(run, r) for r in range(4)]
    n_params = summary["params"]

    def island_elements(t: dict) -> int:  # the parameters one rank saved (tied head once)
        return sum(v.numel() for k, v in t.items() if k.startswith("island_state.model."))

    if kind == "sharded":  # every rank its half of its island's model and moments
        assert all(abs(island_elements(t) - n_params / 2) <= 0.05 * n_params for t in ranks)
        assert sum(island_elements(t) for t in ranks[:2]) == n_params
        assert all(any(".exp_avg_sq" in k for k in t) for t in ranks)
        shared = [sum(v.numel() for k, v in t.items() if k.startswith("strategy.")) for t in ranks]
        # island 0's ranks hold the global model's shards (global parameters and outer momentum), once
        assert shared[0] > 0 and shared[1] > 0 and shared[2] == shared[3] == 0
        assert shared[0] + shared[1] == 2 * n_params
    else:  # an island's replicas are alike: its first rank writes it, the other nothing
        assert island_elements(ranks[0]) == island_elements(ranks[2]) == n_params
        assert ranks[1] == {} and ranks[3] == {}
        assert sum(v.numel() for k, v in ranks[0].items() if k.startswith("strategy.")) == 2 * n_params
        assert not any(k.startswith("strategy.") for k in ranks[2])
    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    exported = _checkpoint(run, "model")
    assert all(torch.equal(v, exported[k]) for k, v in model.state_dict().items() if k in exported)


@pytest.mark.slow
def test_unsharded_per_rank_checkpoint_resumes_exactly(runs: dict, tmp_path: Path) -> None:
    source, _ = runs["diloco-whole"]
    r = _resume_from(source, tmp_path / "resumed", 10)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _every_file(source), _every_file(tmp_path / "resumed")
    assert a.keys() == b.keys() and len(a) >= 4  # state, model, the two islands' first ranks
    for name in a:
        assert a[name].keys() == b[name].keys()
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_for_bit(runs: dict, tmp_path: Path) -> None:
    source, _ = runs["diloco-sharded"]
    out = tmp_path / "resumed"
    assert_resumes_bit_for_bit(source, out, 10)
    r = _atoll("train", "--resume", str(out), "--ranks-per-island", "1")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("atoll: error: shard_island: an island of one rank")


def _checkpoint_events(run: Path) -> dict[int, dict]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e for e in events if e.get("event") == "checkpoint"}


@pytest.mark.slow
def test_async_checkpoint_writes_what_the_foreground_writes(runs: dict, kind: str = "sharded") -> None:
    """--async-checkpoint: the periodic checkpoints are written by threads from host copies while the ranks
    train on, and hold the same tensors as the foreground's, file for file (state, model, every rank's); the
    last one is written in the foreground."""
    (sync_dir, sync), (async_dir, done) = runs[f"diloco-{kind}"], runs[f"diloco-{kind}-async"]
    assert done["final_eval_loss"] == sync["final_eval_loss"]
    for step in (10, STEPS):  # (step 5's was rotated out: two are kept)
        a, b = _every_file(sync_dir, step), _every_file(async_dir, step)
        assert a.keys() == b.keys() and len(a) >= 4, sorted(b)
        for name in a:
            assert a[name].keys() == b[name].keys(), name
            assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), (step, name)
    events = _checkpoint_events(async_dir)
    assert sorted(events) == [5, 10, STEPS]
    assert all(events[s]["background"] is True and events[s]["write_s"] > 0 for s in (5, 10))
    assert "background" not in events[STEPS] and events[STEPS]["blocked_s"] > 0
    assert sorted(p.name for p in (async_dir / "checkpoints").iterdir()) == ["latest", "step_0000010", "step_0000012"]


@pytest.mark.slow
def test_async_checkpoint_resumes_bit_for_bit(runs: dict, tmp_path: Path) -> None:
    source, _ = runs["diloco-sharded-async"]
    assert_resumes_bit_for_bit(source, tmp_path / "resumed", 10)


@pytest.mark.slow
def test_sharded_island_starts_without_the_whole_model(corpus_file: Path, cache_dir: Path, tmp_path: Path) -> None:
    """With --shard-island no process builds the whole float32 model (meta-device initialisation): the host
    memory a rank takes to start (data, model, island) grows by its half of the model, not by the whole model
    and a copy (2.5x the model's bytes before)."""
    settings = {**_settings(corpus_file, cache_dir), "islands": 1, "steps": 1, "eval_every": 1, "eval_batches": 1,
                "checkpoint_every": 0, "batch_size": 2, "shard_island": True}
    floor = _train(settings, tmp_path / "micro")  # imports and data: what any model costs
    big = _train(settings, tmp_path / "20m", model="20m")
    model_bytes = 4 * big["params"]
    grown = big["startup_host_bytes"] - floor["startup_host_bytes"]
    # a rank's pieces are half the parameters (2 ranks); the whole model would be 1.0 and more
    assert 0 < grown < 0.75 * model_bytes, (grown, model_bytes)
    # its pieces are initialised (not left empty): the loss starts near ln(vocab), and a step keeps it finite
    assert abs(big["initial_eval_loss"] - math.log(big["vocab_size"])) < 0.5
    assert math.isfinite(big["final_eval_loss"])


@pytest.mark.parametrize(("flags", "start"), [
    (["--shard-island"], "shard_island: the local runtime does not use it (only collective, service: atoll island); "
     "drop --shard-island or use --runtime collective"),
    (["--runtime", "collective", "--shard-island"], "shard_island: an island of one rank has nothing to shard"),
], ids=["local", "one-rank"])
def test_bad_shard_config_is_refused_with_one_line(flags: list[str], start: str) -> None:
    r = run_cli("train", *flags)
    assert r.returncode == 2
    assert r.stderr.startswith(f"atoll: error: {start}") and r.stderr.count("\n") == 1, r.stderr


def test_sparseloco_runs_on_shards() -> None:
    """Its tiles cross the ranks' rows, so a sharded island's ranks select from whole tensors together
    (atoll.runtime.collective.sharded_sparseloco); it is no longer refused. (A strategy that does not shard is:
    tests/test_strategy_plugin.py.)"""
    config = build_config(overrides={"runtime": "collective", "ranks_per_island": 2, "shard_island": True,
                                     "strategy": "sparseloco"})
    assert config.runtime_config.shard_island and config.strategy == "sparseloco"
