"""The service's settings are fields of its runtime's config: one TOML file for the syncer and every island, each
command setting aside the other's own settings from the file and refusing them as flags (no process started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.cli import build_parser, main
from atoll.config import build_config
from atoll.config.runtimes import ISLAND_ONLY, SYNCER_ONLY, ServiceConfig
from atoll.errors import AtollError, ConfigError
from atoll.runtime.service.commands import build


def _run_toml(tmp_path: Path) -> Path:
    """A run.toml shared by the syncer and the islands: run settings, the syncer's and the islands' own."""
    for name in ("cert.pem", "key.pem", "island_1.token"):
        (tmp_path / name).write_text("-----BEGIN X-----\n")
    toml = tmp_path / "run.toml"
    toml.write_text(f'''strategy = "decoupled"
runtime = "service"
islands = 2
steps = 10
model = "micro"
fragments = 2
sync_every = 4
batch_size = 4
out = "{tmp_path / 'out'}"
listen = "0.0.0.0:7171"
credentials = "{tmp_path / 'creds'}"
tls_cert = "{tmp_path / 'cert.pem'}"
tls_key = "{tmp_path / 'key.pem'}"
give_up_s = 30
syncer = ["syncer.example.org:7171"]
credential = "{tmp_path / 'island_1.token'}"
tls_server_name = "syncer.example.org"
ranks_per_island = 2
slice_transfer = "leader"
''')
    return toml


def _built(*argv: str) -> ServiceConfig:
    config = build(build_parser().parse_args(list(argv)))
    assert isinstance(config.runtime_config, ServiceConfig)
    assert config.strategy == "decoupled" and config.strategy_config.fragments == 2
    return config.runtime_config


def test_syncer_reads_its_address_and_tls_files_from_the_toml_file(tmp_path: Path) -> None:
    """``atoll syncer --config run.toml``: its listen address, TLS files and credentials folder come from the file;
    the islands' own settings in the same file are set aside (their defaults)."""
    toml = _run_toml(tmp_path)
    service = _built("syncer", "--config", str(toml))
    assert service.listen == "0.0.0.0:7171"
    assert service.tls_cert == tmp_path / "cert.pem" and service.tls_key == tmp_path / "key.pem"
    assert service.credentials == tmp_path / "creds" and service.give_up_s == 30.0
    assert service.syncer is None and service.credential is None and service.tls_server_name is None
    assert service.ranks_per_island == 1 and service.slice_transfer == "ranks"  # an island job's own: set aside
    assert _built("syncer", "--config", str(toml), "--listen", "127.0.0.1:7272").listen == "127.0.0.1:7272"


def test_island_reads_its_settings_from_the_same_file(tmp_path: Path) -> None:
    toml = _run_toml(tmp_path)
    service = _built("island", "--config", str(toml), "--island", "1")
    assert service.syncer == ["syncer.example.org:7171"] and service.island == 1
    assert service.credential == tmp_path / "island_1.token" and service.tls_server_name == "syncer.example.org"
    assert service.ranks_per_island == 2 and service.slice_transfer == "leader" and service.give_up_s == 30.0
    assert service.listen == "127.0.0.1:7070" and service.tls_cert is None  # the syncer's own: set aside
    assert service.credentials is None and service.emulate_step_s is None
    assert _built("island", "--config", str(toml), "--island", "1", "--emulate-step-s", "0.4").emulate_step_s == 0.4
    assert "emulate_step_s" in ISLAND_ONLY  # an island job's own: no part of the run's record


def test_an_emulated_step_waits_out_the_rest_of_its_least_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--emulate-step-s 0.5``: each inner step starts at least 0.5 s after the previous one started; a step
    already longer is not made up for; without the setting nothing waits."""
    from atoll.runtime.service import island as island_job

    clock = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(island_job.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(island_job.time, "sleep", sleep)
    pace = island_job.StepPace(0.5)
    pace.wait()  # the first step: nothing to wait for
    clock[0] += 0.2  # a 0.2 s step
    pace.wait()
    clock[0] += 0.8  # a 0.8 s step: longer than the least time
    pace.wait()
    clock[0] += 0.1
    pace.wait()
    assert slept == [pytest.approx(0.3), pytest.approx(0.4)] and pace.waited_s == pytest.approx(0.7)
    free = island_job.StepPace(None)
    free.wait(), free.wait()
    assert len(slept) == 2 and free.waited_s == 0.0


@pytest.mark.parametrize(("argv", "line"), [
    (["syncer", "--plaintext"], "plaintext: atoll syncer does not use it (only atoll island); drop --plaintext"),
    (["syncer", "--island", "0"], "island: atoll syncer does not use it (only atoll island); drop --island"),
    (["syncer", "--ranks-per-island", "2"],
     "ranks_per_island: atoll syncer does not use it (only atoll island); drop --ranks-per-island"),
    (["island", "--listen", "0.0.0.0:7070"], "listen: atoll island does not use it (only atoll syncer); drop --listen"),
    (["island", "--shard", "1"], "shard: atoll island does not use it (only atoll syncer); drop --shard"),
    (["syncer", "--emulate-step-s", "0.5"],
     "emulate_step_s: atoll syncer does not use it (only atoll island); drop --emulate-step-s"),
])
def test_the_other_commands_flag_is_refused_in_one_line(argv: list[str], line: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--steps", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"atoll: error: {line}"]


@pytest.mark.parametrize(("argv", "field"), [
    (["--island", "0", "--credential", "TOKEN"], "syncer"),
    (["--syncer", "127.0.0.1:7070", "--credential", "TOKEN"], "island"),
    (["--syncer", "127.0.0.1:7070", "--island", "0"], "credential"),
])
def test_an_island_without_a_required_setting_says_which(tmp_path: Path, argv: list[str], field: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "island_0.token"
    token.write_text("a" * 32)
    argv = [str(token) if a == "TOKEN" else a for a in argv]
    assert main(["island", *argv, "--steps", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"atoll: error: {field}: atoll island needs it; pass --{field} "), err


@pytest.mark.parametrize(("settings", "field"), [
    ({"listen": "nohost"}, "listen"),
    ({"listen": "0.0.0.0:7070"}, "listen"),  # other hosts can reach it, no TLS, not --insecure
    ({"shards": "127.0.0.1:7070,nohost"}, "shards"),
    ({"shards": "127.0.0.1:7070,127.0.0.1:7071", "shard": 2}, "shard"),
    ({"shard": 1}, "shard"),
    ({"tls_cert": "MISSING"}, "tls_cert"),
    ({"tls_cert": "FILE"}, "tls_cert"),  # without --tls-key
    ({"syncer": "10.1.2.3:7070", "plaintext": True}, "syncer"),
    ({"tls_ca": "FILE", "plaintext": True}, "tls_ca"),
    ({"credential": "MISSING"}, "credential"),
    ({"give_up_s": 0}, "give_up_s"),
    ({"emulate_step_s": 0}, "emulate_step_s"),
])
def test_service_settings_are_checked_by_their_config(tmp_path: Path, settings: dict, field: str) -> None:
    (tmp_path / "file.pem").write_text("x")
    paths = {"FILE": str(tmp_path / "file.pem"), "MISSING": str(tmp_path / "none.pem")}
    settings = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in settings.items()}
    with pytest.raises(ConfigError) as e:
        build_config(overrides={"strategy": "decoupled", "runtime": "service", "fragments": 2, **settings})
    assert str(e.value).startswith(f"{field}: ") and "\n" not in str(e.value), str(e.value)
    assert ServiceConfig(listen="0.0.0.0:7070", insecure=True).listen == "0.0.0.0:7070"


def test_the_service_settings_are_not_atoll_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``atoll train --help`` lists none of the two commands' own settings; one in train's TOML file is refused,
    naming the command that reads it."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for name in (*SYNCER_ONLY, *(n for n in ISLAND_ONLY if n in ("syncer", "credential", "plaintext")), "give_up_s"):
        assert f"--{name.replace('_', '-')} " not in text, name
    toml = tmp_path / "run.toml"
    toml.write_text('listen = "127.0.0.1:7070"\n')
    with pytest.raises(ConfigError) as e:
        build_config(toml)
    assert str(e.value) == (f"listen: the local runtime does not use it (only service: atoll syncer); drop 'listen' "
                            f"from {toml}")
    with pytest.raises(AtollError, match="^runtime: "):
        build(build_parser().parse_args(["syncer", "--runtime", "local"]))


@pytest.mark.parametrize("strategy", [None, "diloco", "decoupled"])
def test_atoll_train_under_the_service_runtime_names_the_commands_that_run_it(strategy: str | None) -> None:
    """``atoll train --runtime service`` is answered in one line naming ``atoll syncer`` and ``atoll island``,
    whatever the strategy (not first with advice to change the strategy, then with this)."""
    from conftest import run_cli

    for args in (["--runtime", "service", *(["--strategy", strategy] if strategy else [])],
                 ["--resume", "no-such-run", "--runtime", "service"]):  # also before a resume's checks
        r = run_cli("train", *args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("atoll: error: runtime: service is run by 'atoll syncer' and 'atoll island'")
