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
