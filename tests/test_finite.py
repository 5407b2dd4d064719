"""atoll.algorithms.finite: all_finite (one pass over the tensor, the exact element-wise check only on alarm) and
l2_norm (accurate at any length)."""

from __future__ import annotations

import math

import pytest
import torch

from atoll.algorithms.finite import NORM_ROW, all_finite, l2_norm


def _isfinite_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes (elements) of the tensors ``torch.isfinite`` is asked about from here on."""
    sizes: list[int] = []
    original = torch.isfinite

    def counted(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return original(t)

    monkeypatch.setattr(torch, "isfinite", counted)
    return sizes


def test_a_finite_tensor_is_checked_by_its_sum_alone(monkeypatch) -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    sizes = _isfinite_calls(monkeypatch)
    assert all_finite(t) is True
    assert sizes == [1]  # isfinite of the 0-d sum only: no boolean per element


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_nan_or_infinity_anywhere_is_not_finite(bad: float) -> None:
    for at in (0, 517, 999):
        t = torch.ones(1000)
        t[at] = bad
        assert all_finite(t) is False
        assert all_finite(t.reshape(10, 100)) is False  # any shape


def test_finite_values_whose_sum_overflows_are_finite_by_the_exact_check(monkeypatch) -> None:
    big = torch.full((4,), 3.0e38)  # each below float32's max (3.4e38); their sum overflows to inf
    assert not torch.isfinite(big.sum())
    sizes = _isfinite_calls(monkeypatch)
    assert all_finite(big) is True
    assert sizes == [1, 4]  # the alarm of the sum, then the exact check of every element
    mixed = torch.tensor([3.0e38, 3.0e38, -3.0e38, -3.0e38, 3.0e38] * 3)  # partial sums overflow, both signs
    assert all_finite(mixed) is True
    mixed[7] = math.nan
    assert all_finite(mixed) is False


def test_low_precision_integer_and_empty_tensors() -> None:
    half = torch.full((8,), 60000.0, dtype=torch.float16)  # float16's max is 65504: the sum overflows
    assert all_finite(half) is True
    half[3] = math.inf
    assert all_finite(half) is False
    assert all_finite(torch.tensor([1.0, math.nan], dtype=torch.bfloat16)) is False
    assert all_finite(torch.arange(10)) is True  # integers are always finite
    assert all_finite(torch.empty(0)) is True
    assert all_finite(torch.tensor(math.nan)) is False  # 0-d


def _exact_norm(t: torch.Tensor) -> float:
    return math.sqrt(float(t.double().square().sum()))


def test_l2_norm_is_accurate_on_a_long_vector_where_a_float32_norm_drifts() -> None:
    # 4M elements with a mean: float32 norm() is off by about 1e-4 there, l2_norm by under 1e-6
    t = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 1e-3 + 1e-3
    exact = _exact_norm(t)
    assert abs(float(t.norm()) / exact - 1) > 1e-5  # the drift this guards against
    assert abs(l2_norm(t) / exact - 1) < 1e-6


@pytest.mark.parametrize("n", [1, 1000, NORM_ROW - 1, NORM_ROW, NORM_ROW + 1, 3 * NORM_ROW + 17])
def test_l2_norm_at_every_length_and_equal_to_norm_below_a_row(n: int) -> None:
    t = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert l2_norm(t) == pytest.approx(_exact_norm(t), rel=1e-6)
    if n < NORM_ROW:
        assert l2_norm(t) == float(t.norm())


def test_l2_norm_of_other_shapes_dtypes_and_no_elements() -> None:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(300, 500, generator=g)
    assert l2_norm(t.T) == pytest.approx(_exact_norm(t), rel=1e-6)  # not contiguous: copied, then one pass
    strided = torch.randn(1 << 20, generator=g)[::2]  # torch's strided norm alone drifts (4e-6 here)
    assert l2_norm(strided) == pytest.approx(_exact_norm(strided), rel=1e-6)
    assert l2_norm(t.bfloat16()) == pytest.approx(_exact_norm(t.bfloat16().float()), rel=1e-5)  # in float32
    assert l2_norm(t.double()) == pytest.approx(_exact_norm(t), rel=1e-12)
    assert l2_norm(torch.empty(0)) == 0.0 and l2_norm(torch.tensor(-3.0)) == 3.0
    assert l2_norm(torch.full((4,), 6e4, dtype=torch.float16)) == 1.2e5  # float16's norm() overflows
    with pytest.raises(RuntimeError):
        l2_norm(torch.ones(3, dtype=torch.int64))  # as norm()
