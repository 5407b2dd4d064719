"""Tests for atoll.algorithms.codecs: error bounds, exact byte counts, stochastic rounding, error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from atoll.algorithms.codec_base import Codec
from atoll.algorithms.codecs import CODEC_NAMES, make_codec
from atoll.algorithms.merge import average_encoded
from atoll.algorithms.wire import ErrorFeedback

NUMELS = [0, 1, 2, 3, 7, 63, 64, 65, 127, 128, 129, 1000, 1001, 4097]


def _data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a spread of magnitudes within blocks, plus some exact zeros, as pseudo-gradients have
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    if n > 10:
        x[::11] = 0.0
    return x


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element absmax of the element's block."""
    nb = -(-x.numel() // block)
    pad = torch.cat([x, x.new_zeros(nb * block - x.numel())]).view(nb, block)
    return pad.abs().amax(dim=1).repeat_interleave(block)[: x.numel()]


# -------------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nbytes_equals_payload_bytes(name: str, rounding: str) -> None:
    for block in (16, 64, 100):
        codec = make_codec(name, block_size=block, rounding=rounding, topk_fraction=0.07)
        for n in NUMELS:
            x = _data(n)
            enc = codec.encode(x, generator=torch.Generator().manual_seed(1))
            assert enc.nbytes == codec.payload_bytes(n), (name, block, n)
            assert enc.numel == n and enc.codec == name
            out = codec.decode(enc)
            assert out.dtype == torch.float32 and out.shape == (n,)


@pytest.mark.parametrize(
    ("name", "numel", "expected"),
    [
        ("fp32", 1000, 4000),
        ("bf16", 1000, 2000),
        ("fp16", 1001, 2002),
        ("fp8-e4m3", 1000, 1000 + 16 * 4),
        ("fp8-e5m2", 64, 64 + 4),
        ("int8", 1000, 1000 + 16 * 4),
        ("int8", 65, 65 + 2 * 4),
        ("int4", 1000, math.ceil(1000 / 2) + 16 * 4),
        ("int4", 1001, 501 + 16 * 4),
        ("int4", 1, 1 + 4),
        ("topk", 1000, 10 * (4 + 4)),
        ("topk", 1001, 11 * (4 + 4)),
        ("int4", 0, 0),
        ("topk", 0, 0),
    ],
)
def test_payload_formula_by_hand(name: str, numel: int, expected: int) -> None:
    codec = make_codec(name)  # block 64, topk fraction 0.01
    assert codec.payload_bytes(numel) == expected
    assert codec.encode(_data(numel)).nbytes == expected


def test_topk_k_uses_exact_decimal_fraction() -> None:
    # 0.07 * 100 == 7.000000000000001 in binary floating point; k must still be 7
    codec = make_codec("topk", topk_fraction=0.07)
    assert codec.payload_bytes(100) == 7 * 8
    assert make_codec("topk", topk_fraction=1.0).payload_bytes(5) == 5 * 8


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_pack_unpack_roundtrip(name: str) -> None:
    codec = make_codec(name, rounding="stochastic")
    for n in (0, 1, 65, 1001):
        enc = codec.encode(_data(n), generator=torch.Generator().manual_seed(3))
        buf = enc.pack()
        assert buf.dtype == torch.uint8 and buf.numel() == enc.nbytes
        again = codec.unpack(buf, n)
        assert torch.equal(codec.decode(again), codec.decode(enc))
        # a misaligned buffer still unpacks
        shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), buf])[1:]
        assert torch.equal(codec.decode(codec.unpack(shifted, n)), codec.decode(enc))
    with pytest.raises(ValueError, match="codec"):
        codec.unpack(torch.zeros(3, dtype=torch.uint8), 1001)


# -------------------------------------------------------------------------------------------------- accuracy


def test_fp32_exact() -> None:
    codec = make_codec("fp32")
    x = _data(1001)
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert torch.equal(out, x)
    out += 1  # decode returns a fresh tensor: payload and input are untouched
    assert torch.equal(codec.decode(enc), x)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bf16_fp16_relative_error(rounding: str) -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    # nearest: half an ulp (2^-8 bf16, 2^-11 fp16); stochastic: under one ulp
    for name, half_ulp in (("bf16", 2.0**-8), ("fp16", 2.0**-11)):
        bound = half_ulp if rounding == "nearest" else 2 * half_ulp
        out = make_codec(name, rounding=rounding).decode(
            make_codec(name, rounding=rounding).encode(x, torch.Generator().manual_seed(1))
        )
        normal = x.abs() > 1e-4  # fp16 subnormals have larger relative error
        rel = ((out - x).abs() / x.abs())[normal]
        assert rel.max().item() <= bound, name


@pytest.mark.parametrize("block", [64, 10])
def test_int8_int4_nearest_bound(block: int) -> None:
    x = _data(1003)
    amax = _block_absmax(x, block)
    for name, qmax in (("int8", 127), ("int4", 7)):
        codec = make_codec(name, block_size=block)
        err = (codec.decode(codec.encode(x)) - x).abs()
        bound = amax / qmax / 2
        assert torch.all(err <= bound * (1 + 1e-5) + 1e-30), name
        # the block's absmax element is reproduced (up to fp32 rounding)
        i = int(x.abs().argmax())
        assert abs(codec.decode(codec.encode(x))[i] - x[i]) <= 1e-6 * abs(x[i])


def test_int_zero_block_and_tiny_values() -> None:
    x = torch.zeros(130)
    x[100] = 1e-30
    for name in ("int8", "int4", "fp8-e4m3", "fp8-e5m2"):
        codec = make_codec(name)
        out = codec.decode(codec.encode(x))
        assert torch.all(out[:64] == 0) and torch.isfinite(out).all(), name


@pytest.mark.parametrize(
    ("name", "mantissa_bits", "subnormal_spacing"),
    [("fp8-e4m3", 3, 2.0**-9), ("fp8-e5m2", 2, 2.0**-16)],
)
def test_fp8_relative_error(name: str, mantissa_bits: int, subnormal_spacing: float) -> None:
    x = _data(2000)
    codec = make_codec(name)
    enc = codec.encode(x)
    scale = enc.tensors["scales"].repeat_interleave(64)[: x.numel()]
    err = (codec.decode(enc) - x).abs()
    # round-to-nearest: half an ulp relative for normals, half the subnormal spacing (in scaled units) below
    bound = 2.0 ** -(mantissa_bits + 1) * x.abs() + subnormal_spacing / 2 * scale
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-30)
    # the block absmax maps to the format's largest value
    fmax = torch.finfo(enc.tensors["values"].dtype).max
    assert torch.allclose(enc.tensors["scales"][0] * fmax, x[:64].abs().max())


def test_topk_keeps_largest_exactly() -> None:
    x = _data(1000)
    codec = make_codec("topk", topk_fraction=0.05)
    enc = codec.encode(x)
    out = codec.decode(enc)
    k = 50
    kept = torch.topk(x.abs(), k).indices
    assert torch.equal(out[kept], x[kept])
    mask = torch.ones(1000, dtype=torch.bool)
    mask[kept] = False
    assert torch.all(out[mask] == 0)
    assert enc.tensors["indices"].dtype == torch.int32 and enc.tensors["values"].dtype == torch.float32
    assert torch.all(enc.tensors["indices"][1:] > enc.tensors["indices"][:-1])  # sorted ascending


def test_int4_packing_layout() -> None:
    codec = make_codec("int4", block_size=4)
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, 2.0])  # block 0 absmax 7 -> scale 1; block 1 absmax 2
    enc = codec.encode(x)
    v = enc.tensors["values"]
    assert v.dtype == torch.uint8 and v.numel() == 3
    assert int(v[0]) == (7 + 8) | ((-7 + 8) << 4)
    assert int(v[1]) == (0 + 8) | ((1 + 8) << 4)
    assert int(v[2]) == (7 + 8) | (8 << 4)  # last element 2.0 -> q 7, pad nibble 8 (zero)
    assert torch.equal(codec.decode(enc), x)


# -------------------------------------------------------------------------------------------------- stochastic


@pytest.mark.parametrize("name", ["int8", "int4", "fp8-e4m3", "fp8-e5m2", "bf16", "fp16"])
def test_stochastic_rounding_unbiased_and_deterministic(name: str) -> None:
    codec = make_codec(name, rounding="stochastic", block_size=32)
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    if name in ("bf16", "fp16"):
        x = 1 + x * 1e-2  # make the rounding step visible
    draws = 2000
    g = torch.Generator().manual_seed(42)
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        total += codec.decode(codec.encode(x, generator=g)).double()
    mean = (total / draws).float()
    nearest = make_codec(name, block_size=32)
    step = (nearest.decode(nearest.encode(x)) - x).abs().max().item() * 2  # about one quantization step
    # the mean error of a {lo, hi} draw shrinks like step / sqrt(draws); nearest rounding errs up to step/2
    assert (mean - x).abs().max().item() < 5 * step / math.sqrt(draws)
    assert (mean - x).abs().mean().item() < 0.2 * (nearest.decode(nearest.encode(x)) - x).abs().mean().item()

    a = codec.encode(x, generator=torch.Generator().manual_seed(7))
    b = codec.encode(x, generator=torch.Generator().manual_seed(7))
    c = codec.encode(x, generator=torch.Generator().manual_seed(8))
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert not all(torch.equal(a.tensors[k], c.tensors[k]) for k in a.tensors)


def _all_finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8- or 16-bit float format, sorted, as float32."""
    if dtype.itemsize == 1:
        codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    else:
        codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = codes.view(dtype).float()
    return torch.unique(values[torch.isfinite(values)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_stochastic_float_lands_on_a_neighbour(dtype: torch.dtype) -> None:
    from atoll.algorithms.quantize import _round_float

    grid = _all_finite_values(dtype)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(20000, generator=g) * torch.exp(torch.randn(20000, generator=g) * 5)
    y = torch.cat([y, grid[:5], grid[-5:], torch.tensor([0.0, 1e-40, -1e-40])]).clamp(grid[0], grid[-1])
    q = _round_float(y, dtype, "stochastic", g).float()
    idx = torch.searchsorted(grid, y, right=True).clamp(1, grid.numel() - 1)
    lo, hi = grid[idx - 1], grid[idx]
    assert torch.all((q == lo) | (q == hi))
    exact = lo == y
    assert torch.equal(q[exact], y[exact])  # representable values are kept


def test_stochastic_int_stays_on_neighbours() -> None:
    codec = make_codec("int8", rounding="stochastic", block_size=8)
    x = _data(800)
    amax = _block_absmax(x, 8)
    for seed in range(5):
        err = (codec.decode(codec.encode(x, torch.Generator().manual_seed(seed))) - x).abs()
        assert torch.all(err <= amax / 127 * (1 + 1e-5) + 1e-30)


# -------------------------------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name", ["int4", "topk", "fp8-e5m2", "int8"])
def test_error_feedback_tracks_sum(name: str) -> None:
    codec = make_codec(name, topk_fraction=0.05)
    ef = ErrorFeedback(codec)
    g = torch.Generator().manual_seed(0)
    sum_in = torch.zeros(500)
    sum_out = torch.zeros(500)
    sum_out_plain = torch.zeros(500)
    steps = 200
    for _ in range(steps):
        x = torch.randn(500, generator=g) + 0.1  # a consistent bias that plain top-k would mostly drop
        sum_in += x
        sum_out += codec.decode(ef.encode("frag0", x))
        sum_out_plain += codec.decode(codec.encode(x))
    residual = ef.residual("frag0")
    assert residual is not None
    # exact identity: what was not sent is the residual
    assert torch.allclose(sum_in - sum_out, residual, atol=1e-3)
    # bounded: the gap does not grow with the number of steps
    assert (sum_in - sum_out).abs().max() < 0.1 * steps
    if name == "topk":
        assert (sum_in - sum_out).abs().mean() < 0.2 * (sum_in - sum_out_plain).abs().mean()


def test_error_feedback_state_dict_and_keys() -> None:
    codec = make_codec("int4")
    ef = ErrorFeedback(codec)
    x = _data(100)
    ef.encode("a", x)
    ef.encode("b", x[:10])
    sd = ef.state_dict()
    assert set(sd) == {"a", "b"} and sd["a"].dtype == torch.float32 and sd["a"].shape == (100,)
    ef2 = ErrorFeedback(codec)
    ef2.load_state_dict(sd)
    y = _data(100, seed=1)
    assert torch.equal(ef.encode("a", y).tensors["values"], ef2.encode("a", y).tensors["values"])
    with pytest.raises(ValueError, match="error_feedback"):
        ef.encode("b", x)  # residual of 10 elements, tensor of 100
    ef.reset("b")
    ef.encode("b", x)
    ef.reset()
    assert ef.state_dict() == {}
    lossless = ErrorFeedback(make_codec("fp32"))
    lossless.encode("a", x)
    assert lossless.state_dict() == {}


# -------------------------------------------------------------------------------------------------- averaging


def test_average_encoded_fp32_is_mean_and_weighted_mean() -> None:
    xs = [_data(300, seed=s) for s in range(3)]
    codec = make_codec("fp32")
    avg, nbytes = average_encoded(xs, codec)
    assert torch.allclose(avg, torch.stack(xs).mean(0), rtol=1e-6, atol=1e-6)
    assert nbytes == 300 * 4 and avg.dtype == torch.float32
    w = [1.0, 3.0, 0.0]
    avg_w, _ = average_encoded(xs, codec, weights=w)
    assert torch.allclose(avg_w, (xs[0] + 3 * xs[1]) / 4, rtol=1e-6, atol=1e-6)


def test_average_encoded_quantized_and_feedback() -> None:
    xs = [_data(300, seed=s) for s in range(4)]
    codec = make_codec("int8", rounding="stochastic")
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    avg, nbytes = average_encoded(xs, codec, generators=gens)
    expected = torch.stack(
        [codec.decode(codec.encode(x, torch.Generator().manual_seed(i))) for i, x in enumerate(xs)]
    ).mean(0)
    assert torch.allclose(avg, expected, atol=1e-6)
    assert nbytes == codec.payload_bytes(300) == 300 + 5 * 4
    efs = [ErrorFeedback(codec) for _ in xs]
    average_encoded(xs, codec, feedback=efs, key="f0")
    assert all(ef.residual("f0") is not None for ef in efs)


@pytest.mark.parametrize("name", ["int4", "int8", "fp8-e4m3", "fp32", "bf16", "topk"])
def test_range_decoder_and_chunked_average_give_the_whole_tensor_floats(name: str) -> None:
    """The ranges cover the payload in order and decode to decode()'s floats; average_encoded (range by range),
    and error feedback (its residual range by range) give, bit for bit, the whole-tensor passes' floats."""
    n = (1 << 18) * 2 + 64 * 3 + 1  # three chunks of the block codecs on the CPU, the last block partial
    xs = [_data(n, seed=s) for s in range(3)]
    codec = make_codec(name, rounding="stochastic" if name != "topk" else "nearest")
    enc = codec.encode(xs[0], torch.Generator().manual_seed(0))
    ranges, fn = codec.range_decoder(enc)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    if name in ("int4", "int8", "fp8-e4m3"):
        assert len(ranges) == 3
    out = torch.empty(n)
    for a, b in ranges:
        fn(a, b, out[a:b])
    assert torch.equal(out, codec.decode(enc))
    weights = [1000.0, 0.0, 3000.0]
    avg, _ = average_encoded(xs, codec, weights, [torch.Generator().manual_seed(i) for i in range(3)])
    expected = torch.zeros(n)
    for i, (x, w) in enumerate(zip(xs, weights, strict=True)):
        if w:
            expected.add_(codec.decode(codec.encode(x, torch.Generator().manual_seed(i))), alpha=w)
    assert torch.equal(avg, expected.div_(sum(weights)))
    feedback, residual = ErrorFeedback(codec), torch.zeros(n)
    for step in range(2):  # the first encode (no residual yet) and the next (x + residual)
        target = xs[step] + residual
        sent = codec.decode(feedback.encode("k", xs[step]))
        residual = target - sent
        if not codec.lossless:
            assert torch.equal(feedback.residual("k"), residual)


def test_average_encoded_errors() -> None:
    codec = make_codec("bf16")
    with pytest.raises(ValueError, match="islands"):
        average_encoded([], codec)
    with pytest.raises(ValueError, match="islands"):
        average_encoded([torch.zeros(3), torch.zeros(4)], codec)
    with pytest.raises(ValueError, match="weights"):
        average_encoded([torch.zeros(3)], codec, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="weights"):
        average_encoded([torch.zeros(3), torch.zeros(3)], codec, weights=[0.0, 0.0])
    with pytest.raises(ValueError, match="weights"):
        average_encoded([torch.zeros(3), torch.zeros(3)], codec, weights=[-1.0, 2.0])


# -------------------------------------------------------------------------------------------------- errors


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="codec") as info:
        make_codec("int3")
    assert "int4" in str(info.value) and isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="rounding"):
        make_codec("int8", rounding="up")
    with pytest.raises(ValueError, match="block_size"):
        make_codec("int8", block_size=0)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="topk_fraction"):
            make_codec("topk", topk_fraction=bad)
    codec: Codec = make_codec("int8")
    with pytest.raises(ValueError, match="codec"):
        codec.encode(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="codec"):
        codec.encode(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="codec"):
        make_codec("int4").decode(codec.encode(torch.zeros(3)))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_into_writes_what_decode_returns_into_a_view(name: str) -> None:
    """decode_into (the syncer decodes each slice of a push straight into its place in the fragment) writes
    exactly decode's values into a view of a larger tensor, leaving the rest untouched, for every codec and a
    length that ends in a partial block; an out of the wrong length or dtype is refused."""
    codec = make_codec(name, block_size=64)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    enc = codec.encode(x)
    big = torch.full((1300,), 7.0)
    codec.decode_into(enc, big[150:1150])
    assert torch.equal(big[150:1150], codec.decode(enc))
    assert bool((big[:150] == 7.0).all()) and bool((big[1150:] == 7.0).all())
    with pytest.raises(ValueError, match="decode_into"):
        codec.decode_into(enc, torch.empty(999))
    with pytest.raises(ValueError, match="decode_into"):
        codec.decode_into(enc, torch.empty(1000, dtype=torch.float64))


@pytest.mark.parametrize("name", ["int4", "int8", "bf16"])
def test_decoded_chunks_are_the_decode_range_by_range(name: str) -> None:
    codec = make_codec(name)
    x = torch.randn(3 * (1 << 18) + 100, generator=torch.Generator().manual_seed(0))
    enc = codec.encode(x)
    chunks = [(a, b, v.clone()) for a, b, v in codec.decoded_chunks(enc)]
    assert (len(chunks) > 1) == (name != "bf16")  # the block codecs on the CPU: several ranges
    assert [a for a, _, _ in chunks] == [0] + [b for _, b, _ in chunks[:-1]] and chunks[-1][1] == x.numel()
    assert torch.equal(torch.cat([v for _, _, v in chunks]), codec.decode(enc))
    assert list(codec.decoded_chunks(codec.encode(torch.empty(0)))) == []
