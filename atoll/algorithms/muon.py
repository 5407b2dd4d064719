"""Muon as an island's inner optimizer: orthogonalized momentum for hidden weight matrices, AdamW for the rest.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; ``torch.optim.Muon``) replaces each 2-D
weight's momentum update by its nearest semi-orthogonal matrix (Newton-Schulz iterations). It applies to the
hidden layers' matrices only: the token embedding, the output head, norms and biases keep AdamW (Jordan et
al.; Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982, whose ``match_rms_adamw``
learning-rate adjustment lets Muon share AdamW's learning rate and weight decay). MuLoCo (Thérien et al.
2025, arXiv:2505.23725) uses it as DiLoCo's inner optimizer.

:class:`MuonWithAdamW` holds the two library optimizers behind one ``torch.optim.Optimizer``, so the
island's learning-rate schedule, gradient clipping and checkpoints treat it as one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: parameter-name fragments that stay with AdamW even when 2-D (embeddings and the output head)
NOT_MUON = ("embed", "lm_head", "wte", "wpe")


def muon_eligible(name: str, param: torch.Tensor) -> bool:
    """Whether a parameter is a hidden-layer weight matrix (2-D, not an embedding or the output head)."""
    return param.ndim == 2 and not any(part in name for part in NOT_MUON)


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the hidden matrices and ``torch.optim.AdamW`` over every other parameter.

    Args:
        muon_params: the hidden-layer matrices (2-D float tensors).
        adamw_groups: AdamW's parameter groups (e.g. decayed matrices, undecayed vectors).
        lr: the shared peak learning rate (Muon's scaled by ``match_rms_adamw``).
        weight_decay: Muon's decoupled weight decay (AdamW's groups carry their own).
        momentum: Muon's Nesterov momentum.
        betas: AdamW's betas.

    The schedule sets ``lr`` on :attr:`param_groups` (Muon's group first, then AdamW's); each :meth:`step`
    passes them on. :meth:`state_dict` holds both optimizers' states.

    Raises:
        ValueError: a Muon parameter that is not 2-D (from ``torch.optim.Muon``).
    """

    def __init__(self, muon_params: list[torch.Tensor], adamw_groups: list[dict[str, Any]], lr: float,
                 weight_decay: float, momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95)) -> None:
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     adjust_lr_fn="match_rms_adamw") if muon_params else None
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas)
        inner = ([self.muon] if self.muon is not None else []) + [self.adamw]
        groups = [{"params": list(g["params"]), "lr": g["lr"], "weight_decay": g["weight_decay"]}
                  for opt in inner for g in opt.param_groups]
        super().__init__(groups, {"lr": lr})
        self._inner = inner

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of both optimizers, with this optimizer's current learning rates."""
        loss = closure() if closure is not None else None
        mine = iter(self.param_groups)
        for opt in self._inner:
            for group in opt.param_groups:
                group["lr"] = next(mine)["lr"]
            opt.step()
        return loss

    def clear_state(self) -> None:
        """Forget both optimizers' state (momenta, second moments, step counts), as a fresh optimizer has none:
        :attr:`state` of this wrapper is empty, the inner optimizers hold theirs."""
        self.state.clear()
        for opt in self._inner:
            opt.state.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict() if self.muon is not None else None,
                "adamw": self.adamw.state_dict(), "lr": [g["lr"] for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.muon is not None:
            self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        for group, lr in zip(self.param_groups, state_dict["lr"], strict=True):
            group["lr"] = lr


def muon_with_adamw(named: list[tuple[str, torch.Tensor]], lr: float, weight_decay: float) -> MuonWithAdamW:
    """The inner optimizer ``--inner-optimizer muon`` builds for a model's ``named_parameters()``: Muon for
    the hidden matrices, AdamW (weight decay on the other matrices only) for the rest."""
    muon = [p for n, p in named if muon_eligible(n, p)]
    decay = [p for n, p in named if not muon_eligible(n, p) and p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    return MuonWithAdamW(muon, [{"params": decay, "weight_decay": weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}], lr=lr, weight_decay=weight_decay)
