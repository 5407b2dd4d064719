"""Decoupled DiLoCo in the local runtime: failure traces, island speeds, rejoining, determinism, bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli, train_crashed_and_resumed

from atoll.algorithms.codecs import make_codec
from atoll.analysis.chaos import FailureTrace, synchronous_under_failures
from atoll.config import build_config
from atoll.errors import ConfigError
from atoll.strategies.decoupled import DecoupledConfig
from atoll.training import train


def _decoupled(fast_config: dict, **extra: object) -> dict:
    return {**fast_config, "strategy": "decoupled", "islands": 4, "fragments": 2, "sync_every": 4,
            "steps": 16, "eval_every": 8, "checkpoint_every": 8, "codec": "fp32", **extra}


def test_seeded_chaos_trace_is_deterministic() -> None:
    a, b = FailureTrace(3, 9.0, 1.0, seed=7), FailureTrace(3, 9.0, 1.0, seed=7)
    # generated lazily in a different order, the outages are the same
    a.next_outage(2, 500.0)
    b.next_outage(0, 100.0)
    assert [a.until(i, 400.0) for i in range(3)] == [b.until(i, 400.0) for i in range(3)]
    assert a.until(0, 400.0) != a.until(1, 400.0), "each island has its own trace"
    assert FailureTrace(3, 9.0, 1.0, seed=8).until(0, 400.0) != a.until(0, 400.0)
    # exponential up-times of mean 9 s and 1 s outages: down about 10% of the time
    horizon = 20000.0
    down = sum(min(u, horizon) - d for d, u in a.until(0, horizon))
    assert down / horizon == pytest.approx(a.down_fraction, abs=0.02)
    assert all(u - d == 1.0 for d, u in a.until(0, horizon))
    assert FailureTrace.from_spec("9:1", 3, 7).until(1, 50.0) == a.until(1, 50.0)


def test_synchronous_accounting_under_the_same_trace() -> None:
    free = synchronous_under_failures(None, steps=100, sync_every=10, step_s=[0.1, 0.1], sync_s=0.5,
                                      tokens_per_step=128)
    assert free["wall_s"] == pytest.approx(100 * 0.1 + 10 * 0.5)
    assert free["goodput"] == pytest.approx(10 / 15)
    slow = synchronous_under_failures(None, steps=100, sync_every=10, step_s=[0.1, 0.4], sync_s=0.0,
                                      tokens_per_step=128)
    assert slow["island_utilization"] == pytest.approx([0.25, 1.0]), "the fast island waits for the slow one"
    trace = FailureTrace(2, 9.0, 1.0, seed=0)
    hit = synchronous_under_failures(trace, steps=100, sync_every=10, step_s=[0.1, 0.1], sync_s=0.5,
                                     tokens_per_step=128)
    assert hit["wall_s"] > free["wall_s"] and hit["goodput"] < free["goodput"]
    assert hit["stopped_s"] > 0 and hit["redone_s"] > 0 and not hit["gave_up"]
    # failures far more frequent than a round: the job gives up at 100x the failure-free time (3 s), not hangs
    hopeless = synchronous_under_failures(FailureTrace(8, 0.5, 0.1, seed=0), steps=20, sync_every=10,
                                          step_s=[0.1] * 8, sync_s=0.5, tokens_per_step=128)
    assert hopeless["gave_up"] and hopeless["wall_s"] >= 100 * 3 and hopeless["goodput"] < 0.05


@pytest.mark.slow
def test_decoupled_run_with_chaos_finishes_and_every_island_rejoins(fast_config: dict) -> None:
    summary = train(build_config(overrides=_decoupled(fast_config, chaos="0.6:0.2", sim_step_s=0.1)))
    saved = json.loads((Path(fast_config["out"]) / "summary.json").read_text())
    assert saved["final_eval_loss"] == summary["final_eval_loss"] < saved["initial_eval_loss"]
    failures, rejoins = saved["failures"], saved["rejoins"]
    assert sum(f > 0 for f in failures) >= 3, failures
    for i in range(4):  # every failure rejoins, but one that the end of the run cuts short
        assert rejoins[i] == failures[i] - (i in saved["down_at_end"]), (i, failures, rejoins)
    assert len(saved["rejoin_s"]) == sum(rejoins)
    assert all(0.0 < r <= 0.2 + 0.05 for r in saved["rejoin_s"])  # the outage, then one pull of the model
    assert saved["commits"] > 0 and saved["lost_tokens"] > 0
    # a merge waits for its quorum at most its grace window (the event loop closes windows on time)
    assert saved["merge_wait_max_s"] > 0 and saved["merge_overrun_max_s"] <= 1e-9
    assert 0 < saved["goodput"] < 1 and saved["useful_tokens"] < saved["tokens"]
    assert len(saved["island_utilization"]) == 4 and all(0 < u <= 1 for u in saved["island_utilization"])
    assert sum(saved["steps_per_island"]) == 4 * 16 and saved["tokens"] == 4 * 16 * 4 * 32
    for key in ("rejected_updates", "stale_updates", "quorum_size_mean", "staleness_mean", "staleness_max"):
        assert key in saved, key
    assert (Path(fast_config["out"]) / "syncer" / "checkpoints" / "latest" / "state.json").is_file()


@pytest.mark.slow
def test_decoupled_is_deterministic_for_a_seed(fast_config: dict, tmp_path: Path) -> None:
    runs = [train(build_config(overrides=_decoupled(fast_config, chaos="0.6:0.2", out=str(tmp_path / f"r{k}"))))
            for k in range(2)]
    for key in ("final_eval_loss", "steps_per_island", "failures", "commits", "quorum_size_counts",
                "staleness_counts", "sim_wall_s", "goodput", "bytes_sent_by_island"):
        assert runs[0][key] == runs[1][key], key


@pytest.mark.slow
def test_island_speeds_scale_step_counts(fast_config: dict) -> None:
    summary = train(build_config(overrides=_decoupled(fast_config, island_speeds="1,1,0.5,0.25", steps=22,
                                                      sync_every=8)))
    steps = summary["steps_per_island"]
    assert sum(steps) == 4 * 22
    # shares 1 : 1 : 0.5 : 0.25 of 88 steps: 32, 32, 16, 8 (pushes cost a little time, equal per island)
    for got, want in zip(steps, [32, 32, 16, 8], strict=True):
        assert abs(got - want) <= 1, steps
    # local steps proportional to speed (H = 8 scaled, at least the 2 fragments): every island pushes each
    # fragment at the same wall-clock cadence, so the slow ones' pushes are not staler than the fast ones'
    from atoll.runtime.decoupled_job import push_sync_every

    assert push_sync_every(build_config(overrides=_decoupled(fast_config, island_speeds="1,1,0.5,0.25",
                                                             sync_every=8))) == [8, 8, 4, 2]
    assert summary["stale_updates"] == 0
    # nobody waits, neither for the slow islands nor for the link (transfers overlap compute): every island
    # computes all the time but the last push's flight at the end
    util = summary["island_utilization"]
    assert min(util) > 0.9, util


@pytest.mark.parametrize(("flags", "message"), [
    (["--island-speeds", "1,1"], "island_speeds: 2 values for 4 islands"),
    (["--island-speeds", "1,1,1,1.5"], "island_speeds: 1.5 is outside (0, 1]"),
    (["--island-speeds", "1,x,1,1"], "island_speeds: '1,x,1,1' is not a comma-separated list"),
    (["--island-speeds", "1,,1,1"], "island_speeds: '1,,1,1' is not a comma-separated list"),
    (["--runtime", "ray", "--chaos", "9:1"], "chaos: simulated in the local runtime only"),
    (["--runtime", "ray", "--ray-address", "127.0.0.1:1"], "ray_address: no Ray cluster answers at 127.0.0.1:1"),
    (["--chaos", "10"], "chaos: '10' is not MTBF_S:DOWNTIME_S"),
    (["--chaos", "0:5"], "chaos: '0:5' is not MTBF_S:DOWNTIME_S"),
    (["--quorum", "5"], "quorum: 5 exceeds islands (4)"),
    (["--quorum", "2", "--min-quorum", "3"], "min_quorum: 3 exceeds the quorum (2)"),
    (["--merge-average", "radial_directional", "--robust-merge", "median"],
     "merge_average: radial_directional averages norms and directions, --robust-merge median"),
    (["--grace-window", "soon"], "grace_window"),
    (["--grace-slack-fraction", "0"], "grace_slack_fraction"),
    (["--robust-merge", "trimmed_mean"], "pass --merge-average mean with it"),
    (["--min-quorum", "0"], "min_quorum"),
    (["--grace-overlap-steps", "0"], "grace_overlap_steps"),
    (["--merge-average", "geometric"], "merge_average"),
    (["--push-weight", "steps"], "push_weight"),
    (["--runtime", "collective"],
     "runtime: collective runs only the ddp, diloco, streaming, demo and sparseloco strategies, not decoupled"),
    (["--runtime", "ray", "--ray-island-resources", "eu=1;eu=1"], "ray_island_resources: 2 entries for 4 islands"),
    (["--runtime", "ray", "--ray-island-resources", "eu"], "ray_island_resources: 'eu' is not NAME=AMOUNT"),
    (["--runtime", "ray", "--ray-island-resources", "eu=0"], "ray_island_resources: eu=0.0 must be a positive"),
    (["--runtime", "ray", "--ray-island-resources", "GPU=1"], "ray_island_resources: 'GPU' is not a custom"),
    (["--ray-island-resources", "eu=1"], "ray_island_resources: the local runtime does not use it (only ray)"),
])
def test_bad_decoupled_flags_exit_2_with_one_line(flags: list[str], message: str) -> None:
    r = run_cli("train", "--strategy", "decoupled", "--islands", "4", *flags)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_decoupled_only_flags_are_refused() -> None:
    with pytest.raises(ConfigError, match="chaos: the diloco strategy does not use it"):
        build_config(overrides={"chaos": "9:1"})
    with pytest.raises(ConfigError, match="runtime: ray runs only the decoupled strategy"):
        build_config(overrides={"runtime": "ray"})
    # tuning that only decoupled (or only Ray) reads: a changed value elsewhere is refused, and so is the default
    # given explicitly, in the same sentence (atoll.config.applies); the default in a saved run's config.json
    # (a base) is not
    with pytest.raises(ConfigError, match="grace_factor: the diloco strategy does not use it"):
        build_config(overrides={"strategy": "diloco", "grace_factor": 3.0})
    with pytest.raises(ConfigError, match="ray_address: the local runtime does not use it"):
        build_config(overrides={"strategy": "decoupled", "ray_address": "10.0.0.1:6379"})
    with pytest.raises(ConfigError, match="grace_factor: the diloco strategy does not use it .*--strategy decoupled"):
        build_config(overrides={"strategy": "diloco", "grace_factor": DecoupledConfig().grace_factor})
    build_config(base={"strategy": "diloco", "grace_factor": DecoupledConfig().grace_factor})


def test_ray_island_resources_one_entry_or_one_per_island() -> None:
    pytest.importorskip("ray")
    from atoll.runtime.ray import island_resources

    base = {"strategy": "decoupled", "runtime": "ray", "islands": 3}
    one = build_config(overrides={**base, "ray_island_resources": "h100=1, us_east=0.5"})
    assert island_resources(one.runtime_config, 3) == [{"h100": 1.0, "us_east": 0.5}] * 3
    each = build_config(overrides={**base, "ray_island_resources": "us=1;us=1;eu=1"})
    assert island_resources(each.runtime_config, 3) == [{"us": 1.0}, {"us": 1.0}, {"eu": 1.0}]
    assert island_resources(build_config(overrides=base).runtime_config, 3) == [{}, {}, {}]


@pytest.mark.slow
def test_failures_faster_than_a_step_stop_with_a_warning(fast_config: dict, capsys) -> None:
    # a rejoin plus one step needs more up-time than an MTBF of 0.01 s almost ever gives: without a bound
    # the event loop would fail and rejoin for ever
    summary = train(build_config(overrides=_decoupled(fast_config, chaos="0.01:0.5", sim_step_s=0.1,
                                                      checkpoint_every=0)))
    assert summary["gave_up"] is True
    assert sum(summary["steps_per_island"]) < 4 * 16
    _assert_every_token_in_one_bucket(summary)  # pushes still on the wire when it stopped included
    assert 0 <= summary["goodput"] < 0.05
    assert "stopped at simulated" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("realign", [False, True])
def test_resume_halfway_matches_uninterrupted_run(fast_config: dict, tmp_path: Path, monkeypatch,
                                                  realign: bool) -> None:
    from atoll.config import load_run_config
    from atoll.job.metrics import read_metrics

    # chaos and speeds: islands are down, pushes in flight and buffers open at the checkpoint
    base = _decoupled(fast_config, chaos="0.6:0.2", island_speeds="1,1,0.5,0.25", sync_every=8,
                      checkpoint_every=6, codec="int4", codec_rounding="stochastic", error_feedback=True,
                      realign_pushes=realign)
    full = train(build_config(overrides={**base, "out": str(tmp_path / "full")}))
    resumed = train_crashed_and_resumed(base, tmp_path / "resumed", monkeypatch, step=12)
    for key in ("final_eval_loss", "steps_per_island", "failures", "rejoin_s", "commits", "staleness_counts",
                "sim_wall_s", "goodput", "bytes_sent_by_island", "rejected_updates", "participation",
                "merges_all_live"):
        assert resumed[key] == full[key], key
    evals = [e["step"] for e in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if e["event"] == "eval"]
    assert evals == [0, 8, 16], "the log of a resumed run reads as one run"
    # a finished run continues with a larger budget
    longer = train(load_run_config(tmp_path / "full", {"steps": 20}), resume=True)
    assert sum(longer["steps_per_island"]) == 4 * 20


@pytest.mark.slow
def test_ray_decoupled_resume_is_refused(fast_config: dict) -> None:
    config = build_config(overrides=_decoupled(fast_config, runtime="ray"))
    with pytest.raises(ConfigError, match="resume: a decoupled run on Ray cannot be resumed"):
        train(config, resume=True)


@pytest.mark.slow
def test_ray_is_imported_only_for_the_ray_runtime() -> None:
    import subprocess
    import sys

    code = ("import sys, atoll.cli, atoll.training, atoll.strategies.decoupled, atoll.runtime.events; "
            "from atoll.cli import build_parser; build_parser(); assert 'ray' not in sys.modules, 'ray imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_strategy_defaults_outer_momentum_and_codec() -> None:
    def own(**overrides: object):
        return build_config(overrides=overrides).strategy_config

    assert own(strategy="decoupled").outer_momentum == 0.5
    assert own(strategy="diloco").outer_momentum == 0.5  # not the paper's 0.9: docs/results.md
    assert own(strategy="decoupled", outer_momentum=0.9).outer_momentum == 0.9
    assert own(strategy="decoupled").codec == "int4" == own(strategy="streaming").codec and own().codec == "fp32"


def test_adopt_keeps_the_work_done_while_the_push_travelled(fast_config: dict) -> None:
    from atoll.runtime.decoupled_job import prepare_job
    from atoll.strategies.decoupled.island import IslandWorker
    from atoll.strategies.decoupled.protocol import Pull

    job = prepare_job(build_config(overrides=_decoupled(fast_config)))
    w = IslandWorker(0, job, total_steps=16)

    def fragment(p: int) -> torch.Tensor:
        return w.fragment_index[p].gather(w.island.flat_params())

    for _ in range(3):
        w.train_step()
    at_push = fragment(0)
    push = w.push(0)
    assert torch.equal(push.delta, w.base[0] - at_push) and push.tokens == 3 * job.facts.tokens_per_step
    assert torch.equal(w.at_push[0], at_push)
    for _ in range(2):  # the island trains on while its push and the pull are on the wire
        w.train_step()
    now = fragment(0)
    assert not torch.equal(now, at_push)
    new_global = w.base[0] - 0.5 * push.delta  # what the syncer sent back, version 1
    # the global fragment plus the progress since the push; the next Δ is exactly that progress
    w.adopt(Pull(0, new_global, 1))
    assert torch.allclose(fragment(0), new_global + (now - at_push), atol=1e-6)
    assert torch.equal(w.base[0], new_global) and w.base_version[0] == 1 and w.at_push[0] is None
    assert torch.allclose(w.push(0).delta, at_push - now, atol=1e-6)
    # with no push in progress (a final pull) adopting is replacing
    w.adopt(Pull(1, w.base[1] + 1.0, 1))
    assert torch.equal(fragment(1), w.base[1])


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_push_is_a_tensor_of_its_own_that_the_worker_keeps_no_part_of(fast_config: dict, codec: str) -> None:
    """The simulated runtime hands a push's Δ to the syncer without a copy (owned): nothing the worker holds
    shares its memory, and what the worker does next leaves the pushed Δ as it was."""
    from atoll.runtime.decoupled_job import prepare_job
    from atoll.strategies.decoupled.island import IslandWorker
    from atoll.strategies.decoupled.protocol import Pull

    job = prepare_job(build_config(overrides={**_decoupled(fast_config), "codec": codec}))
    w = IslandWorker(0, job, total_steps=16)
    for _ in range(2):
        w.train_step()
    push = w.push(0)
    kept = push.delta.clone()
    held = [*w.base, *(t for t in w.at_push if t is not None), *w.island.params,
            *(t for f in (w.wire.feedback or []) for t in f.state_dict().values() if isinstance(t, torch.Tensor))]
    assert not any(push.delta.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in held)
    w.train_step()
    w.push(1)
    w.adopt(Pull(0, w.base[0] - 0.5 * push.delta, 1))
    w.train_step()
    w.push(0)
    assert torch.equal(push.delta, kept)


def test_at_push_lands_in_one_kept_buffer_and_a_delta_pull_lands_in_the_base(fast_config: dict) -> None:
    """θ_at_push of a fragment is written into one buffer the worker keeps from push to push (the same values as a
    fresh copy), which its checkpoint copies; an int8 delta pull is added to the base in place, giving the floats
    of the base plus the decoded payload, and the island's parameters as on a copy."""
    from atoll.runtime.decoupled_job import prepare_job
    from atoll.strategies.decoupled.downlink import Downlink
    from atoll.strategies.decoupled.island import IslandWorker

    job = prepare_job(build_config(overrides={**_decoupled(fast_config), "pull_codec": "int8"}))
    w = IslandWorker(0, job, total_steps=16)
    down = Downlink("int8", [b.clone() for b in w.base])
    w.train_step()
    w.push(0)
    buffer = w.at_push[0]
    assert buffer is not None and torch.equal(buffer, w.fragment_index[0].gather(w.island.flat_params()))
    saved = w.state_dict()["at_push"][0]
    assert saved.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    base_storage = w.base[0].untyped_storage().data_ptr()
    g = w.base[0] + 0.01 * torch.randn(w.base[0].numel(), generator=torch.Generator().manual_seed(0))
    down.commit(0, g, 1)
    pull = down.pull(0, g, 1, have=0)
    assert pull.params is None and len(pull.deltas) == 1
    expected_base = w.base[0] + make_codec("int8").decode(pull.deltas[0])
    now = w.fragment_index[0].gather(w.island.flat_params())
    w.adopt(pull)
    assert w.base[0].untyped_storage().data_ptr() == base_storage and torch.equal(w.base[0], expected_base)
    assert torch.equal(w.base[0], down.shadow[0])
    assert torch.equal(w.fragment_index[0].gather(w.island.flat_params()), (now - saved) + expected_base)
    w.train_step()
    w.push(0)  # the next push of fragment 0: into the same buffer, with the values of now
    assert w.at_push[0] is buffer and torch.equal(buffer, w.fragment_index[0].gather(w.island.flat_params()))
    assert not torch.equal(buffer, saved)


@pytest.mark.slow
def test_pushes_on_the_wire_die_with_a_failed_island(fast_config: dict) -> None:
    # a slow link (pushes take several steps) and frequent failures: some pushes are in flight at a failure
    summary = train(build_config(overrides=_decoupled(fast_config, chaos="0.6:0.2", sim_step_s=0.1,
                                                      link_bandwidth_mbps=0.5, steps=24)))
    assert sum(summary["failures"]) > 0 and summary["lost_pushes"] > 0
    # every trained token is merged, lost with a failure, or dropped at the syncer (stale or rejected)
    _assert_every_token_in_one_bucket(summary)
    assert 0 < summary["goodput"] < 1


@pytest.mark.slow
def test_the_end_answers_every_push_before_the_final_ones(fast_config: dict) -> None:
    # a quorum of 3 of 4 islands of unequal speeds: pushes are still buffered when the step budget runs out.
    # The end closes those buffers and answers their islands before the final pushes (which would otherwise
    # repeat work the syncer already holds), and every live island ends on the final global model, so a
    # run continued with a longer --steps does not push its final work twice.
    from atoll.job.run import load_latest_state
    from atoll.strategies.decoupled import DecoupledConfig

    summary = train(build_config(overrides=_decoupled(fast_config, quorum=3, island_speeds="1,1,0.5,0.25",
                                                      steps=14, sync_every=8)))
    _, state = load_latest_state(Path(summary["out"]))
    outer, downlink = state["syncer"]["outer"], state["syncer"]["downlink"]
    assert all(not b["pushes"] for b in state["syncer"]["buffers"]), "every buffer merged at the end"
    # what an up-to-date island holds: the pull codec's shadows Q (the default's), at the global versions
    default = DecoupledConfig.model_fields["pull_codec"].default
    assert default != "fp32" and downlink["codec"] == default
    assert downlink["version"] == [int(o["version"]) for o in outer]
    for island in state["islands"]:
        assert island["tokens_since"] == [0, 0]
        assert island["base_version"] == [int(o["version"]) for o in outer]
        for base, q in zip(island["base"], downlink["shadow"], strict=True):
            assert torch.equal(base, q)
    assert summary["useful_tokens"] == pytest.approx(summary["tokens"])


BUCKETS = ("merged", "stale", "rejected", "lost", "in_flight")


def _assert_every_token_in_one_bucket(summary: dict) -> None:
    """Per island, the buckets sum to the tokens it trained; together they make the run's tokens."""
    trained = summary["trained_tokens_by_island"]
    assert sum(trained) == summary["tokens"]
    for i, t in enumerate(trained):
        assert sum(summary[f"{k}_tokens_by_island"][i] for k in BUCKETS) == pytest.approx(t, rel=1e-9), i
    assert summary["unaccounted_tokens"] == 0.0
    assert sum(summary["merged_tokens_by_island"]) == pytest.approx(summary["useful_tokens"], rel=1e-9)
    assert sum(summary["lost_tokens_by_island"]) == pytest.approx(summary["lost_tokens"], rel=1e-9)


def test_a_speed_spread_the_cadence_cannot_hold_is_refused_with_one_line() -> None:
    # an island at 0.05 of the fastest's speed takes 0.3 inner steps per round of H = 6: it cannot push each of
    # 2 fragments once a round, its pushes would go stale; H = 40 holds the cadence
    with pytest.raises(ConfigError, match=r"island_speeds: an island at 0.05 of the fastest's speed takes 0.3 "
                                          r"inner steps per round of --sync-every 6, fewer than --fragments 2.*"
                                          r"raise --sync-every to 40 or more"):
        build_config(overrides={"strategy": "decoupled", "islands": 4, "fragments": 2, "sync_every": 6,
                                "island_speeds": "1,1,1,0.05"})
    assert build_config(overrides={"strategy": "decoupled", "islands": 2, "fragments": 2, "sync_every": 40,
                                   "island_speeds": "1,0.05"}).strategy_config.island_speeds == [1.0, 0.05]


@pytest.mark.slow
def test_a_20x_speed_spread_merges_every_token(fast_config: dict) -> None:
    # speeds 1 and 0.05 push at the same cadence (H = 40 and 2 inner steps): 20x the tokens per push on the
    # fast island, neither refused (a median of both islands' claims refused the fast one's as "tokens")
    summary = train(build_config(overrides=_decoupled(fast_config, islands=2, sync_every=40, steps=100,
                                                      island_speeds="1,0.05", eval_every=100, checkpoint_every=0)))
    assert summary["rejected_updates"] == 0 and summary["stale_updates"] == 0, summary["rejected_by_reason"]
    assert summary["merged_tokens_by_island"] == summary["trained_tokens_by_island"]
    assert summary["steps_per_island"][1] >= 8
    _assert_every_token_in_one_bucket(summary)


@pytest.mark.slow
def test_every_trained_token_is_in_one_bucket_per_island(fast_config: dict) -> None:
    # failures (lost), a tight staleness limit and partial quorum (stale), a tight norm bound (rejected)
    summary = train(build_config(overrides=_decoupled(fast_config, islands=3, chaos="0.8:0.2", quorum=2,
                                                      max_staleness=0, update_norm_bound=1.5, steps=24)))
    for k in ("merged", "stale", "rejected", "lost"):
        assert sum(summary[f"{k}_tokens_by_island"]) > 0, k
    _assert_every_token_in_one_bucket(summary)
    from atoll.job.metrics import token_bucket_rows

    rows = dict(token_bucket_rows(summary))
    assert rows["tokens per island"] == "merged / stale / rejected / lost / in flight"
    assert rows["  island 2"] == " / ".join(f"{summary[f'{k}_tokens_by_island'][2]:,.0f}" for k in BUCKETS)
    assert "tokens in no bucket" not in rows


@pytest.mark.slow
def test_the_island_last_after_the_quorum_is_not_starved(fast_config: dict) -> None:
    # 3 islands alike, quorum 2, no staleness allowed: island 2's pushes arrive (ties) after the other two
    # merged; it was dropped every round (merged 0 of its tokens), now its credit lets it merge
    summary = train(build_config(overrides=_decoupled(fast_config, islands=3, quorum=2, max_staleness=0,
                                                      sync_every=6, steps=100, eval_every=100, checkpoint_every=0)))
    shares = [m / t for m, t in zip(summary["merged_tokens_by_island"], summary["trained_tokens_by_island"],
                                    strict=True)]
    assert min(shares) >= 0.75 and min(shares) >= 0.85 * max(shares), shares  # [0.94, 0.94, 0.835] measured
    _assert_every_token_in_one_bucket(summary)
