"""What a run leaves for others: checkpoints readable by another user, ``checkpoints/latest`` a path that
``from_pretrained`` takes, a clock trace that survives a resume, and a final table without repeats."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from atoll.job.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from atoll.job.metrics import summary_rows
from atoll.runtime.network import ClockTrace, Link, SimClock, replay


def _modes(folder: Path) -> set[tuple[str, int]]:
    return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode))
            for p in [folder, *folder.rglob("*")] if not p.is_symlink()}


def test_checkpoints_are_readable_by_other_users_and_latest_is_a_link(tmp_path: Path) -> None:
    from atoll.job.model import build_model

    model = build_model("micro", 512, 32, 0)
    old = os.umask(0o022)
    try:
        first = save_checkpoint(tmp_path, 10, {"w": torch.arange(4.0)}, model=model)
        second = save_checkpoint(tmp_path, 20, {"w": torch.arange(4.0) + 1}, model=model)
    finally:
        os.umask(old)
    root = tmp_path / "checkpoints"
    assert _modes(root / "step_0000020") == {("dir", 0o755), ("file", 0o644)}  # safetensors wrote 0600 before
    assert first.is_dir()  # kept (keep=2)
    latest = root / "latest"
    assert latest.is_symlink() and os.readlink(latest) == "step_0000020"
    assert (latest / "model" / "model.safetensors").is_file()  # a path from_pretrained takes
    assert latest_checkpoint(tmp_path) == second
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))[1]["w"], torch.arange(4.0) + 1)
    latest.unlink()  # a run folder of an earlier atoll: latest was a text file naming the folder
    latest.write_text("step_0000010\n")
    assert latest_checkpoint(tmp_path) == first
    # a copy of the run folder that followed the link (cp -r): latest is a folder; the next checkpoint mends it
    latest.unlink()
    shutil.copytree(second, latest)
    assert latest_checkpoint(tmp_path) == second
    third = save_checkpoint(tmp_path, 30, {"w": torch.arange(4.0)})
    assert latest.is_symlink() and latest_checkpoint(tmp_path) == third


def test_rotation_touches_only_the_checkpoints_atoll_wrote(tmp_path: Path) -> None:
    """A user's copies beside the checkpoints (``step_0000020_best``, ``step_0000020.bak``, ``step_7``) are
    never rotated away, read as the latest, nor make a folder count as holding a run."""
    from atoll.job.checkpoint import checkpoint_folders, new_run_dir

    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, 10, {"w": torch.arange(4.0)})
    second = save_checkpoint(tmp_path, 20, {"w": torch.arange(4.0) + 1})
    copies = [root / "step_0000020_best", root / "step_0000020.bak", root / "step_7"]
    for copy in copies:
        shutil.copytree(second, copy)
    (root / "step_0000099_notes.txt").write_text("mine")
    third = save_checkpoint(tmp_path, 30, {"w": torch.arange(4.0) + 2})
    save_checkpoint(tmp_path, 40, {"w": torch.arange(4.0) + 3})
    assert all(copy.is_dir() for copy in copies) and (root / "step_0000099_notes.txt").is_file()
    assert [p.name for p in checkpoint_folders(root)] == ["step_0000030", "step_0000040"]  # keep=2 of atoll's
    assert third.is_dir() and not (root / "step_0000010").exists()
    (root / "latest").unlink()  # no link: the newest of atoll's names, not a user's copy
    assert latest_checkpoint(tmp_path).name == "step_0000040"
    only_copies = tmp_path / "other"
    (only_copies / "checkpoints").mkdir(parents=True)
    shutil.copytree(copies[0], only_copies / "checkpoints" / "step_0000020_best")
    assert new_run_dir(only_copies, "diloco") == only_copies  # a user's copy is not a run


def test_a_clock_trace_restored_from_a_checkpoint_replays_as_the_whole_run() -> None:
    def steps(clock: SimClock, start: int, end: int) -> None:
        for step in range(start, end):
            clock.compute(0, 0.1 + 0.01 * step)
            clock.compute(1, 0.2)
            if step % 3 == 2:
                clock.collective(0.5, (1e6, 2))
            if step % 4 == 3:
                clock.mark(step + 1)

    whole = SimClock(2, trace=ClockTrace(2))
    steps(whole, 0, 6)
    state = whole.state_dict()  # mid-round: compute pending since the last collective
    steps(whole, 6, 12)
    resumed = SimClock(2, trace=ClockTrace(2))
    resumed.load_state_dict(state)
    steps(resumed, 6, 12)
    a, b = whole.trace.to_dict(), resumed.trace.to_dict()  # type: ignore[union-attr]
    assert b["complete"] and [e for e in a["events"] if e[0] != "c"] == [e for e in b["events"] if e[0] != "c"]
    link = Link.from_config(10.0, 50.0)
    ra, rb = replay(a, link), replay(b, link)
    assert rb["sim_wall_s"] == pytest.approx(ra["sim_wall_s"], rel=1e-12) and rb["marks"].keys() == {4, 8, 12}
    legacy = SimClock(2, trace=ClockTrace(2))  # a checkpoint written without its trace
    legacy.load_state_dict({k: v for k, v in state.items() if k != "trace"})
    assert legacy.trace.complete is False  # type: ignore[union-attr]


def _summary(runtime: str) -> dict:
    return {"strategy": "diloco", "islands": 2, "runtime": runtime, "params": 10, "tokens": 100,
            "initial_eval_loss": 6.0, "final_eval_loss": 5.0, "bytes_sent_per_island": 10.0,
            "ddp_bytes_per_island": 50.0, "reduction_vs_ddp": 5.0, "compute_s": 1.0, "sim_wall_s": 2.0,
            "wall_s": 2.1, "compute_utilization": 0.5, "link_bandwidth_mbps": 100.0}


@pytest.mark.parametrize("runtime", ["collective", "ray"])
def test_the_final_table_of_a_real_clock_shows_its_wall_time_once(runtime: str) -> None:
    rows = dict(summary_rows(_summary(runtime)))
    assert "real wall time" in rows and not any("simulated" in k or "real network" in k for k in rows)
    assert len(rows) == len(summary_rows(_summary(runtime)))  # no name twice
    local = dict(summary_rows(_summary("local")))
    assert local["simulated wall @ 100 Mbit/s"] == "2.0 s" and local["real wall time"] == "2.1 s"


def test_the_final_table_shows_what_a_method_did() -> None:
    rows = dict(summary_rows({**_summary("local"), "outer_agreement_mean": 0.6123, "outer_agreement_last": 0.5}))
    assert rows["outer agreement f̄ (mean / last round)"] == "0.612 / 0.500"
    rows = dict(summary_rows({**_summary("local"), "strategy": "sparseloco", "sparseloco_density": 0.0185,
                              "sparseloco_sent_energy": 0.2345}))
    assert rows["sparseloco density (entries a payload updates)"] == "1.85%"
    assert rows["sparseloco energy sent (share of the accumulator per round)"] == "23.4%"
    assert not any("agreement" in k or "density" in k for k in dict(summary_rows(_summary("local"))))


def test_model_help_names_every_preset() -> None:
    r = run_cli("train", "--help")
    text = " ".join(r.stdout.split())
    start = text.rindex("--model TEXT")  # its entry, after the usage line
    model_help = text[start:text.index("--init-from", start)]
    for preset in ("nano", "tiny", "20m", "125m", "1b", "micro"):
        assert preset in model_help, preset
