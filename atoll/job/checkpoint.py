"""Checkpoints: written atomically, resumed exactly.

A checkpoint is a folder ``<out>/checkpoints/step_<N>/`` holding

- ``model/``: the global model as a Hugging Face folder (``config.json``, ``model.safetensors``, the
  tokenizer), loadable with ``AutoModelForCausalLM.from_pretrained``;
- ``state.safetensors``: every tensor of the run state (each island's weights and inner optimizer, the
  outer optimizer, residuals), under dotted keys;
- ``state.json``: the rest of the state (step, counters, clocks) with references to those tensors;
- ``checksums.json``: the SHA-256 of ``state.json`` and ``state.safetensors``, checked when the checkpoint is
  read (:func:`load_checkpoint`): a damaged file is an unreadable checkpoint, never wrong state (a checkpoint
  written before checksums were kept has none, and is read unchecked).

The collective runtime writes a checkpoint per rank instead of ``state.safetensors``: each rank's own
tensors under ``ranks/rank_<r>/`` (:mod:`atoll.job.rank_checkpoint`), the shared state in ``state.json``.

The folder is written under a temporary name, flushed, and renamed into place; then ``latest`` (a relative
symbolic link to it, so ``checkpoints/latest/model`` is a path ``from_pretrained`` takes; a text file naming it
where the file system has no links) is replaced atomically. A crash at any point leaves the previous
checkpoint intact. Files and folders get the modes the process's umask gives new ones (0644 and 0755 under
the usual 022), as the rest of the run folder, so that a process of another user can read the exported model.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from atoll.errors import CheckpointError

_TENSOR = "__tensor__"

#: the name of a checkpoint folder atoll writes (``step_`` and the step in 7 digits); anything else under
#: ``checkpoints/`` (a user's ``step_0000020_best`` or ``step_0000020.bak``) is never read, rotated or deleted
CHECKPOINT_NAME = re.compile(r"step_[0-9]{7}")  # ASCII digits only: "\d" takes any script's


def checkpoint_folders(root: Path) -> list[Path]:
    """The checkpoint folders atoll wrote in ``root`` (names :data:`CHECKPOINT_NAME` exactly), oldest first;
    an empty list where ``root`` is not a folder."""
    if not Path(root).is_dir():
        return []
    return sorted((p for p in Path(root).iterdir() if CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir()),
                  key=_step_of)


def flatten_state(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested state (dicts, lists, tensors, scalars) into a JSON tree and a flat tensor dict.

    Each tensor is replaced in the tree by ``{"__tensor__": key}`` and stored under ``key`` (a dotted
    path) in the returned dict, as a contiguous CPU copy (shared storage, e.g. tied weights, is split).
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors[path] = obj.detach().to("cpu").contiguous().clone()
            return {_TENSOR: path}
        if isinstance(obj, dict):
            return {"__dict__": [[_key(k), walk(v, f"{path}.{k}" if path else str(k))] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]
        return obj

    return walk(state, prefix), tensors


def _key(k: Any) -> Any:
    # JSON object keys are strings; optimizer state dicts use int keys, so keep keys typed in a list.
    return k if isinstance(k, (str, int, float, bool)) or k is None else str(k)


def unflatten_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_state`."""
    if isinstance(tree, dict):
        if _TENSOR in tree:
            return tensors[tree[_TENSOR]]
        return {k: unflatten_state(v, tensors) for k, v in tree["__dict__"]}
    if isinstance(tree, list):
        return [unflatten_state(v, tensors) for v in tree]
    return tree


#: the file of a checkpoint holding the SHA-256 of :data:`CHECKSUMMED` (what :func:`load_checkpoint` reads)
CHECKSUMS = "checksums.json"
CHECKSUMMED = ("state.json", "state.safetensors")


def _sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read 1 MiB at a time. Raises OSError."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_checksums(path: Path) -> None:
    """Check the files of the checkpoint folder ``path`` against its ``checksums.json`` (none: nothing to check,
    a checkpoint written before checksums were kept).

    Raises:
        ValueError: the checksums file is unreadable, or a file is missing or its bytes differ (one line naming it).
    """
    sums = Path(path) / CHECKSUMS
    if not sums.exists():
        return
    try:
        want = json.loads(sums.read_text())["sha256"]
        if not isinstance(want, dict):
            raise TypeError(CHECKSUMS)
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{CHECKSUMS} is unreadable") from None
    for name, digest in want.items():
        try:
            got = _sha256(Path(path) / str(name))
        except OSError as e:
            raise ValueError(f"{name} cannot be read ({e.strerror or e})") from None
        if got != digest:
            raise ValueError(f"{name} does not match its SHA-256 in {CHECKSUMS} (damaged)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)  # read it (os.umask only sets); put it back at once
    os.umask(mask)
    return mask


def _open_modes(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes of new files under the umask (``mkdtemp`` makes 0700 and
    safetensors writes 0600); but ``ranks/``, whose writers set their own
    (:func:`atoll.job.rank_checkpoint.save_rank_state`)."""
    mask = _umask()
    for path in [folder, *(p for p in folder.rglob("*") if p.relative_to(folder).parts[0] != "ranks")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Raise the I/O failure of a safetensors write under it (a full disk, a read-only folder) as the
    ``OSError`` it is, naming ``path``: safetensors' own ``SafetensorError`` is not an ``OSError``, so the
    command line's one line with the resume advice missed it. Any other ``SafetensorError`` passes unchanged."""
    try:
        yield
    except SafetensorError as e:
        text = str(e)
        code = re.search(r"\(os error (\d+)\)", text)
        if code is None and "I/O error" not in text:
            raise
        number = int(code.group(1)) if code is not None else errno.EIO
        raise OSError(number, os.strerror(number) if code is not None else text, str(path)) from e


def _point_latest(root: Path, name: str) -> None:
    """Make ``root/latest`` name the checkpoint folder ``name`` atomically: a relative symlink, or a text file
    where links cannot be made."""
    tmp = root / ".latest.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    try:
        os.symlink(name, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):  # no symlinks here (some Windows setups): the text file
        tmp.write_text(name + "\n")
    latest = root / "latest"
    if latest.is_dir() and not latest.is_symlink():  # a copy of the run folder that followed the link
        shutil.rmtree(latest)
    os.replace(tmp, latest)


def checkpoint_tmp(out: Path, step: int) -> Path:
    """Remove what an interrupted writer left, and make the temporary folder of the checkpoint at ``step`` that
    several processes write into (the collective runtime's ranks) before :func:`save_checkpoint` renames it.
    Called by one process (rank 0) before the others write."""
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step_{step:07d}"
    tmp.mkdir()
    return tmp


def save_checkpoint(out: Path, step: int, state: dict[str, Any], model: Any | None = None,
                    tokenizer: Any | None = None, keep: int = 2, tmp: Path | None = None,
                    meta: dict[str, Any] | None = None, model_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a checkpoint of ``state`` at inner step ``step`` atomically (:func:`write_checkpoint_files`, then
    :func:`commit_checkpoint`); return its folder.

    Args:
        out: the run folder; checkpoints go to ``out/checkpoints``.
        step, state: inner steps completed; nested dicts/lists of tensors and JSON scalars.
        model, tokenizer: the global model (a ``PreTrainedModel`` holding the global weights) and a
            ``PreTrainedTokenizerFast``, saved to ``model/``.
        keep: how many checkpoints to keep (older ones are removed after the new one is in place).
        tmp: a folder from :func:`checkpoint_tmp` that other processes have written their parts into (each
            fsynced its own files); None: a new one.
        meta: more entries of ``state.json`` (the per-rank format's description).
        model_state: the model's weights by name, when ``model`` holds none (built on the meta device).

    Raises:
        OSError: the disk is full or the folder not writable (also where safetensors writes the tensors); the
            temporary folder is removed and the previous checkpoints are left as they were.
    """
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        for stale in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:  # left by a process killed while
            shutil.rmtree(stale, ignore_errors=True)                            # writing (one writer per run)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:07d}-", dir=root))
    write_checkpoint_files(tmp, step, state, model, tokenizer, meta, model_state)
    return commit_checkpoint(out, tmp, step, keep)


def write_checkpoint_files(tmp: Path, step: int, state: dict[str, Any], model: Any | None = None,
                           tokenizer: Any | None = None, meta: dict[str, Any] | None = None,
                           model_state: dict[str, torch.Tensor] | None = None) -> None:
    """Write the shared part of the checkpoint at ``step`` into ``tmp`` (``state.json``, ``state.safetensors``,
    ``model/``; arguments as :func:`save_checkpoint`'s), fsynced, with the umask's modes; renamed by
    :func:`commit_checkpoint`. Reads only ``model``'s config when ``model_state`` holds the weights, so it may
    run on a thread other than the one training. Raises OSError (a full disk...); ``tmp`` is then removed."""
    try:
        tree, tensors = flatten_state(state)
        with _writing(tmp / "state.safetensors"):
            save_file(tensors, str(tmp / "state.safetensors"))
        with open(tmp / "state.json", "w") as f:
            json.dump({"step": step, "state": tree, **(meta or {})}, f)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / CHECKSUMS, "w") as f:
            json.dump({"sha256": {name: _sha256(tmp / name) for name in CHECKSUMMED}}, f)
        if model is not None:
            with _writing(tmp / "model"):  # transformers writes the weights with safetensors too
                model.save_pretrained(tmp / "model", state_dict=model_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        for p in tmp.rglob("*"):
            if p.is_file() and p.relative_to(tmp).parts[0] != "ranks":  # the ranks fsynced their own
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        _open_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_checkpoint(out: Path, tmp: Path, step: int, keep: int = 2) -> Path:
    """Rename the written folder ``tmp`` to ``checkpoints/step_<N>`` of the run folder ``out`` (swapping out an
    earlier checkpoint of the same step, so a whole one is always on disk), point ``latest`` at it, and remove
    all but the newest ``keep`` checkpoints; return its folder.

    Raises:
        OSError: a file or link holds the checkpoint's name, or the rename failed; ``tmp`` is removed and the
            previous checkpoints are left as they were.
    """
    root = Path(out) / "checkpoints"
    final = root / f"step_{step:07d}"
    try:
        if final.is_symlink() or (final.exists() and not final.is_dir()):
            raise OSError(errno.EEXIST, f"'{final}' is a file or link with a checkpoint's name, not a checkpoint "
                                        "atoll wrote; move it out of the checkpoints folder")
        if final.exists():  # this step again (a stop just after its periodic checkpoint): swapped, so there is
            old = root / f".old-{final.name}-{os.getpid()}"  # always a whole checkpoint of the step on disk
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _point_latest(root, final.name)
    _fsync_dir(root)
    for old in checkpoint_folders(root)[:-keep] if keep > 0 else []:  # only atoll's names (CHECKPOINT_NAME)
        shutil.rmtree(old, ignore_errors=True)
    return final


#: the folder of the run this process last started (None before any): what an interrupted command names
last_run_dir: Path | None = None


def refuse_squatters(out: Path) -> None:
    """Refuse a run folder whose ``checkpoints/`` holds a file or link named like a checkpoint (``step_`` and 7
    digits): a checkpoint of that step would have to write over it.

    Raises:
        ConfigError: one line naming it.
    """
    from atoll.errors import ConfigError

    root = Path(out) / "checkpoints"
    squatters = [p for p in root.iterdir() if CHECKPOINT_NAME.fullmatch(p.name)
                 and (p.is_symlink() or not p.is_dir())] if root.is_dir() else []
    if squatters:
        raise ConfigError(f"out: '{squatters[0]}' is a file or link with a checkpoint's name (step_ and 7 digits); "
                          "atoll would have to write over it: move it away or choose another --out")


def new_run_dir(out: Path | None, strategy: str) -> Path:
    """The folder of a new run, created: ``out``, or ``runs/<strategy>-<time>`` when None.

    Raises:
        ConfigError: the folder already holds a run (a ``checkpoints`` folder).
    """
    from atoll.errors import ConfigError

    if out is None:
        out = Path("runs") / f"{strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(out)
    refuse_squatters(out)
    if checkpoint_folders(out / "checkpoints"):
        raise ConfigError(f"out: '{out}' already holds a run; pass --resume {out} to continue it, "
                          "or choose another --out")
    if (out / "metrics.jsonl").exists() or (out / "config.json").exists():
        raise ConfigError(f"out: '{out}' holds an unfinished run with no checkpoint (or another program's files); "
                          "remove it or choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".atoll-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"out: cannot write to '{out}' ({e.strerror or e}); choose a writable folder") from None
    global last_run_dir
    last_run_dir = out
    return out


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def _damaged(out: Path | str, folders: list[Path]) -> str:
    """What to say of a run whose checkpoint ``folders`` (oldest first, none empty) all lack their state.json."""
    return (f"no checkpoint in '{out}' is whole: {len(folders)} without a state.json (the newest "
            f"{folders[-1].name}); restore its state.json from a backup, or start again")


def latest_checkpoint(out: Path) -> Path:
    """The folder of a run's latest complete checkpoint.

    Raises:
        CheckpointError: the run folder holds no checkpoint.
    """
    root = Path(out) / "checkpoints"
    latest = root / "latest"
    if latest.is_symlink() or latest.is_file():
        try:
            name = os.readlink(latest) if latest.is_symlink() else latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        path = root / name
        if CHECKPOINT_NAME.fullmatch(name) and (path / "state.json").is_file():
            return path
    folders = checkpoint_folders(root)
    candidates = [p for p in folders if (p / "state.json").is_file()]
    if not candidates:
        if folders:  # written, then damaged (a checkpoint is complete once its state.json is in place)
            raise CheckpointError(f"resume: {_damaged(out, folders)}")
        if (Path(out) / "config.json").is_file():  # an atoll run that stopped before its first checkpoint
            raise CheckpointError(f"resume: the run in '{out}' stopped before its first checkpoint (see "
                                  "--checkpoint-every); nothing to resume: remove the folder and start again")
        raise CheckpointError(f"resume: no checkpoint in '{out}'; pass the folder of an atoll run (its --out)")
    return candidates[-1]


def latest_step(out: Path | str) -> int | None:
    """The step of the run in ``out``'s latest complete checkpoint (:func:`latest_checkpoint`); None: none."""
    try:
        return _step_of(latest_checkpoint(Path(out)))
    except CheckpointError:
        return None


def resume_advice(out: Path | str | None) -> str:
    """What to tell a user whose run in ``out`` stopped: resume from its latest checkpoint (naming its step),
    or, when none was written yet, start again (a resume would only say there is none)."""
    if out is None:
        return "resume with 'atoll train --resume OUT' (the run's --out)"
    step = latest_step(out)
    if step is None:
        if folders := checkpoint_folders(Path(out) / "checkpoints"):  # written, then damaged
            return _damaged(out, folders)
        return f"no checkpoint was written yet in '{out}' (see --checkpoint-every); remove it and start again"
    return f"resume with 'atoll train --resume {out}' (from step {step})"


def load_checkpoint(path: Path, consolidate: bool = True) -> tuple[int, dict[str, Any]]:
    """Read a checkpoint folder; return (step, state) with tensors on the CPU.

    A per-rank checkpoint (the collective runtime's, :mod:`atoll.job.rank_checkpoint`) gives its shared
    state with ``checkpoint_path`` (where each rank reads its own folder); with ``consolidate`` (a driver
    that runs every island in one process), every island's state assembled from the rank folders.

    Raises:
        CheckpointError: a missing or corrupt file (one that differs from its checksum too), naming it.
    """
    path = Path(path)
    try:
        verify_checksums(path)
        meta = json.loads((path / "state.json").read_text())
        tensors = load_file(str(path / "state.safetensors"))
        state = unflatten_state(meta["state"], tensors)
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise CheckpointError(
            f"resume: checkpoint '{path}' is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            "resume from an earlier checkpoint or start a new run"
        ) from None
    if meta.get("format") == "ranks":
        from atoll.job import rank_checkpoint

        state = {**state, "checkpoint_path": str(path)}
        if consolidate:
            state = rank_checkpoint.consolidate(path, state)
    return int(meta["step"]), state


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` durably and atomically: readers (and a restart after a power cut) see the old
    file or the new one, never a torn or empty one. The one way atoll writes its small state files
    (``config.json``, the syncer's ``coordinator.json``, ``left.json``, ``status.json``, pid files): a
    temporary file beside it, written and fsynced, renamed over ``path`` (``os.replace``), then the folder
    fsynced so the rename itself survives a power cut. ``mode``: the file's permission bits, set before any
    byte is written (a secret is never readable by others, even for a moment); None: the umask's.

    Raises:
        OSError: the folder is not writable, or the disk is full (the temporary file is removed; ``path`` is
            left as it was).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # an older temporary file keeps its mode through O_CREAT
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def load_latest_state(out: Path, consolidate: bool = True) -> tuple[int, dict[str, Any]]:
    """The newest checkpoint of ``out`` that reads back whole, falling back to older ones; a per-rank
    checkpoint assembled into every island's state with ``consolidate`` (:func:`load_checkpoint`).

    Raises:
        CheckpointError: no checkpoint of the run is readable (the message names the newest one's fault).
        ConfigError: a file or link has a checkpoint's name (:func:`refuse_squatters`).
    """
    refuse_squatters(out)
    root = Path(out) / "checkpoints"
    first = latest_checkpoint(out)
    candidates = [first] + [p for p in reversed(checkpoint_folders(root))
                            if p != first and (p / "state.json").is_file()]
    error: CheckpointError | None = None
    for path in candidates:
        try:
            step, state = load_checkpoint(path, consolidate)
            if not isinstance(state, dict) or "islands" not in state:
                raise CheckpointError(f"resume: checkpoint '{path}' has no island state; start a new run")
            if error is not None:
                print(f"atoll: warning: {error}; resuming from {path.name} instead", file=sys.stderr)
            return step, state
        except CheckpointError as e:
            error = error or e
    raise error  # type: ignore[misc]


def load_newest_readable(out: Path, check: Callable[[dict[str, Any]], None] | None = None
                         ) -> tuple[int, dict[str, Any], Path, list[tuple[Path, str]]]:
    """The newest checkpoint of ``out`` (its ``checkpoints/`` folder) that reads back whole and agrees with its
    checksums, newest step first: (step, state, its folder, the newer ones skipped with why each is unreadable).
    ``check(state)`` may refuse a state that read back but is not whole (raising ValueError or
    CheckpointError). A per-rank checkpoint is read as :func:`load_checkpoint` with ``consolidate``.

    Raises:
        CheckpointError: ``out`` holds no checkpoint folder, or none is readable: one line naming the folder,
            the newest one's fault and the fix (never a silent fresh start).
    """
    root = Path(out) / "checkpoints"
    folders = list(reversed(checkpoint_folders(root)))
    if not folders:
        raise CheckpointError(f"resume: no checkpoint in '{root}'")
    skipped: list[tuple[Path, str]] = []
    for path in folders:
        try:
            step, state = load_checkpoint(path)
            if check is not None:
                check(state)
            return step, state, path, skipped
        except (CheckpointError, ValueError, KeyError, TypeError) as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            skipped.append((path, text.split("; resume from an earlier")[0]))
    raise CheckpointError(f"resume: none of the {len(folders)} checkpoints in '{root}' is readable (the newest: "
                          f"{skipped[0][1]}); restore a checkpoint from a backup into that folder, or move "
                          f"'{Path(out)}' away to start the run anew")


def set_aside(path: Path) -> Path:
    """Rename the checkpoint folder ``path`` (an unreadable one) to ``<name>.damaged`` (``.damaged-2``, ... where
    taken): kept for inspection, but no longer a checkpoint's name (:data:`CHECKPOINT_NAME`), so it is never read
    again nor counted by the rotation (which would otherwise delete the newer run's checkpoints as older than
    it). Returns the new path. Raises OSError."""
    path = Path(path)
    target, n = path.with_name(f"{path.name}.damaged"), 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, target)
    _fsync_dir(path.parent)
    return target
