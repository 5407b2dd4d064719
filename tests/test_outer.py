"""DiLoCo's outer step: FedAvg identity, pseudo-gradient sign, division by contributors, CPU state."""

from __future__ import annotations

import pytest
import torch

from atoll.algorithms.merge import weighted_mean
from atoll.algorithms.outer import OuterOptimizer, pseudo_gradient


def test_outer_step_lr1_momentum0_is_parameter_averaging() -> None:
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=g)
    islands = [theta + 0.1 * torch.randn(1000, generator=g) for _ in range(4)]
    outer = OuterOptimizer(theta, lr=1.0, momentum=0.0)
    delta = weighted_mean([pseudo_gradient(outer.params, t) for t in islands])
    new = outer.step(delta)
    torch.testing.assert_close(new, torch.stack(islands).mean(0), rtol=0, atol=1e-6)


def test_pseudo_gradient_sign_moves_global_towards_islands() -> None:
    theta = torch.zeros(10)
    island = torch.ones(10)  # the island moved +1
    delta = pseudo_gradient(theta, island)
    assert torch.all(delta == -1.0), "Δ = θ_global − θ_island"
    outer = OuterOptimizer(theta, lr=0.5, momentum=0.0)
    assert torch.all(outer.step(delta) == 0.5), "an outer SGD step moves the globals towards the island"


def test_nesterov_outer_step_matches_hand_computation() -> None:
    theta = torch.zeros(3)
    outer = OuterOptimizer(theta, lr=0.7, momentum=0.9)
    d = torch.tensor([1.0, -2.0, 0.5])
    # step 1: buf = d; update = d + 0.9 * buf = 1.9 d
    torch.testing.assert_close(outer.step(d), -0.7 * 1.9 * d)
    # step 2 with the same d: buf = 0.9 d + d = 1.9 d; update = d + 0.9 * 1.9 d = 2.71 d
    torch.testing.assert_close(outer.step(d), -0.7 * (1.9 + 2.71) * d)
    assert outer.version == 2


def test_average_divides_by_contributors_not_configured_count() -> None:
    a, b = torch.full((4,), 2.0), torch.full((4,), 4.0)
    # two of (say) eight configured islands contributed: the mean is over those two
    torch.testing.assert_close(weighted_mean([a, b]), torch.full((4,), 3.0))
    # token weights: 3:1
    torch.testing.assert_close(weighted_mean([a, b], [300, 100]), torch.full((4,), 2.5))


def test_outer_state_lives_on_cpu_in_float32() -> None:
    outer = OuterOptimizer(torch.randn(8, dtype=torch.bfloat16), lr=0.7, momentum=0.9)
    outer.step(torch.randn(8))
    assert outer.params.device.type == "cpu" and outer.params.dtype == torch.float32
    buf = outer.optimizer.state[outer.params]["momentum_buffer"]
    assert buf.device.type == "cpu" and buf.dtype == torch.float32


def test_outer_state_dict_round_trip() -> None:
    outer = OuterOptimizer(torch.zeros(5), lr=0.7, momentum=0.9)
    outer.step(torch.ones(5))
    other = OuterOptimizer(torch.zeros(5), lr=0.7, momentum=0.9)
    other.load_state_dict(outer.state_dict())
    d = torch.arange(5.0)
    torch.testing.assert_close(outer.step(d), other.step(d), rtol=0, atol=0)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_fused_outer_step_equals_torch_default_sgd_bit_for_bit(momentum: float) -> None:
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(10_000, generator=gen)
    outer = OuterOptimizer(init, lr=0.7, momentum=momentum)
    reference = torch.nn.Parameter(init.clone(), requires_grad=False)
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=momentum, nesterov=momentum > 0, foreach=False)
    for _ in range(4):
        delta = 1e-2 * torch.randn(10_000, generator=gen)
        outer.step(delta)
        reference.grad = delta.clone()
        sgd.step()
        assert torch.equal(outer.params.detach(), reference.detach())
    restored = OuterOptimizer(torch.zeros(10_000), lr=0.7, momentum=momentum)
    restored.load_state_dict(outer.state_dict())
    delta = 1e-2 * torch.randn(10_000, generator=gen)
    reference.grad = delta.clone()
    sgd.step()
    assert torch.equal(restored.step(delta), reference.detach()), "resumed: the same floats"


def test_the_global_parameters_norm_is_accurate_on_a_long_vector() -> None:
    """The syncer bounds every push against this norm: a float32 norm() of 4M elements with a mean drifts by about
    1e-4 (atoll.algorithms.finite.l2_norm), this one stays within 1e-6, and follows the step."""
    theta = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 1e-3 + 1e-3
    outer = OuterOptimizer(theta, lr=1.0, momentum=0.0)
    exact = float(theta.double().square().sum().sqrt())
    assert abs(float(theta.norm()) / exact - 1) > 1e-5
    assert outer.params_norm() == pytest.approx(exact, rel=1e-6)
    outer.step(torch.full_like(theta, 1e-3))  # θ ← θ − 1e-3: the norm of the new version
    assert outer.params_norm() == pytest.approx(float((theta.double() - 1e-3).square().sum().sqrt()), rel=1e-6)
