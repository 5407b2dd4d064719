"""Per-rank sharded checkpoints of the collective runtime, written with ``torch.distributed.checkpoint`` (DCP).

Every rank writes what only it holds, into its own folder of the checkpoint, in parallel with the others; no
island's weights or moments travel to rank 0 (torchtitan's layout; Liang et al. 2024, "TorchTitan",
arXiv:2410.06511, section 3.2, distributed checkpointing)::

    checkpoints/step_<N>/
      model/                       the global model, a Hugging Face folder (rank 0; from_pretrained loads it)
      state.json, state.safetensors    the job's shared state: step, counters, clock, losses (rank 0; small)
      ranks/rank_<r>/              what rank r alone holds (DCP, safetensors + JSON):
        model-00001-of-00001.safetensors, model.safetensors.index.json   its tensors
        state.json                 their JSON tree (scalars, references to the tensors)

Who writes what (replicated state is written once, by its owner):

- an island's state (model, inner optimizer, schedule, counters) and the strategy's per-island state
  (residuals, fragments in flight): by the island's position-0 rank, or by *every* rank of a sharded island
  (``--shard-island``: its ``Shard(0)`` pieces of every parameter and AdamW moment, FSDP2's local tensors);
- the strategy's shared state (global parameters, outer momentum): by rank 0, or by each rank of island 0
  for sharded islands (rank p holds shard p of the global vector).

The tensors go through DCP's Hugging Face storage writer (one safetensors file per rank, ``no_dist``: no
collective planning, so nothing crosses a process boundary as pickle, and a rank's folder reads back without
the others). The folder is written atomically for the whole job: every rank writes into
``checkpoints/.tmp-step_<N>/``, the ranks agree that every write succeeded (one all-reduce), and rank 0 adds
the shared state and the model, then renames the folder and points ``latest`` at it
(:func:`atoll.job.checkpoint.save_checkpoint`). Resuming, each rank reads only its own folder and its owners'
(:func:`load_rank_state`); the ``local`` runtime assembles an unsharded checkpoint of every rank
(:func:`consolidate`). Every node must see the run folder (a shared file system), as a resume always needed.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from atoll.errors import CheckpointError

RANKS = "ranks"  # the sub-folder of a checkpoint holding one folder per rank
FORMAT = "ranks"  # ``state.json``'s "format" of a per-rank checkpoint
_TENSOR = "__tensor__"


def rank_folder(checkpoint: Path, rank: int) -> Path:
    """The folder of global rank ``rank`` inside the checkpoint folder ``checkpoint``."""
    return Path(checkpoint) / RANKS / f"rank_{rank:05d}"


def _local_tree(state: Any) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """``state`` (dicts, lists, tensors, scalars) as a JSON tree, its tensors by dotted key (a ``DTensor`` as
    this rank's local piece, detached, not copied; a tensor viewing the same memory as an earlier one, such as
    a tied head, refers to that one's key) and the keys that were ``DTensor`` s."""
    tensors: dict[str, torch.Tensor] = {}
    dtensors: list[str] = []
    seen: dict[tuple[Any, ...], str] = {}  # a tensor that shares another's memory (tied weights) is saved once

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if isinstance(obj, DTensor):
                dtensors.append(path)
                obj = obj.to_local()
            obj = obj.detach()
            where = (obj.device, obj.dtype, obj.untyped_storage().data_ptr(), obj.storage_offset(),
                     tuple(obj.shape), obj.stride())
            if obj.numel() and where in seen:
                return {_TENSOR: seen[where]}
            seen[where] = path
            tensors[path] = obj.contiguous()
            return {_TENSOR: path}
        if isinstance(obj, dict):
            return {"__dict__": [[k if isinstance(k, (str, int, float, bool)) or k is None else str(k),
                                  walk(v, f"{path}.{k}" if path else str(k))] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]
        return obj

    return walk(state, ""), tensors, dtensors


def _untree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if _TENSOR in tree:
            return tensors[tree[_TENSOR]]
        return {k: _untree(v, tensors) for k, v in tree["__dict__"]}
    if isinstance(tree, list):
        return [_untree(v, tensors) for v in tree]
    return tree


def _open_modes(folder: Path) -> None:
    """Give ``folder`` and its files the modes of new files under the umask (0755 and 0644 under 022), as the
    rest of the run folder (safetensors writes 0600)."""
    mask = os.umask(0o022)  # read it (os.umask only sets); put it back at once
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


@dataclass
class StagedState:
    """A rank's state ready to write: its JSON tree, its tensors by dotted key and the keys that were
    ``DTensor`` pieces (:func:`stage_rank_state`)."""

    tree: Any
    tensors: dict[str, torch.Tensor]
    dtensors: list[str]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class HostStaging:
    """Host buffers that hold a copy of a rank's tensors while a background thread writes them (torchtitan's
    asynchronous checkpointing with pinned memory): page-locked where the tensor is on an accelerator, so the
    device-to-host copies run without a bounce buffer; kept from one checkpoint to the next (the same keys,
    shapes and dtypes every time), so a checkpoint allocates nothing after the first. Holds as many bytes as
    the rank's state (16 per parameter of an island with AdamW); not thread-safe (the training thread stages,
    after the previous write finished)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.devices: set[torch.device] = set()  # the CUDA devices copies are in flight from

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` in the buffer kept for ``key`` (non-blocking from a device: call
        :meth:`wait` before reading it)."""
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda" and torch.cuda.is_available()
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if t.device.type == "cuda":
            self.devices.add(t.device)
        return buf.copy_(t, non_blocking=t.device.type == "cuda")

    def wait(self) -> None:
        """Wait for the copies in flight (one synchronization of each device they came from, at a checkpoint
        only; nothing on the CPU)."""
        for device in self.devices:
            torch.cuda.synchronize(device)
        self.devices.clear()


def stage_rank_state(state: dict[str, Any], staging: HostStaging | None = None) -> StagedState:
    """``state`` (dicts, lists, tensors, JSON scalars) flattened for :func:`write_rank_state`: a ``DTensor``
    as this rank's local piece, a tensor sharing another's memory (a tied head) once. With ``staging``, every
    tensor is copied to its host buffer now, so training may change the originals while another thread
    writes; without, the tensors are the state's own (written before anything changes them)."""
    tree, tensors, dtensors = _local_tree(state)
    if staging is not None:
        tensors = {k: staging.copy(k, t) for k, t in tensors.items()}
        staging.wait()
    return StagedState(tree, tensors, dtensors)


def write_rank_state(folder: Path, staged: StagedState) -> None:
    """Write a staged rank state to ``folder`` (created): its tensors with DCP's safetensors writer (each file
    fsynced), the JSON tree beside them. Touches no process group (``no_dist``), so it may run on a thread
    of its own.

    Raises:
        OSError: the disk is full or the folder not writable.
    """
    folder.mkdir(parents=True, exist_ok=False)
    if staged.tensors:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            try:
                dcp.save(staged.tensors, storage_writer=HuggingFaceStorageWriter(str(folder)), no_dist=True)
            except CheckpointException as e:
                raise _unwrapped(e, folder) from None
    with open(folder / "state.json", "w") as f:
        json.dump({"tree": staged.tree, "dtensors": staged.dtensors}, f)
        f.flush()
        os.fsync(f.fileno())
    _open_modes(folder)


def _unwrapped(e: CheckpointException, folder: Path) -> BaseException:
    """The error DCP wrapped in ``e`` (its first rank's), an ``OSError`` naming ``folder`` where it named no file:
    a full disk is an ``OSError`` again, which the callers catch (one line with the resume advice; a background
    writer posts it), not DCP's ``CheckpointException``, a ``BaseException`` that escaped them (a traceback, or
    a writer thread that ended without a word)."""
    for failure in e.failures.values():
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, OSError) and not inner.filename:
            return OSError(inner.errno or errno.EIO, inner.strerror or str(inner), str(folder))
        if isinstance(inner, BaseException):
            return inner
    return OSError(errno.EIO, str(e).splitlines()[0] if str(e) else "the checkpoint writer failed", str(folder))


def save_rank_state(folder: Path, state: dict[str, Any]) -> None:
    """Write this rank's ``state`` to ``folder`` (created) now: :func:`stage_rank_state` without copies, then
    :func:`write_rank_state`.

    Tensors stay where they are (CPU or GPU); DCP copies them to the host as it writes. A ``DTensor`` is saved
    as this rank's piece and marked, so that :func:`load_rank_state` can say which were sharded.

    Raises:
        OSError: the disk is full or the folder not writable.
    """
    write_rank_state(folder, stage_rank_state(state))


def load_rank_state(folder: Path, device: torch.device | str = "cpu") -> tuple[dict[str, Any], set[str]]:
    """Read a rank's folder written by :func:`save_rank_state`: (its state with tensors on ``device``, the
    dotted keys of the tensors that were ``DTensor`` pieces). DCP reads each tensor in place into a buffer
    allocated from the safetensors headers (no pickle anywhere).

    Raises:
        CheckpointError: the folder is missing or damaged, naming it.
    """
    try:
        meta = json.loads((folder / "state.json").read_text())
        tensors: dict[str, torch.Tensor] = {}
        if any(p.suffix == ".safetensors" for p in folder.iterdir()):
            reader = HuggingFaceStorageReader(str(folder))
            described = reader.read_metadata().state_dict_metadata
            tensors = {k: torch.empty(m.size, dtype=m.properties.dtype, device=device)  # type: ignore[union-attr]
                       for k, m in described.items()}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
        return _untree(meta["tree"], tensors), set(meta.get("dtensors", ()))
    except Exception as e:  # safetensors and DCP raise their own error types for damaged files
        raise CheckpointError(
            f"resume: the rank folder '{folder}' of the checkpoint is unreadable ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120] if str(e) else ''}); resume from an earlier checkpoint or start a new run"
        ) from None


def owner_of_island(island: int, position: int, ranks_per_island: int, sharded: bool, alive: list[int]) -> int:
    """The global rank whose folder holds island ``island``'s state for the rank at ``position``: the island's
    own rank at that position (sharded) or at position 0; an island lost before the checkpoint (not in
    ``alive``) resumes from the first live island's, as it would have rejoined."""
    source = island if island in alive else min(alive)
    return source * ranks_per_island + (position if sharded else 0)


def owner_of_shared(position: int, sharded: bool) -> int:
    """The global rank whose folder holds the strategy's shared state for the rank at ``position``: rank 0,
    or island 0's rank at that position (sharded: shard ``position`` of the global vector)."""
    return position if sharded else 0


def consolidate(path: Path, shared: dict[str, Any]) -> dict[str, Any]:
    """An unsharded per-rank checkpoint's state in the ``local`` runtime's format (every island's state, the
    strategy's shared state, each island's strategy state), read from the owners' folders on the CPU.

    Raises:
        CheckpointError: the checkpoint's islands were sharded (it resumes only under the collective runtime,
            with as many ranks per island); a rank folder is unreadable.
    """
    if shared.get("shard_ranks"):
        raise CheckpointError(f"resume: the checkpoint '{path}' holds islands sharded over {shared['shard_ranks']} "
                              "ranks; resume it with --runtime collective --shard-island --ranks-per-island "
                              f"{shared['shard_ranks']}")
    count, r_count, alive = int(shared["islands"]), int(shared["ranks_per_island"]), list(shared["alive"])
    entries = [load_rank_state(rank_folder(path, owner_of_island(i, 0, r_count, False, alive)))[0]
               for i in range(count)]
    strategy = load_rank_state(rank_folder(path, owner_of_shared(0, False)))[0]["strategy"]
    return {**shared, "islands": [e["island_state"] for e in entries], "strategy": strategy,
            "strategy_islands": [e["strategy_island"] for e in entries]}
