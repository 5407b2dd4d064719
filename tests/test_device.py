"""Devices and precision (atoll.job.device): placement with a fake device list, bf16 autocast on the CPU, and
the CUDA path where a GPU is present."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_island, run_cli

from atoll.config import TrainConfig, build_config
from atoll.errors import ConfigError
from atoll.job.device import autocast, island_devices, resolve_device
from atoll.job.island import Island, adamw, compile_skipped
from atoll.job.model import build_model

CUDA = torch.cuda.is_available()


def test_auto_prefers_cuda_then_mps_then_cpu() -> None:
    assert resolve_device("auto", cuda_count=2, mps=True) == "cuda"
    assert resolve_device("auto", cuda_count=0, mps=True) == "mps"
    assert resolve_device("auto", cuda_count=0, mps=False) == "cpu"
    assert resolve_device("cpu", cuda_count=8, mps=True) == "cpu"  # asked for: kept, even with GPUs there


def test_a_device_that_is_not_there_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^device: cuda was asked for .*pass --device cpu"):
        resolve_device("cuda", cuda_count=0, mps=False)
    with pytest.raises(ConfigError, match=r"^device: mps"):
        resolve_device("mps", cuda_count=0, mps=False)


def test_islands_go_round_robin_over_the_visible_gpus() -> None:
    got = island_devices(5, "auto", cuda_count=2, mps=False)
    assert got == [torch.device("cuda", i) for i in (0, 1, 0, 1, 0)]
    assert island_devices(3, "cuda", cuda_count=4, mps=False) == [torch.device("cuda", i) for i in (0, 1, 2)]
    assert island_devices(3, "auto", cuda_count=0, mps=False) == [torch.device("cpu")] * 3


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_an_island_times_its_work_on_its_own_devices_stream(monkeypatch) -> None:
    """The local runtime puts islands on cuda:0, cuda:1, ...: an island's CUDA events are recorded on its own
    device's stream, not the current device's (which timed another GPU's work, or none of this island's), and
    the host waits for nothing as it records them (the islands' launches overlap across GPUs)."""
    from types import SimpleNamespace

    recorded, synchronized = [], []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self, stream=None) -> None:
            recorded.append(stream)

        def synchronize(self) -> None:  # pragma: no cover - reading the timing is not part of the step
            synchronized.append(self)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    island = SimpleNamespace(device=torch.device("cuda", 1), _timings=[], _label=None, clock=None)
    with Island.timed(island):  # type: ignore[arg-type]
        pass
    assert recorded == ["stream of cuda:1", "stream of cuda:1"]
    assert len(island._timings) == 1 and synchronized == []


def test_cli_refuses_cuda_without_a_gpu(tmp_path) -> None:
    r = run_cli("train", "--device", "cuda", "--model", "micro", "--steps", "2", "--sync-every", "1", "--out",
                str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "device: cuda" in r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _island(precision: str, device: str = "cpu"):
    config = TrainConfig(model="micro", vocab_size=512, seq_len=16, batch_size=4, steps=10, precision=precision)
    model = build_model("micro", 512, 16, seed=0).to(device)
    return make_island(0, copy.deepcopy(model), config)


def test_bf16_autocasts_the_forward_pass_and_keeps_float32_state() -> None:
    batch = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    fp32, bf16 = _island("fp32"), _island("bf16")
    with autocast(torch.device("cpu"), "bf16"):  # the island's context: bf16 matmuls
        assert bf16.model(input_ids=batch[:, :-1]).logits.dtype == torch.bfloat16
    losses = [i.forward_backward(batch) for i in (fp32, bf16)]
    assert losses[0] != losses[1] and abs(losses[0] - losses[1]) < 0.05  # rounded, not wrong
    for island in (fp32, bf16):
        island.inner_step()
    # master weights, gradients' consumer (the optimizer state) and the exchanged vector stay float32
    assert all(p.dtype == torch.float32 for p in bf16.params)
    assert all(v.dtype == torch.float32 for s in bf16.optimizer.state.values() for v in s.values() if v.ndim)
    assert bf16.flat_params().dtype == torch.float32
    assert torch.allclose(fp32.flat_params(), bf16.flat_params(), atol=1e-2)


def test_unknown_precision_is_refused_at_config_time() -> None:
    with pytest.raises(ConfigError, match="precision"):
        build_config(overrides={"precision": "fp8"})
    with pytest.raises(ValueError):
        autocast(torch.device("cpu"), "fp8")


def test_adamw_is_the_default_kernel_on_the_cpu() -> None:
    config = TrainConfig()
    opt = adamw([{"params": [torch.nn.Parameter(torch.zeros(3))]}], config.strategy_config)
    assert not opt.defaults.get("fused")  # fused only where the parameters are on CUDA


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_island_uses_fused_adamw_and_matches_the_cpu() -> None:  # pragma: no cover - GPU machines
    batch = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    cpu, gpu = _island("fp32"), _island("fp32", "cuda")
    assert gpu.optimizer.defaults.get("fused") is True
    for island in (cpu, gpu):
        island.forward_backward(batch)
        island.inner_step()
    assert torch.allclose(cpu.flat_params(), gpu.flat_params(), atol=1e-4)
    assert gpu.flat_params().device.type == "cpu"  # what the strategies exchange


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_run_places_islands_on_the_gpus(tmp_path, corpus_file, cache_dir) -> None:  # pragma: no cover
    from atoll.training import train

    summary = train(build_config(overrides={
        "data": str(corpus_file), "cache_dir": str(cache_dir), "model": "micro", "vocab_size": 512, "seq_len": 32,
        "batch_size": 4, "islands": 3, "steps": 10, "sync_every": 5, "progress": False, "device": "cuda",
        "precision": "bf16", "out": str(tmp_path / "run")}))
    assert summary["device"] == "cuda" and summary["precision"] == "bf16"
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def _compiled_island() -> Island:
    config = TrainConfig(model="micro", vocab_size=512, seq_len=16, batch_size=4, steps=10, compile=True)
    return make_island(0, build_model("micro", 512, 16, seed=0), config)


def test_compile_falls_back_to_eager_and_says_why(monkeypatch) -> None:
    def broken(model):  # what torch.compile gives where no C++ compiler exists: it fails at the first call
        def call(*a, **k):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore lines")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    batch = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    eager, compiled = _island("fp32"), _compiled_island()
    with pytest.warns(RuntimeWarning, match="--compile skipped.*No working C"):
        loss = compiled.forward_backward(batch)
    assert loss == eager.forward_backward(batch)  # the same eager maths, bit for bit
    assert compiled.forward.skipped == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    assert compile_skipped([eager, compiled]) == compiled.forward.skipped and compile_skipped([eager]) is None


def test_the_compiling_step_is_start_up_not_compute(monkeypatch) -> None:
    monkeypatch.setattr(torch, "compile", lambda model: model)  # a compiler that returns the model unchanged
    batch = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    island = _compiled_island()
    island.forward_backward(batch)
    assert island.compute_s == 0.0 and island.compile_s > 0.0  # the first call (compilation) is set apart
    island.inner_step()
    first = island.compute_s
    island.forward_backward(batch)
    assert island.compute_s > first and island.forward.skipped is None


@pytest.mark.slow
def test_compiled_run_matches_eager(fast_config) -> None:  # torch.compile for real: Inductor on the CPU
    from atoll.training import train

    base = {**fast_config, "islands": 2, "steps": 4, "sync_every": 2, "threads": 1}
    eager = train(build_config(overrides={**base, "out": fast_config["out"] + "-eager"}))
    compiled = train(build_config(overrides={**base, "compile": True}))
    assert compiled["compile"] is True and eager["compile"] is False
    assert compiled["compile_skipped"] is None and compiled["compile_s"] > 0
    assert compiled["final_eval_loss"] == pytest.approx(eager["final_eval_loss"], abs=1e-4)
