"""bench/gpu.py runs on the CPU at the micro size (its smoke mode), so that it runs first time on a GPU box."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atoll.job.model import build_model
from bench.gpu import PEAK_TFLOPS, flops_per_token, main


def test_flops_per_token_is_palm_formula() -> None:
    model = build_model("micro", 512, 32, seed=0)
    n = sum(p.numel() for p in model.parameters())  # tied head: the embedding matrix multiplies once
    assert flops_per_token(model, 32) == 6 * n + 12 * 2 * 32 * 32  # micro: 2 layers, width 32; T = 32
    assert PEAK_TFLOPS["H100"] == PEAK_TFLOPS["H200"] == 989.0


@pytest.mark.slow
def test_gpu_bench_smoke_on_cpu(tmp_path: Path, corpus_file: Path, cache_dir: Path) -> None:
    out = tmp_path / "gpu"
    rc = main(["--device", "cpu", "--quick", "--out", str(out), "--data", str(corpus_file), "--cache-dir",
               str(cache_dir), "--peak-tflops", "1", "--concurrency", "2"])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    (row,) = result["rows"]
    assert result["device"] == "cpu" and row["model"] == "micro" and row["precision"] == "bf16"
    # the two loops took the same steps on the same batch: the same weights up to round-off
    assert row["max_weight_diff"] < 1e-4
    assert row["island_step_s"] > 0 and row["plain_step_s"] > 0
    # MFU from the stated formula and the given peak
    want = 100 * row["flops_per_token"] * row["batch"] * row["seq_len"] / row["island_step_s"] / 1e12
    assert row["mfu_pct"] == pytest.approx(want)
    # the diloco job: 4 islands x 2 rounds of H=3 steps of 4 x 32 tokens; its outer steps were timed
    assert row["job_tokens"] == 4 * 6 * 4 * 32 and row["outer_step_s"] > 0
    # the inner steps, the outer round and the evaluation timed apart: the round's inner steps are the job's
    # own (not in the outer round), the evaluation not in the job's training time
    assert row["inner_step_s"] > 0 and row["eval_s"] > 0
    assert row["inner_round_s"] == pytest.approx(4 * 3 * row["inner_step_s"])
    assert row["outer_vs_inner_round_pct"] == pytest.approx(100 * row["outer_step_s"] / row["inner_round_s"])
    assert row["job_tokens_per_s"] > row["job_tokens"] / row["job_s"]
    assert "| micro |" in (out / "results.md").read_text()
    # pinned against pageable host copies, at the tiny preset on the CPU path (pinned needs an accelerator)
    (copies,) = result["copies"]
    tiny = sum(p.numel() for p in build_model("tiny", 512, 32, seed=0, meta=True).parameters())
    assert copies["model"] == "tiny" and copies["params"] == tiny and copies["bytes"] == 4 * tiny
    assert copies["repeats"] == 3 and copies["d2h_pageable_s"] > 0 and copies["h2d_pageable_s"] > 0
    assert copies["d2h_pageable_gbps"] == pytest.approx(4 * tiny / copies["d2h_pageable_s"] / 1e9)
    assert copies["d2h_pinned_s"] is None and copies["h2d_pinned_speedup"] is None
    assert "host copies of one exchange on cpu, pinned against pageable" in (out / "results.md").read_text()
    # islands on several devices: here both on the one CPU thread (serial, about 1x); on GPUs, up to 2x
    (c,) = result["concurrency"]
    assert c["model"] == "micro" and c["gpus"] == 2 and c["one_island_step_s"] > 0 and c["islands_step_s"] > 0
    assert c["speedup"] == pytest.approx(2 * c["one_island_step_s"] / c["islands_step_s"])
    assert "islands on several GPUs run concurrently" in (out / "results.md").read_text()
    # the collective runtime's codec exchange, at the tiny preset: on the CPU both paths are the CPU's
    (exchange,) = result["exchanges"]
    assert exchange["model"] == "tiny" and exchange["params"] == tiny and exchange["codec"] == "int4"
    assert exchange["repeats"] == 2 and exchange["device_s"] > 0 and exchange["host_s"] > 0
    assert (exchange["result_device"], exchange["residual_device"], exchange["generator_device"]) == (
        "cpu", "cpu", "cpu")
    assert "the collective runtime's codec exchange on cpu" in (out / "results.md").read_text()
    # DeMo's step where its momentum lives, against the island's inner step of the same model (micro, above)
    (demo,) = result["demo"]
    assert demo["model"] == "micro" and demo["params"] == row["params"] and demo["islands"] == 4
    assert demo["encode_s"] > 0 and demo["apply_s"] > 0 and demo["step_s"] == demo["encode_s"] + demo["apply_s"]
    assert demo["share_of_inner_step_pct"] == pytest.approx(100 * demo["step_s"] / row["island_step_s"])
    assert "DeMo's work per inner step on cpu" in (out / "results.md").read_text()


def test_copies_are_timed_apart_per_direction_and_kind() -> None:
    import torch

    from bench.gpu import measure_copies

    row = measure_copies("micro", 512, torch.device("cpu"), repeats=2)
    micro = sum(p.numel() for p in build_model("micro", 512, 32, seed=0, meta=True).parameters())
    assert row["params"] == micro and row["bytes"] == 4 * micro and row["repeats"] == 2
    for direction in ("d2h", "h2d"):
        assert row[f"{direction}_pageable_s"] > 0
        assert row[f"{direction}_pageable_gbps"] == pytest.approx(4 * micro / row[f"{direction}_pageable_s"] / 1e9)
        if not torch.cuda.is_available():
            assert row[f"{direction}_pinned_s"] is None and row[f"{direction}_pinned_gbps"] is None


def test_the_codec_exchange_is_timed_where_the_comm_runs() -> None:
    import torch
    import torch.distributed as dist

    from atoll.algorithms.codecs import make_codec
    from bench.gpu import measure_exchange

    row = measure_exchange("micro", 512, torch.device("cpu"), repeats=1, codec="int8")
    micro = sum(p.numel() for p in build_model("micro", 512, 32, seed=0, meta=True).parameters())
    assert row["params"] == micro and row["payload_bytes"] == make_codec("int8").payload_bytes(micro)
    assert row["device_s"] > 0 and row["host_s"] > 0
    assert row["host_over_device"] == pytest.approx(row["host_s"] / row["device_s"])
    assert row["result_device"] == row["residual_device"] == "cpu" and row["generator_device"] == "cpu"
    assert not dist.is_initialized()  # its group of one process is gone


def test_gpu_bench_refuses_a_missing_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["--device", "cuda", "--quick", "--out", str(tmp_path)]) == 2
    assert "device: cuda" in capsys.readouterr().err
