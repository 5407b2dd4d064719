"""``atoll report``: labels that tell runs apart, where the PNG goes, training loss drawn beside held-out loss."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.figure
import pytest
from conftest import run_cli

from atoll.config import build_config
from atoll.job.report import plot_runs, run_labels


def _run(folder: Path, **settings: object) -> Path:
    """A run folder as atoll writes it: config.json, and metrics.jsonl with 3 evaluations and 2 train events."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(build_config(overrides=settings).model_dump_json(indent=2))
    events = [{"event": "eval", "step": 0, "tokens": 0, "eval_loss": 6.2, "sim_wall_s": 0.0,
               "bytes_sent_per_island": 0.0}]
    for step, loss, ev in ((10, 5.9, 5.8), (20, 5.5, 5.4)):
        common = {"step": step, "tokens": 64 * step, "sim_wall_s": step / 10, "bytes_sent_per_island": 1000.0 * step}
        events += [{"event": "train", "loss": loss, **common}, {"event": "eval", "eval_loss": ev, **common}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def test_labels_name_the_settings_in_which_runs_differ(tmp_path: Path) -> None:
    runs = [_run(tmp_path / "a"), _run(tmp_path / "b", outer_momentum=0.9),
            _run(tmp_path / "c", seq_len=64, data="/data/corpus.txt")]
    assert run_labels(runs) == ["diloco K=4 H=50", "diloco K=4 H=50 outer_momentum=0.9",
                                "diloco K=4 H=50 data=corpus.txt seq_len=64"]
    # a strategy's own defaults (streaming's int4 codec) are not a difference worth a label
    mixed = [_run(tmp_path / "d", strategy="ddp"), _run(tmp_path / "e", strategy="streaming")]
    assert run_labels(mixed) == ["ddp K=4", "streaming K=4 H=50 int4"]
    # the suite's two decoupled runs: one under a failure trace
    decoupled = [_run(tmp_path / "f", strategy="decoupled"), _run(tmp_path / "g", strategy="decoupled", chaos="90:10")]
    assert run_labels(decoupled) == ["decoupled K=4 H=50 int4", "decoupled K=4 H=50 int4 chaos=90:10"]


def test_runs_alike_in_every_setting_are_told_apart_by_folder_and_names_can_be_given(tmp_path: Path) -> None:
    runs = [_run(tmp_path / "first"), _run(tmp_path / "second")]
    assert run_labels(runs) == ["diloco K=4 H=50 (first)", "diloco K=4 H=50 (second)"]
    assert run_labels(runs, ["base", "again"]) == ["base", "again"]
    r = run_cli("report", *map(str, runs), "--names", "only-one")
    assert r.returncode == 2 and "names: 1 names for 2 runs" in r.stderr and r.stderr.count("\n") == 1


def test_report_writes_beside_the_runs_not_in_the_working_directory(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [_run(tmp_path / "runs" / "a"), _run(tmp_path / "runs" / "b", outer_momentum=0.9)]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = run_cli("report", str(runs[0]))
    assert r.returncode == 0 and (runs[0] / "report.png").read_bytes()[:4] == b"\x89PNG", r.stderr
    r = run_cli("report", *map(str, runs))
    assert r.returncode == 0 and (tmp_path / "runs" / "report.png").is_file(), r.stderr
    assert list(elsewhere.iterdir()) == []


def test_report_help_says_what_run_dir_is() -> None:
    r = run_cli("report", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "RUN_DIR the folder of an atoll run (its --out" in text and "--names" in text


def test_report_draws_training_loss_beside_held_out_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    plot_runs([_run(tmp_path / "a")], tmp_path / "out.png")
    tokens, time, sent = figures[0].axes
    held_out, training = tokens.lines
    assert list(held_out.get_ydata()) == [6.2, 5.8, 5.4] and list(training.get_ydata()) == [5.9, 5.5]
    assert list(time.lines[1].get_xdata()) == [1.0, 2.0] and list(sent.lines[1].get_xdata()) == [10000.0, 20000.0]
    assert training.get_color() == held_out.get_color()


def test_report_out_of_a_format_matplotlib_cannot_write_is_one_line(tmp_path: Path) -> None:
    run = _run(tmp_path / "a")
    notes = tmp_path / "notes.txt"
    notes.write_text("keep")
    r = run_cli("report", str(run), "--out", str(notes))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"atoll: error: out: '{notes}' is not an image file name") and "report.png" in r.stderr
    assert notes.read_text() == "keep"
    r = run_cli("report", str(run), "--out", str(tmp_path / "plot"))  # no suffix: a PNG, and the line says where
    assert (r.returncode == 0 and r.stdout.strip() == f"wrote {tmp_path / 'plot.png'}"
            and (tmp_path / "plot.png").is_file())
