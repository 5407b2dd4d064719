"""The collective runtime's checkpoints written in the background (atoll.runtime.collective.async_checkpoint): the
writer threads agree through a real TCPStore, rank 0 commits once every part is on disk, a failed part fails
the checkpoint on every rank and leaves the previous one, a lost island is left out; host copies are taken at
the checkpoint (training may change the tensors after). Ranks are simulated in one process, each with its own
store client; the runs themselves are tests/test_fsdp.py's (async against foreground, resume)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import cli_flags

from atoll.config import build_config
from atoll.config.applies import applicable
from atoll.errors import PeerWriteError
from atoll.job.checkpoint import commit_checkpoint, latest_checkpoint, save_checkpoint, write_checkpoint_files
from atoll.job.metrics import read_metrics
from atoll.job.rank_checkpoint import HostStaging, load_rank_state, rank_folder, stage_rank_state
from atoll.job.run import prepare_inputs
from atoll.runtime.collective import async_checkpoint
from atoll.runtime.collective.async_checkpoint import Commit, InFlight, writers
from atoll.runtime.collective.membership import Membership

STEP = 10


@pytest.fixture()
def store() -> Any:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master


def _alive(path: Path) -> list[int]:
    """The islands a checkpoint's shared state holds (``alive``), from its state.json."""
    tree = json.loads((path / "state.json").read_text())["state"]
    return dict(tree["__dict__"])["alive"]


def _client(master: Any) -> Any:
    return dist.TCPStore("127.0.0.1", master.port, is_master=False)


class _Run:
    """What rank 0's commit needs of a Run: the shared part written into the folder, then the rename."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.events: list[dict] = []
        self.log = SimpleNamespace(log=lambda event, **fields: self.events.append({"event": event, **fields}))

    def write_checkpoint(self, step: int, state: dict, params: torch.Tensor, tmp: Path, meta: dict) -> None:
        write_checkpoint_files(tmp, step, {**state, "params": params}, meta=meta)

    def commit_checkpoint(self, step: int, tmp: Path) -> Path:
        return commit_checkpoint(self.out, tmp, step)


def _rt(rank: int, membership: Membership, gone: set[int] | None = None) -> SimpleNamespace:
    heartbeat = SimpleNamespace(is_gone=lambda r, s: r in (gone or set()))
    return SimpleNamespace(rank=rank, prefix="atoll/test/", membership=membership, heartbeat=heartbeat)


def _start(master: Any, out: Path, membership: Membership, ranks: list[int], values: dict[int, torch.Tensor],
           gone: set[int] | None = None, survives: bool = True) -> dict[int, InFlight]:
    """Islands of one rank each: ``ranks`` start writing their part (``{"w": values[rank]}``) of the checkpoint
    at STEP, rank 0 with the commit."""
    tmp = out / "checkpoints" / f".tmp-step_{STEP:07d}"
    tmp.mkdir(parents=True)
    alive = list(membership.alive)
    flights = {}
    for rank in ranks:
        staged = stage_rank_state({"w": values[rank]}, HostStaging())
        commit = None
        if rank == 0:
            commit = Commit(_Run(out), {"alive": alive, "step": STEP}, torch.arange(4.0), {"format": "ranks"},
                            writers(alive, 1), membership.epoch, 1.0, survives=survives)
        flights[rank] = InFlight(_rt(rank, membership, gone), _client(master), STEP, tmp, staged, commit)
    return flights


def test_writers_are_every_rank_of_every_island_alive() -> None:
    assert writers([0, 2], 2) == {0: [0, 1], 2: [4, 5]}
    assert writers([1], 1) == {1: [1]}


def test_every_part_on_disk_then_one_commit_that_every_rank_reads(store: Any, tmp_path: Path) -> None:
    values = {0: torch.full((3,), 1.0), 1: torch.full((3,), 2.0)}
    flights = _start(store, tmp_path, Membership(2), [0, 1], values)
    for v in values.values():  # training goes on: the tensors change after the checkpoint's copies were taken
        v.add_(100.0)
    flights[0].thread.join(60)  # committed by rank 0's thread, which logs it then (before any settle)
    path = tmp_path / "checkpoints" / f"step_{STEP:07d}"
    (event,) = flights[0].commit.run.events
    assert event["event"] == "checkpoint" and event["step"] == STEP and event["path"] == str(path)
    assert event["background"] is True and event["write_s"] > 0 and "islands_left_out" not in event
    paths = {rank: f.settle() for rank, f in flights.items()}
    assert paths[0][0] == paths[1][0] == path and paths[0][2] == paths[1][2] == []
    assert latest_checkpoint(tmp_path) == path
    for rank, want in ((0, 1.0), (1, 2.0)):
        got, _ = load_rank_state(rank_folder(path, rank))
        assert torch.equal(got["w"], torch.full((3,), want)), rank  # the values at the checkpoint
    assert _alive(path) == [0, 1] and json.loads((path / "state.json").read_text())["format"] == "ranks"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_part_that_cannot_be_written_fails_the_checkpoint_on_every_rank(store: Any, tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, {"step": 5})  # the previous checkpoint
    tmp = tmp_path / "checkpoints" / f".tmp-step_{STEP:07d}"
    rank_folder(tmp, 1).mkdir(parents=True)  # rank 1's folder exists: its writer's mkdir fails (EEXIST)
    membership = Membership(2)
    values = {0: torch.ones(2), 1: torch.ones(2)}
    alive = list(membership.alive)
    flights = {}
    for rank in (0, 1):
        commit = (Commit(_Run(tmp_path), {"alive": alive}, torch.zeros(2), {}, writers(alive, 1), 0, 1.0)
                  if rank == 0 else None)
        flights[rank] = InFlight(_rt(rank, membership), _client(store), STEP, tmp, stage_rank_state(
            {"w": values[rank]}, HostStaging()), commit)
    for rank, flight in flights.items():
        with pytest.raises(OSError, match=f"checkpoint of step {STEP}") as e:
            flight.settle()
        assert e.value.errno is not None and "exists" in str(e.value).lower(), (rank, e.value)
    assert not tmp.exists()  # removed: the previous checkpoint stays the latest
    assert latest_checkpoint(tmp_path).name == "step_0000005"


def test_an_island_lost_while_writing_is_left_out(store: Any, tmp_path: Path) -> None:
    membership = Membership(3)
    values = {r: torch.full((2,), float(r)) for r in range(3)}
    flights = _start(store, tmp_path, membership, [0, 2], values)  # island 1's rank died before it wrote
    membership.drop([1], STEP + 1)  # the survivors regroup while the checkpoint is written
    path, _, dropped = flights[0].settle()
    assert dropped == [1] and flights[2].settle()[0] == path
    assert _alive(path) == [0, 2]  # a resume takes island 1's state from island 0's
    assert sorted(p.name for p in (path / "ranks").iterdir()) == ["rank_00000", "rank_00002"]


def test_an_island_restarted_or_silent_while_writing_is_left_out(store: Any, tmp_path: Path) -> None:
    # island 1 lost and admitted again since the checkpoint: its part (by the lost process) never comes
    membership = Membership(2)
    flights = _start(store, tmp_path / "a", membership, [0], {0: torch.ones(1)})
    membership.drop([1], STEP + 1)
    membership.admit([1], STEP + 3)
    assert flights[0].settle()[2] == [1]
    # island 1's rank silent (its heartbeat stopped): not waited for
    flights = _start(store, tmp_path / "b", Membership(2), [0], {0: torch.ones(1)}, gone={1})
    path, _, dropped = flights[0].settle()
    assert dropped == [1] and _alive(path) == [0]


def test_a_job_that_cannot_survive_a_loss_gets_no_checkpoint_of_it(store: Any, tmp_path: Path) -> None:
    """Sharded islands, or --min-islands equal to the islands: a loss stops the job, and the checkpoint being
    written fails instead of leaving the lost island out (the foreground's all-reduce fails alike)."""
    membership = Membership(2)
    flights = _start(store, tmp_path, membership, [0], {0: torch.ones(1)}, survives=False)
    membership.drop([1], STEP + 1)
    with pytest.raises(OSError, match="island 1 was lost while its part of the checkpoint was written"):
        flights[0].settle()
    assert not (tmp_path / "checkpoints" / f"step_{STEP:07d}").exists()
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_store_gone_is_nothing_come_yet_not_a_traceback(store: Any, tmp_path: Path) -> None:
    """The launcher (the store's host) died: a rank waiting for the result reads nothing (the heartbeat then
    stops it with the one line naming the launcher), it does not die on the store client's error."""
    from atoll.runtime.collective.async_checkpoint import RESULT

    flights = _start(store, tmp_path, Membership(1), [0], {0: torch.ones(1)})
    flights[0].settle()

    class Gone:
        def check(self, keys: list[str]) -> bool:
            raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    flights[0].store = Gone()
    assert flights[0]._get(RESULT) is None


def test_the_outcome_keys_are_forgotten_once_read(store: Any, tmp_path: Path) -> None:
    from atoll.runtime.collective.async_checkpoint import RESULT, forget, outcome_key

    flights = _start(store, tmp_path, Membership(2), [0, 1], {0: torch.ones(1), 1: torch.ones(1)})
    for flight in flights.values():
        flight.settle()
    keys = [outcome_key("atoll/test/", STEP, who) for who in (0, 1, RESULT)]
    assert all(store.check([k]) for k in keys)
    forget(store, "atoll/test/", STEP, world=2)
    assert not any(store.check([k]) for k in keys)
    forget(store, "atoll/test/", STEP, world=2)  # again: nothing left, no error


def test_host_staging_keeps_its_buffers_and_copies() -> None:
    staging = HostStaging()
    embed = torch.randn(4, 3)
    first = stage_rank_state({"model": {"embed": embed, "head": embed}, "n": 3}, staging)
    assert list(first.tensors) == ["model.embed"] and first.nbytes == 4 * 12  # a tied head once
    held = first.tensors["model.embed"]
    assert held.data_ptr() != embed.data_ptr() and torch.equal(held, embed)
    embed.mul_(2)
    assert not torch.equal(held, embed)  # a copy, not the training tensor
    second = stage_rank_state({"model": {"embed": embed, "head": embed}, "n": 4}, staging)
    assert second.tensors["model.embed"].data_ptr() == held.data_ptr()  # the same buffer, refilled
    assert torch.equal(second.tensors["model.embed"], embed) and second.tree != first.tree
    unstaged = stage_rank_state({"w": embed})
    assert unstaged.tensors["w"].data_ptr() == embed.data_ptr()  # the foreground writes the tensors themselves


def _settle_within(flight: InFlight, timeout: float = 60.0) -> Any:
    """``flight.settle()``'s result or the exception it raised, from a thread given ``timeout`` seconds (a
    settle that never returns fails the test instead of hanging it)."""
    got: list[Any] = []

    def settle() -> None:
        try:
            got.append(flight.settle())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got.append(e)

    waiter = threading.Thread(target=settle, daemon=True)
    waiter.start()
    waiter.join(timeout)
    assert got, f"rank {flight.rank}'s settle still waits after {timeout} s"
    return got[0]


def test_a_writer_that_fails_with_a_base_exception_still_posts_its_outcome(store: Any, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP raises its CheckpointException, a BaseException: rank 1's thread ended without posting, rank 0's
    waited for its part for ever (rank 1 alive, its heartbeat beating) and so did every settle. Any failure is
    posted: the checkpoint fails on every rank, rank 0 raising the error and rank 1 a PeerWriteError."""
    from torch.distributed.checkpoint.api import CheckpointException

    real = async_checkpoint.write_rank_state

    def failing(folder: Path, staged: Any) -> None:
        if folder.name == "rank_00001":
            raise CheckpointException("CheckpointException ranks:dict_keys([0])", {})
        real(folder, staged)

    monkeypatch.setattr(async_checkpoint, "write_rank_state", failing)
    save_checkpoint(tmp_path, 5, {"step": 5})
    flights = _start(store, tmp_path, Membership(2), [0, 1], {0: torch.ones(2), 1: torch.ones(2)})
    errors = {rank: _settle_within(flight) for rank, flight in flights.items()}
    assert type(errors[0]) is OSError and isinstance(errors[1], PeerWriteError), errors
    for e in errors.values():
        assert str(e).startswith("[Errno 5] CheckpointException: CheckpointException ranks:"), e
        assert str(e).endswith(f"(checkpoint of step {STEP})"), e
        assert "\n" not in str(e)  # one line, though DCP's text holds tracebacks
    assert latest_checkpoint(tmp_path).name == "step_0000005"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_commit_that_raises_still_posts_the_result(store: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's commit failing other than by an OSError (here a bug in it) is posted too: the other ranks' settle
    raises it instead of waiting for a result that never comes."""

    def broken(self: InFlight, own: str) -> str:  # after the writers' wait, as the real one fails
        while self._get(1) is None:  # (raising before rank 1 wrote: its write would make the folder again)
            time.sleep(0.01)
        raise KeyError("alive")

    monkeypatch.setattr(InFlight, "_commit", broken)
    flights = _start(store, tmp_path, Membership(2), [0, 1], {0: torch.ones(2), 1: torch.ones(2)})
    errors = {rank: _settle_within(flight) for rank, flight in flights.items()}
    assert all(isinstance(e, OSError) and "KeyError: 'alive'" in str(e) for e in errors.values()), errors
    assert not (tmp_path / "checkpoints" / f".tmp-step_{STEP:07d}").exists()


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "async"])
def test_a_full_disk_under_the_ranks_is_one_line_as_in_the_foreground(corpus_file: Path, cache_dir: Path,
                                                                       tmp_path: Path, background: bool) -> None:
    """The ranks may write no file over 256 KB (RLIMIT_FSIZE: a disk that fills up under DCP's writes; the
    model's export, 150 KB, fits): the run stops with exit status 1 and one line with the resume advice, the
    temporary folder removed, in the foreground and with --async-checkpoint alike. Before, DCP's
    CheckpointException came out of every rank as a traceback (foreground) or ended the writer thread unsaid."""
    settings = {"data": str(corpus_file), "cache_dir": str(cache_dir), "model": "micro", "vocab_size": 512,
                "seq_len": 32, "batch_size": 4, "islands": 2, "steps": 8, "sync_every": 5, "eval_every": 8,
                "eval_batches": 2, "checkpoint_every": 5, "progress": False, "threads": 1, "runtime": "collective",
                "async_checkpoint": background, "out": str(tmp_path / "run")}
    prepare_inputs(build_config(overrides=applicable({**settings, "out": str(tmp_path / "cache-warm")})))

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", *cli_flags(settings)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=small_files)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("atoll: error:")]
    assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "CheckpointException" not in r.stderr
    out = tmp_path / "run"
    folder = out / "checkpoints" / ".tmp-step_0000005" / "ranks" / "rank_00000"
    step = " (checkpoint of step 5)" if background else ""
    assert errors[0] == (f"atoll: error: File too large{step} ('{folder}'); free disk space or make the folder "
                         f"writable, then no checkpoint was written yet in '{out}' (see --checkpoint-every); remove "
                         "it and start again")
    assert os.listdir(out / "checkpoints") == []  # the temporary folder removed, nothing committed


@pytest.mark.slow
def test_a_job_that_diverges_with_a_checkpoint_in_flight_settles_it(corpus_file: Path, cache_dir: Path,
                                                                   tmp_path: Path) -> None:
    """A job that diverges ends without a last checkpoint: the one still written in the background is settled
    before the summary (committed, its event logged), as the foreground had written it. Before, it was left to
    a daemon thread the process's exit could cut, and its ``checkpoint`` event was never logged."""
    out = tmp_path / "run"
    settings = {"data": str(corpus_file), "cache_dir": str(cache_dir), "model": "micro", "vocab_size": 512,
                "seq_len": 32, "batch_size": 4, "islands": 2, "steps": 20, "sync_every": 5, "eval_every": 20,
                "eval_batches": 2, "checkpoint_every": 5, "progress": False, "threads": 1, "runtime": "collective",
                "async_checkpoint": True, "out": str(out)}
    r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", *cli_flags(settings)], capture_output=True,
                       text=True, timeout=300,  # every island's weights NaN at step 7: no pseudo-gradient at 10
                       env={**os.environ, "OMP_NUM_THREADS": "1", "ATOLL_TEST_NAN_AT": "weights:0:7,weights:1:7"})
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith("atoll: error: training diverged at step 10")
    events = read_metrics(out / "metrics.jsonl")
    saved = [e for e in events if e["event"] == "checkpoint"]
    assert [(e["step"], e["background"]) for e in saved] == [(5, True)], saved
    assert saved[0]["path"] == str(out / "checkpoints" / "step_0000005")
    assert events[-1]["event"] == "end" and events[-1]["diverged"]["step"] == 10
    assert latest_checkpoint(out).name == "step_0000005"
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000005"]


@pytest.mark.parametrize("saved", [False, True])
def test_a_resumed_run_may_switch_async_checkpoint(tmp_path: Path, saved: bool) -> None:
    """Where a checkpoint is written from changes nothing the run computes (the same files, the exact resume:
    tests/test_fsdp.py), so a resume may switch it, as --activation-checkpointing; before, it was refused with
    advice to start a new run (--init-from, without the optimizer's state)."""
    from atoll.config import load_run_config

    out = tmp_path / "run"
    out.mkdir()
    config = build_config(overrides={"runtime": "collective", "islands": 2, "model": "micro", "out": str(out),
                                     "async_checkpoint": saved})
    (out / "config.json").write_text(config.model_dump_json())
    assert load_run_config(out, {"async_checkpoint": not saved}).runtime_config.async_checkpoint is (not saved)
    assert load_run_config(out, {}).runtime_config.async_checkpoint is saved


def test_a_replica_rank_that_writes_late_is_waited_for(store: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsharded islands of 2 ranks: a replica's second rank writes an empty folder, as in the foreground. It was
    not waited for, so a late one (a loaded machine) wrote it after rank 0 had renamed the folder: the checkpoint
    lacked it and a stray ``.tmp-step_*`` folder was left behind. Every rank's outcome is waited for."""
    import time

    real = async_checkpoint.write_rank_state

    def late(folder: Path, staged: Any) -> None:
        if folder.name == "rank_00001":
            time.sleep(0.5)
        real(folder, staged)

    monkeypatch.setattr(async_checkpoint, "write_rank_state", late)
    membership = Membership(2)
    tmp = tmp_path / "checkpoints" / f".tmp-step_{STEP:07d}"
    tmp.mkdir(parents=True)
    alive = list(membership.alive)
    flights = {}
    for rank in range(4):  # ranks 0, 2 hold their island's state; 1, 3 are replicas of it
        part = {"w": torch.full((2,), float(rank))} if rank % 2 == 0 else {}
        commit = (Commit(_Run(tmp_path), {"alive": alive}, torch.zeros(2), {}, writers(alive, 2), 0, 1.0)
                  if rank == 0 else None)
        flights[rank] = InFlight(_rt(rank, membership), _client(store), STEP, tmp, stage_rank_state(
            part, HostStaging()), commit)
    paths = {rank: _settle_within(flight)[0] for rank, flight in flights.items()}
    path = tmp_path / "checkpoints" / f"step_{STEP:07d}"
    assert set(paths.values()) == {path}
    assert sorted(p.name for p in (path / "ranks").iterdir()) == [f"rank_{r:05d}" for r in range(4)]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", f"step_{STEP:07d}"]  # nothing stray


def test_a_failed_part_removes_the_folder_after_the_last_write_into_it(store: Any, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's own part fails while rank 1 still writes: the folder was removed at once and rank 1's write made
    it again (a stray ``.tmp-step_*`` folder after the run stopped). Rank 0 waits for every writer first."""
    import errno
    import time

    real = async_checkpoint.write_rank_state

    def writes(folder: Path, staged: Any) -> None:
        if folder.name == "rank_00000":
            raise OSError(errno.ENOSPC, "No space left on device", str(folder))
        time.sleep(0.5)
        real(folder, staged)

    monkeypatch.setattr(async_checkpoint, "write_rank_state", writes)
    flights = _start(store, tmp_path, Membership(2), [0, 1], {0: torch.ones(2), 1: torch.ones(2)})
    errors = {rank: _settle_within(flight) for rank, flight in flights.items()}
    assert all(isinstance(e, OSError) and "No space left on device" in str(e) for e in errors.values()), errors
    assert type(errors[0]) is OSError and isinstance(errors[1], PeerWriteError)
    assert errors[0].filename == str(rank_folder(tmp_path / "checkpoints" / f".tmp-step_{STEP:07d}", 0))
    assert os.listdir(tmp_path / "checkpoints") == []  # removed after rank 1's write, not before it


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_the_background_export_is_the_foregrounds_byte_for_byte(tmp_path: Path, head: str) -> None:
    """Rank 0's writer thread exports the global model from views of a host copy of the flat parameters
    (Run.export_state: tied names included), leaving the live model alone; the files equal the foreground's,
    which loads the parameters into the model first."""
    from atoll.job.model import build_model
    from atoll.job.run import Run

    m = build_model("micro", 512, 32, 0)
    if head == "untied":  # (as the 1b preset's)
        m.config.tie_word_embeddings = False
        m = type(m)(m.config)
        assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    params = torch.nn.utils.parameters_to_vector(list(m.parameters())).detach() * 1.5
    before = [p.detach().clone() for p in m.parameters()]
    m.save_pretrained(tmp_path / "background", state_dict=Run.export_state(SimpleNamespace(model=m), params))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))  # the model untouched
    torch.nn.utils.vector_to_parameters(params, list(m.parameters()))
    m.save_pretrained(tmp_path / "foreground")
    a, b = (tmp_path / d / "model.safetensors" for d in ("background", "foreground"))
    assert a.read_bytes() == b.read_bytes()
