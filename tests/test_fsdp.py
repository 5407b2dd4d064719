"""Sharded islands (``--shard-island``): FSDP2 inside an island of the collective runtime, on the CPU (gloo).

A 2-island x 2-rank run sharded equals the same run unsharded to float round-off, each rank holds half the
parameters, the bytes of an island are the sum of its ranks' shards, the checkpoint holds whole tensors and
resumes bit for bit. Every run is a subprocess with a timeout and a checked exit status.
"""

from __future__ import annotations

import json
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
from atoll.runtime.network import ring_allgather_bytes, ring_allreduce_bytes

STEPS = 12


def _settings(corpus: Path, cache: Path) -> dict:
    return {"data": str(corpus), "cache_dir": str(cache), "model": "micro", "vocab_size": 512, "seq_len": 32,
            "batch_size": 4, "islands": 2, "steps": STEPS, "sync_every": 5, "eval_every": STEPS,
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


@pytest.fixture(scope="module")
def runs(corpus_file: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """diloco and ddp, each unsharded and sharded, 2 islands x 2 ranks; diloco int8 sharded."""
    root, settings = tmp_path_factory.mktemp("fsdp"), _settings(corpus_file, cache_dir)
    out = {}
    for strategy in ("diloco", "ddp"):
        for shard in (False, True):
            name = f"{strategy}-{'sharded' if shard else 'whole'}"
            out[name] = (root / name, _train(settings, root / name, strategy=strategy, shard_island=shard))
    out["int8-sharded"] = (root / "int8", _train(settings, root / "int8", codec="int8", shard_island=True))
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
    # the checkpoint holds whole tensors, in the unsharded run's layout
    sa, sb = _checkpoint(whole_dir, "state"), _checkpoint(sharded_dir, "state")
    islands = {k: v.shape for k, v in sa.items() if k.startswith("islands.")}
    assert islands and islands == {k: v.shape for k, v in sb.items() if k.startswith("islands.")}


@pytest.mark.slow
def test_sharded_codec_bytes_are_the_sum_of_the_shards_payloads(runs: dict) -> None:
    _, s = runs["int8-sharded"]
    codec = make_codec("int8")
    # each rank encodes its shard with its own scale blocks: an island sends both shards' payloads
    per_exchange = sum(ring_allgather_bytes(codec.payload_bytes(n), 2) for n in s["params_per_rank"])
    assert s["exchanges"] == STEPS // 5 + 1 and s["bytes_sent_per_island"] == s["exchanges"] * per_exchange
    assert per_exchange != ring_allgather_bytes(codec.payload_bytes(s["params"]), 2)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_for_bit(runs: dict, tmp_path: Path) -> None:
    source, _ = runs["diloco-sharded"]
    out = tmp_path / "resumed"
    shutil.copytree(source, out, symlinks=True)  # checkpoints/latest is a link to the newest
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:07d}")
    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "latest").symlink_to("step_0000010")
    r = _atoll("train", "--resume", str(out))  # the saved config: collective, sharded, 2 ranks per island
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("model", "state"):
        a, b = _checkpoint(source, name), _checkpoint(out, name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    r = _atoll("train", "--resume", str(out), "--ranks-per-island", "1")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("atoll: error: shard_island: an island of one rank")


@pytest.mark.parametrize(("flags", "start"), [
    (["--shard-island"], "shard_island: only the collective runtime shards islands; add --runtime collective"),
    (["--runtime", "collective", "--shard-island"], "shard_island: an island of one rank has nothing to shard"),
    (["--runtime", "collective", "--ranks-per-island", "2", "--shard-island", "--strategy", "streaming"],
     "shard_island: the streaming strategy does not run on shards (only ddp and diloco do)"),
    (["--runtime", "collective", "--ranks-per-island", "2", "--shard-island", "--strategy", "demo"],
     "shard_island: the demo strategy does not run on shards"),
], ids=["local", "one-rank", "streaming", "demo"])
def test_bad_shard_config_is_refused_with_one_line(flags: list[str], start: str) -> None:
    r = run_cli("train", *flags)
    assert r.returncode == 2
    assert r.stderr.startswith(f"atoll: error: {start}") and r.stderr.count("\n") == 1, r.stderr
