"""Byzantine-robust merges of pseudo-gradients: norm clipping, coordinate-wise trimmed mean and median.

A merge that is a (weighted) mean lets one sender move the result anywhere: a push that is the others'
mean, sign-flipped and scaled, reverses the step while each of its properties (finite, in a norm bound)
looks honest. The robust aggregation rules of the literature bound what a minority can do:

- ``clip``: every Δ_i is scaled to at most the median of the merged pushes' L2 norms, then the weighted
  mean is taken (centred clipping's bound without the centring; Karimireddy, He, Jaggi 2021,
  arXiv:2012.10333, §4). A minority moves the step by at most its share times the median norm.
- ``trimmed_mean``: per coordinate, the largest and the smallest ``trim`` fraction of the values are
  dropped and the rest averaged, unweighted (Yin, Chen, Ramchandran, Bartlett 2018, arXiv:1803.01498,
  Definition 2); with n < 3 values it is the median.
- ``median``: the coordinate-wise median (the mean of the two middle values for even n; Yin et al. 2018,
  Definition 1), unweighted.

The trimmed mean and the median ignore the weights (tokens, staleness) by construction: a weight is a claim
of the sender's, which is what they do not trust. ``none`` is :func:`~atoll.algorithms.merge.weighted_mean`.
Pure tensor math on float32 tensors; errors are ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from atoll.algorithms.finite import l2_norm
from atoll.algorithms.merge import weighted_mean

#: the merges :func:`robust_mean` knows
ROBUST_MERGES = ("none", "clip", "trimmed_mean", "median")


def clip_to_median_norm(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor scaled to at most the lower median of their L2 norms (``clip``'s first half; a minority
    never sets the median), the others returned as they are. Raises ValueError for no tensors."""
    if not tensors:
        raise ValueError("clip_to_median_norm: no tensors")
    norms = [l2_norm(t) for t in tensors]
    cap = sorted(norms)[(len(norms) - 1) // 2]  # the lower median: a minority never sets it
    return [t * (cap / n) if n > cap else t for t, n in zip(tensors, norms, strict=True)]


def robust_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float], method: str = "none",
                trim: float = 0.25, out: torch.Tensor | None = None) -> torch.Tensor:
    """Merge same-shaped float32 tensors (numel,) with the robust rule ``method``; float32 (numel,).

    Args:
        tensors: the pseudo-gradients Δ_i, one per push, same shape.
        weights: the merge weight of each (tokens x staleness discount); used by ``none`` and ``clip``.
        method: one of :data:`ROBUST_MERGES`.
        trim: ``trimmed_mean``: the fraction of values dropped at each end per coordinate, in [0, 0.5)
            (at least one at each end when n >= 3).
        out: ``none``: the buffer the mean is accumulated in (:func:`~atoll.algorithms.merge.weighted_mean`).

    Raises:
        ValueError: an unknown method, no tensors, or ``trim`` outside [0, 0.5).
    """
    if method == "none":
        return weighted_mean(tensors, weights, out=out)
    if not tensors:
        raise ValueError("robust_mean: no tensors to merge")
    if method == "clip":
        return weighted_mean(clip_to_median_norm(tensors), weights)
    stacked = torch.stack([t.to(torch.float32) for t in tensors])  # (n, numel)
    n = stacked.shape[0]
    if method == "median" or (method == "trimmed_mean" and n < 3):
        ordered = stacked.sort(dim=0).values
        return 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
    if method == "trimmed_mean":
        if not 0 <= trim < 0.5:
            raise ValueError(f"robust_mean: trim {trim} outside [0, 0.5)")
        k = max(1, math.floor(trim * n))
        return stacked.sort(dim=0).values[k:n - k].mean(dim=0)
    raise ValueError(f"robust_mean: unknown method '{method}'; use one of {', '.join(ROBUST_MERGES)}")
