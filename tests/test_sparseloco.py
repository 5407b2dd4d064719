"""SparseLoCo: the compressor's payload and size, the FedAvg identity, error feedback, bytes, and a run."""

from __future__ import annotations

import math

import pytest
import torch
from test_strategies import _batch, _setup

from atoll.algorithms.sparse import SparseCompressor
from atoll.analysis.cost import Setting
from atoll.config import build_config
from atoll.errors import ConfigError
from atoll.runtime.network import ring_allgather_bytes
from atoll.strategies.sparseloco import WEIGHT_BYTES, SparseLoCo, payload_bytes

NUMELS = [100, 5000, 30, 4096]


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(sum(NUMELS), generator=torch.Generator().manual_seed(seed))


def test_density_one_at_32_bits_is_lossless() -> None:
    c = SparseCompressor(NUMELS, 64, 64, bits=32)
    x = _x()
    assert torch.equal(c.decompress(c.compress(x)), x)


def test_top_k_per_chunk_keeps_the_largest_and_chunks_stay_within_a_parameter() -> None:
    c = SparseCompressor(NUMELS, 64, 4, bits=32)
    x = _x(1)
    out = c.decompress(c.compress(x))
    offsets = [0]
    for n in NUMELS:
        offsets.append(offsets[-1] + n)
    for lo, hi in zip(offsets, offsets[1:], strict=False):  # every parameter's own chunks: 4 per 64 elements
        for start in range(lo, hi, 64):
            seg, kept = x[start:min(start + 64, hi)], out[start:min(start + 64, hi)]
            k = min(4, seg.numel())
            assert int((kept != 0).sum()) == k
            assert torch.equal(torch.sort(seg.abs(), descending=True).values[:k],
                               torch.sort(kept.abs(), descending=True).values[:k])


def test_two_bit_values_are_the_chunks_four_levels_with_their_signs() -> None:
    c = SparseCompressor(NUMELS, 64, 16, bits=2)
    x = _x(2)
    payload = c.compress(x)
    exact = SparseCompressor(NUMELS, 64, 16, bits=32).decompress(SparseCompressor(NUMELS, 64, 16, 32).compress(x))
    out = c.decompress(payload)
    assert torch.equal(out != 0, exact != 0) and torch.equal(torch.sign(out), torch.sign(exact))
    levels = payload["levels"]
    assert levels.shape == (c.chunks, 2) and bool((levels[:, 0] <= levels[:, 1]).all())
    assert set(out.abs().unique().tolist()) - {0.0} <= set(levels.flatten().tolist())
    # lo and hi are the means of the magnitudes below and above the median: the magnitude sum is kept
    assert out.abs().sum().item() == pytest.approx(exact.abs().sum().item(), rel=1e-5)
    same = torch.full((64,), -0.5)  # a chunk of equal magnitudes is exact
    one = SparseCompressor([64], 64, 8, bits=2)
    out = one.decompress(one.compress(same))
    assert int((out != 0).sum()) == 8 and set(out.unique().tolist()) == {-0.5, 0.0}


@pytest.mark.parametrize("bits", [2, 32])
def test_payload_bytes_are_the_tensors_and_the_formula(bits: int) -> None:
    c = SparseCompressor(NUMELS, 64, 8, bits=bits)
    payload = c.compress(_x())
    assert c.payload_bytes() == sum(t.numel() * t.element_size() for t in payload.values())
    n = c.chunks * 8  # int8 indices for 64-element chunks
    assert c.payload_bytes() == (n + math.ceil(n / 4) + 8 * c.chunks if bits == 2 else n + 4 * n)


def _round(k: int, h: int, **cfg):
    config, model, comm, islands, strategy = _setup(SparseLoCo, k, strategy="sparseloco", sync_every=h, **cfg)
    for step in range(h):
        for island in islands:
            island.forward_backward(_batch(island.index, step))
        for island in islands:
            island.inner_step()
    return comm, islands, strategy


def test_density_one_no_quantization_no_memory_is_parameter_averaging() -> None:
    comm, islands, strategy = _round(3, 3, sparseloco_topk=256, sparseloco_chunk=256, sparseloco_bits=32,
                                     sparseloco_beta=0.0)
    assert strategy.config.outer_lr == 1.0 and strategy.config.outer_momentum == 0.0  # the strategy's defaults
    expected = torch.stack([i.flat_params() for i in islands]).mean(0)
    strategy.outer_step(3)
    torch.testing.assert_close(strategy.global_params(), expected, rtol=0, atol=1e-6)
    assert all(torch.equal(i.flat_params(), strategy.global_params()) for i in islands)
    assert all(float(e.abs().max()) == 0.0 for e in strategy.error)  # nothing carried over
    assert strategy.summary()["sparseloco_sent_energy"] == pytest.approx(1.0)  # a lossless payload sends it all


def test_error_feedback_keeps_what_was_not_sent_and_bytes_follow_the_formula() -> None:
    k, h, beta = 2, 2, 0.9
    comm, islands, strategy = _round(k, h, sparseloco_topk=4, sparseloco_chunk=64, sparseloco_beta=beta)
    previous = [torch.randn(strategy.compressor.numel, generator=torch.Generator().manual_seed(i)) * 1e-3
                for i in range(k)]
    for e, p in zip(strategy.error, previous, strict=True):
        e.copy_(p)
    deltas = [strategy.outer.params.detach() - i.flat_params() for i in islands]
    sent = [strategy.compressor.decompress(strategy.compressor.compress(beta * p + d))
            for p, d in zip(previous, deltas, strict=True)]
    before = strategy.global_params()
    strategy.outer_step(h)
    for e, p, d, s in zip(strategy.error, previous, deltas, sent, strict=True):
        torch.testing.assert_close(e + s, beta * p + d, rtol=0, atol=1e-6)  # accumulated = sent + kept
    torch.testing.assert_close(strategy.global_params(), before - torch.stack(sent).mean(0), rtol=0, atol=1e-6)
    assert comm.bytes_sent_per_island == ring_allgather_bytes(strategy.compressor.payload_bytes() + WEIGHT_BYTES, k)
    shares = [1 - float(e.square().sum()) / float((beta * p + d).square().sum())
              for e, p, d in zip(strategy.error, previous, deltas, strict=True)]
    assert strategy.summary()["sparseloco_sent_energy"] == pytest.approx(sum(shares) / k, rel=1e-5)
    assert 0 < strategy.summary()["sparseloco_sent_energy"] < 1  # 4 of 64 per chunk: a part, not all
    density = strategy.summary()["sparseloco_density"]
    assert density == pytest.approx(strategy.compressor.kept_real / strategy.compressor.numel)


def test_density_counts_real_entries_not_a_chunks_padding() -> None:
    assert SparseCompressor(NUMELS, 4096, 4096, bits=32).density == 1.0  # dense: every entry, once
    c = SparseCompressor(NUMELS, 64, 8)  # 100 -> 2 chunks (8 + 8), 5000 -> 79 (78 x 8 + 8 of 8 real), 30 -> 8
    assert c.kept_real == 16 + 79 * 8 + 8 + 64 * 8
    assert c.density == pytest.approx(c.kept_real / sum(NUMELS))
    tiny = SparseCompressor([3, 64], 64, 8)  # a 3-element parameter can take 3 entries, not 8
    assert tiny.kept_real == 3 + 8 and tiny.kept == 16


def test_projection_prices_the_payload_exactly() -> None:
    comm, islands, strategy = _round(2, 2, sparseloco_topk=4, sparseloco_chunk=16)
    assert all(p.numel() % 16 == 0 for p in islands[0].params)  # whole chunks, as the projection assumes
    s = Setting(params=strategy.compressor.numel, step_compute_s=1.0, sparseloco_topk=4, sparseloco_chunk=16)
    assert payload_bytes(s) == strategy.compressor.payload_bytes() + WEIGHT_BYTES


def test_a_top_k_above_the_chunk_is_refused() -> None:
    with pytest.raises(ConfigError, match="sparseloco_topk"):
        build_config(overrides={"strategy": "sparseloco", "sparseloco_topk": 100, "sparseloco_chunk": 64})
    with pytest.raises(ConfigError, match="sparseloco_topk"):
        build_config(overrides={"strategy": "diloco", "sparseloco_topk": 8})
