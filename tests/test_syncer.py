"""The syncer of Decoupled DiLoCo: token-weighted merge, quorum, grace window, staleness, validation, state."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from atoll.algorithms.outer import pseudo_gradient
from atoll.strategies.decoupled.protocol import Push
from atoll.strategies.decoupled.syncer import Syncer


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_token_weighted_merge_equals_the_formula() -> None:
    theta = torch.randn(100, generator=_gen())
    s = Syncer(theta, None, islands=3, outer_lr=0.5, outer_momentum=0.0, quorum=3, staleness_exponent=0.0)
    deltas = [0.01 * torch.randn(100, generator=_gen(i + 1)) for i in range(3)]
    tokens = [100, 300, 600]
    for i in range(3):
        s.push(Push(i, 0, deltas[i], tokens[i], 0))
    expected = theta - 0.5 * sum(t * d for t, d in zip(tokens, deltas, strict=True)) / sum(tokens)
    torch.testing.assert_close(s.global_params(), expected, rtol=0, atol=1e-6)
    assert s.commits == 1 and list(s.quorum_sizes.recent) == [3] and s.version(0) == 1


def test_one_island_full_quorum_lr1_momentum0_is_plain_averaging() -> None:
    theta = torch.randn(50, generator=_gen())
    island = theta + 0.1 * torch.randn(50, generator=_gen(1))
    s = Syncer(theta, None, islands=1, outer_lr=1.0, outer_momentum=0.0)
    assert s.push(Push(0, 0, pseudo_gradient(theta, island), 10, 0)).committed == 1
    torch.testing.assert_close(s.global_params(), island, rtol=0, atol=1e-6)
    # K islands, full quorum, no staleness, equal tokens: the mean of the islands' parameters
    islands = [theta + 0.1 * torch.randn(50, generator=_gen(i + 2)) for i in range(4)]
    s = Syncer(theta, None, islands=4, outer_lr=1.0, outer_momentum=0.0, quorum=4)
    for i, x in enumerate(islands):
        s.push(Push(i, 0, pseudo_gradient(theta, x), 7, 0))
    torch.testing.assert_close(s.global_params(), torch.stack(islands).mean(0), rtol=0, atol=1e-6)


def test_an_owned_delta_is_buffered_without_a_copy_and_a_given_norm_is_the_one_checked() -> None:
    """``owned``: the service's decoded Δ is buffered as it is (no fragment-sized copy under its lock); an
    island's own tensor is copied (it may reuse it). ``norm``: the norm the service computed outside its lock is
    the one the bounds check, not a second pass. Both are the receiving runtime's arguments, never fields of an
    island's message (a Push carries no norm to claim)."""
    import dataclasses

    assert not {"norm", "delta_norm", "owned"} & {f.name for f in dataclasses.fields(Push)}
    theta = torch.randn(100, generator=_gen())
    s = Syncer(theta, None, islands=3, quorum=3)
    mine, theirs = 1e-3 * torch.randn(100, generator=_gen(1)), 1e-3 * torch.randn(100, generator=_gen(2))
    assert s.push(Push(0, 0, mine, 10, 0), norm=float(mine.norm()), owned=True).accepted
    assert s.push(Push(1, 0, theirs, 10, 0)).accepted
    held = {p.island: p.delta for p in s.buffers[0].pushes}
    assert held[0].data_ptr() == mine.data_ptr()  # the same storage
    assert held[1].data_ptr() != theirs.data_ptr() and torch.equal(held[1], theirs)  # a copy
    # a norm far over the fragment's own (the first round's bound) refuses the push, whatever Δ's true norm
    assert s.push(Push(2, 0, mine.clone(), 10, 0), norm=1e9, owned=True).reason == "norm"


def test_quorum_merges_at_once_and_grace_window_merges_the_rest() -> None:
    theta = torch.zeros(10)
    assert Syncer(theta, None, islands=4).quorum == 4  # every island by default
    s = Syncer(theta, None, islands=4, outer_lr=1.0, outer_momentum=0.0, grace_factor=0.5, scale_partial=False,
               quorum=2)
    r = s.push(Push(0, 0, torch.full((10,), -1.0), 10, 0, round_s=4.0), now=1.0)
    assert r.accepted and r.committed == 0 and s.version(0) == 0
    # the grace window is 0.5 x the median measured round time (4 s), opened at the first push
    assert s.next_deadline() == (3.0, 0)
    assert s.poll(2.9) == 0 and s.version(0) == 0
    assert s.poll(3.0) == 1 and s.version(0) == 1 and list(s.quorum_sizes.recent) == [1]
    torch.testing.assert_close(s.global_params(), torch.ones(10))
    # two distinct islands reach the quorum: merged at once, divided by what they contributed
    s.push(Push(1, 0, torch.full((10,), -1.0), 10, 1, round_s=4.0), now=5.0)
    assert s.push(Push(1, 0, torch.full((10,), -2.0), 10, 1), now=5.5).reason == "replay", "one push per version"
    assert s.push(Push(2, 0, torch.full((10,), -3.0), 20, 1), now=6.0).committed == 1
    torch.testing.assert_close(s.global_params(), torch.full((10,), 1.0 + (10 + 60) / 30))
    assert list(s.quorum_sizes.recent) == [1, 2] and s.next_deadline() is None


def test_partial_merge_is_scaled_by_the_share_of_islands() -> None:
    s = Syncer(torch.zeros(6), None, islands=4, outer_lr=1.0, outer_momentum=0.0, quorum=2)
    s.push(Push(0, 0, torch.full((6,), -1.0), 10, 0))
    s.push(Push(1, 0, torch.full((6,), -3.0), 30, 0))  # token-weighted mean -2.5, spoken for 2 of 4 islands
    torch.testing.assert_close(s.global_params(), torch.full((6,), 2.5 * 2 / 4))


def test_staleness_discount_and_max_staleness() -> None:
    theta = torch.zeros(4)
    s = Syncer(theta, None, islands=2, outer_lr=1.0, outer_momentum=0.0, quorum=1, max_staleness=1,
               staleness_exponent=1.0)
    s.push(Push(0, 0, torch.full((4,), -1.0), 10, 0))          # version 0 -> 1
    s.push(Push(0, 0, torch.full((4,), -1.0), 10, 1))          # version 1 -> 2
    before = s.global_params()
    r = s.push(Push(1, 0, torch.full((4,), -1.0), 10, 0))      # staleness 2 > max 1: dropped
    assert not r.accepted and r.reason == "stale" and s.stale_updates == 1 and s.rejected_updates == 0
    assert torch.equal(s.global_params(), before)
    # staleness 1 with exponent 1: weight tokens / 2, alone in its merge so the mean is unchanged;
    # beside a fresh push of equal tokens it counts half
    s2 = Syncer(theta, None, islands=4, outer_lr=1.0, outer_momentum=0.0, quorum=3, staleness_exponent=1.0,
                scale_partial=False)
    s2.push(Push(0, 0, torch.full((4,), -1.0), 10, 0))
    s2.push(Push(1, 0, torch.full((4,), -1.0), 10, 0))
    s2.push(Push(3, 0, torch.full((4,), -1.0), 10, 0))  # commit: version 1
    s2.push(Push(0, 0, torch.full((4,), -3.0), 10, 1))
    s2.push(Push(1, 0, torch.full((4,), -3.0), 10, 1))
    s2.push(Push(2, 0, torch.full((4,), 0.0), 10, 0))   # staleness 1: weight 5
    expected = 1.0 + (30 + 30 + 0) / 25
    torch.testing.assert_close(s2.global_params(), torch.full((4,), expected))
    assert list(s2.staleness.recent) == [0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize(("bad", "reason"), [
    (torch.tensor([float("nan")] + [0.0] * 15), "non_finite"),
    (torch.tensor([float("inf")] + [0.0] * 15), "non_finite"),
    (torch.full((16,), 1e6), "norm"),
    (torch.zeros(15), "shape"),
    (torch.zeros(4, 4), "shape"),
    (torch.zeros(16, dtype=torch.float64), "dtype"),
    (torch.zeros(16, dtype=torch.bfloat16), "dtype"),
    ([0.0] * 16, "type"),
])
def test_invalid_pushes_never_reach_the_global_model(bad: object, reason: str) -> None:
    theta = torch.randn(16, generator=_gen())
    s = Syncer(theta, None, islands=2, outer_lr=0.7, outer_momentum=0.9, quorum=1)
    for v in range(4):  # accepted updates: the norm bound follows their running median
        s.push(Push(0, 0, 0.01 * torch.randn(16, generator=_gen(v + 1)), 10, v))
    before = s.state_dict()
    global_before = s.global_params()
    r = s.push(Push(1, 0, bad, 10, s.version(0)))
    assert not r.accepted and r.reason == reason
    assert s.rejected_updates == 1 and s.rejected_by_reason == {reason: 1}
    assert torch.equal(s.global_params(), global_before), "bit-identical after a rejected push"
    assert s.version(0) == 4 and s.buffers[0].pushes == []
    assert before["outer"][0]["optimizer"]["state"][0]["momentum_buffer"].equal(
        s.outer[0].optimizer.state_dict()["state"][0]["momentum_buffer"])


def test_norm_bound_follows_honest_growth_and_keeps_refusing_a_hostile_island() -> None:
    # updates grow 700x over a run (the learning rate warming up), 3 honest islands and one hostile one
    # pushing 1000x the honest norm each round: every honest push is merged, every hostile one refused
    s = Syncer(torch.zeros(16), None, islands=4, outer_lr=0.7, outer_momentum=0.0, quorum=3)
    direction = torch.randn(16, generator=_gen(3))
    direction /= direction.norm()
    for r in range(15):
        scale = 1e-3 * 1.6 ** r  # 1e-3 .. 0.7
        for i in range(3):
            assert s.push(Push(i, 0, scale * direction, 10, s.version(0))).accepted, (r, i)
        assert s.push(Push(3, 0, 1000 * scale * direction, 10, s.version(0))).reason == "norm", r
    assert s.version(0) == 15 and s.rejected_updates == 15 and s.accepted_updates == 45


def test_a_push_cannot_buy_a_bigger_norm_by_claiming_more_tokens() -> None:
    # the norm allowance grows with the tokens claimed, so the claims are bounded per island: by its declared
    # push (norm_bound x H tokens) without a ledger; and with 2 islands median_low picks the honest norm
    s = Syncer(torch.zeros(16), None, islands=2, outer_lr=1.0, outer_momentum=0.0, quorum=1, push_tokens=[100, 100])
    delta = 0.01 * torch.randn(16, generator=_gen(5))
    for _ in range(4):
        assert s.push(Push(0, 0, delta, 100, s.version(0))).accepted
    assert s.push(Push(1, 0, 1000 * delta, 100_000, s.version(0))).reason == "tokens"
    for _ in range(3):
        assert s.push(Push(1, 0, 100 * delta, 100, s.version(0))).reason == "norm"
        assert s.push(Push(0, 0, delta, 100, s.version(0))).accepted
    assert s.rejected_by_reason == {"tokens": 1, "norm": 3}
    # with a ledger, exactly what the island was granted: a push deferred 20 rounds (20 x H tokens, beyond
    # the declared bound) is honest and accepted, one token more than granted is not
    led = Syncer(torch.zeros(16), None, islands=2, outer_lr=1.0, outer_momentum=0.0, quorum=1, push_tokens=[100, 100])
    for _ in range(20):
        led.grant(0, 100)
    assert led.push(Push(0, 0, delta, 1500, 0)).accepted and led.push(Push(0, 0, delta, 500, 1)).accepted
    assert led.push(Push(0, 0, delta, 1, 2)).reason == "tokens", "fragment 0 already claimed all 2,000 tokens"
    assert led.push(Push(1, 0, delta, 1, 2)).reason == "tokens", "island 1 was granted nothing"


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_honest_pushes_of_a_wide_speed_spread_are_never_refused(alpha: float) -> None:
    # islands at speeds 1, 1 and 0.005 push at the same cadence: H = 400 and 2 inner steps of 128 tokens. An
    # honest pseudo-gradient's norm grows as steps^alpha (alpha 1: aligned steps, 0.5: a random walk, 0: a
    # saturated one) and with the learning rate over the run. None of them is refused, whatever alpha; a
    # hostile island pushing 50x its honest norm at the fast island's claim is refused every time.
    steps = [400, 400, 2, 400]  # island 3 is the hostile one
    s = Syncer(torch.zeros(64), [torch.arange(32), torch.arange(32, 64)], islands=4, outer_lr=0.5,
               outer_momentum=0.0, quorum=3, push_tokens=[h * 128 for h in steps])
    gen = _gen(7)
    for r in range(40):
        lr = 1e-3 * min(1.0, (r + 1) / 10)  # warmup, then flat
        for i, k in enumerate(steps):
            s.grant(i, k * 128)
        for p in range(2):
            for i, k in enumerate(steps):
                d = torch.randn(32, generator=gen)
                noise = float(torch.empty(1).uniform_(0.5, 2.0, generator=gen))
                scale = lr * k ** alpha * noise * (50 if i == 3 else 1)
                result = s.push(Push(i, p, scale * d / d.norm(), k * 128, s.version(p)))
                assert result.accepted == (i != 3), (r, p, i, result.reason)
    s.flush()
    assert s.rejected_by_reason == {"norm": 2 * 40}
    assert s.stats()["merged_tokens_by_island"][:3] == [40 * k * 128 for k in steps[:3]]


def test_every_pushed_token_lands_in_one_bucket_per_island() -> None:
    # two fragments of 3 and 1 elements (shares 0.75 and 0.25): merged, dropped as stale on arrival and in the
    # buffer, refused (norm, non-finite): each island's buckets sum to the tokens it pushed, times the share
    s = Syncer(torch.ones(4), [torch.arange(3), torch.tensor([3])], islands=3, outer_lr=1.0, outer_momentum=0.0,
               quorum=2, max_staleness=0)
    pushed = [0.0, 0.0, 0.0]

    def push(i: int, p: int, delta: torch.Tensor, tokens: int, base: int) -> str:
        pushed[i] += tokens * (0.75 if p == 0 else 0.25)
        return s.push(Push(i, p, delta, tokens, base)).reason

    small = torch.full((3,), 0.01)
    assert push(0, 0, small, 10, 0) == "" and push(1, 0, small, 20, 0) == ""        # merged: version 1
    assert push(2, 0, small, 30, 0) == "stale"                                     # on arrival
    assert push(2, 1, torch.full((1,), 0.01), 40, 0) == ""                         # buffered, fragment 1
    assert push(0, 0, torch.full((3,), float("nan")), 50, 1) == "non_finite"
    assert push(1, 0, torch.full((3,), 100.0), 60, 1) == "norm"
    s.outer[1].version = 5  # meanwhile fragment 1 moved on: its buffered push is dropped when merged
    s.flush()
    assert s.stale_updates == 2 and s.rejected_updates == 2
    out = s.stats()
    for i in range(3):
        held = sum(out[f"{k}_tokens_by_island"][i] for k in ("merged", "stale", "rejected"))
        assert held == pytest.approx(pushed[i]), i
    assert out["merged_tokens_by_island"] == [7.5, 15.0, 0.0]
    assert out["stale_tokens_by_island"] == [0.0, 0.0, 22.5 + 10.0]
    assert out["rejected_tokens_by_island"] == [37.5, 45.0, 0.0]


def _merged_shares(islands: int, quorum: int, max_staleness: int, rounds: int) -> list[float]:
    """Islands alike push each round in the same order (the last one always after a quorum has merged); an
    island is answered (and pulls) when its push is merged or refused, and one whose push still waits in the
    buffer skips its turn (the push is deferred, its tokens carried). Each island's merged share of its tokens."""
    s = Syncer(torch.zeros(8), None, islands=islands, outer_lr=0.5, outer_momentum=0.0, quorum=quorum,
               max_staleness=max_staleness, staleness_exponent=0.0)
    base, carried, trained = [0] * islands, [0] * islands, [0] * islands
    for _ in range(rounds):
        for i in range(islands):
            trained[i] += 100
            carried[i] += 100
            if any(p.island == i for p in s.buffers[0].pushes):
                continue  # its last push waits for its merge: deferred
            waiting = [p.island for p in s.buffers[0].pushes]
            result = s.push(Push(i, 0, 1e-3 * torch.ones(8), carried[i], base[i]))
            carried[i] = 0
            if not result.accepted:
                base[i] = s.version(0)
            if result.committed:
                for j in [*waiting, i]:
                    base[j] = s.version(0)
    s.flush()
    return [m / t for m, t in zip(s.merged_tokens_per_island, trained, strict=True)]


@pytest.mark.parametrize(("islands", "quorum", "max_staleness"), [(3, 2, 0), (4, 3, 0), (4, 2, 0), (3, 1, 0)])
def test_no_island_is_starved_of_merges_over_many_rounds(islands: int, quorum: int, max_staleness: int) -> None:
    # without the staleness credit the islands after the quorum are dropped round after round and merge nothing
    shares = _merged_shares(islands, quorum, max_staleness, rounds=200)
    assert min(shares) >= 0.95, shares
    assert max(shares) - min(shares) <= 0.05, shares


def test_other_bad_pushes_are_rejected() -> None:
    s = Syncer(torch.zeros(8), [torch.arange(4), torch.arange(4, 8)], islands=2)
    assert s.push(Push(2, 0, torch.zeros(4), 1, 0)).reason == "island"
    assert s.push(Push(0, 2, torch.zeros(4), 1, 0)).reason == "fragment"
    assert s.push(Push(0, 0, torch.zeros(4), 0, 0)).reason == "tokens"
    assert s.push(Push(0, 0, torch.zeros(4), 1, 5)).reason == "version"
    assert s.rejected_updates == 4 and s.version(0) == 0


def test_fragments_merge_independently() -> None:
    theta = torch.arange(8, dtype=torch.float32)
    index = [torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])]
    s = Syncer(theta, index, islands=1, outer_lr=1.0, outer_momentum=0.0)
    s.push(Push(0, 1, torch.full((4,), -1.0), 5, 0))
    expected = theta.clone()
    expected[index[1]] += 1
    torch.testing.assert_close(s.global_params(), expected)
    assert (s.version(0), s.version(1)) == (0, 1)
    assert s.merged_tokens == pytest.approx(2.5)  # half the model's parameters trained on 5 tokens


def test_state_dict_and_atomic_save_restore_every_committed_step(tmp_path: Path) -> None:
    theta = torch.randn(12, generator=_gen())
    kwargs = {"islands": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "quorum": 2}
    s = Syncer(theta, None, **kwargs)
    for v in range(3):
        s.push(Push(0, 0, 0.01 * torch.randn(12, generator=_gen(2 * v)), 10, v, round_s=1.0), now=float(v))
        s.push(Push(1, 0, 0.01 * torch.randn(12, generator=_gen(2 * v + 1)), 20, v, round_s=1.0), now=float(v))
        s.save(tmp_path / "syncer")
    s.push(Push(2, 0, 0.01 * torch.randn(12, generator=_gen(9)), 5, 3, round_s=1.0), now=3.0)  # buffered, not committed
    s.save(tmp_path / "syncer")
    restored = Syncer(theta, None, **kwargs)
    restored.load(tmp_path / "syncer")
    assert restored.version(0) == 3 and torch.equal(restored.global_params(), s.global_params())
    assert len(restored.buffers[0].pushes) == 1 and restored.stats() == s.stats()
    # both take the same next step: outer momentum, buffers and medians were restored
    for x in (s, restored):
        x.push(Push(1, 0, 0.01 * torch.ones(12), 10, 3), now=4.0)
    assert torch.equal(restored.global_params(), s.global_params())
    assert math.isinf(Syncer(theta, None, **kwargs).buffers[0].grace_s)


def test_fragments_as_views_or_as_positions_give_the_same_syncer() -> None:
    from atoll.algorithms.fragments import fragment_flat_indices, fragment_slices

    shapes = [("model.embed_tokens.weight", (8, 4)), *[(f"model.layers.{i}.w", (4, 4)) for i in range(4)],
              ("model.norm.weight", (4,))]
    theta = torch.randn(sum(math.prod(s) for _, s in shapes), generator=_gen())
    syncers = [Syncer(theta, index, islands=2, outer_lr=0.7, outer_momentum=0.9, quorum=2)
               for index in (fragment_flat_indices(shapes, 2), fragment_slices(shapes, 2))]
    for p in range(2):
        n = syncers[0].numels[p]
        assert n == syncers[1].numels[p]
        for i in range(2):
            delta = 0.01 * torch.randn(n, generator=_gen(10 * p + i))
            for s in syncers:
                s.push(Push(i, p, delta.clone(), 100, 0))
    assert torch.equal(syncers[0].global_params(), syncers[1].global_params())
    assert all(s.commits == 2 for s in syncers)


# --- the paper's merge settings (Decoupled DiLoCo, arXiv:2604.21428): average, push weight, grace window ---------
def test_radial_directional_merge_per_tensor_and_embeddings_by_the_mean() -> None:
    from atoll.algorithms.fragments import FlatFragment

    # one fragment: a layer's tensor (elements 0-1) and a block of the token embedding (elements 2-3)
    frag = FlatFragment(((0, 2), (2, 4)), ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"))
    s = Syncer(torch.zeros(4), [frag], islands=2, outer_lr=1.0, outer_momentum=0.0, quorum=2,
               staleness_exponent=0.0, average="radial_directional")
    s.push(Push(0, 0, torch.tensor([1.0, 0.0, 1.0, 1.0]), 10, 0))
    assert s.push(Push(1, 0, torch.tensor([0.0, 3.0, 3.0, -1.0]), 10, 0)).committed == 1
    # the tensor: norm 2 along (1, 1) / sqrt(2); the embedding: the plain mean (2, 0); stepped with lr 1
    torch.testing.assert_close(s.global_params(), -torch.tensor([math.sqrt(2.0), math.sqrt(2.0), 2.0, 0.0]))
    # an index without names (positions, or none) is one tensor, merged radial-directionally
    s = Syncer(torch.zeros(2), None, islands=2, outer_lr=1.0, outer_momentum=0.0, quorum=2,
               average="radial_directional")
    s.push(Push(0, 0, torch.tensor([1.0, 0.0]), 10, 0))
    s.push(Push(1, 0, torch.tensor([0.0, 3.0]), 10, 0))
    torch.testing.assert_close(s.global_params(), -torch.tensor([math.sqrt(2.0), math.sqrt(2.0)]))


def test_push_weight_tokens_times_tokens_per_step() -> None:
    deltas = [torch.full((3,), -1.0), torch.full((3,), -4.0)]

    def merged(**kw: Any) -> torch.Tensor:
        s = Syncer(torch.zeros(3), None, islands=2, outer_lr=1.0, outer_momentum=0.0, quorum=2,
                   staleness_exponent=0.0, **kw)
        for i, d in enumerate(deltas):
            s.push(Push(i, 0, d, 10, 0))
        return s.global_params()

    # island 1 trains half the tokens per inner step: it weighs 10 x 0.5 against island 0's 10 x 1
    torch.testing.assert_close(merged(push_weight="tokens_x_tokens_per_step", step_tokens=[2048, 1024]),
                               torch.full((3,), (10 * 1 + 5 * 4) / 15))
    torch.testing.assert_close(merged(push_weight="tokens", step_tokens=[2048, 1024]), torch.full((3,), 2.5))
    # every island of one batch (atoll's runs): the very same merge as token weights
    assert torch.equal(merged(push_weight="tokens_x_tokens_per_step", step_tokens=[512, 512]), merged())


def test_minimum_quorum_opens_the_grace_window() -> None:
    s = Syncer(torch.zeros(2), None, islands=3, quorum=3, min_quorum=2, grace_factor=1.0)
    s.push(Push(0, 0, torch.ones(2), 10, 0, round_s=4.0), now=1.0)
    assert s.next_deadline() == (math.inf, 0) and s.poll(1e9) == 0, "short of K: waits for islands, not the clock"
    s.push(Push(1, 0, torch.ones(2), 10, 0, round_s=4.0), now=2.0)
    assert s.next_deadline() == (6.0, 0), "the window opens at the K-th push: 1 x the median round (4 s)"
    assert s.poll(6.0) == 1 and list(s.quorum_sizes.recent) == [2]
    assert s.merge_waits.last == (4.0, 4.0) and s.merge_waits.count == 1
    # a quorum of 1 merges every push as it arrives: none waits
    s = Syncer(torch.zeros(2), None, islands=2, quorum=1)
    s.push(Push(0, 0, torch.ones(2), 10, 0, round_s=4.0), now=7.0)
    assert s.merge_waits.last == (0.0, 4.0) and s.merge_waits.summary()["merge_wait_max_s"] == 0.0


def test_slack_grace_window_waits_within_what_the_overlap_leaves() -> None:
    s = Syncer(torch.zeros(2), None, islands=3, quorum=3, grace_window="slack", grace_slack_fraction=0.5,
               grace_overlap=1.0, grace_factor=1.0)
    # the first round: no push-to-push gap seen yet, so the round window (1 x the median claim, 3 s)
    s.push(Push(0, 0, torch.ones(2), 10, 0, round_s=3.0), now=1.0)
    assert s.next_deadline() == (4.0, 0)
    s.push(Push(1, 0, torch.ones(2), 10, 0, round_s=3.0), now=1.0)
    assert s.push(Push(2, 0, torch.ones(2), 10, 0, round_s=3.0), now=2.0).committed == 1  # merged at 2.0
    assert s.per_island[0].last_wait[0] == 1.0 and s.per_island[2].last_wait[0] == 0.0
    # island 2 again 5 s later, claiming 4.5 s from its pull: its transfers took 5 - 4.5 - 0 (its wait) = 0.5 s
    s.push(Push(2, 0, torch.ones(2), 10, 1, round_s=4.5), now=7.0)
    assert list(s.push_gap_s) == [5.0] and list(s.sync_s) == [0.5]
    # slack = tau x t_step (one 5 s round) - (t_quorum 0 + t_sync 0.5) = 4.5; the window is half of it
    assert s.next_deadline() == (7.0 + 2.25, 0)
    # island 0 pushes 7 s after its last: the window of the next buffer grows with the median gap
    s.poll(9.25)
    s.push(Push(0, 0, torch.ones(2), 10, 1, round_s=5.0), now=8.0)
    assert list(s.push_gap_s) == [5.0, 7.0] and list(s.sync_s) == [0.5, 1.0]
    assert s.next_deadline() == (8.0 + 0.5 * (6.0 - 0.75), 0)
    # no slack left: the window is 0 and the buffer merges as soon as the clock is polled
    s = Syncer(torch.zeros(2), None, islands=2, quorum=2, grace_window="slack", grace_overlap=0.05)
    s.push(Push(0, 0, torch.ones(2), 10, 0, round_s=2.0), now=0.0)
    s.push(Push(1, 0, torch.ones(2), 10, 0, round_s=2.0), now=0.0)
    s.push(Push(0, 0, torch.ones(2), 10, 1, round_s=1.9), now=2.0)
    assert s.next_deadline() == (2.0, 0) and s.poll(2.0) == 1


def test_merge_settings_refused_in_one_line() -> None:
    theta = torch.zeros(2)
    with pytest.raises(ValueError, match="min_quorum 3 outside 1..2"):
        Syncer(theta, None, islands=4, quorum=2, min_quorum=3)
    with pytest.raises(ValueError, match="average: unknown 'geometric'"):
        Syncer(theta, None, islands=2, average="geometric")
    with pytest.raises(ValueError, match="grace_window: unknown"):
        Syncer(theta, None, islands=2, grace_window="soon")
    with pytest.raises(ValueError, match="use robust_merge none or clip"):
        Syncer(theta, None, islands=2, average="radial_directional", robust_merge="trimmed_mean")
    with pytest.raises(ValueError, match="step_tokens"):
        Syncer(theta, None, islands=2, step_tokens=[1])


def test_slack_measurements_and_window_survive_a_restart() -> None:
    kw: dict[str, Any] = dict(islands=3, quorum=3, grace_window="slack", outer_lr=1.0, outer_momentum=0.0)
    s = Syncer(torch.zeros(2), None, **kw)
    for i in range(3):
        s.push(Push(i, 0, torch.ones(2), 10, 0, round_s=3.0), now=1.0 + i)
    s.push(Push(0, 0, torch.ones(2), 10, 1, round_s=4.0), now=6.0)
    t = Syncer(torch.zeros(2), None, **kw)
    t.load_state_dict(s.state_dict())
    assert t.next_deadline() == s.next_deadline() and list(t.push_gap_s) == list(s.push_gap_s)
    assert list(t.sync_s) == list(s.sync_s) and t.per_island == s.per_island
    assert [p.arrived_at for p in t.buffers[0].pushes] == [6.0] and t.buffers[0].first_at == 6.0
    # a checkpoint written before these were kept loads with none measured
    old = s.state_dict()
    for key in ("push_gap_s", "sync_s", "last_wait"):
        del old[key]
    for b in old["buffers"]:
        del b["first_at"]
    t.load_state_dict(old)
    assert not t.push_gap_s and t.buffers[0].first_at == t.buffers[0].opened_at


def test_minimum_quorum_merges_the_pushes_in_when_the_window_closes() -> None:
    kw: dict[str, Any] = dict(islands=3, quorum=3, outer_lr=1.0, outer_momentum=0.0, staleness_exponent=0.0,
                              grace_window="slack", grace_factor=1.0)
    d0, d1 = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0])
    # K = 1: the first push opens the window (the round window until a push-to-push gap is seen: 1 x 2 s)
    s = Syncer(torch.zeros(2), None, min_quorum=1, **kw)
    s.push(Push(0, 0, d0, 10, 0, round_s=2.0), now=0.0)
    assert s.next_deadline() == (2.0, 0) and s.poll(1.9) == 0
    assert s.poll(2.0) == 1 and list(s.quorum_sizes.recent) == [1]
    # one island of 3 merged alone: its delta scaled by 1/3 (scale_partial), stepped with lr 1
    torch.testing.assert_close(s.global_params(), -d0 / 3)
    # K = 1, a second island in before the window closes: both merged, token-weighted (equal tokens: the mean)
    s = Syncer(torch.zeros(2), None, min_quorum=1, **kw)
    s.push(Push(0, 0, d0, 10, 0, round_s=2.0), now=0.0)
    s.push(Push(1, 0, d1, 10, 0, round_s=2.0), now=1.0)
    assert s.next_deadline() == (2.0, 0), "the window runs from the K-th (first) push, not the latest"
    assert s.poll(2.0) == 1 and list(s.quorum_sizes.recent) == [2]
    torch.testing.assert_close(s.global_params(), -(d0 + d1) / 2 * (2 / 3))
    # K = 2: one push waits for a second island however long; the second opens the window, whose close merges 2
    s = Syncer(torch.zeros(2), None, min_quorum=2, **kw)
    s.push(Push(0, 0, d0, 10, 0, round_s=2.0), now=0.0)
    assert s.poll(1e6) == 0 and s.next_deadline() == (math.inf, 0)
    s.push(Push(1, 0, d1, 10, 0, round_s=2.0), now=5.0)
    assert s.next_deadline() == (7.0, 0) and s.poll(7.0) == 1 and list(s.quorum_sizes.recent) == [2]


def test_the_runs_syncer_takes_the_merge_settings_and_their_defaults() -> None:
    from atoll.algorithms.fragments import FlatFragment
    from atoll.config import build_config
    from atoll.runtime.decoupled_job import syncer_of

    index = [FlatFragment(((0, 4),), ("model.layers.0.mlp.up_proj.weight",))]
    config = build_config(overrides={"strategy": "decoupled", "islands": 2, "sync_every": 10})
    s = syncer_of(config, torch.zeros(4), index)
    # the measured defaults (bench/out/decoupled_merge/results.md): K = 1 in a window of the overlap's slack
    r = s.rules
    assert (r.min_quorum, r.quorum, r.grace_window, r.grace_slack_fraction, r.grace_overlap) == (1, 2, "slack",
                                                                                               0.5, 1.0)
    assert (r.push_weight, r.average) == ("tokens", "radial_directional")
    config = build_config(overrides={"strategy": "decoupled", "islands": 2, "sync_every": 10, "min_quorum": 2,
                                     "grace_window": "round", "grace_overlap_steps": 5,
                                     "push_weight": "tokens_x_tokens_per_step"})
    s = syncer_of(config, torch.zeros(4), index)
    r = s.rules
    assert (r.min_quorum, r.grace_window, r.grace_overlap) == (2, "round", 0.5)
    assert r.push_weight == "tokens_x_tokens_per_step"
