"""Adding a runtime is one module plus one registry line (atoll.runtime.registry): a runtime written here, in a
module of its own outside atoll, registered by one entry of ``RUNTIMES``, is configured by its own setting,
refused elsewhere, and trains a lockstep strategy; no other file of atoll is touched."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from atoll.config import build_config
from atoll.config.applies import catalog
from atoll.errors import ConfigError
from atoll.runtime import registry
from atoll.runtime.network import Link, replay
from atoll.training import train

#: the whole new runtime: the local one with its simulated links slowed by a factor, built from its own config
#: (the local runtime's settings and one of its own) and the run's facts
PLUGIN = '''
    """``slowlocal``: the local runtime on links slowed by a factor (a congested WAN, simulated)."""

    from __future__ import annotations

    from typing import Any

    from pydantic import Field

    from atoll.config.facts import RunFacts
    from atoll.config.runtimes import LocalConfig
    from atoll.runtime.local import LocalRuntime
    from atoll.runtime.spec import RuntimeSpec


    class SlowLocalConfig(LocalConfig):
        """The local runtime's links, and how much slower they run."""

        link_slowdown: float = Field(1.0, ge=1, le=1000,
                                     description="slowlocal: divide the links' bandwidth by this.")


    class SlowLocalRuntime(LocalRuntime):
        """The local runtime at a bandwidth ``link_slowdown`` times lower."""

        def __init__(self, config: SlowLocalConfig, facts: RunFacts, strategy: Any = None) -> None:
            slowed = LocalConfig(link_bandwidth_mbps=config.link_bandwidth_mbps / config.link_slowdown,
                                 link_latency_ms=config.link_latency_ms)
            super().__init__(slowed, facts, strategy)
            self.slowdown = config.link_slowdown

        def summary(self) -> dict[str, Any]:
            return {**super().summary(), "link_slowdown": self.slowdown}


    SPEC = RuntimeSpec(name="slowlocal", summary="the local runtime on slower links", config=SlowLocalConfig,
                       kinds=("lockstep",), lockstep="plugins_rt.slowlocal:SlowLocalRuntime")
'''


@pytest.fixture
def slowlocal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The plugin's module written to a package of its own, and its one line in the registry."""
    package = tmp_path / "plugins_rt"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "slowlocal.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "RUNTIMES", (*registry.RUNTIMES, "plugins_rt.slowlocal"))
    return "slowlocal"


def _run(fast_config: dict, tmp_path: Path, name: str, **settings: object) -> dict:
    return train(build_config(overrides={**fast_config, "strategy": "diloco", "steps": 6, "sync_every": 3,
                                         "eval_every": 3, "checkpoint_every": 3, "out": str(tmp_path / name),
                                         **settings}))


def test_a_runtime_in_one_module_and_one_registry_line_trains(slowlocal: str, fast_config: dict,
                                                              tmp_path: Path) -> None:
    assert "link_slowdown" in catalog()  # its own setting is a flag and a TOML key
    config = build_config(overrides={**fast_config, "runtime": slowlocal, "link_slowdown": "4"})
    assert type(config.runtime_config).__name__ == "SlowLocalConfig" and config.runtime_config.link_slowdown == 4
    slow = _run(fast_config, tmp_path, "slow", runtime=slowlocal, link_slowdown=4)
    local = _run(fast_config, tmp_path, "local")
    assert slow["link_slowdown"] == 4 and slow["steps"] == 6 and slow["exchanges"] == local["exchanges"] == 2
    assert slow["final_eval_loss"] == local["final_eval_loss"]  # the clock is not the maths
    saved = json.loads((Path(slow["out"]) / "config.json").read_text())
    assert saved["runtime"] == slowlocal and saved["link_slowdown"] == 4
    trace = json.loads((Path(slow["out"]) / "clock_trace.json").read_text())
    assert trace["link_bandwidth_mbps"] == 25.0  # re-timed at the link it ran at
    # the same bytes on 4x slower links: the collectives' seconds as priced (no measured compute in them)
    comm = [replay(json.loads((Path(r["out"]) / "clock_trace.json").read_text()),
                   Link.from_config(mbps, 10.0))["comm_s"] for r, mbps in ((slow, 25.0), (local, 100.0))]
    assert comm[0] > comm[1] > 0


def test_its_settings_are_its_own(slowlocal: str) -> None:
    with pytest.raises(ConfigError, match=r"^link_slowdown: the local runtime does not use it \(only slowlocal\); "
                                          r"drop --link-slowdown or use --runtime slowlocal$"):
        build_config(overrides={"runtime": "local", "link_slowdown": 2})
    with pytest.raises(ConfigError, match=r"^link_slowdown: input should be greater than or equal to 1"):
        build_config(overrides={"runtime": slowlocal, "link_slowdown": 0.5})
    with pytest.raises(ConfigError, match=r"^collective_timeout_s: the slowlocal runtime does not use it"):
        build_config(overrides={"runtime": slowlocal, "collective_timeout_s": 5})
    # it runs lockstep strategies only (its spec's kinds): the asynchronous one is refused in one line
    with pytest.raises(ConfigError, match=r"^runtime: slowlocal runs only the ddp, diloco, .* strategies, not "
                                          r"decoupled; add --strategy ddp or pass --runtime local$"):
        build_config(overrides={"runtime": slowlocal, "strategy": "decoupled"})


def test_an_unknown_runtime_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"^runtime: 'nope' is not a runtime \('local', 'collective', 'ray', "
                                          r"'service'\); "):
        build_config(overrides={"runtime": "nope"})


def test_the_registry_and_the_runtime_configs_import_no_torch() -> None:
    """The specs name their runtimes' modules by dotted path: listing them, their names and their configs imports
    neither torch nor a runtime's code."""
    code = ("import sys; from atoll.runtime.registry import configs, names; "
            "assert names() == ('local', 'collective', 'ray', 'service'), names(); "
            "assert list(configs()) == list(names()); assert configs()['collective'].__name__ == 'CollectiveConfig'; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'atoll.runtime.local', "
            "'atoll.runtime.collective', 'atoll.runtime.ray'))); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_runtime_config_is_built_and_validated_without_a_run() -> None:
    """Each runtime's own checks are its config's: built alone, it refuses what concerns only its settings;
    the whole config keeps the checks across owners (the run's islands, the batch)."""
    from atoll.config.runtimes import CollectiveConfig, RayConfig

    assert CollectiveConfig(ranks_per_island=2, shard_island=True).shard_island
    with pytest.raises(ValueError, match=r"shard_island: an island of one rank has nothing to shard"):
        CollectiveConfig(shard_island=True)
    with pytest.raises(ValueError, match=r"'GPU' is not a custom resource name"):
        RayConfig(ray_island_resources="GPU=1")
    with pytest.raises(ConfigError, match=r"^min_islands \(3\) exceeds islands \(2\)"):
        build_config(overrides={"runtime": "collective", "islands": 2, "min_islands": 3})
    with pytest.raises(ConfigError, match=r"^batch_size \(3\) must be divisible by ranks_per_island \(2\)"):
        build_config(overrides={"runtime": "collective", "batch_size": 3, "ranks_per_island": 2})
