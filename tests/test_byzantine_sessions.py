"""One island that opens sessions itself (``Push.session`` + 1, or ``join`` again) to push many times per
fragment version: it gets one vote per merge, never sets the norm bound, never outvotes a robust merge, and
on Ray claims only the tokens it was granted. Bad pushes are refused and counted, never raised."""

from __future__ import annotations

import pytest
import torch

from atoll.strategies.decoupled.protocol import Push
from atoll.strategies.decoupled.syncer import Syncer

CREDS = ["a" * 32, "b" * 32, "c" * 32]
N, TOK = 200, 100


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _honest(i: int, seed: int = 0) -> torch.Tensor:
    """An honest Δ: a shared direction plus island noise, norm about 0.07."""
    base = torch.randn(N, generator=_gen(1000 + seed))
    return 0.005 * (base + 0.3 * torch.randn(N, generator=_gen(seed * 10 + i)))


def _syncer(**kw: object) -> Syncer:
    theta = torch.randn(N, generator=_gen(0))
    return Syncer(theta, None, 3, **{"outer_lr": 1.0, "outer_momentum": 0.0, "credentials": CREDS,
                                     "push_tokens": [TOK] * 3, **kw})  # type: ignore[arg-type]


def _push(s: Syncer, i: int, delta: torch.Tensor, session: int = 0, tokens: int = TOK) -> Push:
    return Push(i, 0, delta, tokens, s.version(0), session=session, credential=CREDS[i])


def test_session_bumps_leave_one_push_per_island_in_a_buffer() -> None:
    s = _syncer()
    for session in range(5):  # the same island, the same base version, a new session each time
        assert s.push(_push(s, 2, _honest(2, seed=session), session)).accepted
    assert [p.island for p in s.buffers[0].pushes] == [2]
    torch.testing.assert_close(s.buffers[0].pushes[0].delta, _honest(2, seed=4))  # the newest one
    assert s.push(_push(s, 0, _honest(0))).accepted
    assert s.push(_push(s, 1, _honest(1))).committed == 1
    assert list(s.quorum_sizes.recent) == [3] and s.replaced_updates == 4
    stats = s.stats()
    assert stats["merged_tokens_by_island"] == [TOK, TOK, TOK]  # island 2's tokens merged once
    assert stats["stale_tokens_by_island"] == [0.0, 0.0, 4.0 * TOK]  # the replaced ones: every token in a bucket
    assert stats["replaced_updates"] == 4 and stats["rejected_updates"] == 0
    # the merge is the plain mean of the three islands' (last) pushes
    step = torch.randn(N, generator=_gen(0)) - s.global_params()
    torch.testing.assert_close(step, torch.stack([_honest(0), _honest(1), _honest(2, seed=4)]).mean(0))


def test_a_replaced_push_keeps_its_buffers_window_and_survives_a_checkpoint() -> None:
    s = _syncer(grace_factor=1.0)
    assert s.push(Push(2, 0, _honest(2), TOK, 0, round_s=10.0, credential=CREDS[2]), now=0.0).accepted
    # a replacement neither reopens the window nor adds a round time (one per island and buffer)
    assert s.push(Push(2, 0, _honest(2, 1), TOK, 0, round_s=1e-6, session=1, credential=CREDS[2]), now=5.0).accepted
    assert list(s.round_s) == [10.0] and s.buffers[0].opened_at == 0.0 and s.buffers[0].grace_s == 10.0
    restored = _syncer()
    restored.load_state_dict(s.state_dict())
    assert restored.replaced_updates == 1 and [p.island for p in restored.buffers[0].pushes] == [2]
    assert restored.poll(10.0) == 1 and list(restored.quorum_sizes.recent) == [1]


def test_the_norm_bound_does_not_follow_one_islands_pushes_however_many_sessions() -> None:
    s = _syncer()
    for v in range(3):  # three honest rounds: every island has an entry
        for i in range(3):
            s.push(_push(s, i, _honest(i, seed=v + 1)))
    assert s.version(0) == 3
    before = s.global_params()
    honest = float(_honest(0).norm())
    session, scale = 0, 8.0
    for _ in range(6):  # escalate: 9x what was accepted last, from 8x an honest push, three sessions per step
        results = []
        for _ in range(3):
            session += 1
            results.append(s.push(_push(s, 2, scale * _honest(2, seed=session), session)))
        assert all(r.accepted == (scale < 10) for r in results), (scale, results)
        scale *= 9
    for _ in range(20):  # 1000x an honest push: refused in every new session
        session += 1
        assert s.push(_push(s, 2, 1000 * _honest(2, seed=session), session)).reason == "norm"
    assert [p.island for p in s.buffers[0].pushes] == [2]
    assert all(e is not None and e[0] < 10 * honest for e in s.bounds.latest[0])  # one entry per island
    assert s.push(_push(s, 0, _honest(0, seed=50))).accepted
    assert s.push(_push(s, 1, _honest(1, seed=50))).committed == 1
    # the merge moved the globals by the mean of two honest pushes and one at 8x: a few honest steps
    assert float((s.global_params() - before).norm()) < 5 * honest
    assert s.rejected_by_reason["norm"] == 5 * 3 + 20


def test_the_norm_history_survives_a_checkpoint_and_an_old_one_loads_cold() -> None:
    s = _syncer()
    for i in range(3):
        s.push(_push(s, i, _honest(i)))
    assert s.bounds.warm(0) and all(e is not None for e in s.bounds.latest[0])
    restored = _syncer()
    restored.load_state_dict(s.state_dict())
    assert restored.bounds.latest == s.bounds.latest
    assert restored.push(_push(restored, 2, 50 * _honest(2, seed=1))).reason == "norm"  # the warm bound
    old = s.state_dict()
    old["bounds"] = {"window": [[[0.07, TOK]] * 3], "granted": None, "claimed": [[TOK]] * 3}  # before per island
    cold = _syncer()
    cold.load_state_dict(old)
    assert not cold.bounds.warm(0) and cold.bounds.latest == [[None] * 3]
    assert cold.push(_push(cold, 2, 50 * _honest(2, seed=1))).accepted  # the cold bound: 10x the parameters' norm


@pytest.mark.parametrize("robust", ["median", "trimmed_mean", "clip"])
def test_a_robust_merge_is_not_outvoted_by_one_islands_sessions(robust: str) -> None:
    # islands 0 and 1 push honestly; island 2 pushes their mean sign-flipped x5, in three sessions
    honest = [_honest(i) for i in range(3)]
    theta = torch.randn(N, generator=_gen(0))
    clean = _syncer(robust_merge=robust)
    for i in range(3):
        clean.push(_push(clean, i, honest[i]))
    clean_step = theta - clean.global_params()
    s = _syncer(robust_merge=robust)
    for session in range(3):
        assert s.push(_push(s, 2, -5 * torch.stack(honest[:2]).mean(0), session)).accepted
    s.push(_push(s, 0, honest[0]))
    assert s.push(_push(s, 1, honest[1])).committed == 1
    step = theta - s.global_params()
    assert float(torch.nn.functional.cosine_similarity(step, clean_step, dim=0)) > 0.9
    assert 0.25 < float(step.norm() / clean_step.norm()) < 1.5  # clip: about a third (one of three outvoted)


@pytest.mark.parametrize("delta, reason", [
    (torch.empty(N, device="meta"), "type"),
    (torch.zeros(N).to_sparse(), "type"),
    (torch.nested.nested_tensor([torch.zeros(N)], layout=torch.jagged), "type"),
    (torch.nn.Parameter(torch.zeros(N)), "type"),
    ([0.0] * N, "type"),
    (torch.zeros(N, dtype=torch.float64), "dtype"),
    (torch.full((N,), 3e37), "norm"),
])
def test_bad_tensors_are_refused_and_counted(delta: object, reason: str) -> None:
    s = _syncer()
    result = s.push(Push(0, 0, delta, TOK, 0, credential=CREDS[0]))  # type: ignore[arg-type]
    assert not result.accepted and result.reason == reason
    assert s.rejected_by_reason == {reason: 1} and s.stats()["rejected_by_island"] == {reason: [1, 0, 0]}
    assert s.stats()["rejected_tokens_by_island"] == [TOK, 0.0, 0.0]


@pytest.mark.parametrize("island", [True, -1, 3, 99, "x", None, 1.0])
def test_pushes_naming_no_island_are_refused_and_counted(island: object) -> None:
    s = _syncer()
    result = s.push(Push(island, 0, _honest(0), TOK, 0, credential=CREDS[0]))  # type: ignore[arg-type]
    assert result.reason == "island"
    assert s.rejected_by_reason == {"island": 1} and s.stats()["rejected_by_island"] == {}
    assert s.stats()["rejected_tokens_by_island"] == [0.0] * 3


def test_not_a_push_and_forged_pushes_leave_no_tokens_in_a_bucket() -> None:
    s = _syncer()
    assert s.push({"island": 0}).reason == "type"  # type: ignore[arg-type]
    assert s.push(Push(0, 0, _honest(0), TOK, 0, credential=CREDS[1])).reason == "identity"
    for fragment in (1, -1, True, "0"):
        assert s.push(Push(0, fragment, _honest(0), TOK, 0, credential=CREDS[0])).reason == "fragment"  # type: ignore[arg-type]
    assert s.push(Push(0, 0, _honest(0), True, 0, credential=CREDS[0])).reason == "tokens"
    stats = s.stats()
    assert stats["rejected_by_reason"] == {"type": 1, "identity": 1, "fragment": 4, "tokens": 1}
    assert all(stats[f"{k}_tokens_by_island"] == [0.0] * 3 for k in ("merged", "stale", "rejected"))
    for i, round_s in ((1, "x"), (2, float("nan"))):  # a round time that is no number: taken as not measured
        assert s.push(Push(i, 0, _honest(i), TOK, 0, round_s=round_s, credential=CREDS[i])).accepted  # type: ignore[arg-type]
    assert not s.round_s
    # an authenticated push of a bad version is its island's claim: its tokens are rejected ones
    assert s.push(Push(0, 0, _honest(0), TOK, True, credential=CREDS[0])).reason == "version"
    assert s.stats()["rejected_tokens_by_island"] == [TOK, 0.0, 0.0]


# --- the Ray syncer actor's class, used in this process (no Ray started) -------------------------------------
def _service(fast_config: dict, creds: list[str]):  # noqa: ANN202
    pytest.importorskip("ray")
    from atoll.config import build_config
    from atoll.runtime.ray.actors import SyncerService

    config = build_config(overrides={**fast_config, "strategy": "decoupled", "runtime": "ray", "fragments": 2})
    return config, SyncerService(config.model_dump_json(), fast_config["out"], creds)


def test_on_ray_token_claims_are_bounded_by_the_steps_granted(fast_config: dict) -> None:
    from atoll.runtime.ray.actors import SyncerService

    creds = CREDS[:2]
    config, svc = _service(fast_config, creds)
    tps = config.tokens_per_step
    delta = 1e-3 * svc.syncer.pull(0).params
    with pytest.raises(PermissionError, match="reserve_step: island 1's credential does not match"):
        svc.reserve_step(1, creds[0])
    with pytest.raises(PermissionError):
        svc.reserve_step(1)
    assert svc.syncer.bounds.granted == [0, 0]  # the ledger is open before any step: nothing granted yet
    assert not svc.push(Push(1, 0, delta, tps, 0, credential=creds[1]))[0]  # a claim before any step granted
    for _ in range(5):
        assert svc.reserve_step(1, creds[1])[0]
    assert svc.syncer.bounds.granted == [0, 5 * tps]
    claims = []
    for _ in range(20):  # island 1 opens 20 sessions and claims its push size x10 in each
        session = svc.join(1, creds[1])[3]
        claims.append(svc.push(Push(1, 0, delta, 10 * 5 * tps, 0, session=session, credential=creds[1]))[0])
    assert not any(claims)
    assert svc.push(Push(1, 0, delta, 5 * tps, 0, session=session, credential=creds[1]))[0]  # its 5 steps, once
    session = svc.join(1, creds[1])[3]
    assert not svc.push(Push(1, 0, delta, tps, 0, session=session, credential=creds[1]))[0]  # claimed already
    svc.reserve_step(0, creds[0])
    assert svc.push(Push(0, 0, delta, tps, 0, credential=creds[0]))[0]  # completes the quorum: commit, checkpoint
    stats = svc.syncer.stats()
    assert svc.syncer.commits == 1 and stats["rejected_by_reason"] == {"tokens": 22}
    share = int(svc.syncer.index[0].numel()) / svc.syncer.numel
    assert stats["merged_tokens_by_island"] == pytest.approx([tps * share, 5 * tps * share])
    # a syncer restarted from its checkpoint keeps the ledger as it was at its last grant (ledger.json: not a push
    # of tokens more, which would let the merged tokens exceed the steps granted), and the claims; the commit's
    # checkpoint is written by the writer thread: a restart reads what is on disk (on a loaded machine the write
    # may not have finished yet)
    assert svc.writer.flush(timeout=60)
    restarted = SyncerService(config.model_dump_json(), fast_config["out"], creds)
    h = config.strategy_config.sync_every * tps
    assert restarted.syncer.bounds.granted == [tps, 5 * tps]
    assert restarted.syncer.bounds.claimed == svc.syncer.bounds.claimed
    pull = restarted.syncer.pull(0)
    assert not restarted.push(Push(1, 0, delta, h, pull.version, session=session + 1, credential=creds[1]))[0]
    assert restarted.reserve_steps(1, creds[1], config.strategy_config.sync_every) == config.strategy_config.sync_every
    assert not restarted.push(Push(1, 0, delta, h + 1, pull.version, session=session + 1, credential=creds[1]))[0]
    assert restarted.push(Push(1, 0, delta, h, pull.version, session=session + 1, credential=creds[1]))[0]


def test_on_ray_bad_calls_are_refused_never_raised_as_index_errors(fast_config: dict) -> None:
    creds = CREDS[:2]
    config, svc = _service(fast_config, creds)
    svc.reserve_step(1, creds[1])
    delta = 1e-3 * svc.syncer.pull(0).params
    seen = [i.last_seen for i in svc.islands]
    for island in (99, 2, -1, "x", None, True):
        assert svc.push(Push(island, 0, delta, 10, 0, credential=creds[1])) == (False, None)  # type: ignore[arg-type]
        for call in (svc.reserve_step, svc.buffered):
            with pytest.raises(ValueError, match=f"island {island!r} is not one of this run's islands 0..1"):
                call(island)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="join: island"):
            svc.join(island, creds[1])  # type: ignore[arg-type]
    assert svc.push(Push(1, 5, delta, 10, 0, credential=creds[1])) == (False, None)  # no such fragment
    assert svc.push(Push(0, 0, delta, 10, 0, credential=creds[1]))[0] is False  # forged: refused, answered
    assert svc.push("not a push") == (False, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pull: fragment 7"):
        svc.pull(7)
    # island -1 did not overwrite island 1's entry, a forged push not island 0's
    assert [i.last_seen for i in svc.islands] == seen
    assert svc.syncer.rejected_by_reason == {"island": 6, "fragment": 1, "identity": 1, "type": 1}
