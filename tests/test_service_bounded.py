"""``atoll syncer`` bounded by construction: transfers admitted per island and in all (so control calls always
have threads), stalled and empty-chunk streams cut, per-island upload quotas counted, a lease bounded by the
island's share, handler exceptions counted by kind, the open-file limit raised at start."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from atoll.runtime.service import bulk, schema, wire

pytest.importorskip("cryptography")  # (grpcio comes with it in the dev extra)

#: seconds a test call may take on a loaded machine (never asserted as a duration: a call past it fails)
PATIENCE_S = 60.0


@pytest.fixture()
def bounded(fast_config: dict, tmp_path: Path):  # noqa: ANN201 - a function serving a syncer of given settings
    """``serve(**settings)`` -> (SyncerServer, address, credentials): a syncer in this process built as ``atoll
    syncer`` builds it (:func:`~atoll.runtime.service.serve.build_server`), plaintext on loopback."""
    from atoll.config import build_config
    from atoll.config.runtimes import ServiceConfig
    from atoll.runtime.service.serve import build_server
    from atoll.runtime.service.server import SyncerServer

    servers, channels = [], []

    def serve(**settings: object) -> tuple:
        base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
        config = build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "fragments": 2,
                                     **settings})
        creds = ["a" * 32, "b" * 32]
        state = SyncerServer.of_run(config, tmp_path / "syncer", creds)
        server = build_server(state, ServiceConfig.of_run(config), config.islands, 2)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return state, f"127.0.0.1:{port}", creds

    serve.channels = channels  # type: ignore[attr-defined]
    yield serve
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(grace=0)


def _channel(serve, address: str) -> grpc.Channel:  # noqa: ANN001
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    serve.channels.append(channel)
    return channel


def _md(island: int, creds: list[str]) -> tuple:
    return ((wire.ISLAND_KEY, str(island)), (wire.CREDENTIAL_KEY, creds[island]))


def _header(upload: str, size: int = 64, ranges: list | None = None) -> bytes:
    return schema.encode(schema.UploadHeader(upload=upload, fragment=0, ranges=ranges or [(0, 4)], size=size))


def _upload(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    return channel.stream_unary(f"/{wire.SERVICE}/Upload")


def _stalled(header: bytes, release: threading.Event) -> Iterator[bytes]:
    yield header
    release.wait(PATIENCE_S)  # sends nothing more until the test ends


def test_stalled_uploads_of_one_island_leave_the_others_calls_their_threads(bounded) -> None:  # noqa: ANN001
    """Island 0 opens 24 uploads that send a header and stall: beyond its ``island_transfers`` they are refused
    (UNAVAILABLE, counted ``transfers``) and island 1's heartbeat and lease are answered; the stalled ones
    are cut after ``chunk_timeout_s`` (counted ``stalled``)."""
    state, address, creds = bounded(island_transfers=3, bulk_slots=4, chunk_timeout_s=10.0)
    release = threading.Event()
    calls = []
    try:
        attacker = _channel(bounded, address)
        for i in range(24):
            calls.append(_upload(attacker).future(_stalled(_header(f"x{i}"), release), metadata=_md(0, creds),
                                                  timeout=PATIENCE_S))
        done = threading.Event()
        for c in calls:
            c.add_done_callback(lambda _: done.set() if sum(x.done() for x in calls) >= 21 else None)
        assert done.wait(PATIENCE_S)  # 21 refused at once; 3 admitted, stalled (until cut)
        honest = _channel(bounded, address)
        heartbeat = honest.unary_unary(f"/{wire.SERVICE}/Heartbeat")
        reply = wire.loads(heartbeat(b"{}", metadata=_md(1, creds), timeout=PATIENCE_S))
        assert reply == {"spent": False}
        # island 1's own transfers still have their slot: one slot left of bulk_slots=4
        own = _upload(honest).future(iter([_header("mine", size=4), b"abcd"]), metadata=_md(1, creds),
                                     timeout=PATIENCE_S)
        assert wire.loads(own.result(timeout=PATIENCE_S)) == {"received": 4}
        codes = [_code(c, PATIENCE_S) for c in calls]  # the stalled ones are cut: each thread back
        assert codes.count(grpc.StatusCode.UNAVAILABLE) == 21 and codes.count(grpc.StatusCode.CANCELLED) == 3
        assert state.refused_calls["transfers"] == 21 and state.refused_calls["stalled"] == 3
        deadline = time.monotonic() + PATIENCE_S  # each cut handler's thread gives its slot back as it ends,
        while state.bulk.open and time.monotonic() < deadline:  # after its caller saw CANCELLED
            time.sleep(0.05)
        assert not state.bulk.open
    finally:
        release.set()


def _code(call: grpc.Future, timeout: float) -> grpc.StatusCode | None:
    try:
        call.result(timeout=timeout)
    except grpc.FutureTimeoutError:
        return None
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_an_upload_of_empty_chunks_is_cut_and_counted(bounded) -> None:  # noqa: ANN001
    state, address, creds = bounded()
    sent = [0]

    def empties() -> Iterator[bytes]:
        yield _header("e")
        for _ in range(100_000):
            sent[0] += 1
            yield b""

    with pytest.raises(grpc.RpcError) as e:
        _upload(_channel(bounded, address))(empties(), metadata=_md(0, creds), timeout=PATIENCE_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty chunk" in e.value.details()
    assert state.refused_calls["empty_chunk"] == 1 and sent[0] < 100_000


def test_an_islands_uploads_over_their_quota_are_dropped_and_counted(bounded, monkeypatch) -> None:  # noqa: ANN001
    """Uploads beyond :data:`~atoll.runtime.service.bulk.ISLAND_UPLOADS` (ids) or
    :data:`~atoll.runtime.service.bulk.ISLAND_RANGES` (ranges) per island: the oldest dropped, counted
    ``quota``; the other island's uploads untouched."""
    monkeypatch.setattr(bulk, "ISLAND_UPLOADS", 4)
    monkeypatch.setattr(bulk, "ISLAND_RANGES", 6)
    state, address, creds = bounded()
    upload = _upload(_channel(bounded, address))
    assert wire.loads(upload(iter([_header("other", size=1), b"z"]), metadata=_md(1, creds))) == {"received": 1}
    for i in range(7):
        upload(iter([_header(f"u{i}", size=1), b"z"]), metadata=_md(0, creds), timeout=PATIENCE_S)
    assert list(state.bulk.uploads[0]) == ["u3", "u4", "u5", "u6"]
    assert state.refused_calls["quota"] == 3
    # three ranges each: two uploads fit the island's 6 ranges, a third drops the oldest
    for i in range(3):
        upload(iter([_header(f"r{i}", size=1, ranges=[(0, 1), (2, 3), (4, 5)]), b"z"]), metadata=_md(0, creds),
               timeout=PATIENCE_S)
    assert list(state.bulk.uploads[0]) == ["r1", "r2"] and list(state.bulk.uploads[1]) == ["other"]
    assert state.refused_calls["quota"] > 3


def test_one_lease_takes_at_most_the_islands_share_of_the_budget(bounded) -> None:  # noqa: ANN001
    state, _, creds = bounded()
    service = state.service
    assert service.budget == 2 * 20
    assert service.reserve_steps(0, creds[0], service.budget) == 20  # its share, not the whole budget
    assert service.reserve_steps(1, creds[1], 7) == 7  # an honest ask is granted in full
    assert service.lease_share(0) == max(20, 2 * 5)


def test_a_handler_exception_is_counted_by_kind_and_answered_internal(bounded, monkeypatch) -> None:  # noqa: ANN001
    state, address, creds = bounded()

    def broken(island: int) -> None:
        raise KeyError("/some/server/path")

    monkeypatch.setattr(state.service, "heartbeat", broken)
    heartbeat = _channel(bounded, address).unary_unary(f"/{wire.SERVICE}/Heartbeat")
    with pytest.raises(grpc.RpcError) as e:
        heartbeat(b"{}", metadata=_md(0, creds), timeout=PATIENCE_S)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "KeyError" in e.value.details()
    assert "/some/server/path" not in e.value.details()
    assert state.gate.errors == {"KeyError": 1} and state.status()["handler_errors"] == {"KeyError": 1}


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    resource = pytest.importorskip("resource")
    from atoll.runtime.service.serve import raise_nofile

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 256)
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip("the hard limit is the soft one here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        got = raise_nofile()
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert now == hard or (hard == resource.RLIM_INFINITY and now == low)
        assert got >= low
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
