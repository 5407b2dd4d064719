"""One-pass checks of the tensors an exchange moves (pseudo-gradients, merged globals, pushes): finite, and norm.

A NaN or an infinity in one element makes the float sum NaN or infinite, so a finite sum proves every element
finite; only when the sum is not finite (a real NaN, or finite values whose sum overflowed) is the exact
element-wise check run. ``isfinite(t).all()`` materializes a boolean per element: about 8-12 ns per element on
one CPU thread against under 1 for the sum (bench/outer_round.py measures both).

A float32 ``norm()`` of a long vector drifts with its length (its terms summed in one running float32 order):
relative errors of about 1e-4 at 4M elements and growing faster than the length beyond
(tests/test_finite.py). :func:`l2_norm` takes float32 norms of rows of :data:`NORM_ROW` elements, accurate at that
length, and sums their squares in float64: one pass, accurate at any length. Pure tensor math.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NORM_ROW", "all_finite", "l2_norm"]

#: elements per row of the float32 norms that :func:`l2_norm` combines in float64
NORM_ROW = 1 << 16


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` (any shape, float or integer dtype) is finite: one pass over it (the
    exact check only on alarm); one host sync when ``t`` is on an accelerator. True for an empty tensor."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def l2_norm(t: torch.Tensor) -> float:
    """The L2 norm of ``t`` (any shape, a real float dtype), accurate at any length (module docstring): float32
    norms (float64 for a float64 ``t``) of its rows of :data:`NORM_ROW` elements, their squares summed in float64
    on the host. One pass over ``t`` (a contiguous copy first where it is not contiguous); one host
    sync on an accelerator. For a float32 tensor of fewer than :data:`NORM_ROW` elements, equal to
    ``float(t.norm())``; a half-precision one is measured in float32 (``norm()`` keeps its dtype, and may
    overflow). A row's float32 norm overflows to inf as ``norm()`` does (an element above about 1.8e19); a float64
    tensor's squares beyond float64's range (norms above about 1e154) read inf; 0.0 for an empty tensor.

    Raises:
        RuntimeError: ``t`` is not of a floating dtype (torch's message, as ``norm()``'s).
    """
    flat = t.detach().reshape(-1).contiguous()  # torch's strided norm sums in a less accurate order
    n = flat.numel()
    if n == 0:
        return 0.0
    dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
    whole = n // NORM_ROW * NORM_ROW
    rows = [torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1, dtype=dtype)] if whole else []
    if whole < n:
        rows.append(torch.linalg.vector_norm(flat[whole:], dtype=dtype).reshape(1))
    norms = torch.cat(rows) if len(rows) > 1 else rows[0]
    return math.sqrt(float(norms.to("cpu", torch.float64).square().sum()))
