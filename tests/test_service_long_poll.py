"""The long poll ``Buffered`` attacked: bad ``wait_s``, the cap, a stopped server, the client's loop."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from conftest import service_clients as _clients

from atoll.runtime.service import wire

pytest.importorskip("cryptography")


def _buffered_push(state, address, creds):  # noqa: ANN001, ANN202
    lead, _, other, s0, s1 = _clients(state, address, creds)
    assert other.call("ReserveSteps", {"n": 5})["granted"] == 5
    n, tps = state.service.syncer.numels[0], state.service.run.tokens_per_step
    step = wire.payload_bytes(state.codec.encode(torch.full((n,), 1e-3)).tensors)
    assert not lead.push(step, 0, ((0, n),), 5 * tps, 0, s0)["answered"]  # in the buffer: quorum 2
    return lead, other, step, s1


@pytest.mark.parametrize("wait_s", [10 ** 400, -(10 ** 400)], ids=["huge", "huge-negative"])
def test_a_huge_int_wait_s_is_answered_cleanly(syncer, wait_s: int) -> None:  # noqa: ANN001, F811
    """A JSON int too large for a float is no number of seconds: refused at parse by the schema (INVALID_ARGUMENT,
    counted as ``schema``) like any negative one; never an exception in the handler (UNKNOWN, which the islands'
    client even retries), and no waiting slot taken."""
    state, address, creds = syncer(quorum=2, grace_window="round")
    lead, *_ = _buffered_push(state, address, creds)
    with pytest.raises(grpc.RpcError) as bad:
        lead.call("Buffered", {"fragment": 0, "wait_s": wait_s}, retry=False)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value.details()
    assert bad.value.details().startswith("Buffered: wait_s: ")
    assert state.refused_calls == {"schema": 1}
    assert state.waiting == [0, 0]


def test_the_islands_wait_loop_does_not_spin_when_answered_at_once(syncer) -> None:  # noqa: ANN001, F811
    """An island's waiting slots taken (here by calls on its other fragment's push; in a run, a stale call of an
    earlier incarnation of its leader that the syncer still holds, or a syncer older than the long poll, which
    answers at once): each ``Buffered`` is answered at once with the push still buffered. The leader's wait
    (``ServiceTransport._commit``) must not then call ``Buffered`` back to back (thousands of calls a second,
    each on the syncer's lock): at most one per poll interval."""
    from types import SimpleNamespace

    from atoll.runtime.service.exchange import Outgoing, ServiceTransport

    state, address, creds = syncer(quorum=2, grace_window="round")
    lead, _, other, s0, s1 = _clients(state, address, creds)
    assert other.call("ReserveSteps", {"n": 10})["granted"] == 10
    numels, tps = state.service.syncer.numels, state.service.run.tokens_per_step
    steps = [state.codec.encode(torch.full((n,), 1e-3)).tensors for n in numels]
    assert not lead.push(wire.payload_bytes(steps[1]), 1, ((0, numels[1]),), 5 * tps, 0, s0)["answered"]
    held = [threading.Thread(target=lambda: lead.call("Buffered", {"fragment": 1, "wait_s": 5}, retry=False))
            for _ in range(2)]  # the cap: one per fragment of the shard (two), both on fragment 1
    for t in held:
        t.start()
    while state.waiting[0] < 2:
        time.sleep(0.01)
    transport = ServiceTransport.__new__(ServiceTransport)  # what _commit reads, for island 0's leader
    transport.route, transport.poll_s, transport.lease, transport.ranks_move = [lead, lead], 0.02, None, False
    transport.plan, transport.session, transport.refused = SimpleNamespace(numels=numels), s0, 0
    before = state.calls["Buffered"]
    waiter = threading.Thread(target=transport._commit,
                              args=(0, 1, Outgoing(steps[0], 5 * tps, 0, 600.0, 0), 5 * tps, None))
    waiter.start()
    time.sleep(1.0)
    calls = state.calls["Buffered"] - before
    for p in (0, 1):  # island 1's pushes: the quorum of each, merged
        assert other.push(wire.payload_bytes(steps[p]), p, ((0, numels[p]),), 5 * tps, 0, s1)["answered"]
    waiter.join(30)
    for t in held:
        t.join(30)
    assert not waiter.is_alive() and state.waiting == [0, 0] and state.service.syncer.version(0) == 1
    assert calls <= 1.0 / transport.poll_s + 5, f"{calls} Buffered calls in 1 s while the push waited"


def test_a_long_poll_ends_soon_after_the_server_stops(syncer) -> None:  # noqa: ANN001, F811
    """server.stop(grace): the waiting handler returns (its slot freed) shortly after the grace ends."""
    state, address, creds = syncer(quorum=2, grace_window="round")
    lead, *_ = _buffered_push(state, address, creds)
    import atoll.runtime.service.server  # noqa: F401

    got: list = []
    t = threading.Thread(target=lambda: got.append(_try(lead)))
    t.start()
    while state.waiting[0] < 1:
        time.sleep(0.01)
    servers = [s for s in _servers()]
    assert servers
    t0 = time.monotonic()
    for s in servers:
        s.stop(grace=0.5)
    while state.waiting[0] and time.monotonic() - t0 < 30:  # (within about 0.5 s past the grace on an idle host)
        time.sleep(0.01)
    assert state.waiting == [0, 0]  # not held until its 5 s are over: the slot is freed as the server stops
    t.join(10)


def _try(client):  # noqa: ANN001, ANN202
    try:
        return client.call("Buffered", {"fragment": 0, "wait_s": 5}, retry=False)
    except grpc.RpcError as e:
        return e.code()


def _servers() -> list:
    import gc

    return [o for o in gc.get_objects() if type(o).__name__ == "_Server" and hasattr(o, "stop")]


def test_a_tick_wakes_the_waiting_calls_only_when_a_buffer_changed(syncer) -> None:  # noqa: ANN001, F811
    """The syncer's poll thread ticks ten times a second: it wakes the waiting ``Buffered`` calls (each a lock
    and a scan of the buffers) only when a push left a buffer (a grace window closed), not at every tick."""
    state, address, creds = syncer(quorum=2, grace_window="round")
    _buffered_push(state, address, creds)
    woken = []
    real = state.changed.notify_all
    state.changed.notify_all = lambda: (woken.append(1), real())[1]
    try:
        for _ in range(3):  # the push waits for a second island's: nothing left a buffer
            state.tick()
        assert woken == [] and state._buffer_counts()[0] == 1
        state.service.syncer.buffers[0].grace_s = 0.0  # its grace window is due: the next tick merges it
        state.service.syncer.buffers[0].opened_at -= 1.0
        state.tick()
    finally:
        state.changed.notify_all = real
    assert state._buffer_counts()[0] == 0 and woken == [1]
