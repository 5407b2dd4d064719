"""The bulk connections' flow-control windows (atoll.runtime.service.flow) and the payloads read without a copy
(atoll.runtime.service.wire.view_tensors)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from atoll.config.runtimes import ServiceConfig
from atoll.runtime.service import flow, wire


def test_bdp_is_rate_times_round_trip() -> None:
    assert flow.bdp_bytes(1000, 70) == 8_750_000  # 125e6 B/s x 0.07 s
    assert flow.bdp_bytes(2000, 35) == flow.bdp_bytes(1000, 70)
    assert flow.bdp_bytes(10, 100) == 125_000
    for bad in ((0, 70), (1000, 0), (-1, 5)):
        with pytest.raises(ValueError):
            flow.bdp_bytes(*bad)


def test_window_is_clamped_to_http2_limits() -> None:
    assert flow.window_bytes(8) == 8 << 20
    assert flow.window_bytes(0.5) == 1 << 19
    assert flow.window_bytes(1e-9) == flow.MIN_WINDOW  # never below gRPC's default
    assert flow.window_bytes(4096) == flow.MAX_WINDOW == (1 << 31) - 1
    with pytest.raises(ValueError):
        flow.window_bytes(0)


def test_bulk_options_start_streams_at_the_window_and_keep_the_bdp_probe() -> None:
    opts = dict(flow.bulk_options(flow.window_bytes(8)))
    assert opts == {"grpc.http2.lookahead_bytes": 8 << 20, "grpc.http2.bdp_probe": 1}
    with pytest.raises(ValueError):
        flow.bulk_options(flow.MAX_WINDOW + 1)


def test_the_setting_covers_a_1_gbit_70_ms_links_bdp_shared_by_two_ranks() -> None:
    default = ServiceConfig.model_fields["bulk_window_mib"].default
    assert 2 * flow.window_bytes(default) >= flow.bdp_bytes(1000, 70)


@pytest.mark.parametrize("tensors", [
    {"t": torch.randn(1000)},
    {"values": torch.randint(0, 255, (77,), dtype=torch.uint8), "scales": torch.randn(3, dtype=torch.float16),
     "indices": torch.arange(5, dtype=torch.int64)},
    {"t": torch.empty(0)},
    {"m": torch.randn(4, 6, dtype=torch.bfloat16), "z": torch.zeros(0, dtype=torch.int32)},
])
def test_view_tensors_reads_what_safetensors_reads_bit_for_bit(tensors: dict[str, torch.Tensor]) -> None:
    data = st_save(tensors)
    ours, theirs = wire.view_tensors(bytearray(data)), st_load(data)
    assert ours.keys() == theirs.keys()
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and ours[k].shape == t.shape
        assert ours[k].view(torch.uint8).tolist() == t.view(torch.uint8).tolist()  # bit-identical


@pytest.mark.parametrize("tensors", [
    {"t": torch.randn(1000)},
    {"values": torch.randint(0, 255, (77,), dtype=torch.uint8), "scales": torch.randn(3, dtype=torch.float16),
     "indices": torch.arange(5, dtype=torch.int64)},
    {"t": torch.empty(0)},
    {},  # (an up-to-date island's delta pull: the header alone)
    {"a": torch.randn(5, dtype=torch.bfloat16), "b": torch.ones(2, 3, dtype=torch.bool), "c": torch.randn(2).double(),
     "d": torch.arange(4, dtype=torch.int16), "e": torch.arange(3, dtype=torch.int32), "f": torch.randn(4).half(),
     "0.values": torch.randint(-128, 127, (9,), dtype=torch.int8), "1.scales": torch.randn(2)[1:]},
    {"values": torch.randn(7).to(torch.float8_e4m3fn), "v2": torch.randn(3).to(torch.float8_e5m2),
     "scales": torch.randn(1), "é": torch.zeros(1)},  # (the fp8 codecs' payloads; a name not in ASCII)
])
def test_save_writes_safetensors_own_bytes_and_reads_back_as_views(tensors: dict[str, torch.Tensor]) -> None:
    """:func:`wire.save` (torch's copies, which release the GIL) writes the file ``safetensors.torch.save`` writes,
    byte for byte (header, order of the tensors, padding), for every dtype a payload or a pull uses; its
    ``memoryview`` is read back as views (no copy) and chunked into ``bytes``."""
    ours = wire.save(tensors)
    assert isinstance(ours, memoryview) and ours.format == "B" and bytes(ours) == st_save(tensors)
    back = wire.view_tensors(ours)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.contiguous().view(torch.uint8))
    pieces = wire.chunks(ours)
    assert all(type(c) is bytes for c in pieces) and b"".join(pieces) == st_save(tensors)


@pytest.mark.parametrize("tensors", [
    {"values": torch.randn(700_001)},  # (chunks cut inside the tensor, the last one short)
    {"values": torch.randint(0, 255, (wire.CHUNK_BYTES + 3,), dtype=torch.uint8), "scales": torch.randn(9),
     "indices": torch.arange(5, dtype=torch.int64)},  # (a chunk spanning two tensors)
    {"values": torch.randn(7).to(torch.float8_e4m3fn), "é": torch.zeros(1)},
    {},
])
def test_a_payload_is_read_from_its_tensors_as_safetensors_bytes_from_any_offset(
        tensors: dict[str, torch.Tensor]) -> None:
    """A push's :class:`wire.Payload` (no copy of the whole file before its first byte leaves) has the length of
    ``safetensors.torch.save``'s file and chunks into its bytes from any offset (a retry resumes where the syncer's
    copy ends), each chunk a ``bytes`` of at most CHUNK_BYTES."""
    want = st_save(tensors)
    payload = wire.payload_bytes(tensors)
    assert isinstance(payload, wire.Payload) and len(payload) == len(want) and payload.tobytes() == want
    for offset in {0, 1, 8, len(payload.head), wire.CHUNK_BYTES - 1, wire.CHUNK_BYTES, len(want) - 1, len(want)}:
        if offset > len(want):
            continue
        pieces = wire.chunks(payload, offset)
        assert all(type(c) is bytes and 0 < len(c) <= wire.CHUNK_BYTES for c in pieces)
        assert b"".join(pieces) == want[offset:]


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int8", "int4", "topk"])
def test_every_push_codecs_payload_crosses_the_wire_and_decodes_the_same(name: str) -> None:
    """Every codec a run may push with (the fp8 ones included: their float8 tensors are safetensors' F8 dtypes)
    is written by :func:`wire.save` and read back by the syncer's check as the same payload."""
    from atoll.algorithms.codecs import make_codec

    codec, x = make_codec(name), torch.randn(1000, generator=torch.Generator().manual_seed(0))
    sent = codec.encode(x)
    got = wire.bytes_payload(bytearray(wire.payload_bytes(sent.tensors).tobytes()), codec, 1000)
    assert torch.equal(codec.decode(got), codec.decode(sent))


def test_view_tensors_is_a_view_of_the_bytes_not_a_copy() -> None:
    buf = bytearray(wire.tensor_bytes(torch.arange(8, dtype=torch.float32)))
    t = wire.bytes_tensor(buf)
    assert t.tolist() == [float(i) for i in range(8)]
    buf[-4:] = torch.tensor([42.0]).numpy().tobytes()
    assert t[-1].item() == 42.0
    with pytest.raises(BufferError):  # the tensor holds the bytes: they cannot be resized under it
        buf += b"x"


def _file(header: dict, body: bytes) -> bytearray:
    h = json.dumps(header).encode()
    return bytearray(len(h).to_bytes(8, "little") + h + body)


@pytest.mark.parametrize("data", [
    bytearray(b"\x01\x02"),
    bytearray((10 ** 9).to_bytes(8, "little") + b"{}"),  # a header longer than the file
    _file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),  # shorter body
    _file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12),  # bytes left over
    _file({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),  # shape and offsets differ
    _file({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
    _file({"t": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),  # an unknown dtype
    _file({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
           "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6),  # overlapping
    _file({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 4),  # a gap
    _file({"t": "F32"}, b""),
    bytearray((2).to_bytes(8, "little") + b"[]"),  # a header that is no JSON object
])
def test_view_tensors_refuses_malformed_files(data: bytearray) -> None:
    with pytest.raises(ValueError, match="not a safetensors payload|expected a JSON object"):
        wire.view_tensors(data)


def test_iter_chunks_are_the_chunks() -> None:
    data = bytes(range(256)) * (3 * wire.CHUNK_BYTES // 256 + 5)
    for offset in (0, 17, wire.CHUNK_BYTES, len(data)):
        assert list(wire.iter_chunks(data, offset)) == wire.chunks(data, offset)
        assert b"".join(wire.iter_chunks(data, offset)) == data[offset:]


@pytest.fixture()
def served(fast_config: dict, tmp_path):  # noqa: ANN001, ANN201 - (server state, port): plaintext, in this process
    from concurrent import futures

    import grpc

    from atoll.config import build_config
    from atoll.runtime.service.server import SyncerServer

    settings = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
    config = build_config(None, {**settings, "strategy": "decoupled", "runtime": "service", "fragments": 2,
                                 "codec": "fp32", "pull_codec": "fp32"})  # (pulls by ranges: float32 slices)
    state = SyncerServer.of_run(config, tmp_path / "syncer", ["a" * 32, "b" * 32])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[state.handler()],
                         options=flow.bulk_options(flow.window_bytes(8)))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield state, port
    server.stop(grace=0)


def test_slices_over_windowed_connections_arrive_and_reassemble_bit_identical(served) -> None:  # noqa: ANN001
    from atoll.algorithms.fragments import FlatFragment
    from atoll.runtime.service.client import SyncerClient
    from atoll.runtime.service.slices import even_parts

    state, port = served
    numels = state.service.syncer.numels
    window = flow.window_bytes(8)
    ranks = [SyncerClient(f"127.0.0.1:{port}", 0, "a" * 32, plaintext=True, control=r == 0, window=window)
             for r in range(2)]
    other = SyncerClient(f"127.0.0.1:{port}", 1, "b" * 32, plaintext=True)
    try:
        ranks[0].call("Join", {"numels": numels})
        other.call("Join", {"numels": numels})
        parts = [p.ranges for p in even_parts(FlatFragment(((0, numels[0]),)), 2)]
        delta = torch.randn(numels[0], generator=torch.Generator().manual_seed(3))
        for r, client in enumerate(ranks):  # each rank's slice, written into its place as its bytes arrive
            (a, b), = parts[r]
            payload = wire.payload_bytes({"values": delta[a:b]})
            client.upload(payload, 0, parts[r], f"u{r}")
            assert state.bulk.uploads[0][f"u{r}"].received == len(payload)
        held = [state.bulk.uploads[0][f"u{r}"] for r in range(2)]
        assert held[0].into is not None and held[1].into is not None and not held[0].data
        assert held[0].into.assembly is held[1].into.assembly  # (the push's two slices: one fragment)
        assert torch.equal(held[0].into.assembly.values, delta)  # the fragment reassembled bit for bit
        glob = state.service.syncer.pull(0).params
        for r, client in enumerate(ranks):  # and each rank pulls its slice of the global fragment bit for bit
            version, values = client.download(0, parts[r])
            (a, b), = parts[r]
            assert version == 0 and torch.equal(values, glob[a:b])
        assert ranks[0].bytes_up + ranks[1].bytes_up == sum(len(wire.payload_bytes({"values": delta[a:b]}))
                                                            for (a, b), in parts)
        assert ranks[0].bytes_down + ranks[1].bytes_down == sum(
            len(wire.tensor_bytes(glob[a:b])) for (a, b), in parts)
    finally:
        for c in (*ranks, other):
            c.close()


def test_the_services_answer_to_a_push_carries_its_version_without_a_copy(served) -> None:  # noqa: ANN001
    from atoll.strategies.decoupled.protocol import Push

    state, _ = served
    service = state.service
    numel = service.syncer.numels[0]
    push = Push(0, 0, torch.zeros(numel), 1, 0, credential="a" * 32)
    accepted, answer = service.push(push, values=False)  # refused (no step granted): answered at once
    assert not accepted and answer is not None
    assert answer.version == service.syncer.version(0) and answer.params.numel() == 0
    accepted, full = service.push(push)
    assert full is not None and torch.equal(full.params, service.syncer.pull(0).params)
