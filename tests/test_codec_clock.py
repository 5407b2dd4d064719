"""The block-scaled codecs' chunked passes (bit for bit what the earlier whole-tensor code gave, with less memory
traffic), and the codec's encode and decode seconds charged on the simulated clock."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from atoll.algorithms.codecs import make_codec
from atoll.algorithms.merge import CodecTimes, average_encoded
from atoll.algorithms.quantize import _round_float
from atoll.algorithms.wire import Wire
from atoll.runtime.local import LocalComm
from atoll.runtime.network import ClockTrace, Link, SimClock, replay

BLOCK_CODECS = ("int8", "int4", "fp8-e4m3", "fp8-e5m2")
_FP8 = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


# --- the earlier whole-tensor implementation (before the chunked passes), kept as the reference -------------
def _ref_encode(name: str, x: torch.Tensor, block: int, rounding: str,
                gen: torch.Generator | None) -> dict[str, torch.Tensor]:
    n = x.numel()
    nb = -(-n // block)
    xb = torch.cat([x, x.new_zeros(nb * block - n)]).view(nb, block)
    vmax = float(torch.finfo(_FP8[name]).max) if name in _FP8 else float(2 ** (int(name[3:]) - 1) - 1)
    scale = xb.abs().amax(dim=1) / vmax if xb.numel() else xb.new_zeros(nb)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (xb / safe.unsqueeze(1)).reshape(-1)[:n]
    if name in _FP8:
        return {"scales": scale, "values": _round_float(y.clamp_(-vmax, vmax), _FP8[name], rounding, gen)}
    rand = torch.rand(y.shape, generator=gen, dtype=torch.float32) if rounding == "stochastic" else None
    q = (torch.round(y) if rand is None else torch.floor(y + rand)).clamp_(-vmax, vmax)
    if name == "int8":
        return {"scales": scale, "values": q.to(torch.int8)}
    nib = (q + 8).to(torch.uint8)
    if nib.numel() % 2:
        nib = torch.cat([nib, nib.new_full((1,), 8)])
    pairs = nib.view(-1, 2)
    return {"scales": scale, "values": (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous()}


def _ref_decode(name: str, tensors: dict[str, torch.Tensor], n: int, block: int) -> torch.Tensor:
    v = tensors["values"]
    q = torch.stack([v & 0x0F, v >> 4], dim=1).reshape(-1)[:n].float() - 8.0 if name == "int4" else v.float()
    nb = -(-n // block)
    qb = torch.cat([q, q.new_zeros(nb * block - n)]).view(nb, block)
    return (qb * tensors["scales"].float().unsqueeze(1)).reshape(-1)[:n].contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", BLOCK_CODECS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_chunked_codecs_match_the_whole_tensor_code_bit_for_bit(name: str, rounding: str) -> None:
    """Payload bytes and decoded values equal the earlier code's, for sizes around the blocks, the odd int4
    pad nibble and the CPU chunk boundary (2**18 elements), with zero blocks, -0.0 and values spanning 1e-9..1e4."""
    g = torch.Generator().manual_seed(0)
    for n, block in itertools.product([0, 1, 2, 63, 65, 1000, 2**18 - 1, 2**18 + 5, 600_001], [1, 7, 64, 300_000]):
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
        x[:3], x[5:9], x[64:200] = -0.0, 0.0, 0.0
        codec = make_codec(name, block_size=block, rounding=rounding)
        enc = codec.encode(x, torch.Generator().manual_seed(7))
        ref = _ref_encode(name, x, block, rounding, torch.Generator().manual_seed(7))
        for key in ("scales", "values"):
            assert enc.tensors[key].dtype == ref[key].dtype, (n, block, key)
            assert torch.equal(_bits(enc.tensors[key]), _bits(ref[key])), (n, block, key)
        decoded = codec.decode(codec.unpack(enc.pack(), n))
        assert torch.equal(_bits(decoded), _bits(_ref_decode(name, ref, n, block))), (n, block)


def _allocated_bytes(fn) -> int:
    """Bytes that ``fn()``'s CPU operators allocated, summed (what the profiler attributes to each operator)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.key_averages())


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_codecs_allocate_less_than_float32_copies_of_the_input(name: str) -> None:
    """Memory traffic, the cost the chunked passes remove (not a timing): encoding 4e6 float32 values allocates
    less than one float32 copy of them (the earlier code allocated about five), decoding less than two (the
    output, plus per-chunk scratch; the earlier code about four)."""
    n = 4_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    codec = make_codec(name)
    enc = codec.encode(x)
    assert _allocated_bytes(lambda: codec.encode(x)) < 4 * n
    assert _allocated_bytes(lambda: codec.decode(enc)) < 2 * 4 * n


# --- codec seconds on the simulated clock -------------------------------------------------------------------
class FakeTimer:
    """A clock that advances ``step`` seconds at every reading."""

    def __init__(self, step: float) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_average_encoded_reports_each_islands_encode_and_decode_seconds() -> None:
    codec = make_codec("int8")
    xs = [torch.randn(100), torch.randn(100), torch.randn(100)]
    times = CodecTimes(FakeTimer(0.5))
    average_encoded(xs, codec, weights=[1.0, 0.0, 2.0], times=times)
    assert times.encode_s == [0.5, 0.0, 0.5]  # the island of weight 0 encodes nothing
    assert times.decode_s == [0.5, 0.0, 0.5]


def test_local_comm_charges_codec_seconds_on_the_clock_not_as_compute() -> None:
    """With a fake timer (each reading 0.25 s later), each of 2 islands' clock advances by its encode (0.25 s)
    before the collective and by decoding both payloads (0.5 s) after it: 0.75 s over the link's time; the
    trace records them, so a re-timed run keeps them; an fp32 exchange charges none."""
    link = Link(bandwidth_bps=8e6, latency_s=0.0)
    clock = SimClock(2, trace=ClockTrace(2))
    comm = LocalComm(2, link, clock)
    comm.timer = FakeTimer(0.25)
    wire = Wire("int8", [0, 1])
    x = [torch.randn(1000), torch.randn(1000)]
    comm.all_reduce_mean(x, wire=wire, key="k")
    transfer = link.allreduce_seconds(wire.codec.payload_bytes(1000), 2)  # type: ignore[union-attr]
    assert clock.codec_s == [0.75, 0.75]
    assert clock.island_time == pytest.approx([0.25 + transfer + 0.5] * 2)
    comm.all_reduce_mean(x)  # no codec: no codec seconds
    assert clock.codec_s == [0.75, 0.75]
    again = replay(clock.trace.to_dict(), link)  # type: ignore[union-attr]
    assert again["sim_wall_s"] == pytest.approx(clock.wall_s)
    assert again["codec_s"] == 0.75 and again["compute_s"] == 0.0
    state = clock.state_dict()
    restored = SimClock(2)
    restored.load_state_dict(state)
    assert restored.codec_s == [0.75, 0.75]


def test_overlapped_exchange_charges_decode_when_waited_for() -> None:
    """A started (overlapped) exchange charges the encode at once and the decode only at its wait, once."""
    clock = SimClock(2)
    comm = LocalComm(2, Link(bandwidth_bps=1e12, latency_s=0.0), clock)
    comm.timer = FakeTimer(1.0)
    work = comm.start_all_reduce_mean([torch.randn(64), torch.randn(64)], wire=Wire("int4", [0, 1]), key="k")
    assert clock.codec_s == [1.0, 1.0]
    clock.compute(0, 10.0)
    clock.compute(1, 10.0)
    work.wait()
    work.wait()
    assert clock.codec_s == [3.0, 3.0]
    assert clock.island_time == pytest.approx([13.0, 13.0])


def test_codec_speed_bench_writes_throughputs_and_link_ratios(tmp_path) -> None:
    """bench/codec_speed.py: a row per codec with its payload ratio, GB/s and codec seconds per link second
    (consistent with each other); an unknown codec is bad input (exit status 2)."""
    import json

    from bench.codec_speed import main

    assert main(["--numel", "1000", "--repeats", "1", "--codecs", "int4,int8", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["codec"] for r in rows] == ["int4", "int8"]
    int4 = rows[0]
    assert int4["payload_bytes"] == make_codec("int4").payload_bytes(1000) == 500 + 4 * 16
    link_s = int4["payload_bytes"] * 8 / 10e9
    assert int4["per_link_s_10"] == pytest.approx((int4["encode_s"] + int4["decode_s"]) / link_s)
    assert int4["encode_gbps"] == pytest.approx(4000 / 1e9 / int4["encode_s"])
    assert "| int4 |" in (tmp_path / "results.md").read_text()
    assert main(["--codecs", "int5", "--out", str(tmp_path)]) == 2


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_decode_into_an_odd_offset_and_average_encoded_into_kept_buffers_give_the_same_floats(name: str) -> None:
    """decode_into a view at an odd offset (int4's pairwise lookup falls back to one float at a time) equals
    decode, bit for bit; average_encoded into the caller's buffers (``out``, ``scratch``, dirty from an earlier
    exchange) equals it into fresh ones."""
    codec = make_codec(name)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2**18 + 77, generator=g) for _ in range(2)]
    enc = codec.encode(xs[0])
    into = torch.empty(xs[0].numel() + 2)[1:-1]
    codec.decode_into(enc, into)
    assert torch.equal(_bits(into), _bits(codec.decode(enc)))
    fresh, nbytes = average_encoded(xs, codec, [1.0, 3.0])
    out, scratch = torch.full_like(xs[0], 5.0), torch.full_like(xs[0], -2.0)
    kept, kept_bytes = average_encoded(xs, codec, [1.0, 3.0], out=out, scratch=scratch)
    assert kept is out and kept_bytes == nbytes and torch.equal(_bits(kept), _bits(fresh))
