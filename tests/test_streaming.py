"""Streaming DiLoCo: reduces to DiLoCo exactly, syncs each fragment once per H, overlap hides transfers."""

from __future__ import annotations

import pytest
import torch
from test_strategies import _batch, _setup

from atoll.job.model import param_bytes
from atoll.runtime.network import ring_allreduce_bytes
from atoll.strategies.diloco import DiLoCo
from atoll.strategies.streaming import StreamingDiLoCo


def _run(strategy, islands, steps: int) -> None:
    for step in range(steps):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        strategy.step(step)


def test_one_fragment_no_overlap_no_mixing_equals_diloco_bit_for_bit() -> None:
    _, _, _, d_islands, diloco = _setup(DiLoCo, 3, sync_every=4)
    _, _, _, s_islands, streaming = _setup(StreamingDiLoCo, 3, strategy="streaming", sync_every=4, fragments=1,
                                           overlap_steps=0, mixing_alpha=0.0)
    _run(diloco, d_islands, 12)
    _run(streaming, s_islands, 12)
    assert torch.equal(diloco.global_params(), streaming.global_params())
    for a, b in zip(d_islands, s_islands, strict=True):
        assert torch.equal(a.flat_params(), b.flat_params())


def test_each_fragment_synced_once_per_window_and_bytes_per_fragment() -> None:
    k, h, p = 2, 4, 2
    _, model, comm, islands, streaming = _setup(StreamingDiLoCo, k, strategy="streaming", sync_every=h,
                                                fragments=p, overlap_steps=1, mixing_alpha=0.5)
    _run(streaming, islands, 3 * h)
    # fragment 1's third exchange started after the last step (offset H) and is still in flight (tau = 1)
    assert [o.version for o in streaming.outer] == [3, 2] and len(streaming.in_flight) == 1
    # every parameter in exactly one fragment, so all exchanges together carry the model once per window
    assert torch.equal(torch.sort(torch.cat([f.positions() for f in streaming.index])).values,
                       torch.arange(streaming.numel))
    assert comm.bytes_sent_per_island == pytest.approx(3 * ring_allreduce_bytes(param_bytes(model), k))
    assert comm.bytes_received_per_island == comm.bytes_sent_per_island  # a ring's receive half
    assert comm.peak_bytes_per_exchange < ring_allreduce_bytes(param_bytes(model), k)
    # the end merges fragment 1 and syncs fragment 0 (last sent after step 10, offset H/2) once more
    streaming.finish(3 * h)
    assert [o.version for o in streaming.outer] == [4, 3]
    assert not streaming.in_flight


def test_overlap_hides_transfer_time_on_a_slow_link() -> None:
    def utilization(tau: int) -> float:
        cfg = {"strategy": "streaming", "sync_every": 4, "fragments": 2, "overlap_steps": tau,
               "mixing_alpha": 0.5, "link_bandwidth_mbps": 50.0}
        _, _, comm, islands, streaming = _setup(StreamingDiLoCo, 2, **cfg)
        # fixed compute time per step, so the comparison does not depend on this machine's speed
        for island in islands:
            island.timed = _fixed_time(island, 0.01)
        _run(streaming, islands, 12)
        clock = comm.clock
        return max(i.compute_s for i in islands) / clock.wall_s

    assert utilization(3) > utilization(0)


def _fixed_time(island, seconds: float):
    from contextlib import contextmanager

    @contextmanager
    def timed(compiling: bool = False):
        yield
        island.compute_s += seconds
        island.clock.compute(island.index, seconds)

    return timed


def test_mixing_alpha_blends_local_and_global() -> None:
    _, _, _, islands, streaming = _setup(StreamingDiLoCo, 2, strategy="streaming", sync_every=2, fragments=1,
                                         overlap_steps=0, mixing_alpha=0.25, outer_lr=1.0, outer_momentum=0.0)
    for step in range(2):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        for island in islands:
            island.inner_step()
    local = [i.flat_params() for i in islands]
    avg = torch.stack(local).mean(0)
    streaming._start(0, 1)
    for island, before in zip(islands, local, strict=True):
        torch.testing.assert_close(island.flat_params(), 0.25 * before + 0.75 * avg, rtol=0, atol=1e-6)
