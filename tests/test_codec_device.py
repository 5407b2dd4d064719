"""The collective runtime's codec exchange stays on the comm's device (issue 25, "the exchange").

``DistComm.start_all_reduce_mean`` with a wire encodes, packs, all-gathers, decodes and averages on
``comm.device``; the wire's random sources and residuals live there too. No GPU here, so:

- on the CPU (gloo's device) the exchange is checked bit for bit against the code before the change, written
  out in this file (payload bytes with their float64 weight header, decoded average, residuals, random
  sources), and against the local runtime's :func:`average_encoded`;
- off the CPU, on the ``meta`` device (shapes only, no data), under a dispatch mode that records every copy
  between the host and the device: the exchange makes one host read, the (K, 8) weight headers, and no other;
- a wire's random sources are made on their tensors' device and their state round-trips.

Islands of one process each are K :class:`DistComm` objects sharing a fake cross-island group whose
``all_gather`` hands every island the shards all of them posted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from atoll.algorithms.codec_base import Codec
from atoll.algorithms.codecs import make_codec
from atoll.algorithms.merge import average_decoded, average_encoded
from atoll.algorithms.wire import ErrorFeedback, Wire
from atoll.runtime.collective.comm import DistComm

CODECS = ["int8", "int4", "fp8-e4m3", "fp8-e5m2"]
SEED = 5


# -------------------------------------------------------------------------------------------------- a fake group


class _Rank:
    """The cross-island group as one island sees it: a board every island posts its shard to, and its index."""

    def __init__(self, board: dict[int, torch.Tensor], rank: int) -> None:
        self.board, self.rank = board, rank


class _Handle:
    def __init__(self, parts: list[torch.Tensor], board: dict[int, torch.Tensor]) -> None:
        self.parts, self.board = parts, board

    def wait(self, timeout: Any = None) -> bool:
        for i, part in enumerate(self.parts):
            part.copy_(self.board[i])
        return True


def _all_gather(parts: list[torch.Tensor], shard: torch.Tensor, group: _Rank, async_op: bool = False) -> _Handle:
    group.board[group.rank] = shard.clone()
    return _Handle(parts, group.board)


@pytest.fixture()
def comms(monkeypatch: pytest.MonkeyPatch):
    """``make(K, device)``: K islands' DistComms over one fake group, and the board of their posted shards."""
    monkeypatch.setattr(dist, "all_gather", _all_gather)

    def make(k: int, device: str = "cpu") -> tuple[list[DistComm], dict[int, torch.Tensor]]:
        board: dict[int, torch.Tensor] = {}
        return [DistComm(k, i, 1, 0, _Rank(board, i), None, torch.device(device)) for i in range(k)], board

    return make


def _inputs(k: int, n: int, rnd: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rnd)
    xs = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g)) * (i + 1) for i in range(k)]
    for x in xs:
        x[::13] = 0.0
    return xs


def _weights(k: int, rnd: int) -> list[float]:
    w = [1.0 + 0.5 * i for i in range(k)]
    if rnd == 1:
        w[k // 2] = 0.0  # not encoded: its residual and random source untouched (one island alone: a NaN mean)
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# -------------------------------------------------------------------------------------------------- the CPU path


class _Before:
    """The exchange as it was before the change, for one island, written out with the codec's primitives: CPU
    random source seeded ``seed * 1_000_003 + island``, residual ``x + r - decode(encode(x + r))``, payload
    ``[float64 weight bytes, packed codec payload]``, and the average of the gathered rows decoded on the CPU
    in island order, each row's weight read with ``float(row[:8].view(float64))``."""

    def __init__(self, codec: Codec, island: int, stochastic: bool, feedback: bool) -> None:
        self.codec, self.feedback = codec, feedback
        self.gen = torch.Generator().manual_seed(SEED * 1_000_003 + island) if stochastic else None
        self.residual: torch.Tensor | None = None

    def payload(self, x: torch.Tensor, w: float) -> torch.Tensor:
        x = x.to("cpu", torch.float32)
        if w == 0.0:
            packed = torch.zeros(self.codec.payload_bytes(x.numel()), dtype=torch.uint8)
        else:
            target = x if self.residual is None else x + self.residual
            enc = self.codec.encode(target, self.gen)
            if self.feedback:
                self.residual = target - self.codec.decode(enc)
            packed = enc.pack().cpu()
        return torch.cat([torch.tensor([w], dtype=torch.float64).view(torch.uint8), packed])

    @staticmethod
    def average(codec: Codec, rows: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
        ws = [float(row[:8].clone().view(torch.float64)) for row in rows]
        if sum(ws) <= 0:
            return torch.full((n,), math.nan), 0.0
        acc = torch.zeros(n, dtype=torch.float32)
        for row, w in zip(rows, ws, strict=True):
            if w != 0.0:
                acc.add_(codec.decode(codec.unpack(row[8:].contiguous(), n)), alpha=w)
        return acc.div_(math.fsum(ws)), sum(ws)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("feedback", [False, True], ids=["no-ef", "ef"])
@pytest.mark.parametrize("k", [1, 3], ids=["1-island", "3-islands"])
def test_the_cpu_exchange_is_bit_for_bit_what_it_was(comms, codec: str, rounding: str, feedback: bool,
                                                     k: int) -> None:
    n, rounds = 1001, 3  # 1001: a partial last block, an odd int4 length and payloads not 8-aligned
    dist_comms, board = comms(k)
    wires = [Wire(codec, [i], rounding=rounding, error_feedback=feedback, seed=SEED) for i in range(k)]
    before = [_Before(wires[0].codec, i, rounding == "stochastic", feedback) for i in range(k)]
    # the local runtime's path: every island in one process, average_encoded
    local = Wire(codec, list(range(k)), rounding=rounding, error_feedback=feedback, seed=SEED)
    for rnd in range(rounds):
        xs, ws = _inputs(k, n, rnd), _weights(k, rnd)
        works = [c.start_all_reduce_mean([x], weights=[w], wire=wire, key="f")
                 for c, x, w, wire in zip(dist_comms, xs, ws, wires, strict=True)]
        expected_rows = [b.payload(x, w) for b, x, w in zip(before, xs, ws, strict=True)]
        for i in range(k):  # what each island sent: the same bytes, weight header included
            assert torch.equal(board[i], expected_rows[i]), (rnd, i)
        expected, weight = _Before.average(wires[0].codec, torch.stack(expected_rows), n)
        local_mean = expected  # no island contributed: nothing encoded, the NaN mean (the local runtime's too)
        if sum(ws) > 0:
            local_mean, _ = average_encoded(xs, local.codec, ws, local.generators_for("cpu"),
                                            feedback=local.feedback, key="f")
        for i, work in enumerate(works):
            mean = work.wait()
            assert mean.device.type == "cpu" and mean.dtype == torch.float32 and mean.shape == (n,)
            assert torch.equal(_bits(mean), _bits(expected)), (rnd, i)
            assert torch.equal(_bits(mean), _bits(local_mean)), (rnd, i)
            assert work.weight == weight
        for i, (wire, b) in enumerate(zip(wires, before, strict=True)):
            if feedback:
                assert torch.equal(_bits(wire.feedback[0].residual("f")), _bits(b.residual)), (rnd, i)
                assert torch.equal(_bits(local.feedback[i].residual("f")), _bits(b.residual)), (rnd, i)
            else:
                assert wire.feedback is None
            if b.gen is not None:
                assert torch.equal(wire.island_state(0)["generator"], b.gen.get_state()), (rnd, i)
                assert torch.equal(local.island_state(i)["generator"], b.gen.get_state()), (rnd, i)


def test_no_island_contributing_gives_nan_on_the_device_and_weight_zero(comms) -> None:
    dist_comms, _ = comms(2)
    wires = [Wire("int8", [i]) for i in range(2)]
    works = [c.start_all_reduce_mean([torch.ones(10)], weights=[0.0], wire=w, key="k")
             for c, w in zip(dist_comms, wires, strict=True)]
    for work in works:
        mean = work.wait()
        assert mean.device.type == "cpu" and mean.shape == (10,) and bool(mean.isnan().all())
        assert work.weight == 0.0


def test_average_decoded_accumulates_where_the_payloads_are() -> None:
    codec = make_codec("int4")
    xs = _inputs(2, 100, 0)
    payloads = [codec.encode(x).pack() for x in xs]
    avg = average_decoded(codec, payloads, 100, [1.0, 3.0])
    assert avg.device.type == "cpu"
    expected = (codec.decode(codec.encode(xs[0])) + 3 * codec.decode(codec.encode(xs[1]))) / 4
    torch.testing.assert_close(avg, expected, rtol=1e-6, atol=1e-6)
    meta = average_decoded(codec, [p.to("meta") for p in payloads], 100, [1.0, 3.0])
    assert meta.device.type == "meta" and meta.shape == (100,) and meta.dtype == torch.float32


# -------------------------------------------------------------------------------------------------- off the CPU


class _HostCopies(TorchDispatchMode):
    """Records every copy between the host and another device (and every scalar read off a device) while
    active. A copy to the host of meta data gives, for the (K, 8) uint8 weight headers, the float64 bytes of
    ``weights``; for anything else zeros (recorded all the same)."""

    def __init__(self, weights: list[float] | None = None) -> None:
        super().__init__()
        self.weights = weights or []
        self.to_host: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.to_device: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.scalar_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
            if src.type != "cpu" and dst.type == "cpu":
                self.to_host.append((tuple(args[0].shape), args[0].dtype))
                return self._fake_host(args[0], kwargs.get("dtype") or args[0].dtype)
            if src.type == "cpu" and dst.type != "cpu":
                self.to_device.append((tuple(args[0].shape), args[0].dtype))
        elif func is torch.ops.aten.copy_.default:
            dst, src = args[0].device, args[1].device
            if src.type != "cpu" and dst.type == "cpu":
                self.to_host.append((tuple(args[1].shape), args[1].dtype))
                return args[0]
            if src.type == "cpu" and dst.type != "cpu":
                self.to_device.append((tuple(args[1].shape), args[1].dtype))
        elif func is torch.ops.aten._local_scalar_dense.default and args[0].device.type != "cpu":
            self.scalar_reads += 1
            return 0
        return func(*args, **kwargs)

    def _fake_host(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype == torch.uint8 and tuple(t.shape) == (len(self.weights), 8):
            return torch.tensor(self.weights, dtype=torch.float64).view(torch.uint8).reshape(-1, 8).clone()
        return torch.zeros(t.shape, dtype=dtype)


@contextmanager
def _watch(weights: list[float] | None = None) -> Iterator[_HostCopies]:
    with _HostCopies(weights) as mode:
        yield mode


@pytest.mark.parametrize("codec", CODECS)
def test_the_exchange_off_the_cpu_reads_only_the_weights_on_the_host(comms, codec: str) -> None:
    """On a device that is not the CPU (meta: the same code, shapes only), encode with error feedback, pack,
    weight header, all-gather, decode and average make no copy to or from the host but one read of the K
    weights; the result and the residual stay on the device. A ``.cpu()`` or ``.to("cpu")`` anywhere in the
    path (of the input, the payload, the gathered rows or the mean) is recorded here and fails the test."""
    k, n = 3, 1001
    dist_comms, _ = comms(k, "meta")
    wires = [Wire(codec, [i], error_feedback=True, seed=SEED) for i in range(k)]
    ws = [1.0, 0.0, 2.0]
    xs = [torch.empty(n, device="meta") for _ in range(k)]
    for rnd in range(2):  # the second round adds the residuals the first one left
        with _watch(ws) as seen:
            works = [c.start_all_reduce_mean([x], weights=[w], wire=wire, key="f")
                     for c, x, w, wire in zip(dist_comms, xs, ws, wires, strict=True)]
            means = [work.wait() for work in works]
        assert seen.to_host == [((k, 8), torch.uint8)] * k, rnd  # one read per island: its K weights
        assert seen.to_device == [] and seen.scalar_reads == 0, rnd
        for mean, work in zip(means, works, strict=True):
            assert mean.device.type == "meta" and mean.shape == (n,) and mean.dtype == torch.float32
            assert work.weight == sum(ws)
        for wire, w in zip(wires, ws, strict=True):
            residual = wire.feedback[0].residual("f")
            assert (residual is None) if w == 0.0 else (residual.device.type == "meta" and residual.shape == (n,))


@pytest.mark.parametrize("codec", [*CODECS, "bf16", "fp16", "topk"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_codecs_encode_pack_unpack_decode_off_the_cpu_without_host_copies(codec: str, rounding: str) -> None:
    c = make_codec(codec, rounding=rounding, block_size=64, topk_fraction=0.1)
    for n in (1, 63, 1001, 4097):
        x = torch.empty(n, device="meta")
        with _watch() as seen:
            enc = c.encode(x)  # stochastic: torch's global source on the device (a meta generator cannot exist)
            buf = enc.pack()
            # a row of gathered payloads behind an 8-byte header: unpacked at an offset that is not 8-aligned
            rows = torch.cat([torch.empty(3, device="meta", dtype=torch.uint8), buf])
            out = c.decode(c.unpack(rows[3:], n))
        assert seen.to_host == [] and seen.to_device == [] and seen.scalar_reads == 0, (codec, n)
        assert buf.device.type == "meta" and buf.shape == (c.payload_bytes(n),)
        assert out.device.type == "meta" and out.shape == (n,) and out.dtype == torch.float32


def test_a_residual_loaded_on_the_cpu_moves_to_the_device_once() -> None:
    codec = make_codec("int8")
    ef = ErrorFeedback(codec)
    ef.load_state_dict({"f": torch.ones(100)})  # as a checkpoint gives it: on the CPU
    x = torch.empty(100, device="meta")
    with _watch() as seen:
        ef.encode("f", x)
    assert seen.to_device == [((100,), torch.float32)]  # the residual, once
    assert ef.residual("f").device.type == "meta"
    with _watch() as seen:
        ef.encode("f", x)
        ef.encode("f", x)
    assert seen.to_device == [] and seen.to_host == []


# -------------------------------------------------------------------------------------------------- random sources


def test_each_random_source_is_made_on_the_device_of_its_first_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.Generator
    made: list[torch.device] = []

    def generator(device: torch.device | str = "cpu") -> torch.Generator:
        made.append(torch.device(device))
        return real(device="cpu")  # the only device here that has one

    wire = Wire("int4", [0, 1], rounding="stochastic", seed=SEED)
    monkeypatch.setattr(torch, "Generator", generator)
    assert made == []  # none made before a tensor says where
    wire.generator(1, torch.device("meta"))
    wire.encode(0, torch.randn(10), "k")
    assert made == [torch.device("meta"), torch.device("cpu")]
    monkeypatch.setattr(torch, "Generator", real)

    wire = Wire("int8", [3], rounding="stochastic", seed=SEED)
    wire.encode(0, torch.randn(10), "k")
    gen = wire.generator(0, "cpu")
    assert gen is not None and gen.device.type == "cpu" and gen.initial_seed() == SEED * 1_000_003 + 3
    with pytest.raises(ValueError, match="random source of local island 0 is on cpu"):
        wire.encode(0, torch.empty(10, device="meta"), "k")
    eager = Wire("int8", [0], rounding="stochastic", device="cpu")
    assert eager.island_state(0)["generator_device"] == "cpu"
    assert Wire("int8", [0]).generator(0, "cpu") is None and Wire("int8", [0]).generators_for("cpu") is None


def _run(wire: Wire, rounds: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for rnd in rounds:
        x = _inputs(1, 1001, rnd)[0]
        payload = wire.encode(0, x, "f").pack()
        out.append((payload, wire.feedback[0].residual("f").clone()))
    return out


@pytest.mark.parametrize("codec", CODECS)
def test_a_resumed_wire_encodes_as_an_uninterrupted_one(codec: str) -> None:
    def make() -> Wire:
        return Wire(codec, [2], rounding="stochastic", error_feedback=True, seed=SEED)

    whole = make()
    expected = _run(whole, range(5))
    first = make()
    _run(first, range(2))
    state = first.island_state(0)
    assert state["generator"].dtype == torch.uint8 and state["generator_device"] == "cpu"
    resumed = make()
    resumed.load_island_state(0, state)
    assert torch.equal(resumed.island_state(0)["generator"], state["generator"])  # kept until made
    got = _run(resumed, range(2, 5))
    for (p, r), (ep, er) in zip(got, expected[2:], strict=True):
        assert torch.equal(p, ep) and torch.equal(_bits(r), _bits(er))
    # loaded into a wire that already drew: the same state again
    first.load_island_state(0, state)
    assert all(torch.equal(p, ep) for (p, _), (ep, _) in zip(_run(first, range(2, 5)), expected[2:], strict=True))
    # a state without a device type (written before it was kept) is a CPU generator's
    legacy = make()
    legacy.load_island_state(0, {k: v for k, v in state.items() if k != "generator_device"})
    assert torch.equal(_run(legacy, range(2, 3))[0][0], expected[2][0])
    # state_dict: the same states, island order
    sd = resumed.state_dict()
    assert sd["generator_devices"] == ["cpu"] and torch.equal(sd["generators"][0],
                                                              resumed.island_state(0)["generator"])


def test_a_random_source_not_used_yet_round_trips_as_its_seed() -> None:
    fresh = Wire("int8", [1], rounding="stochastic", seed=SEED)
    state = fresh.island_state(0)
    assert state["generator"] is None and state["generator_device"] is None
    used = Wire("int8", [1], rounding="stochastic", seed=SEED)
    expected = used.encode(0, torch.randn(200, generator=torch.Generator().manual_seed(0)), "k").pack()
    used.load_island_state(0, state)  # back to the start: the same draws again
    assert torch.equal(used.encode(0, torch.randn(200, generator=torch.Generator().manual_seed(0)), "k").pack(),
                       expected)


def test_a_state_saved_on_another_device_type_seeds_the_source_from_it_with_a_warning() -> None:
    donor = Wire("int8", [0], rounding="stochastic", seed=SEED)
    donor.encode(0, torch.randn(50), "k")
    state = {**donor.island_state(0), "generator_device": "cuda"}  # as if saved from a GPU run
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    payloads = []
    for _ in range(2):
        wire = Wire("int8", [0], rounding="stochastic", seed=SEED)
        wire.load_island_state(0, state)
        with pytest.warns(RuntimeWarning, match="saved on cuda is resumed on cpu"):
            payloads.append(wire.encode(0, x, "k").pack())
    assert torch.equal(payloads[0], payloads[1])  # deterministic
    assert not torch.equal(payloads[0], Wire("int8", [0], rounding="stochastic", seed=SEED).encode(0, x, "k").pack())
