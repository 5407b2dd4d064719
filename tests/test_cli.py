"""The command line: every setting is a documented flag, shipped TOML files validate, report draws runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.cli import build_parser, main
from atoll.config import TrainConfig, build_config
from atoll.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_train_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, field in TrainConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        assert field.description and field.description.split()[0] in text


@pytest.mark.parametrize("toml", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(toml: Path) -> None:
    config = build_config(toml)
    assert config.steps >= 1


def test_flags_override_toml(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nstrategy = "ddp"\nislands = 2\n')
    config = build_config(toml, {"islands": "3"})
    assert config.strategy == "ddp" and config.islands == 3


def test_cross_field_error_names_the_field() -> None:
    with pytest.raises(ConfigError, match="^sync_every"):
        build_config(overrides={"strategy": "streaming", "fragments": 4, "sync_every": 2})


@pytest.mark.slow
def test_report_draws_several_runs(fast_config: dict, tmp_path: Path) -> None:
    from atoll.train import train

    a = train(build_config(overrides={**fast_config, "steps": 4, "eval_every": 2, "out": str(tmp_path / "a")}))
    b = train(build_config(overrides={**fast_config, "steps": 4, "eval_every": 2, "strategy": "ddp",
                                      "out": str(tmp_path / "b")}))
    png = tmp_path / "cmp.png"
    assert main(["report", a["out"], b["out"], "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(tmp_path / "missing")]) == 2
