"""Evaluation on the islands' devices: the global model run by an island's own model (its parameters swapped
for the global ones and put back), the windows split over the ranks of the collective runtime; on the CPU it
gives the numbers of the float32 CPU evaluation of the global model, bit for bit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import make_island

from atoll.config import build_config
from atoll.config.facts import RunFacts
from atoll.job.evaluation import evaluate, evaluate_island
from atoll.job.model import build_model
from atoll.runtime.local import LocalRuntime


def _setup(tmp_path):
    config = build_config(overrides={"model": "micro", "vocab_size": 512, "seq_len": 32, "islands": 2,
                                     "steps": 10, "out": str(tmp_path / "run"), "threads": 1})
    model = build_model("micro", 512, 32, seed=0)
    island = make_island(0, copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 512, (4, 33), generator=gen)
    for _ in range(2):  # the island moves away from the global model
        island.forward_backward(batch)
        island.inner_step()
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    params = flat + 0.01 * torch.randn(flat.shape, generator=gen)  # a global model unlike both
    batches = [torch.randint(0, 512, (8, 33), generator=gen) for _ in range(5)]
    return config, model, island, params, batches


def test_island_evaluation_equals_the_cpu_evaluation_of_the_global_model(tmp_path) -> None:
    config, model, island, params, batches = _setup(tmp_path)
    reference = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(params.clone(), reference.parameters())
    expected = evaluate(reference, batches)  # the old path: float32 on the CPU, the global model
    before = island.flat_params()
    losses = evaluate_island(island, params, batches)
    assert sorted(losses) == list(range(5))
    assert sum(losses[j] for j in range(5)) / 5 == expected  # bit for bit
    assert torch.equal(island.flat_params(), before)  # the island's own weights are back
    assert island.model.training
    # a subset of the windows (a rank's share) gives those windows' numbers
    part = evaluate_island(island, params, batches, range(1, 5, 2))
    assert part == {1: losses[1], 3: losses[3]}
    # the local runtime evaluates on island 0's device through the same path
    assert LocalRuntime(config.runtime_config, RunFacts.of(config)).evaluate([island], params, batches) == expected
    # None: the island's model as it is
    own = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(before.clone(), own.parameters())
    assert sum(evaluate_island(island, None, batches).values()) / 5 == evaluate(own, batches)


def test_bf16_island_on_the_cpu_still_evaluates_in_float32(tmp_path) -> None:
    config, model, island, params, batches = _setup(tmp_path)
    island.precision = "bf16"
    reference = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(params.clone(), reference.parameters())
    assert sum(evaluate_island(island, params, batches).values()) / 5 == evaluate(reference, batches)


def test_the_global_model_evaluated_on_the_cpu_by_the_ray_driver_path_is_the_cpu_evaluation(tmp_path) -> None:
    from atoll.job.evaluation import GlobalEvaluator, evaluate_global

    config, model, island, params, batches = _setup(tmp_path)
    reference = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(params.clone(), reference.parameters())
    expected = evaluate(reference, batches)
    assert evaluate_global(model, params, batches, torch.device("cpu"), "bf16") == expected  # float32 on a CPU
    assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), params)  # the global model set
    assert evaluate_global(model, None, batches, torch.device("cpu")) == expected and model.training
    evaluator = GlobalEvaluator(model, batches, torch.device("cpu"), "bf16")  # what the Ray driver sets
    assert evaluator(params) == expected and evaluator.seconds > 0


def test_the_ray_driver_evaluates_on_the_named_device_when_its_node_has_it(capsys) -> None:
    from atoll.runtime.ray import evaluation_device

    assert evaluation_device(build_config(overrides={"device": "cpu"})) == torch.device("cpu")
    assert capsys.readouterr().err == ""
    if torch.cuda.is_available():
        assert evaluation_device(build_config(overrides={"device": "auto"})).type == "cuda"
    else:  # the islands' nodes may have GPUs this node lacks: the CPU, said once
        assert evaluation_device(build_config(overrides={"device": "cuda"})) == torch.device("cpu")
        assert capsys.readouterr().err == ("atoll: note: this node has no cuda device; the driver evaluates the "
                                           "global model on the CPU\n")


@pytest.mark.slow
def test_the_decoupled_simulation_evaluates_on_island_0s_device(monkeypatch, fast_config) -> None:
    """Before: no evaluator, the global model in float32 on the CPU whatever the islands' device; now island 0's
    own model on its device, with the CPU's numbers on a CPU."""
    from atoll.job import evaluation
    from atoll.job.metrics import read_metrics
    from atoll.training import train

    seen: list[tuple[torch.device, float, float]] = []
    original = evaluation.evaluate_island

    def spy(island, params, batches, which=None):
        losses = original(island, params, batches, which)
        reference = copy.deepcopy(island.model)  # the old path: the global parameters, float32 on the CPU
        torch.nn.utils.vector_to_parameters(params.clone(), reference.parameters())
        seen.append((island.device, sum(losses.values()) / len(losses), evaluate(reference, batches)))
        assert island.index == 0
        return losses

    monkeypatch.setattr(evaluation, "evaluate_island", spy)
    summary = train(build_config(overrides={**fast_config, "strategy": "decoupled", "fragments": 2, "sync_every": 4,
                                            "steps": 10, "eval_every": 5, "checkpoint_every": 0, "device": "cpu"}))
    logged = [e["eval_loss"] for e in read_metrics(Path(fast_config["out"]) / "metrics.jsonl") if e["event"] == "eval"]
    assert len(seen) == len(logged) == 3  # before training, at step 5 and at the end
    assert all(device == torch.device("cpu") and loss == old for device, loss, old in seen)  # bit for bit
    assert [loss for _, loss, _ in seen] == logged and summary["final_eval_loss"] == logged[-1]
    assert summary["eval_s"] > 0
