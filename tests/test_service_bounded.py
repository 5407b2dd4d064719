"""``atoll syncer`` bounded by construction: transfers admitted per island and in all (so control calls always
have threads), stalled and empty-chunk streams cut, per-island upload quotas counted, a lease bounded by the
island's share, handler exceptions counted by kind, the open-file limit raised at start."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from atoll.runtime.service import bulk, schema, wire
from tests.conftest import free_port

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
    assert service.lease_share(0) == max(20, 2 * 5) and service.lease_hold(0) == 3 * 5
    # its share (20), and of that what an island may hold unused: 3 rounds at its H of 5; not the whole budget
    assert service.reserve_steps(0, creds[0], service.budget) == 15
    assert service.reserve_steps(1, creds[1], 7) == 7  # an honest ask is granted in full


def _clients(state, address: str, creds: list[str]) -> list:  # noqa: ANN001 - both islands joined, plaintext
    from atoll.runtime.service.client import SyncerClient

    clients = [SyncerClient(address, i, creds[i], plaintext=True) for i in range(2)]
    for c in clients:
        c.call("Join", schema.JoinRequest(numels=state.service.syncer.numels))
    return clients


def _lease(client, n: int, used: int | None = None, received: int | None = None) -> dict:  # noqa: ANN001
    return client.call("ReserveSteps", schema.ReserveStepsRequest(n=n, used=used, received=received), retry=False)


def test_an_island_that_reports_no_steps_used_holds_at_most_three_rounds_then_is_refused(bounded) -> None:  # noqa: ANN001
    """A stranger with island 0's credential that asks a round (H = 5) again and again and reports ``used`` 0
    forever is granted 3 rounds (:meth:`~atoll.runtime.service.syncer.SyncerService.lease_hold`: its lease, one
    ahead, its credit), then refused ("ask again": ``wait``), each refusal counted ``lease``; before, it took
    lease after lease until the budget was spent. Once it reports steps used it is granted as many again; a
    ``used`` below its last is refused (``used``); one above its grant and credit counts as that much."""
    state, address, creds = bounded()
    service = state.service
    liar, honest = _clients(state, address, creds)
    replies = [_lease(liar, 5, used=0) for _ in range(8)]
    assert [r["granted"] for r in replies] == [5, 5, 5, 0, 0, 0, 0, 0]
    assert all(r.get("wait") for r in replies[3:]) and state.refused_calls == {"lease": 5}
    assert _lease(liar, 20, used=0) == {"granted": 0, "wait": True}  # its share at once: refused too
    assert service.reserved == 15 and service.islands[0].leased == 15
    assert _lease(honest, 5, used=0)["granted"] == 5  # the other island is granted as before
    # it reports 5 used: granted 5 more (at most 15 unused again)
    assert _lease(liar, 20, used=5)["granted"] == 5 and service.islands[0].leased == 20
    assert _lease(liar, 5, used=4) == {"granted": 0, "wait": True}  # fewer used than it said before
    assert state.refused_calls == {"lease": 6, "used": 1} and service.reserved == 25
    # more than its grant (20) and credit (5, one round) counts as 25; it may take what it says it used
    assert _lease(liar, 5, used=1000)["granted"] == 5
    assert service.islands[0].reported == 25 and service.islands[0].sessions[-1].steps == 25
    assert _lease(liar, 5, used=24) == {"granted": 0, "wait": True} and state.refused_calls["used"] == 2
    status = state.status()["refused_calls"]
    assert status == {"lease": 6, "used": 2}


def test_the_lease_bound_holds_across_a_syncer_restart_and_a_rejoin_gives_the_held_steps_back(bounded) -> None:  # noqa: ANN001
    """The island's lease record (granted, reported used) is in the syncer's ledger: a syncer restarted on its
    folder still refuses the island that holds 3 rounds unused, and grants its session's honest continuation
    (``used`` grown). A new join (a torchrun restart: a new session) gives the steps its last session held
    unused back to the budget (not to the ledger) and its reports start again from 0."""
    from atoll.runtime.service.client import SyncerClient

    state, address, creds = bounded()
    liar, _ = _clients(state, address, creds)
    assert [_lease(liar, 5, used=0)["granted"] for _ in range(4)] == [5, 5, 5, 0]
    restarted, address, _ = bounded()  # the same folder: continues from its ledger
    service = restarted.service
    assert service.restarts == 1 and service.reserved == 15 and service.islands[0].leased == 15
    again = SyncerClient(address, 0, creds[0], plaintext=True)
    again.session = liar.session
    assert _lease(again, 5, used=0) == {"granted": 0, "wait": True} and restarted.refused_calls == {"lease": 1}
    assert _lease(again, 5, used=10)["granted"] == 5 and service.islands[0].reported == 10
    assert _lease(again, 5, used=9) == {"granted": 0, "wait": True} and restarted.refused_calls["used"] == 1
    granted = service.syncer.bounds.granted[0]
    again.call("Join", schema.JoinRequest(numels=service.syncer.numels))  # a new session
    assert service.reserved == 10 and service.islands[0].leased == 0 and service.islands[0].reported == 0
    assert service.syncer.bounds.granted[0] == granted  # (it may have pushed tokens of steps it never reported)
    assert _lease(again, 5, used=0)["granted"] == 5


def test_a_lease_record_of_an_older_session_is_closed_by_a_call_of_the_newer_one(bounded) -> None:  # noqa: ANN001
    """A syncer restarted from a checkpoint older than the island's join, without its ledger, holds the lease
    record of the island's session before: the island's first call carrying its present session closes that
    record as the join would have (its unused steps back to the budget), so its ``used`` is never compared
    with the older session's and it is not refused."""
    state, address, creds = bounded()
    service = state.service
    me, _ = _clients(state, address, creds)
    assert _lease(me, 5, used=0)["granted"] == 5 and _lease(me, 5, used=5)["granted"] == 5
    assert service.reserved == 10 and service.islands[0].reported == 5
    me.session += 1  # its join the restarted syncer never saw
    assert _lease(me, 5, used=0)["granted"] == 5 and state.refused_calls == {}
    assert service.islands[0].sessions[-1].session == me.session and service.islands[0].leased == 5
    assert service.reserved == 10 and service.islands[0].steps == 10  # 5 of the older session's, 5 of this one's


def test_steps_whose_tokens_a_push_claimed_count_as_used_whatever_the_island_reports(bounded) -> None:  # noqa: ANN001
    """An island that pushed the tokens of 10 steps and reports ``used`` 0 is counted as having used 10: its
    Leave gives back the 5 it did not claim (before: all 15, the budget and ledger of steps it was merged
    for), and the steps it may hold unused count from those 10."""
    import torch

    state, address, creds = bounded()
    service = state.service
    liar, _ = _clients(state, address, creds)
    assert _lease(liar, 15, used=0)["granted"] == 15
    n = service.syncer.numels[0]
    payload = wire.payload_bytes(state.codec.encode(torch.full((n,), 1e-4)).tensors)
    tokens = 10 * service.run.tokens_per_step
    assert liar.push(payload, 0, ((0, n),), tokens, 0, liar.session)["accepted"]
    assert service.syncer.bounds.claimed[0][0] == tokens
    assert _lease(liar, 20, used=0)["granted"] == 10  # 5 held unused: room for 10
    assert service.islands[0].lease_used == 10
    assert liar.call("Leave", schema.LeaveRequest(used=0))["returned"] == 25 - 10
    assert service.islands[0].steps == 10 and service.syncer.bounds.granted[0] == tokens


def test_an_honest_lease_whose_replies_are_lost_is_granted_them_again_never_refused(
        bounded, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """An honest :class:`~atoll.runtime.service.lease.StepLease` whose ``ReserveSteps`` replies are lost four
    times in a row (the syncer granted, the island never heard) trains on credit meanwhile; its next fetch says
    how many steps it received and is granted the lost ones again, from the budget already taken: it takes
    its whole share and is never refused (before: the lost steps would count as held unused, and 3 rounds of
    them refuse it)."""
    from atoll.runtime.service.lease import GO, STOP, StepLease
    from tests.test_service import _take, _Unavailable

    state, address, creds = bounded()
    service = state.service
    me, _ = _clients(state, address, creds)
    tps = service.run.tokens_per_step
    lease = StepLease(me, size=5, offline_steps=5, tokens_per_step=tps, fragments=2)
    real_call, lose = me.call, [4]

    def call(name: str, payload: object = None, timeout_s: float = 30.0, retry: bool = True,
             bulk: bool = False) -> dict:
        reply = real_call(name, payload, timeout_s, retry, bulk)
        if name == "ReserveSteps" and lose[0] > 0 and reply.get("granted"):
            lose[0] -= 1
            raise _Unavailable()  # granted, and the reply never reached the island
        return reply

    monkeypatch.setattr(me, "call", call)
    try:
        for _ in range(20):  # its share: steps 20, as the budget is shared by 2 islands of 20
            _take(lease, GO)
        assert lose[0] == 0 and lease.offline_steps_taken > 0
        service.stop()  # no more steps: it ends its lease
        while lease.leased:
            _take(lease, GO)
        _take(lease, STOP)
    finally:
        lease.close()
    assert "lease" not in state.refused_calls and "used" not in state.refused_calls
    assert lease.received == service.islands[0].leased  # every step granted reached it in the end
    assert service.islands[0].reported <= lease.used


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


#: idle connections of the flood: more than an inherited soft limit of 1,024 open files
FLOOD = 1_100
#: the HTTP/2 client connection preface (RFC 9113 section 3.4): the magic and an empty SETTINGS frame (length 0,
#: type 4, no flags, stream 0): a connection that has done its handshake, then says nothing more
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _descriptors(pid: int) -> int:
    """Open file descriptors of process ``pid`` now (Linux's /proc)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_idle_strangers_connections_past_an_inherited_1024_file_limit_leave_the_islands_calls_answered(
        fast_config: dict, tmp_path: Path) -> None:
    """A real ``atoll syncer`` started with a soft ``RLIMIT_NOFILE`` of 1,024 (its hard limit kept) takes 1,100
    idle loopback connections that send the HTTP/2 preface and nothing more; after them an island's heartbeat
    (its credential) is answered and the syncer goes on writing its status. Without the soft limit raised at
    start (:func:`~atoll.runtime.service.serve.raise_nofile`) the 1,025th descriptor fails (EMFILE) and nothing
    is answered (issue #35, item 10). gRPC counts none of it (no hook for a connection without a call): what
    shows the flood is the syncer's own descriptors, more than 1,024."""
    resource = pytest.importorskip("resource")
    from tests.test_service import run_flags

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("counts descriptors in /proc (Linux)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 512  # this process's own ends of the flood, and its usual files
    if hard != resource.RLIM_INFINITY and hard < need + 256:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room for {FLOOD} connections")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))

    def inherited_1024() -> None:  # (in the child, before exec) the soft limit a login shell often gives
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    out, port = tmp_path / "syncer", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    log = tmp_path / "syncer.log"
    syncer = subprocess.Popen([sys.executable, "-m", "atoll", "syncer", "--listen", f"127.0.0.1:{port}", "--out",
                               str(out), *run_flags(fast_config)], stdout=log.open("w"), stderr=subprocess.STDOUT,
                              env=env, start_new_session=True, preexec_fn=inherited_1024)
    flood: list[socket.socket] = []
    try:
        deadline = time.monotonic() + PATIENCE_S
        while "listening on" not in log.read_text():
            assert syncer.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"the syncer did not listen: {log.read_text()}"
            time.sleep(0.2)
        creds = [(out / "credentials" / f"island_{i}.token").read_text().strip() for i in range(2)]
        # its own files and the listening socket: the least of a second's readings (a reading may catch a file it
        # holds for a moment, its status being written, which would ask one stranger's descriptor too many)
        readings = []
        for _ in range(10):
            readings.append(_descriptors(syncer.pid))
            time.sleep(0.1)
        base = min(readings)
        for _ in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S)
            s.sendall(PREFACE)
            flood.append(s)
        # the server accepts them on its own threads: until it holds them all, or takes no more for 3 s
        # (before its handshake timeout, HANDSHAKE_S, closes them: the island calls while they are held)
        held, deadline = [_descriptors(syncer.pid)], time.monotonic() + PATIENCE_S
        while held[-1] < base + FLOOD and time.monotonic() < deadline and (len(held) < 30 or held[-30] < held[-1]):
            time.sleep(0.1)
            held.append(_descriptors(syncer.pid))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        try:
            heartbeat = channel.unary_unary(f"/{wire.SERVICE}/Heartbeat")
            # (no wait for ready: a connection refused is UNAVAILABLE now, not retried)
            reply = wire.loads(heartbeat(b"{}", metadata=_md(1, creds), timeout=PATIENCE_S))
        finally:
            channel.close()
        assert reply == {"spent": False}
        # every stranger held a descriptor of the syncer's (none refused by its connection cap)
        assert max(held) >= base + FLOOD > 1024 and syncer.poll() is None, (held[-5:], base, log.read_text())
        deadline = time.monotonic() + PATIENCE_S  # and it goes on: the status it writes counts the heartbeat
        while time.monotonic() < deadline:
            try:
                written = json.loads((out / "service" / "status.json").read_text())
            except (OSError, ValueError):
                written = {}
            if written.get("calls", {}).get("Heartbeat") == 1:
                break
            time.sleep(0.2)
        assert written["calls"] == {"Heartbeat": 1} and written["refused_calls"] == {}
        assert written["handler_errors"] == {}
        assert "Too many open files" not in log.read_text()
    finally:
        for s in flood:
            s.close()
        syncer.kill()
        syncer.wait(timeout=PATIENCE_S)
