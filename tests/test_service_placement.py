"""A push's slices written into their places as their bytes arrive (:mod:`atoll.runtime.service.placement`).

The placement alone: chunks cut anywhere (inside the head, inside a value), slices of several ranges, the
element-wise codecs' dtypes, a resumed stream, a head of another layout, a sealed assembly. Then against a syncer
served in this process on loopback: two ranks' slices of one push become the buffered Δ itself (no decode, no
copy), bit for bit what the codec decodes; a slice sent again after the commit changes nothing (a stream still
writing at the commit is refused: the assembly is sealed); a payload of another layout is held as bytes and
refused at the commit (``type``); what an island holds in transfer stays within its quota, an assembly counted
whole. Last, a stranger's streams (a review's attacks on the change; the first three found defects, fixed): a
header of many ranges costs the server's lock a bisection per range, a stream resumes at the offset the syncer
reports even inside a value, a slice's ranges stay claimed after its commit took it, and what held: islands
apart, no write after a commit, the fallback's bytes, non-finite values refused, ``wire.Payload`` byte for byte.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from conftest import service_clients, upload_halves

from atoll.algorithms.codecs import make_codec
from atoll.runtime.service import schema, slices, wire
from atoll.runtime.service.placement import Assembly, Placement, Sealed, element_wise, expected_head

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


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_two_ranks_slices_become_the_buffered_delta_itself_and_a_late_stream_changes_nothing(
        syncer, codec: str) -> None:  # noqa: ANN001
    """Each rank's slice (ranges of the fragment's real parameters) is written in place as it arrives, into one
    assembly; the commit buffers that assembly as the push's Δ (the same tensor: nothing decoded or copied on the
    commit's path), bit for bit what the codec decodes from the two payloads. The committed slice uploaded again
    (its id once more) is a new upload, into a new assembly: the buffered Δ does not change."""
    from atoll.runtime.service.client import SyncerClient

    state, address, creds = syncer(codec=codec, pull_codec="fp32")
    lead, rank1, other, session, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    delta, halves, encoded, ids = upload_halves(state, lead, rank1)
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
    lead, rank1, other, session, _ = service_clients(state, address, creds)
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
    lead, rank1, other, _, _ = service_clients(state, address, creds)
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


def _raw(client, upload: str, ranges, size: int, chunks: list[bytes], offset: int = 0) -> dict:  # noqa: ANN001
    """One ``Upload`` stream as a stranger's client may send it: its header, then exactly ``chunks`` (any sizes;
    none: the stream ends after its header). The reply, or grpc.RpcError."""
    header = schema.UploadHeader(upload=upload, fragment=0, ranges=ranges, size=size, offset=offset)
    stub = client.bulk.stream_unary(wire.method("Upload"))
    return wire.loads(stub(iter([schema.encode(header), *chunks]), metadata=client.metadata, timeout=60.0))


def _close(*clients) -> None:  # noqa: ANN002
    for c in clients:
        c.close()


# ----------------------------------------------------------------------------------------------------------------
# attacks on the path (a stranger's streams; found by a review of the change: the first three were defects, fixed)
# ----------------------------------------------------------------------------------------------------------------

def test_a_header_only_upload_of_many_ranges_costs_the_servers_lock_a_bisection_per_range_and_assembly(
        syncer, monkeypatch) -> None:  # noqa: ANN001
    """255 one-value slices share one assembly (their claims merged in it); a new upload is checked against that
    assembly once, two bisections per range, not against each of its slices (under the server's lock); one of
    more than PLACED_RANGES ranges is held as bytes without any check. (Found by an attack: the check had been
    O(slices x ranges) in Python, 1.1 s under the lock for one header.)"""
    from atoll.runtime.service import bulk, placement

    state, address, creds = syncer(codec="fp32", pull_codec="fp32", fragments=1)  # (one fragment: more values)
    lead, rank1, other, _, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    k = 255  # (ISLAND_UPLOADS - 1) claimants of one assembly: one value each, at the fragment's end, disjoint
    for i in range(k):
        r = ((n - k + i, n - k + i + 1),)
        assert _raw(lead, f"c{i}", r, expected_head(r, torch.float32)[1], []) == {"received": 0}
    held = state.bulk.uploads[0]
    assert len({id(u.into.assembly) for u in held.values()}) == 1  # (all in one assembly: counted once)
    checks: list[int] = []
    overlaps = placement.Assembly.overlaps
    monkeypatch.setattr(placement.Assembly, "overlaps", lambda self, r: checks.append(len(r)) or overlaps(self, r))
    try:
        few = tuple((i, i + 1) for i in range(0, 2 * bulk.PLACED_RANGES, 2))  # (below the claimants: disjoint)
        assert _raw(lead, "few", few, expected_head(few, torch.float32)[1], []) == {"received": 0}
        assert checks == [len(few)] and held["few"].into.assembly is held["c0"].into.assembly
        many = tuple((i, i + 1) for i in range(1, 2 * bulk.PLACED_RANGES + 3, 2))
        assert _raw(lead, "many", many, expected_head(many, torch.float32)[1], []) == {"received": 0}
        assert checks == [len(few)] and held["many"].into is None  # (over PLACED_RANGES: bytes, no check)
    finally:
        _close(lead, rank1, other)


def test_an_upload_resumes_at_the_offset_upload_status_reports(syncer) -> None:  # noqa: ANN001
    state, address, creds = syncer(codec="fp32", pull_codec="fp32")
    lead, rank1, other, session, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    x = torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-3
    data = wire.payload_bytes({"values": x}).tobytes()
    head = len(wire.payload_bytes({"values": x}).head)
    try:
        # a stranger's client sends 1000-byte chunks; its stream is cut after the first chunk of the body
        first = data[:head + 1000 + 2]
        assert _raw(lead, "u", ((0, n),), len(data), [first]) == {"received": len(first)}
        offset = lead.call("UploadStatus", {"upload": "u"}, bulk=True)["received"]
        assert offset == len(first)  # (what the syncer says it holds: the island continues there)
        try:
            reply = _raw(lead, "u", ((0, n),), len(data), [data[offset:]], offset=offset)
        except grpc.RpcError as e:
            pytest.fail(f"the resume at UploadStatus's offset was refused: {e.code()} {e.details()}")
        assert reply == {"received": len(data)}
        assert lead.commit(["u"], 0, 128, 0, session)["accepted"], state.service.syncer.rejected_by_reason
        assert torch.equal(state.service.syncer.buffers[0].pushes[0].delta, x)
    finally:
        _close(lead, rank1, other)


def test_a_slice_copied_out_of_a_shared_assembly_is_the_one_committed(syncer, monkeypatch) -> None:  # noqa: ANN001
    from atoll.runtime.service.client import SyncerClient

    state, address, creds = syncer(codec="fp32", pull_codec="fp32")
    lead, rank1, other, session, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    h = n // 2
    lo, hi = ((0, h),), ((h, n),)
    delta = torch.randn(n, generator=torch.Generator().manual_seed(7)) * 1e-3
    # a slice of an earlier push left behind (its commit never came): assembly A, at lo
    assert _raw(lead, "old", lo, expected_head(lo, torch.float32)[1], []) == {"received": 0}
    lead.upload(wire.payload_bytes({"values": delta[:h].clone()}), 0, lo, "a")  # overlaps "old": assembly B
    rank1.upload(wire.payload_bytes({"values": delta[h:].clone()}), 0, hi, "b")  # joins A (disjoint from "old")
    up = state.bulk.uploads[0]
    assert up["b"].into.assembly is up["old"].into.assembly is not up["a"].into.assembly
    late = SyncerClient(address, 0, creds[0], plaintext=True, control=False, give_up_s=5.0)
    original, joined = slices.assemble_payloads, []

    def between_the_take_and_the_copy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        # (the window is real: Bulk.taken popped "a" and "b" under the lock, the copy out of A comes after)
        late.upload(wire.payload_bytes({"values": torch.full((n - h,), 1e-3)}), 0, hi, "x")
        joined.append(state.bulk.uploads[0]["x"].into.assembly is up["old"].into.assembly)
        return original(*args, **kwargs)

    monkeypatch.setattr(slices, "assemble_payloads", between_the_take_and_the_copy)
    try:
        answer = lead.commit(["a", "b"], 0, 5 * state.service.run.tokens_per_step, 0, session)
    finally:
        _close(lead, rank1, other, late)
    assert answer["accepted"] and joined == [False]  # (b's ranges stay claimed in A: x is placed elsewhere)
    buffered = state.service.syncer.buffers[0].pushes[0].delta
    assert torch.equal(buffered[:h], delta[:h])
    assert torch.equal(buffered[h:], delta[h:]), "the committed Δ holds another upload's values at slice b"


@pytest.mark.parametrize("name", ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8",
                                  "BOOL"])
def test_a_payload_is_safetensors_own_file_for_every_dtype_shape_and_offset(name: str) -> None:
    from safetensors.torch import save as st_save

    dtype = wire._DTYPES[name]
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4 * 1000, generator=g) * 10
    tensors = {
        "values": base[:1000].to(dtype),
        "t": base[1000:1012].reshape(3, 4).t().to(dtype),  # (not contiguous)
        "s": base[2000].to(dtype),  # (0-d)
        "e": torch.empty(0, dtype=dtype),  # (empty: no bytes)
        "z": base[3000:3003],  # (another dtype beside it: safetensors' order of dtypes)
        "é": torch.arange(3, dtype=torch.int64),  # (a name beyond ASCII)
    }
    want = st_save({k: v.contiguous() for k, v in tensors.items()})
    payload = wire.Payload(tensors)
    assert len(payload) == len(want) and payload.tobytes() == want and bytes(wire.save(tensors)) == want
    for offset in range(0, len(want) + 1, 37):
        assert b"".join(payload.chunks(offset)) == want[offset:]


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_a_narrow_codecs_slices_cut_inside_values_are_the_decoded_delta_and_other_islands_have_their_own(
        syncer, codec: str) -> None:  # noqa: ANN001
    """Two ranks' slices of several ranges, sent in 999-byte chunks (cut inside the head and inside values), become
    what the codec decodes; island 1 uploading the same ids and ranges at once writes into an assembly of its own."""
    state, address, creds = syncer(codec=codec, pull_codec="fp32")
    lead, rank1, other, session, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    parts = [tuple((a, min(a + 97, n)) for a in range(0, n, 194)),
             tuple((a + 97, min(a + 194, n)) for a in range(0, n, 194) if a + 97 < n)]
    assert slices.tiles(parts, n)
    delta = torch.randn(n, generator=torch.Generator().manual_seed(11)) * 1e-3
    enc = [state.codec.encode(slices.take(delta, r)) for r in parts]
    spoiler = [state.codec.encode(torch.full((sum(b - a for a, b in r),), 1e3)) for r in parts]
    try:
        for r, (client, ranges, e, s) in enumerate(zip((lead, rank1), parts, enc, spoiler, strict=True)):
            data = wire.payload_bytes(e.tensors).tobytes()
            bad = wire.payload_bytes(s.tensors).tobytes()
            cut = [data[i:i + 999] for i in range(0, len(data), 999)]
            assert _raw(client, f"s{r}", ranges, len(data), cut) == {"received": len(data)}
            assert _raw(other, f"s{r}", ranges, len(bad), [bad]) == {"received": len(bad)}
        mine, theirs = state.bulk.uploads[0], state.bulk.uploads[1]
        assert mine["s0"].into.assembly is mine["s1"].into.assembly
        assert {id(u.into.assembly) for u in theirs.values()}.isdisjoint({id(mine["s0"].into.assembly)})
        assert lead.commit(["s0", "s1"], 0, 5 * state.service.run.tokens_per_step, 0, session)["accepted"]
        want = slices.assemble(n, [(r, state.codec.decode(e)) for r, e in zip(parts, enc, strict=True)])
        assert torch.equal(state.service.syncer.buffers[0].pushes[0].delta, want)
    finally:
        _close(lead, rank1, other)


def test_a_stream_holding_a_complete_upload_writes_nothing_after_its_commit(syncer) -> None:  # noqa: ANN001
    """A second stream of a complete upload, opened before the commit at the end of its bytes and kept open,
    sends after the commit: refused, and the buffered Δ (the sealed assembly) is unchanged."""
    state, address, creds = syncer(codec="fp32", pull_codec="fp32")
    lead, rank1, other, session, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    x = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-3
    data = wire.payload_bytes({"values": x}).tobytes()
    lead.upload(wire.payload_bytes({"values": x}), 0, ((0, n),), "u")
    go, result = threading.Event(), {}

    def held_open():  # noqa: ANN202
        yield schema.encode(schema.UploadHeader(upload="u", fragment=0, ranges=((0, n),), size=len(data),
                                                offset=len(data)))
        go.wait(30)
        yield b"\x00\x00\xc0\x7f" * 4  # four NaNs, at the end of the fragment

    def stream() -> None:
        stub = rank1.bulk.stream_unary(wire.method("Upload"))
        try:
            result["reply"] = stub(held_open(), metadata=rank1.metadata, timeout=60.0)
        except grpc.RpcError as e:
            result["code"] = e.code()

    t = threading.Thread(target=stream)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not any(tr.island == 0 for tr in state.bulk.open.values()):  # (the stream holds its upload)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        answer = lead.commit(["u"], 0, 5 * state.service.run.tokens_per_step, 0, session)
        assert answer["accepted"]
        buffered = state.service.syncer.buffers[0].pushes[0].delta
        go.set()
        t.join(30)
        assert result.get("code") in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION)
        assert torch.equal(buffered, x) and bool(torch.isfinite(buffered).all())
    finally:
        go.set()
        _close(lead, rank1, other)


def test_a_head_of_another_layout_cut_mid_head_falls_back_to_the_bytes_sent(syncer) -> None:  # noqa: ANN001
    """A valid payload whose head differs from the expected one only inside its JSON (the same length: its keys in
    another order), sent one byte at a time through its head: held as bytes, exactly those sent (the matched
    prefix included), and decoded at the commit into the values sent."""
    state, address, creds = syncer(codec="fp32", pull_codec="fp32")
    lead, rank1, other, session, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    x = torch.randn(n, generator=torch.Generator().manual_seed(9)) * 1e-3
    good = wire.payload_bytes({"values": x}).tobytes()
    expected, size = expected_head(((0, n),), torch.float32)
    text = expected[8:].decode()
    swapped = text.replace(f'"dtype":"F32","shape":[{n}]', f'"shape":[{n}],"dtype":"F32"')
    assert swapped != text and len(swapped) == len(text)
    data = expected[:8] + swapped.encode() + good[len(expected):]
    same = next(i for i in range(len(expected)) if data[i] != expected[i])
    assert same > 16 and len(data) == size == len(good)
    try:
        cut = [data[i:i + 1] for i in range(len(expected) + 8)] + [data[len(expected) + 8:]]
        assert _raw(lead, "m", ((0, n),), size, cut) == {"received": size}
        held = state.bulk.uploads[0]["m"]
        assert held.into is None and bytes(held.data) == data
        assert lead.commit(["m"], 0, 5 * state.service.run.tokens_per_step, 0, session)["accepted"]
        assert torch.equal(state.service.syncer.buffers[0].pushes[0].delta, x)
    finally:
        _close(lead, rank1, other)


def test_a_placed_payload_of_non_finite_values_is_refused_as_a_decoded_one_was(syncer) -> None:  # noqa: ANN001
    """The head the syncer expects, then NaN and inf in the body: written in place, then refused at the commit by
    the syncer's check of the norm (nothing buffered)."""
    state, address, creds = syncer(codec="bf16", pull_codec="fp32")
    lead, rank1, other, session, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    x = torch.zeros(n, dtype=torch.bfloat16)
    x[7], x[n - 1] = float("nan"), float("inf")
    data = wire.payload_bytes({"values": x}).tobytes()
    try:
        assert _raw(lead, "n", ((0, n),), len(data), [data]) == {"received": len(data)}
        assert state.bulk.uploads[0]["n"].into is not None
        assert not lead.commit(["n"], 0, 5 * state.service.run.tokens_per_step, 0, session)["accepted"]
        assert state.service.syncer.buffers[0].pushes == []
        assert sum(state.service.syncer.rejected_by_reason.values()) == 1
    finally:
        _close(lead, rank1, other)
