"""Streaming DiLoCo's compiled round (``outer_kernel = "compiled"``): a fragment's spans and the codec's blocks
across them, the quantized mean over spans against the eager codec on the same inputs, the merge's mixing on a
hand-computed case, and whole runs against the eager round (model, bytes, clock, a poisoned island, resume in
tests/test_train.py)."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from test_strategies import _graphs_compiled_while_training, _setup, _train_steps

from atoll.algorithms.codecs import make_codec
from atoll.algorithms.fragments import FlatFragment
from atoll.algorithms.fused_round import FusedRound
from atoll.algorithms.layout import Layout
from atoll.algorithms.merge import average_encoded
from atoll.algorithms.wire import ErrorFeedback
from atoll.config import TrainConfig
from atoll.strategies.streaming import StreamingDiLoCo

pytestmark = pytest.mark.xdist_group("compile")  # one worker compiles the loops once

#: a fragment of four ranges of a flat vector of 1000: two adjacent (one span), none a whole number of blocks of 64
FRAGMENT = FlatFragment(((10, 110), (110, 147), (300, 600), (700, 705), (800, 990)))


def test_a_layout_joins_adjacent_ranges_and_cuts_whole_blocks_inside_spans() -> None:
    layout = Layout.of(FRAGMENT)
    assert layout.spans == ((0, 10, 137), (137, 300, 300), (437, 700, 5), (442, 800, 190))
    assert layout.numel == FRAGMENT.numel() == 632 and layout.flat_numel == 990
    flat = torch.arange(1000.0)
    assert torch.equal(torch.cat(layout.of_flat(flat)), FRAGMENT.gather(flat))
    assert torch.equal(layout.gather(flat, 130, 450), FRAGMENT.gather(flat)[130:450])
    chunks, rest = layout.chunks(64)
    # chunks: whole blocks inside one span; the rest: blocks across spans' borders and the partial last block
    assert chunks == [(0, 10, 128), (192, 355, 192), (448, 806, 128)]
    assert rest == [(128, 192), (384, 448), (576, 632)]
    covered = sorted([(o, o + n) for o, _, n in chunks] + rest)
    assert covered[0][0] == 0 and covered[-1][1] == 632 and all(a[1] == b[0] for a, b in pairwise(covered))
    assert Layout.whole(100).chunks(64) == ([(0, 0, 64)], [(64, 100)])


@pytest.mark.parametrize("codec", ["int4", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("islands", [1, 3])
def test_the_quantized_mean_over_a_fragment_is_the_codecs_on_the_gathered_fragment(codec: str, rounding: str,
                                                                                  islands: int) -> None:
    """Against the eager exchange (:func:`average_encoded` with error feedback) of each island's gathered
    pseudo-gradient: the same residuals bit for bit (so the same integers and scales, in the blocks inside spans
    and those across their borders), the same draws, the mean within float32 rounding; islands only read."""
    torch.manual_seed(islands)
    layout = Layout.of(FRAGMENT)
    g = torch.randn(layout.numel)
    flats = [torch.randn(1000) for _ in range(islands)]
    for f in flats:
        FRAGMENT.scatter_(f, g + 0.01 * torch.randn(layout.numel))
    weights = [3.0, 1.0, 2.0][:islands]
    lossy = make_codec(codec, block_size=64, rounding=rounding)
    feedback = [ErrorFeedback(lossy) for _ in range(islands)]

    def sources() -> list[torch.Generator] | None:
        return [torch.Generator().manual_seed(10 + i) for i in range(islands)] if rounding == "stochastic" else None

    deltas = [g - FRAGMENT.gather(f) for f in flats]
    average_encoded(deltas, lossy, weights, sources(), feedback=feedback, key="f")  # residuals
    residuals = [f.residual("f").clone() for f in feedback]
    expected, _ = average_encoded(deltas, lossy, weights, sources(), feedback=feedback, key="f")
    fused = FusedRound(1.0, 0.0, codec=lossy, error_feedback=True)
    before, generators = [f.clone() for f in flats], sources()
    mean = fused.mean("f", g, flats, layout, weights, residuals=residuals, generators=generators)
    assert mean is not None
    for mine, theirs in zip(residuals, feedback, strict=True):
        assert torch.equal(mine, theirs.residual("f"))
    for mine, theirs in zip(generators or [], sources() or [], strict=True):
        torch.rand(layout.numel, generator=theirs)
        assert torch.equal(mine.get_state(), theirs.get_state())
    torch.testing.assert_close(mean, expected, rtol=0, atol=2 * torch.finfo(torch.float32).eps * 4)
    assert all(torch.equal(a, b) for a, b in zip(flats, before, strict=True))


def test_the_fp32_mean_over_a_fragment_and_a_pseudo_gradient_that_is_not_finite() -> None:
    layout = Layout.of(FRAGMENT)
    g = torch.randn(layout.numel)
    flats = [torch.randn(1000) for _ in range(2)]
    fused = FusedRound(0.7, 0.9)
    mean = fused.mean("f", g, flats, layout, [1.0, 3.0])
    assert mean is not None
    expected = 0.25 * (g - FRAGMENT.gather(flats[0])) + 0.75 * (g - FRAGMENT.gather(flats[1]))
    torch.testing.assert_close(mean, expected, rtol=0, atol=1e-6)
    flats[1][850] = math.nan  # inside the fragment: found by the mean's own sums
    assert fused.mean("f", g, flats, layout, [1.0, 3.0]) is None
    flats[1][850], flats[1][200] = 0.0, math.inf  # outside it: not read
    assert fused.mean("f", g, flats, layout, [1.0, 3.0]) is not None
    lossy = make_codec("int4", block_size=64, rounding="stochastic")
    fused = FusedRound(0.7, 0.9, codec=lossy)
    flats[0][140] = math.inf  # in a block across two spans (run uncompiled)
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    states = [gen.get_state() for gen in generators]
    assert fused.mean("f", g, flats, layout, [1.0, 3.0], generators=generators) is None
    assert all(torch.equal(gen.get_state(), s) for gen, s in zip(generators, states, strict=True))


def test_the_merge_steps_and_mixes_a_hand_computed_case() -> None:
    """θ, m from torch's SGD-Nesterov; each island's fragment elements become α θ_i + (1 − α) θ; its other
    elements are not touched."""
    fragment = FlatFragment(((1, 3), (5, 6)))
    layout = Layout.of(fragment)
    g, m, mean = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5, 0.0, -0.5]), torch.tensor([0.25, -0.5, 1.0])
    flats = [torch.arange(8.0), -torch.arange(8.0)]
    lr, mu, alpha = 0.5, 0.5, 0.75
    new_m = mu * m + mean  # (0.5, -0.5, 0.75)
    new_g = g - lr * (mean + mu * new_m)  # (0.75, 2.375, -1.6875)
    expected = [f.clone() for f in flats]
    for e in expected:
        fragment.scatter_(e, alpha * fragment.gather(e) + (1 - alpha) * new_g)
    assert FusedRound(lr, mu).merge(g, m, mean, flats, layout, alpha)
    assert torch.equal(m, new_m) and torch.equal(g, torch.tensor([0.75, 2.375, -1.6875]))
    for mine, theirs in zip(flats, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
        assert torch.equal(mine[[0, 3, 4, 6, 7]], theirs[[0, 3, 4, 6, 7]])


def _streaming(outer_kernel: str, steps: int = 16, poison_at: int | None = None, **settings: object):
    """Two islands, H = 4, P = 2, tau = 1 (an exchange in flight across an inner step), the micro model."""
    config, model, comm, islands, streaming = _setup(StreamingDiLoCo, 2, sync_every=4, fragments=2,
                                                     overlap_steps=1, outer_kernel=outer_kernel, **settings)
    _train_steps(streaming, islands, steps, poison_at)
    streaming.drain()
    return streaming, islands, comm


def _globals(streaming: StreamingDiLoCo) -> torch.Tensor:
    return torch.cat([o.params.detach() for o in streaming.outers])


@pytest.mark.parametrize("settings", [{"codec": "fp32"}, {"codec": "int4"},
                                      {"codec": "int4", "codec_rounding": "stochastic", "error_feedback": True},
                                      {"codec": "int8", "outer_momentum": 0.0},
                                      {"codec": "fp32", "mixing_alpha": 0.0}])
def test_a_compiled_streaming_run_gives_the_eager_runs_model_bytes_and_clock(settings: dict) -> None:
    eager, eager_islands, eager_comm = _streaming("eager", **settings)
    run, islands, comm = _streaming("compiled", **settings)
    # every fragment's first round merges eager (torch's SGD starts the momentum; with error feedback its first
    # encode keeps the residual): 8 rounds, 2 eager; with no momentum, all compiled
    first = 0 if settings.get("outer_momentum") == 0.0 else 2
    assert run.summary()["outer_rounds_compiled"] == comm.exchanges - first == 8 - first
    scale = max(float(_globals(eager).abs().max()), 1.0)
    diff = torch.cat([(a.flat_params() - b.flat_params()).abs() for a, b in zip(islands, eager_islands, strict=True)]
                     + [(_globals(run) - _globals(eager)).abs()])
    if settings["codec"] == "fp32":
        assert float(diff.max()) <= 1e-5 * scale
    else:  # a last-bit difference may put a value on the other side of a rounding step, which the islands keep
        # (mixing) and error feedback carries: a few elements, by about one step of the codec's rounding
        assert float((diff > 1e-5 * scale).float().mean()) < 1e-2 and float(diff.max()) <= 1e-2 * scale
    assert comm.bytes_sent_per_island == eager_comm.bytes_sent_per_island > 0
    assert comm.exchanges == eager_comm.exchanges == 8 and comm.peak_bytes_per_exchange == \
        eager_comm.peak_bytes_per_exchange
    assert comm.clock.comm_busy_s == pytest.approx(eager_comm.clock.comm_busy_s) and comm.clock.comm_busy_s > 0
    if settings["codec"] != "fp32":
        assert all(s > 0 for s in comm.clock.codec_s)
    assert [o.version for o in run.outers] == [o.version for o in eager.outers] == [4, 4]


@pytest.mark.parametrize("alpha", [0.5, 0.0])
def test_no_round_compiles(alpha: float) -> None:
    """The loops are compiled as the strategy is built, on each fragment's own spans (alpha 0: the merge copies)."""
    config, model, comm, islands, streaming = _setup(StreamingDiLoCo, 2, sync_every=4, fragments=2,
                                                     overlap_steps=1, outer_kernel="compiled", codec="int4",
                                                     mixing_alpha=alpha)
    assert _graphs_compiled_while_training(streaming, islands, 12) == 0
    # 6 fragment rounds started, the last still in flight, each fragment's first merged eager
    assert streaming.compiled_rounds == 3


@pytest.mark.parametrize("settings", [{"codec": "fp32"}, {"codec": "int4"}])
def test_an_island_that_is_not_finite_is_left_out_and_adopts_the_globals_as_in_the_eager_run(settings: dict) -> None:
    """Island 1's weights made NaN just before fragment 0's exchange after step 10 (its loss still finite): the
    compiled start finds it and runs that round eager, which leaves the island out and has it adopt the globals."""
    eager, eager_islands, _ = _streaming("eager", poison_at=10, **settings)
    run, islands, _ = _streaming("compiled", poison_at=10, **settings)
    assert eager.dropped_updates == run.dropped_updates == 1
    assert run.compiled_rounds == 5  # 8 rounds: each fragment's first and the poisoned one eager
    for a, b in zip(islands, eager_islands, strict=True):
        assert torch.isfinite(a.flat_params()).all()
        torch.testing.assert_close(a.flat_params(), b.flat_params(), rtol=0, atol=1e-2)


def test_the_compiled_streaming_round_is_refused_where_it_cannot_run() -> None:
    base = {"strategy": "streaming", "outer_kernel": "compiled", "model": "micro", "fragments": 2}
    with pytest.raises(ValueError, match="outer_kernel: .*--codec fp32, int8 or int4"):
        TrainConfig(**base, codec="bf16")
    with pytest.raises(ValueError, match="outer_kernel: .*--runtime local"):
        TrainConfig(**base, runtime="collective")
    with pytest.raises(ValueError, match="outer_kernel: .*--device cpu"):
        TrainConfig(**base, device="cuda")
    assert TrainConfig(**base).strategy_config.outer_kernel == "compiled"
