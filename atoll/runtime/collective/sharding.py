"""Sharded islands: an island's model, gradients and inner optimizer state sharded over its R ranks with
PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), the strategy's exchange run per shard across islands.

This is hybrid sharding (HSDP; Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277, section 3.2, hybrid
sharding): sharded inside an island, replicated across islands. Every parameter is cut along its first dimension into R
pieces (``Shard(0)``, FSDP2's placement); rank r of an island holds piece r of each parameter, its gradient
and its AdamW moments. FSDP2 all-gathers a block's parameters for its forward and backward pass and
reduce-scatters the gradient, so each rank ends an inner step with the island's mean gradient of its piece.

What the strategy sees is the rank's *local shard*: ``flat_params()`` is the concatenation of this rank's
pieces (``DTensor.to_local()``), shape (numel of the pieces,); the pseudo-gradient, the codec and the
outer optimizer act on it, and the cross-island exchange moves it between the ranks at the same position in
every island. Element-wise maths (AdamW, the outer Nesterov step, fp32 averaging) is therefore the same as
on the whole vector; only the order of floating-point sums changes (gradient reduce-scatter, clip norm).

The full model is assembled only for the checkpoint's Hugging Face model (:meth:`ShardLayout.gather`, on
island 0); a checkpoint's island state is each rank's pieces (:meth:`ShardedIsland.local_state_dict`, written
per rank, :mod:`atoll.job.rank_checkpoint`), and the evaluation runs the sharded island itself.
"""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.utils import parameters_to_vector

from atoll.algorithms.fragments import FlatFragment
from atoll.config.facts import IslandSettings
from atoll.job.flat_views import check_flat_out
from atoll.job.island import InnerOptimizer, Island, build_island, copy_flat_into
from atoll.runtime.collective.failure import dist_call

_FULL = StateDictOptions(full_state_dict=True)


def shard_model(model: torch.nn.Module, group: Any, device: torch.device, precision: str = "fp32") -> None:
    """Shard ``model`` in place over the ranks of ``group`` (an island's process group) with FSDP2.

    With ``precision="bf16"`` FSDP2's mixed-precision policy all-gathers the parameters in bfloat16 for the
    forward and backward passes and reduce-scatters the gradients in float32 (torchtitan's default): half
    the gather traffic and memory of the whole layers; the sharded weights, gradients and optimizer state
    stay float32 (the master weights).

    Each block the model names in ``_no_split_modules`` (a Hugging Face model's decoder layers) is its own
    FSDP unit, so only one block's parameters are whole at a time; the root holds the rest (embeddings,
    final norm, head; tied weights stay tied). Parameters become ``DTensor`` s placed ``Shard(0)`` on a
    one-dimensional mesh of the group, on ``device``. Collective over ``group``.
    """
    mesh = DeviceMesh.from_group(group, device.type)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if precision == "bf16" else MixedPrecisionPolicy())
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensors(obj: Any) -> Any:
    """``obj`` (dicts, lists, tensors, scalars) with every ``DTensor`` replaced by its whole tensor.

    Collective over each DTensor's mesh: every rank of the island calls it on a state of the same layout.
    """
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [full_tensors(v) for v in obj]
    return obj


class ShardedIsland(Island):
    """An :class:`~atoll.job.island.Island` whose model was sharded by :func:`shard_model` before its
    optimizer was built (so AdamW's moments are sharded too). Its flat vectors are this rank's shard.

    State dicts hold the *full* tensors (the same keys, shapes and optimizer layout as an unsharded
    island's); :meth:`state_dict` and :meth:`load_state_dict` are collective over the island's ranks.
    """

    def gradient_sync(self, last: bool) -> Any:
        """FSDP2 reduce-scatters the gradient only in the backward pass of the last micro-batch
        (``set_requires_gradient_sync``); the others accumulate the unsharded gradient locally."""
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    def local_params(self) -> list[torch.Tensor]:
        """This rank's piece of each parameter (views: writing them writes the parameter), in order."""
        with torch.no_grad():
            return [_local(p) for p in self.params]

    def shard_pieces(self) -> list[tuple[int, int, int]]:
        """Where this rank's pieces sit in the whole flat vector: per parameter whose piece is not empty,
        ``(flat_start, flat_stop, local_start)`` (``model.parameters()`` order, flattened row-major): FSDP2's
        ``Shard(0)`` gives it a run of whole rows, so each piece is one range. No collective."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        pieces, offset, local = [], 0, 0
        for p in self.params:
            shape, start = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            row = p.numel() // max(1, p.shape[0]) if p.dim() else 1
            n = _local(p).numel()
            if n:
                a = offset + (start[0] * row if p.dim() else 0)
                pieces.append((a, a + n, local))
            offset += p.numel()
            local += n
        return pieces

    def local_fragment(self, fragment: FlatFragment) -> FlatFragment:
        """``fragment``'s elements this rank holds, as ranges of its shard's flat vector (:meth:`flat_params`),
        in the fragment's element order: its pieces intersected with the fragment's ranges (the slices a
        service island's ranks push, :func:`atoll.runtime.service.slices.shard_parts`)."""
        from atoll.runtime.service.slices import shard_parts

        return shard_parts(fragment, [self.shard_pieces()])[0].local

    def flat_params(self, fragment: FlatFragment | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard, float32 on the CPU: its pieces concatenated, shape (numel of the pieces,); or
        ``fragment``'s elements of it (ranges of the shard's flat vector); written into ``out`` where given
        (as :meth:`FlatViews.flat_params <atoll.job.flat_views.FlatViews.flat_params>`, whose ValueError it
        raises)."""
        if fragment is not None:
            return super().flat_params(fragment, out=out)
        flat = parameters_to_vector([_local(p.detach()) for p in self.params])
        if out is None:
            return flat.to("cpu", torch.float32)
        check_flat_out(out, flat.numel())
        return out.copy_(flat)  # the device-to-host copy and the cast straight into it

    def set_flat_params(self, flat: torch.Tensor, fragment: FlatFragment | None = None) -> None:
        """Overwrite this rank's pieces (or ``fragment``'s elements of its shard) from a flat float32 vector
        shaped as :meth:`flat_params`."""
        if fragment is not None:
            super().set_flat_params(flat, fragment)
            return
        copy_flat_into(self.local_params(), flat)

    def flat_grads(self) -> torch.Tensor:
        """This rank's pieces of the island's mean gradient, float32 on the CPU (missing ones: zeros)."""
        return torch.cat([(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)))
                          .reshape(-1).to("cpu", torch.float32) for p in self.params])

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        """Overwrite the gradients' pieces from a flat float32 vector shaped as :meth:`flat_params`."""
        offset = 0
        for p in self.params:
            piece = _local(p.detach())
            n = piece.numel()
            local = flat[offset:offset + n].view_as(piece).to(piece.device, piece.dtype).clone()
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
            offset += n

    def state_dict(self) -> dict[str, Any]:
        """The island's state with whole tensors (collective over the island's ranks; each gets it all)."""
        return {
            "model": {k: v.detach().clone() for k, v in get_model_state_dict(self.model, options=_FULL).items()},
            "optimizer": full_tensors(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "compute_s": self.compute_s,
            "tokens": self.tokens,
            "skipped_steps": self.skipped_steps,
        }

    def local_state_dict(self) -> dict[str, Any]:
        """The island's state as this rank holds it: every parameter and AdamW moment a ``DTensor`` (its
        ``Shard(0)`` piece on this rank; no collective, no copy), for a per-rank checkpoint
        (:mod:`atoll.job.rank_checkpoint` saves the pieces)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "compute_s": self.compute_s, "tokens": self.tokens,
                "skipped_steps": self.skipped_steps, "reset_count": self.reset_count}

    def load_local_state_dict(self, state: dict[str, Any], was_dtensor: Callable[[str], bool]) -> None:
        """Load :meth:`local_state_dict`'s pieces as saved by this rank's position (no collective).

        ``was_dtensor(key)`` says whether the tensor at dotted ``key`` (``model.<name>``,
        ``optimizer.state.<index>.<name>``) was a ``DTensor`` piece; those are wrapped again with their
        parameter's mesh and placement.
        """
        own = self.model.state_dict()
        model = {}
        for k, v in state["model"].items():
            p = own[k]
            model[k] = (DTensor.from_local(v.to(p.device, p.dtype), p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
                        if isinstance(p, DTensor) and was_dtensor(f"model.{k}") else v)
        self.model.load_state_dict(model)
        optimizer = state["optimizer"]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        moments = {}
        for index, entry in optimizer["state"].items():
            p = params[int(index)]
            moments[index] = {k: (DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False,
                                                     shape=p.shape, stride=p.stride())
                                  if was_dtensor(f"optimizer.state.{index}.{k}") else v)
                              for k, v in entry.items()}
        self.optimizer.load_state_dict({**optimizer, "state": moments})
        self.scheduler.load_state_dict(state["scheduler"])
        self.compute_s = float(state["compute_s"])
        self.tokens = int(state["tokens"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.reset_count = int(state.get("reset_count", 0))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state with whole tensors (an unsharded or a sharded island's): each rank keeps its pieces."""
        set_model_state_dict(self.model, state["model"], options=_FULL)
        optimizer = state["optimizer"]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        own = {}
        for index, entry in optimizer["state"].items():
            p = params[int(index)]
            own[index] = {k: (distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements,
                                                src_data_rank=None)
                              if k != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape else v)
                          for k, v in entry.items()}
        self.optimizer.load_state_dict({**optimizer, "state": own})
        self.scheduler.load_state_dict(state["scheduler"])
        self.compute_s = float(state["compute_s"])
        self.tokens = int(state["tokens"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class ShardLayout:
    """Where each rank's shard sits in the whole flat parameter vector of a sharded island.

    Args:
        params: the island's parameters, ``DTensor`` s placed ``Shard(0)`` (in ``model.parameters()`` order).
        group: the island's process group; position r is group rank r.
        device: where the group's collectives take their tensors (the rank's GPU for NCCL, else the CPU).

    Attributes:
        counts: (R, P) int64, elements of parameter j held by position r.

    Raises:
        ValueError: a parameter is not a ``DTensor`` placed ``Shard(0)``.
    """

    def __init__(self, params: list[torch.Tensor], group: Any, device: torch.device) -> None:
        for p in params:
            if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),):
                raise ValueError("sharded island: every parameter must be a DTensor placed Shard(0)")
        self.group, self.device = group, device
        mine = torch.tensor([_local(p).numel() for p in params], dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist_call(dist.all_gather, rows, mine, group=group)
        self.counts = torch.stack(rows).cpu()

    @property
    def numel_per_rank(self) -> list[int]:
        """Elements of each position's shard: R integers summing to the model's parameter count."""
        return [int(n) for n in self.counts.sum(dim=1)]

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole flat vector (numel,) in ``model.parameters()`` order from every rank's ``shard``
        (float32, shaped as :meth:`ShardedIsland.flat_params`); float32 on the CPU. Collective over the island."""
        sizes = self.numel_per_rank
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=torch.float32, device=self.device)
        padded[:shard.numel()] = shard.to(self.device, torch.float32)
        rows = [torch.empty_like(padded) for _ in sizes]
        dist_call(dist.all_gather, rows, padded, group=self.group)
        pieces = [torch.split(row[:n].cpu(), counts.tolist())
                  for row, n, counts in zip(rows, sizes, self.counts, strict=True)]
        return torch.cat([pieces[r][j] for j in range(self.counts.shape[1]) for r in range(len(sizes))])


# --- the collective runtime's sharded islands: building, an older checkpoint's state ------------------------
def _seed_of(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


@torch.no_grad()
def materialize(model: torch.nn.Module, seed: int, device: torch.device, init_from: str | None = None) -> None:
    """Give a model built on the meta device and sharded (:func:`shard_model`) storage for this rank's pieces
    only, on ``device``, and initialise them: no process ever holds the whole model (meta-device
    initialisation, as torchtitan does: Liang et al. 2024, arXiv:2410.06511, section 3.1).

    Each parameter is initialised by the model's own ``_init_weights`` (Hugging Face: normal(0,
    ``initializer_range``) for linear and embedding weights, ones for norms) on a CPU copy of its module,
    one module at a time, with a generator seeded by ``seed`` and the module's name; this rank keeps its
    rows. The values are therefore the same whatever the number of ranks, but not those of the unsharded
    model built by :func:`atoll.job.model.build_model` (one generator for the whole model, which only a
    whole model can replay); start both from ``--init-from`` to compare them. With ``init_from`` (a run
    folder), each rank reads its rows of the checkpoint's ``model/model.safetensors`` instead. Buffers
    (rotary frequencies) are recomputed by their module.

    Raises:
        ConfigError: ``init_from`` holds no Hugging Face model of this shape.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    buffered = [m for m in model.modules() if any(True for _ in m.buffers(recurse=False))]
    model.to_empty(device=device)
    for module in buffered:  # non-persistent buffers (rotary inv_freq): computed again by a fresh module
        fresh = type(module)(config=model.config)
        for name, buf in fresh.named_buffers(recurse=False):
            getattr(module, name).copy_(buf)

    def rows(p: torch.Tensor) -> tuple[int, int]:
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return offset[0], offset[0] + shape[0]

    if init_from is not None:
        _load_rows(model, init_from, rows)
        return
    done: set[int] = set()
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in done]
        if not own:
            continue
        twin = copy.copy(module)  # the module's class and settings, its own CPU parameters
        twin._parameters = {n: None if p is None else torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                            for n, p in module._parameters.items()}
        twin._modules = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed_of(seed, name))
            model._init_weights(twin)  # type: ignore[operator]
        for n, p in own:
            a, b = rows(p)
            _local(p).copy_(twin._parameters[n][a:b])
            done.add(id(p))


def _load_rows(model: torch.nn.Module, init_from: str, rows: Any) -> None:
    """Each parameter's rows ``rows(p)`` read from the Hugging Face model of ``init_from``'s latest
    checkpoint (safetensors reads only those rows)."""
    from pathlib import Path

    from safetensors import safe_open

    from atoll.errors import ConfigError
    from atoll.job.checkpoint import latest_checkpoint

    try:
        weights = latest_checkpoint(Path(init_from)) / "model" / "model.safetensors"
        with safe_open(str(weights), framework="pt") as f:
            keys = set(f.keys())
            for name, p in model.named_parameters():  # a tied head once, under the embedding's name
                if name not in keys or tuple(f.get_slice(name).get_shape()) != tuple(p.shape):
                    raise ConfigError(f"init_from: the model in '{init_from}' does not match --model/--vocab-size "
                                      f"of this run ({name}); use the same model and vocabulary as that run")
                a, b = rows(p)
                _local(p).copy_(f.get_slice(name)[a:b])
    except ConfigError:
        raise
    except Exception as e:  # no checkpoint, or no model folder (a syncer's), or a damaged file
        raise ConfigError(f"init_from: sharded islands start from the model/ folder of a run's checkpoint, and "
                          f"'{init_from}' has none readable ({type(e).__name__}); pass the --out folder of a "
                          "finished lockstep run") from None


def build_sharded_island(index: int, model: torch.nn.Module, settings: IslandSettings, optimizer: InnerOptimizer,
                         group: Any, device: torch.device, seed: int, init_from: Path | None = None
                         ) -> tuple[Island, ShardLayout]:
    """Island ``index`` with ``model`` sharded over its ranks (``group``) before the inner optimizer is built,
    so the optimizer holds this rank's shard only; and the layout of the shards. A model on the meta device
    takes storage for this rank's pieces here (:func:`materialize`: initialised from ``seed``, or the weights
    of run folder ``init_from``). ``settings``, ``optimizer``: as :func:`~atoll.job.island.build_island`'s."""
    from atoll.job.model import enable_activation_checkpointing
    from atoll.runtime.collective.sharded_demo import shard_aware

    if settings.activation_checkpointing:  # checkpoint the blocks before FSDP2 wraps them (torchtitan's order)
        enable_activation_checkpointing(model)
    meta = any(p.is_meta for p in model.parameters())
    shard_model(model, group, device, settings.precision)
    if meta:
        materialize(model, seed, device, str(init_from) if init_from else None)
    # a strategy's own optimizer, DeMo, selects from whole tensors (sharded_demo); AdamW stays as built
    island = build_island(index, model, settings, shard_aware(optimizer), island_type=ShardedIsland)
    return island, ShardLayout(island.params, group, device)


def load_sharded_job_state(rt: Any, state: dict[str, Any], islands: list[Island], strategy: Any) -> None:
    """A checkpoint of whole tensors gathered on rank 0 (before per-rank checkpoints): each rank of a sharded island
    keeps its pieces of the whole tensors, and its position's strategy state.

    Raises:
        CheckpointError: the checkpoint's islands were sharded over another number of ranks (or not at all).
    """
    from atoll.errors import CheckpointError

    saved = state.get("shard_ranks")
    if saved != rt.ranks_per_island:
        raise CheckpointError(f"resume: the checkpoint's islands are sharded over {saved} ranks, this "
                              f"run's over {rt.ranks_per_island}; resume with --ranks-per-island {saved}")
    for island in islands:
        island.load_state_dict(state["islands"][island.index])
    strategy.load_state_dict(state["strategy_shards"][rt.position])
    for position, island in enumerate(islands):
        strategy.load_island_state(position, state["strategy_islands"][island.index][rt.position])
    rt.comm.load_state_dict(state["comm"])
