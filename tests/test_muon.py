"""Muon as the inner optimizer: which parameters it takes, the schedule reaching it, exact resume, refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_island
from test_strategies import _batch

from atoll.algorithms.muon import MuonWithAdamW, muon_eligible
from atoll.config import TrainConfig, build_config
from atoll.errors import ConfigError
from atoll.job.model import build_model


def _island(**cfg):
    config = TrainConfig(model="micro", vocab_size=300, seq_len=16, batch_size=4, steps=20, warmup_steps=4,
                         inner_optimizer="muon", **cfg)
    return make_island(0, build_model("micro", 300, 16, seed=0), config)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest() -> None:
    island = _island()
    opt = island.optimizer
    assert isinstance(opt, MuonWithAdamW) and opt.muon is not None
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    names = {id(p): n for n, p in island.model.named_parameters()}
    assert {names[i] for i in muon} == {n for n, p in island.model.named_parameters() if muon_eligible(n, p)}
    assert all(".layers." in names[i] and "proj" in names[i] for i in muon)  # attention and MLP matrices
    assert not any("embed" in names[i] for i in muon)
    adam = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert muon.isdisjoint(adam) and muon | adam == set(names)


def test_the_schedule_reaches_both_optimizers() -> None:
    island = _island()
    used = []
    for step in range(4):  # warmup (2 steps: a tenth of 20), then the cosine decay
        scheduled = [g["lr"] for g in island.optimizer.param_groups]
        island.forward_backward(_batch(0, step))
        island.inner_step()
        inner = [g["lr"] for o in island.optimizer._inner for g in o.param_groups]
        assert inner == scheduled  # each step ran at the rate the schedule set for it
        used.append(scheduled[0])
    assert used[0] < used[1] and used[2] > used[3]  # rising in the warmup, falling after it


def test_state_round_trip_resumes_exactly() -> None:
    a = _island()
    for step in range(3):
        a.forward_backward(_batch(0, step))
        a.inner_step()
    b = _island()
    b.set_flat_params(a.flat_params())
    b.optimizer.load_state_dict(copy.deepcopy(a.optimizer.state_dict()))
    b.scheduler.load_state_dict(a.scheduler.state_dict())
    for island in (a, b):
        island.forward_backward(_batch(0, 3))
        island.inner_step()
    assert torch.equal(a.flat_params(), b.flat_params())


def test_muon_is_refused_where_a_strategy_brings_its_optimizer() -> None:
    with pytest.raises(ConfigError,
                       match="inner_optimizer: the demo strategy does not use it .*demo brings its own"):
        build_config(overrides={"strategy": "demo", "inner_optimizer": "muon"})
    muon = build_config(overrides={"strategy": "diloco", "inner_optimizer": "muon"})
    assert muon.strategy_config.inner_optimizer == "muon"


def test_a_reset_island_restarts_both_inner_optimizers_from_nothing() -> None:
    """A diverged Muon island reset to the global model keeps no momentum nor second moment (its moments may hold
    the NaNs that made it diverge): both inner optimizers' state is cleared, as a fresh optimizer has none."""
    island = _island()
    island.forward_backward(_batch(0, 0))
    island.inner_step()
    opt = island.optimizer
    assert isinstance(opt, MuonWithAdamW) and opt.muon is not None
    assert len(opt.muon.state) > 0 and len(opt.adamw.state) > 0
    island.reset_to(island.flat_params())
    assert len(opt.muon.state) == 0 and len(opt.adamw.state) == 0 and island.reset_count == 1
    island.forward_backward(_batch(0, 1))  # and it trains on, its state started again
    island.inner_step()
    assert len(opt.muon.state) > 0 and torch.isfinite(island.flat_params()).all()
