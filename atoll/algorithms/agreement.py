"""An adaptive outer step: each tensor's share of the outer step set by how much the islands agree on it.

K islands each send a pseudo-gradient Δ_i = g + n_i: a shared descent direction g and island noise n_i
(its own data, its own inner trajectory). Their token-weighted mean Δ̄ carries the noise divided by the
effective number of islands K_eff = (Σ w_i)² / Σ w_i². From two numbers per parameter tensor, the squared
norm of the mean, ``D = ‖Δ̄‖²``, and the weighted mean of the islands' squared norms, ``M = Σ w_i ‖Δ_i‖² / Σ w_i``,
the share of ``D`` that is signal is estimated as::

    f = (K_eff · D − M) / ((K_eff − 1) · D),   clipped to [0, 1]

(``E[M] = ‖g‖² + σ²`` and ``E[D] = ‖g‖² + σ²/K_eff``, so f estimates ‖g‖² / E[D]: 1 when every island sent
the same Δ, near 0 when the Δ_i are independent noise). This is the two-norm estimator of the gradient noise
scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", arXiv:1812.06162, Appendix A),
taken across islands instead of across batch sizes, per tensor and every round, with no state.

The step: each tensor's averaged pseudo-gradient is multiplied by ``f / f̄`` (f̄: the element-weighted mean
of f over the model; at most ``MAX_MULTIPLIER``) before the outer optimizer (DiLoCo's outer SGD-Nesterov,
Douillard et al. 2023, arXiv:2311.08105). The overall outer rate stays ``outer_lr``; what changes is how it
is shared: tensors the islands agree on step more, tensors whose pseudo-gradients are mostly island noise
step less, as LARS/LAMB (You et al. 2017, arXiv:1708.03888; 2019, arXiv:1904.00962) share one rate across
layers by a per-layer ratio. Scaling by f itself (the Wiener shrinkage of a noisy mean) lowers the overall
rate to about f̄ times ``outer_lr`` and trained worse in ``bench/beyond.py``'s study; the relative form is
what atoll ships.

The norms travel as one extra float32 all-reduce of ``T + 1`` values per round (T parameter tensors; the
last value carries each island's share of the weight, for K_eff).
"""

from __future__ import annotations

import torch

__all__ = ["MAX_MULTIPLIER", "AgreementScaler", "signal_fraction"]

#: no tensor steps more than this many times the outer rate, however lonely its agreement
MAX_MULTIPLIER = 2.0


def signal_fraction(mean_sq: torch.Tensor, island_sq: torch.Tensor, islands: float) -> torch.Tensor:
    """The estimated signal share of each tensor's averaged pseudo-gradient (module docstring).

    Args:
        mean_sq: ``D``, the squared norm of each tensor's mean pseudo-gradient, float32 (T,).
        island_sq: ``M``, the weighted mean over islands of each tensor's squared norm, float32 (T,).
        islands: K_eff, the effective number of islands (>= 1).

    Returns:
        float32 (T,) in [0, 1]; 1 where ``islands`` <= 1 (one island: nothing to compare) or ``D`` is 0.
    """
    if islands <= 1 + 1e-9:
        return torch.ones_like(mean_sq)
    f = (islands * mean_sq - island_sq) / ((islands - 1) * mean_sq.clamp(min=torch.finfo(torch.float32).tiny))
    return torch.where(mean_sq > 0, f.clamp(0.0, 1.0), torch.ones_like(f))


class AgreementScaler:
    """Per-tensor agreement weighting of a flat averaged pseudo-gradient (module docstring).

    Args:
        numels: element counts of the model's parameter tensors, in the flat vector's order.

    Attributes:
        rounds: outer steps weighted so far.
        agreement_sum: sum over rounds of f̄, the element-weighted mean signal share (``/ rounds``: the run's mean).
        last_agreement: the last round's f̄ (1 before any round).
    """

    def __init__(self, numels: list[int]) -> None:
        self.numels = [int(n) for n in numels]
        self.counts = torch.tensor(self.numels, dtype=torch.float32)
        self.rounds = 0
        self.agreement_sum = 0.0
        self.last_agreement = 1.0

    def _sq_norms(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.stack([c.pow(2).sum() for c in flat.float().split(self.numels)])

    def statistics(self, delta: torch.Tensor, weight_share: float) -> torch.Tensor:
        """What one island contributes to the norms' all-reduce: each tensor's ‖Δ_i‖², then ``w_i / Σw``.

        Args:
            delta: the island's pseudo-gradient, float32 (numel,).
            weight_share: the island's weight over the job's total weight.

        Returns:
            float32 (T + 1,).
        """
        return torch.cat([self._sq_norms(delta), torch.tensor([weight_share], dtype=torch.float32)])

    def weigh(self, mean: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
        """Multiply each tensor of the averaged pseudo-gradient by ``min(f / f̄, MAX_MULTIPLIER)``.

        Args:
            mean: Δ̄, the token-weighted mean pseudo-gradient, float32 (numel,).
            reduced: the weighted mean over islands of :meth:`statistics`, with the same weights as ``mean``'s.

        Returns:
            The weighted Δ̄, float32 (numel,), a new tensor (Δ̄ itself when f̄ is 0: nothing to share by).
        """
        island_sq, mean_share = reduced[:-1], float(reduced[-1])
        k_eff = 1.0 / mean_share if mean_share > 0 else 1.0  # Σw / (Σw²/Σw), with w normalized by Σw
        f = signal_fraction(self._sq_norms(mean), island_sq, k_eff)
        self.last_agreement = float((f * self.counts).sum() / self.counts.sum())
        self.agreement_sum += self.last_agreement
        self.rounds += 1
        if self.last_agreement <= 0:
            return mean.clone()
        multiplier = (f / self.last_agreement).clamp(max=MAX_MULTIPLIER)
        return mean * torch.repeat_interleave(multiplier, self.counts.long())

    def summary(self) -> dict[str, float]:
        """``outer_agreement_mean`` and ``outer_agreement_last``: f̄ over the run's rounds and at the last one."""
        return {"outer_agreement_mean": self.agreement_sum / self.rounds if self.rounds else 1.0,
                "outer_agreement_last": self.last_agreement}

    def state_dict(self) -> dict[str, float]:
        return {"rounds": self.rounds, "agreement_sum": self.agreement_sum, "last_agreement": self.last_agreement}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.rounds = int(state["rounds"])
        self.agreement_sum = float(state["agreement_sum"])
        self.last_agreement = float(state["last_agreement"])
