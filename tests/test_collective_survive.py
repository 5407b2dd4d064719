"""The collective runtime's failure handling: survivors go on without a lost island, a frozen rank is killed
as soon as its peers report it, a killed launcher stops the ranks with one line, an early checkpoint.

Every run is a subprocess with a timeout, and every exit status is checked (micro model, 12 steps).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import cli_flags, run_ranks

from atoll.config import build_config
from atoll.config.applies import applicable
from atoll.errors import ConfigError
from atoll.job.checkpoint import resume_advice
from atoll.job.lock import RunLock
from atoll.job.metrics import read_metrics
from atoll.runtime.collective import EXIT_PEER_FAILURE, KILL_HOOK_ENV
from atoll.runtime.collective.quorum import Quorum
from atoll.runtime.network import ring_allreduce_bytes

STEPS = 12


@pytest.fixture()
def settings(corpus_file: Path, cache_dir: Path) -> dict:
    return {"data": str(corpus_file), "cache_dir": str(cache_dir), "model": "micro", "vocab_size": 512,
            "seq_len": 32, "batch_size": 4, "islands": 3, "steps": STEPS, "sync_every": 5, "eval_every": 12,
            "eval_batches": 2, "progress": False, "threads": 1, "runtime": "collective"}


def _train(settings: dict, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atoll.cli", "train", *cli_flags(settings)], capture_output=True,
                           text=True, timeout=timeout, env={**os.environ, **(env or {})})


# --- item 8: the survivors go on ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "ranks", "kill", "extra"), [
    # (diloco on islands of one rank is diloco-3x2's maths on ddp-3x1's layout: not run again)
    ("ddp", 1, 1, {}), ("diloco", 2, 3, {}),
    # an exchange in flight over an inner step, int4 payloads all-gathered; DeMo's all-gathered components
    ("streaming", 1, 1, {"fragments": 2, "overlap_steps": 1, "codec": "int4"}), ("demo", 1, 1, {}),
], ids=["ddp-3x1", "diloco-3x2", "streaming-int4-3x1", "demo-3x1"])
def test_survivors_of_a_killed_island_finish_the_run(settings: dict, tmp_path: Path, strategy: str, ranks: int,
                                                     kill: int, extra: dict) -> None:
    out = tmp_path / "run"
    r = _train({**settings, "strategy": strategy, "ranks_per_island": ranks, "out": str(out), **extra},
               env={KILL_HOOK_ENV: f"{kill}:8"})
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["lost_islands"]) == ["1"] and summary["lost_islands"]["1"] >= 8
    assert summary["islands_alive"] == 2
    # every exchange from the loss on averaged the two survivors: ddp's and demo's steps 8..12, diloco's
    # at 10 and 12, streaming's fragments started at 8 and 10 and both fragments' final syncs at 12
    assert summary["degraded_exchanges"] == {"ddp": 5, "demo": 5, "diloco": 2, "streaming": 4}[strategy]
    if strategy in ("ddp", "diloco"):  # bytes: K = 3 before the loss, 2 after (the failed one recounted at 2)
        n = summary["params"]
        full = summary["exchanges"] - summary["degraded_exchanges"]
        assert summary["bytes_sent_per_island"] == pytest.approx(
            full * ring_allreduce_bytes(4 * n, 3) + summary["degraded_exchanges"] * ring_allreduce_bytes(4 * n, 2))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert [e["step"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "eval"] == [0, STEPS]
    warning = [ln for ln in r.stderr.splitlines() if ln.startswith("atoll: warning:")]
    assert "atoll: error:" not in r.stderr
    assert all(ln.startswith(f"atoll: warning: island 1 (rank {kill}) stopped responding") for ln in warning)
    # the survivors' one warning; and the live rank of the dropped island says so in a warning (the run goes on),
    # and stops (the two in either order)
    assert sorted(ln.endswith("going on with 2 of 3 islands") for ln in warning) == [False] * (ranks - 1) + [True]
    assert sum(ln.endswith("island 1 is dropped and the other islands go on without it") for ln in warning) == ranks - 1


@pytest.mark.slow
def test_survivors_go_on_under_torchruns_environment(settings: dict, tmp_path: Path) -> None:
    """Ranks started as torchrun starts them, without an agent store: rank 0's default group hosts the store,
    which must outlive the group that the survivors destroy."""
    out = tmp_path / "run"
    flags = cli_flags({**settings, "strategy": "diloco", "out": str(out)})
    codes, _, errs = run_ranks(["-m", "atoll.cli", "train", *flags], 3, timeout=240, **{KILL_HOOK_ENV: "2:8"})
    assert codes == [0, 0, -9], errs[0][-3000:]
    assert json.loads((out / "summary.json").read_text())["lost_islands"] == {"2": 10}
    # the first warning names the lost island (the first test of a session notes the tokenizer it trains before)
    warnings = [line for line in errs[0].splitlines() if line.startswith("atoll: warning:")]
    assert warnings[0].startswith("atoll: warning: island 2 (rank 2) stopped responding at inner step 10")
    assert "Traceback" not in errs[0]


@pytest.mark.slow
def test_a_restarted_island_rejoins_with_a_live_islands_state(settings: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = _train({**settings, "strategy": "diloco", "steps": 40, "eval_every": 40, "max_restarts": 1, "out": str(out)},
               env={KILL_HOOK_ENV: "1:8"})
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_islands"] == {"1": 8}  # found at the end of step 8 by the per-step check for joiners
    (rejoined,) = summary["rejoined_islands"].values()
    assert list(summary["rejoined_islands"]) == ["1"] and 8 <= rejoined < 40
    assert summary["islands_alive"] == 3
    # island 1's tokens: every step after it rejoined, none of the state it took; its 7 steps before the kill
    # were never reported (totals run every 10 steps) and are not counted
    per_step = settings["batch_size"] * settings["seq_len"]
    assert summary["tokens"] == per_step * (2 * 40 + 40 - rejoined)
    # bytes: each exchange at the number of islands that made it
    n = summary["params"]
    k2 = summary["degraded_exchanges"]
    assert summary["bytes_sent_per_island"] == pytest.approx(
        (summary["exchanges"] - k2) * ring_allreduce_bytes(4 * n, 3) + k2 * ring_allreduce_bytes(4 * n, 2))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_max_restarts_needs_survivors_and_one_rank_per_island() -> None:
    with pytest.raises(ConfigError, match="max_restarts: a restarted island rejoins survivors"):
        build_config(overrides={"runtime": "collective", "islands": 3, "max_restarts": 1, "ranks_per_island": 2,
                                "batch_size": 4})
    with pytest.raises(ConfigError, match="max_restarts"):
        build_config(overrides={"runtime": "collective", "islands": 3, "max_restarts": 1, "min_islands": 3})


def test_a_state_travels_as_safetensors_and_json() -> None:
    from atoll.runtime.collective.transfer import decode_state, encode_state

    state = {"step": 9, "w": torch.arange(6.0).reshape(2, 3), "opt": {"state": {0: {"m": torch.ones(2)}},
                                                                      "param_groups": [{"lr": 0.1}]}}
    got = decode_state(encode_state(state))
    assert got["step"] == 9 and got["opt"]["param_groups"] == [{"lr": 0.1}]
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["opt"]["state"][0]["m"], torch.ones(2))


@pytest.mark.slow
def test_losing_island_0_or_going_below_min_islands_stops_the_run(settings: dict, tmp_path: Path) -> None:
    r = _train({**settings, "strategy": "ddp", "min_islands": 3, "out": str(tmp_path / "a")},
               env={KILL_HOOK_ENV: "2:4"})
    assert r.returncode == 128 + 9, r.stderr[-3000:]
    # stop mode, no quorum: one line for the run, the launcher's (the survivors hand theirs over, unsaid)
    _assert_one_kill_line(r.stderr, "rank 2 (island 2)", tmp_path / "a")
    r = _train({**settings, "strategy": "ddp", "out": str(tmp_path / "b")}, env={KILL_HOOK_ENV: "0:4"})
    assert r.returncode == 128 + 9, r.stderr[-3000:]
    _assert_one_kill_line(r.stderr, "rank 0 (island 0)", tmp_path / "b")
    # island 0's second rank: its live rank stops the run with the others (it said "island 0 is dropped and the
    # other islands go on without it", beside the others' line and none of the launcher's)
    r = _train({**settings, "strategy": "ddp", "islands": 2, "ranks_per_island": 2, "out": str(tmp_path / "c")},
               env={KILL_HOOK_ENV: "1:4"})
    assert r.returncode == 128 + 9, r.stderr[-3000:]
    _assert_one_kill_line(r.stderr, "rank 1 (island 0)", tmp_path / "c")


def _assert_one_kill_line(stderr: str, who: str, out: Path) -> None:
    """``stderr`` says one error: ``who`` killed by SIGKILL, and how to resume ``out`` (from its checkpoint)."""
    errors = [ln for ln in stderr.splitlines() if ln.startswith("atoll: error:")]
    assert len(errors) == 1, errors
    assert re.fullmatch(re.escape(f"atoll: error: {who} was killed by SIGKILL; resume with 'atoll train --resume "
                                  f"{out}' (from step ") + r"[0-9]+\)", errors[0]), errors


def test_quorum_drops_every_island_that_lost_a_rank_and_agrees_once() -> None:
    store = dist.HashStore()
    dead = {3}
    quorums = [Quorum(store, r, 2, lambda rank, _s: rank in dead, timeout_s=5) for r in range(6)]
    for r in (0, 1, 4, 5, 2):
        store.set(f"1/op/{r}", "14" if r != 2 else "10")  # rank 2 (island 1) failed in another operation
    assert quorums[0].agree(1, 14, [0, 1, 2]) == ([0, 2], [3])
    # decided once: a rank that had another view adopts the stored membership
    assert quorums[5].agree(1, 14, [0, 1, 2]) == ([0, 2], [3])
    # survivors that failed in different operations cannot redo the same one: nothing is agreed
    store2 = dist.HashStore()
    q = [Quorum(store2, r, 1, lambda rank, _s: rank == 2, timeout_s=5) for r in range(3)]
    store2.set("1/op/1", "7")
    assert q[0].agree(1, 6, [0, 1, 2]) is None


def test_min_islands_above_islands_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"min_islands \(3\) exceeds islands \(2\); set --min-islands"):
        build_config(overrides={"runtime": "collective", "islands": 2, "min_islands": 3})


# --- item 7: a frozen rank, a killed launcher -------------------------------------------------------------


@pytest.mark.slow
def test_a_frozen_rank_is_killed_as_soon_as_its_peers_report_it(settings: dict, tmp_path: Path) -> None:
    """The launcher is given a grace of hours: only the report can end the frozen rank (SIGSTOP)."""
    out = tmp_path / "run"
    overrides = applicable({**settings, "islands": 2, "min_islands": 2, "strategy": "ddp",
                            "collective_timeout_s": 5, "out": str(out)})
    code = ("import sys\nfrom atoll.config import build_config\nfrom atoll.errors import RunFailed\n"
            "from atoll.runtime.collective import launch\n"
            f"config = build_config(overrides={overrides!r})\n"
            "try:\n    launch(config, 'atoll.training:train', grace_s=36000)\n"
            "except RunFailed as e:\n    print(f'atoll: error: {e}', file=sys.stderr)\n    sys.exit(e.exit_code)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                       env={**os.environ, KILL_HOOK_ENV: "1:8:STOP"})
    assert r.returncode == EXIT_PEER_FAILURE, r.stderr[-3000:]
    # one line, beside the status line of a tokenizer trained on a cold cache (this test run alone): the survivor's,
    # said by the launcher (the survivor handed it over)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "-token BPE tokenizer" not in ln]
    assert len(lines) == 1, lines
    # (the heartbeat's "no heartbeat for 5 s" or gloo's 5 s deadline, whichever comes first)
    assert lines[0].startswith("atoll: error: island 1 (rank 1) stopped responding at inner step 8 (")


@pytest.mark.slow
def test_survivors_go_on_after_a_frozen_island_is_reported_and_killed(settings: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = _train({**settings, "strategy": "ddp", "collective_timeout_s": 5, "out": str(out)},
               env={KILL_HOOK_ENV: "2:8:STOP"})
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_islands"] == {"2": 8} and summary["degraded_exchanges"] == 5


def _training(settings: dict, out: Path) -> subprocess.Popen:
    """A collective run of 2 islands that trains until it is stopped, in a session of its own, once its first
    exchange's checkpoint is written (its ranks are training); its stderr piped."""
    flags = cli_flags({**settings, "islands": 2, "steps": 100000, "eval_every": 100000, "checkpoint_every": 0,
                       "strategy": "diloco", "out": str(out)})
    p = subprocess.Popen([sys.executable, "-m", "atoll.cli", "train", *flags], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not (out / "checkpoints" / "latest").exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    if not (out / "checkpoints" / "latest").exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"no checkpoint within 180 s: {p.communicate(timeout=60)[1][-3000:]}")
    return p


@pytest.mark.slow
def test_a_killed_launcher_stops_the_ranks_with_one_line(settings: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = _training(settings, out)
    try:
        # the launcher killed while its ranks are held still: the ranks hold the run folder's lock without it, so
        # a --resume started before they stop is refused (two writers in one folder), naming the ended launcher
        ranks = _session_pids(p.pid)
        assert len(ranks) >= 3, ranks  # the fork server and 2 ranks (with multiprocessing's resource tracker)
        os.killpg(p.pid, signal.SIGSTOP)
        try:
            os.kill(p.pid, signal.SIGKILL)  # the launcher, and with it the rendezvous store
            p.wait(timeout=30)
            with pytest.raises(ConfigError, match=f"in use, though atoll process {p.pid}, which took it, is not"):
                RunLock(out)
        finally:
            os.killpg(p.pid, signal.SIGCONT)
        _, err = p.communicate(timeout=90)  # returns once every rank has closed its stderr: they all exited
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # anything of this test's session still running
    # one line, beside the status line of a tokenizer trained on a cold cache (this test run alone): no c10d
    # warnings (TORCH_CPP_LOG_LEVEL=ERROR in the ranks), and one rank's line only, whichever rank found the store
    # gone first (a collective failed by a peer that stopped on it names the store too)
    lines = [ln for ln in err.splitlines() if ln.strip() and "-token BPE tokenizer" not in ln]
    assert len(lines) == 1, lines[:5]
    assert lines[0].startswith("atoll: error: the launcher's rendezvous store stopped responding at inner step ")
    assert lines[0].endswith(f"resume with 'atoll train --resume {out}' (from step 5)")


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (started with ``start_new_session``) other than its leader."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != sid:
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":  # (state, ppid, pgrp, session, ...)
                    found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fork-server-killed", "group-sigterm", "rank-sigterm"])
def test_a_run_stopped_from_outside_checkpoints_and_says_so_in_one_line(settings: dict, tmp_path: Path,
                                                                         how: str) -> None:
    """The fork server that started the ranks killed: it reported every live rank as ended with 255 (before: the
    launcher exited 255 without a word, and the ranks trained on into the folder). Now the launcher asks them to
    stop after the step they agree on, waits for them, and says so in one line, with the resume advice. A SIGTERM
    to the whole process group (a batch system's cancel) ends the fork server too, which has no handler for it:
    that is an interrupt, exit 143, as for the launcher alone; and so is a SIGTERM that reached one rank only
    (before: exit 143 without the interrupt's line, the launcher having had no signal itself)."""
    out = tmp_path / "run"
    p = _training(settings, out)
    try:
        if how == "group-sigterm":
            os.killpg(p.pid, signal.SIGTERM)
        elif how == "rank-sigterm":
            server = next(pid for pid in _session_pids(p.pid) if _parent(pid) == p.pid
                          and b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes())
            os.kill(next(pid for pid in _session_pids(p.pid) if _parent(pid) == server), signal.SIGTERM)
        else:
            server = next(pid for pid in _session_pids(p.pid) if _parent(pid) == p.pid  # (its ranks: same cmdline)
                          and b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes())
            os.kill(server, signal.SIGKILL)
        _, err = p.communicate(timeout=120)
        assert p.returncode == (1 if how == "fork-server-killed" else 143), err[-3000:]
        for _ in range(100):  # no rank left writing (the last to close stderr may still be ending)
            if not _session_pids(p.pid):
                break
            time.sleep(0.1)
        assert not _session_pids(p.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    lines = [ln for ln in err.splitlines() if ln.strip() and "-token BPE tokenizer" not in ln]
    step = int((out / "checkpoints" / "latest").resolve().name.split("_")[1])
    assert step > 5  # they checkpointed where they stopped, after the first exchange's
    advice = f"resume with 'atoll train --resume {out}'"
    if how != "fork-server-killed":
        # (each process of the group got the signal and says it finishes its step: the launcher and each rank)
        assert lines[-1] == f"atoll: stopped by SIGTERM: checkpoint written at step {step}; {advice}", lines
        assert set(lines[:-1]) == {"atoll: SIGTERM: finishing this inner step and writing a checkpoint (send it "
                                   "again to stop at once)"}, lines
    else:
        assert lines == ["atoll: error: the fork server that started the ranks was lost (killed?); they stopped "
                         f"after the checkpoint they agreed on; {advice} (from step {step})"], lines
    RunLock(out).release()  # nothing holds the folder


def _ended(survive: bool, first: tuple[int, int], exits: list[int], lines: dict[int, tuple[str, int | None]],
           tmp_path: Path) -> tuple[int, str]:
    """(exit status, line) of a launcher's outcome for ranks that ended with ``exits`` (one rank per island),
    the first failure noted ``first`` and the survivors' handed-over ``lines`` (line, the rank found silent)."""
    from types import SimpleNamespace

    from atoll.errors import RunFailed
    from atoll.runtime.collective.launch import Supervisor

    ranks = Supervisor.__new__(Supervisor)  # its state alone: no process is started
    ranks.config = SimpleNamespace(runtime_config=SimpleNamespace(ranks_per_island=1))
    ranks.procs = [SimpleNamespace(exitcode=code) for code in exits]
    ranks.orphans, ranks.killed, ranks.survive, ranks.first, ranks.lines = [], set(), survive, first, lines
    with pytest.raises(RunFailed) as failed:
        ranks.outcome(tmp_path)
    return failed.value.exit_code, str(failed.value)


def test_the_launchers_one_line_names_the_failure_that_ended_the_run(tmp_path: Path) -> None:
    lost0 = "island 0 (rank 0) stopped responding at inner step 12 (gone; island 0 writes the run folder); resume"
    killed = f"was killed by SIGKILL; {resume_advice(tmp_path)}"
    # a loss survived (island 3), then island 0's rank killed: the line names rank 0, not the survived loss;
    # also where rank 0 was the last survivor, with nobody to hand a line over
    assert _ended(True, (3, -9), [-9, 3, 3, -9], {1: (lost0, 0), 2: (lost0, 0)}, tmp_path) == (
        137, f"rank 0 (island 0) {killed}")
    assert _ended(True, (1, -9), [-9, -9], {}, tmp_path) == (137, f"rank 0 (island 0) {killed}")
    # a loss survived, then too few islands after a second kill: the rank the survivors found silent, killed
    few = "island 1 (rank 1) stopped responding at inner step 9 (gone; 2 of 4 islands left, --min-islands 3); resume"
    assert _ended(True, (3, -9), [3, -9, 3, -9], {0: (few, 1), 2: (few, 1)}, tmp_path) == (
        137, f"rank 1 (island 1) {killed}")
    # ... or a silent rank that no signal ended (frozen, killed here): the lowest survivor's line, its status
    assert _ended(True, (3, -9), [3, 3, 3, -9], {0: (few, 1), 2: (few, 1)}, tmp_path) == (EXIT_PEER_FAILURE, few)
    # stop mode: the first survivor's own line; one that printed its own (the store did not take it) is not
    # followed by another rank's
    assert _ended(False, (1, 3), [3, 3, -9], {0: (lost0, 2)}, tmp_path) == (EXIT_PEER_FAILURE, "")
    assert _ended(False, (0, 3), [3, 3, 3], {0: (lost0, 2), 1: ("other", 2)}, tmp_path) == (EXIT_PEER_FAILURE, lost0)


def test_a_fork_server_lost_while_starting_the_ranks_is_one_line(settings: dict, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What multiprocessing raises when the fork server dies as it starts a rank (EOFError reading the new
    rank's pid; an OSError connecting to it) is one line, not a traceback."""
    from atoll.errors import RunFailed
    from atoll.runtime.collective.launch import Supervisor

    config = build_config(overrides=applicable({**settings, "islands": 2, "out": str(tmp_path / "run")}))
    for error, resume, advice in ((EOFError("unexpected EOF"), False, "start it again"),
                                  (ConnectionRefusedError(111, "refused"), True, "no checkpoint was written yet")):
        ranks = Supervisor(config, "atoll.training:train", resume, {}, grace_s=1.0)

        def lost(_self: object, error: BaseException = error) -> None:
            raise error

        monkeypatch.setattr(type(ranks.procs[0]), "start", lost)
        with pytest.raises(RunFailed) as e:
            ranks.start()
        assert e.value.exit_code == 1
        assert str(e.value).startswith("the fork server that starts the ranks was lost while it started them "
                                       f"(killed?: {type(error).__name__}); {advice}"), str(e.value)


def test_a_signal_while_the_data_is_prepared_starts_no_rank_and_leaves_no_folder(
        settings: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM to the launcher while it prepares the data (a tokenizer trained on a large corpus takes minutes):
    before, the default action ended it in silence, leaving a folder that held only its lock; now no rank is
    started, the command says it stopped with no checkpoint, and the new folder is removed."""
    import importlib

    from atoll.errors import Interrupted

    launcher = importlib.import_module("atoll.runtime.collective.launch")  # (the package exports its function)

    def prepare(_config: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # (the handler sets the request: nothing ends here)

    monkeypatch.setattr(launcher, "_prepare_data", prepare)
    started: list[int] = []
    monkeypatch.setattr(launcher.Supervisor, "start", lambda self: started.append(1))
    out = tmp_path / "run"
    config = build_config(overrides=applicable({**settings, "islands": 2, "out": str(out)}))
    with pytest.raises(Interrupted) as e:
        launcher.launch(config, "atoll.training:train")
    assert e.value.exit_code == 143 and str(e.value) == "stopped by SIGTERM: no checkpoint written"
    assert not started and not out.exists()


# --- item 9: something to resume from early -------------------------------------------------------------


@pytest.mark.slow
def test_a_collective_run_checkpoints_after_its_first_exchange(settings: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"  # checkpoint_every stays 100: only the early checkpoint is there by step 8
    r = _train({**settings, "islands": 2, "strategy": "diloco", "min_islands": 2, "out": str(out)},
               env={KILL_HOOK_ENV: "1:8"})
    assert r.returncode == 128 + 9, r.stderr[-3000:]
    assert (out / "checkpoints" / "latest").resolve().name == "step_0000005"
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("atoll: error:")]
    assert errors == [f"atoll: error: rank 1 (island 1) was killed by SIGKILL; resume with 'atoll train --resume "
                      f"{out}' (from step 5)"], errors
    r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", "--resume", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS
    assert "lost_islands" not in json.loads((out / "summary.json").read_text())


# --- issue 26: membership that survives repeated failures, a job-wide pause ------------------------------


def _events(summary: dict) -> list[tuple[str, int]]:
    return [(e["kind"], e["island"]) for e in summary["membership"]]


@pytest.mark.slow
def test_a_loss_after_a_rejoin_is_survived(settings: dict, tmp_path: Path) -> None:
    """The rejoined rank counts operations as the islands that never left, so when another island is lost
    the survivors (one of them rejoined) agree on the failed collective and go on (before: they registered
    different operation numbers, read 'failed in different collectives' and all stopped, exit 137)."""
    out = tmp_path / "run"
    r = _train({**settings, "strategy": "diloco", "steps": 40, "eval_every": 40, "max_restarts": 2, "out": str(out)},
               env={KILL_HOOK_ENV: "1:4,2:+2"})  # rank 2 dies 2 steps after rank 1 rejoined
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    members = summary["membership"]
    assert _events(summary)[:3] == [("lost", 1), ("rejoined", 1), ("lost", 2)], members
    assert members[0]["step"] == 4 and members[2]["step"] == members[1]["step"] + 2
    assert [e["epoch"] for e in members] == list(range(1, len(members) + 1))  # one epoch per change
    assert summary["lost_islands"]["2"] == members[2]["step"]
    # every change is a run event of metrics.jsonl too (failure, rejoin), with its island, step and epoch
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    changes = [(e["event"], e["island"], e["step"], e["epoch"]) for e in logged if e["event"] in ("failure", "rejoin")]
    assert changes == [("failure" if m["kind"] == "lost" else "rejoin", m["island"], m["step"], m["epoch"])
                       for m in members], changes
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("atoll: warning:")]
    assert [w.split(" stopped")[0] for w in warnings] == ["atoll: warning: island 1 (rank 1)",
                                                          "atoll: warning: island 2 (rank 2)"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("second", ["KILL", "STOP"])
def test_a_rank_fails_and_rejoins_twice(settings: dict, tmp_path: Path, second: str) -> None:
    """Admissions answer one request each and are deleted once read: the rank restarted a second time waits
    for its own admission (before: it found its first one, joined that old epoch, and the live islands waited
    for it until the collective timeout and stopped). Frozen the second time, the restarted rank is reported
    by its peers and killed by the launcher, which watches it again once admitted (before: it ignored every
    report about a restarted rank, so the frozen process was never restarted)."""
    out = tmp_path / "run"
    steps = 40 if second == "KILL" else 200  # (a frozen rank is restarted only once the survivors went on)
    r = _train({**settings, "strategy": "diloco", "steps": steps, "eval_every": steps, "max_restarts": 2,
                "out": str(out), **({"collective_timeout_s": 10} if second == "STOP" else {})},
               env={KILL_HOOK_ENV: f"1:4,1:+2:{second}"})  # rank 1 at step 4, its restarted process 2 steps after
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["islands_alive"] == 3  # back after its second loss
    assert _events(summary) == [("lost", 1), ("rejoined", 1), ("lost", 1), ("rejoined", 1)], summary["membership"]
    first, second = summary["membership"][1]["step"], summary["membership"][3]["step"]
    assert summary["lost_islands"] == {"1": first + 2} and summary["rejoined_islands"] == {"1": second}
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def _process_group(pgid: int) -> list[int]:
    """The pids of process group ``pgid``, ascending (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(entry))
    return sorted(pids)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc")
def test_a_paused_job_goes_on_without_killing_an_island(settings: dict, tmp_path: Path) -> None:
    """Every process of the run is stopped for longer than the heartbeat's silence limit (10 s) and continued
    one by one, 1 s apart (the launcher first, the ranks in the order they started): the first rank to run
    again must not report the others silent (before: rank 0 reported rank 1, the launcher killed it, exit 3)."""
    out = tmp_path / "run"
    flags = cli_flags({**settings, "islands": 2, "min_islands": 2, "steps": 60, "eval_every": 60,
                       "strategy": "diloco", "collective_timeout_s": 20, "out": str(out)})
    p = subprocess.Popen([sys.executable, "-m", "atoll.cli", "train", *flags], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / "checkpoints" / "latest").exists()  # the first exchange's checkpoint: ranks are training
        os.killpg(p.pid, signal.SIGSTOP)
        try:
            time.sleep(12)  # > the 10 s silence limit, < the 20 s collective timeout
            for pid in _process_group(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                time.sleep(1.0)
        finally:
            os.killpg(p.pid, signal.SIGCONT)
        _, err = p.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # anything of this test's session still running
    assert p.returncode == 0, err[-3000:]
    assert "stopped responding" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60 and "lost_islands" not in summary


def test_a_heartbeat_forgives_a_pause_it_sat_through_but_finds_a_silent_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's heartbeat against a store where the test beats for rank 1. A job-wide pause is the monotonic
    clock jumping 10 s while rank 1 did not beat: no report; rank 1 then falling silent is reported. Time runs
    4x faster than in a job (a beat every 0.125 s, a pause past 0.5 s more, silent past 0.75 s): the same
    proportions, a quarter of the wait."""
    from types import SimpleNamespace

    from atoll.runtime.collective import heartbeat as hb
    from atoll.runtime.collective.launch import loopback_store

    scale = 0.25
    monkeypatch.setattr(hb, "HEARTBEAT_S", hb.HEARTBEAT_S * scale)
    monkeypatch.setattr(hb, "PAUSE_S", hb.PAUSE_S * scale)
    stale_s = 3.0 * scale
    store = loopback_store(10)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    jump = [0.0]
    monkeypatch.setattr(hb, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + jump[0]))
    peer = dist.PrefixStore("t/", store)
    peer.add("hb/1", 1)
    peer.add("bye/1", 0)
    found: list[int | None] = []
    beat = hb._Heartbeat(0, 2, "t/", stale_s, lambda rank, _why: found.append(rank), store_host=None,
                         on_store_lost=lambda _why: found.append(None))
    beat.start()
    try:
        for _ in range(6):  # 6 beats of rank 1
            peer.add("hb/1", 1)
            time.sleep(0.25 * scale)
        jump[0] = 10.0  # the pause: every clock moved 10 s, and nobody beat
        time.sleep(1.5 * scale)  # rank 1 runs again later than rank 0 (half the silence limit)
        for _ in range(8):
            peer.add("hb/1", 1)
            time.sleep(0.25 * scale)
        assert found == []
        assert not beat.is_gone(1, stale_s)
        deadline = time.monotonic() + 10  # rank 1 falls silent for real: found within the limit (+ beats)
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found == [1]
    finally:
        beat.leave()
        beat.thread.join(timeout=5)


def test_the_jobs_tokens_keep_a_lost_islands_count_and_a_rejoined_islands_offset() -> None:
    from atoll.runtime.collective.job_tokens import JobTokens

    tokens = JobTokens([0] * 3)
    assert tokens.update({0: 100, 1: 90, 2: 80}) == 270
    assert tokens.update({0: 200, 2: 160}) == 200 + 90 + 160  # island 1 lost: its count stays as last reported
    tokens.rejoined(1, counted=200)  # it took island 0's state (200 tokens of its own count)
    assert tokens.offset == 90 - 200 and tokens.of == [200, 90, 160]


def test_membership_counts_every_loss_and_rejoin() -> None:
    from atoll.runtime.collective.membership import Membership

    m = Membership(3)
    assert m.alive == [0, 1, 2] and m.epoch == 0 and m.first_rejoin() is None
    m.drop([1], 6)
    m.admit([1], 16)
    m.drop([1], 20)
    m.admit([1], 31)
    assert m.alive == [0, 1, 2] and m.epoch == 4 and m.first_rejoin() == 16
    assert m.lost == {1: 20} and m.rejoined == {1: 31}  # the latest of each
    copy = Membership(3)
    copy.load_state_dict(json.loads(json.dumps(m.state_dict())))  # travels as JSON to a joiner
    assert copy == m
    with pytest.raises(ValueError, match="not all alive"):
        m.drop([3], 40)
    with pytest.raises(ValueError, match="alive already"):
        m.admit([0], 40)
    with pytest.raises(ValueError, match="3 islands"):
        Membership(2).load_state_dict(m.state_dict())


def test_the_kill_hook_takes_several_entries_and_steps_after_a_rejoin() -> None:
    from atoll.job.faults import KillAt, parse_kill_hook

    assert parse_kill_hook("1:6, 2:+4:STOP") == [KillAt(1, 6, signal.SIGKILL),
                                                 KillAt(2, 4, signal.SIGSTOP, after_rejoin=True)]
    with pytest.raises(ConfigError, match=KILL_HOOK_ENV):
        parse_kill_hook("1:6;2:4")


def test_the_kill_hook_is_a_fault_hook_told_once_as_the_process_starts(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """Installed from the environment with the NaN faults (one mechanism, read once); it fires only as its rank
    starts the step (kind "start", which only the collective runtime calls), counting "+N" from the job's first
    rejoin, and notes when in the stamp file."""
    from types import SimpleNamespace

    from atoll.job import divergence, faults

    sent: list[tuple[int, signal.Signals]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setenv(KILL_HOOK_ENV, "1:3,2:+2:STOP")
    monkeypatch.setenv(faults.KILL_STAMP_ENV, str(tmp_path / "stamp"))
    monkeypatch.setenv(divergence.FAULT_HOOK_ENV, "weights:0:1")
    divergence.install_fault_hook_from_env()
    monkeypatch.delenv(KILL_HOOK_ENV)  # never read again
    island = SimpleNamespace(index=0, params=[torch.zeros(2)])
    divergence.inject_fault(island, 2, "weights")  # not "start": no kill (the local runtime never says it)
    divergence.inject_fault(island, 1, "start", rank=1, first_rejoin=None)
    divergence.inject_fault(island, 2, "start", rank=2, first_rejoin=None)  # no rejoin yet: "+2" never fires
    assert sent == [] and not (tmp_path / "stamp").exists()
    divergence.inject_fault(island, 2, "start", rank=1, first_rejoin=None)  # rank 1 starting step 3
    divergence.inject_fault(island, 6, "start", rank=2, first_rejoin=5)  # 2 steps after the rejoin at 5
    assert sent == [(os.getpid(), signal.SIGKILL), (os.getpid(), signal.SIGSTOP)]
    assert float((tmp_path / "stamp").read_text()) > 0
    divergence.inject_fault(island, 0, "weights")  # the NaN fault of the same environment, in the same hook
    assert torch.isnan(island.params[0]).all()
