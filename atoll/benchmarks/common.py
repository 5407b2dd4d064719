"""What every benchmark shares: one run cache, one results writer, the common flags.

Not launched by itself; used by ``atoll bench suite`` (:mod:`atoll.benchmarks.suite`), ``atoll bench wan``
(:mod:`atoll.benchmarks.wan`), ``atoll sweep`` (:mod:`atoll.benchmarks.sweep`) and the studies under the
repository's ``bench/`` folder (``python bench/<name>.py``: ``diloco_vs_ddp``, ``streaming_codecs``,
``demo_sweep``, ``decoupled``, ``overhead``, ``same_numbers`` and the others).

A benchmark writes ``<out>/<run>/`` (a normal atoll run folder) for every run, then ``<out>/results.json``
and ``<out>/results.md``. :func:`train_once` trains a run or reuses the finished one already there when
its ``config.json`` matches, so an interrupted benchmark continues where it stopped (``--fresh`` reruns
everything); two benchmark processes that need the same run take turns through a lock file, and the second
reuses the first's run. It never deletes a folder that atoll did not write (the guard of
:mod:`atoll.benchmarks.folders`).
:func:`write_results` writes ``results.json`` and the Markdown table of ``results.md``.

It imports the training code only when a run trains: ``atoll --help`` reaches it through the suite's flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from atoll.benchmarks.folders import check_benchmark_run, clear_run_dir, make_folder, register
from atoll.job.metrics import finite_or_none

#: a column of a results table: (header, key) or (header, key, formatter of the key's value)
Column = tuple[str, str] | tuple[str, str, Callable[[Any], str]]


# ----------------------------------------------------------------------------------------------------------
# where results go


def default_out(name: str) -> Path:
    """``bench/out/<name>`` of the repository: the default output folder of the script ``bench/<name>.py``.

    The repository is the one of the script being run (``python bench/<script>.py``: the folder beside it),
    else the checkout this package is imported from (an editable install), else ``bench/out/<name>`` under
    the current folder.
    """
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else Path()
    if script.parent.name == "bench" and (script.parent.parent / "pyproject.toml").is_file():
        return script.parent / "out" / name
    repo = Path(__file__).resolve().parents[2]
    if (repo / "bench").is_dir() and (repo / "pyproject.toml").is_file():
        return repo / "bench" / "out" / name
    return Path("bench") / "out" / name


def command_line(script: str) -> str:
    """The command that started this process, as a results file names it: ``python bench/<script> ARGS`` when
    run as that script, ``atoll ARGS`` through the CLI, else the program's own name and its arguments."""
    name = Path(sys.argv[0]).name
    head = f"python bench/{script}" if name == script else "atoll" if name in ("atoll", "cli.py") else name
    return " ".join([head, *sys.argv[1:]])


def study_settings(script: str | Path, table: str = "earlier") -> dict[str, Any]:
    """The settings a study pins: the table ``table`` of the TOML file beside the script (``bench/<name>.toml``
    for ``bench/<name>.py``), TrainConfig fields and their values (tests/test_bench_settings.py checks every
    such file against today's config)."""
    path = Path(script).resolve().with_suffix(".toml")
    settings = tomllib.loads(path.read_text(encoding="utf-8"))
    if not isinstance(settings.get(table), dict):
        raise KeyError(f"{path}: no [{table}] table of settings")
    return dict(settings[table])


# ----------------------------------------------------------------------------------------------------------
# flags


def add_common_arguments(parser: argparse.ArgumentParser, name: str, steps: int = 600,
                         steps_help: str = "inner steps per island") -> None:
    """``--fresh``, ``--steps`` (default ``steps``) and ``--out`` (default None: :func:`default_out` ``(name)``)."""
    parser.add_argument("--fresh", action="store_true", help="rerun every run, ignoring cached summaries")
    parser.add_argument("--steps", type=int, default=steps, help=f"{steps_help} [{steps}]")
    parser.add_argument("--out", type=Path, default=None, help=f"output folder [bench/out/{name}]")


def parse_args(description: str, name: str, argv: Sequence[str] | None = None, table_steps: bool = False,
               sweep_steps: bool = False) -> argparse.Namespace:
    """The flags of a script that trains runs: optionally ``--sweep-steps`` and ``--table-steps``, then
    :func:`add_common_arguments`. ``argv``: the arguments (default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=description)
    if sweep_steps:
        parser.add_argument("--sweep-steps", type=int, default=None, help="inner steps of the sweeps")
    if table_steps:
        parser.add_argument("--table-steps", type=int, default=None, help="inner steps of the codec table")
    add_common_arguments(parser, name)
    return parser.parse_args(argv)


def script_error(prog: str, error: Exception) -> int:
    """Print ``<prog>: error: <message>`` (one line) on stderr; return 2, the exit status of bad input."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2


def pct(a: float, b: float) -> float:
    """Relative gap of ``a`` against ``b`` in percent (positive: ``a`` is worse for a loss)."""
    return 100.0 * (a - b) / b


# ----------------------------------------------------------------------------------------------------------
# the run cache



def run_matches(out: Path, settings: dict[str, Any]) -> bool:
    """Whether the run folder ``out`` was trained with ``settings``: each key its strategy and runtime read
    equal in its ``config.json`` (a benchmark's shared settings, e.g. ``sync_every`` for ddp, are not saved by
    a run that does not read them: :func:`atoll.config.applies.applicable`)."""
    from atoll.config.applies import applicable

    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(config, dict) and all(config.get(k) == (str(v) if isinstance(v, Path) else v)
                                            for k, v in applicable(settings).items())


def finished(out: Path, settings: dict[str, Any]) -> bool:
    """Whether ``out`` holds a finished run of ``settings``: its ``summary.json``, a matching ``config.json``
    and, for a lockstep strategy on the ``local`` runtime, its ``clock_trace.json`` (which re-timing needs; an
    asynchronous strategy keeps its own event clock)."""
    from atoll.config.sections import RunSection
    from atoll.strategies.registry import spec

    strategy = settings.get("strategy", RunSection.model_fields["strategy"].default)
    runtime = settings.get("runtime", RunSection.model_fields["runtime"].default)
    traced = spec(strategy).lockstep is not None and runtime == "local"
    return read_summary(out) is not None and (not traced or (out / "clock_trace.json").is_file()) \
        and run_matches(out, settings) and _has_evals(out)


def _has_evals(out: Path) -> bool:
    """Whether the run's ``metrics.jsonl`` reads back with its evaluations (the curves are drawn from them)."""
    from atoll.errors import DataError
    from atoll.job.metrics import read_metrics

    try:
        return any(e["event"] == "eval" and isinstance(e.get("eval_loss"), int | float)
                   for e in read_metrics(out / "metrics.jsonl"))
    except (OSError, DataError):
        return False


#: what every finished run's summary.json holds (atoll.job.run.Run.finish): a summary without them is damaged
SUMMARY_KEYS = ("strategy", "islands", "steps", "tokens", "initial_eval_loss", "final_eval_loss",
                "bytes_sent_per_island")


def read_summary(out: Path) -> dict[str, Any] | None:
    """The ``summary.json`` of the run folder ``out``, or None where it is missing or damaged (cut short by a
    crash or a full disk, not a JSON object, without the entries every run writes, :data:`SUMMARY_KEYS`, or a
    loss that is not a number): such a run is not finished."""
    try:
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(summary, dict) or not all(k in summary for k in SUMMARY_KEYS) \
            or not isinstance(summary["strategy"], str):
        return None
    losses = (summary["initial_eval_loss"], summary["final_eval_loss"])  # None: a diverged run's, as JSON
    return summary if all(x is None or (isinstance(x, int | float) and not isinstance(x, bool)) for x in losses) \
        else None


def train_once(suite_dir: Path, name: str, fresh: bool = False, *, tag: str = "bench",
               **settings: Any) -> dict[str, Any]:
    """Train ``settings`` into ``suite_dir/name``, or reuse the finished run there; return its summary.

    The run is reused when :func:`finished` (and not ``fresh``). Another process training the same run holds
    the lock file ``suite_dir/.<name>.lock`` (its pid); this one waits for it, then reuses its run. Before
    training, a previous folder is removed only if atoll wrote it (:func:`clear_run_dir`). Every run trains
    with one torch thread and no progress bar unless ``settings`` say otherwise: benchmarks often share the
    cores with another run, and two OpenMP pools spinning on 2 cores slow both many-fold.

    Args:
        suite_dir: the benchmark's output folder.
        name: the run's folder name in it.
        fresh: train again even when a finished run matches.
        tag: the prefix of the line printed on stderr before training (``[tag] name: settings``).
        settings: TrainConfig fields (``out`` is set here); they are what ``config.json`` must match.

    Raises:
        ConfigError: ``suite_dir`` cannot be made, ``suite_dir/name`` is not an atoll run folder, or a setting
            is invalid.
    """
    out = suite_dir / name
    make_folder(suite_dir)
    from atoll.config import build_config

    # bad settings fail here, before anything is waited for, moved or deleted; a benchmark's settings are a base
    # shared by runs of several strategies (e.g. one outer momentum for ddp and diloco), which the runs that do
    # not read a setting ignore, as they always did (atoll.config.applies refuses only a user's own settings)
    config = build_config(base={"progress": False, "threads": 1, **settings}, overrides={"out": str(out)})
    lock = suite_dir / f".{name}.lock"
    said = False
    if not fresh and (out / "summary.json").is_file() and read_summary(out) is None and run_matches(out, settings):
        print(f"atoll: warning: '{out / 'summary.json'}' is damaged (cut short, not JSON); training {name} "
              "again", file=sys.stderr, flush=True)
    while True:  # another benchmark process may be training the same run: wait for it, then reuse it
        if not fresh and finished(out, settings):
            return read_summary(out)  # type: ignore[return-value]
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, _lock_text(os.getpid()).encode())
            os.close(fd)
            break
        except FileExistsError:
            if not _lock_alive(lock):
                lock.unlink(missing_ok=True)
            else:
                if not said:
                    print(f"[{tag}] {name}: waiting for process {lock.read_text().split()[0]}, which trains it "
                          f"(lock file {lock})", file=sys.stderr, flush=True)
                    said = True
                time.sleep(10)
    previous = suite_dir / f".{name}.previous"  # the run being replaced, until the new one has trained
    try:
        if check_benchmark_run(suite_dir, name):  # refuses a folder atoll did not write, or a run no benchmark
            clear_run_dir(previous)                # of this folder trained
            out.rename(previous)
        register(suite_dir, name)
        print(f"[{tag}] {name}: {settings}", file=sys.stderr, flush=True)
        from atoll.training import train

        try:
            summary = train(config)
        except BaseException:  # bad input found while training, a crash or Ctrl-C: the previous run comes back
            if previous.exists():
                clear_run_dir(out)
                previous.rename(out)
            raise
        clear_run_dir(previous)
        return summary
    finally:
        lock.unlink(missing_ok=True)


def _start_time(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot, from /proc; '' where there is no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _lock_text(pid: int) -> str:
    """A lock's content: the pid and its start time, so that a pid reused by another process is not taken
    for the benchmark that left the lock."""
    return f"{pid} {_start_time(pid)}".strip()


def _lock_alive(lock: Path) -> bool:
    """Whether the process that wrote ``lock`` still runs (the same pid, started at the same time)."""
    try:
        fields = lock.read_text().split()
        pid = int(fields[0]) if fields else 0
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError, FileNotFoundError, PermissionError):
        return False
    return len(fields) < 2 or fields[1] == _start_time(pid)


# ----------------------------------------------------------------------------------------------------------
# the results writer


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), from ``/proc`` (Linux): torchrun's agent starts each
    worker in a session of its own, so killing the agent's process group leaves its (restarted) workers
    running; a benchmark or test ends them by pid. (A process's name, in parentheses in ``/proc/PID/stat``, is
    any 15 bytes: spaces, parentheses, a UTF-8 character cut in two; it is skipped as bytes.)"""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):  # ended meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every process below it (:func:`descendants`); wait for none.

    The tree is frozen first (SIGSTOP, until a scan finds no process it did not stop): a stopped parent starts
    no worker between the scan and the kill (torchrun restarting its workers), and reaps no child, so no pid
    of the tree is reused by another process before its SIGKILL. The caller must not have reaped ``pid``."""
    import contextlib
    import signal

    def send(target: int, sig: int, group: bool = False) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            (os.killpg if group else os.kill)(target, sig)

    send(pid, signal.SIGSTOP)
    stopped = {pid}
    while below := [p for p in descendants(pid) if p not in stopped]:
        for p in below:
            send(p, signal.SIGSTOP)
        stopped.update(below)
    send(pid, signal.SIGKILL, group=True)
    for p in [pid, *sorted(stopped - {pid})]:
        send(p, signal.SIGKILL)


def cell(v: Any, mega_digits: int = 1) -> str:
    """A table cell: ``-`` for None; a float as ``1.234``, ``12.3``, ``1,234``, and from a million on ``1.2 M``
    (``mega_digits`` decimals); a list's cells joined by `` / ``; anything else as ``str``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if abs(v) >= 1e6:
            return f"{v / 1e6:,.{mega_digits}f} M"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, list):
        return " / ".join(cell(x, mega_digits) for x in v)
    return str(v)


def markdown_table(columns: Sequence[Column], rows: Sequence[dict[str, Any]], title: str | None = None,
                   notes: Sequence[str] = (), bullets: bool = True, fmt: Callable[[Any], str] = cell) -> str:
    """A Markdown table: ``### title`` (if any), the header and one line per row, then the notes.

    Args:
        columns: (header, key) or (header, key, formatter): the cell of a row is its value at ``key``,
            formatted by the column's formatter, else by ``fmt``. None is written ``-`` and a ``str`` as it
            is (a pre-formatted cell; ``""`` leaves the cell empty).
        rows: the rows, in order.
        notes: lines after the table and a blank line; Markdown bullets (``- note``) unless not ``bullets``.
        fmt: the formatter of columns that name none (default :func:`cell`).
    """

    def text(row: dict[str, Any], column: Column) -> str:
        v = row.get(column[1])
        if v is None:
            return "-"
        if isinstance(v, str):
            return v
        return (column[2] if len(column) > 2 else fmt)(v)  # type: ignore[misc]

    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    lines = [f"### {title}", ""] if title is not None else []
    lines += [line([c[0] for c in columns]), "|" + "|".join("---" for _ in columns) + "|"]
    lines += [line([text(row, c) for c in columns]) for row in rows]
    lines += [""] + [f"- {n}" if bullets else n for n in notes]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict[str, Any], columns: Sequence[Column], rows: Sequence[dict[str, Any]],
                  title: str | None = None, notes: Sequence[str] = (), bullets: bool = True,
                  fmt: Callable[[Any], str] = cell) -> str:
    """Write ``results.json`` (``results``, indented; NaN and infinities as null, other objects JSON cannot hold
    as strings: strict JSON) and ``results.md`` (:func:`markdown_table` of the other arguments) into ``out``;
    return the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(finite_or_none(results), indent=2, default=str))
    table = markdown_table(columns, rows, title, notes, bullets, fmt)
    (out / "results.md").write_text(table)
    return table
