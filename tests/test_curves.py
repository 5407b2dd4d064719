"""Loss curves: interpolation between evaluations, time to a target loss, re-timing at another link."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from atoll.analysis.curves import Curve, loss_vs_time, loss_vs_tokens
from atoll.config import build_config
from atoll.training import train


def test_interpolation_and_first_crossing() -> None:
    c = Curve((0.0, 10.0, 20.0), (8.0, 6.0, 5.0))
    assert c.at(5.0) == pytest.approx(7.0) and c.at(20.0) == 5.0
    assert math.isnan(c.at(-1.0)) and math.isnan(c.at(21.0))
    assert c.first_below(6.0) == pytest.approx(10.0)
    assert c.first_below(5.5) == pytest.approx(15.0)
    assert c.first_below(8.5) == 0.0 and c.first_below(4.0) == math.inf


@pytest.mark.slow
def test_a_run_retimed_on_a_faster_link_reaches_each_loss_sooner(fast_config: dict) -> None:
    cfg = {**fast_config, "steps": 10, "eval_every": 5, "checkpoint_every": 0, "link_bandwidth_mbps": 1.0}
    train(build_config(overrides=cfg))
    out = Path(cfg["out"])
    own, same = loss_vs_time(out), loss_vs_time(out, bandwidth_mbps=1.0)
    assert own.losses == same.losses and own.xs == pytest.approx(same.xs, rel=1e-9)
    fast = loss_vs_time(out, bandwidth_mbps=1000.0)
    target = loss_vs_tokens(out).losses[-1]
    assert fast.first_below(target) < own.first_below(target) < math.inf
    slow_compute = loss_vs_time(out, bandwidth_mbps=1000.0, step_s=10.0)
    assert slow_compute.xs[-1] >= 10 * 10.0  # ten steps of 10 s each, at least
