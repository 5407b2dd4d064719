"""The decoupled syncer sharded by fragment, its pure parts: the fragment -> shard map, the coordinator's signed
grants and a shard's check of a push's grant and session, one run's statistics from its shards'."""

from __future__ import annotations

import pytest
import torch

from atoll.algorithms.fragments import FlatFragment
from atoll.runtime.service.syncer_shards import (
    Grant,
    GrantBook,
    combine_stats,
    fingerprint,
    owned,
    peer_token,
    shard_map,
    shard_vector,
)

KEY, RUN = b"k" * 32, "run0"


def test_the_map_gives_the_largest_fragment_first_to_the_least_loaded_shard() -> None:
    # by hand: 30 (fragment 1) -> shard 0; 20 (2) -> 1; 20 (3) -> 1 (20 < 30); 10 (0) -> 0 (30 < 40)
    assert shard_map([10, 30, 20, 20], 2) == [0, 0, 1, 1]
    assert shard_map([10, 30, 20, 20], 1) == [0, 0, 0, 0]
    assert shard_map([5, 5, 5, 5], 4) == [0, 1, 2, 3]  # ties: the lower fragment, the lower shard
    numels = [1000 + 37 * (p % 5) for p in range(24)]  # the paper's P = 24, of near sizes
    owners = shard_map(numels, 4)
    assert owners == shard_map(list(numels), 4)  # the same on every process
    load = [sum(n for n, s in zip(numels, owners, strict=True) if s == k) for k in range(4)]
    assert max(load) - min(load) <= max(numels) and sorted(set(owners)) == [0, 1, 2, 3]
    assert owned(owners, 2) == [p for p in range(24) if owners[p] == 2]


def test_the_map_refuses_more_shards_than_fragments_in_one_line() -> None:
    for shards in (0, 3, True):
        with pytest.raises(ValueError, match="^shards: .* at most as many --shards addresses as --fragments"):
            shard_map([1, 2], shards)


def test_the_fingerprint_names_the_fragments_and_the_map() -> None:
    assert fingerprint([3, 4], [0, 1]) == fingerprint([3, 4], [0, 1])
    assert len({fingerprint([3, 4], [0, 1]), fingerprint([3, 4], [1, 0]), fingerprint([3, 5], [0, 1])}) == 3
    assert peer_token(KEY) != peer_token(b"j" * 32) and KEY.decode() not in peer_token(KEY)


def test_a_shard_holds_its_fragments_one_after_the_other() -> None:
    flat = torch.arange(10, dtype=torch.float32)
    frags = [FlatFragment(((6, 8),)), FlatFragment(((0, 2), (4, 5)))]
    values, index = shard_vector(flat, frags)
    assert values.tolist() == [6.0, 7.0, 0.0, 1.0, 4.0]
    assert [f.ranges for f in index] == [((0, 2),), ((2, 5),)]
    # named ranges keep their parameters' names: the shard's syncer merges per tensor as one syncer does
    named = [FlatFragment(((6, 8),), ("c",)), FlatFragment(((0, 2), (4, 5)), ("a", "b.embed_tokens"))]
    _, index = shard_vector(flat, named)
    assert [f.tensor_segments() for f in index] == [[(0, 2, "c")], [(0, 2, "a"), (2, 3, "b.embed_tokens")]]


def test_a_grant_verifies_only_unaltered_under_the_run_key() -> None:
    signed = Grant(1, 2, 640, 1, 5, RUN).signed(KEY)
    assert Grant.verified(signed, KEY, RUN) == Grant(1, 2, 640, 1, 5, RUN)
    assert Grant.verified({**signed, "tokens": 10**6}, KEY, RUN) is None  # more tokens: the MAC fails
    assert Grant.verified(signed, b"j" * 32, RUN) is None                 # another key (another run's shards)
    assert Grant.verified(signed, KEY, "run1") is None                    # another run, the same key
    assert Grant.verified({**signed, "session": True}, KEY, RUN) is None  # a bool is no count
    assert Grant.verified({**signed, "extra": 1}, KEY, RUN) is None
    assert Grant.verified("grant", KEY, RUN) is None


def test_a_shard_refuses_a_forged_another_islands_or_an_old_sessions_grant() -> None:
    book = GrantBook(2, KEY, RUN)
    g = Grant(0, 1, 640, 1, 1, RUN)
    assert book.check(0, None, 1) == ("grant", None)                                   # none
    assert book.check(0, {**g.signed(KEY), "tokens": 9999}, 1) == ("grant", None)      # altered
    assert book.check(0, g.signed(b"j" * 32), 1) == ("grant", None)                    # forged (no key)
    assert book.check(1, g.signed(KEY), 1) == ("grant", None)                          # island 0's, by island 1
    assert book.check(0, g.signed(KEY), 2) == ("session", None)   # a session the coordinator did not sign
    assert book.check(0, g.signed(KEY), "1") == ("session", None)
    reason, grant = book.check(0, g.signed(KEY), 1)
    assert reason == "" and grant == g
    assert book.record(grant) == 640 and book.tokens == [640, 0]
    # pushes in flight carry older grants of the same session: taken, but change nothing
    assert book.record(Grant(0, 1, 1280, 1, 3, RUN)) == 1280
    assert book.check(0, g.signed(KEY), 1)[0] == "" and book.record(g) is None and book.tokens[0] == 1280
    # the island rejoined (session 2): its grants of session 1 are replays now, and so are its session-1 pushes
    new = Grant(0, 2, 1280, 1, 4, RUN)
    assert book.record(book.check(0, new.signed(KEY), 2)[1]) is None and book.session == [2, 0]
    assert book.check(0, g.signed(KEY), 1) == ("replay", None)
    assert book.check(0, new.signed(KEY), 1) == ("replay", None)  # an old session's push with a new grant
    # a restarted coordinator (epoch 2) counts its grants anew: newer than any of epoch 1
    assert book.record(Grant(0, 2, 1920, 2, 1, RUN)) == 1920
    restored = GrantBook(2, KEY, RUN)
    restored.load_state_dict(book.state_dict())
    assert (restored.session, restored.newest, restored.tokens) == (book.session, book.newest, book.tokens)


def test_statistics_of_shards_add_up_to_the_runs() -> None:
    a = {"commits": 3, "rejected_by_reason": {"norm": 1}, "rejected_by_island": {"norm": [1, 0]},
         "quorum": 2, "robust_merge": "none", "quorum_size_counts": {"2": 3}, "quorum_size_mean": 2.0,
         "quorum_size_min": 2, "quorum_size_max": 2, "staleness_counts": {"0": 4, "1": 2}, "staleness_mean": 1 / 3,
         "staleness_max": 1, "merge_wait_max_s": 0.5, "merge_s": 0.25,
         "merged_tokens_by_island": [100.0, 60.0]}
    b = {"commits": 1, "rejected_by_reason": {"replay": 2}, "rejected_by_island": {"norm": [0, 3], "replay": [2, 0]},
         "quorum": 2, "robust_merge": "none", "quorum_size_counts": {"1": 1}, "quorum_size_mean": 1.0,
         "quorum_size_min": 1, "quorum_size_max": 1, "staleness_counts": {"2": 1}, "staleness_mean": 2.0,
         "staleness_max": 2, "merge_wait_max_s": 1.5, "merge_s": 0.5,
         "merged_tokens_by_island": [40.0, 40.0]}
    out = combine_stats([(a, 0.75), (b, 0.25)])
    assert out["commits"] == 4 and out["quorum"] == 2 and out["robust_merge"] == "none"
    assert out["rejected_by_reason"] == {"norm": 1, "replay": 2}
    assert out["rejected_by_island"] == {"norm": [1, 3], "replay": [2, 0]}
    assert out["quorum_size_counts"] == {"1": 1, "2": 3} and out["quorum_size_mean"] == 7 / 4
    assert (out["quorum_size_min"], out["quorum_size_max"]) == (1, 2)
    assert out["staleness_mean"] == 4 / 7 and out["staleness_max"] == 2
    assert out["merge_wait_max_s"] == 1.5 and out["merge_s"] == 0.75
    # each shard's tokens are per its own parameters: times its share, they are the model's
    assert out["merged_tokens_by_island"] == [85.0, 55.0]
