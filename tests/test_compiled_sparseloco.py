"""SparseLoCo's compiled accumulation (``outer_kernel = "compiled"``): the loop against the eager formulas on the
same inputs, nothing of the caller's written where a pseudo-gradient is not finite, the sent energy's "after" from
the kept entries against the whole-vector norm, and whole runs against the eager round (model, accumulators,
bytes, diagnostics, a poisoned island; resume in tests/test_train.py)."""

from __future__ import annotations

import math

import pytest
import torch
from test_strategies import _graphs_compiled_while_training, _setup, _train_steps

from atoll.algorithms.fused_accumulate import FusedAccumulate
from atoll.algorithms.sparse import SparseCompressor
from atoll.config import TrainConfig
from atoll.strategies.sparseloco import SparseLoCo

pytestmark = pytest.mark.xdist_group("compile")  # one worker compiles the loops once


def _vectors(islands: int, numel: int = 10_000, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                       list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(numel, generator=gen)
    return (g, [g + 0.01 * torch.randn(numel, generator=gen) for _ in range(islands)],
            [0.001 * torch.randn(numel, generator=gen) for _ in range(islands)])


@pytest.mark.parametrize("islands", [1, 3])
def test_the_loop_gives_the_eager_accumulators_and_norms_and_reads_its_inputs_only(islands: int) -> None:
    g, flats, errors = _vectors(islands)
    weights = [3, 0, 2][:islands]  # an island of weight 0 accumulates too, and counts nowhere in the step
    beta, rate = 0.95, 0.7
    before = [t.clone() for t in (g, *flats, *errors)]
    fused = FusedAccumulate(beta, rate)
    fused.warm_up(islands, g.numel())
    out = fused.apply(g, flats, errors, weights)
    assert out is not None
    new, energies, square = out
    for t, b in zip((g, *flats, *errors), before, strict=True):
        assert torch.equal(t, b)  # read only: the new accumulators are in the second buffers
    for n, e, f, energy in zip(new, errors, flats, energies, strict=True):
        expected = e.clone().mul_(beta).add_(g - f, alpha=rate)  # the eager round's operations
        torch.testing.assert_close(n, expected, rtol=0, atol=4 * torch.finfo(torch.float32).eps)
        assert energy == pytest.approx(float(expected.double().square().sum()), rel=1e-5)
        assert all(n.data_ptr() != t.data_ptr() for t in (*errors, *flats))
    plain = sum(w * (g - f).double() for w, f in zip(weights, flats, strict=True))
    assert square == pytest.approx(float(plain.square().sum()), rel=1e-5)
    # the next round writes into this round's inputs' buffers (kept as the second buffers), not the ones returned
    again = fused.apply(g, flats, new, weights)
    assert again is not None and {t.data_ptr() for t in again[0]} == {t.data_ptr() for t in errors}


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_pseudo_gradient_that_is_not_finite_writes_nothing_of_the_callers(bad: float) -> None:
    g, flats, errors = _vectors(2)
    flats[1][1234] = bad
    before = [e.clone() for e in errors]
    fused = FusedAccumulate(0.95, 1.0)
    fused.warm_up(2, g.numel())
    assert fused.apply(g, flats, errors, [1, 1]) is None
    assert all(torch.equal(e, b) for e, b in zip(errors, before, strict=True))


def test_vectors_that_do_not_fit_are_refused() -> None:
    g, flats, errors = _vectors(2)
    fused = FusedAccumulate(0.95, 1.0)
    with pytest.raises(ValueError, match="float32 \\(9999,\\)"):
        fused.apply(g, [flats[0], flats[1][:-1]], errors, [1, 1])
    with pytest.raises(ValueError, match="2 islands, 1 accumulators"):
        fused.apply(g, flats, errors[:1], [1, 1])


@pytest.mark.parametrize("layout", ["tiles", "flat"])
@pytest.mark.parametrize("whole", [False, True])
def test_the_energy_removed_is_counted_from_the_kept_entries(layout: str, whole: bool) -> None:
    """``subtract_energy_``: the same vector as ``subtract_``; the kept entries' squares before and after, and how
    many it set (every entry for a lossless payload, whose remainder is exactly 0)."""
    shapes = [(64, 96), (96,), (1000,)]
    chunk = 1024 if layout == "tiles" else 256
    compressor = SparseCompressor(shapes, chunk, chunk if whole else 8, 32 if whole else 2, layout)
    x = torch.randn(compressor.numel, generator=torch.Generator().manual_seed(1))
    payload = compressor.compress(x)
    plain, counted = x.clone(), x.clone()
    compressor.subtract_(plain, payload)
    kept_before, kept_after, count = compressor.subtract_energy_(counted, payload)
    assert torch.equal(plain, counted)
    set_ = (counted != x).double()
    assert count == (compressor.numel if whole else int(set_.sum()))
    assert kept_before == pytest.approx(float((x.double() * set_).square().sum()), rel=1e-12)
    assert kept_after == pytest.approx(float((counted.double() * set_).square().sum()), rel=1e-12, abs=0)
    if whole:
        assert kept_after == 0.0 and not counted.any()


def test_a_lossless_payload_delivers_all_of_the_energy_as_in_the_eager_round() -> None:
    """Density 1, 32-bit values, no decay, no clip (the FedAvg identity): the sent energy is 1 exactly, both ways."""
    lossless = {"sparseloco_topk": 256, "sparseloco_bits": 32, "sparseloco_beta": 0.0, "sparseloco_clip": "none"}
    for kernel in ("eager", "compiled"):
        strategy = _sparseloco(kernel, **lossless)[0]
        assert strategy.summary()["sparseloco_sent_energy"] == 1.0


def test_the_second_buffers_are_never_the_callers_accumulators() -> None:
    """A caller that passes the accumulators it passed before (not the ones returned) gets fresh second buffers: a
    round found not finite then leaves them untouched too."""
    g, flats, errors = _vectors(2)
    keep = [e.clone() for e in errors]
    fused = FusedAccumulate(0.9, 1.0)
    fused.warm_up(2, g.numel())
    assert fused.apply(g, flats, errors, [1, 1]) is not None  # (the result not adopted)
    flats[1][5] = math.nan
    assert fused.apply(g, flats, errors, [1, 1]) is None
    assert all(torch.equal(e, k) for e, k in zip(errors, keep, strict=True))


def _sparseloco(outer_kernel: str, steps: int = 12, poison_at: int | None = None, **settings: object):
    """Three islands, H = 3, the micro model, tiles of 256 keeping 16 (so every tensor keeps some entries)."""
    settings = {"sparseloco_chunk": 256, "sparseloco_topk": 16, **settings}
    config, model, comm, islands, strategy = _setup(SparseLoCo, 3, sync_every=3, outer_kernel=outer_kernel,
                                                    **settings)
    _train_steps(strategy, islands, steps, poison_at)
    return strategy, islands, comm


@pytest.mark.parametrize("settings", [{}, {"sparseloco_bits": 32, "sparseloco_clip": "none"},
                                      {"outer_momentum": 0.9, "outer_lr": 0.7, "sparseloco_beta": 0.5}])
def test_a_compiled_sparseloco_run_gives_the_eager_runs_model_accumulators_bytes_and_diagnostics(
        settings: dict) -> None:
    eager, eager_islands, eager_comm = _sparseloco("eager", **settings)
    run, islands, comm = _sparseloco("compiled", **settings)
    assert run.summary()["outer_rounds_compiled"] == 4 and "outer_rounds_compiled" not in eager.summary()
    scale = max(float(eager.outer.params.detach().abs().max()), 1.0)
    # a last-bit difference in an accumulator may move a near-tie in a tile's top-k: a few entries, not the model
    diff = (run.outer.params.detach() - eager.outer.params.detach()).abs()
    assert float((diff > 1e-5 * scale).float().mean()) < 1e-3 and float(diff.max()) <= 1e-2 * scale
    for a, b in zip(islands, eager_islands, strict=True):
        torch.testing.assert_close(a.flat_params(), run.outer.params.detach(), rtol=0, atol=0)
        assert float((a.flat_params() - b.flat_params()).abs().max()) <= 1e-2 * scale
    for mine, theirs in zip(run.error, eager.error, strict=True):
        assert float(((mine - theirs).abs() > 1e-5).float().mean()) < 1e-3
    mine, theirs = run.summary(), eager.summary()
    for key in ("sparseloco_sent_energy", "sparseloco_step_ratio"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-4) and mine[key] > 0
    assert comm.bytes_sent_per_island == eager_comm.bytes_sent_per_island > 0
    assert comm.exchanges == eager_comm.exchanges == 4
    assert run.outer.version == eager.outer.version == 4


def test_no_round_compiles() -> None:
    config, model, comm, islands, strategy = _setup(SparseLoCo, 2, sync_every=3, sparseloco_chunk=256,
                                                    sparseloco_topk=16, outer_kernel="compiled")
    assert _graphs_compiled_while_training(strategy, islands, 9) == 0
    assert strategy.compiled_rounds == 3


def test_an_island_that_is_not_finite_is_left_out_as_in_the_eager_run() -> None:
    """Island 1's weights made NaN before the round after step 6: the compiled loop finds it, writes nothing, and
    that round runs eager (island 1 sends nothing, keeps its accumulator and restarts from the globals)."""
    eager, eager_islands, _ = _sparseloco("eager", poison_at=6)
    run, islands, _ = _sparseloco("compiled", poison_at=6)
    assert eager.dropped_updates == run.dropped_updates == 1
    assert run.compiled_rounds == 3  # 4 rounds, the poisoned one eager
    for a, b in zip(islands, eager_islands, strict=True):
        assert torch.isfinite(a.flat_params()).all()
        assert float((a.flat_params() - b.flat_params()).abs().max()) <= 1e-2
    assert all(torch.isfinite(e).all() for e in run.error)


def test_the_compiled_sparseloco_round_is_refused_where_it_cannot_run() -> None:
    base = {"strategy": "sparseloco", "outer_kernel": "compiled", "model": "micro"}
    with pytest.raises(ValueError, match="outer_kernel: .*--runtime local"):
        TrainConfig(**base, runtime="collective")
    with pytest.raises(ValueError, match="outer_kernel: .*--device cpu"):
        TrainConfig(**base, device="cuda")
    assert TrainConfig(**base).strategy_config.outer_kernel == "compiled"
