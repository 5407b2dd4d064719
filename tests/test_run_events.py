"""Run events and progress: failures, rejoins, resets, refusals, pushes and merges in metrics.jsonl and the
trackers; a decoupled run's progress line from its first steps and its timeline plot; tokens per second and
peak accelerator memory in every train event."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from atoll.config import build_config
from atoll.job import device
from atoll.job.metrics import ProgressDisplay, read_metrics
from atoll.job.timeline import read_timeline
from atoll.job.trackers import scalars
from atoll.strategies.decoupled.journal import Merged, Refused
from atoll.strategies.decoupled.progress import progress_detail, syncer_events
from atoll.strategies.decoupled.protocol import Push
from atoll.strategies.decoupled.syncer import Syncer
from atoll.training import train


def _decoupled(fast_config: dict, **over) -> dict:
    return {**fast_config, "strategy": "decoupled", "fragments": 2, "sync_every": 4, "steps": 40, "islands": 3,
            "eval_every": 20, **over}


def _events(out, kind: str) -> list[dict]:
    return [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == kind]


@pytest.mark.slow
def test_a_decoupled_run_logs_its_failures_rejoins_pushes_and_merges_and_draws_its_timeline(fast_config) -> None:
    config = build_config(overrides=_decoupled(fast_config, chaos="2:0.5"))
    summary = train(config)
    out = config.out
    failures, rejoins = _events(out, "failure"), _events(out, "rejoin")
    assert failures, "the failure trace made islands fail"
    assert len(failures) == sum(summary["failures"]) and len(rejoins) == sum(summary["rejoins"])
    for i in range(3):  # every failure and rejoin names its island, in the order the summary counts them
        assert sum(e["island"] == i for e in failures) == summary["failures"][i]
        assert sum(e["island"] == i for e in rejoins) == summary["rejoins"][i]
    assert [e["count"] for e in failures] == list(range(1, len(failures) + 1))
    assert all(r["rejoin_s"] > 0 for r in rejoins)
    merges, pushes = _events(out, "merge"), _events(out, "push")
    assert len(merges) == summary["commits"]  # one merge event per outer step the syncer committed
    assert sum(p["outcome"] == "accepted" for p in pushes) == summary["accepted_updates"]
    assert sum(p["outcome"] == "stale" for p in pushes) == summary["stale_updates"]
    # every merge names a fragment's new version, in order per fragment, and islands that pushed it
    for f in range(2):
        versions = [m["version"] for m in merges if m["fragment"] == f]
        assert versions == list(range(1, len(versions) + 1))
    assert all(set(m["islands"]) <= {0, 1, 2} and m["islands"] for m in merges)
    assert all(e["sim_wall_s"] > 0 for e in pushes + merges + failures + rejoins)
    # the timeline read back: an outage per failure, each island's steps climbing to what it trained
    tl = read_timeline(read_metrics(out / "metrics.jsonl"))
    assert [len(o) for o in tl.outages] == summary["failures"]
    assert all(up is None or up > down for o in tl.outages for down, up in o)
    assert [max(n for _, n in s) for s in tl.steps] == summary["steps_per_island"]
    assert len(tl.merges) == summary["commits"]
    assert (out / "timeline.png").stat().st_size > 10_000
    # pace and memory in every train event: tokens per second of the interval; no accelerator here
    trains = _events(out, "train")
    assert trains and all(t["tokens_per_s"] > 0 and t["peak_accelerator_bytes"] is None for t in trains)
    assert all(len(t["island_steps"]) == 3 for t in trains)


@pytest.mark.slow
def test_run_event_counts_go_on_across_a_resume(fast_config) -> None:
    first = build_config(overrides=_decoupled(fast_config, steps=20, checkpoint_every=10))
    train(first)
    again = build_config(overrides=_decoupled(fast_config, steps=40, checkpoint_every=10))
    train(again, resume=True)
    pushes = _events(first.out, "push")
    assert pushes and [p["count"] for p in pushes] == list(range(1, len(pushes) + 1))  # none twice, none skipped
    steps = [p["step"] for p in pushes]
    assert steps == sorted(steps) and steps[-1] >= 20


@pytest.mark.slow
def test_a_decoupled_run_shows_its_progress_from_the_first_steps(fast_config, capsys) -> None:
    summary = train(build_config(overrides=_decoupled(fast_config, progress=True, progress_every=4)))
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("atoll: step ")]
    # the last line comes after the end's merges: its goodput and merges are the summary's (a line before
    # them once said 87% beside a summary of 96.6%)
    assert lines[-1].startswith("atoll: step 40/40") and "| eval " in lines[-1], lines[-1]
    assert f"| goodput {summary['goodput']:.0%} |" in lines[-1] and f"| merges {summary['commits']} |" in lines[-1]
    assert lines[0].startswith("atoll: step 4/40"), lines[:3]  # the first line at the first multiple
    assert all("| steps " in x and "| merges " in x and "staleness" in x and "goodput" in x for x in lines)
    assert len({x.split(" | ")[0] for x in lines}) == len(lines), "never two lines for one step"
    merges = [int(x.split("| merges ")[1].split(" ")[0]) for x in lines]
    assert merges == sorted(merges) and merges[-1] > 0


def test_the_syncer_journals_its_merges_and_refusals_for_the_run_events() -> None:
    syncer = Syncer(torch.zeros(4), None, islands=2, outer_lr=1.0, outer_momentum=0.0, quorum=2)
    ok = Push(0, 0, torch.ones(4), 10, 0, 16)
    syncer.push(ok, now=1.0)
    syncer.push(Push(1, 0, torch.full((4,), float("nan")), 10, 0, 16), now=1.5)  # not finite: refused
    syncer.push(Push(1, 0, torch.ones(4), 10, 0, 16), now=2.0)  # completes the quorum
    records = syncer.journal.drain()
    assert records == [Refused(1, 0, "non_finite", 1.5), Merged(0, 1, (0, 1), 2.0)]
    assert syncer.journal.drain() == []  # drained
    assert syncer_events(records) == [
        ("refusal", {"island": 1, "fragment": 0, "reason": "non_finite", "sim_wall_s": 1.5}),
        ("merge", {"fragment": 0, "version": 1, "islands": [0, 1], "sim_wall_s": 2.0})]
    syncer.push("not a push", now=3.0)  # names no island: the refusal names none either
    assert syncer.journal.drain() == [Refused(None, None, "type", 3.0)]


def test_the_progress_detail_of_a_decoupled_run() -> None:
    assert progress_detail([40, 40, 20], 12, [0, 1, 0, 1], 0.834) == \
        "steps 40/40/20 | merges 12 | staleness 0.50 | goodput 83%"
    assert progress_detail([3, 1], 0, [], None, down=[1]) == "steps 3/1 | merges 0 | staleness - | goodput - | down 1"


def test_plain_progress_lines_once_per_multiple_even_when_steps_are_sampled() -> None:
    buf = io.StringIO()
    bar = ProgressDisplay(20, 0, True, console=Console(file=buf, force_terminal=False), every=5)
    for step in (3, 7, 8, 12, 12, 20, 20):  # a driver that looks now and then (Ray) sees these
        bar.update(step, 1.0, 100.0, 0.0, detail="steps 1/2")
    steps = [line.split()[2] for line in buf.getvalue().splitlines()]
    assert steps == ["7/20", "12/20", "20/20"]
    assert all(line.endswith("eta 0:00:00") or "| steps 1/2 |" in line for line in buf.getvalue().splitlines())


def test_trackers_receive_the_run_events_and_the_pace() -> None:
    assert scalars({"event": "failure", "step": 7, "count": 3, "island": 1}) == {"events/failures": 3.0}
    assert scalars({"event": "refusal", "step": 7, "count": 1, "reason": "norm"}) == {"events/refusals": 1.0}
    assert scalars({"event": "push", "step": 7, "count": 9}) == {}  # too many to plot: metrics.jsonl only
    values = scalars({"event": "train", "step": 10, "loss": 2.0, "tokens": 100, "tokens_per_s": 250.0,
                      "peak_accelerator_bytes": None})
    assert values["perf/tokens_per_s"] == 250.0 and "perf/peak_accelerator_bytes" not in values


def test_peak_accelerator_memory_is_the_largest_device_peak_of_the_interval(monkeypatch) -> None:
    peaks, resets = {0: 5_000, 1: 7_000}, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks[d])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    assert device.peak_accelerator_bytes() == 7_000 and resets == [0, 1]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no CUDA context: none asked, none made
    assert device.peak_accelerator_bytes() is None


@pytest.mark.slow
def test_a_lockstep_run_logs_its_pace(fast_config) -> None:
    config = build_config(overrides={**fast_config, "strategy": "diloco", "steps": 20})
    train(config)
    trains = _events(config.out, "train")
    assert [t["step"] for t in trains] == [10, 20]
    for t in trains:  # tokens of every island in the interval over its seconds: 10 steps x 2 islands x 4 x 32
        assert t["tokens_per_s"] > 0 and "peak_accelerator_bytes" in t
    assert json.loads((config.out / "summary.json").read_text())["tokens"] == trains[-1]["tokens"]
