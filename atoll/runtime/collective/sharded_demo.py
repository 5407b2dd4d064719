"""DeMo on a sharded island (``--strategy demo --shard-island``): the selection of whole tensors, one at a time.

DeMo (Peng, Quesnelle, Kingma 2024, arXiv:2411.19870, Algorithm 1; :class:`~atoll.algorithms.demo.DeMo`) keeps
the top-k DCT-II coefficients of each 64 x 64 tile of a parameter's momentum. Tiles cross the row boundaries
of FSDP2's ``Shard(0)`` pieces (a (64, 32) matrix over two ranks is one tile, but two pieces of 32 rows), so a
rank's piece alone cannot make the reference's selection. :class:`ShardedDeMo` therefore keeps the momentum
sharded (a ``DTensor`` like its parameter: the element-wise steps a and e run on the rank's piece) and, for
each parameter in turn, all-gathers the momentum inside the island (``DTensor.full_tensor``), selects,
transmits and removes exactly as the unsharded optimizer does on the whole tensor, and keeps its own rows of
what is removed; every rank of the island then holds the same payload, which the exchange moves once
(``replicated``: cut into one piece per rank, :meth:`DistComm.all_gather
<atoll.runtime.collective.comm.DistComm.all_gather>`). Applying decodes every island's payload for the whole
tensor and keeps the rank's rows of its sign.

Memory: at most one parameter's whole momentum, its DCT coefficients and their decoded update per rank at a
time (a few times the largest tensor: about 4 x 4 bytes x the embedding at 1B, 0.5 GB for a 128k x 2048
embedding), never the whole model; on the CPU three of those (the DCT's buffers, :meth:`DeMo._buffers`) are held
between steps. Cost: one all-gather of the momentum per parameter and step inside the
island (the fast link), and the selection computed redundantly on each of the island's R ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from atoll.algorithms.dct import index_dtype_for
from atoll.algorithms.demo import DeMo, DemoPayload
from atoll.algorithms.demo_payload import pack_ternary


def local_rows(p: torch.Tensor) -> slice:
    """The rows of ``p`` (a ``DTensor`` placed ``Shard(0)``) this rank holds, as a slice of its first dimension."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return slice(offset[0], offset[0] + shape[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedDeMo(DeMo):
    """:class:`~atoll.algorithms.demo.DeMo` over parameters sharded by FSDP2 (``DTensor`` s placed ``Shard(0)``):
    the same payloads and the same update as the unsharded optimizer on the whole tensors, to the round-off of
    the island's reduce-scattered gradient (see the module docstring). Collective over the island's ranks:
    :meth:`encode_step` all-gathers each momentum. The state (``momentum``: a ``DTensor`` like its parameter,
    ``step``) and the settings are DeMo's."""

    @torch.no_grad()
    def encode_step(self) -> list[DemoPayload]:
        """DeMo's steps a-c (:meth:`DeMo.encode_step`), the selection on each whole momentum in turn.

        Returns:
            One :class:`DemoPayload` per parameter, for the whole tensor, the same on every rank of the island.

        Raises:
            RuntimeError: no parameter has a gradient.
        """
        params = self._params()
        if params and all(p.grad is None for p in params):
            raise RuntimeError("DeMo.encode_step: no parameter has a gradient; call backward() first")
        payloads = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "momentum" not in state:  # sharded like its parameter
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                    state["step"] = torch.zeros((), dtype=torch.int64)
                m = state["momentum"]
                state["step"] = state["step"] + 1
                mine = _local(m)  # a. decoupled momentum, on this rank's rows
                mine.mul_(group["beta"])
                if p.grad is not None:
                    mine.add_(_local(p.grad).to(torch.float32), alpha=group["lr"])
                whole = m.full_tensor() if isinstance(m, DTensor) else m  # the island's all-gather
                t = self.transform_for(p.shape)  # b. top-k DCT coefficients per chunk of the whole tensor
                idx, vals, sent = self._top_components(t, whole, self._buffers(whole))
                mine.sub_(sent[local_rows(p)] if isinstance(m, DTensor) else sent)  # c. this rank's rows of it
                payloads.append(DemoPayload(
                    indices=idx.to(index_dtype_for(t.chunk_elems)),
                    values=pack_ternary(torch.sign(vals)) if self.sign_values else vals,
                    shape=t.shape, chunk_elems=t.chunk_elems, sign_values=self.sign_values))
        return payloads

    def _piece(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``p`` (its local shard; ``p`` itself when not a DTensor)."""
        return _local(p)

    def _apply_update(self, p: torch.Tensor, update: torch.Tensor, lr: float, wd: float) -> None:
        """DeMo's step e on this rank's piece (:meth:`DeMo.apply_step` checks the payloads, averages each
        coefficient over the islands that selected it and decodes the whole tensor): its rows of ``update``."""
        piece = _local(p)
        if wd != 0.0:
            piece.mul_(1.0 - lr * wd)
        piece.add_((update[local_rows(p)] if isinstance(p, DTensor) else update).to(piece.dtype), alpha=-lr)

def shard_aware(factory: Callable[[torch.nn.Module], torch.optim.Optimizer]
                ) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    """An island's inner-optimizer factory (:func:`atoll.job.island.inner_optimizer`) for a sharded island's
    parameters: a :class:`DeMo` it builds becomes a :class:`ShardedDeMo` of the same groups and settings; any
    other optimizer is kept (AdamW is element-wise)."""
    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        opt = factory(model)
        if type(opt) is not DeMo:
            return opt
        return ShardedDeMo(opt.param_groups, lr=opt.defaults["lr"], beta=opt.defaults["beta"], chunk=opt.chunk,
                           topk=opt.topk, weight_decay=opt.defaults["weight_decay"], sign_values=opt.sign_values)
    return build
