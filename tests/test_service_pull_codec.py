"""The pull codec (``pull_codec``) through the syncer service: ``Download`` serves the pull codec's payloads since
the version an island holds (or the full fragment at its start, its rejoin, or when it fell behind the payloads
kept), the island job's leader downloads it and every rank decodes it onto its copy.

The syncer is a gRPC server in this process on loopback (as tests/test_service_realign.py); island 0 is a job of
two ranks as threads (:class:`~conftest.ThreadRanks`), island 1 a leader of one rank pushing through its
client. Quorum 1: every push merges at once. Invariant checked over many rounds: each rank's copy of the global
fragment is the syncer's shadow Q bit for bit (what the local and Ray runtimes' islands hold), within one int8
delta's error of the global fragment G, never drifting; bytes received are the int8 payloads' (n + 4 ceil(n / 64)
per version behind), the full fragment's 4 n at the start and rejoin.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from conftest import ThreadRanks

from atoll.runtime.service import schema, wire

pytest.importorskip("cryptography")  # (grpcio comes with it in the dev extra)

CREDS = [c * 32 for c in "ab"]


@pytest.fixture
def served(fast_config: dict, tmp_path: Path):  # noqa: ANN201 - (server state, address, config)
    """A syncer of two islands with int8 pulls, one fragment, quorum 1, in this process (plaintext, loopback)."""
    from concurrent import futures

    import grpc

    from atoll.config import build_config
    from atoll.runtime.service.server import SyncerServer

    base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
    config = build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "islands": 2,
                                 "fragments": 1, "sync_every": 8, "steps": 4000, "quorum": 1,
                                 "codec": "int4", "pull_codec": "int8"})
    state = SyncerServer.of_run(config, tmp_path / "syncer", CREDS)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[state.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield state, f"127.0.0.1:{port}", config
    server.stop(grace=0)


def _int8_bytes(n: int) -> int:
    return n + 4 * math.ceil(n / 64)


def _job(state, address: str, config, session: int, lead):  # noqa: ANN001, ANN202
    """Island 0 as a job of two ranks: their transports (the leader's client ``lead``)."""
    from atoll.runtime.service.client import SyncerClient
    from atoll.runtime.service.exchange import ServiceTransport, SlicePlan
    from atoll.strategies.base import make_wire
    from atoll.strategies.decoupled.downlink import pull_codec

    ranks = ThreadRanks(2)
    clients = [lead, SyncerClient(address, 0, CREDS[0], plaintext=True, control=False)]
    codec = pull_codec("int8", config.strategy_config.codec_block_size)
    return [ServiceTransport(clients[r], ranks.rank(r), SlicePlan.whole(state.service.index, r, 2),
                             make_wire(config.strategy_config, [0], config.seed), state.codec, session, None,
                             poll_s=0.005, pull_codec=codec) for r in range(2)], clients, codec


def _both(fn) -> list:  # noqa: ANN001 - fn(r) on both ranks at once, in threads; their results
    out: list = [None, None]

    def run(r: int) -> None:
        out[r] = fn(r)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return out


def test_an_island_job_holds_the_syncers_shadow_over_many_rounds_with_int8_pulls(served) -> None:  # noqa: ANN001
    from atoll.runtime.service.client import SyncerClient
    from atoll.strategies.decoupled.downlink import apply_pull
    from atoll.strategies.decoupled.protocol import Push

    state, address, config = served
    syncer, tps = state.service.syncer, state.service.run.tokens_per_step
    n = syncer.numels[0]
    leads = [SyncerClient(address, i, CREDS[i], plaintext=True) for i in range(2)]
    sessions = [c.call("Join", {"numels": syncer.numels})["session"] for c in leads]
    transports, clients, codec = _job(state, address, config, sessions[0], leads[0])
    start = _both(lambda r: transports[r].start())
    held = [pulls[0].params.clone() for pulls in start]  # the full fragment at the start: float32
    version = start[0][0].version
    assert start[0][0].deltas == () and torch.equal(held[0], syncer.downlink.shadow[0])
    expected = 4 * n  # bytes received: the start's full fragment
    gen = torch.Generator().manual_seed(0)
    errors = []
    for k in range(24):
        behind = k % 3  # island 1 pushes 0, 1 or 2 times first: island 0's pull then carries 1, 2 or 3 versions
        for _ in range(behind):
            assert leads[1].call("ReserveSteps", {"n": 1})["granted"] == 1
            delta = torch.randn(n, generator=gen) * 1e-3
            answer = leads[1].push(wire.payload_bytes(state.codec.encode(delta).tensors), 0, ((0, n),), tps,
                                   syncer.version(0), sessions[1])
            assert answer["accepted"] and answer["answered"]
        deltas = torch.randn(n, generator=gen) * 1e-3
        assert leads[0].call("ReserveSteps", {"n": 1})["granted"] == 1

        def exchange(r: int, deltas: torch.Tensor = deltas, version: int = version) -> object:
            a, b = transports[r].plan.send_range(0)
            transports[r].send(Push(0, 0, deltas[a:b].clone(), tps, version))
            (pull,) = transports[r].settle(0)
            return pull

        pulls = _both(exchange)
        assert pulls[0].params is None and pulls[0].since == version  # the int8 payloads since the version held
        assert len(pulls[0].deltas) == behind + 1 == pulls[0].version - version
        expected += (behind + 1) * _int8_bytes(n)
        held = [apply_pull(p, h, version, codec) for p, h in zip(pulls, held, strict=True)]
        version = pulls[0].version
        assert version == syncer.version(0)
        q, g = syncer.downlink.shadow[0], syncer.outer[0].params
        assert torch.equal(held[0], q) and torch.equal(held[1], q)  # every rank: the syncer's shadow, bit for bit
        errors.append(float((held[0] - g).abs().max()))
    # within one int8 delta's error of G (a delta is at most a few 1e-3 here: half a step of 127 levels), no drift
    assert max(errors) < 1e-4 and max(errors[-6:]) < 2 * max(errors[:6]), errors
    assert transports[0].bytes_received == expected and transports[1].bytes_received == 0
    # on the wire: the leader's downloads alone, each its payloads plus a safetensors header
    assert clients[1].bytes_down == 0
    assert expected < clients[0].bytes_down == state.bulk.bytes_out_by_island[0] < expected + 25 * 400
    for tr in transports:
        tr.abort()

    # the island's job restarts (a rank's crash ends it): it starts from the full fragment, Q in float32
    transports, clients, _ = _job(state, address, config, sessions[0], leads[0])
    again = _both(lambda r: transports[r].start())
    assert again[0][0].params is not None and torch.equal(again[0][0].params, syncer.downlink.shadow[0])
    assert torch.equal(again[1][0].params, again[0][0].params) and transports[0].bytes_received == 4 * n
    for tr in transports:
        tr.abort()


def test_a_pull_behind_the_payloads_kept_is_the_full_fragment_and_resumes_only_in_the_same_answer(served) -> None:  # noqa: ANN001
    """An island at a version older than the payloads kept gets the full fragment (``since`` None); a
    resumption continues at its offset only in the same answer (version and since), else from 0; ranges are
    refused with a pull codec."""
    import grpc

    from atoll.runtime.service.client import SyncerClient

    state, address, _ = served
    syncer, tps = state.service.syncer, state.service.run.tokens_per_step
    n = syncer.numels[0]
    other, lead = (SyncerClient(address, i, CREDS[i], plaintext=True) for i in range(2))
    other.call("Join", {"numels": syncer.numels})  # (the islands start together)
    session = lead.call("Join", {"numels": syncer.numels})["session"]
    keep = syncer.downlink.keep[0]
    for _ in range(keep + 1):
        assert lead.call("ReserveSteps", {"n": 1})["granted"] == 1
        delta = torch.full((n,), 1e-3)
        lead.push(wire.payload_bytes(state.codec.encode(delta).tensors), 0, ((0, n),), tps, syncer.version(0), session)
    v = syncer.version(0)
    assert v == keep + 1
    full = lead.download_bytes(0, have=0)  # behind the payloads kept: the full fragment, Q
    assert full[:2] == (v, None) and torch.equal(wire.bytes_tensor(full[2]), syncer.downlink.shadow[0])
    cached = len(state.bulk.pulls)
    for have in (v + 1, v + 10**6):  # versions no island holds: the same full fragment, no new cache entry each
        assert lead.download_bytes(0, have=have) == full
    assert len(state.bulk.pulls) == cached
    version, since, data = lead.download_bytes(0, have=v - 1)
    assert (version, since) == (v, v - 1) and len(data) < _int8_bytes(n) + 400
    assert torch.equal(wire.bytes_deltas(data, state.bulk.service.syncer.downlink.codec, n, 1)[0].tensors["values"],
                       syncer.downlink.deltas[0][-1][1].tensors["values"])
    stub = lead.bulk.unary_stream(wire.method("Download"))

    def header(**ask: object) -> dict:
        replies = stub(schema.encode(schema.DownloadRequest(fragment=0, **ask)), metadata=lead.metadata, timeout=30)
        head = wire.loads(next(replies))
        head["body"] = b"".join(replies)
        return head

    epoch = state.service.restarts  # (0: this syncer never restarted)
    resumed = header(have=v - 1, version=v, since=v - 1, epoch=epoch, offset=100)
    assert resumed["offset"] == 100 and resumed["body"] == bytes(data[100:])
    assert header(have=v - 1, version=v, since=None, epoch=epoch, offset=100)["offset"] == 0  # another answer: from 0
    # bytes held of the same version and since before the syncer restarted (another epoch: a lost commit's
    # version is numbered again) are another answer too; and a request that names no epoch starts from 0
    assert header(have=v - 1, version=v, since=v - 1, epoch=epoch + 1, offset=100)["offset"] == 0
    assert header(have=v - 1, version=v, since=v - 1, offset=100)["offset"] == 0
    with pytest.raises(grpc.RpcError) as e:
        header(ranges=[[0, 10]], have=v - 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ranges" in e.value.details()


def test_a_sharded_ranks_part_of_a_delta_pull_is_the_decoded_payloads_part() -> None:
    """A rank of a sharded island keeps its part of each payload, decoded (codec "fp32"): adding them to its part
    of the copy gives the part of the whole copy's values, bit for bit."""
    from atoll.algorithms.codec_base import Encoded
    from atoll.runtime.service import slices
    from atoll.strategies.decoupled.downlink import apply_pull, pull_codec
    from atoll.strategies.decoupled.protocol import Pull

    codec = pull_codec("int8")
    gen = torch.Generator().manual_seed(1)
    held, encs = torch.randn(300, generator=gen), tuple(codec.encode(torch.randn(300, generator=gen)) for _ in range(2))
    whole = apply_pull(Pull(0, None, 5, deltas=encs, since=3), held, 3, codec)
    ranges = ((10, 70), (200, 230))
    part = Pull(0, None, 5, since=3, deltas=tuple(Encoded({"values": slices.take(codec.decode(e), ranges)}, 90, "fp32")
                                                  for e in encs))
    assert torch.equal(apply_pull(part, slices.take(held, ranges), 3, codec), slices.take(whole, ranges))


def test_versions_behind_the_payloads_kept_share_the_one_full_fragment_answer(served, monkeypatch) -> None:  # noqa: ANN001
    """Islands (or a stranger) at distinct versions older than the payloads kept are each answered with the full
    fragment: it is serialized once and cached once, not once per version asked (each evicting the others)."""
    from atoll.runtime.service import bulk
    from atoll.runtime.service.client import SyncerClient

    made: list[int] = []
    real = bulk.wire.tensor_bytes
    monkeypatch.setattr(bulk.wire, "tensor_bytes", lambda t: made.append(t.numel()) or real(t))
    state, address, _ = served
    syncer, tps = state.service.syncer, state.service.run.tokens_per_step
    n = syncer.numels[0]
    other, lead = (SyncerClient(address, i, CREDS[i], plaintext=True) for i in range(2))
    other.call("Join", {"numels": syncer.numels})
    session = lead.call("Join", {"numels": syncer.numels})["session"]
    keep = syncer.downlink.keep[0]
    for _ in range(keep + 3):
        assert lead.call("ReserveSteps", {"n": 1})["granted"] == 1
        lead.push(wire.payload_bytes(state.codec.encode(torch.full((n,), 1e-3)).tensors), 0, ((0, n),), tps,
                  syncer.version(0), session)
    full = lead.download_bytes(0, have=None)
    assert made == [n]
    for have in (0, 1, 2):  # each behind the payloads kept (keep + 3 versions): the full fragment, Q
        assert lead.download_bytes(0, have=have) == full
    assert made == [n] and len(state.bulk.pulls) == 1
    assert lead.download_bytes(0, have=syncer.version(0) - 1)[1] == syncer.version(0) - 1  # a kept one: deltas
