"""atoll syncer and atoll island: the decoupled syncer as a gRPC service, islands as jobs that dial out.

Loopback only, CPU. Every process started is waited for with a timeout and its exit status asserted.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import free_port, run_cli, syncer_commits_on_disk

cryptography = pytest.importorskip("cryptography")

from atoll.benchmarks.common import kill_tree  # noqa: E402
from atoll.errors import ConfigError  # noqa: E402
from atoll.runtime.service import wire  # noqa: E402
from atoll.runtime.service.client import SyncerClient  # noqa: E402
from atoll.runtime.service.tls import loopback_certificate  # noqa: E402


def make_cert(folder: Path, name: str = "syncer") -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key (PEM files in ``folder``)."""
    key, cert = loopback_certificate()
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert)
    key_path.write_bytes(key)
    return cert_path, key_path


def run_flags(fast_config: dict, steps: int = 20) -> list[str]:
    """The run settings every process of a test run is given (the same for the syncer and the islands)."""
    return ["--data", fast_config["data"], "--cache-dir", fast_config["cache_dir"], "--model", "micro",
            "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--islands", "2", "--steps", str(steps),
            "--sync-every", "5", "--fragments", "2", "--eval-batches", "2", "--threads", "1", "--no-progress"]


def start(args: list[str], log: Path, launcher: list[str] | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m atoll ARGS`` (or ``python LAUNCHER ARGS``), its output in ``log``, in a session of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})}
    return subprocess.Popen([sys.executable, *(launcher or ["-m", "atoll"]), *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Every process's exit status; all are killed (and the test fails) past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:  # islands dump their threads' stacks on SIGUSR1 (faulthandler): the log says where
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0 if hung else 0.0)
        for p in hung:  # with torchrun's workers, which run in sessions of their own
            kill_tree(p.pid)
            p.wait()


def wait_for(what: str, cond, procs: list[subprocess.Popen], timeout: float = 180) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"a process ended (status {p.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


def status(out: Path) -> dict:
    try:
        return json.loads((out / "service" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
def test_two_island_jobs_over_tls_end_near_the_local_run(fast_config: dict, tmp_path: Path) -> None:
    """The syncer service and 2 island processes (TLS, credentials) train, merge, and end within 2% of the
    local-runtime decoupled run with the same settings and seeds, at equal tokens."""
    cert, key = make_cert(tmp_path)
    out, port, flags = tmp_path / "syncer", free_port(), run_flags(fast_config)
    syncer = start(["syncer", "--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert), "--tls-key", str(key),
                    "--out", str(out), *flags], tmp_path / "syncer.log")
    procs = [syncer]
    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_1.token").is_file(), procs)
        procs += [start(["island", "--syncer", f"127.0.0.1:{port}", "--tls-ca", str(cert), "--island", str(i),
                         "--credential", str(out / "credentials" / f"island_{i}.token"), *flags],
                        tmp_path / f"island_{i}.log") for i in range(2)]
    finally:
        codes = wait_all(procs, timeout=300)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert codes == [0, 0, 0], logs
    served = json.loads((out / "run" / "summary.json").read_text())
    local = run_cli("train", "--strategy", "decoupled", *flags, "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    ref = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert served["tokens"] == ref["tokens"] == 2 * 20 * 4 * 32
    rejected = [line for line in (tmp_path / "syncer.log").read_text().splitlines() if "rejected a push" in line]
    assert served["commits"] > 0 and served["refused_calls"] == {} and served["rejected_updates"] == 0, \
        (served.get("rejected_by_reason"), rejected)
    assert served["islands_left"] == [0, 1]
    assert all(b > 0 for b in served["bytes_sent_by_island"]) and all(c > 0 for c in served["compute_s_by_island"])
    # each island pulled the whole model in float32 when it joined, then every fragment it pushed: more than once
    assert all(r > 4 * served["params"] for r in served["bytes_received_by_island"])
    assert all(r % 4 == 0 for r in served["bytes_received_by_island"])
    assert "sim_wall_s" not in served and served["wall_s"] >= served["run_s"] > 0
    assert served["final_eval_loss"] < served["initial_eval_loss"] - 0.3
    assert abs(served["final_eval_loss"] - ref["final_eval_loss"]) / ref["final_eval_loss"] < 0.02, \
        (served["final_eval_loss"], ref["final_eval_loss"], served["steps_per_island"], served["commits"],
         served.get("stale_updates"))  # on a real clock the shared budget may split unevenly under load
    assert "TLS" in logs["syncer.log"]


@pytest.fixture()
def served(fast_config: dict, tmp_path: Path):  # noqa: ANN201 - (server state, TLS port, plaintext port, cert, creds)
    """A syncer served in this process: a TLS port and a plaintext one, two islands' credentials."""
    from concurrent import futures

    from atoll.config import build_config
    from atoll.runtime.service.server import SyncerServer

    config = build_config(None, {**{k: v for k, v in fast_config.items()
                                    if k not in ("eval_every", "checkpoint_every")},
                                 "strategy": "decoupled", "runtime": "service", "fragments": 2})
    cert, key = make_cert(tmp_path)
    creds = ["a" * 32, "b" * 32]
    state = SyncerServer.of_run(config, tmp_path / "syncer", creds)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[state.handler()])
    tls_port = server.add_secure_port("127.0.0.1:0",
                                      grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
    plain_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield state, tls_port, plain_port, cert.read_bytes(), creds
    server.stop(grace=0)


@pytest.mark.slow
def test_strangers_are_refused_and_counted(served) -> None:  # noqa: ANN001
    state, port, plain_port, ca, creds = served
    address = f"127.0.0.1:{port}"
    numels = state.service.syncer.numels
    # no credential at all: a raw call without the metadata
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary(wire.method("Join"))(wire.dumps({}), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # another island's secret, and an island that is not one of the run's
    with pytest.raises(ConfigError, match="credential"):
        SyncerClient(address, 0, creds[1], ca).call("Join", {"numels": state.service.syncer.numels})
    with pytest.raises(ConfigError, match="credential"):
        SyncerClient(address, 7, creds[0], ca).call("Heartbeat")
    assert state.refused_calls == {"no_credential": 1, "identity": 1, "island": 1}
    assert state.joined == set()
    # plaintext to the TLS port: no TLS, no call (the handshake refuses it before any handler), one line
    with pytest.raises(ConfigError, match="serves TLS"):
        SyncerClient(address, 0, creds[0], plaintext=True, give_up_s=30.0).call("Heartbeat")
    # TLS to a port that serves plaintext: one line, not an endless retry
    with pytest.raises(ConfigError, match="serves plaintext"):
        SyncerClient(f"127.0.0.1:{plain_port}", 0, creds[0], ca, give_up_s=30.0).call("Heartbeat")
    assert state.refused_calls == {"no_credential": 1, "identity": 1, "island": 1}
    # the honest island 0: joins, takes a round of steps (once island 1 joined too: the run starts with every
    # island), pushes; the same push again is a replay
    me = SyncerClient(address, 0, creds[0], ca)
    session = me.call("Join", {"numels": numels})["session"]
    assert me.call("ReserveSteps", {"n": 5}) == {"granted": 0, "wait": True}
    SyncerClient(address, 1, creds[1], ca).call("Join", {"numels": numels})
    assert me.call("ReserveSteps", {"n": 5})["granted"] == 5
    payload = wire.payload_bytes(state.codec.encode(torch.full((numels[0],), 1e-3)).tensors)
    first = me.push(payload, 0, ((0, numels[0]),), 5 * 4 * 32, 0, session)
    assert first["accepted"] and not first["answered"]  # waits for island 1's push (quorum 2)
    again = me.push(payload, 0, ((0, numels[0]),), 5 * 4 * 32, 0, session)
    assert not again["accepted"]
    assert state.service.syncer.rejected_by_reason == {"replay": 1}
    # a pickle instead of safetensors is never unpickled: refused as a malformed payload, and counted
    data = pickle.dumps(torch.zeros(16))
    upload = me.upload(data, 1, ((0, numels[1]),))
    answer = me.commit([upload], 1, 128, 0, session)
    assert not answer["accepted"] and answer["answered"] and answer["version"] == 0  # refused now, as any refusal
    assert state.service.syncer.rejected_by_reason == {"replay": 1, "type": 1}
    assert state.service.syncer.version(0) == 0  # nothing refused reached the global parameters
    version, params = me.download(0)
    assert version == 0 and torch.equal(params, state.service.syncer.pull(0).params)


def test_bad_addresses_and_certificates_exit_2(tmp_path: Path) -> None:
    """One line naming the field, status 2, before any data or model is prepared."""
    cert, key = make_cert(tmp_path)
    other_cert, _ = make_cert(tmp_path, "other")
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    token = tmp_path / "island_0.token"
    token.write_text("a" * 32)
    out = ["--out", str(tmp_path / "syncer")]
    cases = {
        "listen": ["syncer", "--listen", "nohost", *out],
        "listen ": ["syncer", "--listen", "0.0.0.0:7070", *out],  # other hosts can reach it, no TLS
        "tls_cert": ["syncer", "--tls-cert", str(junk), "--tls-key", str(key), *out],
        "tls_key": ["syncer", "--tls-cert", str(other_cert), "--tls-key", str(key), *out],
        "tls_cert ": ["syncer", "--tls-cert", str(cert), *out],
        "syncer": ["island", "--syncer", "syncer.example.org", "--island", "0", "--credential", str(token)],
        "syncer ": ["island", "--syncer", "10.1.2.3:7070", "--plaintext", "--island", "0", "--credential", str(token)],
        "tls_ca": ["island", "--syncer", "127.0.0.1:7070", "--tls-ca", str(junk), "--island", "0",
                   "--credential", str(token)],
        "credential": ["island", "--syncer", "127.0.0.1:7070", "--island", "0", "--credential", str(tmp_path / "none")],
    }
    for field, args in cases.items():
        result = run_cli(*args)
        assert result.returncode == 2, (field, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"atoll: error: {field.strip()}:"), (field, lines)
    assert not (tmp_path / "syncer").exists()  # nothing made for bad input


@pytest.mark.slow
def test_killed_syncer_restarts_without_losing_a_commit(fast_config: dict, tmp_path: Path) -> None:
    """SIGKILL the syncer mid-run: restarted on its folder it continues from its newest checkpoint (no committed
    step lost); the islands, which kept training and retrying, resume pushing; every process exits 0."""
    out, port, flags = tmp_path / "syncer", free_port(), run_flags(fast_config, steps=40)
    syncer_args = ["syncer", "--listen", f"127.0.0.1:{port}", "--out", str(out), *flags]
    first = start(syncer_args, tmp_path / "syncer.log")
    procs = [first]
    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_1.token").is_file(), procs)
        islands = [start(["island", "--syncer", f"127.0.0.1:{port}", "--plaintext", "--island", str(i),
                          "--credential", str(out / "credentials" / f"island_{i}.token"), *flags],
                         tmp_path / f"island_{i}.log") for i in range(2)]
        procs += islands
        wait_for("2 commits on disk", lambda: syncer_commits_on_disk(out) >= 2, procs)
        os.kill(int((out / "service" / "syncer.pid").read_text()), signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
        before = syncer_commits_on_disk(out)
        time.sleep(2.0)  # the islands train on and retry meanwhile
        second = start(syncer_args, tmp_path / "syncer2.log")
        procs = [second, *islands]
    finally:
        codes = wait_all(procs, timeout=400)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert codes == [0, 0, 0], logs
    restarted = int(logs["syncer2.log"].split("restarted from commit ")[1].split()[0])
    assert restarted >= before  # nothing committed before the kill was lost
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["syncer_restarts"] == 1
    assert summary["useful_tokens"] <= summary["tokens"]  # the ledger survived the restart: no token merged twice
    # the islands' leases (and the replies the kill lost) were never refused: their records survived it too
    assert not {"lease", "used"} & set(summary["refused_calls"]), summary["refused_calls"]
    assert summary["commits"] > restarted  # the islands pushed again, and their pushes were merged
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3
    retried = [int(logs[f"island_{i}.log"].split(" retried calls")[0].rsplit(" ", 1)[1]) for i in range(2)]
    assert sum(retried) > 0, logs


@pytest.mark.slow
def test_a_broken_upload_resumes_at_the_offset_the_syncer_holds(served, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A push's transfer that breaks after some chunks continues from the bytes the syncer holds (not from 0);
    the push it commits is the tensor sent, bit for bit."""
    state, port, _, ca, creds = served
    monkeypatch.setattr(wire, "CHUNK_BYTES", 1024)  # several chunks of a micro fragment (client and server)
    numels = state.service.syncer.numels
    me = SyncerClient(f"127.0.0.1:{port}", 0, creds[0], ca)
    session = me.call("Join", {"numels": numels})["session"]
    SyncerClient(f"127.0.0.1:{port}", 1, creds[1], ca).call("Join", {"numels": numels})
    assert me.call("ReserveSteps", {"n": 5})["granted"] == 5
    delta = torch.randn(numels[0], generator=torch.Generator().manual_seed(0)) * 1e-3
    encoded = state.codec.encode(delta)  # the run's codec (int4): its payload is what travels
    data = wire.payload_bytes(encoded.tensors)
    assert len(data) > 8 * 1024
    header = {"upload": "u1", "fragment": 0, "ranges": [[0, numels[0]]], "size": len(data)}

    def broken():  # noqa: ANN202 - three chunks, then the link fails
        yield wire.dumps({**header, "offset": 0})
        yield from wire.chunks(data)[:3]
        time.sleep(0.5)
        raise ConnectionError("link lost")

    upload = me.bulk.stream_unary(wire.method("Upload"))
    with pytest.raises(grpc.RpcError):
        upload(broken(), metadata=me.metadata, timeout=30)
    held = me.call("UploadStatus", {"upload": "u1"}, bulk=True)["received"]
    assert held == 3 * 1024
    rest = iter([wire.dumps({**header, "offset": held}), *wire.chunks(data, held)])
    assert wire.loads(upload(rest, metadata=me.metadata, timeout=30))["received"] == len(data)
    answer = me.commit(["u1"], 0, 5 * 4 * 32, 0, session)
    assert answer["accepted"]
    # the syncer decoded the payload: the Δ it holds is the codec's round trip of the island's, bit for bit
    assert torch.equal(state.service.syncer.buffers[0].pushes[0].delta, state.codec.decode(encoded))
    # the commit retried after a lost reply is answered again, not counted as a replay
    again = me.commit(["u1"], 0, 5 * 4 * 32, 0, session)
    assert again == answer and state.service.syncer.rejected_updates == 0


@pytest.mark.slow
def test_killed_island_job_rejoins_with_the_same_command(fast_config: dict, tmp_path: Path) -> None:
    """SIGKILL one island's process mid-run and start the same command again: it rejoins (a new session, the
    newest global fragments), pushes and is merged; the other island never stops; every process exits 0."""
    # a budget that island 0 does not spend alone while island 1 restarts: a restart takes about 20 s on the
    # loaded 2-core machine (imports and data), in which island 0 alone takes 300 or more micro steps
    out, port, flags = tmp_path / "syncer", free_port(), run_flags(fast_config, steps=400)
    syncer = start(["syncer", "--listen", f"127.0.0.1:{port}", "--out", str(out), *flags], tmp_path / "syncer.log")
    procs = [syncer]

    def island(i: int, log: str) -> subprocess.Popen:
        return start(["island", "--syncer", f"127.0.0.1:{port}", "--plaintext", "--island", str(i),
                      "--credential", str(out / "credentials" / f"island_{i}.token"), *flags], tmp_path / log)

    try:
        wait_for("credentials", lambda: (out / "credentials" / "island_1.token").is_file(), procs)
        procs += [island(0, "island_0.log"), island(1, "island_1.log")]
        wait_for("island 1 merged", lambda: status(out).get("merged_tokens_by_island", [0, 0])[1] > 0, procs)
        procs[2].send_signal(signal.SIGKILL)
        assert procs[2].wait(timeout=30) == -signal.SIGKILL
        at_kill = status(out)
        procs[2] = island(1, "island_1b.log")
    finally:
        codes = wait_all(procs, timeout=400)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert codes == [0, 0, 0], logs
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["rejoins"] == [0, 1] and len(summary["rejoin_s"]) == 1
    killed, restarted = summary["island_sessions"][1]  # the killed job's figures are counted with the new one's
    assert killed["compute_s"] > 0 and summary["compute_s_by_island"][1] == killed["compute_s"] + restarted["compute_s"]
    assert summary["islands_left"] == [0, 1]
    # the restarted island trained and was merged after its rejoin (from the steps it had used: the rest of
    # the lease its killed session held went back to the budget); its new session's pushes are no replays
    # (the norm bound may refuse a few pushes of either island in this long, lopsided run: its own check)
    rejoined = (tmp_path / "island_1b.log").read_text().split("joined (session 2, ")[1]
    assert summary["steps_per_island"][1] > int(rejoined.split(" inner steps")[0]) > 0
    assert summary["merged_tokens_by_island"][1] > at_kill["merged_tokens_by_island"][1]
    assert set(summary["rejected_by_reason"]) <= {"norm"}, summary["rejected_by_reason"]
    assert not {"lease", "used"} & set(summary["refused_calls"]), summary["refused_calls"]  # no lease refused
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3


class _Unavailable(grpc.RpcError, grpc.Call):  # a syncer that did not answer in time (what the client retries)
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "syncer busy"

    initial_metadata = trailing_metadata = cancel = add_callback = is_active = time_remaining = lambda self: None


def _take(lease, want: int) -> None:  # noqa: ANN001 - StepLease.take until it answers ``want`` (GO, STOP)
    from atoll.runtime.service.lease import WAIT

    deadline = time.monotonic() + 30
    while (got := lease.take()) == WAIT:
        assert time.monotonic() < deadline, "no step within 30 s"
        time.sleep(0.01)
    assert got == want


@pytest.mark.parametrize("budget_left", [True, False])
def test_steps_taken_on_credit_are_granted_before_the_push_that_claims_them(
        served, budget_left: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """An island whose step lease went unanswered trains a step on credit; the push that claims its tokens is
    not refused (``tokens``): the credit is reserved first, and a step the syncer no longer grants (the budget
    was spent meanwhile) is taken out of the claim. The lease's unused steps go back to the budget at Leave."""
    from atoll.runtime.service.lease import GO, StepLease

    state, port, _, ca, creds = served
    numels = state.service.syncer.numels
    me = SyncerClient(f"127.0.0.1:{port}", 0, creds[0], ca)
    session = me.call("Join", {"numels": numels})["session"]
    SyncerClient(f"127.0.0.1:{port}", 1, creds[1], ca).call("Join", {"numels": numels})
    tps = state.service.run.tokens_per_step
    lease = StepLease(me, size=2, offline_steps=2, tokens_per_step=tps, fragments=2)
    real_call, fail = me.call, [True]

    def call(name: str, payload: dict | None = None, timeout_s: float = 30.0, retry: bool = True,
             bulk: bool = False) -> dict:
        if name == "ReserveSteps" and fail[0]:
            fail[0] = False
            raise _Unavailable()
        return real_call(name, payload, timeout_s, retry, bulk)

    monkeypatch.setattr(me, "call", call)
    lease._delay = 3600.0  # the retry waits until the test says
    _take(lease, GO)  # the lease's fetch went unanswered: a step on credit
    assert lease.offline_steps_taken == 1 and lease.owed == 1 and state.service.islands[0].steps == 0
    if not budget_left:
        state.service.reserved = state.service.budget  # the others spent it while this island was unanswered
    lease._retry_at = 0.0
    claim = lease.claimable(0, tps, lease.credit_taken)  # the round's push claims the credit step
    granted = state.service.islands[0].steps
    assert granted == (3 if budget_left else 0) and lease.owed == 0  # the credit step and a lease of 2
    assert claim == (tps if budget_left else 0)  # it claims no token it was not granted
    if claim:
        payload = wire.payload_bytes(state.codec.encode(torch.full((numels[0],), 1e-4)).tensors)
        assert me.push(payload, 0, ((0, numels[0]),), claim, 0, session)["accepted"]
    assert state.service.syncer.rejected_updates == 0, state.service.syncer.rejected_by_reason
    assert state.service.syncer.bounds.claimed[0][0] == claim
    lease.close()
    # leaving, it gives the 2 steps of its lease it did not take back to the budget (and its ledger)
    assert me.call("Leave", {"steps": 1, "used": lease.used})["returned"] == (2 if budget_left else 0)
    assert state.service.islands[0].steps == (1 if budget_left else 0)
    assert state.service.syncer.bounds.granted[0] == state.service.islands[0].steps * tps
