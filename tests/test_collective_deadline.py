"""Each exchange of the collective runtime has a deadline sized from its bytes and the configured link
(atoll.runtime.collective.comm.exchange_deadline_s), with ``collective_timeout_s`` as its floor."""

from __future__ import annotations

import textwrap

import pytest
import torch

from atoll.config import build_config
from atoll.errors import ConfigError
from atoll.runtime.collective.comm import DEADLINE_SAFETY, DistComm, exchange_deadline_s
from atoll.runtime.network import Link, ring_allgather_bytes, ring_allreduce_bytes
from tests.conftest import run_ranks


def test_the_deadline_is_the_transfer_time_times_the_safety_factor_plus_latencies_plus_the_floor() -> None:
    link = Link.from_config(1000.0, 10.0)  # 1 Gbit/s, 10 ms
    assert exchange_deadline_s(0, 0, link, 60.0) == 60.0  # a small exchange: the floor alone
    assert exchange_deadline_s(1e9, 2, link, 60.0) == pytest.approx(1e9 * 8 / 1e9 * 4 + 2 * 0.01 + 60.0)
    assert exchange_deadline_s(1e9, 2, link, 60.0, safety=1.0) == pytest.approx(8.0 + 0.02 + 60.0)
    # the case: a 1B-parameter float32 all-reduce over 8 islands at 1 Gbit/s sends 7 GB per island,
    # 56 s on the wire: the old fixed 60 s was also every op's deadline; now 224 s of transfer + 60 s
    sent = ring_allreduce_bytes(4 * 1_000_000_000, 8)
    assert sent == 7e9
    deadline = exchange_deadline_s(sent, 14, link, 60.0)
    assert deadline == pytest.approx(56.0 * DEADLINE_SAFETY + 14 * 0.01 + 60.0) and deadline > 4 * 56.0
    # at the default link (100 Mbit/s) ten times the transfer
    assert exchange_deadline_s(sent, 14, Link.from_config(100.0, 10.0), 60.0) == pytest.approx(
        560.0 * DEADLINE_SAFETY + 0.14 + 60.0)
    for bad in ((-1.0, 0, 60.0), (0.0, -1, 60.0), (0.0, 0, 0.0)):
        with pytest.raises(ValueError, match="exchange_deadline_s"):
            exchange_deadline_s(bad[0], bad[1], link, bad[2])
    with pytest.raises(ValueError, match="safety"):
        exchange_deadline_s(1.0, 1, link, 1.0, safety=0.5)


def test_the_link_is_a_collective_setting() -> None:
    config = build_config(overrides={"runtime": "collective", "collective_link_mbps": 1000,
                                     "collective_link_latency_ms": 30})
    link = config.runtime_config
    assert (link.collective_link_mbps, link.collective_link_latency_ms) == (1000.0, 30.0)
    with pytest.raises(ConfigError, match="^collective_link_mbps"):
        build_config(overrides={"runtime": "collective", "collective_link_mbps": 0})
    with pytest.raises(ConfigError, match="^collective_link_mbps: the local runtime"):
        build_config(overrides={"collective_link_mbps": 1000})


def test_each_exchange_gets_its_deadline_and_the_group_timeout_is_raised_to_it(monkeypatch) -> None:
    """One process of gloo: the deadline of an all-reduce and of an all-gather from their ring bytes, the
    group's own timeout raised (once, when longer), the wait given the deadline."""
    import datetime

    import torch.distributed as dist

    import atoll.runtime.collective.comm as comm_mod

    raised: list[float] = []
    monkeypatch.setattr(comm_mod, "_set_pg_timeout", lambda timeout, group: raised.append(timeout.total_seconds()))
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=5))
    try:
        link = Link.from_config(0.001, 100.0)  # 1 kbit/s: 4000 bytes are 32 s on the wire
        comm = DistComm(1, 0, 1, 0, dist.group.WORLD, None, torch.device("cpu"), link=link, floor_s=5.0)
        comm.islands = 2  # as if one of two islands (the ring's bytes and rounds), over a one-process group
        x = torch.ones(1000)
        work = comm.start_all_reduce_mean([x], weights=[1.0])
        exchange = comm.pending[-1]
        sent = ring_allreduce_bytes(4 * 1000, 2)
        assert exchange.deadline_s == pytest.approx(sent * 8 / 1000 * DEADLINE_SAFETY + 2 * 0.1 + 5.0)
        assert raised == [pytest.approx(exchange.deadline_s)]
        waits: list[float] = []

        class Handle:  # the backend's work, its wait's deadline noted
            def __init__(self, work) -> None:
                self.work = work

            def wait(self, timeout=None):
                waits.append(timeout.total_seconds())
                return self.work.wait(timeout)

        exchange.handle = Handle(exchange.handle)
        assert torch.equal(work.wait(), x)
        assert waits == [pytest.approx(exchange.deadline_s)]
        comm.islands = 1  # (an all-gather must match the group's size)
        comm.all_gather([torch.ones(10)], payload_bytes=40)  # one island sends nothing: the floor, no raise
        assert len(raised) == 1
        assert comm.deadline_s(ring_allgather_bytes(40, 1), 0) == 5.0
        comm.regroup(2, dist.group.WORLD, None)  # new groups have the floor's timeout: raised again when needed
        comm.start_all_reduce_mean([x], weights=[1.0]).wait()
        assert len(raised) == 2
    finally:
        dist.destroy_process_group()


_RANK = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from atoll.runtime.collective.comm import DistComm
    from atoll.runtime.collective.failure import PeerFailure
    from atoll.runtime.network import Link
    rank, mbps = int(os.environ["RANK"]), float(os.environ["LINK_MBPS"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    comm = DistComm(2, rank, 1, 0, dist.group.WORLD, None, torch.device("cpu"), link=Link.from_config(mbps, 0),
                    floor_s=2.0)
    if rank == 1:
        time.sleep(5)  # joins the exchange 5 s late: past the 2 s floor
    try:
        mean = comm.all_reduce_mean([torch.full((1000,), float(rank))], weights=[1.0])
        print("mean", float(mean[0]))
        code = 0
    except PeerFailure as e:
        print("failure", e.reason)
        code = 3
    sys.stdout.flush()
    os._exit(code)
""")


@pytest.mark.slow
@pytest.mark.parametrize(("mbps", "arrives"), [(0.01, True), (1e5, False)], ids=["slow-link", "fast-link"])
def test_a_late_peer_is_waited_for_within_the_exchange_deadline_and_no_longer(mbps: float, arrives: bool) -> None:
    """Two gloo processes whose groups time out at 2 s; rank 1 joins the all-reduce 5 s late. At 10 kbit/s the
    4000 bytes' deadline is about 15 s: the exchange completes (before, gloo failed it at 2 s). At 100 Gbit/s
    the deadline is the 2 s floor: rank 0 fails the exchange with the backend's time-out, as a peer failure."""
    codes, outs, errs = run_ranks(["-c", _RANK], 2, timeout=120, LINK_MBPS=str(mbps))
    if arrives:
        assert codes == [0, 0], [e[-2000:] for e in errs]
        assert all("mean 0.5" in o for o in outs)
    else:
        assert codes[0] == 3, errs[0][-2000:]
        assert "failure" in outs[0] and "timed out" in outs[0].lower()
