"""Counted bytes against the ring formula; the simulated clock."""

from __future__ import annotations

import pytest
import torch

from atoll.runtime.local import LocalComm
from atoll.runtime.network import Link, SimClock, ring_allgather_bytes, ring_allreduce_bytes


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_ring_allreduce_bytes_formula(k: int) -> None:
    assert ring_allreduce_bytes(1000, k) == pytest.approx(2 * (k - 1) / k * 1000)
    assert ring_allgather_bytes(1000, k) == pytest.approx((k - 1) * 1000)


def test_local_comm_counts_bytes_of_the_tensors_exchanged() -> None:
    k, n = 4, 12345
    clock = SimClock(k)
    link = Link.from_config(100, 10)
    comm = LocalComm(k, link, clock)
    fp32 = [torch.randn(n) for _ in range(k)]
    comm.all_reduce_mean(fp32)
    assert comm.bytes_sent_per_island == pytest.approx(2 * (k - 1) / k * n * 4)
    comm.all_reduce_mean([t.to(torch.bfloat16) for t in fp32])
    assert comm.bytes_sent_per_island == pytest.approx(2 * (k - 1) / k * n * (4 + 2))
    # a ring: each island receives from its predecessor what it sends to its successor
    assert comm.bytes_received_per_island == comm.bytes_sent_per_island
    comm.all_gather([None] * k, payload_bytes=1000)
    assert comm.bytes_received_per_island == comm.bytes_sent_per_island == pytest.approx(
        2 * (k - 1) / k * n * (4 + 2) + (k - 1) * 1000)
    restored = LocalComm(k, link, SimClock(k))
    restored.load_state_dict(comm.state_dict())
    assert restored.bytes_received_per_island == comm.bytes_received_per_island
    old = {key: v for key, v in comm.state_dict().items() if key != "bytes_received_per_island"}
    restored.load_state_dict(old)  # a checkpoint from before the receive half was counted: rings only
    assert restored.bytes_received_per_island == comm.bytes_sent_per_island
    comm.all_reduce_mean(fp32)
    assert comm.exchanges == 4
    assert comm.peak_bytes_per_exchange == pytest.approx(2 * (k - 1) / k * n * 4)


def test_link_seconds_and_clock() -> None:
    link = Link.from_config(bandwidth_mbps=10, latency_ms=20)
    # 1.25 MB payload over 2 islands: each sends 1.25 MB = 10 Mbit -> 1 s, plus 2 rounds of 20 ms
    assert link.allreduce_seconds(1.25e6, 2) == pytest.approx(1.0 + 0.04)
    clock = SimClock(2)
    clock.compute(0, 3.0)
    clock.compute(1, 1.0)
    end = clock.collective(link.allreduce_seconds(1.25e6, 2))
    assert end == pytest.approx(4.04)
    assert clock.island_time == [pytest.approx(4.04)] * 2
    assert clock.blocked_s == [pytest.approx(1.04), pytest.approx(3.04)]
    # an overlapped collective does not block until waited for
    t_done = clock.start_collective(2.0)
    clock.compute(0, 0.5)
    assert clock.island_time[0] == pytest.approx(4.54)
    clock.wait_until(0, t_done)
    assert clock.island_time[0] == pytest.approx(6.04)


def test_single_island_sends_nothing() -> None:
    comm = LocalComm(1, Link.from_config(100, 10), SimClock(1))
    out = comm.all_reduce_mean([torch.ones(10)])
    assert comm.bytes_sent_per_island == 0.0 and torch.all(out == 1)
