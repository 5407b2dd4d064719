"""What a syncer keeps per merge stays bounded however long it runs, and its summary is exact."""

from __future__ import annotations

import json
import random

import torch

from atoll.strategies.decoupled.protocol import Push
from atoll.strategies.decoupled.syncer import Syncer
from atoll.strategies.decoupled.tallies import RECENT_WINDOW, MergeWaits, Tally


def test_a_tally_gives_the_statistics_of_the_whole_list_it_replaces() -> None:
    rng = random.Random(0)
    values = [rng.randrange(0, 7) for _ in range(5000)]
    tally = Tally()
    tally.extend(values)
    assert len(tally) == len(values) and tally.mean() == sum(values) / len(values)
    assert tally.least() == min(values) and tally.greatest() == max(values)
    assert tally.histogram() == {str(k): values.count(k) for k in sorted(set(values))}
    assert list(tally.recent) == values[-RECENT_WINDOW:]
    again = Tally.from_state(json.loads(json.dumps(tally.state_dict())))
    assert again.histogram() == tally.histogram() and list(again.recent) == list(tally.recent)
    assert Tally.from_state(values[:10]).histogram() == Tally.from_state(Tally.from_state(values[:10]).state_dict()
                                                                         ).histogram()  # an older checkpoint's list


def test_merge_waits_summarise_as_the_list_did() -> None:
    waits = [(1.5, 2.0), (3.0, -1.0), (0.25, 0.5), (4.0, 2.0)]
    m = MergeWaits()
    for w, g in waits:
        m.add(w, g)
    assert m.summary() == {"merge_wait_max_s": 4.0, "merge_wait_mean_s": sum(w for w, _ in waits) / 4,
                           "grace_window_max_s": 2.0, "merge_overrun_max_s": 2.0}
    assert MergeWaits.from_state([list(w) for w in waits]).summary() == m.summary()
    assert MergeWaits.from_state(json.loads(json.dumps(m.state_dict()))).summary() == m.summary()
    assert MergeWaits().summary() == {"merge_wait_max_s": 0.0, "merge_wait_mean_s": 0.0, "grace_window_max_s": 0.0,
                                      "merge_overrun_max_s": 0.0}


def test_the_syncer_state_does_not_grow_with_its_merges() -> None:
    """A long run's checkpoint: the per-merge figures (quorum sizes, staleness, waits) are counts, not lists."""
    def state_size(merges: int) -> int:
        s = Syncer(torch.zeros(4), None, islands=2, quorum=1, max_staleness=4)
        for k in range(merges):
            assert s.push(Push(k % 2, 0, torch.full((4,), 0.01), 10, s.version(0)), now=float(k)).accepted
        assert s.commits == merges
        state = s.state_dict()
        return len(json.dumps({k: state[k] for k in ("quorum_sizes", "staleness", "merge_waits")}))

    assert state_size(1000) <= state_size(RECENT_WINDOW + 10) + 64
