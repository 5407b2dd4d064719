"""The outer step of DiLoCo: pseudo-gradients and an SGD-Nesterov outer optimizer on CPU-held globals.

DiLoCo (Douillard et al. 2023, arXiv:2311.08105, Algorithm 1): every H inner steps each island i computes
the pseudo-gradient Δ_i = θ_global − θ_i, the islands average it, and an outer optimizer (SGD with Nesterov
momentum, lr 0.7, momentum 0.9) updates θ_global with Δ as its gradient. With outer lr 1 and momentum 0
the outer step is exactly parameter averaging (FedAvg, McMahan et al. 2017).

The global parameters and the outer momentum live on the CPU in float32, so the outer state costs no
accelerator memory.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from atoll.algorithms.finite import l2_norm
from atoll.algorithms.snapshot import Snapshots


def pseudo_gradient(global_params: torch.Tensor, island_params: torch.Tensor) -> torch.Tensor:
    """Δ = θ_global_before − θ_island_after, float32, same shape as the inputs (DiLoCo Alg. 1, line 9).

    Its sign makes Δ point *against* the islands' progress, as a gradient does: the outer SGD step
    θ ← θ − lr·Δ moves the global parameters towards the islands.
    """
    return global_params.to(torch.float32) - island_params.to(torch.float32)


class OuterOptimizer:
    """Global parameters of one fragment (or of the whole model) and their outer optimizer.

    Args:
        init: the initial global parameters, a 1-D tensor (copied to float32 on the CPU).
        lr: outer learning rate.
        momentum: Nesterov momentum; 0 gives plain SGD.
        pin: hold the globals (and the buffer an accelerator's pseudo-gradient lands in) in pinned host
            memory, so copies to and from the islands' devices are non-blocking (torchft keeps its backups
            pinned); only where CUDA is available.

    Attributes:
        params: the global parameters, 1-D float32 on the CPU, shape (numel,).
        version: number of outer steps applied.
    """

    def __init__(self, init: torch.Tensor, lr: float, momentum: float, pin: bool = False) -> None:
        params = init.detach().to("cpu", torch.float32).clone()
        self.pinned = pin and torch.cuda.is_available()
        if self.pinned:
            params = params.pin_memory()
        self.params = torch.nn.Parameter(params, requires_grad=False)
        # torch's fused kernel: one pass over globals, pseudo-gradient and momentum (the same floats as the
        # default per-op loop, about 6x faster on one CPU thread: bench/outer_round.py)
        self.optimizer = torch.optim.SGD([self.params], lr=lr, momentum=momentum, nesterov=momentum > 0, fused=True)
        self.version = 0
        self._landing: torch.Tensor | None = None  # pinned buffer for a pseudo-gradient from a device
        self._norm: tuple[int, float] | None = None  # (version, norm of the globals at it)
        self._snapshots = Snapshots()  # the copies of globals and momentum that state_dict hands out

    def params_norm(self) -> float:
        """The L2 norm of the global parameters, computed once per version (a syncer checks every push
        against it)."""
        if self._norm is None or self._norm[0] != self.version:
            self._norm = (self.version, l2_norm(self.params))
        return self._norm[1]

    def step(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """Apply one outer step with the averaged pseudo-gradient (1-D float32, on the CPU or a device);
        return the new globals (the CPU tensor itself, not a copy)."""
        if pseudo_grad.shape != self.params.shape:
            raise ValueError(f"pseudo-gradient of shape {tuple(pseudo_grad.shape)} "
                             f"for globals of {tuple(self.params.shape)}")
        if self.pinned and pseudo_grad.device.type == "cuda":  # one non-blocking copy into pinned memory
            if self._landing is None:
                self._landing = torch.empty_like(self.params.detach()).pin_memory()
            self._landing.copy_(pseudo_grad, non_blocking=True)
            torch.cuda.current_stream(pseudo_grad.device).synchronize()
            self.params.grad = self._landing
        else:
            self.params.grad = pseudo_grad.to("cpu", torch.float32)
        self.optimizer.step()
        self.params.grad = None
        self.version += 1
        return self.params.detach()

    def state_dict(self, lend: bool = False) -> dict[str, Any]:
        """A snapshot of the globals and the outer momentum at this version (copies: the next step does not change
        them). Copied once per version: until the next :meth:`step` or :meth:`load_state_dict` every call returns
        the same tensors (never changed afterwards), so a syncer that checkpoints at every commit copies only the
        fragment that stepped, not the whole model (bench/outer_round.py). Treat the tensors as read-only.

        ``lend``: the caller gives the state back with :meth:`release` once it no longer reads it (a checkpoint
        written); a later version's copy may then reuse its memory (:class:`~atoll.algorithms.snapshot.Snapshots`).
        """
        # torch's optimizer state_dict shares its buffers, which the next step mutates in place: they are copied
        opt = self.optimizer.state_dict()
        slots = [(i, k) for i, st in sorted(opt["state"].items()) for k, v in st.items() if torch.is_tensor(v)]
        copies = self._snapshots.get("state", self.version,
                                     [self.params.detach(), *(opt["state"][i][k] for i, k in slots)], lend)
        state = {i: {k: v for k, v in st.items() if not torch.is_tensor(v)} for i, st in opt["state"].items()}
        for (i, k), t in zip(slots, copies[1:], strict=True):
            state[i][k] = t
        return {"params": copies[0], "optimizer": {"state": state, "param_groups": copy.deepcopy(opt["param_groups"])},
                "version": self.version}

    def release(self, state: dict[str, Any]) -> None:
        """Give back a :meth:`state_dict` made with ``lend=True`` (raises ValueError if it was not lent)."""
        self._snapshots.release("state", state["params"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.params.copy_(state["params"])
        # a copy: torch's load keeps the given momentum tensor itself, which the next step would change in place
        # (and ``state`` may be another optimizer's snapshot, read-only)
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.version = int(state["version"])
        self._norm = None
        self._snapshots.forget()
