"""The command line: every setting is a documented flag, shipped TOML files validate, report draws runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.cli import build_parser, main
from atoll.config import build_config
from atoll.config.applies import applicable, catalog
from atoll.errors import ConfigError
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_train_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, field in catalog().items():
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


def test_toml_types_are_strict_but_a_whole_number_is_a_float(tmp_path: Path) -> None:
    """A TOML file has types (a flag is text, converted): lr = 1 is a float, seq_len = "32" is not a number."""
    toml = tmp_path / "run.toml"
    toml.write_text("lr = 1\nlink_bandwidth_mbps = 10\ncompile = false\nsteps = 5\n")
    config = build_config(toml)
    assert config.strategy_config.lr == 1.0 and config.runtime_config.link_bandwidth_mbps == 10.0
    assert config.compile is False
    toml.write_text('seq_len = "32"\n')
    with pytest.raises(ConfigError) as e:
        build_config(toml, {"seq_len": "32"})  # refused even where a flag overrides it: the file is wrong
    assert str(e.value) == f"seq_len: the string '32' in '{toml}' is not a whole number; write seq_len = 32 (no quotes)"


def test_cross_field_error_names_the_field() -> None:
    with pytest.raises(ConfigError, match="^sync_every"):
        build_config(overrides={"strategy": "streaming", "fragments": 4, "sync_every": 2})


@pytest.mark.slow
def test_report_draws_several_runs(fast_config: dict, tmp_path: Path) -> None:
    from atoll.training import train

    a = train(build_config(overrides={**fast_config, "steps": 4, "eval_every": 2, "out": str(tmp_path / "a")}))
    b = train(build_config(overrides=applicable({**fast_config, "steps": 4, "eval_every": 2, "strategy": "ddp",
                                                 "out": str(tmp_path / "b")})))
    png = tmp_path / "cmp.png"
    assert main(["report", a["out"], b["out"], "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(tmp_path / "missing")]) == 2


def _metrics(folder: Path, lines: list[str]) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


EVAL = '{"event": "eval", "step": %d, "tokens": %d, "eval_loss": %.2f, "sim_wall_s": %.1f, "bytes_sent_per_island": 0}'


def test_report_reads_a_torn_last_line_and_refuses_a_damaged_file(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    start = '{"event": "start", "step": 0, "config": {"strategy": "diloco", "islands": 2}}'
    torn = _metrics(tmp_path / "torn", [start, EVAL % (0, 0, 6.2, 0.0), EVAL % (10, 640, 5.1, 1.0), '{"event": "ev'])
    assert main(["report", str(torn), "--out", str(tmp_path / "a.png")]) == 0  # the writer was killed mid-line
    garbage = _metrics(tmp_path / "garbage", [start, "garbage", EVAL % (10, 640, 5.1, 1.0)])
    nokey = _metrics(tmp_path / "nokey", [start, '{"event": "eval", "step": 3, "eval_loss": 5.0}'])
    empty = _metrics(tmp_path / "empty", [start])
    for folder, message in ((garbage, "line 2 of"), (nokey, "lacks tokens"), (empty, "no evaluation yet")):
        assert main(["report", str(folder), "--out", str(tmp_path / "b.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_fragments_beyond_a_presets_layers_are_refused_at_config_time() -> None:
    for strategy in ("streaming", "decoupled"):
        with pytest.raises(ConfigError, match="^fragments: 4 fragments for the micro model's 2 layers"):
            build_config(overrides={"strategy": strategy, "model": "micro"})
    build_config(overrides={"strategy": "streaming", "model": "micro", "fragments": 2})


@pytest.mark.slow
def test_a_run_that_never_trained_exits_1(fast_config: dict, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--data", fast_config["data"], "--cache-dir", fast_config["cache_dir"], "--model", "micro",
             "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--threads", "1", "--no-progress"]
    rc = main(["train", *flags, "--strategy", "decoupled", "--fragments", "2", "--islands", "2", "--steps", "20",
               "--chaos", "0.000001:1", "--out", str(tmp_path / "run")])
    assert rc == 1 and "stopped early with 0 tokens" in capsys.readouterr().err
    assert (tmp_path / "run" / "summary.json").is_file()  # the folder keeps what happened


def test_perplexity_of_a_diverged_loss_is_none() -> None:
    from atoll.job.metrics import perplexity

    assert perplexity(1.0) == pytest.approx(2.718281828)
    assert perplexity(1e6) is None and perplexity(float("nan")) is None


@pytest.mark.parametrize(("args", "line"), [
    (["train", "--sync-evry", "10"],
     "atoll: error: unrecognized arguments: --sync-evry 10 (did you mean --sync-every?); see 'atoll train --help'"),
    (["train", "--step", "4"], "atoll: error: unrecognized arguments: --step 4 (did you mean --steps?); "
                               "see 'atoll train --help'"),
    (["bench", "suite", "--qick"], "atoll: error: unrecognized arguments: --qick (did you mean --quick?); "
                                   "see 'atoll bench suite --help'"),
])
def test_an_unknown_or_shortened_flag_is_refused_by_its_subcommand_with_the_closest_flag(args: list[str],
                                                                                          line: str) -> None:
    """A prefix of a flag is not taken for it (``--step`` once trained with --steps), and the error names the
    subcommand's help and its closest flag."""
    r = run_cli(*args)
    assert r.returncode == 2 and r.stderr == line + "\n", r.stderr


def test_a_config_that_is_a_folder_is_named_as_one(tmp_path: Path) -> None:
    r = run_cli("train", "--config", str(tmp_path))
    assert r.returncode == 2 and r.stderr == f"atoll: error: config: '{tmp_path}' is a folder; pass a TOML file (see " \
                                             "configs/)\n"


@pytest.mark.parametrize("message", [
    "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "68719476736 bytes. Error code 12 (Cannot allocate memory)",
    "CUDA out of memory. Tried to allocate 20.00 GiB",
], ids=["cpu", "cuda"])
def test_running_out_of_memory_is_one_line_with_the_settings_to_lower(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       message: str) -> None:
    """torch's CPU allocator says "can't allocate memory", CUDA's "out of memory": both end the command with one
    line naming what to lower (exit status 1: the settings are valid, the machine is too small for them)."""
    import atoll.cli

    def fail(args: object) -> int:
        raise RuntimeError(message)

    monkeypatch.setattr(atoll.cli, "_cmd_train", fail)
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("atoll: error: out of memory; lower --batch-size") and err.count("\n") == 1, err
