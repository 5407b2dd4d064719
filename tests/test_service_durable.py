"""The syncer's state on disk, durable and verified: checksummed checkpoints (the newest readable one used, a
damaged one named), state files fsynced, a full disk that neither stops merging nor fails a merged push, an
unreadable ``coordinator.json`` that never restarts the grant epoch silently, an end cut during its final
write that a restart completes, and one restart rule: a folder of a finished or another run is refused before
anything is written.

In this process (the syncer service built from a micro run's settings; real gRPC calls where a push is
answered), except the refusals, which run the ``atoll syncer`` command as a user would (in this process too:
they end before any server starts).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from atoll.errors import CheckpointError
from atoll.runtime.service import wire
from tests.conftest import free_port, run_cli
from tests.test_service import run_flags

KEY = b"ab" * 32
CREDS = ["a" * 32, "b" * 32]


def _config(fast_config: dict, **more):  # noqa: ANN003, ANN202 - the TrainConfig of a served micro run
    from atoll.config import build_config

    base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every", "out")}
    return build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "fragments": 2, **more})


def _server(config, folder: Path, **shard):  # noqa: ANN001, ANN003, ANN202 - a SyncerServer in this process
    from atoll.runtime.service.server import SyncerServer

    return SyncerServer.of_run(config, folder, CREDS, **shard)


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``folder``: (mtime in ns, SHA-256 of its bytes)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_state_files_are_written_tmp_fsynced_renamed_and_the_folder_fsynced(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The one helper every small state file goes through: the file's bytes and the folder's rename are both
    fsynced (a power cut leaves the old file or the new one, never an empty one); a secret has its mode from
    its first byte on."""
    from atoll.job.checkpoint import write_text_atomic

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd))[1])
    path = tmp_path / "coordinator.json"
    write_text_atomic(path, '{"epoch": 3}')
    assert path.read_text() == '{"epoch": 3}'
    assert path.stat().st_ino in synced and tmp_path.stat().st_ino in synced
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator.json"]  # no temporary file left
    write_text_atomic(tmp_path / "island_0.token", "secret\n", mode=0o600)
    assert (tmp_path / "island_0.token").stat().st_mode & 0o777 == 0o600


def _checkpoint(folder: Path, step: int, state: dict) -> Path:
    from atoll.job.checkpoint import save_checkpoint

    return save_checkpoint(folder / "syncer", step, state, keep=5)


@pytest.mark.parametrize("damage", ["truncated", "bit_flip"])
def test_a_damaged_newest_checkpoint_gives_way_to_the_previous_one_named(fast_config: dict, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture, damage: str
                                                                        ) -> None:
    """The newest checkpoint damaged (its tensors' file cut short, or a figure of its state.json changed, which
    JSON still parses and only its checksum catches): the restarted syncer continues from the previous one,
    says so in one line naming the damaged one, and sets it aside, so the rotation keeps the new checkpoints.
    Before: a fresh start from zero (cut file), or the changed figure taken as the state (flip)."""
    config = _config(fast_config)
    first = _server(config, tmp_path)
    service = first.service
    state = {"syncer": service.syncer.state_dict()}
    _checkpoint(tmp_path, 1, {**state, "service": {"reserved": 10, "steps_by_island": [5, 5], "joins": [1, 1]}})
    newest = _checkpoint(tmp_path, 2, {**state, "service": {"reserved": 20, "steps_by_island": [10, 10],
                                                            "joins": [1, 1]}})
    if damage == "truncated":
        data = (newest / "state.safetensors").read_bytes()
        (newest / "state.safetensors").write_bytes(data[:len(data) // 2])
    else:
        text = (newest / "state.json").read_text()
        assert '"reserved", 20]' in text
        (newest / "state.json").write_text(text.replace('"reserved", 20]', '"reserved", 28]'))
    capsys.readouterr()
    restarted = _server(config, tmp_path).service
    assert restarted.reserved == 10 and [i.steps for i in restarted.islands] == [5, 5] and restarted.restarts == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "unreadable" in line]
    assert len(lines) == 1 and "step_0000002" in lines[0] and "step_0000001" in lines[0], lines
    root = tmp_path / "syncer" / "checkpoints"
    assert (root / "step_0000002.damaged").is_dir() and not (root / "step_0000002").exists()
    restarted.syncer.commits = 2  # the next commit's checkpoint: kept, not rotated out as older than the damaged
    restarted._save(wait=True)
    assert (root / "step_0000002" / "checksums.json").is_file()
    assert _server(config, tmp_path).service.reserved == 10  # that one read back


def test_no_readable_checkpoint_is_one_line_never_a_fresh_start(fast_config: dict, tmp_path: Path) -> None:
    """Every checkpoint unreadable: one line naming the folder and the fix (the command exits 2), no fresh run
    over the old one's folder."""
    config = _config(fast_config)
    service = _server(config, tmp_path).service
    path = _checkpoint(tmp_path, 1, {"syncer": service.syncer.state_dict(), "service": {"reserved": 10}})
    (path / "state.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints in .* is readable.*restore.*move"):
        _server(config, tmp_path)


def _payload(state, n: int) -> bytes:  # noqa: ANN001 - the run's codec of a small Δ
    return wire.payload_bytes(state.codec.encode(torch.full((n,), 1e-3)).tensors)


def _idle(writer) -> bool:  # noqa: ANN001 - the checkpoint writer has nothing left to write
    return not writer._pending and not writer._busy


def test_a_full_disk_is_one_line_per_failed_write_and_merged_pushes_are_answered(
        fast_config: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Every checkpoint write fails with ENOSPC: each is one line, the syncer keeps merging, and every push it
    merged is answered as accepted (before: the second commit's push failed as UNKNOWN, a push that was merged).
    Once the disk has room, the next commit's checkpoint is written."""
    from atoll.runtime.service import durable

    def full(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path))

    real = durable.save_checkpoint
    monkeypatch.setattr(durable, "save_checkpoint", full)
    config = _config(fast_config, min_quorum=2)
    state = _server(config, tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[state.handler()])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    from atoll.runtime.service.client import SyncerClient

    try:
        clients = [SyncerClient(address, i, CREDS[i], plaintext=True) for i in range(2)]
        numels = state.service.syncer.numels
        sessions = [c.call("Join", {"numels": numels})["session"] for c in clients]
        tokens = 5 * state.service.run.tokens_per_step
        answers = []
        for fragment in range(2):
            for c, session in zip(clients, sessions, strict=True):
                assert c.call("ReserveSteps", {"n": 5})["granted"] == 5
                n = numels[fragment]
                answers.append(c.push(_payload(state, n), fragment, ((0, n),), tokens, 0, session)["accepted"])
            deadline = time.monotonic() + 60
            while not _idle(state.service.writer) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert answers == [True] * 4 and state.service.syncer.commits == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if "checkpoint not written" in line]
        assert len(lines) == 2 and "No space left on device" in lines[0], lines
        monkeypatch.setattr(durable, "save_checkpoint", real)  # room again: the next commit is written
        state.service._save(wait=True)
        assert (tmp_path / "syncer" / "checkpoints" / "step_0000002").is_dir()
    finally:
        server.stop(grace=0)


def test_an_unreadable_coordinator_json_never_restarts_the_grant_epoch(fast_config: dict, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """coordinator.json emptied (a power cut before its bytes were on disk): one line naming it, no silent epoch 1
    (the other shards would refuse every honest push as ``tokens``). Deleted, as that line advises: the epoch is
    recovered from the newest checkpoint's copy, past every epoch signed before. Before: epoch 1 both times."""
    config = _config(fast_config)
    folder = tmp_path / "shard_0"
    coordinator = _server(config, folder, shard=0, shards=2, key=KEY).service
    coordinator = _server(config, folder, shard=0, shards=2, key=KEY).service  # restarted: epoch 2
    assert coordinator.issuer.epoch == 2
    coordinator._save(wait=True)  # a checkpoint holding a copy of the epoch
    path = folder / "syncer" / "coordinator.json"
    path.write_text("")
    with pytest.raises(CheckpointError, match="^coordinator: .*coordinator.json' is unreadable \\(empty\\)"):
        _server(config, folder, shard=0, shards=2, key=KEY)
    path.unlink()
    capsys.readouterr()
    recovered = _server(config, folder, shard=0, shards=2, key=KEY).service
    assert recovered.issuer.epoch > 2
    assert "recovered from the newest checkpoint" in capsys.readouterr().err
    assert json.loads(path.read_text())["epoch"] == recovered.issuer.epoch


def _finished_service(config, out: Path):  # noqa: ANN001, ANN202 - a SyncerServer whose run is over
    """Both islands joined, took the whole budget and left: the server's tick ends the run."""
    server = _server(config, out)
    service = server.service
    for i in range(2):
        service.join(i, CREDS[i])
        used = 0
        while used < config.steps:  # a round at a time, reporting the steps used (as an island's lease does)
            used += service.reserve_steps(i, CREDS[i], config.strategy_config.sync_every, used=used)
        assert used == config.steps
        service.leave_session(i, config.steps)
        server.left[i] = {"bytes_sent": 1000.0, "compute_s": 1.0}
    server._save_left()
    server.tick()
    assert server.done.is_set()
    return server


def test_an_end_cut_during_its_final_write_is_completed_by_the_same_command(
        fast_config: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The syncer killed while writing the run's end (``run/`` begun, no summary): the same command restarted on
    its folder completes the summary (before: it refused ``run/`` and advised ``--resume``, which ``atoll
    syncer`` does not have). Then that finished folder is refused, one line, exit 2, with not a byte or a
    modification time changed."""
    from atoll.job.run import Run
    from atoll.runtime.service import serve as serve_module

    out = tmp_path / "syncer"
    config = _config(fast_config, out=str(out), listen=f"127.0.0.1:{free_port()}")
    server = _finished_service(config, out)

    def cut(self, **fields):  # noqa: ANN001, ANN003, ANN202 - killed before the summary
        raise KeyboardInterrupt("cut")

    with monkeypatch.context() as m:
        m.setattr(Run, "finish", cut)
        with pytest.raises(KeyboardInterrupt):
            serve_module.finish_run(config, out, server)
    assert (out / "run" / "metrics.jsonl").is_file() and not (out / "run" / "summary.json").exists()
    server.service.writer.flush()
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(serve_module.serve(config)), daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive()
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["syncer_restarts"] == 1 and summary["islands_left"] == [0, 1] and done["tokens"] > 0

    before = _snapshot(out)
    result = run_cli("syncer", "--out", str(out), *run_flags(fast_config))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: out:") and "finished run" in lines[0], lines
    assert _snapshot(out) == before


def test_a_folder_of_another_run_is_refused_before_anything_is_written(fast_config: dict, tmp_path: Path) -> None:
    """A syncer started on the folder of another run (another seed here): one line naming the setting and both
    values, exit 2, and the folder left as it was, byte for byte (before: it started, loaded that run's state
    and rewrote it). Also a folder of ``atoll train``."""
    out = tmp_path / "syncer"
    with socket.socket() as taken:  # the syncer's port is held: its first start ends (exit 2) after it began
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        flags = [*run_flags(fast_config), "--listen", f"127.0.0.1:{taken.getsockname()[1]}"]
        first = run_cli("syncer", "--out", str(out), *flags)
        assert first.returncode == 2 and "listen:" in first.stderr, first.stderr
        assert (out / "credentials").is_dir()  # the folder of a run, begun by its own command
        before = _snapshot(out)
        result = run_cli("syncer", "--out", str(out), *flags, "--seed", "7")
        train = tmp_path / "train"
        train.mkdir()
        (train / "config.json").write_text("{}")
        refused = run_cli("syncer", "--out", str(train), *flags)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: seed:") and "7" in lines[0], lines
    assert _snapshot(out) == before
    assert refused.returncode == 2 and "'atoll train' run" in refused.stderr, refused.stderr
    assert sorted(p.name for p in train.iterdir()) == ["config.json"]


def test_a_folder_in_use_by_a_live_syncer_is_refused(fast_config: dict, tmp_path: Path) -> None:
    """A second syncer on the folder a live one holds: one line naming the folder (the lock, as ``atoll train``);
    free again once the first one ends."""
    from atoll.errors import ConfigError
    from atoll.runtime.service.serve import SETTINGS, claim_folder

    out = tmp_path / "syncer"
    config = _config(fast_config, out=str(out))
    held = claim_folder(config, out, out)
    assert (out / SETTINGS).is_file()
    with pytest.raises(ConfigError, match="^out: .* is in use by another atoll process"):
        claim_folder(config, out, out)
    held.release()
    claim_folder(config, out, out).release()
