"""Islands that are jobs of several ranks (torchrun) against ``atoll syncer``: they train and merge, end near
the local runtime's run, mix with islands of one rank, and survive a rank's SIGKILL.

Loopback, CPU (gloo), micro model. Every process started (the syncer, ``torchrun``, a single-rank island) is
waited for with a timeout and its exit status asserted; torchrun's own exit status is its ranks'.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import free_port, run_cli
from tests.test_service import make_cert, run_flags, start, status, wait_all, wait_for

pytest.importorskip("cryptography")


def island_args(i: int, port: int, out: Path, flags: list[str], tls: Path | None) -> list[str]:
    connect = ["--tls-ca", str(tls)] if tls is not None else ["--plaintext"]
    return ["island", "--syncer", f"127.0.0.1:{port}", *connect, "--island", str(i),
            "--credential", str(out / "credentials" / f"island_{i}.token"), *flags]


def torchrun(args: list[str], log: Path, ranks: int = 2, restarts: int = 0,
             env: dict | None = None) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node RANKS -m atoll ARGS`` (its ranks in its own session: a hung
    job is killed whole)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                "--max-restarts", str(restarts), "--monitor-interval", "0.5", "-m", "atoll"]
    return start(args, log, launcher=launcher, env=env)


def _logs(tmp_path: Path) -> dict[str, str]:
    return {p.name: p.read_text()[-3000:] for p in tmp_path.glob("*.log")}


def _local(fast_config: dict, flags: list[str], out: Path) -> dict:
    """The local runtime's decoupled run of the same settings and seeds (the reference, failure-free)."""
    local = run_cli("train", "--strategy", "decoupled", *flags, "--out", str(out))
    assert local.returncode == 0, local.stderr
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "fsdp"])
def test_two_island_jobs_of_two_ranks_end_near_the_local_run(fast_config: dict, tmp_path: Path, shard: bool) -> None:
    """The syncer and 2 island jobs of 2 ranks each (TLS; each rank moving its own slice of every fragment;
    with FSDP2 the second island has its leader move whole fragments) end within 2% of the local-runtime
    decoupled run with the same settings and seeds, at equal tokens."""
    cert, key = make_cert(tmp_path)
    out, port, flags = tmp_path / "syncer", free_port(), run_flags(fast_config)
    syncer = start(["syncer", "--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert), "--tls-key", str(key),
                    "--out", str(out), *flags], tmp_path / "syncer.log")
    procs = [syncer]
    own = [["--shard-island"], ["--shard-island", "--slice-transfer", "leader"]] if shard else [[], []]
    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_1.token").is_file(), procs)
        procs += [torchrun(island_args(i, port, out, [*flags, *own[i]], cert), tmp_path / f"island_{i}.log")
                  for i in range(2)]
    finally:
        codes = wait_all(procs, timeout=420)
    logs = _logs(tmp_path)
    assert codes == [0, 0, 0], logs
    for i in range(2):
        assert f"atoll island {i} (2 ranks" in logs[f"island_{i}.log"], logs
    served = json.loads((out / "run" / "summary.json").read_text())
    ref = _local(fast_config, flags, tmp_path / "local")
    assert served["tokens"] == ref["tokens"] == 2 * 20 * 4 * 32
    assert served["refused_calls"] == {} and set(served["rejected_by_reason"]) <= {"norm"}, served
    assert served["islands_left"] == [0, 1] and min(served["merged_tokens_by_island"]) > 0
    assert served["final_eval_loss"] < served["initial_eval_loss"] - 0.3
    assert abs(served["final_eval_loss"] - ref["final_eval_loss"]) / ref["final_eval_loss"] < 0.02, \
        (served["final_eval_loss"], ref["final_eval_loss"], served["steps_per_island"], served["commits"])


@pytest.mark.slow
def test_islands_of_two_ranks_and_of_one_rank_train_and_merge_in_one_run(fast_config: dict, tmp_path: Path) -> None:
    """An island of 2 ranks (DDP, its leader moving whole fragments) and an island of 1 rank, one run."""
    out, port, flags = tmp_path / "syncer", free_port(), run_flags(fast_config)
    procs = [start(["syncer", "--listen", f"127.0.0.1:{port}", "--out", str(out), *flags], tmp_path / "syncer.log")]
    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_1.token").is_file(), procs)
        procs.append(torchrun(island_args(0, port, out, [*flags, "--slice-transfer", "leader"], None),
                              tmp_path / "island_0.log"))
        procs.append(start(island_args(1, port, out, flags, None), tmp_path / "island_1.log"))
    finally:
        codes = wait_all(procs, timeout=420)
    logs = _logs(tmp_path)
    assert codes == [0, 0, 0], logs
    assert "atoll island 0 (2 ranks)" in logs["island_0.log"] and "atoll island 1:" in logs["island_1.log"]
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["tokens"] == 2 * 20 * 4 * 32 and summary["commits"] > 0
    assert min(summary["merged_tokens_by_island"]) > 0 and min(summary["steps_per_island"]) > 0, summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3


@pytest.mark.slow
def test_a_killed_rank_ends_its_island_job_which_restarts_and_rejoins_while_the_other_trains_on(
        fast_config: dict, tmp_path: Path) -> None:
    """Rank 1 of island 0 (2 ranks) is SIGKILLed at its 30th inner step: the job ends (its peer's next
    collective fails at once), torchrun starts it again (--max-restarts 1), and it rejoins from the newest
    global fragments; island 1 never pauses (its steps grow through the outage); every process exits 0 and the
    final loss is within 5% of the failure-free run. (The times: bench/service_failover.py.)"""
    out, port = tmp_path / "syncer", free_port()
    flags = [*run_flags(fast_config, steps=200), "--collective-timeout-s", "180"]
    stamp = tmp_path / "killed"
    procs = [start(["syncer", "--listen", f"127.0.0.1:{port}", "--out", str(out), *flags], tmp_path / "syncer.log")]
    samples: list[tuple[float, dict]] = []
    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_1.token").is_file(), procs)
        env = {"ATOLL_TEST_KILL_RANK_AT_STEP": "1:30", "ATOLL_TEST_KILL_STAMP": str(stamp)}
        procs.append(torchrun(island_args(0, port, out, [*flags, "--give-up-s", "120"], None),
                              tmp_path / "island_0.log", restarts=1, env=env))
        procs.append(start(island_args(1, port, out, [*flags, "--give-up-s", "120"], None),
                           tmp_path / "island_1.log"))
        deadline = time.monotonic() + 400
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            samples.append((time.time(), status(out)))
            time.sleep(0.1)
    finally:
        codes = wait_all(procs, timeout=60)
    logs = _logs(tmp_path)
    assert codes == [0, 0, 0], logs
    killed_at = float(stamp.read_text())
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["rejoins"] == [1, 0] and summary["islands_left"] == [0, 1], summary
    # the outage: from the kill to island 0's second join; island 1's steps kept growing through it (until
    # the budget it could take was spent)
    outage = [s for t, s in samples if t >= killed_at and s.get("joins", [0])[0] < 2]
    steps = [s["steps_by_island"][1] for s in outage if s]
    assert len(set(steps)) >= 3 and steps == sorted(steps), steps
    # the restarted job started from the newest global fragments, not from its own
    at_kill = next(s for t, s in samples if t >= killed_at and s)
    joined = [line for line in (tmp_path / "island_0.log").read_text().splitlines() if "joined (session" in line]
    assert len(joined) == 2, joined
    versions = json.loads(joined[1].rsplit("versions ", 1)[1])
    assert all(v >= k for v, k in zip(versions, at_kill["versions"], strict=True)), (versions, at_kill)
    ref = _local(fast_config, flags[:-2], tmp_path / "local")
    # (the islands' shares of the budget depend on how long the restart takes: beside a CPU hog the restarted
    # island trained 70 of 400 steps and ended 2.2% off; 5% bounds that, a diverged or unmerged island is far off)
    assert abs(summary["final_eval_loss"] - ref["final_eval_loss"]) / ref["final_eval_loss"] < 0.05, \
        (summary["final_eval_loss"], ref["final_eval_loss"], summary["steps_per_island"])
