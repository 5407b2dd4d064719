"""Adding a strategy is one module plus one registry line (atoll.strategies.registry): a strategy written here,
in a module of its own outside atoll, registered by one entry of ``STRATEGIES``, is configured by its own flags,
refused elsewhere, and trains; no other file of atoll is touched."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

from atoll.config import build_config
from atoll.config.applies import catalog
from atoll.errors import ConfigError
from atoll.strategies import registry
from atoll.training import train

#: the whole new strategy: FedAvg (McMahan et al. 2017), every H inner steps the islands' parameters are
#: averaged, token-weighted, moved a fraction ``fedavg_mix`` of the way to that mean
PLUGIN = '''
    """``fedavg``: parameter averaging every H inner steps (McMahan et al. 2017), a fraction fedavg_mix of the way."""

    from __future__ import annotations

    from typing import Any

    import torch
    from pydantic import Field

    from atoll.algorithms.wire import Wire
    from atoll.config.section import StrategyConfig
    from atoll.config.sections import AdamWSection, SyncSection
    from atoll.strategies.base import Strategy
    from atoll.strategies.spec import StrategySpec


    class FedAvgConfig(SyncSection, AdamWSection, StrategyConfig):
        """H, the inner AdamW, and how far each island moves to the mean."""

        fedavg_mix: float = Field(1.0, gt=0, le=1, description="fedavg: fraction of the way to the mean.")


    class FedAvg(Strategy):
        """Inner AdamW steps; every H steps each island moves to the islands' token-weighted mean."""

        name = "fedavg"
        config: FedAvgConfig

        def __init__(self, config: FedAvgConfig, islands: list, comm: Any, seed: int = 0) -> None:
            super().__init__(config, islands, comm, seed)
            self.wire = Wire("fp32", comm.local_islands)
            self.rounds = 0
            self.tokens_at_sync = [island.tokens for island in islands]

        def step(self, step: int) -> None:
            for island in self.islands:
                island.inner_step()
            if (step + 1) % self.config.sync_every == 0:
                self.average()

        def average(self) -> None:
            flats = [island.flat_params() for island in self.islands]
            weights = [i.tokens - t for i, t in zip(self.islands, self.tokens_at_sync, strict=True)]
            mean, _ = self.comm.all_reduce_mean_and_weight(flats, weights=weights, wire=self.wire, key="all")
            for island, flat in zip(self.islands, flats, strict=True):
                island.set_flat_params(flat + self.config.fedavg_mix * (mean - flat))
            self.tokens_at_sync = [island.tokens for island in self.islands]
            self.rounds += 1

        def finish(self, steps_done: int) -> None:
            if steps_done % self.config.sync_every:
                self.average()

        def global_params(self) -> torch.Tensor:
            return self.islands[0].flat_params()

        def summary(self) -> dict[str, Any]:
            return {**super().summary(), "fedavg_rounds": self.rounds}


    SPEC = StrategySpec(name="fedavg", summary="parameter averaging every H inner steps (FedAvg)",
                        config=FedAvgConfig, lockstep=FedAvg)
'''


@pytest.fixture
def fedavg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The plugin's module written to a package of its own, and its one line in the registry."""
    package = tmp_path / "plugins_here"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fedavg.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "STRATEGIES", (*registry.STRATEGIES, "plugins_here.fedavg"))
    return "fedavg"


def test_a_strategy_in_one_module_and_one_registry_line_trains(fedavg: str, fast_config: dict) -> None:
    assert "fedavg_mix" in catalog()  # its own setting is a flag and a TOML key
    config = build_config(overrides={**fast_config, "strategy": fedavg, "steps": 6, "sync_every": 3,
                                     "fedavg_mix": "0.5", "eval_every": 3, "checkpoint_every": 3, "seq_len": 16,
                                     "batch_size": 2, "eval_batches": 1, "islands": 2})
    assert type(config.strategy_config).__name__ == "FedAvgConfig" and config.strategy_config.fedavg_mix == 0.5
    summary = train(config)
    assert summary["strategy"] == "fedavg" and summary["fedavg_rounds"] == 2 and summary["steps"] == 6
    assert torch.isfinite(torch.tensor(summary["final_eval_loss"]))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["bytes_sent_per_island"] > 0  # two rounds of the full fp32 parameters
    saved = (Path(summary["out"]) / "config.json").read_text()
    assert '"fedavg_mix": 0.5' in saved and '"outer_lr"' not in saved  # its settings, none it does not read


def test_a_strategy_that_does_not_shard_is_refused_on_sharded_islands(fedavg: str) -> None:
    """A spec says whether its strategy runs on shards (default: no); the refusal names those that do."""
    with pytest.raises(ConfigError, match=r"^shard_island: the fedavg strategy does not run on shards \(only ddp, "
                                          r"diloco, streaming, demo, sparseloco and decoupled do\); pass --strategy "
                                          r"diloco or drop --shard-island$"):
        build_config(overrides={"strategy": fedavg, "runtime": "collective", "ranks_per_island": 2,
                                "shard_island": True})


def test_its_settings_are_its_own(fedavg: str) -> None:
    with pytest.raises(ConfigError, match=r"^fedavg_mix: the diloco strategy does not use it \(only fedavg\)"):
        build_config(overrides={"strategy": "diloco", "fedavg_mix": 0.5})
    with pytest.raises(ConfigError, match=r"^outer_lr: the fedavg strategy does not use it"):
        build_config(overrides={"strategy": fedavg, "outer_lr": 0.5})
    with pytest.raises(ConfigError, match=r"^fedavg_mix: input should be less than or equal to 1"):
        build_config(overrides={"strategy": fedavg, "fedavg_mix": 2})


def test_a_strategy_config_is_built_and_validated_without_a_run() -> None:
    from atoll.strategies.diloco import DiLoCoConfig
    from atoll.strategies.streaming import StreamingConfig

    assert DiLoCoConfig(sync_every=100).sync_every == 100 and StreamingConfig().codec == "int4"
    with pytest.raises(ValueError, match=r"sync_every \(2\) must be at least fragments \(4\)"):
        StreamingConfig(sync_every=2, fragments=4)
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        DiLoCoConfig(fragments=2)  # not diloco's


def test_the_shared_settings_import_neither_torch_nor_a_strategy() -> None:
    import subprocess
    import sys

    code = ("import sys; import atoll.config.sections, atoll.config.runtimes, atoll.config.section; "
            "from atoll.config import TrainConfig, build_config; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'atoll.strategies'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_toml_file_may_give_the_owned_parts_as_tables(tmp_path: Path) -> None:
    from atoll.config.train import tree_path

    path = tmp_path / "run.toml"
    path.write_text('strategy = "streaming"\nislands = 2\n[strategy_config]\nsync_every = 8\nfragments = 2\n'
                    '[runtime_config]\nlink_bandwidth_mbps = 25.0\n')
    config = build_config(path)
    own, link = config.strategy_config, config.runtime_config
    assert (own.sync_every, own.fragments, own.codec, link.link_bandwidth_mbps) == (8, 2, "int4", 25.0)
    assert tree_path("sync_every", "streaming", "local") == "strategy_config.sync_every"
    assert tree_path("islands", "streaming", "local") == "islands"
    assert tree_path("link_bandwidth_mbps", "ddp", "collective") is None
    path.write_text('strategy = "ddp"\n[strategy_config]\nsync_every = 8\n')
    with pytest.raises(ConfigError, match="^sync_every: the ddp strategy does not use it"):
        build_config(path)


def test_another_strategys_config_given_whole_is_refused_in_the_one_sentence() -> None:
    """A config of another strategy (or runtime) handed over whole gets the sentence its flat keys get, not
    the owned config's "unknown setting"; the setting named is one the user set, where there is one."""
    from atoll.config import TrainConfig
    from atoll.runtime.registry import configs
    from atoll.strategies.demo import DeMoConfig
    from atoll.strategies.diloco import DiLoCoConfig

    said = "demo_lr: the diloco strategy does not use it (only demo); drop --demo-lr or use --strategy demo"
    with pytest.raises(ValueError, match=re.escape(said)):
        TrainConfig(strategy="diloco", demo_lr=0.1)
    with pytest.raises(ValueError, match=re.escape(said)):
        TrainConfig(strategy="diloco", strategy_config=DeMoConfig())
    with pytest.raises(ValueError, match=r"sync_every: the demo strategy does not use it \(only diloco, "):
        TrainConfig(strategy="demo", strategy_config=DiLoCoConfig(sync_every=5))  # (codec comes first, not set)
    with pytest.raises(ValueError, match=r"collective_timeout_s: the local runtime does not use it \(only "):
        TrainConfig(runtime="local", runtime_config=configs()["collective"]())
    assert TrainConfig(strategy="diloco", strategy_config=DiLoCoConfig(sync_every=7)).strategy_config.sync_every == 7
