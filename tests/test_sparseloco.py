"""SparseLoCo: the compressor's payload and size, the FedAvg identity, error feedback, bytes, and a run."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from test_strategies import _batch, _setup

from atoll.algorithms.sparse import SparseCompressor
from atoll.config import build_config
from atoll.errors import ConfigError
from atoll.runtime.network import ring_allgather_bytes
from atoll.strategies.sparseloco import WEIGHT_BYTES, SparseLoCo, payload_bytes

NUMELS = [100, 5000, 30, 4096]


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(sum(NUMELS), generator=torch.Generator().manual_seed(seed))


def test_density_one_at_32_bits_is_lossless() -> None:
    c = SparseCompressor(NUMELS, 64, 64, bits=32, layout="flat")
    x = _x()
    assert torch.equal(c.decompress(c.compress(x)), x)


def test_top_k_per_chunk_keeps_the_largest_and_chunks_stay_within_a_parameter() -> None:
    c = SparseCompressor(NUMELS, 64, 4, bits=32, layout="flat")
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
    c = SparseCompressor(NUMELS, 64, 16, bits=2, layout="flat")
    x = _x(2)
    payload = c.compress(x)
    exact = SparseCompressor(NUMELS, 64, 16, bits=32, layout="flat").decompress(
        SparseCompressor(NUMELS, 64, 16, 32, layout="flat").compress(x))
    out = c.decompress(payload)
    assert torch.equal(out != 0, exact != 0) and torch.equal(torch.sign(out), torch.sign(exact))
    levels = payload["levels"]
    assert levels.shape == (c.chunks, 2) and bool((levels[:, 0] <= levels[:, 1]).all())
    assert set(out.abs().unique().tolist()) - {0.0} <= set(levels.flatten().tolist())
    # lo and hi are the means of the magnitudes below and above the median: the magnitude sum is kept
    assert out.abs().sum().item() == pytest.approx(exact.abs().sum().item(), rel=1e-5)
    same = torch.full((64,), -0.5)  # a chunk of equal magnitudes is exact
    one = SparseCompressor([64], 64, 8, bits=2, layout="flat")
    out = one.decompress(one.compress(same))
    assert int((out != 0).sum()) == 8 and set(out.unique().tolist()) == {-0.5, 0.0}


@pytest.mark.parametrize("bits", [2, 32])
def test_payload_bytes_are_the_tensors_and_the_formula(bits: int) -> None:
    c = SparseCompressor(NUMELS, 64, 8, bits=bits, layout="flat")
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
                                     sparseloco_beta=0.0, sparseloco_clip="none")
    assert strategy.config.outer_lr == 1.0 and strategy.config.outer_momentum == 0.0  # the strategy's defaults
    expected = torch.stack([i.flat_params() for i in islands]).mean(0)
    strategy.outer_step(3)
    torch.testing.assert_close(strategy.global_params(), expected, rtol=0, atol=1e-6)
    assert all(torch.equal(i.flat_params(), strategy.global_params()) for i in islands)
    assert all(float(e.abs().max()) == 0.0 for e in strategy.error)  # nothing carried over
    assert strategy.summary()["sparseloco_sent_energy"] == pytest.approx(1.0)  # a lossless payload sends it all
    assert strategy.summary()["sparseloco_step_ratio"] == pytest.approx(1.0, rel=1e-5)  # plain averaging's step


def test_error_feedback_keeps_what_was_not_sent_and_bytes_follow_the_formula() -> None:
    k, h, beta = 2, 2, 0.9
    comm, islands, strategy = _round(k, h, sparseloco_topk=4, sparseloco_chunk=64, sparseloco_beta=beta,
                                     sparseloco_clip="none")
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
    # each entry averaged over the islands that sent it (the reference's scatter-mean), not over all islands
    chosen = torch.zeros(k, strategy.compressor.numel + 1)
    for row, p, d in zip(chosen, previous, deltas, strict=True):
        row[strategy.compressor.positions_and_values(strategy.compressor.compress(beta * p + d))[0]] = 1.0
    senders = chosen[:, :-1].sum(0)
    expected = torch.where(senders > 0, torch.stack(sent).sum(0) / senders.clamp(min=1), 0.0)
    assert float(senders.max()) == k and float(senders[senders > 0].min()) == 1  # both overlap and not
    torch.testing.assert_close(strategy.global_params(), before - expected, rtol=0, atol=1e-6)
    assert comm.bytes_sent_per_island == ring_allgather_bytes(strategy.compressor.payload_bytes() + WEIGHT_BYTES, k)
    assert comm.bytes_received_per_island == comm.bytes_sent_per_island  # the all-gather's receive half
    shares = [1 - float(e.square().sum()) / float((beta * p + d).square().sum())
              for e, p, d in zip(strategy.error, previous, deltas, strict=True)]
    assert strategy.summary()["sparseloco_sent_energy"] == pytest.approx(sum(shares) / k, rel=1e-5)
    assert 0 < strategy.summary()["sparseloco_sent_energy"] < 1  # 4 of 64 per chunk: a part, not all
    density = strategy.summary()["sparseloco_density"]
    assert density == pytest.approx(strategy.compressor.kept_real / strategy.compressor.numel)


def test_density_counts_real_entries_not_a_chunks_padding() -> None:
    assert SparseCompressor(NUMELS, 4096, 4096, bits=32, layout="flat").density == 1.0  # dense: every entry, once
    # 100 -> 2 chunks (8 + 8), 5000 -> 79 (78 x 8 + 8 of 8 real), 30 -> 8
    c = SparseCompressor(NUMELS, 64, 8, layout="flat")
    assert c.kept_real == 16 + 79 * 8 + 8 + 64 * 8
    assert c.density == pytest.approx(c.kept_real / sum(NUMELS))
    tiny = SparseCompressor([3, 64], 64, 8, layout="flat")  # a 3-element parameter can take 3 entries, not 8
    assert tiny.kept_real == 3 + 8 and tiny.kept == 16


def test_projection_prices_the_payload_exactly() -> None:  # exact for flat chunks that divide every parameter
    comm, islands, strategy = _round(2, 2, sparseloco_topk=4, sparseloco_chunk=16, sparseloco_layout="flat")
    assert all(p.numel() % 16 == 0 for p in islands[0].params)  # whole chunks, as the projection assumes
    predicted = payload_bytes(strategy.config, strategy.compressor.numel)
    assert predicted == strategy.compressor.payload_bytes() + WEIGHT_BYTES


def test_a_top_k_above_the_chunk_is_refused() -> None:
    with pytest.raises(ConfigError, match="sparseloco_topk"):
        build_config(overrides={"strategy": "sparseloco", "sparseloco_topk": 100, "sparseloco_chunk": 64})
    with pytest.raises(ConfigError, match="sparseloco_topk"):
        build_config(overrides={"strategy": "diloco", "sparseloco_topk": 8})


# --- the reference's rules (SparseLoCo release, Templar compress.py), on small hand-computed cases ----------


def test_each_entry_is_averaged_over_the_islands_that_sent_it() -> None:
    # 2 islands, one 1x2 tensor, top-1 (a 1x2 tile of a 2x2 chunk keeps round(2 * 2 / 4) = 1), accumulators
    # (1, 0) and (0, 1): the reference's aggregate is (1, 1); dividing by every island gave (0.5, 0.5)
    c = SparseCompressor([(1, 2)], 4, 2, bits=32)
    payloads = [c.compress(torch.tensor([1.0, 0.0])), c.compress(torch.tensor([0.0, 1.0]))]
    assert c.aggregate(payloads, [1.0, 1.0]).tolist() == [1.0, 1.0]
    both = [c.compress(torch.tensor([3.0, 0.0])), c.compress(torch.tensor([1.0, 0.0]))]
    assert c.aggregate(both, [1.0, 3.0], clip="none").tolist() == [1.5, 0.0]  # senders weighed by tokens: (3 + 3) / 4
    assert c.aggregate([payloads[0], both[0]], [1.0, 0.0]).tolist() == [1.0, 0.0]  # weight 0 counts nowhere


def test_each_payload_is_clipped_to_the_median_norm_per_tensor_before_the_mean() -> None:
    # Templar's batch_decompress(clip_norm=True): two tensors, a 1x2 matrix (top-1) and a vector of 2 (chunk 4,
    # side 2: one run of 2, k = round(2 * 2 / 4) = 1). Islands A, B, C send the matrix values 4, 1, 2 at
    # entries 0, 0, 1 and the vector values 1, 1, 1 at entry 0: the matrix norms are 4, 1, 2, median 2, so A's
    # 4 becomes 2 (B and C are not scaled up): entry 0 is mean(2, 1) = 1.5, entry 1 is C's 2; the vector's
    # norms are all 1, so nothing changes there (the clip is per tensor, not over the whole payload)
    c = SparseCompressor([(1, 2), 2], 4, 2, bits=32)
    xs = [[4.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 2.0, 1.0, 0.0]]
    payloads = [c.compress(torch.tensor(x)) for x in xs]
    assert c.aggregate(payloads, [1.0] * 3).tolist() == pytest.approx([1.5, 2.0, 1.0, 0.0], rel=1e-7)
    assert c.aggregate(payloads, [1.0] * 3, clip="none").tolist() == [2.5, 2.0, 1.0, 0.0]  # the release's
    # an even count: torch.median's lower middle value; norms 1 and 3 -> 1, so the 3 is scaled to 1
    two = [c.compress(torch.tensor([1.0, 0.0, 0.0, 0.0])), c.compress(torch.tensor([0.0, 3.0, 0.0, 0.0]))]
    assert c.aggregate(two, [1.0, 1.0]).tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0], rel=1e-7)
    # a payload of weight 0 takes no part in the median: B alone has the median
    assert c.aggregate(payloads, [0.0, 1.0, 0.0]).tolist() == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="clip"):
        c.aggregate(payloads, [1.0] * 3, clip="mean")


def test_a_round_clips_to_the_median_norm_by_default() -> None:
    comm, islands, strategy = _round(3, 1, sparseloco_topk=1, sparseloco_chunk=4096, sparseloco_bits=32,
                                     sparseloco_beta=0.0)
    assert strategy.config.sparseloco_clip == "median"
    for island, size in zip(islands, (4.0, 1.0, 2.0), strict=True):  # one entry each, norms 4, 1 and 2
        flat = strategy.outer.params.detach().clone()
        flat[0] -= size
        island.set_flat_params(flat)
    before = strategy.global_params()
    strategy.outer_step(1)
    step = before - strategy.global_params()
    assert float(step[0]) == pytest.approx((2.0 + 1.0 + 2.0) / 3, rel=1e-6)  # the 4 clipped to the median 2
    assert float(step[1:].abs().max()) < 1e-6


def test_a_round_takes_the_senders_mean() -> None:
    comm, islands, strategy = _round(2, 1, sparseloco_topk=1, sparseloco_chunk=4096, sparseloco_bits=32,
                                     sparseloco_beta=0.0)  # both norms 1: the clip changes nothing
    for island, sign in zip(islands, (1.0, -1.0), strict=True):  # disjoint selections: entry 0 and entry 1
        flat = strategy.outer.params.detach().clone()
        flat[0 if sign > 0 else 1] -= 1.0
        island.set_flat_params(flat)
    before = strategy.global_params()
    strategy.outer_step(1)
    step = before - strategy.global_params()
    assert step[:2].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)  # not (0.5, 0.5)
    assert float(step[2:].abs().max()) < 1e-6


def test_two_d_tensors_are_cut_into_tiles_of_the_largest_divisors_with_k_scaled_to_the_tile() -> None:
    # a 2x4 tensor, tiles of at most 2x2 (chunk 4), top-2: tiles [[1, 5], [3, -4]] and [[6, 8], [0, 7]]
    c = SparseCompressor([(2, 4)], 4, 2, bits=32)
    x = torch.tensor([[1.0, 5, 6, 8], [3, -4, 0, 7]]).reshape(-1)
    assert c.decompress(c.compress(x)).view(2, 4).tolist() == [[0, 5, 0, 8], [0, -4, 0, 7]]
    flat = SparseCompressor([8], 4, 2, bits=32, layout="flat")  # contiguous runs of 4: the old rule
    assert flat.decompress(flat.compress(x)).view(2, 4).tolist() == [[0, 0, 6, 8], [0, -4, 0, 7]]
    # 100 x 96 at 64 x 64 (top-64 of 4096): 2 x 2 tiles of 50 x 48, k = round(64 * 2400 / 4096) = 38 each
    big = SparseCompressor([(100, 96)], 4096, 64, bits=32)
    assert big.chunks == 4 and big.kept == 4 * 38
    y = torch.randn(100, 96, generator=torch.Generator().manual_seed(3))
    out = big.decompress(big.compress(y.reshape(-1))).view(100, 96)
    for r in (0, 50):
        for col in (0, 48):
            tile, kept = y[r:r + 50, col:col + 48], out[r:r + 50, col:col + 48]
            assert int((kept != 0).sum()) == 38
            assert torch.equal(kept.abs().flatten().sort().values[-38:], tile.abs().flatten().sort().values[-38:])


def test_one_d_tensors_keep_about_one_entry_per_run() -> None:
    # a vector of 8 at chunk 16 (side 4), top-4: runs of 4, k = round(4 * 4 / 16) = 1 per run
    c = SparseCompressor([8], 16, 4, bits=32)
    x = torch.tensor([1.0, -3, 2, 0, 5, 4, -6, 1])
    assert c.decompress(c.compress(x)).tolist() == [0, -3, 0, 0, 0, 0, -6, 0]
    # at the default 64 x 64 top-64: a norm of 64 sends 1 entry, one of 100 two runs of 50 with 1 each
    d = SparseCompressor([64, 100, 30], 4096, 64, bits=32)
    assert d.kept == 1 + 2 + 1 and d.density == pytest.approx(4 / 194)
    old = SparseCompressor([64, 100, 30], 4096, 64, bits=32, layout="flat")
    assert old.kept_real == 64 + 64 + 30  # the old rule sent most of every short vector


def test_templars_k_keeps_topk_in_every_tile_at_most_the_tile() -> None:
    # Templar's compress: k = min(topk, tile) (a setting). A vector of 8 at chunk 16 (side 4), top-4: runs of 4
    # go whole (the release keeps 1 per run); a 2x4 matrix is one 2x4 tile of 8: 4 kept, where the release
    # keeps round(4 * 8 / 16) = 2
    x = torch.tensor([1.0, -3, 2, 0.5, 5, 4, -6, 1])
    vector = SparseCompressor([8], 16, 4, bits=32, tile_k="topk")
    assert vector.decompress(vector.compress(x)).tolist() == x.tolist() and vector.density == 1.0
    matrix = SparseCompressor([(2, 4)], 16, 4, bits=32, tile_k="topk")
    assert matrix.decompress(matrix.compress(x)).view(2, 4).tolist() == [[0, -3, 0, 0], [5, 4, -6, 0]]
    release = SparseCompressor([(2, 4)], 16, 4, bits=32)
    assert release.decompress(release.compress(x)).view(2, 4).tolist() == [[0, 0, 0, 0], [5, 0, -6, 0]]
    assert SparseCompressor([(64, 64), 64], 4096, 64, tile_k="topk").kept == 64 + 64  # the norm of 64 whole
    with pytest.raises(ConfigError, match="sparseloco_tile_k"):
        build_config(overrides={"strategy": "sparseloco", "sparseloco_tile_k": "topk", "sparseloco_layout": "flat"})


def test_the_outer_rate_goes_into_the_accumulator_and_into_the_step() -> None:
    rate, beta = 0.5, 0.5
    comm, islands, strategy = _round(2, 2, sparseloco_topk=256, sparseloco_chunk=256, sparseloco_bits=32,
                                     sparseloco_beta=beta, outer_lr=rate, sparseloco_clip="none")
    previous = [torch.full((strategy.compressor.numel,), 1e-3 * (i + 1)) for i in range(2)]
    for e, p in zip(strategy.error, previous, strict=True):
        e.copy_(p)
    deltas = [strategy.outer.params.detach() - i.flat_params() for i in islands]
    before = strategy.global_params()
    strategy.outer_step(2)
    accumulated = [beta * p + rate * d for p, d in zip(previous, deltas, strict=True)]  # e <- beta e + rate delta
    expected = before - rate * torch.stack(accumulated).mean(0)  # theta <- theta - rate * mean (density 1)
    torch.testing.assert_close(strategy.global_params(), expected, rtol=0, atol=1e-6)
    assert all(float(e.abs().max()) == 0.0 for e in strategy.error)  # density 1: everything was sent


def test_a_tile_needs_a_square_chunk() -> None:
    with pytest.raises(ValueError, match="square"):
        SparseCompressor([(4, 4)], 48, 4)
    with pytest.raises(ConfigError, match="sparseloco_chunk"):
        build_config(overrides={"strategy": "sparseloco", "sparseloco_chunk": 48, "sparseloco_topk": 4})
    build_config(overrides={"strategy": "sparseloco", "sparseloco_chunk": 48, "sparseloco_topk": 4,
                            "sparseloco_layout": "flat"})


def test_a_payload_from_a_stranger_is_checked() -> None:
    c = SparseCompressor([(2, 4)], 4, 2, bits=32)
    bad = c.compress(torch.arange(8.0))
    bad["indices"] = bad["indices"].clone()
    bad["indices"][0] = 4  # outside its tile of 4
    with pytest.raises(ValueError, match="outside its tile"):
        c.decompress(bad)
    with pytest.raises(ValueError, match="indices"):
        c.decompress({**bad, "indices": bad["indices"][:1]})


@pytest.mark.parametrize(("layout", "bits", "tile_k"), [("tiles", 2, "scaled"), ("tiles", 32, "topk"),
                                                         ("flat", 2, "scaled")])
def test_one_tensor_at_a_time_makes_the_model_s_payload(layout: str, bits: int, tile_k: str) -> None:
    """A sharded island compresses one whole tensor at a time (atoll.runtime.collective.sharded_sparseloco):
    joined, the tensors' payloads are the model's payload bit for bit, and each tensor's part of the model's
    payload aggregates (median clip, senders' mean) to the model's aggregate of that tensor."""
    shapes = [(100, 96), (64,), (30,), (3, 64, 2), (128, 40)]  # two tile sizes and k, and 1-D runs
    c = SparseCompressor(shapes, 1024, 16, bits=bits, layout=layout, tile_k=tile_k)
    sizer = SparseCompressor(shapes, 1024, 16, bits=bits, layout=layout, tile_k=tile_k)
    sizer.split(sizer.join([sizer.of_tensor(j).empty() for j in range(len(shapes))]))
    assert sizer.payload_bytes() == c.payload_bytes() and "groups" not in vars(sizer)  # no table of the model
    xs = [torch.randn(c.numel, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.1, 2.0, c.numel)
          for seed in (1, 2, 3)]
    ends = [0, *c.ends.tolist()]
    payloads = [c.compress(x) for x in xs]
    for x, payload in zip(xs, payloads, strict=True):
        parts = [c.of_tensor(j).compress(x[a:b]) for j, (a, b) in enumerate(pairwise(ends))]
        joined = c.join(parts)
        assert joined.keys() == payload.keys() and all(torch.equal(joined[k], payload[k]) for k in payload)
        assert [v.numel() for v in c.empty().values()] == [v.numel() for v in payload.values()]
    whole = c.aggregate(payloads, [1.0, 2.0, 3.0])
    split = [c.split(p) for p in payloads]
    for j, (a, b) in enumerate(pairwise(ends)):
        part = c.of_tensor(j).aggregate([s[j] for s in split], [1.0, 2.0, 3.0])
        torch.testing.assert_close(part, whole[a:b], rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout", ["tiles", "flat"])
def test_the_aggregate_divides_at_the_sent_entries_only_and_leaves_its_sums_clear(layout: str) -> None:
    """The aggregate's floats are the dense formula's, ``where(den > 0, num / den, 0)`` over the whole vector in
    float64 then float32, call after call on one compressor (its kept sums cleared where each call wrote them);
    ``out`` is overwritten whole."""
    shapes = [(8, 12), (5,), (3, 7)]
    c = SparseCompressor(shapes, 16, 3, bits=2, layout=layout)
    numel = sum(math.prod(s) for s in shapes)
    g = torch.Generator().manual_seed(0)
    out = torch.full((numel,), 7.0)
    for weights in ([1.0, 3.0, 2.0], [2.0, 0.0, 5.0], [1.0, 1.0, 1.0]):
        payloads = [c.compress(torch.randn(numel, generator=g)) for _ in weights]
        num = torch.zeros(numel + 1, dtype=torch.float64)
        den = torch.zeros(numel + 1, dtype=torch.float64)
        for payload, w in zip(payloads, weights, strict=True):
            if w > 0:
                pos, vals = c.positions_and_values(payload)
                num.index_add_(0, pos, vals.double() * w)
                den.index_add_(0, pos, torch.full_like(vals, w, dtype=torch.float64))
        expected = torch.where(den > 0, num / den.clamp(min=1e-300), 0.0)[:-1].float()
        got = c.aggregate(payloads, weights, clip="none", out=out)
        assert got is out and torch.equal(got, expected)
        assert not c.__dict__["_sums"].any()


@pytest.mark.parametrize("layout", ["tiles", "flat"])
def test_positions_and_the_error_s_subtraction_are_the_tables_and_the_dense_formula(layout: str) -> None:
    """A payload's positions are its tiles' table entries at its indices (``groups``' 2-D gather), its values the
    tiles' levels with its signs, and ``subtract_`` is ``x - decompress(payload)`` bit for bit."""
    shapes = [(8, 12), (5,), (3, 7), (64, 64)]
    c = SparseCompressor(shapes, 16, 3, bits=2, layout=layout)
    numel = sum(math.prod(s) for s in shapes)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    payload = c.compress(x)
    pos, vals = c.positions_and_values(payload)
    idx, start, expected = payload["indices"].long(), 0, []
    for gather, k in c.groups:
        part = idx[start:start + gather.shape[0] * k].view(-1, k)
        expected.append(gather.gather(1, part).reshape(-1))
        start += part.numel()
    assert torch.equal(pos, torch.cat(expected))
    dense = c.decompress(payload)
    real = pos < numel
    assert torch.equal(dense[pos[real]], vals[real]) and int((dense != 0).sum()) <= int(real.sum())
    want = x - dense
    assert torch.equal(c.subtract_(x.clone(), payload), want)


def test_the_step_ratios_norms_are_accurate_on_long_vectors() -> None:
    """Plain averaging's step size ‖Σ w_i Δ_i‖ / Σ w_i over 4M elements, and the update's norm, against float64: a
    float32 ``norm()`` drifts by about 1e-4 there (0.5% at 60M), ``l2_norm`` stays within 1e-6."""
    strategy = _setup(SparseLoCo, 2)[4]
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(1 << 22, generator=gen) * 1e-3 + 1e-4 for _ in range(2)]
    dropped, plain = strategy._agree(deltas, [1, 3])
    exact = float((deltas[0].double() + 3 * deltas[1].double()).norm()) / 4
    assert dropped == [False, False] and plain == pytest.approx(exact, rel=1e-6)
    # the update's norm: every entry of a 2048 x 2048 tensor sent (density 1, float32 values)
    strategy.compressor = SparseCompressor([(2048, 2048)], 4096, 4096, 32)
    payloads = [strategy.compressor.compress(d) for d in deltas]
    agg, norm = strategy._aggregate(payloads, [1.0, 3.0])
    assert norm == pytest.approx(float(agg.double().norm()), rel=1e-6) and norm > 0
