"""Attacks on whole decoupled runs: a hostile island in the local simulation, a forged island on Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.robust_merge import train

pytestmark = pytest.mark.slow  # whole training runs, and Ray


def _settings(fast_config: dict, tmp_path: Path, merge: str, name: str) -> dict:
    return {**{k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")},
            "strategy": "decoupled", "islands": 5, "steps": 40, "sync_every": 10, "fragments": 2, "codec": "fp32",
            "robust_merge": merge, "merge_average": "mean", "out": str(tmp_path / name)}


def test_a_sign_flipped_island_ruins_the_mean_and_not_a_robust_merge(fast_config: dict, tmp_path: Path) -> None:
    # island 4 pushes -5 x its honest Δ: finite and within the norm bound, so every push is accepted
    clean = train(_settings(fast_config, tmp_path, "none", "clean"), None, 5.0)
    ruined = train(_settings(fast_config, tmp_path, "none", "ruined"), 4, 5.0)
    robust = train(_settings(fast_config, tmp_path, "median", "median"), 4, 5.0)
    assert ruined["rejected_updates"] == 0 and robust["rejected_updates"] == 0
    assert ruined["final_eval_loss"] > clean["final_eval_loss"] + 0.3, (clean["final_eval_loss"], ruined)
    assert abs(robust["final_eval_loss"] - clean["final_eval_loss"]) < 0.1, (clean["final_eval_loss"], robust)
    assert robust["robust_merge"] == "median" and robust["merge_s"] > 0


def test_on_ray_an_island_can_only_push_as_itself_and_once_per_version(fast_config: dict) -> None:
    ray = pytest.importorskip("ray")
    from atoll.config import build_config
    from atoll.runtime.ray.actors import SyncerService
    from atoll.runtime.ray.cluster import start_local_ray
    from atoll.strategies.decoupled.protocol import Push

    config = build_config(overrides={**fast_config, "strategy": "decoupled", "runtime": "ray", "fragments": 2})
    creds = ["0" * 32, "1" * 32]
    start_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        syncer = ray.remote(num_cpus=0)(SyncerService).remote(config.model_dump_json(), fast_config["out"], creds)
        pull = ray.get(syncer.pull.remote(0))
        delta = 1e-3 * pull.params
        tokens = config.tokens_per_step

        def push(island: int, credential: str) -> bool:
            return ray.get(syncer.push.remote(Push(island, 0, delta, tokens, 0, credential=credential)))[0]

        with pytest.raises(ray.exceptions.RayTaskError, match="PermissionError"):  # a step granted to another
            ray.get(syncer.reserve_step.remote(1, creds[0]))
        for _ in range(2):  # the ledger: island 1 may claim the tokens of the steps it was granted
            assert ray.get(syncer.reserve_step.remote(1, creds[1]))[0]
        assert not push(0, creds[1]), "island 1 pushing as island 0"
        assert not push(1, "")
        assert push(1, creds[1])
        assert not push(1, creds[1]), "the same push replayed"
        with pytest.raises(ray.exceptions.RayTaskError, match="PermissionError"):  # a new session as another
            ray.get(syncer.join.remote(1, creds[0]))
        assert ray.get(syncer.join.remote(1, creds[1]))[3] == 1  # island 1 restarts: its session 1
        assert ray.get(syncer.push.remote(Push(1, 0, delta, tokens, 0, session=1, credential=creds[1])))[0]
        stats = ray.get(syncer.finish.remote())["stats"]
        assert stats["rejected_by_reason"] == {"identity": 2, "replay": 1}
        assert stats["rejected_by_island"] == {"identity": [1, 1], "replay": [0, 1]}
        assert stats["commits"] == 1 and stats["replaced_updates"] == 1  # island 1's second push replaced its first
        assert stats["quorum_size_max"] == 1
    finally:
        ray.shutdown()
