"""realign_pushes: an island whose pushes drifted out of phase is put back in step (decoupled)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from atoll.config import build_config
from atoll.strategies.decoupled import DecoupledConfig
from atoll.strategies.decoupled.journal import Merged
from atoll.strategies.decoupled.protocol import Pull
from atoll.strategies.decoupled.syncer import Syncer

H = 8       # each island's H (one fragment: pushed every H inner steps)
SHIFT = 4   # island 1 starts half a round after island 0
TICKS = 44  # one inner step per tick for each island, one second each


def _merges(fast_config: dict, realign: bool) -> list[tuple[int, list[int]]]:
    """Two islands of one fragment, one step per second each, island 1 started SHIFT seconds late; the syncer
    merges at a quorum of both or when a 0.1-round grace window closes; answers arrive at once. Returns each
    merge's (time, islands)."""
    from atoll.runtime.decoupled_job import prepare_job
    from atoll.strategies.decoupled.island import IslandWorker

    overrides = {**fast_config, "strategy": "decoupled", "islands": 2, "fragments": 1, "sync_every": H,
                 "steps": TICKS, "codec": "fp32", "realign_pushes": realign}
    job = prepare_job(build_config(overrides=overrides))
    workers = [IslandWorker(i, job, total_steps=TICKS) for i in range(2)]
    syncer = Syncer(job.init_flat, job.index, 2, quorum=2, grace_window="round", grace_factor=0.1,
                    realign=realign)
    waiting: set[int] = set()
    merges: list[tuple[int, list[int]]] = []

    def answer() -> None:  # every island whose push left the buffer (merged) takes the merged fragment
        for r in syncer.journal.drain():
            if isinstance(r, Merged):
                merges.append((int(r.at), sorted(r.islands)))
        for i in sorted(waiting - {p.island for p in syncer.buffers[0].pushes}):
            pull = syncer.pull(0)
            workers[i].adopt(Pull(0, pull.params, pull.version, syncer.take_behind(i, 0)))
            waiting.discard(i)

    for t in range(1, TICKS + 1):
        syncer.poll(t)
        answer()
        for i, w in enumerate(workers):
            if i == 1 and t <= SHIFT:
                continue
            w.train_step()
            if w.due():
                assert i not in waiting  # one push per merge: its previous push was answered
                syncer.push(replace(w.push(0), round_s=float(H)), now=t)
                waiting.add(i)
                answer()
    return merges


def test_a_shifted_island_is_back_in_phase_after_one_round_and_stays_shifted_without_the_rule(
        fast_config: dict) -> None:
    off = _merges(fast_config, realign=False)
    # island 0 pushes at 8, 16, ..., island 1 half a round later at 12, 20, ...: never in one merge
    assert off and all(len(held) == 1 for _, held in off)
    assert [t for t, held in off if held == [1]][:3] == [13, 21, 29]  # each merged alone a grace window later
    on = _merges(fast_config, realign=True)
    # the same until island 1's second merge (at 21: 0.5 of a round behind island 0's at 16, measured against
    # the push-to-push time, 8 s, both rounds seen): island 1 skips 4 steps, so its next push joins island 0's
    # at 24, and every merge from then on holds both, at the quorum (no grace window)
    assert on[:4] == off[:4]
    together = [t for t, held in on if held == [0, 1]]
    assert together and together[0] == 24
    assert all(held == [0, 1] for t, held in on if t >= 24)
    assert [t for t, _ in on if t >= 24] == [24, 32, 40]


def test_the_setting_is_validated_and_on_by_default() -> None:
    assert DecoupledConfig().realign_pushes is True  # on by default: measured best (bench/out/service_soak)
    assert DecoupledConfig(realign_pushes=False).realign_pushes is False
    with pytest.raises(ValidationError):
        DecoupledConfig(realign_pushes="sometimes")


def test_realign_share_rules() -> None:
    s = Syncer(torch.zeros(4), None, 4, realign=True)
    s.push_gap_s.extend([10.0, 10.0, 10.0])
    larger = (100.0, frozenset({0, 1, 2}))
    assert s.realign_share(larger, frozenset({3}), 3, 103.0) == pytest.approx(0.3)  # behind a larger merge
    assert s.realign_share(larger, frozenset({2, 3}), 2, 103.0) == 0.0  # it was in that merge itself
    assert s.realign_share(larger, frozenset({3}), 3, 111.0) == 0.0    # more than a round after it
    assert s.realign_share((100.0, frozenset({3})), frozenset({0, 1, 2}), 0, 103.0) == 0.0  # a smaller one
    # two equal groups: only the one without the lowest island index moves
    assert s.realign_share((100.0, frozenset({0, 1})), frozenset({2, 3}), 2, 105.0) == pytest.approx(0.5)
    assert s.realign_share((100.0, frozenset({2, 3})), frozenset({0, 1}), 0, 105.0) == 0.0
    s.behind[3][0] = 0.3
    assert s.take_behind(3, 0) == pytest.approx(0.3) and s.take_behind(3, 0) == 0.0  # said once
    s.behind[3][0] = 0.4
    s.rejoin(3)  # a new session starts its rounds at its join: the old session's share is not said to it
    assert s.take_behind(3, 0) == 0.0


def test_the_setting_is_reported_with_participation(fast_config: dict, tmp_path: Path) -> None:
    from atoll.training import train

    overrides = {**fast_config, "strategy": "decoupled", "islands": 3, "fragments": 2, "sync_every": 4,
                 "steps": 16, "eval_every": 8, "checkpoint_every": 8, "codec": "fp32", "realign_pushes": True,
                 "island_speeds": [1.0, 1.0, 0.5], "out": str(tmp_path / "r")}
    summary = train(build_config(overrides=overrides))
    assert summary["realign_pushes"] is True
    assert json.loads((tmp_path / "r" / "config.json").read_text())["realign_pushes"] is True
    merges = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    merges = [e for e in merges if e.get("event") == "merge"]
    # no failures: every island is alive at every merge, so participation is the mean share of the 3 islands
    assert summary["commits"] == len(merges) > 0
    assert summary["participation"] == pytest.approx(sum(len(e["islands"]) / 3 for e in merges) / len(merges))
    assert summary["merges_all_live"] == sum(len(e["islands"]) == 3 for e in merges)
