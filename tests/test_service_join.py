"""A join refuses a run it does not belong to, and one island index has one live job.

The syncer compares the record of the island's run settings with its own at ``Join``
(:mod:`atoll.config.run_record`): a difference is refused in one line naming the setting and both values, exit
status 2 at the island, counted as ``settings``, nothing merged. A second join of an island index supersedes the
first's session: every later call of the older session (``Heartbeat``, ``ReserveSteps``, ``Buffered``, a push,
``Leave``) is refused and counted as ``stale_session``, and its job stops in one line with status 2, so an older
torchrun attempt can neither return the live session's lease nor mark the island left.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from atoll.config import build_config
from atoll.config.run_record import digest, first_difference, run_record
from atoll.runtime.service import schema, wire
from tests.conftest import run_cli

pytest.importorskip("cryptography")

#: the settings of the in-process syncer (tests.test_service_slices' fixture) as flags, beside fast_config's
FLAGS = ("--model", "micro", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--islands", "2",
         "--steps", "20", "--sync-every", "5", "--fragments", "2", "--eval-batches", "2", "--threads", "1",
         "--no-progress")


def _config(fast_config: dict, **changes: object):  # noqa: ANN202 - a TrainConfig of the syncer fixture's run
    base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
    return build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "fragments": 2, **changes})


def test_the_record_holds_the_runs_settings_and_not_each_processs_own(fast_config: dict, tmp_path: Path) -> None:
    syncer_side = _config(fast_config, listen="127.0.0.1:7171", give_up_s=30.0)
    token = tmp_path / "island_1.token"
    token.write_text("x" * 32)
    island_side = _config(fast_config, island=1, syncer=["127.0.0.1:7171"], credential=str(token), plaintext=True,
                          ranks_per_island=2, slice_transfer="leader", device="cpu", out=str(tmp_path / "island"),
                          tracker=["tensorboard"], progress_every=3, threads=2, collective_timeout_s=5.0)
    ours, theirs = run_record(syncer_side), run_record(island_side)
    assert ours == theirs and digest(ours) == digest(theirs)
    assert {"seed", "islands", "sync_every", "codec", "fragments", "outer_lr", "merge_average", "steps", "data",
            "model", "seq_len", "island_speeds"} <= set(ours)
    assert not {"listen", "island", "ranks_per_island", "shard_island", "slice_transfer", "device", "out", "tracker",
                "progress_every", "tls_ca", "give_up_s", "credential"} & set(ours)
    for name, value in (("seed", 1), ("sync_every", 10), ("islands", 3), ("codec", "int8"),
                        ("island_speeds", [1.0, 0.5])):
        other = run_record(_config(fast_config, **{name: value}))
        assert digest(other) != digest(ours)
        assert first_difference(ours, other) == (name, ours[name], json.dumps(value, separators=(",", ":")))


@pytest.mark.parametrize(("flag", "value", "line"), [
    ("seed", "7", "settings: island 0's seed is 7 but the syncer's is 0"),
    ("sync-every", "10", "settings: island 0's sync_every is 10 but the syncer's is 5"),
    ("islands", "3", "settings: island 0's islands is 3 but the syncer's is 2"),
    ("codec", "int8", "settings: island 0's codec is int8 but the syncer's is int4"),
])
def test_an_island_of_another_run_exits_2_in_one_line_and_nothing_is_merged(
        syncer, fast_config: dict, tmp_path: Path, flag: str, value: str, line: str) -> None:  # noqa: F811
    state, address, creds = syncer()
    token = tmp_path / "island_0.token"
    token.write_text(creds[0])
    flags = [*FLAGS]
    if f"--{flag}" in flags:
        flags[flags.index(f"--{flag}") + 1] = value
    else:
        flags += [f"--{flag}", value]
    result = run_cli("island", "--syncer", address, "--plaintext", "--island", "0", "--credential", str(token),
                     "--data", fast_config["data"], "--cache-dir", fast_config["cache_dir"], *flags)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"atoll: error: {line}; start every island with the syncer's run.toml"], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert state.refused_calls == {"settings": 1}
    assert state.joined == set() and state.service.syncer.commits == 0
    assert state.service.syncer.tokens_by_outcome["merged"] == [0, 0]


def test_the_same_settings_join_and_a_record_that_does_not_match_its_digest_is_refused(
        syncer, fast_config: dict) -> None:  # noqa: F811
    from atoll.errors import ConfigError
    from atoll.runtime.service.client import SyncerClient

    state, address, creds = syncer()
    record = run_record(_config(fast_config))
    me = SyncerClient(address, 0, creds[0], plaintext=True)
    numels = state.service.syncer.numels
    with pytest.raises(ConfigError, match="^settings: island 0's digest of its run settings is not the digest"):
        me.call("Join", schema.JoinRequest(numels=numels, settings=record, digest="0" * 64))
    with pytest.raises(ConfigError, match="^settings: island 0's run settings differ from the syncer's"):
        me.call("Join", schema.JoinRequest(numels=numels, digest="0" * 64))
    joined = me.call("Join", schema.JoinRequest(numels=numels, settings=record, digest=digest(record)))
    assert joined["session"] == me.session == 1
    assert state.refused_calls == {"settings": 2} and state.joined == {0}


def _push(state, client, tokens: int):  # noqa: ANN001, ANN202 - a whole push of fragment 0 in the client's session
    numel = state.service.syncer.numels[0]
    payload = wire.payload_bytes(state.codec.encode(torch.full((numel,), 1e-3)).tensors)
    return client.push(payload, 0, ((0, numel),), tokens, 0, client.session)


def test_a_second_job_of_an_island_fences_the_first_whose_calls_are_refused_and_counted(syncer) -> None:  # noqa: F811
    from atoll.runtime.service.client import SessionSuperseded, SyncerClient
    from atoll.runtime.service.lease import GO, StepLease

    state, address, creds = syncer()
    numels = state.service.syncer.numels
    first = SyncerClient(address, 0, creds[0], plaintext=True)
    first.call("Join", schema.JoinRequest(numels=numels))
    SyncerClient(address, 1, creds[1], plaintext=True).call("Join", schema.JoinRequest(numels=numels))
    lease = StepLease(first, 5, 0, 128, 2)
    deadline = time.monotonic() + 30
    while lease.take() != GO:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.call("Heartbeat", schema.HeartbeatRequest())  # its session is the live one: answered
    second = SyncerClient(address, 0, creds[0], plaintext=True)
    second.call("Join", schema.JoinRequest(numels=numels))
    assert (first.session, second.session) == (1, 2)
    line = ("session: island 0 joined again as session 2 (another job with --island 0, or a restart) and this job's "
            "session 1 is over; this job stops: run one job per island index")
    with pytest.raises(SessionSuperseded) as e:
        first.call("Heartbeat", schema.HeartbeatRequest())
    assert str(e.value) == line
    with pytest.raises(SessionSuperseded, match="^session: island 0 joined again"):
        first.call("Buffered", schema.BufferedRequest(fragment=0))
    with pytest.raises(SessionSuperseded, match="^session: island 0 joined again"):
        _push(state, first, 128)
    with pytest.raises(SessionSuperseded, match="^session: island 0 joined again"):  # its next step stops the job
        while True:
            lease.take()
    assert state.refused_calls == {"stale_session": 3}
    assert second.call("Heartbeat", schema.HeartbeatRequest()) == {"spent": False}
    lease.close()


def test_a_superseded_jobs_restart_is_refused_at_its_join_and_a_restart_of_the_live_job_is_not(
        syncer) -> None:  # noqa: F811
    """torchrun restarts a job that stopped with status 2: its next attempt (the same job id) is refused at the join,
    so it does not supersede the newer job in turn; the newer job's own restarts rejoin as before."""
    from atoll.runtime.service.client import SessionSuperseded, SyncerClient

    state, address, creds = syncer()
    numels = state.service.syncer.numels

    def join(job: str) -> int:
        return SyncerClient(address, 0, creds[0], plaintext=True).call(
            "Join", schema.JoinRequest(numels=numels, job=job))["session"]

    assert join("first") == 1 and join("second") == 2
    with pytest.raises(SessionSuperseded, match="^session: island 0 was joined by another job"):
        join("first")  # the first job's next torchrun attempt
    assert join("second") == 3  # the live job's own restart (its old session dead)
    assert join("third") == 4  # a third job supersedes the second
    with pytest.raises(SessionSuperseded):
        join("second")
    assert state.refused_calls == {"stale_session": 2}


def test_an_older_sessions_leave_cannot_end_the_live_session(syncer) -> None:  # noqa: F811
    """An old torchrun attempt's Leave is refused: the live session keeps its lease, the island stays joined, and
    its honest push claiming the steps of that lease is accepted (before: the lease went back, the island was
    marked left, and the push was refused as ``tokens``)."""
    from atoll.runtime.service.client import SessionSuperseded, SyncerClient

    state, address, creds = syncer()
    numels = state.service.syncer.numels
    old = SyncerClient(address, 0, creds[0], plaintext=True)
    old.call("Join", schema.JoinRequest(numels=numels))
    SyncerClient(address, 1, creds[1], plaintext=True).call("Join", schema.JoinRequest(numels=numels))
    assert old.call("ReserveSteps", schema.ReserveStepsRequest(n=5))["granted"] == 5
    live = SyncerClient(address, 0, creds[0], plaintext=True)  # torchrun's next attempt
    live.call("Join", schema.JoinRequest(numels=numels))
    assert live.call("ReserveSteps", schema.ReserveStepsRequest(n=5, used=0))["granted"] == 5
    with pytest.raises(SessionSuperseded):
        old.call("Leave", schema.LeaveRequest(used=0, steps=5))
    with pytest.raises(SessionSuperseded):
        old.call("ReserveSteps", schema.ReserveStepsRequest(n=5, used=0))
    assert state.refused_calls == {"stale_session": 2}
    assert 0 not in state.left and state.service.islands[0].leased == 5
    answer = _push(state, live, 5 * 4 * 32)
    assert answer["accepted"], state.service.syncer.rejected_by_reason
    assert state.service.syncer.rejected_by_reason == {}
    assert live.call("Leave", schema.LeaveRequest(used=5, steps=5))["returned"] == 0
    assert 0 in state.left


@pytest.mark.slow
def test_an_island_job_of_another_run_exits_2_in_one_line(fast_config: dict, tmp_path: Path) -> None:
    """End to end: ``atoll syncer`` and an ``atoll island`` whose --sync-every differs: one line, exit 2, counted."""
    from tests.conftest import free_port
    from tests.test_service import run_flags, start, status, wait_all, wait_for

    out, port, flags = tmp_path / "syncer", free_port(), run_flags(fast_config)
    procs = [start(["syncer", "--listen", f"127.0.0.1:{port}", "--out", str(out), *flags], tmp_path / "syncer.log")]
    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_0.token").is_file(), procs)
        other = [*flags]
        other[other.index("--sync-every") + 1] = "10"
        island = start(["island", "--syncer", f"127.0.0.1:{port}", "--plaintext", "--island", "0", "--credential",
                        str(out / "credentials" / "island_0.token"), *other], tmp_path / "island_0.log")
        assert wait_all([island], timeout=240) == [2]
        wait_for("the refusal in the status", lambda: status(out).get("refused_calls") == {"settings": 1}, procs)
        assert status(out)["commits"] == 0 and status(out)["joined"] == []
    finally:
        procs[0].send_signal(signal.SIGTERM)
        wait_all(procs, timeout=120)
    lines = (tmp_path / "island_0.log").read_text().strip().splitlines()
    assert lines == ["atoll: error: settings: island 0's sync_every is 10 but the syncer's is 5; start every island "
                     "with the syncer's run.toml"], lines


@pytest.mark.slow
def test_the_same_island_index_started_twice_ends_with_one_job_training(fast_config: dict, tmp_path: Path) -> None:
    """A second ``atoll island --island 1`` while the first trains: the first stops in one line with status 2 (its
    session superseded), the second trains to the end; the run ends with every process done."""
    from tests.conftest import free_port
    from tests.test_service import run_flags, start, wait_all, wait_for

    # a budget the first two jobs do not spend before the second job of island 1 has started (imports, data: about
    # 20 s on the loaded 2-core machine, in which the two islands take about 400 steps)
    out, port, flags = tmp_path / "syncer", free_port(), run_flags(fast_config, steps=1500)
    procs = [start(["syncer", "--listen", f"127.0.0.1:{port}", "--out", str(out), *flags], tmp_path / "syncer.log")]

    def island(i: int, log: str) -> subprocess.Popen:
        return start(["island", "--syncer", f"127.0.0.1:{port}", "--plaintext", "--island", str(i),
                      "--credential", str(out / "credentials" / f"island_{i}.token"), *flags], tmp_path / log)

    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_1.token").is_file(), procs)
        procs += [island(0, "island_0.log"), island(1, "island_1.log")]
        wait_for("island 1 joined", lambda: "joined (session 1" in (tmp_path / "island_1.log").read_text(), procs)
        procs.append(island(1, "island_1b.log"))
    finally:
        codes = wait_all(procs, timeout=600)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert codes == [0, 0, 2, 0], logs
    first = (tmp_path / "island_1.log").read_text().strip().splitlines()
    assert first[-1] == ("atoll: error: session: island 1 joined again as session 2 (another job with --island 1, "
                         "or a restart) and this job's session 1 is over; this job stops: run one job per island "
                         "index"), logs["island_1.log"]
    assert "Traceback" not in logs["island_1.log"]
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["islands_left"] == [0, 1] and summary["refused_calls"].get("stale_session", 0) >= 1
    assert "replay" not in summary["rejected_by_reason"], summary["rejected_by_reason"]
    assert "done;" in (tmp_path / "island_1b.log").read_text()


def test_a_heartbeat_of_the_present_session_is_answered_while_a_merge_holds_the_lock(syncer) -> None:  # noqa: F811
    """A merge holds the server's lock for a fragment's outer step; the present session's heartbeat does not wait
    for it (it would read as a lost island), an older session's still takes the lock and is refused."""
    import threading

    from atoll.runtime.service.client import SessionSuperseded, SyncerClient

    state, address, creds = syncer()
    numels = state.service.syncer.numels
    first = SyncerClient(address, 0, creds[0], plaintext=True)
    first.call("Join", schema.JoinRequest(numels=numels))
    me = SyncerClient(address, 0, creds[0], plaintext=True)
    me.call("Join", schema.JoinRequest(numels=numels))  # session 2 fences session 1
    heard_before = state.service.islands[0].heard
    replies: list[object] = []
    with state.lock:  # as a merge does
        t = threading.Thread(target=lambda: replies.append(me.call("Heartbeat", schema.HeartbeatRequest())))
        t.start()
        t.join(timeout=60)
        answered_under_lock = not t.is_alive()
        stale: list[BaseException] = []

        def old() -> None:
            try:
                first.call("Heartbeat", schema.HeartbeatRequest())
            except SessionSuperseded as e:
                stale.append(e)

        o = threading.Thread(target=old)
        o.start()
        o.join(timeout=1.0)
        waited = o.is_alive()  # the older session's heartbeat takes the slow path: it waits for the lock
    t.join(timeout=60)
    o.join(timeout=60)
    assert answered_under_lock and replies == [{"spent": False}]
    assert state.service.islands[0].heard is not None and state.service.islands[0].heard != heard_before
    assert waited and len(stale) == 1 and state.refused_calls == {"stale_session": 1}
