"""realign_pushes through the syncer service: the answer to a merged push carries its share over gRPC (``Push``'s
reply when merged at once, ``Buffered``'s once merged), the schema bounds it, and every rank of an island job
applies the one share the leader received.

The syncer is a gRPC server in this process on loopback, its clock set by the test (the hand-made cadence of
tests/test_realign.py: one step a second, H = 8, one fragment). Four islands, quorum 2: islands 0 and 1 push at
t = 8, 16 (each merge holds both, the second push completes the quorum), islands 2 and 3 half a round later at
t = 12, 20. At t = 20 both rounds' push-to-push gaps are measured (8 s), and the merge of {2, 3} began 4 s after
the previous merge of the fragment, {0, 1} (as many islands, the lower index first): islands 2 and 3 are told
0.5 of a round; islands 0 and 1 (the lower index) and every earlier answer 0.
"""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from conftest import ThreadRanks

from atoll.runtime.service import schema, wire

pytest.importorskip("cryptography")  # (grpcio comes with it in the dev extra)

H = 8
CREDS = [c * 32 for c in "abcd"]


@pytest.fixture
def serve(fast_config: dict, tmp_path: Path):  # noqa: ANN201 - a function serving a syncer of given settings
    """``serve(realign)`` -> (SyncerServer, address, clock): a syncer of four islands in this process, plaintext
    on loopback, whose clock is ``clock[0]`` seconds; stopped after the test."""
    from atoll.config import build_config
    from atoll.runtime.service.server import SyncerServer

    servers = []

    def start(realign: bool) -> tuple:
        base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
        config = build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "islands": 4,
                                     "fragments": 1, "sync_every": H, "steps": 64, "quorum": 2,
                                     "grace_window": "round", "realign_pushes": realign,
                                     "pull_codec": "fp32"})  # (the pulls' values read as float32 fragments)
        state = SyncerServer.of_run(config, tmp_path / f"syncer{len(servers)}", CREDS)
        clock = [0.0]
        state.service._now = lambda: clock[0]  # the test's clock, not the wall's
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[state.handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return state, f"127.0.0.1:{port}", clock, config

    yield start
    for server in servers:
        server.stop(grace=0)


def _islands(state, address: str) -> tuple[list, list[int]]:  # noqa: ANN001
    """The four islands' leaders, joined, each granted three rounds of steps; their sessions."""
    from atoll.runtime.service.client import SyncerClient

    leads = [SyncerClient(address, i, CREDS[i], plaintext=True) for i in range(4)]
    sessions = [c.call("Join", {"numels": state.service.syncer.numels})["session"] for c in leads]
    for c in leads:
        assert c.call("ReserveSteps", {"n": 3 * H})["granted"] == 3 * H
    return leads, sessions


def _push(state, lead, session: int) -> dict:  # noqa: ANN001
    """A round's push of fragment 0 (a small Δ, H steps' tokens, on the newest version): the syncer's reply."""
    n, tps = state.service.syncer.numels[0], state.service.run.tokens_per_step
    payload = wire.payload_bytes(state.codec.encode(torch.full((n,), 1e-3)).tensors)
    return lead.push(payload, 0, ((0, n),), H * tps, state.service.syncer.version(0), session, round_s=float(H))


def _buffered(lead) -> dict:  # noqa: ANN001
    return lead.call("Buffered", schema.BufferedRequest(fragment=0, wait_s=0.0))


def _round(state, clock: list[float], t: float, pair: tuple[int, int], leads: list, sessions: list[int]) -> tuple:
    """At ``t``, the first island of ``pair`` pushes (it waits in the buffer), the second completes the quorum:
    (the second's Push reply, the first's Buffered reply)."""
    clock[0] = t
    first, second = pair
    assert not _push(state, leads[first], sessions[first])["answered"]
    answer = _push(state, leads[second], sessions[second])
    assert answer["accepted"] and answer["answered"]
    return answer, _buffered(leads[first])


def test_a_late_merge_is_answered_with_its_share_and_on_time_ones_with_zero(serve) -> None:  # noqa: ANN001
    state, address, clock, _ = serve(True)
    leads, sessions = _islands(state, address)
    shares = []
    for t, pair in ((8.0, (0, 1)), (12.0, (2, 3)), (16.0, (0, 1)), (20.0, (2, 3))):
        answer, waited = _round(state, clock, t, pair, leads, sessions)
        assert waited["buffered"] == []  # merged with the second push
        shares.append((answer["realign"], waited["realign"]))
    assert state.service.syncer.version(0) == 4
    # the first three answers: in phase or not measured yet (no push-to-push gap before t = 16); at t = 20
    # islands 2 and 3 (the Push reply of the one merged at once, the Buffered reply of the one that waited)
    assert shares == [(0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.5, 0.5)]
    assert _buffered(leads[2])["realign"] == 0.0  # said once
    assert state.refused_calls == {}


def test_without_the_rule_the_replies_carry_no_share(serve) -> None:  # noqa: ANN001
    """The rule off (the default): the replies are as before it existed (no ``realign`` field on the wire)."""
    state, address, clock, _ = serve(False)
    leads, sessions = _islands(state, address)
    for t, pair in ((8.0, (0, 1)), (12.0, (2, 3)), (16.0, (0, 1)), (20.0, (2, 3))):
        answer, waited = _round(state, clock, t, pair, leads, sessions)
        assert "realign" not in answer and "realign" not in waited


@pytest.mark.parametrize("share", ["1.0", "-0.1", "NaN", "Infinity", "1e400", "\"0.5\"", "true"])
def test_the_schema_refuses_a_share_out_of_range(share: str) -> None:
    for reply in (b'{"buffered": [], "realign": %s}' % share.encode(),
                  b'{"accepted": true, "answered": true, "version": 1, "realign": %s}' % share.encode()):
        model = schema.BufferedReply if reply.startswith(b'{"buffered"') else schema.PushReply
        with pytest.raises(schema.SchemaError, match="realign"):
            schema.parse(model, reply)
    assert schema.parse(schema.BufferedReply, b'{"buffered": [], "realign": 0.25}').realign == 0.25
    assert schema.parse(schema.BufferedReply, b'{"buffered": [], "realign": 0}').realign == 0.0


def test_the_agreement_carries_a_share_exactly_and_nothing_else() -> None:
    from atoll.runtime.service.agreement import INF, bits_share, share_bits

    for share in (0.0, 0.5, 0.123456789, 1 - 2 ** -52):
        assert bits_share(share_bits(share)) == share and 0 <= share_bits(share) < INF
    for bad in (1.0, -0.1, -0.0, float("nan"), float("inf"), True, None, "0.5"):
        assert share_bits(bad) == 0  # (the bits of 0.0)
    assert bits_share(INF) == 0.0 and bits_share(-1) == 0.0  # no leader's value, or no share's bits


def test_the_island_ignores_a_share_that_is_not_one(fast_config: dict) -> None:
    from atoll.config import build_config
    from atoll.runtime.decoupled_job import prepare_job
    from atoll.strategies.decoupled.island import IslandWorker

    job = prepare_job(build_config(overrides={**fast_config, "strategy": "decoupled", "fragments": 1,
                                              "sync_every": H, "realign_pushes": True}))
    worker = IslandWorker(0, job, total_steps=20)
    worker.pushed_at[0], worker.steps = 3, 5
    for bad in (float("nan"), float("inf"), -0.5, 1.0, 7.0):
        assert worker.realign(0, bad) == 0 and worker.round_step == 0
    assert worker.realign(0, 0.5) == H // 2 and worker.round_step == H // 2


def test_both_ranks_of_an_island_job_apply_the_share_their_leader_received(serve) -> None:  # noqa: ANN001
    """Island 2 as a job of two ranks for its late push (t = 20): each rank uploads its half and downloads its
    half, the leader commits and waits in ``Buffered``; both ranks' Pull of the merge carry the leader's 0.5."""
    from atoll.runtime.service.client import SyncerClient
    from atoll.runtime.service.exchange import ServiceTransport, SlicePlan
    from atoll.strategies.base import make_wire
    from atoll.strategies.decoupled.protocol import Push

    state, address, clock, config = serve(True)
    leads, sessions = _islands(state, address)
    for t, pair in ((8.0, (0, 1)), (12.0, (2, 3)), (16.0, (0, 1))):
        _round(state, clock, t, pair, leads, sessions)
    clock[0] = 20.0
    ranks, index, tps = ThreadRanks(2), state.service.index, state.service.run.tokens_per_step
    clients = [leads[2], SyncerClient(address, 2, CREDS[2], plaintext=True, control=False)]
    transports = [ServiceTransport(clients[r], ranks.rank(r), SlicePlan.whole(index, r, 2),
                                   make_wire(config.strategy_config, [2], config.seed), state.codec, sessions[2],
                                   None, poll_s=0.01) for r in range(2)]
    pulls: list = [None, None]
    base = state.service.syncer.version(0)

    def rank(r: int) -> None:
        a, b = transports[r].plan.send_range(0)
        transports[r].send(Push(2, 0, torch.full((b - a,), 1e-3), H * tps, base))
        pulls[r] = transports[r].settle(0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    while True:  # until island 2's push is committed: it waits for the quorum
        with state.lock:  # (the server's lock: the service sees one call at a time)
            if state.service.buffered(2):
                break
        assert all(t.is_alive() for t in threads), "a rank ended before its push was committed"
        threading.Event().wait(0.01)
    answer = _push(state, leads[3], sessions[3])
    assert answer["answered"] and answer["realign"] == 0.5
    for t in threads:
        t.join(60)
    for tr in transports:
        tr.abort()
    assert not any(t.is_alive() for t in threads)
    (p0,), (p1,) = pulls
    assert p0.realign == p1.realign == 0.5  # the one share, on both ranks
    assert p0.version == p1.version == state.service.syncer.version(0) == base + 1
    assert torch.equal(p0.params, p1.params) and torch.equal(p0.params, state.service.syncer.pull(0).params)


def test_each_shard_answers_its_own_fragments_share(fast_config: dict, tmp_path: Path) -> None:
    """A syncer of 2 shards, one fragment each: the same cadence on both fragments; each push goes to its
    fragment's owner, which measures its own merges and says the share with its own replies (the run's fragment
    index mapped to the shard's): islands 2 and 3 are told 0.5 for both fragments at t = 20, by both shards."""
    from atoll.config import build_config
    from atoll.runtime.service.client import SyncerClient
    from tests.test_service_shards import KEY, _serve

    base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
    config = build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "islands": 4,
                                 "fragments": 2, "sync_every": H, "steps": 64, "quorum": 2,
                                 "grace_window": "round", "realign_pushes": True})
    served = [_serve(config, tmp_path / f"shard_{s}", CREDS, shard=s, shards=2, key=KEY) for s in range(2)]
    try:
        states, addresses = [s for s, _, _ in served], [a for _, a, _ in served]
        clock = [0.0]
        for state in states:
            state.service._now = lambda: clock[0]
        numels, owners = states[0].service.numels, states[0].shards.owners
        assert sorted(owners) == [0, 1]
        tps = states[0].service.run.tokens_per_step
        clients = [[SyncerClient(a, i, CREDS[i], plaintext=True) for a in addresses] for i in range(4)]
        sessions = []
        for i in range(4):
            sessions.append(clients[i][0].call("Join", {"numels": numels, "shards": owners})["session"])
            clients[i][1].call("Hello", {"numels": numels, "shards": owners, "shard": 1, "grant": clients[i][0].grant})
        for i in range(4):
            assert clients[i][0].call("ReserveSteps", {"n": 3 * H})["granted"] == 3 * H

        def push(i: int, g: int) -> dict:
            owner = states[owners[g]]
            data = wire.payload_bytes(owner.codec.encode(torch.full((numels[g],), 1e-3)).tensors)
            version = owner.service.syncer.version(owner.shards.local[g])
            return clients[i][owners[g]].push(data, g, ((0, numels[g]),), H * tps, version, sessions[i],
                                              round_s=float(H), grant=clients[i][0].grant if owners[g] else None)

        shares = {}
        for t, (first, second) in ((8.0, (0, 1)), (12.0, (2, 3)), (16.0, (0, 1)), (20.0, (2, 3))):
            clock[0] = t
            for g in range(2):
                assert not push(first, g)["answered"]
                answer = push(second, g)
                assert answer["answered"]
                waited = clients[first][owners[g]].call("Buffered", schema.BufferedRequest(fragment=g, wait_s=0.0))
                shares[t, g] = (answer["realign"], waited["realign"])
        assert {k: v for k, v in shares.items() if v != (0.0, 0.0)} == {(20.0, 0): (0.5, 0.5), (20.0, 1): (0.5, 0.5)}
        assert [s.service.syncer.commits for s in states] == [4, 4]
    finally:
        for _, _, server in served:
            server.stop(grace=0)
