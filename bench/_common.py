"""Shared helpers of the benchmark scripts: run a config once (cached by name), write JSON and a table.

Each benchmark writes ``bench/out/<suite>/<run>/`` (a normal atoll run folder) for every run, then
``bench/out/<suite>/results.json`` and ``results.md``. A run whose ``summary.json`` exists is not
run again, so an interrupted benchmark continues where it stopped; ``--fresh`` reruns everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from atoll.bench.suite import run_matches
from atoll.config import build_config
from atoll.train import train

OUT = Path(__file__).resolve().parent / "out"


def parse_args(description: str, table_steps: bool = False, sweep_steps: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    if sweep_steps:
        parser.add_argument("--sweep-steps", type=int, default=None, help="inner steps of the sweeps")
    if table_steps:
        parser.add_argument("--table-steps", type=int, default=None, help="inner steps of the codec table")
    parser.add_argument("--fresh", action="store_true", help="rerun every run, ignoring cached summaries")
    parser.add_argument("--steps", type=int, default=600, help="inner steps per island [600]")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/<suite>]")
    return parser.parse_args()


def run(suite_dir: Path, name: str, fresh: bool = False, **settings: Any) -> dict[str, Any]:
    """Train one configuration into ``suite_dir/name`` (or reuse its summary); return the summary."""
    out = suite_dir / name
    summary_path = out / "summary.json"
    suite_dir.mkdir(parents=True, exist_ok=True)
    lock = suite_dir / f".{name}.lock"
    while True:  # another benchmark process may be training the same run: wait for it, then reuse it
        if summary_path.is_file() and not fresh and run_matches(out, settings):
            return json.loads(summary_path.read_text())
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            break
        except FileExistsError:
            if not _alive(lock):
                lock.unlink(missing_ok=True)
            else:
                time.sleep(10)
    try:
        if out.exists():
            shutil.rmtree(out)
        print(f"[bench] {name}: {settings}", file=sys.stderr, flush=True)
        # one torch thread per run: benchmarks often share the 2 cores with another run, and two OpenMP
        # pools spinning on 2 cores slow both many-fold
        return train(build_config(overrides={"progress": False, "threads": 1, **settings, "out": str(out)}))
    finally:
        lock.unlink(missing_ok=True)


def _alive(lock: Path) -> bool:
    try:
        pid = int(lock.read_text() or "0")
        if pid <= 0:
            return False
        os.kill(pid, 0)
        return True
    except (ValueError, ProcessLookupError, FileNotFoundError):
        return False


def pct(a: float, b: float) -> float:
    """Relative gap of ``a`` against ``b`` in percent (positive: ``a`` is worse for a loss)."""
    return 100.0 * (a - b) / b


def write_results(suite_dir: Path, results: dict[str, Any], columns: list[tuple[str, str]],
                  rows: list[dict[str, Any]], title: str, notes: list[str] | None = None) -> str:
    """Write ``results.json`` and ``results.md`` (a Markdown table) into ``suite_dir``; return the table."""
    suite_dir.mkdir(parents=True, exist_ok=True)
    (suite_dir / "results.json").write_text(json.dumps(results, indent=2))
    lines = [f"### {title}", "", "| " + " | ".join(h for h, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(key)) for _, key in columns) + " |")
    lines += [""] + [f"- {n}" for n in notes or []]
    table = "\n".join(lines) + "\n"
    (suite_dir / "results.md").write_text(table)
    return table


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1e6:
            return f"{v / 1e6:,.1f} M"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)
