"""Attacks on the decoupled syncer through its public push API: identity, replays, bounds, robust merges."""

from __future__ import annotations

import pytest
import torch

from atoll.strategies.decoupled.protocol import Push
from atoll.strategies.decoupled.syncer import Syncer

CREDS = ["a" * 32, "b" * 32, "c" * 32, "d" * 32]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _honest(i: int, n: int = 200, seed: int = 0) -> torch.Tensor:
    """An honest Δ: a shared direction plus island noise, norm about 0.1."""
    base = torch.randn(n, generator=_gen(1000 + seed))
    return 0.005 * (base + 0.3 * torch.randn(n, generator=_gen(seed * 10 + i)))


def test_cold_start_push_cannot_negate_the_parameters() -> None:
    # before any history, a push that negates the parameters (θ − 2θ = −θ) among the first round's 3 honest
    # ones: refused when the buffer merges (over 10x what the pushes merged with it vouch for)
    theta = torch.randn(200, generator=_gen(0))
    kw = {"islands": 4, "outer_lr": 1.0, "outer_momentum": 0.0, "scale_partial": False}
    s = Syncer(theta, None, quorum=4, **kw)
    s.push(Push(3, 0, 2 * theta, 100, 0))
    for i in range(3):
        s.push(Push(i, 0, _honest(i), 100, 0))
    honest = Syncer(theta, None, quorum=3, **kw)
    for i in range(3):
        honest.push(Push(i, 0, _honest(i), 100, 0))
    assert s.commits == honest.commits == 1
    torch.testing.assert_close(s.global_params(), honest.global_params())
    assert s.stats()["rejected_by_island"] == {"norm": [0, 0, 0, 1]}
    assert s.stats()["rejected_tokens_by_island"] == [0.0, 0.0, 0.0, 100.0]
    # a push 11x the parameters' norm is refused at once
    assert Syncer(theta, None, quorum=1, **kw).push(Push(0, 0, 11 * theta, 100, 0)).reason == "norm"


def test_refused_pushes_do_not_move_the_norm_bound() -> None:
    theta = torch.randn(200, generator=_gen(0))
    s = Syncer(theta, None, islands=2, quorum=2, outer_lr=0.7, outer_momentum=0.0)
    for i in range(2):  # one honest round: norms about 0.1
        assert s.push(Push(i, 0, _honest(i), 100, 0)).accepted
    for k in range(40):  # 40 refused pushes 50x the honest norm (over the bound of 10x)
        assert s.push(Push(0, 0, 50 * _honest(0, seed=k + 1), 100, 1)).reason in ("norm", "replay")
    huge = s.push(Push(1, 0, 500 * _honest(1, seed=99), 100, 1))
    assert not huge.accepted and huge.reason == "norm"
    assert s.version(0) == 1


def test_a_replayed_push_is_refused() -> None:
    theta = torch.randn(200, generator=_gen(0))
    s = Syncer(theta, None, islands=2, quorum=2, outer_lr=0.7, outer_momentum=0.0)
    push = Push(0, 0, _honest(0), 100, 0)
    assert s.push(push).accepted
    again = s.push(push)
    assert not again.accepted and again.reason == "replay"
    assert s.push(Push(1, 0, _honest(1), 100, 0)).committed == 1
    assert s.push(push).reason == "replay"  # a stale copy after the merge: refused too, never merged twice
    assert s.stats()["rejected_by_island"]["replay"] == [2, 0]


def test_an_island_can_only_push_as_itself() -> None:
    theta = torch.randn(200, generator=_gen(0))
    s = Syncer(theta, None, islands=4, quorum=3, credentials=CREDS)
    for i in range(4):  # one sender (island 3) fills a quorum under every index with its own credential
        result = s.push(Push(i, 0, _honest(i), 100, 0, credential=CREDS[3]))
        assert result.accepted == (i == 3), (i, result)
    assert s.commits == 0 and s.version(0) == 0
    assert s.push(Push(0, 0, _honest(0), 100, 0)).reason == "identity"  # none presented
    assert s.stats()["rejected_by_island"]["identity"] == [2, 1, 1, 0]


def _attacked_step(robust: str, attack: bool) -> torch.Tensor:
    """One merge of 4 honest pushes and (``attack``) a fifth that is the honest mean, sign-flipped and scaled
    x5 (in the norm bound): the step of the global parameters."""
    theta = torch.randn(200, generator=_gen(0))
    s = Syncer(theta, None, islands=5, quorum=5 if attack else 4, outer_lr=1.0, outer_momentum=0.0,
               robust_merge=robust, scale_partial=False)
    honest = [_honest(i) for i in range(4)]
    for i, d in enumerate(honest):
        assert s.push(Push(i, 0, d, 100, 0)).accepted
    if attack:
        assert s.push(Push(4, 0, -5 * torch.stack(honest).mean(0), 100, 0)).accepted  # in bound: not refused
    assert s.commits == 1
    return theta - s.global_params()


@pytest.mark.parametrize("robust", ["clip", "trimmed_mean", "median"])
def test_a_sign_flipped_in_bound_push_is_outvoted_by_a_robust_merge(robust: str) -> None:
    clean = _attacked_step("none", attack=False)
    cos = torch.nn.functional.cosine_similarity
    assert float(cos(_attacked_step("none", attack=True), clean, dim=0)) < -0.5  # the plain mean is reversed
    step = _attacked_step(robust, attack=True)
    assert float(cos(step, clean, dim=0)) > 0.9
    assert 0.3 < float(step.norm() / clean.norm()) < 1.5
    # a clean merge stays close to the plain one
    assert float(cos(_attacked_step(robust, attack=False), clean, dim=0)) > 0.9


def test_a_rejoined_island_pushes_from_the_same_version_in_a_new_session() -> None:
    # an island fails while its push waits in a buffer and rejoins at the same version: its new work is not a
    # replay (a new session), but a copy of its push before the failure is
    theta = torch.randn(200, generator=_gen(0))
    s = Syncer(theta, None, islands=2, quorum=2)
    before = Push(0, 0, _honest(0), 100, 0)
    assert s.push(before).accepted
    assert s.rejoin(0) == 1
    assert s.push(Push(0, 0, _honest(0, seed=5), 100, 0, session=1)).accepted
    assert s.push(before).reason == "replay"
    assert s.push(Push(0, 0, _honest(0, seed=6), 100, 0, session=1)).reason == "replay"
    restored = Syncer(theta, None, islands=2, quorum=2)
    restored.load_state_dict(s.state_dict())
    assert restored.push(Push(0, 0, _honest(0, seed=7), 100, 0, session=1)).reason == "replay"
    assert restored.push(Push(1, 0, _honest(1), 100, 0)).committed == 1
    # a syncer restarted from a checkpoint older than the island's join: its pushes of the later session count
    assert restored.push(Push(0, 0, _honest(0, seed=8), 100, 1, session=3)).accepted
    assert restored.push(Push(0, 0, _honest(0, seed=9), 100, 1, session=1)).reason == "replay"


def test_refusals_per_island_and_the_robust_merge_are_rows_of_the_final_table() -> None:
    from atoll.job.metrics import _trust_rows

    summary = {"robust_merge": "median", "merge_s": 0.25,
               "rejected_by_island": {"replay": [0, 2, 0], "identity": [1, 0, 0], "norm": [0, 0, 0]}}
    assert _trust_rows(summary) == [("robust merge (seconds merging)", "median (0.25 s)"),
                                    ("pushes refused per island", "by reason"), ("  identity", "1 / 0 / 0"),
                                    ("  replay", "0 / 2 / 0")]
    assert _trust_rows({"robust_merge": "none", "rejected_by_island": {}}) == []
