"""What every benchmark shares (atoll.benchmarks.common): the run cache, the folder guard, the results writer, and
the scripts under bench/ (the studies, and bench/wan.py, the launcher of ``atoll bench wan``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from atoll.benchmarks import common, folders
from atoll.benchmarks.common import default_out, markdown_table, train_once, write_results
from atoll.benchmarks.folders import check_out_folder, clear_run_dir
from atoll.errors import ConfigError

REPO = Path(__file__).parents[1]


def test_clear_run_dir_removes_only_what_atoll_wrote(tmp_path: Path) -> None:
    clear_run_dir(tmp_path / "absent")  # nothing there: nothing to do
    for marker in ("config.json", "metrics.jsonl", "checkpoints"):
        run = tmp_path / f"run-{marker}"
        (run / "checkpoints").mkdir(parents=True) if marker == "checkpoints" else run.mkdir()
        if marker != "checkpoints":
            (run / marker).write_text("{}")
        (run / "report.png").write_text("")
        clear_run_dir(run)
        assert not run.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    clear_run_dir(empty)
    assert not empty.exists()
    wan = tmp_path / "wan-run"  # a benchmark's own files count when it names them
    wan.mkdir()
    (wan / "rank0.log").write_text("")
    clear_run_dir(wan, markers=("rank0.log",))
    assert not wan.exists()


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_clear_run_dir_never_deletes_a_users_folder(tmp_path: Path, kind: str) -> None:
    user = tmp_path / "mine"
    if kind == "folder":
        user.mkdir()
        (user / "thesis.tex").write_text("precious")
    else:
        user.write_text("precious")
    with pytest.raises(ConfigError, match="not an atoll run folder") as e:
        clear_run_dir(user)
    assert "\n" not in str(e.value)
    assert (user / "thesis.tex" if kind == "folder" else user).read_text() == "precious"


@pytest.mark.slow
def test_suite_out_keeps_a_users_folder(tmp_path: Path) -> None:
    """The reported bug: a folder under --out named like a run was deleted before training."""
    (tmp_path / "ddp").mkdir()
    (tmp_path / "ddp" / "notes.txt").write_text("precious")
    r = run_cli("bench", "suite", "--quick", "--out", str(tmp_path), "--only", "ddp")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: out:") and "left untouched" in lines[0]
    assert (tmp_path / "ddp" / "notes.txt").read_text() == "precious"
    assert not list(tmp_path.glob(".*.lock"))


@pytest.mark.slow
def test_script_out_keeps_a_users_folder(tmp_path: Path) -> None:
    (tmp_path / "a_decoupled_free").mkdir()
    (tmp_path / "a_decoupled_free" / "notes.txt").write_text("precious")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "decoupled.py"), "--steps", "20", "--model", "micro",
                        "--fragments", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("decoupled: error: out:")
    assert (tmp_path / "a_decoupled_free" / "notes.txt").read_text() == "precious"


@pytest.mark.slow
def test_train_once_reuses_a_finished_run(fast_config: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    settings = {k: v for k, v in fast_config.items() if k != "out"}
    suite = tmp_path / "suite"
    first = train_once(suite, "run", **settings)
    assert "[bench] run:" in capsys.readouterr().err
    assert json.loads((suite / "run" / "config.json").read_text())["threads"] == 1
    assert train_once(suite, "run", **settings) == first  # reused: nothing trained
    assert "[bench] run:" not in capsys.readouterr().err
    assert not list(suite.glob(".*.lock"))
    # a lockstep run is reused only with its clock trace (re-timing needs it); other settings: trained again
    (suite / "run" / "clock_trace.json").unlink()
    train_once(suite, "run", tag="suite", **settings)
    assert "[suite] run:" in capsys.readouterr().err and (suite / "run" / "clock_trace.json").is_file()
    train_once(suite, "run", **{**settings, "seed": 1})
    assert "[bench] run:" in capsys.readouterr().err
    assert json.loads((suite / "run" / "config.json").read_text())["seed"] == 1


def test_clear_run_dir_keeps_a_run_with_a_users_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "my_analysis.txt").write_text("precious")
    with pytest.raises(ConfigError, match=r"files atoll did not write \('my_analysis.txt'\)"):
        clear_run_dir(run)
    assert (run / "my_analysis.txt").read_text() == "precious" and (run / "config.json").is_file()


#: a run folder as atoll writes it: a run with two checkpoints (one being written, one per rank), the decoupled
#: syncer's, TensorBoard's events, a W&B run, the Ray runtime's pid files, the WAN benchmark's logs
ATOLL_TREE = (
    "config.json", "metrics.jsonl", "summary.json", "report.png", "clock_trace.json", ".atoll.lock",
    ".summary.json.tmp", "checkpoints/.latest.tmp", "wan.json", "rank0.log", "rank1.log",
    *(f"checkpoints/step_000000{n}/{f}" for n in (2, 4) for f in (
        "state.json", "state.safetensors", "model/config.json", "model/generation_config.json",
        "model/model.safetensors", "model/tokenizer.json", "model/tokenizer_config.json")),
    "checkpoints/.tmp-step_0000006-ab_3x9/state.safetensors",
    *(f"checkpoints/step_0000004/ranks/rank_0000{r}/{f}" for r in (0, 1)  # the collective runtime's per-rank one
      for f in ("state.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json")),
    "syncer/checkpoints/step_0000002/state.json", "syncer/checkpoints/step_0000002/state.safetensors",
    "tensorboard/events.out.tfevents.1733000000.host.123.0",
    "wandb/atoll-run-id", "wandb/debug.log", "wandb/run-20241201_120000-abc/files/config.yaml",
    "ray/syncer.pid", "ray/island_0.pid", "ray/.island_1.pid.tmp",
)


def _atoll_tree(run: Path) -> None:
    import os

    for rel in ATOLL_TREE:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("")
    os.symlink("step_0000004", run / "checkpoints" / "latest")


def test_clear_run_dir_removes_every_file_atoll_writes_at_any_depth(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _atoll_tree(run)
    assert folders.foreign_files(run, ("wan.json", "rank0.log"), (r"rank\d+\.log",)) == []
    clear_run_dir(run, markers=("wan.json", "rank0.log"), patterns=(r"rank\d+\.log",))
    assert not run.exists()


@pytest.mark.parametrize("mine", ["checkpoints/MY_NOTES.txt", "tensorboard/my_own_log.txt", "rank_my_notes.log",
                                  "checkpoints/step_0000004/model/notes.md", "syncer/notes", "wandb/notes.txt",
                                  "checkpoints/step_0000004/my_dir/a.txt", "checkpoints/my_empty_dir/"])
def test_clear_run_dir_keeps_a_users_file_nested_in_a_run(tmp_path: Path, mine: str) -> None:
    """The reported bug: a user's file inside checkpoints/ or tensorboard/, or a rank*.log of theirs, was deleted
    with the run (only the top-level names were checked, and any rank*.log counted as atoll's)."""
    run = tmp_path / "run"
    _atoll_tree(run)
    if mine.endswith("/"):
        (run / mine).mkdir()
    else:
        (run / mine).parent.mkdir(parents=True, exist_ok=True)
        (run / mine).write_text("precious")
    first = mine.rstrip("/") if "my_dir" not in mine else "checkpoints/step_0000004/my_dir"
    with pytest.raises(ConfigError) as e:
        clear_run_dir(run, markers=("wan.json", "rank0.log"), patterns=(r"rank\d+\.log",))
    assert str(e.value) == (f"out: '{run}' holds files atoll did not write ('{first}'), so it was left untouched; "
                            "move them away or pass another --out")
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == sorted(
        [*ATOLL_TREE, *([] if mine.endswith("/") else [mine])])  # nothing was removed


def test_a_trained_run_folder_holds_only_files_atoll_writes(fast_config: dict, tmp_path: Path) -> None:
    """The list of atoll's files (RUN_PATHS) stays true to what a run writes: a run with checkpoints is cleared."""
    from atoll.config import build_config
    from atoll.training import train

    out = tmp_path / "run"
    train(build_config(overrides={**fast_config, "steps": 4, "checkpoint_every": 2, "eval_every": 4,
                                  "out": str(out)}))
    assert (out / "checkpoints" / "step_0000004" / "model" / "model.safetensors").is_file()
    assert folders.foreign_files(out) == []


def test_check_out_folder(tmp_path: Path) -> None:
    check_out_folder(tmp_path / "new")  # absent: fine
    (tmp_path / "empty").mkdir()
    check_out_folder(tmp_path / "empty")
    user = tmp_path / "user"
    user.mkdir()
    (user / "results.txt").write_text("mine")
    with pytest.raises(ConfigError, match="^out: .* left untouched"):
        check_out_folder(user)
    (tmp_path / "bench" / "run").mkdir(parents=True)
    (tmp_path / "bench" / "run" / "config.json").write_text("{}")
    check_out_folder(tmp_path / "bench")  # holds an atoll run
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_out_folder(tmp_path / "afile", "suite")


def test_check_out_folder_keeps_results_files_no_benchmark_wrote(tmp_path: Path) -> None:
    """results.json and results.md are written over at the end: only a benchmark's (a JSON object, a table)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    (tmp_path / "results.md").write_text("important")
    with pytest.raises(ConfigError) as e:
        check_out_folder(tmp_path)
    assert str(e.value) == (f"out: '{tmp_path / 'results.md'}' is not a benchmark's results file (no Markdown "
                            "table), so it was left untouched; move it away or pass another --out")
    (tmp_path / "results.md").write_text(markdown_table([("run", "run")], [{"run": "a"}], "T"))
    (tmp_path / "results.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"results.json' is not a benchmark's results file \(not a JSON object\)"):
        check_out_folder(tmp_path)
    write_results(tmp_path, {"rows": []}, [("run", "run")], [{"run": "a"}])
    check_out_folder(tmp_path)  # a benchmark's own: written over
    assert (tmp_path / "run" / "config.json").read_text() == "{}"


def _wan_args(out: Path, fresh: bool = False):  # noqa: ANN202
    import argparse

    from atoll.benchmarks.wan import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--steps", "10", "--sync-every", "10", "--strategies", "ddp", "--bandwidths", "100", "--model", "micro",
            "--out", str(out)]
    return parser.parse_args(argv + (["--fresh"] if fresh else []))


def _users_wan_folder(out: Path) -> None:
    """The reported case: a folder named like a run of the benchmark, with the user's config.json and log."""
    (out / "ddp-100mbit").mkdir(parents=True)
    (out / "ddp-100mbit" / "config.json").write_text('{"mine":1}')
    (out / "ddp-100mbit" / "rank0.log").write_text("mine")


def test_bench_wan_checks_its_out_folder_as_the_suite_does(tmp_path: Path) -> None:
    """bench wan deleted a folder it did not write and wrote over the user's results.md: every run folder it
    would train must be one it trained there (its registry), holding only atoll's files; checked up front."""
    from atoll.benchmarks.wan import check_out

    out = tmp_path / "wan"
    check_out(_wan_args(out))  # new: fine
    _users_wan_folder(out)
    with pytest.raises(ConfigError) as e:
        check_out(_wan_args(out))
    assert str(e.value) == (f"out: '{out / 'ddp-100mbit'}' holds a run that no atoll benchmark trained in this "
                            "folder (it is not in .atoll-bench.json), so it was left untouched; move it away or "
                            "pass another --out")
    (out / "results.md").write_text("important")
    with pytest.raises(ConfigError, match="results.md' is not a benchmark's results file"):
        check_out(_wan_args(out))
    assert (out / "results.md").read_text() == "important"
    assert (out / "ddp-100mbit" / "config.json").read_text() == '{"mine":1}'
    (out / "results.md").unlink()
    (out / "ddp-100mbit" / "wan.json").write_text("{}")  # a finished run: reused, not replaced, so not refused
    check_out(_wan_args(out))
    with pytest.raises(ConfigError, match="no atoll benchmark trained"):
        check_out(_wan_args(out, fresh=True))
    folders.register(out, "ddp-100mbit")  # a run this benchmark trained there: replaced by --fresh
    check_out(_wan_args(out, fresh=True))
    (out / "ddp-100mbit" / "rank0_notes.txt").write_text("mine")  # but never with a user's file in it
    with pytest.raises(ConfigError, match=r"files atoll did not write \('rank0_notes.txt'\)"):
        check_out(_wan_args(out, fresh=True))


def test_bench_wan_refuses_a_users_folder_before_anything_runs(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The command: one line, status 2, the user's files as they were, nothing written (no namespace needed)."""
    from atoll.benchmarks import wan

    monkeypatch.setattr(wan, "unavailable_reason", lambda: None)  # as root with network namespaces
    monkeypatch.setattr(wan, "EmulatedWan", None)  # reached only if a run started
    out = tmp_path / "wan"
    _users_wan_folder(out)
    (out / "results.md").write_text("important")
    r = run_cli("bench", "wan", "--steps", "10", "--sync-every", "10", "--strategies", "ddp", "--bandwidths", "100",
                "--model", "micro", "--train-arg", "vocab_size=512", "--out", str(out))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"atoll: error: out: '{out / 'results.md'}' is not a benchmark's results file (no Markdown table), so it "
        "was left untouched; move it away or pass another --out"), r.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "ddp-100mbit", "ddp-100mbit/config.json", "ddp-100mbit/rank0.log", "results.md"]
    assert (out / "results.md").read_text() == "important"
    assert (out / "ddp-100mbit" / "config.json").read_text() == '{"mine":1}'


def test_a_lock_whose_pid_was_reused_is_stale(tmp_path: Path) -> None:
    import os

    lock = tmp_path / ".run.lock"
    lock.write_text(common._lock_text(os.getpid()))
    assert common._lock_alive(lock)  # this very process
    lock.write_text(f"{os.getpid()} 1")  # the same pid, started at another time: another process
    assert not common._lock_alive(lock)
    lock.write_text("999999999 5")
    assert not common._lock_alive(lock)


@pytest.mark.slow
def test_train_once_never_loses_a_run(fast_config: dict, tmp_path: Path) -> None:
    settings = {k: v for k, v in fast_config.items() if k != "out"}
    suite = tmp_path / "suite"
    first = train_once(suite, "run", **settings)
    before = (suite / "run" / "summary.json").read_text()
    # bad settings are refused before the finished run is touched
    with pytest.raises(ConfigError, match="vocab_size"):
        train_once(suite, "run", **{**settings, "vocab_size": 10})
    # a run that fails while training (here: its corpus is missing) gives the previous run back
    with pytest.raises(Exception, match="data"):
        train_once(suite, "run", **{**settings, "data": str(tmp_path / "missing.txt")})
    assert (suite / "run" / "summary.json").read_text() == before
    assert not list(suite.glob(".run.previous")) and not list(suite.glob(".*.lock"))
    assert train_once(suite, "run", **settings) == first  # still reused
    # a run this folder's benchmarks did not train (the user's own) is never replaced
    (suite / "theirs").mkdir()
    for name in ("config.json", "metrics.jsonl"):
        (suite / "theirs" / name).write_text((suite / "run" / name).read_text())
    with pytest.raises(ConfigError, match="no atoll benchmark trained"):
        train_once(suite, "theirs", **settings)
    assert (suite / "theirs" / "config.json").is_file()


def test_markdown_table_formats() -> None:
    columns = [("run", "run"), ("loss", "loss"), ("bytes", "bytes"), ("pair", "pair"),
               ("gap", "gap", lambda v: f"{v:+.1f}%")]
    rows = [{"run": "a", "loss": 4.81234, "bytes": 138_700_000.0, "pair": [100, 130], "gap": 2.25},
            {"run": "b", "loss": 12.345, "bytes": 1234.5, "pair": None, "gap": "n/a"},
            {"run": "c", "loss": "", "bytes": "", "pair": "", "gap": ""}]
    table = markdown_table(columns, rows, "Title", ["one", "two"])
    assert table == ("### Title\n\n| run | loss | bytes | pair | gap |\n|---|---|---|---|---|\n"
                     "| a | 4.812 | 138.7 M | 100 / 130 | +2.2% |\n| b | 12.3 | 1,234 | - | n/a |\n| c | | | | |\n"
                     "\n- one\n- two\n")
    plain = markdown_table(columns[:1], rows[:1], notes=["command: x"], bullets=False)
    assert plain == "| run |\n|---|\n| a |\n\ncommand: x\n"


def test_write_results_writes_json_and_table(tmp_path: Path) -> None:
    table = write_results(tmp_path / "out", {"rows": [{"run": "a"}], "path": Path("x")}, [("run", "run")],
                          [{"run": "a"}], "T")
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == {"rows": [{"run": "a"}], "path": "x"}
    assert (tmp_path / "out" / "results.md").read_text() == table


def test_write_results_writes_strict_json(tmp_path: Path) -> None:
    results = {"a": math.nan, "b": [math.inf, 1.5, {"c": -math.inf, "d": (math.nan, 2)}], "e": "nan", "f": 3}
    write_results(tmp_path, results, [("a", "a")], [{"a": math.nan}])

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    assert json.loads((tmp_path / "results.json").read_text(), parse_constant=refuse) == {
        "a": None, "b": [None, 1.5, {"c": None, "d": [None, 2]}], "e": "nan", "f": 3}
    assert results["a"] != results["a"]  # the caller's results are left as they were


def test_default_out_is_the_repositorys_bench_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(REPO / "bench" / "decoupled.py")])
    assert default_out("decoupled") == REPO / "bench" / "out" / "decoupled"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["diloco_vs_ddp", "streaming_codecs", "demo_sweep", "decoupled", "overhead",
                                  "same_numbers", "wan", "fidelity", "gpu", "beyond", "codec_speed", "robust_merge",
                                  "service_transfer", "survivors", "wan_decoupled"])
def test_bench_scripts_run(name: str) -> None:
    r = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--out" in r.stdout
