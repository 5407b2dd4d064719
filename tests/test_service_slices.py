"""An island of several ranks at ``atoll syncer``: slices of a fragment, the codec's payload on the wire, step
leases, and an island back from a long outage.

The geometry of slices is checked on a model's real fragments (every value in exactly one slice, each rank's
local ranges holding the values its slice names); the rest against a syncer served in this process on
loopback, with the run's int4 codec: real uploads, commits and downloads, assertions on what the syncer holds.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from conftest import service_clients, upload_halves

from atoll.algorithms.fragments import fragment_slices
from atoll.runtime.service import schema, slices, wire

pytest.importorskip("cryptography")  # (grpcio comes with it in the dev extra)


def _shapes() -> list[tuple[str, tuple[int, ...]]]:
    """A decoder's parameter shapes, embedding and head included (rows not a multiple of the ranks)."""
    shapes = [("model.embed_tokens.weight", (37, 8))]
    for layer in range(4):
        shapes += [(f"model.layers.{layer}.attn.weight", (8, 8)), (f"model.layers.{layer}.norm.weight", (8,)),
                   (f"model.layers.{layer}.mlp.weight", (13, 8))]
    return shapes + [("model.norm.weight", (8,)), ("lm_head.weight", (37, 8))]


def _fsdp_counts(shapes: list[tuple[str, tuple[int, ...]]], ranks: int) -> torch.Tensor:
    """(R, params) elements per rank as FSDP2's Shard(0) cuts each parameter's rows (chunks of ceil(rows/R))."""
    counts = torch.zeros(ranks, len(shapes), dtype=torch.int64)
    for j, (_, shape) in enumerate(shapes):
        rows, per_row = shape[0], (shape[1] if len(shape) > 1 else 1)
        chunk = -(-rows // ranks)
        for r in range(ranks):
            counts[r, j] = max(0, min(rows, (r + 1) * chunk) - min(rows, r * chunk)) * per_row
    return counts


@pytest.mark.parametrize("codec_name", ["fp32", "int4", "topk"])
def test_payloads_decoded_into_their_places_equal_the_decoded_slices_assembled(codec_name: str) -> None:
    """The syncer decodes each slice of a push into its place (assemble_payloads); a slice of one range and a
    slice of several give the values decode-then-assemble gives, bit for bit."""
    from atoll.algorithms.codecs import make_codec

    codec = make_codec(codec_name)
    delta = torch.randn(300, generator=torch.Generator().manual_seed(1))
    parts = [((0, 100),), ((100, 130), (200, 300)), ((130, 200),)]
    encoded = [codec.encode(slices.take(delta, r)) for r in parts]
    expected = slices.assemble(300, [(r, codec.decode(e)) for r, e in zip(parts, encoded, strict=True)])
    assert torch.equal(slices.assemble_payloads(300, list(zip(parts, encoded, strict=True)), codec), expected)
    if codec.lossless:
        assert torch.equal(expected, delta)
    with pytest.raises(ValueError, match="a slice of 100 values"):
        slices.assemble_payloads(300, [(((0, 100),), encoded[2])], codec)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_every_rank_holds_the_values_its_slice_names_and_the_slices_tile_each_fragment(ranks: int) -> None:
    shapes = _shapes()
    numels = [int(torch.Size(s).numel()) for _, s in shapes]
    index = fragment_slices(shapes, 3)
    flat = torch.arange(sum(numels), dtype=torch.float32)  # value = its flat position
    pieces = slices.shard_pieces(numels, _fsdp_counts(shapes, ranks))
    shards = [torch.cat([flat[a:b] for a, b, _ in mine]) if mine else torch.empty(0) for mine in pieces]
    for fragment in index:
        whole = fragment.gather(flat)
        for parts, local in ((slices.even_parts(fragment, ranks), [flat] * ranks),
                             (slices.shard_parts(fragment, pieces), shards)):
            assert slices.tiles([p.ranges for p in parts], fragment.numel())
            for part, vector in zip(parts, local, strict=True):
                assert part.numel() == part.local.numel()
                # the rank's local ranges hold exactly the fragment's values at its slice's ranges
                assert torch.equal(part.local.gather(vector) if part.numel() else torch.empty(0),
                                   slices.take(whole, part.ranges))
            rebuilt = slices.assemble(fragment.numel(), [(p.ranges, slices.take(whole, p.ranges)) for p in parts])
            assert torch.equal(rebuilt, whole)
    even = slices.even_parts(index[0], ranks)
    assert max(p.numel() for p in even) - min(p.numel() for p in even) <= 1  # as equal as can be
    n = index[0].numel()
    assert not slices.tiles([((0, n // 2),), ((0, n // 2),)], n)  # twice the same half: a gap and an overlap
    assert not slices.tiles([((0, n - 1),)], n)
    assert not slices.tiles([((0, n // 2),), ((n // 2 - 1, n),)], n)


@pytest.mark.slow
def test_two_ranks_push_their_slices_which_the_syncer_decodes_and_reassembles(syncer) -> None:  # noqa: ANN001
    """Each rank uploads its half of Δ as the int4 codec encodes it; the leader's commit lists both: the syncer
    holds the halves decoded and reassembled, and counts the payloads' bytes (what travelled), not float32's.
    Slices that do not tile the fragment are refused and counted (``slices``); with float32 pulls a rank pulls
    its own slice."""
    state, address, creds = syncer(pull_codec="fp32")
    lead, rank1, _, session, _ = service_clients(state, address, creds)
    n = state.service.syncer.numels[0]
    delta, halves, encoded, ids = upload_halves(state, lead, rank1)
    with pytest.raises(RuntimeError, match="leader"):  # a rank other than the leader has no control connection
        rank1.call("Push", {})
    answer = lead.commit(ids, 0, 5 * state.service.run.tokens_per_step, 0, session)
    assert answer["accepted"] and not answer["answered"]  # in the buffer: quorum 2
    expected = slices.assemble(n, [(p.ranges, state.codec.decode(e)) for p, e in zip(halves, encoded, strict=True)])
    assert torch.equal(state.service.syncer.buffers[0].pushes[0].delta, expected)
    payload = sum(e.nbytes for e in encoded)
    assert payload == sum(state.codec.payload_bytes(p.numel()) for p in halves) < n  # int4: under a byte a value
    assert state.service.islands[0].bytes_received == payload  # the syncer counts what it received
    assert payload < lead.bytes_up + rank1.bytes_up < payload + 2 * 256  # each slice: its payload + a header
    assert lead.bytes_up > 0 and rank1.bytes_up > 0  # both ranks' connections carried their half

    # slices that do not tile fragment 1: one half twice (the other half missing), refused and counted
    halves1 = slices.even_parts(state.service.syncer.index[1], 2)
    same = state.codec.encode(torch.zeros(halves1[0].numel()))
    bad = [lead.upload(wire.payload_bytes(same.tensors), 1, halves1[0].ranges) for _ in range(2)]
    assert not lead.commit(bad, 1, 128, 0, session)["accepted"]
    assert state.service.syncer.rejected_by_reason == {"slices": 1}
    assert state.service.syncer.version(1) == 0

    # a rank pulls its own slice: the global fragment's values at its ranges, float32
    version, mine = rank1.download(0, halves[1].ranges)
    assert version == 0 and torch.equal(mine, slices.take(state.service.syncer.pull(0).params, halves[1].ranges))
    assert 4 * halves[1].numel() < rank1.bytes_down < 4 * halves[1].numel() + 256


@pytest.mark.slow
def test_a_commit_riding_on_the_leaders_upload_waits_for_the_other_slice_and_answers_in_its_reply(
        syncer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The leader's slice carries the push's commit (``UploadHeader.commit``): the syncer holds the upload's call
    until the other rank's slice is up, commits, and answers in the upload's reply (one round trip fewer than a
    ``Push`` after both uploads): the same reassembled Δ in the buffer, counted as one ``Push`` call; retried, the
    same answer. A slice
    that never comes: no answer after the quiet wait and nothing merged (a ``Push`` of it then finds the upload
    lost); a commit that does not name its own upload is refused (``commit``)."""
    import threading
    import time

    from atoll.runtime.service import bulk
    from atoll.runtime.service.client import UploadLost

    monkeypatch.setattr(bulk, "COMMIT_WAIT_QUIET_S", 0.5)
    state, address, creds = syncer()
    lead, rank1, _, session, _ = service_clients(state, address, creds)
    n, tokens = state.service.syncer.numels[0], 5 * state.service.run.tokens_per_step
    delta = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    halves = slices.even_parts(state.service.syncer.index[0], 2)
    encoded = [state.codec.encode(slices.take(delta, part.ranges)) for part in halves]
    ids = ["s.0.1.0", "s.0.1.1"]
    request = lead.push_request(ids, 0, tokens, 0, session)
    answers: list = []
    riding = threading.Thread(target=lambda: answers.append(
        lead.upload_commit(wire.payload_bytes(encoded[0].tensors), 0, halves[0].ranges, ids[0], request)))
    riding.start()
    deadline = time.monotonic() + 30
    while ids[0] not in state.bulk.uploads[0] or state.bulk.uploads[0][ids[0]].received < \
            state.bulk.uploads[0][ids[0]].size:  # the leader's slice is up; its call waits for the other
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert riding.is_alive() and state.calls.get("Push", 0) == 0
    rank1.upload(wire.payload_bytes(encoded[1].tensors), 0, halves[1].ranges, ids[1])
    riding.join(timeout=60)
    assert not riding.is_alive() and answers[0]["accepted"] and not answers[0]["answered"]  # buffered: quorum 2
    expected = slices.assemble(n, [(p.ranges, state.codec.decode(e)) for p, e in zip(halves, encoded, strict=True)])
    assert torch.equal(state.service.syncer.buffers[0].pushes[0].delta, expected)
    assert state.calls["Push"] == 1 and state.bulk.uploads[0] == {}  # both slices taken by the commit
    # the upload retried after its reply was lost (its slices taken already): the same answer, at once
    again = lead.upload_commit(wire.payload_bytes(encoded[0].tensors), 0, halves[0].ranges, ids[0], request)
    assert again == answers[0] and len(state.service.syncer.buffers[0].pushes) == 1
    state.bulk.uploads[0].clear()  # (the retry's bytes, held until the quota drops them)

    # the other slice never comes: after the quiet wait the reply carries no answer, and nothing is buffered
    halves1 = slices.even_parts(state.service.syncer.index[1], 2)
    lonely = wire.payload_bytes(state.codec.encode(torch.zeros(halves1[0].numel())).tensors)
    gone = lead.push_request(["t.0", "t.1"], 1, tokens, 0, session)
    assert lead.upload_commit(lonely, 1, halves1[0].ranges, "t.0", gone) is None
    assert state.service.syncer.buffers[1].pushes == [] and state.calls["Push"] == 2  # (the retry was a call)
    with pytest.raises(UploadLost):
        lead.commit(["t.0", "t.1"], 1, tokens, 0, session)
    # a stream that ends short of its declared size: answered at once with the bytes held, no commit waited for
    # (a quiet wait longer than the call's deadline would fail the call)
    monkeypatch.setattr(bulk, "COMMIT_WAIT_QUIET_S", 600.0)
    cut, pushes = lead.push_request(["u.0", "u.1"], 1, tokens, 0, session), state.calls["Push"]
    header = schema.UploadHeader(upload="u.0", fragment=1, ranges=halves1[0].ranges, size=len(lonely), offset=0,
                                 commit=cut)
    stub = lead.bulk.stream_unary(wire.method("Upload"))
    short = wire.loads(stub(iter([schema.encode(header), lonely.tobytes()[:len(lonely) // 2]]), metadata=lead.metadata,
                            timeout=30.0))
    assert short == {"received": len(lonely) // 2} and state.calls["Push"] == pushes
    assert state.service.syncer.buffers[1].pushes == []
    # a commit that does not name the upload carrying it
    with pytest.raises(grpc.RpcError) as refused:
        lead.upload_commit(lonely, 1, halves1[0].ranges, "t.2", gone)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and state.gate.refused["commit"] == 1


@pytest.mark.slow
def test_a_push_whose_session_is_superseded_while_it_decodes_is_fenced_not_a_replay(
        syncer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A join of the same island while a push of its old session is decoded (outside the server's lock): the push
    is refused as ``stale_session`` (ABORTED: the old job stops), never handed to the syncer, which would count it
    a ``replay`` (the race CI met beside a CPU hog)."""
    from atoll.runtime.service import server as server_module
    from atoll.runtime.service.client import SessionSuperseded

    state, address, creds = syncer()
    lead, _, _, session, _ = service_clients(state, address, creds)
    n, tokens = state.service.syncer.numels[0], 5 * state.service.run.tokens_per_step
    real = server_module.slices.assemble_payloads

    def joined_meanwhile(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a new job of island 0 joins mid-decode
        with state.lock:
            state.service.syncer.admission.rejoin(0)
        return real(*args, **kwargs)

    monkeypatch.setattr(server_module.slices, "assemble_payloads", joined_meanwhile)
    payload = wire.payload_bytes(state.codec.encode(torch.full((n,), 1e-3)).tensors)
    with pytest.raises(SessionSuperseded):
        lead.push(payload, 0, ((0, n),), tokens, 0, session)
    assert state.gate.refused.get("stale_session") == 1
    assert state.service.syncer.rejected_by_reason == {} and state.service.syncer.buffers[0].pushes == []


@pytest.mark.slow
def test_a_lease_returns_its_unused_steps_at_leave_and_a_killed_sessions_at_its_rejoin(syncer) -> None:  # noqa: ANN001
    state, address, creds = syncer()
    lead, _, other, _, _ = service_clients(state, address, creds)
    s, tps = state.service, state.service.run.tokens_per_step
    assert lead.call("ReserveSteps", {"n": 5, "used": 3})["granted"] == 5  # the next lease, 3 of the first used
    assert s.islands[0].steps == s.reserved == 10
    # the island is killed and started again: its new session gives back the 7 steps it never said it used
    # (to the budget only: its ledger keeps them, as it may have pushed tokens of steps it had not reported)
    lead.call("Join", {"numels": s.syncer.numels})
    assert s.islands[0].steps == s.reserved == 3 and s.syncer.bounds.granted[0] == 10 * tps
    assert lead.call("ReserveSteps", {"n": 5, "used": 0})["granted"] == 5
    # it leaves having taken 2 of them: the other 3 go back to the budget and out of its ledger
    assert lead.call("Leave", {"steps": 5, "used": 2})["returned"] == 3
    assert s.islands[0].steps == 5 and s.syncer.bounds.granted[0] == (10 + 5 - 3) * tps
    # the budget runs out: a lease is cut short, then nothing is granted
    s.reserved = s.budget - 2
    assert other.call("ReserveSteps", {"n": 5})["granted"] == 2
    assert other.call("ReserveSteps", {"n": 5})["granted"] == 0


@pytest.mark.slow
def test_an_island_back_from_a_long_outage_never_becomes_the_global_state(syncer) -> None:  # noqa: ANN001
    """Island 1 trains on alone (quorum 1) while island 0 is away: island 0's push, computed from version 0,
    is refused as stale; the syncer answers it with the newest global fragment, which is what the island pulls
    (and what it starts from when it rejoins). A push that would replace the model with the island's own
    (a Δ of the parameters' size) is refused for its norm, whatever its version."""
    state, address, creds = syncer(quorum=1, max_staleness=4)
    lead, _, other, s0, s1 = service_clients(state, address, creds)
    n, tps = state.service.syncer.numels[0], state.service.run.tokens_per_step
    for v in range(6):  # six merges of island 1 alone, a lease of a round (5 steps) before each, used reported
        assert other.call("ReserveSteps", {"n": 5, "used": 5 * v})["granted"] == 5
        step = state.codec.encode(torch.full((n,), 1e-3))
        answer = other.push(wire.payload_bytes(step.tensors), 0, ((0, n),), 5 * tps, v, s1)
        assert answer["accepted"] and answer["version"] == v + 1
    before = state.service.syncer.pull(0).params.clone()
    # island 0 comes back with the work of a long outage, computed from version 0
    stale = state.codec.encode(torch.full((n,), -1e-3))
    answer = lead.push(wire.payload_bytes(stale.tensors), 0, ((0, n),), 5 * tps, 0, s0)
    assert not answer["accepted"] and answer["answered"] and answer["version"] == 6
    assert state.service.syncer.stale_updates == 1, state.service.syncer.rejected_by_reason
    assert torch.equal(state.service.syncer.pull(0).params, before)  # the global state is untouched
    version, pulled = lead.download(0)  # what the island adopts: the newest global fragment
    assert version == 6 and torch.equal(pulled, before)
    rejoined = lead.call("Join", {"numels": state.service.syncer.numels})  # restarted: from the newest
    assert rejoined["versions"][0] == 6
    assert lead.call("ReserveSteps", {"n": 5})["granted"] == 5
    # fresh, but a Δ that would make its own parameters the global ones (the size of the parameters)
    own = state.codec.encode(before - torch.randn(n, generator=torch.Generator().manual_seed(1)))
    answer = lead.push(wire.payload_bytes(own.tensors), 0, ((0, n),), 5 * tps, 6, rejoined["session"])
    assert not answer["accepted"] and state.service.syncer.rejected_by_reason == {"norm": 1}
    assert torch.equal(state.service.syncer.pull(0).params, before)


@pytest.mark.slow
def test_a_push_waiting_for_its_quorum_is_answered_by_one_long_poll_when_it_merges(syncer) -> None:  # noqa: ANN001
    """``Buffered`` with ``fragment`` and ``wait_s`` holds the call until the island's push leaves the buffer:
    island 0's push waits for island 1's (quorum 2); one call, made before island 1 pushes, is answered when the
    merge happens, with the fragment no longer buffered (one call per merge, not one per poll interval). Without
    ``wait_s`` the answer is immediate; a bad ``wait_s`` is refused."""
    import threading

    state, address, creds = syncer(quorum=2, grace_window="round")
    lead, _, other, s0, s1 = service_clients(state, address, creds)
    n, tps = state.service.syncer.numels[0], state.service.run.tokens_per_step
    assert other.call("ReserveSteps", {"n": 5})["granted"] == 5
    step = wire.payload_bytes(state.codec.encode(torch.full((n,), 1e-3)).tensors)
    assert not lead.push(step, 0, ((0, n),), 5 * tps, 0, s0)["answered"]  # in the buffer: quorum 2
    assert lead.call("Buffered", {"fragment": 0})["buffered"] == [0]  # no wait_s: answered at once
    with pytest.raises(grpc.RpcError) as bad:
        lead.call("Buffered", {"fragment": 0, "wait_s": "soon"}, retry=False)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    answers: list[list[int]] = []
    waiting = threading.Thread(target=lambda: answers.append(
        lead.call("Buffered", {"fragment": 0, "wait_s": wire.MAX_WAIT_S}, retry=False)["buffered"]))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not answers  # held by the syncer: the push is still buffered
    # an island holds at most one waiting call per fragment of the shard (two here): a third is answered at
    # once, however long it asked to wait, so no island can take the threads the others' calls need
    second = threading.Thread(target=lambda: lead.call("Buffered", {"fragment": 0, "wait_s": 5}, retry=False))
    second.start()
    while state.waiting[0] < 2:
        second.join(0.05)
    assert lead.call("Buffered", {"fragment": 0, "wait_s": 5}, retry=False)["buffered"] == [0]
    assert waiting.is_alive() and second.is_alive()  # the third came back while the two still wait
    assert other.push(step, 0, ((0, n),), 5 * tps, 0, s1)["answered"]  # the quorum: merged
    second.join(30)
    waiting.join(30)
    assert answers == [[]] and state.service.syncer.version(0) == 1
    assert state.calls["Buffered"] == 5  # immediate, refused, the two that waited for the merge, the third
    assert state.waiting == [0, 0]
