"""The checkpoint writer off the critical path (atoll.job.async_save): newest state wins, errors surface."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from atoll.job.async_save import LatestStateWriter
from atoll.job.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def test_writes_on_its_own_thread_and_keeps_only_the_newest_pending_state() -> None:
    gate, started, written, threads = threading.Event(), threading.Event(), [], []

    def write(state: int) -> None:
        threads.append(threading.current_thread().name)
        started.set()
        gate.wait(10)
        written.append(state)

    writer = LatestStateWriter(write)
    writer.submit(1)
    assert started.wait(10)
    for state in (2, 3, 4):  # handed in while 1 is being written: only the newest, 4, is written next
        writer.submit(state)
    assert written == [], "submit returns while the write is in progress"
    gate.set()
    assert writer.flush(10)
    assert written == [1, 4] and writer.written == 2 and writer.coalesced == 2
    assert set(threads) == {"atoll-checkpoint-writer"}


def test_a_failed_write_is_raised_on_the_callers_thread_once() -> None:
    def write(state: int) -> None:
        if state == 1:
            raise OSError(28, "No space left on device")

    writer = LatestStateWriter(write)
    writer.submit(1)
    with pytest.raises(OSError, match="No space"):
        writer.flush(10)
    writer.submit(2)
    assert writer.flush(10) and writer.written == 1


def test_the_syncer_state_written_in_the_background_loads_back(tmp_path: Path) -> None:
    from atoll.strategies.decoupled.protocol import Push
    from atoll.strategies.decoupled.syncer import Syncer

    s = Syncer(torch.arange(8.0), None, islands=1, outer_lr=1.0, outer_momentum=0.0)
    writer = LatestStateWriter(lambda item: save_checkpoint(tmp_path, item[0], item[1]))
    s.push(Push(0, 0, torch.full((8,), 0.5), 10, 0))
    writer.submit((s.commits, {"syncer": s.state_dict()}))
    s.push(Push(0, 0, torch.full((8,), 0.5), 10, 1))  # the actor goes on while the write runs
    assert writer.flush(30)
    _, state = load_checkpoint(latest_checkpoint(tmp_path))
    restored = Syncer(torch.zeros(8), None, islands=1, outer_lr=1.0, outer_momentum=0.0)
    restored.load_state_dict(state["syncer"])
    assert restored.commits == 1 and torch.equal(restored.global_params(), torch.arange(8.0) - 0.5)


def test_every_state_handed_in_is_given_back_once_written_or_replaced() -> None:
    """``on_done`` hears of each state once the writer no longer reads it: after its write (written or failed)
    or when a newer one replaced it before its write; never twice, never before."""
    gate, started, done = threading.Event(), threading.Event(), []

    def write(state: int) -> None:
        started.set()
        gate.wait(10)
        if state == 4:
            raise OSError(28, "No space left on device")

    writer = LatestStateWriter(write, on_error=lambda e: None, on_done=done.append)
    writer.submit(1)
    assert started.wait(10)
    writer.submit(2)
    writer.submit(3)  # replaces 2 before its write, while 1 is being written
    writer.submit(4)
    assert done == [2, 3], "replaced states are given back at once: a slow write holds no queue of them"
    gate.set()
    assert writer.flush(10)
    assert done == [2, 3, 1, 4] and writer.failed == 1 and writer.written == 1  # (4's write failed)


def test_a_state_refused_for_an_earlier_error_is_given_back() -> None:
    done = []

    def write(state: int) -> None:
        if state == 1:
            raise OSError(28, "No space left on device")

    given = threading.Event()
    writer = LatestStateWriter(write, on_done=lambda state: (done.append(state), given.set()))
    writer.submit(1)
    assert given.wait(10)  # (told after the failed write's error is kept)
    with pytest.raises(OSError, match="No space"):
        writer.submit(2)  # refused with the earlier write's error: no write will read it
    assert done == [1, 2]


def test_a_failure_to_give_a_state_back_is_told_as_a_writes_and_the_writer_goes_on() -> None:
    told, written = [], []

    def done(state: int) -> None:
        if state == 1:
            raise ValueError("not lent")

    writer = LatestStateWriter(written.append, on_error=told.append, on_done=done)
    writer.submit(1)
    assert writer.flush(10)
    writer.submit(2)
    assert writer.flush(10)
    assert written == [1, 2] and [str(e) for e in told] == ["not lent"]


def test_a_lent_syncer_state_stays_unchanged_until_given_back_then_its_memory_carries_a_later_commit() -> None:
    """The service checkpoints a lent state (``state_dict(lend=True)``): while the writer holds it, later commits
    copy into new memory and leave it as it was; once given back, the next commit of that fragment copies into
    its memory (no page faults of fresh memory), and the values are the new version's. A state handed out
    without lending is never reused."""
    from atoll.strategies.decoupled.protocol import Push
    from atoll.strategies.decoupled.syncer import Syncer

    index = [torch.arange(0, 256), torch.arange(256, 512)]
    s = Syncer(torch.randn(512, generator=torch.Generator().manual_seed(0)), index, islands=1, quorum=1,
               outer_lr=0.7, outer_momentum=0.9, pull_codec="int4")

    def push(version: int) -> None:
        s.push(Push(0, 0, torch.full((256,), 0.01 * (version + 1)), 10, version))

    push(0)
    lent = s.state_dict(lend=True)
    held = {k: lent["outer"][0][k].clone() for k in ("params",)}
    held["momentum"] = lent["outer"][0]["optimizer"]["state"][0]["momentum_buffer"].clone()
    held["shadow"] = lent["downlink"]["shadow"][0].clone()
    push(1)
    second = s.state_dict(lend=True)
    assert second["outer"][0]["params"].data_ptr() != lent["outer"][0]["params"].data_ptr()
    assert torch.equal(lent["outer"][0]["params"], held["params"])  # not given back: unchanged
    assert torch.equal(lent["outer"][0]["optimizer"]["state"][0]["momentum_buffer"], held["momentum"])
    assert torch.equal(lent["downlink"]["shadow"][0], held["shadow"])
    ptrs = (second["outer"][0]["params"].data_ptr(), second["downlink"]["shadow"][0].data_ptr(),
            second["outer"][0]["optimizer"]["state"][0]["momentum_buffer"].data_ptr())
    s.release(lent)
    s.release(second)  # (one set of buffers is kept per fragment: the newest given back)
    push(2)
    third = s.state_dict(lend=True)
    assert (third["outer"][0]["params"].data_ptr(), third["downlink"]["shadow"][0].data_ptr(),
            third["outer"][0]["optimizer"]["state"][0]["momentum_buffer"].data_ptr()) == ptrs
    assert torch.equal(third["outer"][0]["params"], s.outer[0].params.detach())
    assert torch.equal(third["downlink"]["shadow"][0], s.downlink.shadow[0])
    assert torch.equal(third["outer"][0]["optimizer"]["state"][0]["momentum_buffer"],
                       s.outer[0].optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert third["outer"][1]["params"] is second["outer"][1]["params"]  # fragment 1 never committed: one copy
    with pytest.raises(ValueError, match="is not lent"):
        s.release(lent)  # given back twice
    kept = s.state_dict()  # not lent: its copies are its holder's for good
    kept_params = kept["outer"][0]["params"].clone()
    s.release(third)
    push(3)
    s.state_dict(lend=True)
    push(4)
    assert kept["outer"][0]["params"].data_ptr() != s.state_dict()["outer"][0]["params"].data_ptr()
    s.release(s.state_dict(lend=True))
    push(5)
    s.state_dict(lend=True)
    assert kept["outer"][0]["version"] == 3 and torch.equal(kept["outer"][0]["params"], kept_params)


def test_a_copy_is_given_back_by_itself_not_by_its_version() -> None:
    """After ``forget`` (a state loaded) a new copy may carry the version of one still lent: giving back the old
    one frees the old one's memory for reuse, never the new one's, which its borrower still reads."""
    from atoll.algorithms.snapshot import Snapshots

    snaps, x = Snapshots(), torch.arange(4.0)
    old = snaps.get("g", 5, [x], lend=True)
    snaps.forget()
    x.add_(10)
    new = snaps.get("g", 5, [x], lend=True)  # the same version number, another copy
    assert new[0] is not old[0] and torch.equal(new[0], x)
    snaps.release("g", old[0])
    x.add_(10)
    newer = snaps.get("g", 6, [x], lend=True)  # the old copy's memory, not the lent new one's
    assert newer[0].data_ptr() == old[0].data_ptr() and torch.equal(new[0], torch.arange(4.0) + 10)
    assert torch.equal(newer[0], x)
    snaps.release("g", new[0])
    with pytest.raises(ValueError, match="is not lent"):
        snaps.release("g", new[0])  # given back twice
