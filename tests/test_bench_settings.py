"""The settings the studies pin (bench/<name>.toml) are still settings of today's config, with valid values.

A study under bench/ that reproduces committed results (bench/out/<name>/) on earlier defaults, or on its own
base settings, reads them from the TOML file beside it (:func:`atoll.benchmarks.common.study_settings`). Here
every table of every such file is built as the overrides of :func:`atoll.config.build_config`: a key that is no
longer a setting, or a value no longer valid, fails and names the file, the table and the key. The runs each
study plans (at its default flags) are built with today's code the way the study builds them, and each keeps
the pinned settings it does not set itself. Nothing is trained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from atoll.benchmarks import wan
from atoll.cli import build_parser
from atoll.config import TrainConfig, build_config
from atoll.config.applies import applicable, catalog
from atoll.errors import ConfigError
from bench import beyond, decoupled, demo_sweep, diloco_vs_ddp, overhead, streaming_codecs, survivors

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BENCH = Path(__file__).resolve().parents[1] / "bench"
TOMLS = sorted(BENCH.glob("*.toml"))


def check_settings(path: Path) -> None:
    """Every table of ``path`` builds as overrides of today's config; else an AssertionError naming the file,
    the table and what is wrong (an unknown key: it is no longer a setting)."""
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    assert doc, f"{path.name}: no table of settings"
    for table, settings in doc.items():
        assert isinstance(settings, dict), f"{path.name}: {table!r} is not a table of settings ([{table}])"
        unknown = sorted(set(settings) - set(catalog()))
        assert not unknown, (f"{path.name} [{table}]: {', '.join(unknown)} no longer a setting of TrainConfig "
                             "(renamed or removed since the study was measured); pin its replacement, or drop it")
        try:
            build_config(overrides=settings)
        except ConfigError as e:
            raise AssertionError(f"{path.name} [{table}]: {e}") from None


def test_there_are_settings_files() -> None:
    assert {p.stem for p in TOMLS} >= {"diloco_vs_ddp", "streaming_codecs", "demo_sweep", "decoupled", "overhead",
                                       "beyond", "survivors"}


@pytest.mark.parametrize("path", TOMLS, ids=[p.name for p in TOMLS])
def test_settings_file_validates_against_the_current_config(path: Path) -> None:
    assert (BENCH / f"{path.stem}.py").is_file(), f"{path.name}: no study bench/{path.stem}.py reads it"
    check_settings(path)


def test_a_key_that_is_no_longer_a_setting_fails_clearly(tmp_path: Path) -> None:
    bad = tmp_path / "old_study.toml"
    bad.write_text('[earlier]\nwarmup_steps = 50\nwarmup_ratio = 0.1\n')
    with pytest.raises(AssertionError, match=r"old_study.toml \[earlier\]: warmup_ratio no longer a setting"):
        check_settings(bad)
    bad.write_text('[earlier]\ncodec = "fp33"\n')
    with pytest.raises(AssertionError, match=r"old_study.toml \[earlier\]: codec"):
        check_settings(bad)


def test_studies_read_their_files() -> None:
    def table(name: str, key: str) -> dict[str, Any]:
        return tomllib.loads((BENCH / f"{name}.toml").read_text(encoding="utf-8"))[key]

    for module in (diloco_vs_ddp, streaming_codecs, demo_sweep, decoupled, overhead):
        assert table(module.__name__.split(".")[-1], "earlier") == module.EARLIER_SETTING, module.__name__
    assert table("decoupled", "earlier_diloco") == decoupled.EARLIER_DILOCO
    assert table("decoupled", "earlier_decoupled") == decoupled.EARLIER_DECOUPLED
    assert table("beyond", "base") == beyond.BASE and table("beyond", "size_base") == beyond.SIZE_BASE
    assert table("survivors", "settings") == survivors.SETTINGS


def test_wan_pins_current_settings() -> None:
    """``atoll bench wan`` (a command, in the package) pins its earlier defaults in the code: the same check."""
    assert set(wan.EARLIER_SETTING) <= set(catalog())
    build_config(overrides=wan.EARLIER_SETTING)


def via_train_once(settings: dict[str, Any]) -> TrainConfig:
    """The config :func:`atoll.benchmarks.common.train_once` trains ``settings`` with."""
    return build_config(base={"progress": False, "threads": 1, **settings}, overrides={"out": "/tmp/run"})


def via_cli(flags: list[str]) -> TrainConfig:
    """The config ``atoll train FLAGS`` trains with (as the command builds it)."""
    args = build_parser().parse_args(["train", *flags])
    return build_config(args.config, {k: v for k, v in vars(args).items() if k in catalog()})


def assert_keeps(config: TrainConfig, pinned: dict[str, Any], own: dict[str, Any], run: str) -> None:
    """``config`` holds every pinned setting its strategy and runtime read that the run does not set itself, and
    the run's own (``config.json`` holds only the settings the run reads)."""
    got = json.loads(config.model_dump_json())
    want = applicable({**pinned, **{k: str(v) if isinstance(v, Path) else v for k, v in own.items()}})
    diff = {k: (v, got[k]) for k, v in want.items() if got[k] != v}
    assert not diff, f"{run}: (pinned, built) differ: {diff}"


def test_diloco_vs_ddp_runs(tmp_path: Path) -> None:
    for name, own in diloco_vs_ddp.planned_runs(600, tmp_path):
        if name == "default_cli":  # `atoll train` with no argument then; the earlier defaults as flags now
            config = via_cli(["--no-progress", *diloco_vs_ddp.cli_flags(diloco_vs_ddp.pinned(own))])
        else:
            config = via_train_once(diloco_vs_ddp.pinned(own))
        assert_keeps(config, diloco_vs_ddp.EARLIER_SETTING, own, name)


def test_streaming_codecs_and_demo_sweep_runs() -> None:
    for name, own in streaming_codecs.planned_runs(600, 300):
        assert_keeps(via_train_once(streaming_codecs.pinned(own)), streaming_codecs.EARLIER_SETTING, own, name)
    for name, own in demo_sweep.planned_runs(600, 300, demo_sweep.LRS[0], demo_sweep.FLOORS[0]):
        assert_keeps(via_train_once(demo_sweep.pinned(own)), demo_sweep.EARLIER_SETTING, own, name)


def test_decoupled_runs() -> None:
    for name, own in decoupled.planned_runs(decoupled.parse_args(["--train-sync"])):
        earlier = {**decoupled.EARLIER_SETTING,
                   **(decoupled.EARLIER_DILOCO if own.get("strategy") == "diloco" else {}),
                   **(decoupled.EARLIER_DECOUPLED if own.get("strategy", "decoupled") == "decoupled" else {})}
        assert_keeps(via_train_once(decoupled.pinned(own)), earlier, own, name)


def test_overhead_runs() -> None:
    (name, own), = overhead.planned_runs(overhead.parse_args([]))
    assert_keeps(build_config(base=overhead.pinned(own)), overhead.EARLIER_SETTING, own, name)


def test_wan_runs() -> None:
    parser = argparse.ArgumentParser()
    wan.add_arguments(parser)
    args = parser.parse_args([])
    for name, own in wan.planned_runs(args):
        settings = wan._settings(args, own["strategy"], own["sync_every"])  # what one_run trains
        assert settings == wan.pinned(own)
        # the ranks' command line: `atoll train --runtime collective ...` (run_in_wan)
        flags = wan._flags(applicable({**settings, "runtime": "collective", "progress": False, "out": "/tmp/run"}))
        got = json.loads(via_cli(flags).model_dump_json())
        read = applicable({**got})
        diff = {k: (v, got[k]) for k, v in settings.items() if k in read and got[k] != v}
        assert not diff, f"{name}: (pinned, built) differ: {diff}"
