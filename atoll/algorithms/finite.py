"""One-pass finite checks of the tensors an exchange moves (pseudo-gradients, merged globals, pushes).

A NaN or an infinity in one element makes the float sum NaN or infinite, so a finite sum proves every element
finite; only when the sum is not finite (a real NaN, or finite values whose sum overflowed) is the exact
element-wise check run. ``isfinite(t).all()`` materializes a boolean per element: about 8-12 ns per element on
one CPU thread against under 1 for the sum (bench/outer_round.py measures both). Pure tensor math.
"""

from __future__ import annotations

import torch

__all__ = ["all_finite"]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` (any shape, float or integer dtype) is finite: one pass over it (the
    exact check only on alarm); one host sync when ``t`` is on an accelerator. True for an empty tensor."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
