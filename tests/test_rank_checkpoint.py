"""A rank's folder of a per-rank checkpoint (atoll.job.rank_checkpoint): DCP's safetensors writer and reader,
no pickle; shared memory (a tied head) written once; owners of replicated state; a damaged folder is one line."""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from atoll.errors import CheckpointError
from atoll.job.rank_checkpoint import (
    consolidate,
    load_rank_state,
    owner_of_island,
    owner_of_shared,
    rank_folder,
    save_rank_state,
)


def test_a_rank_state_round_trips_with_tied_tensors_written_once(tmp_path: Path) -> None:
    embed = torch.randn(6, 4)
    state = {"island_state": {"model": {"embed": embed, "head": embed, "norm": torch.ones(4)},
                              "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, 4)}},
                                            "param_groups": [{"lr": 0.1, "params": [0]}]},
                              "tokens": 12},
             "strategy": {"outer": [torch.arange(5), torch.tensor([True, False])], "name": None}}
    folder = rank_folder(tmp_path / "step_0000001", 3)
    save_rank_state(folder, state)
    assert folder.name == "rank_00003"
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["model-00001-of-00001.safetensors", "model.safetensors.index.json", "state.json"]
    from safetensors.torch import load_file

    stored = load_file(str(folder / files[0]))
    assert "island_state.model.head" not in stored and "island_state.model.embed" in stored  # once
    got, dtensors = load_rank_state(folder)
    assert dtensors == set()
    model = got["island_state"]["model"]
    assert torch.equal(model["embed"], embed) and model["head"] is model["embed"]
    assert got["island_state"]["optimizer"]["state"][0]["step"].item() == 3.0
    assert got["island_state"]["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert got["island_state"]["tokens"] == 12 and got["strategy"]["name"] is None
    assert torch.equal(got["strategy"]["outer"][0], torch.arange(5))
    assert got["strategy"]["outer"][1].dtype == torch.bool
    json.loads((folder / "state.json").read_text())  # the tree is JSON


def test_a_damaged_rank_folder_is_one_checkpoint_error(tmp_path: Path) -> None:
    folder = tmp_path / "rank_00000"
    save_rank_state(folder, {"w": torch.randn(3)})
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="rank folder .* is unreadable"):
        load_rank_state(folder)
    with pytest.raises(CheckpointError, match="unreadable"):
        load_rank_state(tmp_path / "rank_00009")


def test_owners_of_replicated_state() -> None:
    # unsharded islands of 2 ranks: island i's state is its rank 2i's; a lost island takes the first live one's
    assert [owner_of_island(i, p, 2, False, [0, 1]) for i in (0, 1) for p in (0, 1)] == [0, 0, 2, 2]
    assert owner_of_island(1, 1, 2, False, [0]) == 0
    # sharded: every rank its own pieces; the shared (outer) state by island 0's rank at the same position
    assert [owner_of_island(i, p, 2, True, [0, 1]) for i in (0, 1) for p in (0, 1)] == [0, 1, 2, 3]
    assert [owner_of_shared(p, True) for p in (0, 1)] == [0, 1] and owner_of_shared(1, False) == 0


def test_consolidate_assembles_every_island_and_refuses_shards(tmp_path: Path) -> None:
    path = tmp_path / "step_0000004"
    for island in (0, 1):
        entry = {"island": island, "position": 0, "island_state": {"w": torch.full((2,), float(island))},
                 "strategy_island": {"tokens": island}}
        if island == 0:
            entry["strategy"] = {"outer": torch.zeros(2)}
        save_rank_state(rank_folder(path, 2 * island), entry)
        save_rank_state(rank_folder(path, 2 * island + 1), {"island": island, "position": 1})
    shared = {"islands": 2, "ranks_per_island": 2, "shard_ranks": None, "alive": [0, 1], "comm": {}}
    state = consolidate(path, shared)
    assert [float(s["w"][0]) for s in state["islands"]] == [0.0, 1.0]
    assert [s["tokens"] for s in state["strategy_islands"]] == [0, 1]
    assert torch.equal(state["strategy"]["outer"], torch.zeros(2)) and state["comm"] == {}
    with pytest.raises(CheckpointError, match="--shard-island --ranks-per-island 2"):
        consolidate(path, {**shared, "shard_ranks": 2})


@contextlib.contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    """This process may write files of at most ``nbytes`` (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a longer
    write fails with EFBIG): a disk that fills up under a write, for real."""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_write_that_fails_in_dcp_is_the_oserror_naming_the_folder(tmp_path: Path) -> None:
    """DCP wraps a failed write in its CheckpointException, a BaseException: it escaped the callers' ``except
    OSError`` (a traceback instead of the one line) and a background writer's ``except Exception`` (its thread
    ended without posting, and the job waited for it for ever). It is the OSError it wraps, naming the folder."""
    folder = rank_folder(tmp_path / "step_0000001", 1)
    with _file_size_limit(64 * 1024), pytest.raises(OSError) as e:
        save_rank_state(folder, {"island_state": {"w": torch.zeros(64 * 1024)}})  # 256 KB
    assert e.value.errno == errno.EFBIG and e.value.filename == str(folder), e.value
    assert type(e.value) is OSError and "File too large" in str(e.value)
