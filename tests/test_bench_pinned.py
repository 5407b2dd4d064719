"""The older benchmarks still train on the setting their committed results were measured on.

bench/diloco_vs_ddp.py, streaming_codecs.py, demo_sweep.py, decoupled.py, overhead.py and wan.py (``atoll bench
wan``) were measured (bench/out/<name>/results.*) on the TrainConfig defaults before the nano regime. Each pins
the defaults that changed since (its ``EARLIER_SETTING``). Here every run each of them trains, at its default
flags and at the command line of its committed results, is built with today's code the way the script builds
it, and every field of the resolved config is compared with the run's resolution under the earlier defaults,
written below as data (:data:`OLD_DEFAULTS`, read from the code at commit 568f3bb). Nothing is trained.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from atoll.benchmarks import wan
from atoll.cli import build_parser
from atoll.config import TrainConfig, build_config
from atoll.config.applies import applicable
from bench import decoupled, demo_sweep, diloco_vs_ddp, overhead, streaming_codecs

#: Every TrainConfig field's default at commit 568f3bb (the code the committed results were measured with).
OLD_DEFAULTS: dict[str, Any] = {
    # added since: the device (auto is the CPU on a machine without a GPU, where the results come from) and the
    # precision (fp32 then and by default now)
    "device": "auto", "precision": "fp32",
    # added since, off by default: torch.compile, experiment trackers, the plain progress lines' interval, the
    # inner optimizer (adamw then and by default now), sharded islands, the tokenizer (None: atoll's BPE for a
    # preset, as then), hf: datasets' document cap; min_islands and max_restarts (the collective runtime's
    # survivors going on and a lost island rejoining, which no pinned run meets)
    "compile": False, "grad_accum": 1, "activation_checkpointing": False, "tracker": [], "progress_every": None, "inner_optimizer": "adamw", "shard_island": False,
    "tokenizer": None, "max_documents": None, "min_islands": 1, "max_restarts": 0,
    # the sparseloco strategy's own settings (a strategy added since; they apply to it alone)
    "sparseloco_topk": 64, "sparseloco_chunk": 4096, "sparseloco_beta": 0.95, "sparseloco_bits": 2,
    # sparseloco's tiles and senders' mean (added since, by issue 24: the reference's rules, which intentionally
    # change sparseloco's results; "flat" and "all" are what it computed before; they apply to sparseloco alone)
    "sparseloco_layout": "tiles", "sparseloco_aggregate": "senders",
    # decoupled's robust merge (added since; none is the token-weighted mean of then)
    "robust_merge": "none",
    # the adaptive outer step (added since; none is the fixed outer step of then)
    "outer_adapt": "none",
    "batch_size": 8, "cache_dir": None, "chaos": None, "checkpoint_every": 100, "codec": "fp32",
    "codec_block_size": 64, "codec_rounding": "nearest", "collective_timeout_s": 60.0, "data": "stdlib",
    "demo_beta": 0.999, "demo_chunk": 64, "demo_lr": 0.003, "demo_sign_values": True, "demo_topk": 32,
    "error_feedback": False, "eval_batches": 16, "eval_every": 100, "fragments": 4, "grace_factor": 1.0,
    "grad_clip": 1.0, "init_from": None, "island_speeds": None, "islands": 4, "link_bandwidth_mbps": 100.0,
    "link_latency_ms": 10.0, "lr": 0.003, "max_staleness": 4, "min_lr_ratio": 0.1, "mixing_alpha": 0.5,
    "model": "tiny", "out": None, "outer_lr": 0.7, "outer_momentum": 0.9, "overlap_steps": 1, "partition": "iid",
    "progress": True, "quorum": None, "ranks_per_island": 1, "ray_address": None, "ray_cpus_per_island": 1.0,
    "ray_gpus_per_island": 0.0, "ray_island_resources": None, "ray_logs": False, "runtime": "local", "scale_partial_merges": True,
    "seed": 0, "seq_len": 128, "sim_step_s": 0.1, "staleness_exponent": 0.5, "steps": 600, "strategy": "diloco",
    "sync_every": 50, "text_field": "text", "threads": None, "topk_fraction": 0.01, "update_norm_bound": 10.0,
    "vocab_size": 4096, "warmup_steps": 50, "weight_decay": 0.1,
}
#: The strategies' own defaults for shared settings then, applied when a run leaves the field unset.
OLD_STRATEGY_DEFAULTS: dict[str, dict[str, Any]] = {"demo": {"min_lr_ratio": 1.0},
                                                    "decoupled": {"outer_momentum": 0.5}}

#: Fields that do not change what a run computes or measures: where it writes, its progress bar, its cache and
#: its torch threads (benchmark runs take 1 where ``atoll train`` took torch's choice under OMP_NUM_THREADS=1).
IGNORED = frozenset({"out", "progress", "cache_dir", "threads"})


def old_resolved(own: dict[str, Any]) -> dict[str, Any]:
    """A run's config under the earlier defaults: its own settings over the defaults of then (JSON values)."""
    strategy = own.get("strategy", OLD_DEFAULTS["strategy"])
    own = {k: str(v) if isinstance(v, Path) else v for k, v in own.items()}
    return {**OLD_DEFAULTS, **OLD_STRATEGY_DEFAULTS.get(strategy, {}), **own}


def assert_same(new: TrainConfig, own: dict[str, Any], run: str, skip_unread: bool = False) -> None:
    """Every field of ``new`` (today's resolution of the pinned run) equals the run's earlier resolution;
    ``skip_unread``: but the fields its strategy and runtime do not read (``atoll train`` refuses them as flags,
    so a benchmark driving the command leaves them out: ddp has no H and no outer momentum)."""
    got = json.loads(new.model_dump_json())
    want = old_resolved(own)
    if got["strategy"] == "decoupled" and want["quorum"] is None:  # None meant half the islands then (now: all)
        want["quorum"] = -(-want["islands"] // 2)
    assert set(got) == set(want), f"{run}: fields added or removed since the earlier setting: {set(got) ^ set(want)}"
    skip = IGNORED | ({k for k in got if k not in applicable({**got, k: got[k]})} if skip_unread else set())
    diff = {k: (want[k], got[k]) for k in got if k not in skip and got[k] != want[k]}
    assert not diff, f"{run}: (earlier, now) differ: {diff}"


def via_train_once(settings: dict[str, Any]) -> TrainConfig:
    """The config :func:`atoll.benchmarks.common.train_once` trains ``settings`` with."""
    return build_config(base={"progress": False, "threads": 1, **settings}, overrides={"out": "/tmp/run"})


def via_cli(flags: list[str]) -> TrainConfig:
    """The config ``atoll train FLAGS`` trains with (as the command builds it)."""
    args = build_parser().parse_args(["train", *flags])
    return build_config(args.config, {k: v for k, v in vars(args).items() if k in TrainConfig.model_fields})


def test_old_defaults_cover_every_field() -> None:
    assert set(OLD_DEFAULTS) == set(TrainConfig.model_fields)


@pytest.mark.parametrize("steps", [600, 300])
def test_diloco_vs_ddp(steps: int, tmp_path: Path) -> None:
    runs = diloco_vs_ddp.planned_runs(steps, tmp_path)
    first = "default_cli" if steps == 600 else "diloco_H50"
    assert [n for n, _ in runs] == [first, "one_island", "ddp", "diloco_H10", "diloco_H25", "diloco_H100",
                                    "diloco_H50_outer_1_0", "diloco_H50_outer_0.7_0.5", "warm_then_ddp",
                                    "warm_then_diloco_H50"]
    configs = {}
    for name, own in runs:
        if name == "default_cli":  # `atoll train` with no argument then; the earlier defaults as flags now
            assert own == {}
            configs[name] = via_cli(["--no-progress", *diloco_vs_ddp.cli_flags(diloco_vs_ddp.pinned(own))])
        else:
            configs[name] = via_train_once(diloco_vs_ddp.pinned(own))
        assert_same(configs[name], own, name)
    # streaming_codecs and demo_sweep reuse ddp, one_island and diloco at H=50 when their config.json matches
    # what they ask for (atoll.benchmarks.common.run_matches)
    for name in ("ddp", "one_island", first):
        resolved = json.loads(configs[name].model_dump_json())
        assert all(resolved[k] == v for k, v in diloco_vs_ddp.reference(name, steps).items()), name


def _references(steps: int) -> None:
    """bench/diloco_vs_ddp's runs that streaming_codecs and demo_sweep reuse (or train when missing)."""
    for name, own in (("ddp", {"strategy": "ddp", "steps": steps}),
                      ("one_island", {"strategy": "ddp", "islands": 1, "steps": steps}),
                      ("diloco_H50", {"strategy": "diloco", "sync_every": 50, "steps": steps}),
                      ("default_cli", {"strategy": "diloco", "sync_every": 50, "steps": steps})):
        assert_same(via_train_once(diloco_vs_ddp.reference(name, steps)), own, f"diloco_vs_ddp/{name}")


@pytest.mark.parametrize("steps, table_steps", [(600, 300), (300, 300), (600, None)])
def test_streaming_codecs(steps: int, table_steps: int | None) -> None:
    runs = streaming_codecs.planned_runs(steps, table_steps or steps // 2)
    names = [n for n, _ in runs]
    assert "streaming_int4" in names and len(names) == len(streaming_codecs.CODECS) + 1 + (steps != (table_steps or steps // 2))
    for name, own in runs:
        assert_same(via_train_once(streaming_codecs.pinned(own)), own, name)
    _references(steps)


@pytest.mark.parametrize("best_lr", demo_sweep.LRS)
@pytest.mark.parametrize("best_floor", demo_sweep.FLOORS)
@pytest.mark.parametrize("steps, half", [(600, 150), (600, 300)])
def test_demo_sweep(steps: int, half: int, best_lr: float, best_floor: float) -> None:
    runs = demo_sweep.planned_runs(steps, half, best_lr, best_floor)
    assert len(runs) == len(demo_sweep.LRS) + len(demo_sweep.FLOORS) + len(demo_sweep.TOPKS) + 2
    for name, own in runs:
        assert_same(via_train_once(demo_sweep.pinned(own)), own, name)
    _references(steps)


def test_demo_sweep_starts_from_demo_defaults_of_then() -> None:
    assert demo_sweep.demo_defaults() == (OLD_DEFAULTS["demo_sign_values"], OLD_STRATEGY_DEFAULTS["demo"]["min_lr_ratio"],
                                          OLD_DEFAULTS["demo_chunk"])


@pytest.mark.parametrize("argv", [[], ["--jobs", "2", "--model", "micro", "--fragments", "2"], ["--train-sync"]])
def test_decoupled(argv: list[str]) -> None:
    runs = decoupled.planned_runs(decoupled.parse_args(argv))
    assert [n for n, _ in runs] == ["a_decoupled_free", "a_decoupled_chaos",
                                    *(["a_diloco_free"] if "--train-sync" in argv else []),
                                    "b_decoupled_homogeneous", "b_decoupled_speeds"]
    for name, own in runs:
        assert_same(via_train_once(decoupled.pinned(own)), own, name)


@pytest.mark.parametrize("argv", [[], ["--model", "micro", "--vocab-size", "300", "--batch-size", "2"]])
def test_overhead(argv: list[str]) -> None:
    (name, own), = overhead.planned_runs(overhead.parse_args(argv))
    assert_same(build_config(base=overhead.pinned(own)), own, name)


@pytest.mark.parametrize("argv", [[], ["--ddp-steps", "130"]])
def test_wan(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    wan.add_arguments(parser)
    args = parser.parse_args(argv)
    runs = wan.planned_runs(args)
    assert [n for n, _ in runs] == [f"{s}-{mbps:g}mbit" for mbps in args.bandwidths
                                    for s in ("ddp", *(f"diloco-H{h}" for h in args.sync_every))]
    for name, own in runs:
        settings = wan._settings(args, own["strategy"], own["sync_every"])  # what one_run trains
        assert settings == wan.pinned(own)
        # the ranks' command line: `atoll train --runtime collective ...` (run_in_wan)
        config = via_cli(wan._flags(applicable({**settings, "runtime": "collective", "progress": False,
                                                "out": "/tmp/run"})))
        assert_same(config, {**own, "runtime": "collective"}, name, skip_unread=True)
