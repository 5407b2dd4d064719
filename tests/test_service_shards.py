"""atoll syncer sharded by fragment: the shards' checks in this process, and whole runs in processes.

In this process (two shards served on loopback, real gRPC calls): a fragment sent to a shard that does not own
it, a push without the coordinator's grant, with a forged, altered, another island's or an older session's
grant, or of a session the coordinator never opened, is refused and counted; an island whose map differs is
refused in one line; only a shard's peer credential opens ``Finish``. In processes (every exit status
asserted, every wait with a timeout): 2 shards and 2 islands end near the unsharded service's run; a shard
SIGKILLed and restarted loses no committed step while the run goes on and ends.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import free_port, syncer_commits_on_disk
from tests.test_service import make_cert, run_flags, start, status, wait_all, wait_for

pytest.importorskip("cryptography")

from atoll.errors import ConfigError  # noqa: E402
from atoll.runtime.service import wire  # noqa: E402
from atoll.runtime.service.client import SessionSuperseded, SyncerClient  # noqa: E402

KEY = b"ab" * 32


def _serve(config, folder: Path, creds: list[str], **shard):  # noqa: ANN001, ANN202 - (state, address, server)
    """A :class:`SyncerServer` of ``config`` (shard ``shard``, else unsharded) on a loopback port in this process."""
    from atoll.runtime.service.server import SyncerServer

    state = SyncerServer.of_run(config, folder, creds, **shard)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[state.handler()])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return state, address, server


def _config(fast_config: dict):  # noqa: ANN202 - the TrainConfig
    """The run of the in-process shards: 2 fragments, a merge takes both islands' pushes."""
    from atoll.config import build_config

    base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
    return build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "fragments": 2, "min_quorum": 2})


@pytest.fixture()
def shards(fast_config: dict, tmp_path: Path):  # noqa: ANN201 - ([state0, state1], [address0, address1], creds)
    """Shards 0 and 1 of a syncer of 2 fragments, served in this process (plaintext on loopback). A merge takes
    both islands' pushes (``min_quorum`` 2): no grace window closes on a push alone, whatever the machine's pace."""
    config = _config(fast_config)
    creds = ["a" * 32, "b" * 32]
    served = [_serve(config, tmp_path / f"shard_{s}", creds, shard=s, shards=2, key=KEY) for s in range(2)]
    yield [s for s, _, _ in served], [a for _, a, _ in served], creds
    for _, _, server in served:
        server.stop(grace=0)


def _payload(state, n: int, scale: float = 1e-3) -> bytes:  # noqa: ANN001 - the run's codec of a small Δ
    return wire.payload_bytes(state.codec.encode(torch.full((n,), scale)).tensors)


@pytest.mark.slow
def test_a_shard_refuses_strangers_fragments_grants_and_sessions_it_cannot_vouch_for(shards) -> None:  # noqa: ANN001
    (coord, shard), (a0, a1), creds = shards
    numels, owners = coord.service.numels, coord.shards.owners
    assert sorted(owners) == [0, 1] and shard.service.fragment_ids == [owners.index(1)]
    mine, theirs = owners.index(1), owners.index(0)  # shard 1's fragment, and the coordinator's
    n = numels[mine]
    c0, c1 = SyncerClient(a0, 0, creds[0], plaintext=True), SyncerClient(a1, 0, creds[0], plaintext=True)
    other0, other1 = SyncerClient(a0, 1, creds[1], plaintext=True), SyncerClient(a1, 1, creds[1], plaintext=True)

    # an island whose map differs (one shard, or the shards' addresses swapped) is refused in one line
    with pytest.raises(ConfigError, match="^shards: this island routes the fragments to"):
        c0.call("Join", {"numels": numels, "shards": [0, 0]})
    with pytest.raises(ConfigError, match="^shards: Join goes to shard 0"):
        c1.call("Join", {"numels": numels, "shards": owners})
    session = c0.call("Join", {"numels": numels, "shards": owners})["session"]
    with pytest.raises(ConfigError, match="^shards: the address this island dialed as shard 0 is shard 1"):
        c1.call("Hello", {"numels": numels, "shards": owners, "shard": 0, "grant": c0.grant})
    with pytest.raises(ConfigError, match="^shards: shard 1 cannot verify the coordinator's grant"):
        c1.call("Hello", {"numels": numels, "shards": owners, "shard": 1, "grant": {**c0.grant, "mac": "0" * 64}})
    assert c1.call("Hello", {"numels": numels, "shards": owners, "shard": 1, "grant": c0.grant})["fragments"] == [mine]
    other0.call("Join", {"numels": numels, "shards": owners})
    assert c0.call("ReserveSteps", {"n": 5})["granted"] == 5 and other0.call("ReserveSteps", {"n": 5})["granted"] == 5
    tokens = 5 * coord.service.run.tokens_per_step
    assert c0.grant["tokens"] == tokens and c0.grant["session"] == session

    # a fragment sent to the shard that does not own it: refused (one line at the island) and counted
    with pytest.raises(ConfigError, match=f"^shards: fragment {theirs} is shard 0's"):
        c1.upload(_payload(coord, numels[theirs]), theirs, ((0, numels[theirs]),))
    with pytest.raises(ConfigError, match=f"^shards: fragment {theirs} is shard 0's"):
        c1.download(theirs)
    assert shard.refused_calls == {"shard": 2}

    def push(client: SyncerClient, grant: object, session: int, claim: int = tokens, base: int = 0) -> bool:
        return client.push(_payload(shard, n), mine, ((0, n),), claim, base, session, grant=grant)["accepted"]

    forged = {**c0.grant, "tokens": 100 * tokens}  # more tokens than granted: its MAC no longer holds
    assert not push(c1, None, session)            # no grant
    assert not push(c1, forged, session)          # altered
    assert not push(c1, other0.grant, session)    # island 1's grant, pushed by island 0
    assert not push(c1, c0.grant, session + 1)    # a session the coordinator never opened
    assert not push(c1, c0.grant, session, claim=tokens + 1)  # more tokens than the grant vouches for
    assert shard.service.syncer.rejected_by_reason == {"grant": 3, "session": 1, "tokens": 1}
    assert shard.service.syncer.version(0) == 0 and shard.service.syncer.accepted_updates == 0
    assert push(c1, c0.grant, session)  # the honest push: accepted (waits for island 1's, quorum 2)
    old_grant = c0.grant

    # island 0 rejoins (session 2): once shard 1 has seen its new grant, the old session's grant and pushes
    # are replays; the push of the new session is accepted
    new_session = c0.call("Join", {"numels": numels, "shards": owners})["session"]
    assert new_session == session + 1 and c0.grant["session"] == new_session
    assert not push(c1, c0.grant, new_session)  # a rejoin grants no tokens: the ledger holds one push's
    assert c0.call("ReserveSteps", {"n": 5})["granted"] == 5 and c0.grant["tokens"] == 2 * tokens
    assert push(c1, c0.grant, new_session)
    with pytest.raises(SessionSuperseded):  # an old session's grant: fenced (refused and counted as stale_session)
        push(c1, old_grant, session, base=1)
    with pytest.raises(SessionSuperseded):  # an old session's push under the new grant
        push(c1, c0.grant, session, base=1)
    assert shard.service.syncer.rejected_by_reason == {"grant": 3, "session": 1, "tokens": 2}
    assert shard.refused_calls == {"shard": 2, "stale_session": 2}
    assert shard.service.syncer.admission.rejected_by_island["grant"] == [3, 0]
    assert other1.push(_payload(shard, n), mine, ((0, n),), tokens, 0, 1, grant=other0.grant)["accepted"]
    assert shard.service.syncer.version(0) == 1  # the quorum of both islands merged

    # only a shard's peer credential opens Finish: an island's, or another run's key, is refused and counted
    from atoll.runtime.service.gather import PeerClient
    from atoll.runtime.service.syncer_shards import peer_token

    with pytest.raises(ConfigError, match="credential"):
        c1.call("Finish")
    with pytest.raises(ConfigError, match="^shards: shard 1 .* refused the coordinator's peer credential"):
        PeerClient(a1, 1, peer_token(b"x" * 64), plaintext=True).call("Finish")
    assert shard.refused_calls == {"shard": 2, "stale_session": 2, "peer": 2}
    peer = PeerClient(a1, 1, peer_token(KEY), plaintext=True)
    finished = peer.call("Finish")
    assert finished["fragments"] == [mine] and finished["versions"] == [1] and finished["stats"]["commits"] == 1
    version, values = peer.download(mine)
    # the global fragment G itself, float32 (an island's pull carries the pull codec's shadow Q, within its
    # rounding of G: the final model is G)
    assert version == 1 and torch.equal(values, shard.service.syncer.outer[0].params)
    assert not torch.equal(values, shard.service.syncer.pull(0).params)  # (the default int4 pull's Q)
    assert peer.call("Finish") == finished  # asked again (a restarted coordinator): the same answer
    with pytest.raises(grpc.RpcError) as e:  # the run is over at this shard: no more pushes
        c1.call("Push", {"slices": ["x"], "fragment": mine, "tokens": 1, "base_version": 1, "session": session},
                retry=False)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_two_shards_merge_the_same_global_model_as_one_syncer_given_the_same_pushes(shards, fast_config: dict,  # noqa: ANN001
                                                                                    tmp_path: Path) -> None:
    """The same pushes (values, tokens, order) sent to 2 shards (each fragment to its owner, over gRPC, with the
    coordinator's grants) and to one unsharded syncer: every merge happens on the fragment's owner, and the
    gathered global model, its versions, commits and merged tokens are those of the one syncer, bit for bit
    (a shard's merge is the unsharded syncer's, over its own fragments)."""
    from atoll.runtime.service.gather import PeerClient, gather
    from atoll.runtime.service.syncer_shards import peer_token

    (coord, shard), addresses, creds = shards
    one, one_address, one_server = _serve(_config(fast_config), tmp_path / "one", creds)
    try:
        numels, owners = coord.service.numels, coord.shards.owners
        init = one.service.syncer.global_params()
        sharded = [[SyncerClient(a, i, creds[i], plaintext=True) for a in addresses] for i in range(2)]
        single = [SyncerClient(one_address, i, creds[i], plaintext=True) for i in range(2)]
        for i in range(2):
            session = sharded[i][0].call("Join", {"numels": numels, "shards": owners})["session"]
            assert single[i].call("Join", {"numels": numels})["session"] == session
            sharded[i][1].call("Hello", {"numels": numels, "shards": owners, "shard": 1,
                                         "grant": sharded[i][0].grant})
        gen = torch.Generator().manual_seed(0)
        steps = [5, 3]  # island 1 claims fewer tokens: the token-weighted mean is not a plain one
        for r in range(3):
            for i in range(2):
                assert sharded[i][0].call("ReserveSteps", {"n": steps[i]})["granted"] == steps[i]
                assert single[i].call("ReserveSteps", {"n": steps[i]})["granted"] == steps[i]
            for g in range(2):
                for i in range(2):
                    data = wire.payload_bytes(coord.codec.encode(
                        torch.empty(numels[g]).normal_(0, 1e-3, generator=gen)).tensors)
                    tokens = steps[i] * coord.service.run.tokens_per_step
                    to = sharded[i][owners[g]]
                    grant = sharded[i][0].grant if owners[g] else None
                    assert to.push(data, g, ((0, numels[g]),), tokens, r, 1, grant=grant)["accepted"]
                    assert single[i].push(data, g, ((0, numels[g]),), tokens, r, 1)["accepted"]
        for g in range(2):  # each fragment merged 3 times, on its owner only
            owner = (coord, shard)[owners[g]]
            assert owner.service.syncer.version(owner.shards.local[g]) == 3 and one.service.syncer.version(g) == 3
        assert coord.service.syncer.commits == shard.service.syncer.commits == 3

        coord.final = coord.service.finish()
        final, refused = gather(coord, [PeerClient(addresses[1], 1, peer_token(KEY), plaintext=True)])
        ref = one.service.finish()
        assert torch.equal(final["global"], ref["global"]) and not torch.equal(ref["global"], init)
        assert final["versions"] == ref["versions"] == [3, 3] and refused == {}
        assert final["stats"]["commits"] == ref["stats"]["commits"] == 6
        assert final["merged_tokens"] == pytest.approx(ref["merged_tokens"], rel=1e-9)
        assert final["shard_restarts"] == [0, 0]
    finally:
        one_server.stop(grace=0)


def _shard_args(s: int, ports: list[int], out: Path, flags: list[str], tls: list[str]) -> list[str]:
    return ["syncer", "--shard", str(s), "--shards", ",".join(f"127.0.0.1:{p}" for p in ports), "--listen",
            f"127.0.0.1:{ports[s]}", "--out", str(out), *tls, *flags]


@pytest.mark.slow
def test_two_shards_and_two_islands_end_near_the_unsharded_service(fast_config: dict, tmp_path: Path) -> None:
    """2 shards (TLS, one credentials folder) and 2 island processes train, merge on both shards, and end within
    2% of the unsharded service's run with the same settings and seeds, at equal tokens; shard 0 gathers shard
    1's fragment and writes the one run folder; shard 1 exits 0 once gathered."""
    cert, key = make_cert(tmp_path)
    flags = run_flags(fast_config)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert)]
    out, ports = tmp_path / "sharded", [free_port(), free_port()]
    procs = [start(_shard_args(s, ports, out, flags, tls), tmp_path / f"shard_{s}.log") for s in range(2)]
    try:
        wait_for("credentials", lambda: (out / "credentials" / "syncer.key").is_file(), procs)
        syncer = ",".join(f"127.0.0.1:{p}" for p in ports)
        procs += [start(["island", "--syncer", syncer, "--tls-ca", str(cert), "--island", str(i), "--credential",
                         str(out / "credentials" / f"island_{i}.token"), *flags], tmp_path / f"island_{i}.log")
                  for i in range(2)]
    finally:
        codes = wait_all(procs, timeout=300)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert codes == [0, 0, 0, 0], logs
    sharded = json.loads((out / "run" / "summary.json").read_text())
    assert "shard 1 done" in logs["shard_1.log"] and "as shard 1 of 2" in logs["shard_1.log"]
    for s in range(2):  # each shard merged its own fragment
        assert status(out / f"shard_{s}")["commits"] > 0, logs

    # the same run on one syncer
    ref_out, port = tmp_path / "one", free_port()
    procs = [start(["syncer", "--listen", f"127.0.0.1:{port}", "--out", str(ref_out), *flags], tmp_path / "one.log")]
    try:
        wait_for("credentials", lambda: (ref_out / "credentials" / "island_1.token").is_file(), procs)
        procs += [start(["island", "--syncer", f"127.0.0.1:{port}", "--plaintext", "--island", str(i), "--credential",
                         str(ref_out / "credentials" / f"island_{i}.token"), *flags], tmp_path / f"one_{i}.log")
                  for i in range(2)]
    finally:
        codes = wait_all(procs, timeout=300)
    assert codes == [0, 0, 0], {p.name: p.read_text()[-2000:] for p in tmp_path.glob("one*.log")}
    ref = json.loads((ref_out / "run" / "summary.json").read_text())

    assert sharded["tokens"] == ref["tokens"] == 2 * 20 * 4 * 32
    assert sharded["shards"] == 2 and sharded["shard_restarts"] == [0, 0]
    assert sharded["refused_calls"] == {} and sharded["rejected_updates"] == 0, sharded.get("rejected_by_reason")
    assert sharded["commits"] == sum(status(out / f"shard_{s}")["commits"] for s in range(2))
    owned = [status(out / f"shard_{s}") for s in range(2)]  # the run's versions: each fragment's on its owner
    assert sorted(f for st in owned for f in st["fragments"]) == list(range(len(sharded["versions"])))
    for st in owned:
        assert [sharded["versions"][f] for f in st["fragments"]] == st["versions"] and min(st["versions"]) > 0
    # one run folder, on shard 0's side, with the model; the other shard wrote none
    assert (out / "run" / "checkpoints" / "latest").exists() and (out / "run" / "report.png").is_file()
    assert list(out.glob("run/checkpoints/step_*/model/*.safetensors")) and not list(out.glob("shard_*/run"))
    assert sharded["islands_left"] == [0, 1] and status(out / "shard_1")["finished"]
    assert 0 < sharded["useful_tokens"] <= sharded["tokens"]  # the merged tokens of both shards' fragments
    assert sharded["final_eval_loss"] < sharded["initial_eval_loss"] - 0.3
    assert abs(sharded["final_eval_loss"] - ref["final_eval_loss"]) / ref["final_eval_loss"] < 0.02, \
        (sharded["final_eval_loss"], ref["final_eval_loss"], sharded["steps_per_island"], sharded["commits"])


@pytest.mark.slow
def test_a_killed_shard_restarts_without_losing_a_commit_while_the_run_goes_on(fast_config: dict,
                                                                              tmp_path: Path) -> None:
    """SIGKILL shard 1 mid-run: the islands keep training and pushing to shard 0, retry shard 1's fragment with
    backoff; restarted on its folder, shard 1 continues from its newest checkpoint (no committed step lost), its
    fragment is merged again, and the run ends with every process's status 0."""
    flags = run_flags(fast_config, steps=40)
    out, ports = tmp_path / "sharded", [free_port(), free_port()]
    first = [start(_shard_args(s, ports, out, flags, []), tmp_path / f"shard_{s}.log") for s in range(2)]
    procs = list(first)
    try:
        wait_for("credentials", lambda: (out / "credentials" / "syncer.key").is_file(), procs)
        syncer = ",".join(f"127.0.0.1:{p}" for p in ports)
        islands = [start(["island", "--syncer", syncer, "--plaintext", "--island", str(i), "--credential",
                          str(out / "credentials" / f"island_{i}.token"), *flags], tmp_path / f"island_{i}.log")
                   for i in range(2)]
        procs += islands
        wait_for("2 commits of shard 1 on disk", lambda: syncer_commits_on_disk(out / "shard_1") >= 2, procs)
        os.kill(int((out / "shard_1" / "service" / "syncer.pid").read_text()), signal.SIGKILL)
        assert first[1].wait(timeout=30) == -signal.SIGKILL
        before = syncer_commits_on_disk(out / "shard_1")
        coordinator_before = status(out / "shard_0")["commits"]
        time.sleep(3.0)  # the islands train on, and shard 0 merges on, meanwhile
        second = start(_shard_args(1, ports, out, flags, []), tmp_path / "shard_1b.log")
        procs = [first[0], second, *islands]
    finally:
        codes = wait_all(procs, timeout=400)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert codes == [0, 0, 0, 0], logs
    restarted = int(logs["shard_1b.log"].split("restarted from commit ")[1].split()[0])
    assert restarted >= before  # nothing shard 1 committed before the kill was lost
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["shard_restarts"] == [0, 1] and summary["syncer_restarts"] == 1
    assert status(out / "shard_1")["commits"] > restarted  # its fragment was pushed and merged again
    assert status(out / "shard_0")["commits"] > coordinator_before  # shard 0 merged on throughout
    assert summary["islands_left"] == [0, 1]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3
    retried = [int(logs[f"island_{i}.log"].split(" retried calls")[0].rsplit(" ", 1)[1]) for i in range(2)]
    assert sum(retried) > 0, logs


def test_bad_shard_settings_exit_2_in_one_line(tmp_path: Path) -> None:
    """A shard's place outside its list, a bad address in it, more shards than fragments (at a shard or an
    island): one line naming the field, status 2, nothing made."""
    from tests.conftest import run_cli

    token = tmp_path / "island_0.token"
    token.write_text("a" * 32)
    out = ["--out", str(tmp_path / "syncer"), "--fragments", "2"]
    cases = {
        "shard": ["syncer", "--shard", "2", "--shards", "127.0.0.1:7070,127.0.0.1:7071", *out],
        "shards": ["syncer", "--shard", "0", "--shards", "127.0.0.1:7070,nohost", *out],
        "shards ": ["syncer", "--shards", "127.0.0.1:7070,127.0.0.1:7071,127.0.0.1:7072", *out],
        "syncer": ["island", "--syncer", "127.0.0.1:7070,127.0.0.1:7071,127.0.0.1:7072", "--island", "0",
                   "--credential", str(token), "--fragments", "2"],
    }
    for field, args in cases.items():
        result = run_cli(*args)
        assert result.returncode == 2, (field, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"atoll: error: {field.strip()}:"), (field, lines)
    assert not (tmp_path / "syncer").exists()
