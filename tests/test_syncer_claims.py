"""What a claim buys at the decoupled syncer (issue 26): a round time, banked tokens, tiny pushes.

Each test is an attack that worked before the bounds of :mod:`atoll.strategies.decoupled.syncer` and
:mod:`atoll.strategies.decoupled.bounds` took the syncer's own view of an island: a claimed round time of
1e300 s stalled every merge of a full quorum once the claimant went silent; a push that banked ten rounds'
tokens got ten times the merge weight and norm allowance; tiny pushes of one of two islands refused every
push of the other. Plain syncers, small tensors, real assertions on the global parameters.
"""

from __future__ import annotations

import math

import pytest
import torch

from atoll.strategies.decoupled.protocol import Push
from atoll.strategies.decoupled.syncer import Syncer

N, TOK = 200, 100


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


THETA = torch.randn(N, generator=_gen(0))
DIRECTION = torch.randn(N, generator=_gen(1000))
DIRECTION = DIRECTION / DIRECTION.norm()  # what every honest island learns, a unit vector


def _honest(i: int, seed: int) -> torch.Tensor:
    """An honest Δ: 0.07 along the shared direction plus island noise (Δ = θ_before − θ_after, so a step
    along +DIRECTION lowers θ·DIRECTION)."""
    return 0.07 * DIRECTION + 0.01 * torch.randn(N, generator=_gen(seed * 10 + i)) / math.sqrt(N)


def _progress(s: Syncer) -> float:
    """How far the global parameters moved along the honest direction since the start (honest merges: +0.07)."""
    return float((THETA - s.global_params()) @ DIRECTION)


def test_a_claimed_round_time_cannot_stall_the_merges_of_a_full_quorum() -> None:
    # 2 islands, full quorum; island 1 claims 1e300 s per round, then goes silent. Before, the grace window was
    # the median of the last 32 claims: with the window full, half of them its own, their mean, ~5e299 s, and
    # no merge came again (a Ray island waiting for its push of that fragment waited forever)
    s = Syncer(THETA, None, 2, outer_lr=1.0, outer_momentum=0.0, grace_factor=1.0, push_tokens=[TOK] * 2,
               max_round_s=60.0)
    for r in range(1, 21):  # rounds 1 s apart, on the syncer's clock
        t = float(r)
        assert s.push(Push(0, 0, _honest(0, r), TOK, s.version(0), round_s=0.9), now=t).accepted
        assert s.push(Push(1, 0, _honest(1, r), TOK, s.version(0), round_s=1e300), now=t + 0.01).committed == 1
    assert max(s.round_s) <= 60.0  # its first claim, with no earlier push seen: the ceiling; then 1 s
    # island 1 is silent now; island 0's push must merge about one round later, alone
    assert s.push(Push(0, 0, _honest(0, 21), TOK, s.version(0), round_s=0.9), now=21.0).accepted
    deadline, fragment = s.next_deadline()  # type: ignore[misc]
    assert fragment == 0 and deadline <= 21.0 + 2.0, deadline
    assert s.poll(21.0 + 2.0) == 1 and s.quorum_sizes.recent[-1] == 1
    # a claim is clamped to the seconds since the island's own previous push of the fragment
    assert s.round_time(1e300, 0.98) == 0.98 and s.round_time(0.5, 0.98) == 0.5
    assert s.round_time(float("nan"), 1.0) is None and s.round_time(True, 1.0) is None


def _banked() -> tuple[Syncer, float]:
    """5 islands, full quorum, outer lr 1, momentum 0, a token ledger: three honest rounds, then nine in which
    island 4 trains (is granted its tokens) but does not push fragment 0. The syncer, and the progress of one
    honest merge."""
    s = Syncer(THETA, None, 5, outer_lr=1.0, outer_momentum=0.0, grace_factor=1.0, push_tokens=[TOK] * 5,
               max_round_s=60.0)
    for r in range(1, 14):
        for i in range(5):
            s.grant(i, TOK)
        if r == 13:
            break
        for i in range(5 if r < 4 else 4):
            s.push(Push(i, 0, _honest(i, r), TOK, s.version(0), round_s=0.9), now=float(r))
        s.poll(r + 0.99)  # close a window short of the quorum (island 4 missing)
    assert s.commits == 12
    return s, _progress(s) / 12


def _merge_round_13(s: Syncer, hostile: Push) -> tuple[object, float]:
    before = _progress(s)
    result = s.push(hostile, now=13.0)
    for i in range(4):
        s.push(Push(i, 0, _honest(i, 13), TOK, s.version(0), round_s=0.9), now=13.0)
    s.poll(14.0)
    return result, _progress(s) - before


def test_banked_tokens_buy_no_more_weight_or_norm_than_one_round() -> None:
    # island 4 claims all ten rounds' tokens in one push of its honest Δ sign-flipped and 95x: within 10x of
    # what the others' entries vouch for at 10x their tokens. Before: accepted, weight 10/14, and the one
    # merge undid about 63 honest rounds
    s, honest_round = _banked()
    result, moved = _merge_round_13(s, Push(4, 0, -95.0 * _honest(4, 13), 10 * TOK, s.version(0), round_s=0.9))
    assert not result.accepted and result.reason == "norm", result  # vouched for one round's tokens
    assert moved / honest_round > 0.5, moved / honest_round
    # at the bound of one round's tokens (9x its Δ, sign-flipped) it is accepted, and weighs one island's share
    s, honest_round = _banked()
    result, moved = _merge_round_13(s, Push(4, 0, -9.0 * _honest(4, 13), 10 * TOK, s.version(0), round_s=0.9))
    assert result.accepted and s.quorum_sizes.recent[-1] == 5  # type: ignore[attr-defined]
    assert -1.5 < moved / honest_round < 0.0, moved / honest_round  # (4 - 9) / 5 = -1, not (4 - 90) / 14 = -6
    assert s.stats()["merged_tokens_by_island"][4] == 13 * TOK  # its tokens still count as merged


def test_tiny_pushes_of_one_of_two_islands_do_not_refuse_the_others() -> None:
    # 2 islands; after three honest rounds island 1 pushes 1e-4 x its honest Δ. Before: median_low picked its
    # entry, 10x that refused every push of island 0, and the model stopped training (the run exited 0)
    s = Syncer(THETA, None, 2, outer_lr=1.0, outer_momentum=0.0, push_tokens=[TOK] * 2)
    for r in range(1, 4):
        for i in (0, 1):
            assert s.push(Push(i, 0, _honest(i, r), TOK, s.version(0))).accepted
    before = _progress(s)
    for r in range(4, 24):
        assert s.push(Push(1, 0, 1e-4 * _honest(1, r), TOK, s.version(0))).accepted
        result = s.push(Push(0, 0, _honest(0, r), TOK, s.version(0)))
        assert result.accepted and result.committed == 1, (r, result)
    assert s.rejected_updates == 0 and s.starved() == []
    assert (_progress(s) - before) > 0.45 * 20 * 0.07  # every merge half an honest Δ (two equal weights)
    # and the floor lets no island climb: pushes 3x its last accepted one, again and again, are refused
    big = [s.push(Push(1, 0, 3.0 ** k * _honest(1, 30 + k), TOK, s.version(0))) for k in range(2, 8)]
    assert [r.reason for r in big][-3:] == ["norm"] * 3


def test_an_island_whose_pushes_are_all_refused_stops_the_run_with_one_line() -> None:
    # the same attack from the first round on: no entry of island 0's vouches for it, so its pushes are refused
    # when they merge (cold, no push vouches for itself); the syncer reports it rather than train on without it
    s = Syncer(THETA, None, 2, outer_lr=1.0, outer_momentum=0.0, push_tokens=[TOK] * 2, starve_after=6)
    for r in range(1, 7):
        s.push(Push(1, 0, 1e-4 * _honest(1, r), TOK, s.version(0)))
        s.push(Push(0, 0, _honest(0, r), TOK, s.version(0)))
        assert s.starved() == ([0] if r == 6 else [])
    message = s.starved_message()
    assert "island 0" in message and "norm x6" in message and "\n" not in message
    # one accepted push ends the streak
    restored = Syncer(THETA, None, 2, outer_lr=1.0, outer_momentum=0.0, push_tokens=[TOK] * 2, starve_after=6)
    restored.load_state_dict(s.state_dict())
    assert restored.starved() == [0]


@pytest.mark.slow  # it trains 120 inner steps of each island
def test_a_run_whose_island_is_refused_throughout_stops_and_says_so(fast_config: dict) -> None:
    # the local simulation, 2 islands: island 1 pushes 1e-4 x its honest Δ from the start, so island 0's pushes
    # are refused when they merge. Before: every push of island 0 refused, the model untrained, exit 0, no word
    from atoll.config import TrainConfig
    from atoll.job.divergence import until_diverged
    from atoll.job.run import Run
    from atoll.runtime.events import Simulation
    from bench.robust_merge import flip_pushes

    config = TrainConfig(**{**fast_config, "strategy": "decoupled", "steps": 120, "codec": "fp32", "fragments": 1,
                            "eval_every": 1000, "checkpoint_every": 1000})
    run = Run(config)
    sim = Simulation.of_run(config, run)
    flip_pushes(sim.syncer, 1, -1e-4)  # -(-1e-4) x its honest Δ
    run.begin(restore=sim.restore)
    sim.diverged = until_diverged(sim.run_events, False)
    summary = sim.finish()
    assert summary["starved_islands"] == [0]
    assert "island 0" in summary["starved"] and "norm" in summary["starved"]
    assert summary["rejected_by_island"]["norm"][0] >= 16
    assert summary["tokens"] < config.islands * config.steps * config.tokens_per_step  # it stopped early
