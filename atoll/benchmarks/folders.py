"""Which folders and files a benchmark may delete or write over: only those atoll wrote.

Used by :mod:`atoll.benchmarks.common` (the run cache, :func:`~atoll.benchmarks.common.train_once`),
``atoll bench suite`` and ``atoll bench wan``. A run folder is cleared for a rerun only if every file and folder in it,
at any depth, is one atoll writes (:data:`RUN_PATHS`, exact name patterns; :func:`clear_run_dir`), and replaced by a
benchmark only if a benchmark of that output folder trained it (its :data:`REGISTRY`, :func:`check_benchmark_run`). An
output folder is checked before anything runs (:func:`check_out_folder`), its ``results.json`` and ``results.md``
included. Every refusal is one line (:class:`~atoll.errors.ConfigError`) naming the folder or file and the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from atoll.errors import ConfigError
from atoll.job.lock import LOCK_NAME

#: files and folders that only an atoll run folder holds; a folder with none of them is not atoll's
RUN_MARKERS = ("config.json", "metrics.jsonl", "checkpoints")

_CHECKPOINTS = r"(?:syncer/)?checkpoints"  # a run's, and the decoupled syncer's
# a checkpoint, or one being written or swapped
_STEP = _CHECKPOINTS + r"/(?:step_[0-9]+|\.tmp-step_[0-9]+-\w+|\.old-step_[0-9]+-\w+)"
#: what save_pretrained writes for a model and its tokenizer (the checkpoint's model/ folder)
_MODEL_FILES = (r"(?:config\.json|generation_config\.json|model(?:-\d+-of-\d+)?\.safetensors|"
                r"model\.safetensors\.index\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|"
                r"added_tokens\.json|chat_template\.(?:jinja|json)|vocab\.(?:json|txt)|merges\.txt|tokenizer\.model|"
                r"spiece\.model|sentencepiece\.bpe\.model)")
#: every path atoll writes into a run folder, relative, as regular expressions over the whole path: the run's
#: files and their temporary names, checkpoints (the syncer's too), the trackers' folders (wandb's run folders
#: are wandb's own tree) and the Ray runtime's pid files; a file or folder that matches none is not atoll's
RUN_PATHS = (
    r"config\.json", r"metrics\.jsonl", r"summary\.json", r"report\.png", r"clock_trace\.json",
    re.escape(LOCK_NAME), r"\.(?:config|summary)\.json\.tmp", r"\.atoll-write-test",
    r"syncer", _CHECKPOINTS, _CHECKPOINTS + r"/(?:latest|\.latest\.tmp)", _STEP,
    _STEP + r"/(?:state\.json|state\.safetensors|checksums\.json|model)", _STEP + r"/model/" + _MODEL_FILES,
    # the collective runtime's per-rank checkpoint (atoll.job.rank_checkpoint): ranks/rank_<r>/ with its tensors
    _STEP + r"/ranks(?:/rank_[0-9]+)?", _STEP + r"/ranks/rank_[0-9]+/(?:state\.json|" + _MODEL_FILES + ")",
    r"tensorboard", r"tensorboard/events\.out\.tfevents\.[^/]+",
    r"wandb", r"wandb/(?:atoll-run-id|latest-run|debug\.log|debug-internal\.log|debug-cli\.[^/]+\.log)",
    r"wandb/(?:offline-)?run-[^/]+(?:/.+)?",
    r"ray", r"ray/\.?(?:syncer|island_\d+)\.pid(?:\.tmp)?",
)
_RUN_PATH = re.compile("|".join(f"(?:{p})" for p in RUN_PATHS))
#: the benchmark folder's list of the runs its benchmarks trained (only those may be cleared and retrained)
REGISTRY = ".atoll-bench.json"
#: what a benchmark writes at the top of its folder
RESULT_FILES = ("results.json", "results.md", REGISTRY)


def is_atoll_run(path: Path) -> bool:
    """Whether the folder ``path`` holds an atoll run's files (:data:`RUN_MARKERS`: ``config.json``,
    ``metrics.jsonl`` or ``checkpoints/``)."""
    return path.is_dir() and not path.is_symlink() and any((path / m).exists() for m in RUN_MARKERS)


def foreign_files(path: Path, markers: Sequence[str] = (), patterns: Sequence[str] = ()) -> list[str]:
    """Paths in the folder ``path``, at any depth, relative to it, that atoll does not write into a run folder
    (:data:`RUN_PATHS`; the names ``markers`` and the regular expressions ``patterns`` at the top: a benchmark's
    own files), sorted; empty for a folder that holds only atoll's files. Symbolic links are not followed (the
    checkpoints' ``latest`` is one of atoll's)."""
    own = re.compile("|".join([_RUN_PATH.pattern, *(re.escape(m) for m in markers), *(f"(?:{p})" for p in patterns)]))
    foreign = []
    for folder, dirs, files in os.walk(path):
        here = Path(folder).relative_to(path)
        for name in sorted(dirs) + sorted(files):
            rel = (here / name).as_posix()
            if own.fullmatch(rel) is None:
                foreign.append(rel)
        dirs[:] = [d for d in dirs if own.fullmatch((here / d).as_posix()) is not None]  # a foreign one: named
    return sorted(foreign)


def clear_run_dir(path: Path, markers: Sequence[str] = (), patterns: Sequence[str] = ()) -> None:
    """Remove the run folder ``path`` before training it again, if it exists.

    Only a folder that atoll wrote is removed: one holding an atoll run's files (:data:`RUN_MARKERS`, or
    one of ``markers``, names of files a benchmark writes there itself), or an empty one, and nothing else:
    every file and folder in it, at any depth, must be one atoll writes (:func:`foreign_files`, with
    ``patterns``: more names of a benchmark's own). Anything else is left untouched.

    Raises:
        ConfigError: ``path`` exists and is not an atoll run folder, or holds files atoll did not write
            (one line, naming the first).
    """
    if check_run_dir(path, markers, patterns):
        shutil.rmtree(path)


def check_run_dir(path: Path, markers: Sequence[str] = (), patterns: Sequence[str] = ()) -> bool:
    """Whether ``path`` exists and may be removed (:func:`clear_run_dir`'s rule); False when it does not exist.

    Raises:
        ConfigError: as :func:`clear_run_dir`.
    """
    if not path.exists() and not path.is_symlink():
        return False
    ours = is_atoll_run(path) or (path.is_dir() and not path.is_symlink()
                                  and (not any(path.iterdir()) or any((path / m).exists() for m in markers)))
    if not ours:
        raise ConfigError(f"out: '{path}' exists and is not an atoll run folder (no config.json, metrics.jsonl or "
                          "checkpoints/), so it was left untouched; move it away or pass another --out")
    foreign = foreign_files(path, markers, patterns)
    if foreign:
        raise ConfigError(f"out: '{path}' holds files atoll did not write ('{foreign[0]}'"
                          f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}), so it was left "
                          "untouched; move them away or pass another --out")
    return True


def check_out_folder(out: Path, prog: str = "out", keys: Sequence[str] = ()) -> None:
    """Refuse a benchmark's output folder that is not atoll's: an existing non-empty folder must hold a
    benchmark's results (:data:`RESULT_FILES`) or atoll run folders, and a ``results.json`` or ``results.md`` in
    it (which the benchmark writes over) must be a benchmark's: ``results.json`` a JSON object with every key of
    ``keys`` (what this benchmark's results hold: a user's JSON object lacks them), ``results.md`` a Markdown
    table beside such a ``results.json`` (a benchmark writes both); a file is refused too.

    Raises:
        ConfigError: ``out`` is a file, a non-empty folder with none of atoll's files, or one whose results.json
            is not a JSON object or results.md holds no Markdown table (field ``prog``; nothing is written).
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{prog}: '{out}' is a file; pass a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (any((out / f).exists() for f in RESULT_FILES) or any(is_atoll_run(e) for e in out.iterdir())):
        raise ConfigError(f"{prog}: '{out}' is a folder of other files (no results.json and no atoll run in it), "
                          "so it was left untouched; pass an empty or new folder")
    for name in ("results.json", "results.md"):  # about to be written over: they must be a benchmark's
        if not _benchmark_results(out / name, keys):
            what = "not a JSON object" + prog_keys(keys) if name.endswith(".json") else "no Markdown table"
            raise ConfigError(f"{prog}: '{out / name}' is not a benchmark's results file ({what}), so it "
                              "was left untouched; move it away or pass another --out")


def prog_keys(keys: Sequence[str]) -> str:
    return f" with {', '.join(keys)}" if keys else ""


def _benchmark_results(path: Path, keys: Sequence[str] = ()) -> bool:
    """Whether ``path`` is absent or a results file a benchmark wrote (:func:`write_results`): ``results.json`` a
    JSON object holding ``keys``, ``results.md`` a Markdown table (a ``|---`` line) whose ``results.json``, beside
    it, is one (with ``keys`` given); a benchmark writes over those only."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_symlink() or not path.is_file():
        return False
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            data = json.loads(text)
            return isinstance(data, dict) and all(k in data for k in keys)
        table = any(line.startswith("|---") for line in text.splitlines())
        beside = path.with_name("results.json")
        return table and (not keys or (beside.is_file() and _benchmark_results(beside, keys)))
    except (OSError, UnicodeDecodeError, ValueError):
        return False


def check_benchmark_run(suite_dir: Path, name: str, markers: Sequence[str] = (), patterns: Sequence[str] = ()) -> bool:
    """Whether the run folder ``suite_dir/name`` exists and may be replaced by a benchmark: an atoll run folder
    holding only atoll's files (:func:`check_run_dir`, with a benchmark's own ``markers`` and ``patterns``) that
    a benchmark of this folder trained (its :data:`REGISTRY` names it), or an empty folder. False when absent.

    Raises:
        ConfigError: a folder that is not an atoll run's, holds files atoll did not write, or holds a run that
            no benchmark trained here (one line, naming it).
    """
    out = suite_dir / name
    if not check_run_dir(out, markers, patterns):
        return False
    if name not in _registry(suite_dir) and any(out.iterdir()):
        raise ConfigError(f"out: '{out}' holds a run that no atoll benchmark trained in this folder (it is "
                          f"not in {REGISTRY}), so it was left untouched; move it away or pass another --out")
    return True


def make_folder(path: Path) -> None:
    """Make the benchmark folder ``path`` (and its parents) if it is not there.

    Raises:
        ConfigError: it cannot be made (one line naming it).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out: cannot make the folder '{path}' ({e.strerror or e}); pass another --out") from None


def registered(suite_dir: Path) -> set[str]:
    """The names of the runs a benchmark trained in ``suite_dir`` (its :data:`REGISTRY`; empty if none)."""
    return _registry(suite_dir)


def _registry(suite_dir: Path) -> set[str]:
    try:
        return set(json.loads((suite_dir / REGISTRY).read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def register(suite_dir: Path, name: str) -> None:
    """Add ``name`` to the folder's list of runs a benchmark trained (written atomically)."""
    names = sorted(_registry(suite_dir) | {name})
    tmp = suite_dir / f"{REGISTRY}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(names))
    os.replace(tmp, suite_dir / REGISTRY)
