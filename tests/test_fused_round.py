"""diloco's compiled outer round (``outer_kernel = "compiled"``): its arithmetic on a hand-computed case, the
eager round's globals within rounding over several rounds, the same bytes and clock, and where it is refused; with
an int8/int4 codec, the codec's own integers and residuals on the same inputs."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from test_strategies import _batch, _graphs_compiled_while_training, _setup, _train_steps

from atoll.algorithms.codecs import make_codec
from atoll.algorithms.fused_round import FusedRound
from atoll.algorithms.merge import average_encoded
from atoll.algorithms.wire import ErrorFeedback
from atoll.config import TrainConfig
from atoll.errors import ConfigError
from atoll.strategies.diloco import DiLoCo

pytestmark = pytest.mark.xdist_group("compile")  # one worker compiles the round once


def test_one_round_matches_a_hand_computed_nesterov_step() -> None:
    g = torch.tensor([1.0, 2.0, -1.0, 0.5])
    m = torch.tensor([0.1, 0.0, -0.2, 0.0])
    p1 = torch.tensor([0.5, 2.5, -1.0, 0.0])  # Δ_1 = (0.5, -0.5, 0, 0.5)
    p2 = torch.tensor([1.0, 1.0, -2.0, 0.5])  # Δ_2 = (0, 1, 1, 0)
    lr, mu = 0.7, 0.9
    weights = [3.0, 1.0]  # shares 0.75, 0.25: Δ̄ = (0.375, -0.125, 0.25, 0.375)
    mean = [0.375, -0.125, 0.25, 0.375]
    new_m = [0.9 * mi + d for mi, d in zip([0.1, 0.0, -0.2, 0.0], mean, strict=True)]
    new_g = [gi - lr * (d + mu * nm) for gi, d, nm in zip([1.0, 2.0, -1.0, 0.5], mean, new_m, strict=True)]
    fused = FusedRound(lr, mu)
    assert fused.finite_deltas(g, [p1, p2]) == [True, True]
    assert fused.apply(g, m, [p1, p2], weights)
    torch.testing.assert_close(m, torch.tensor(new_m), rtol=0, atol=1e-7)
    torch.testing.assert_close(g, torch.tensor(new_g), rtol=0, atol=1e-7)
    assert torch.equal(p1, g) and torch.equal(p2, g)  # every island restarts from the new globals


def test_plain_sgd_with_outer_lr_one_is_the_weighted_average() -> None:
    """FedAvg's identity: outer lr 1 and momentum 0 give the islands' token-weighted mean."""
    g = torch.zeros(5)
    p1, p2 = torch.arange(5.0), torch.full((5,), 2.0)
    expected = (1 * p1 + 3 * p2) / 4
    fused = FusedRound(1.0, 0.0)
    assert fused.apply(g, None, [p1, p2], [1, 3])
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-6)
    assert torch.equal(p1, g) and torch.equal(p2, g)


def test_an_int4_round_matches_a_hand_computed_quantization() -> None:
    """One island, blocks of 4, FedAvg's step (lr 1, μ 0): θ moves by the decoded pseudo-gradient, and the residual
    keeps what rounding dropped. Powers of two, so every float is exact."""
    g = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 2.0])
    p = torch.tensor([0.125, 1.4375, 0.875, 1.0, 2.25, 2.0])  # Δ = (0.875, -0.4375, 0.125, 0 | -0.25, 0)
    residual = torch.zeros(6)
    fused = FusedRound(1.0, 0.0, codec=make_codec("int4", block_size=4), error_feedback=True)
    assert fused.apply(g, None, [p], [1.0], residuals=[residual])
    # block 1: scale 0.875 / 7 = 0.125, Δ / scale = (7, -3.5, 1, 0), rounded half to even: (7, -4, 1, 0);
    # block 2 (partial): scale 0.25 / 7, q = (-7, 0), decoded exactly (-0.25, 0)
    decoded = torch.tensor([0.875, -0.5, 0.125, 0.0, -0.25, 0.0])
    assert torch.equal(g, torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 2.0]) - decoded)
    assert torch.equal(residual, torch.tensor([0.0, 0.0625, 0.0, 0.0, 0.0, 0.0]))
    assert torch.equal(p, g)


@pytest.mark.parametrize("codec", ["int4", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("islands", [1, 3])
def test_the_quantized_mean_is_the_codecs_on_the_same_inputs(codec: str, rounding: str, islands: int) -> None:
    """Against the eager exchange (:func:`average_encoded` with error feedback): the same residuals bit for bit
    (so the same integers and scales), the same draws of the random sources, and the mean within float32
    rounding; a length with a partial last block."""
    n = 64 * 300 + 37
    torch.manual_seed(islands)
    g = torch.randn(n)
    parts = [g + 0.01 * torch.randn(n) for _ in range(islands)]
    weights = [3.0, 1.0, 2.0][:islands]
    lossy = make_codec(codec, block_size=64, rounding=rounding)
    feedback = [ErrorFeedback(lossy) for _ in range(islands)]

    def sources() -> list[torch.Generator] | None:
        return [torch.Generator().manual_seed(10 + i) for i in range(islands)] if rounding == "stochastic" else None

    average_encoded([g - p for p in parts], lossy, weights, sources(), feedback=feedback, key="all")  # residuals
    residuals = [f.residual("all").clone() for f in feedback]
    mean, _ = average_encoded([g - p for p in parts], lossy, weights, sources(), feedback=feedback, key="all")
    fused = FusedRound(1.0, 0.0, codec=lossy, error_feedback=True)
    new_g, copies, generators = g.clone(), [p.clone() for p in parts], sources()
    assert fused.apply(new_g, None, copies, weights, residuals=residuals, generators=generators)
    for mine, theirs in zip(residuals, feedback, strict=True):
        assert torch.equal(mine, theirs.residual("all"))
    if generators is not None:  # each drew n values, as the codec's encode does
        for mine, theirs in zip(generators, sources(), strict=True):
            torch.rand(n, generator=theirs)
            assert torch.equal(mine.get_state(), theirs.get_state())
    torch.testing.assert_close(g - new_g, mean, rtol=0, atol=2 * torch.finfo(torch.float32).eps * 4)
    assert all(torch.equal(p, new_g) for p in copies)


@pytest.mark.parametrize("codec", [None, "int4", "int4 feedback", "int8 stochastic"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_pseudo_gradient_that_is_not_finite_is_found_before_anything_is_written(codec: str | None,
                                                                                   bad: float) -> None:
    """Found by the separate check (fp32; error feedback) or by the quantized mean's block scales (a codec without
    error feedback): nothing of the caller's written, the random sources set back."""
    n = 64 * 80 + 5
    g, m = torch.ones(n), torch.full((n,), 0.25)
    p1, p2 = torch.zeros(n), torch.zeros(n)
    p2[64 * 40 + 3] = bad
    name, *options = (codec or "fp32").split()
    fused = FusedRound(0.7, 0.5, codec=None if codec is None else make_codec(
        name, block_size=64, rounding="stochastic" if "stochastic" in options else "nearest"),
        error_feedback="feedback" in options)
    residuals = [torch.full((n,), 0.01), torch.full((n,), 0.02)] if "feedback" in options else None
    generators = [torch.Generator().manual_seed(i) for i in range(2)] if "stochastic" in options else None
    states = None if generators is None else [gen.get_state() for gen in generators]
    assert fused.finite_deltas(g, [p1, p2]) == [True, False]
    assert fused.apply(g, m, [p1, p2], [1.0, 1.0], residuals=residuals, generators=generators) is None
    assert torch.equal(g, torch.ones(n)) and torch.equal(m, torch.full((n,), 0.25)) and torch.equal(p1, torch.zeros(n))
    if residuals is not None:
        assert torch.equal(residuals[0], torch.full((n,), 0.01)) and torch.equal(residuals[1], torch.full((n,), 0.02))
    for gen, state in zip(generators or [], states or [], strict=True):
        assert torch.equal(gen.get_state(), state)


def test_contiguous_parameters_keep_their_values_and_train_as_before() -> None:
    _, _, _, islands, _ = _setup(DiLoCo, 2)
    island, other = islands
    before = island.flat_params()
    assert island.contiguous_params() is None  # separate tensors, as the model built them
    island.make_contiguous()
    flat = island.contiguous_params()
    assert flat is not None and torch.equal(flat, before)
    flat[0] = 7.0  # a view: writing it writes the parameter
    assert float(island.params[0].reshape(-1)[0]) == 7.0
    flat[0] = before[0]
    for step in range(3):  # the same inner steps, bit for bit, as an island whose parameters were left apart
        for i in (island, other):
            i.forward_backward(_batch(0, step))
            i.inner_step()
    assert torch.equal(island.flat_params(), other.flat_params())
    island.params[1].data = island.params[1].data.clone()  # a parameter moved out of the buffer
    assert island.contiguous_params() is None


def test_a_flat_copy_into_a_kept_buffer_equals_a_fresh_one_and_a_buffer_that_does_not_fit_is_refused() -> None:
    """``flat_params(fragment, out=)`` writes the same values a fresh copy holds into the buffer and returns it,
    float32 or bf16 parameters alike; a buffer of another length, dtype or shape is refused in one line."""
    from atoll.algorithms.fragments import FlatFragment

    _, _, _, islands, _ = _setup(DiLoCo, 1)
    island = islands[0]
    n = island.flat_params().numel()
    frag = FlatFragment([(3, n // 2), (n // 2 + 5, n - 1)])
    buffer = torch.full((frag.numel(),), float("nan"))
    assert island.flat_params(frag, out=buffer) is buffer and torch.equal(buffer, island.flat_params(frag))
    with torch.no_grad():
        for p in island.params:
            p.data = p.data.to(torch.bfloat16)
    assert island.flat_params(frag, out=buffer) is buffer and torch.equal(buffer, island.flat_params(frag))
    assert torch.equal(buffer, frag.gather(torch.cat([p.detach().reshape(-1).float() for p in island.params])))
    for bad in (torch.empty(frag.numel() + 1), torch.empty(frag.numel(), dtype=torch.float64),
                torch.empty(frag.numel(), 1), torch.empty(2 * frag.numel())[::2]):
        with pytest.raises(ValueError, match=f"^out: a contiguous 1-D float32 CPU tensor of {frag.numel()} elements"):
            island.flat_params(frag, out=bad)


def _train(outer_kernel: str, poison_at: int | None = None, **codec: object
           ) -> tuple[torch.Tensor, list, object, DiLoCo]:
    """Three islands, H = 3, 4 rounds of the micro model; ``poison_at``: island 1's weights made NaN (its loss
    stays finite) just before that round; ``codec``: the codec's settings (default fp32)."""
    config, model, comm, islands, diloco = _setup(DiLoCo, 3, sync_every=3, outer_kernel=outer_kernel, **codec)
    _train_steps(diloco, islands, 12, poison_at)
    return diloco.outer.params.detach().clone(), islands, comm, diloco


def test_the_compiled_round_gives_the_eager_rounds_model_and_counts_the_same_bytes() -> None:
    eager, eager_islands, eager_comm, eager_run = _train("eager")
    compiled, islands, comm, run = _train("compiled")
    step = float(eager.abs().max())
    # 4 rounds (the first eager: torch's SGD starts the momentum), then the islands' inner steps amplify it
    assert float((compiled - eager).abs().max()) <= 1e-5 * max(step, 1.0)
    for island in islands:  # every island restarted from the new globals, bit for bit
        assert torch.equal(island.flat_params(), compiled)
    assert run.outer.version == eager_run.outer.version == 4
    assert comm.bytes_sent_per_island == eager_comm.bytes_sent_per_island > 0
    assert comm.exchanges == eager_comm.exchanges == 4
    assert comm.clock.comm_busy_s == pytest.approx(eager_comm.clock.comm_busy_s)  # the link's seconds
    assert comm.clock.comm_busy_s > 0
    assert run.summary()["outer_rounds_compiled"] == 3 and "outer_rounds_compiled" not in eager_run.summary()
    assert run.clocks[0].last_sync_step == 12


@pytest.mark.parametrize("codec", [{"codec": "int4"}, {"codec": "int4", "error_feedback": True},
                                   {"codec": "int8", "codec_rounding": "stochastic", "error_feedback": True}])
def test_a_quantized_compiled_round_gives_the_eager_rounds_model_bytes_and_codec_time(codec: dict) -> None:
    eager, _, eager_comm, eager_run = _train("eager", **codec)
    compiled, islands, comm, run = _train("compiled", **codec)
    scale = max(float(eager.abs().max()), 1.0)
    diff = (compiled - eager).abs()
    if codec.get("error_feedback"):
        # one round from the same state gives the codec's integers (test above); over rounds, a last-bit
        # difference of the globals may put a value on the other side of a rounding step, whose difference error
        # feedback then carries: a few elements drift, by less than one step of the codec's rounding
        assert float((diff > 1e-5 * scale).float().mean()) < 1e-3 and float(diff.max()) <= 1e-3 * scale
    else:
        assert float(diff.max()) <= 1e-5 * scale
    for island in islands:
        assert torch.equal(island.flat_params(), compiled)
    assert comm.bytes_sent_per_island == eager_comm.bytes_sent_per_island > 0  # the codec's payload, not fp32's
    assert comm.bytes_sent_per_island < eager_comm.exchanges * 4 * run.numel
    assert comm.exchanges == eager_comm.exchanges == 4
    assert comm.clock.comm_busy_s == pytest.approx(eager_comm.clock.comm_busy_s)
    assert all(s > 0 for s in comm.clock.codec_s)  # the fused loop's seconds, charged as codec time
    assert run.summary()["outer_rounds_compiled"] == 3
    if codec.get("error_feedback"):  # the residuals the compiled rounds kept: the eager rounds', but where the
        # globals' last bits put a value on the other side of a rounding step (or a stochastic draw's threshold)
        for mine, theirs in zip(run.wire.feedback, eager_run.wire.feedback, strict=True):
            near = (mine.residual("all") - theirs.residual("all")).abs() <= 1e-6
            assert float(theirs.residual("all").abs().max()) > 0 and float(near.float().mean()) > 0.99


@pytest.mark.parametrize("codec", [{}, {"codec": "int4"},
                                   {"codec": "int8", "codec_rounding": "stochastic", "error_feedback": True}])
def test_no_round_compiles(codec: dict) -> None:
    """The loops are compiled as the strategy is built, on lengths whose graphs the model's vectors reuse."""
    config, model, comm, islands, diloco = _setup(DiLoCo, 3, sync_every=3, outer_kernel="compiled", **codec)
    assert _graphs_compiled_while_training(diloco, islands, 9) == 0
    assert diloco.compiled_rounds == 2


def test_the_recompile_limit_at_the_start_gives_the_eager_round_with_a_warning(monkeypatch) -> None:
    """A sweep of many settings in one process: torch compiles a function at most 8 times."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    import atoll.algorithms.fused_round as fr

    def limit(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

    monkeypatch.setattr(fr.FusedRound, "warm_up", limit)
    with pytest.warns(RuntimeWarning, match="given up, the eager round from now on: FailOnRecompileLimitHit"):
        diloco = _setup(DiLoCo, 2, outer_kernel="compiled", codec="int4")[4]
    assert diloco.fused is None
    assert diloco.summary()["outer_kernel_skipped"].startswith("FailOnRecompileLimitHit")


def test_a_loop_that_fails_to_compile_mid_round_leaves_the_state_whole(monkeypatch) -> None:
    """The quantized mean's compile failing: nothing written and the draws set back (the eager round then runs as
    if the compiled one never had); the step's failing after the mean wrote the residuals: the round ends
    uncompiled, the same operations, and the strategy gives up."""
    import atoll.algorithms.fused_round as fr

    real = fr._compiled

    def failing(which: str):  # noqa: ANN202
        def compiled(name: str):  # noqa: ANN202
            if name != which:
                return real(name)

            def broken(*args):  # noqa: ANN002, ANN202
                raise RuntimeError("FailOnRecompileLimitHit: Hard failure due to fullgraph=True")

            return broken
        return compiled

    n = 64 * 80 + 5
    lossy = make_codec("int4", block_size=64, rounding="stochastic")
    fused = FusedRound(0.7, 0.5, codec=lossy, error_feedback=True)
    g, m = torch.randn(n), torch.zeros(n)
    parts, residuals = [g + 0.01 * torch.randn(n) for _ in range(2)], [torch.full((n,), 1e-3) for _ in range(2)]
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    saved = [t.clone() for t in (g, m, *parts, *residuals)] + [gen.get_state() for gen in generators]
    monkeypatch.setattr(fr, "_compiled", failing("quantized_means"))
    with pytest.raises(RuntimeError, match="FailOnRecompileLimitHit"):
        fused.apply(g, m, parts, [1.0, 1.0], residuals=residuals, generators=generators)
    after = [g, m, *parts, *residuals] + [gen.get_state() for gen in generators]
    assert all(torch.equal(a, b) for a, b in zip(after, saved, strict=True))

    monkeypatch.setattr(fr, "_compiled", failing("merge"))
    twin = FusedRound(0.7, 0.5, codec=lossy, error_feedback=True)  # the same round, every loop compiled
    g2, m2, parts2, residuals2 = g.clone(), m.clone(), [p.clone() for p in parts], [r.clone() for r in residuals]
    generators2 = [torch.Generator().manual_seed(i) for i in range(2)]
    assert fused.apply(g, m, parts, [1.0, 1.0], residuals=residuals, generators=generators)
    assert fused.given_up is not None and fused.given_up.startswith("RuntimeError: FailOnRecompileLimitHit")
    monkeypatch.setattr(fr, "_compiled", real)
    assert twin.apply(g2, m2, parts2, [1.0, 1.0], residuals=residuals2, generators=generators2)
    assert all(torch.equal(a, b) for a, b in zip(residuals, residuals2, strict=True))  # the mean's, compiled
    torch.testing.assert_close(g, g2, rtol=0, atol=1e-6)  # the step: eager against compiled
    assert all(torch.equal(p, g) for p in parts)


@pytest.mark.parametrize("codec", [{}, {"codec": "int4"}])
def test_an_island_with_weights_that_are_not_finite_is_left_out_as_in_the_eager_round(codec: dict) -> None:
    eager, _, _, eager_run = _train("eager", poison_at=9, **codec)
    compiled, islands, _, run = _train("compiled", poison_at=9, **codec)
    assert eager_run.dropped_updates == run.dropped_updates == 1
    assert run.summary()["outer_rounds_compiled"] == 2  # rounds 2 and 4; round 3 ran eager, without island 1
    assert torch.isfinite(compiled).all()
    assert float((compiled - eager).abs().max()) <= 1e-5 * max(float(eager.abs().max()), 1.0)
    assert all(torch.equal(island.flat_params(), compiled) for island in islands)


def test_the_compiled_round_is_refused_where_it_cannot_run() -> None:
    base = {"strategy": "diloco", "outer_kernel": "compiled"}
    with pytest.raises(ValueError, match="outer_kernel: .*--codec fp32, int8 or int4"):
        TrainConfig(**base, codec="fp8-e4m3")
    with pytest.raises(ValueError, match="codec: the compiled round quantizes int8 and int4 only, not bf16"):
        FusedRound(0.7, 0.9, codec=make_codec("bf16"))
    with pytest.raises(ValueError, match="outer_kernel: .*--outer-adapt none"):
        TrainConfig(**base, outer_adapt="agreement")
    with pytest.raises(ValueError, match="outer_kernel: .*--runtime local"):
        TrainConfig(**base, runtime="collective")
    with pytest.raises(ValueError, match="outer_kernel: .*--device cpu"):
        TrainConfig(**base, device="cuda")
    config, _, _, islands, _ = _setup(DiLoCo, 2, outer_kernel="compiled")

    class Remote:  # a comm of another runtime: one island in this process
        islands, local_islands, in_memory = 2, [0], False

    with pytest.raises(ConfigError, match="outer_kernel: .*--runtime local"):
        DiLoCo(config.strategy_config, islands, Remote(), 0)  # type: ignore[arg-type]


def test_a_compiler_that_fails_is_one_line_at_the_start_and_the_eager_round_after_a_failure_mid_run(
        monkeypatch) -> None:
    import atoll.algorithms.fused_round as fr

    def broken(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found\nmore detail")

    with monkeypatch.context() as m:  # at the start: the run is refused before it trains (exit status 2)
        m.setattr(fr.FusedRound, "warm_up", broken)
        with pytest.raises(ConfigError, match=r"^outer_kernel: torch.compile cannot build the round here "
                                              r"\(RuntimeError: InvalidCxxCompiler: no working C\+\+ compiler "
                                              r"found\); pass --outer-kernel eager$"):
            _setup(DiLoCo, 2, outer_kernel="compiled")
    # mid-run (a recompile limit reached, say): the round runs eager from then on, and the summary says why
    config, model, comm, islands, diloco = _setup(DiLoCo, 2, sync_every=3, outer_kernel="compiled")
    eager = _setup(DiLoCo, 2, sync_every=3)[4]
    monkeypatch.setattr(fr.FusedRound, "apply", broken)
    for step in range(6):
        for island, twin in zip(islands, eager.islands, strict=True):
            island.forward_backward(_batch(island.index, step))
            twin.forward_backward(_batch(twin.index, step))
        with pytest.warns(RuntimeWarning, match="given up") if step == 5 else contextlib.nullcontext():
            diloco.step(step)
        eager.step(step)
    summary = diloco.summary()
    assert summary["outer_rounds_compiled"] == 0
    assert summary["outer_kernel_skipped"].startswith("RuntimeError: InvalidCxxCompiler")
    assert diloco.fused is None and diloco.outer.version == 2
    assert torch.equal(diloco.outer.params, eager.outer.params)  # both rounds eager: the reference's floats
