"""Evaluation on the islands' devices: the global model run by an island's own model (its parameters swapped
for the global ones and put back), the windows split over the ranks of the collective runtime; on the CPU it
gives the numbers of the float32 CPU evaluation of the global model, bit for bit."""

from __future__ import annotations

import copy

import torch

from atoll.config import build_config
from atoll.job.evaluation import evaluate, evaluate_island
from atoll.job.island import make_island
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
    assert LocalRuntime(config).evaluate([island], params, batches) == expected
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
