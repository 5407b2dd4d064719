"""The agreement-weighted outer step: the signal-share estimator, the per-tensor weights, and diloco's round."""

from __future__ import annotations

import pytest
import torch
from test_strategies import _batch, _setup

from atoll.algorithms.agreement import MAX_MULTIPLIER, AgreementScaler, signal_fraction
from atoll.strategies.diloco import DiLoCo


def _stats(scaler: AgreementScaler, deltas: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The weighted mean of the islands' statistics, as the all-reduce computes it."""
    total = sum(weights)
    return sum(w / total * scaler.statistics(d, w / total) for d, w in zip(deltas, weights, strict=True))


def test_signal_share_is_one_when_islands_agree_and_follows_the_noise_formula() -> None:
    g = torch.tensor([3.0, 4.0, 0.0, 0.0])  # ‖g‖² = 25
    assert signal_fraction(torch.tensor([25.0]), torch.tensor([25.0]), 4.0).item() == 1.0
    # four islands g + n_i with n_i = ±s e_3, ±s e_4: orthogonal to g, summing to 0, ‖n_i‖² = s²
    s = 2.0
    noise = [torch.tensor([0, 0, s, 0]), torch.tensor([0, 0, -s, 0]), torch.tensor([0, 0, 0, s]),
             torch.tensor([0, 0, 0, -s])]
    deltas = [g + n for n in noise]
    scaler = AgreementScaler([4])
    reduced = _stats(scaler, deltas, [1.0] * 4)
    mean = torch.stack(deltas).mean(0)
    f = signal_fraction(mean.pow(2).sum().reshape(1), reduced[:1], 1.0 / float(reduced[-1]))
    assert float(reduced[-1]) == pytest.approx(0.25)  # K_eff = 4
    assert f.item() == pytest.approx(1 - s ** 2 / (3 * 25.0))  # (K·D − M) / ((K − 1)·D) with D = 25, M = 25 + s²
    # pure disagreement clips at 0; one island has nothing to compare with
    assert signal_fraction(torch.tensor([1.0]), torch.tensor([10.0]), 4.0).item() == 0.0
    assert signal_fraction(torch.tensor([1.0]), torch.tensor([10.0]), 1.0).item() == 1.0


def test_tensors_the_islands_agree_on_step_more_and_the_mean_rate_is_kept() -> None:
    scaler = AgreementScaler([3, 3])
    agree = torch.tensor([1.0, 2.0, 3.0])
    deltas = [torch.cat([agree, torch.tensor([(1.0 if i % 2 else -1.0) + 0.5, 0, 0])]) for i in range(4)]
    mean = torch.stack(deltas).mean(0)
    out = scaler.weigh(mean, _stats(scaler, deltas, [1.0] * 4))
    f2 = 1 - 1.0 / (3 * 0.25)  # tensor 2: g = 0.5 e_1 (‖g‖² 0.25), noise ±e_1 (σ² = 1): clipped at 0
    assert f2 < 0
    assert scaler.last_agreement == pytest.approx(0.5)  # f = (1, 0), three elements each
    torch.testing.assert_close(out[:3], 2.0 * mean[:3])  # f / f̄ = 2: the agreed tensor takes the whole rate
    assert float(out[3:].abs().max()) == 0.0
    assert scaler.summary() == {"outer_agreement_mean": pytest.approx(0.5), "outer_agreement_last": pytest.approx(0.5)}


def test_the_multiplier_is_capped_and_weights_set_the_effective_island_count() -> None:
    scaler = AgreementScaler([1, 9])
    same = torch.ones(10)
    deltas = [same.clone() for _ in range(3)]
    for i, d in enumerate(deltas):  # tensor 2 is noise only
        d[1:] = torch.randn(9, generator=torch.Generator().manual_seed(i))
    mean = torch.stack(deltas).mean(0)
    out = scaler.weigh(mean, _stats(scaler, deltas, [1.0, 1.0, 1.0]))
    assert out[0].item() == pytest.approx(MAX_MULTIPLIER * mean[0].item())  # 1 / f̄ would be above the cap
    # an island of weight 0 is not an island: K_eff = 2, and identical halves agree fully
    halves = [torch.ones(10), torch.ones(10), torch.full((10,), 99.0)]
    reduced = _stats(scaler, halves, [1.0, 1.0, 0.0])
    assert 1.0 / float(reduced[-1]) == pytest.approx(2.0)
    out = scaler.weigh(torch.ones(10), reduced)
    torch.testing.assert_close(out, torch.ones(10))


def test_diloco_with_agreement_steps_with_the_weighted_mean_and_keeps_islands_equal() -> None:
    k, h = 3, 2
    config, model, comm, islands, strategy = _setup(DiLoCo, k, outer_adapt="agreement", outer_lr=1.0,
                                                    outer_momentum=0.0)
    for step in range(h):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        for island in islands:
            island.inner_step()
    before = strategy.global_params()
    deltas = [before - i.flat_params() for i in islands]
    check = AgreementScaler([p.numel() for p in islands[0].params])
    expected = before - check.weigh(torch.stack(deltas).mean(0), _stats(check, deltas, [1.0] * k))
    bytes_before = comm.bytes_sent_per_island
    strategy.outer_step(h)
    torch.testing.assert_close(strategy.global_params(), expected, rtol=0, atol=1e-6)
    assert all(torch.equal(i.flat_params(), strategy.global_params()) for i in islands)
    assert 0.0 < strategy.summary()["outer_agreement_last"] <= 1.0
    assert strategy.summary()["outer_agreement_last"] == pytest.approx(check.last_agreement, rel=1e-5)
    assert comm.bytes_sent_per_island > bytes_before  # the pseudo-gradients and the norms' all-reduce
    resumed = _setup(DiLoCo, k, outer_adapt="agreement")[4]
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.summary() == strategy.summary()
