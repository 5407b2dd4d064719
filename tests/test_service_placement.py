"""A push's slices written into their places as their bytes arrive (:mod:`atoll.runtime.service.placement`).

The placement alone: chunks cut anywhere (inside the head, inside a value), slices of several ranges, the
element-wise codecs' dtypes, a resumed stream, a head of another layout, a sealed assembly. Then against a syncer
served in this process on loopback: two ranks' slices of one push become the buffered Δ itself (no decode, no copy),
bit for bit what the codec decodes; a slice sent again after the commit changes nothing (a stream still writing at
the commit is refused: the assembly is sealed); a payload of another layout is held as bytes and refused at the
commit (``type``); and what an island holds in transfer stays within its quota, an assembly counted whole.
"""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from atoll.algorithms.codecs import make_codec
from atoll.runtime.service import slices, wire
from atoll.runtime.service.placement import Assembly, Placement, Sealed, element_wise

pytest.importorskip("cryptography")  # (grpcio comes with it in the dev extra)


@pytest.mark.parametrize(("name", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16), ("fp8-e4m3", None),
                                             ("int8", None), ("int4", None), ("topk", None)])
def test_element_wise_codecs_are_those_whose_payload_is_their_values_in_order(name: str, dtype) -> None:  # noqa: ANN001
    """(The fp8 codecs carry a scale beside their values: held as bytes, decoded at the commit.)"""
    assert element_wise(make_codec(name)) == dtype


def _cut(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` in chunks of ``sizes`` (cycled), the last one what is left."""
    out, at, i = [], 0, 0
    while at < len(data):
        out.append(data[at:at + sizes[i % len(sizes)]])
        at, i = at + len(out[-1]), i + 1
    return out


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("sizes", [[wire.CHUNK_BYTES], [5], [3, 1000, 7], [1]])
def test_a_slices_values_land_at_its_ranges_whatever_the_chunks(name: str, sizes: list[int]) -> None:
    """Chunks cut inside the head and inside values (1 byte at a time too): the assembly holds, at the slice's
    ranges, exactly what the codec decodes from the payload; the values outside stay 0."""
    codec = make_codec(name)
    ranges = ((3, 40), (50, 51), (60, 1000))
    n = sum(b - a for a, b in ranges)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    sent = codec.encode(x)
    data = wire.payload_bytes(sent.tensors).tobytes()
    assembly = Assembly(1200)
    placement = Placement(assembly, ranges, element_wise(codec))
    assert placement.size == len(data)
    for chunk in _cut(data, sizes if sizes != [1] else [1, 1, 2, 3]):
        assert placement.write(chunk)
    assert placement.received == len(data)
    want = torch.zeros(1200)
    slices.assemble_into(want, ranges, codec.decode(sent))
    assert torch.equal(assembly.seal(), want)


def test_a_resumed_stream_continues_at_its_offset_and_a_head_of_another_layout_falls_back() -> None:
    codec = make_codec("fp32")
    x = torch.arange(10, dtype=torch.float32)
    data = wire.payload_bytes({"values": x}).tobytes()
    head = len(data) - 40
    placement = Placement(Assembly(10), ((0, 10),), torch.float32)
    assert placement.write(data[:head + 13])  # (three values and a part of the fourth)
    assert not placement.resume(head + 14)  # beyond what it holds
    assert not placement.resume(head + 6)  # inside a value
    assert placement.resume(head + 12)  # where the island's UploadStatus says the syncer's copy ends
    assert placement.write(data[head + 12:])
    assert torch.equal(placement.assembly.seal(), x)
    other = wire.payload_bytes({"values": x.double()}).tobytes()  # another layout: not written in place
    assert not Placement(Assembly(10), ((0, 10),), torch.float32).write(other[:64])
    assert element_wise(codec) == torch.float32


def test_nothing_is_written_into_a_sealed_assembly() -> None:
    data = wire.payload_bytes({"values": torch.ones(8)}).tobytes()
    assembly = Assembly(8)
    placement = Placement(assembly, ((0, 8),), torch.float32)
    assert placement.write(data[:len(data) - 8])
    before = assembly.seal().clone()
    with pytest.raises(Sealed):
        placement.write(data[len(data) - 8:])
    assert torch.equal(assembly.values, before)


@pytest.fixture()
def syncer(fast_config: dict, tmp_path: Path):  # noqa: ANN201 - a function serving a syncer of given settings
    """``serve(**settings)`` -> (SyncerServer, address, credentials): a decoupled run's syncer in this process,
    plaintext on loopback, 2 fragments; stopped after the test."""
    from atoll.config import build_config
    from atoll.runtime.service.server import SyncerServer

    servers = []

    def serve(**settings: object) -> tuple:
        base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
        config = build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "fragments": 2,
                                     **settings})
        creds = ["a" * 32, "b" * 32]
        state = SyncerServer.of_run(config, tmp_path / "syncer", creds)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[state.handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return state, f"127.0.0.1:{port}", creds

    yield serve
    for server in servers:
        server.stop(grace=0)


def _island(state, address: str, creds: list[str]) -> tuple:  # noqa: ANN001
    """Island 0's leader and second rank, both islands joined, island 0 granted a round of steps."""
    from atoll.runtime.service.client import SyncerClient

    numels = state.service.syncer.numels
    lead = SyncerClient(address, 0, creds[0], plaintext=True)
    rank1 = SyncerClient(address, 0, creds[0], plaintext=True, control=False)
    other = SyncerClient(address, 1, creds[1], plaintext=True)
    session = lead.call("Join", {"numels": numels})["session"]
    other.call("Join", {"numels": numels})
    assert lead.call("ReserveSteps", {"n": 5})["granted"] == 5
    return lead, rank1, other, session


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_two_ranks_slices_become_the_buffered_delta_itself_and_a_late_stream_changes_nothing(
        syncer, codec: str) -> None:  # noqa: ANN001
    """Each rank's slice (ranges of the fragment's real parameters) is written in place as it arrives, into one
    assembly; the commit buffers that assembly as the push's Δ (the same tensor: nothing decoded or copied on the
    commit's path), bit for bit what the codec decodes from the two payloads. The committed slice uploaded again
    (its id once more) is a new upload, into a new assembly: the buffered Δ does not change."""
    from atoll.runtime.service.client import SyncerClient

    state, address, creds = syncer(codec=codec, pull_codec="fp32")
    lead, rank1, other, session = _island(state, address, creds)
    n = state.service.syncer.numels[0]
    delta = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    halves = slices.even_parts(state.service.syncer.index[0], 2)
    encoded = [state.codec.encode(slices.take(delta, part.ranges)) for part in halves]
    ids = [client.upload(wire.payload_bytes(e.tensors), 0, part.ranges, f"s.0.1.{r}")
           for r, (client, part, e) in enumerate(zip((lead, rank1), halves, encoded, strict=True))]
    held = [state.bulk.uploads[0][u] for u in ids]
    assert all(h.into is not None and not h.data for h in held) and held[0].into.assembly is held[1].into.assembly
    assembly = held[0].into.assembly.values
    answer = lead.commit(ids, 0, 5 * state.service.run.tokens_per_step, 0, session)
    assert answer["accepted"] and not answer["answered"]  # in the buffer: quorum 2
    buffered = state.service.syncer.buffers[0].pushes[0].delta
    assert buffered.data_ptr() == assembly.data_ptr()  # the assembly is the push's Δ (its memory, not a copy)
    want = slices.assemble(n, [(p.ranges, state.codec.decode(e)) for p, e in zip(halves, encoded, strict=True)])
    assert torch.equal(buffered, want)
    assert state.service.islands[0].bytes_received == sum(e.nbytes for e in encoded)
    before = buffered.clone()
    late = SyncerClient(address, 0, creds[0], plaintext=True, control=False, give_up_s=5.0)
    try:  # (the same upload id again: a new transfer of it, not the committed one)
        late.upload(wire.payload_bytes(state.codec.encode(torch.ones(halves[0].numel())).tensors), 0,
                    halves[0].ranges, ids[0])
    finally:
        late.close()
    assert torch.equal(state.service.syncer.buffers[0].pushes[0].delta, before)
    for c in (lead, rank1, other):
        c.close()


def test_a_payload_of_another_layout_is_held_as_bytes_and_refused_at_the_commit(syncer) -> None:  # noqa: ANN001
    state, address, creds = syncer(codec="fp32", pull_codec="fp32")
    lead, rank1, other, session = _island(state, address, creds)
    n = state.service.syncer.numels[0]
    wrong = wire.payload_bytes({"other": torch.zeros(n)})  # the same size, another tensor's name
    assert len(wrong) == len(wire.payload_bytes({"values": torch.zeros(n)}))
    upload = lead.upload(wrong, 0, ((0, n),))
    assert state.bulk.uploads[0][upload].into is None and len(state.bulk.uploads[0][upload].data) == len(wrong)
    assert not lead.commit([upload], 0, 128, 0, session)["accepted"]
    assert state.service.syncer.rejected_by_reason == {"type": 1}
    for c in (lead, rank1, other):
        c.close()


def test_an_islands_slices_in_transfer_stay_within_its_quota_each_assembly_counted_whole(syncer) -> None:  # noqa: ANN001
    """Slices that overlap one another each need an assembly of the whole fragment: the island's uploads are
    dropped, oldest first, once their assemblies pass its quota (``OPEN_FRAGMENTS`` payloads of a fragment)."""
    from atoll.runtime.service import bulk

    state, address, creds = syncer(codec="fp32", pull_codec="fp32")
    lead, rank1, other, _ = _island(state, address, creds)
    n = state.service.syncer.numels[0]
    one = wire.payload_bytes({"values": torch.zeros(1)})
    for _ in range(bulk.OPEN_FRAGMENTS + 3):  # one value each, all at the same place: an assembly each
        lead.upload(one, 0, ((0, 1),))
    held = state.bulk.uploads[0]
    assert len({id(u.into.assembly) for u in held.values()}) == len(held) <= bulk.OPEN_FRAGMENTS
    assert state.bulk._held_bytes(0) <= state.bulk.max_open < (len(held) + 1) * 4 * n
    assert state.refused_calls["quota"] >= 3
    for c in (lead, rank1, other):
        c.close()
