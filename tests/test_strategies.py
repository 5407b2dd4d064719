"""ddp and diloco on in-process islands: the maths, equal weights after syncs, counted bytes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import make_island

from atoll.config import TrainConfig
from atoll.config.applies import applicable
from atoll.job.loss import next_token_loss
from atoll.job.model import build_model, param_bytes
from atoll.runtime.local import LocalComm
from atoll.runtime.network import Link, SimClock, ring_allreduce_bytes
from atoll.strategies.ddp import DDP
from atoll.strategies.diloco import DiLoCo

VOCAB, SEQ, BATCH = 300, 16, 4


def _setup(strategy_cls, k: int, **cfg):
    base = {"strategy": strategy_cls.name, "islands": k, "steps": 12, "lr": 1e-2, "warmup_steps": 0, "seq_len": SEQ,
            "batch_size": BATCH, "codec": "fp32"}  # the codec where the strategy reads one
    config = TrainConfig(**{**applicable(base), **cfg})
    model = build_model("micro", VOCAB, SEQ, seed=0)
    clock = SimClock(k)
    comm = LocalComm(k, Link.from_config(100, 10), clock)
    islands = [make_island(i, copy.deepcopy(model), config, clock) for i in range(k)]
    return config, model, comm, islands, strategy_cls(config.strategy_config, islands, comm, config.seed)


def _batch(i: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * i + step))


def _train_steps(strategy, islands, steps: int, poison_at: int | None = None) -> None:
    """``steps`` inner steps of every island, each followed by ``strategy.step``; ``poison_at``: island 1's weights
    made NaN (its loss still finite) after that many steps, just before the strategy's step."""
    for step in range(steps):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        if poison_at is not None and step + 1 == poison_at:
            with torch.no_grad():
                islands[1].params[0].view(-1)[0] = math.nan
        strategy.step(step)


def _graphs_compiled_while_training(strategy, islands, steps: int) -> int:
    """How many graphs torch compiled while ``strategy`` trained ``islands`` for ``steps`` steps (a compiled
    round's loops are compiled as the strategy is built: none expected)."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    _train_steps(strategy, islands, steps)
    return counters["stats"]["unique_graphs"] - graphs


def test_ddp_equals_one_model_with_k_times_the_batch() -> None:
    k = 3
    config, model, comm, islands, ddp = _setup(DDP, k)
    reference = make_island(0, copy.deepcopy(model), config, None)
    for step in range(5):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        ddp.step(step)
        big = torch.cat([_batch(i, step) for i in range(k)])
        reference.forward_backward(big)
        reference.inner_step()
    for island in islands:
        # float round-off of the grouped sums, amplified by Adam's 1/sqrt(v), stays far below lr = 1e-2
        torch.testing.assert_close(island.flat_params(), reference.flat_params(), rtol=0, atol=1e-4)
    assert comm.bytes_sent_per_island == pytest.approx(5 * ring_allreduce_bytes(param_bytes(model), k))
    assert comm.bytes_received_per_island == comm.bytes_sent_per_island  # a ring's receive half


def test_diloco_islands_identical_after_each_sync_and_bytes_match_formula() -> None:
    k, h = 3, 4
    config, model, comm, islands, diloco = _setup(DiLoCo, k, sync_every=h)
    for step in range(12):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        diloco.step(step)
        flats = [i.flat_params() for i in islands]
        if (step + 1) % h == 0:
            for f in flats:
                assert torch.equal(f, diloco.global_params())
        elif step % h != h - 1 and step % h > 0:
            assert not torch.equal(flats[0], flats[1]), "islands diverge between syncs (different data)"
    assert diloco.outer.version == 3
    assert comm.bytes_sent_per_island == pytest.approx(3 * ring_allreduce_bytes(param_bytes(model), k))
    assert comm.bytes_received_per_island == comm.bytes_sent_per_island  # a ring's receive half


def test_diloco_lr1_momentum0_global_is_average_of_islands() -> None:
    k, h = 2, 3
    config, model, comm, islands, diloco = _setup(DiLoCo, k, sync_every=h, outer_lr=1.0, outer_momentum=0.0)
    for step in range(h):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        for island in islands:
            island.inner_step()
    expected = torch.stack([i.flat_params() for i in islands]).mean(0)
    diloco.outer_step(h)
    torch.testing.assert_close(diloco.global_params(), expected, rtol=0, atol=1e-6)


def test_diloco_finish_syncs_a_partial_round() -> None:
    config, model, comm, islands, diloco = _setup(DiLoCo, 2, sync_every=5)
    for step in range(7):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        diloco.step(step)
    assert diloco.outer.version == 1
    diloco.finish(7)
    assert diloco.outer.version == 2
    assert torch.equal(islands[0].flat_params(), islands[1].flat_params())


def test_next_token_loss_of_uniform_model_is_log_vocab() -> None:
    model = build_model("micro", VOCAB, SEQ, seed=0)
    with torch.no_grad():
        for p in model.lm_head.parameters():
            p.zero_()
    with torch.no_grad():
        loss = float(next_token_loss(model, _batch(0, 0)))
    assert loss == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), rel=1e-4)


@pytest.mark.parametrize("strategy_cls", [DDP, DiLoCo])
def test_a_nan_gradient_on_one_island_never_reaches_the_global_model(strategy_cls) -> None:
    k, h = 3, 3
    own = {"sync_every": h} if strategy_cls is DiLoCo else {}  # ddp exchanges every step: no H
    config, model, comm, islands, strategy = _setup(strategy_cls, k, **own)
    for step in range(6):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        if step == 1:
            for p in islands[1].params:
                p.grad.fill_(float("nan"))
        strategy.step(step)
    assert torch.isfinite(strategy.global_params()).all()
    assert all(torch.isfinite(i.flat_params()).all() for i in islands)
    # ddp leaves the NaN gradient out of the mean (no island skips); diloco's island skips its own step
    assert sum(i.skipped_steps for i in islands) == (0 if strategy_cls is DDP else 1)
    assert strategy.dropped_updates == (1 if strategy_cls is DDP else 0)


def test_a_non_finite_island_is_left_out_of_the_outer_average() -> None:
    config, model, comm, islands, diloco = _setup(DiLoCo, 3, sync_every=2, outer_lr=1.0, outer_momentum=0.0)
    for step in range(2):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        for island in islands:
            island.inner_step()
    with torch.no_grad():
        islands[2].params[0].fill_(float("inf"))
    expected = torch.stack([islands[0].flat_params(), islands[1].flat_params()]).mean(0)
    diloco.outer_step(2)
    torch.testing.assert_close(diloco.global_params(), expected, rtol=0, atol=1e-6)
    assert diloco.dropped_updates == 1 and torch.isfinite(islands[2].flat_params()).all()
    assert [i.reset_count for i in islands] == [0, 0, 1]  # reset with a fresh inner optimizer, and counted
    assert not islands[2].optimizer.state and islands[0].optimizer.state
