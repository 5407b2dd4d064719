"""Batches: random training windows of an island's shard, and evenly spread validation windows.

Batches are a pure function of ``(seed, island, step)``: a resumed run draws exactly the same batches
without any saved iterator state.
"""

from __future__ import annotations

import numpy as np
import torch

from atoll.errors import DataError


def sample_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, island: int, step: int
) -> torch.Tensor:
    """Random windows of an island's shard, a pure function of ``(seed, island, step)``.

    Window starts are drawn uniformly from ``[0, len(tokens) - seq_len - 1]`` by
    ``np.random.default_rng([seed, island, step])``: no iterator state, so a resumed run draws the same
    batches, and each island draws independently of the others.

    Args:
        tokens: 1-D shard of token ids (any integer dtype).
        batch_size: windows per batch, >= 1.
        seq_len: model context in tokens, >= 1; each window holds ``seq_len + 1`` tokens (inputs
            ``[:, :-1]``, targets ``[:, 1:]``).
        seed, island, step: non-negative integers.

    Returns:
        ``torch.int64`` tensor of shape ``(batch_size, seq_len + 1)`` on the CPU.

    Raises:
        DataError: the shard is shorter than ``seq_len + 1``, or an argument is out of range.
    """
    if batch_size < 1 or seq_len < 1:
        raise DataError(f"batch_size/seq_len: got {batch_size}/{seq_len}; both must be >= 1")
    if min(seed, island, step) < 0:
        raise DataError(f"seed: seed, island and step must be >= 0 (got {seed}, {island}, {step})")
    window = seq_len + 1
    if len(tokens) < window:
        raise DataError(
            f"seq_len: island {island}'s shard has {len(tokens)} tokens, fewer than seq_len + 1 = {window}; "
            "lower seq_len or use a larger corpus / fewer islands"
        )
    rng = np.random.default_rng([seed, island, step])
    starts = rng.integers(0, len(tokens) - window, size=batch_size, endpoint=True)
    idx = starts[:, None] + np.arange(window)
    return torch.from_numpy(tokens[idx].astype(np.int64))


def eval_batches(
    val_tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int
) -> list[torch.Tensor]:
    """Non-overlapping windows spread evenly over the whole validation split, grouped into batches.

    The split holds ``M = len(val_tokens) // (seq_len + 1)`` whole windows; ``n = min(M, batch_size *
    max_batches)`` of them are used, window ``j`` of ``n`` being whole window ``floor(j * M / n)``, so a
    small evaluation still samples every part of the split rather than its first documents. Batches hold
    ``batch_size`` windows; a last partial batch is dropped unless it is the only one (then it has fewer
    rows).

    Args:
        val_tokens: 1-D validation token ids.
        batch_size: windows per batch, >= 1.
        seq_len: model context; windows hold ``seq_len + 1`` tokens.
        max_batches: at most this many batches, >= 1.

    Returns:
        A list of 1 to ``max_batches`` ``torch.int64`` tensors of shape ``(batch_size, seq_len + 1)`` (or
        ``(n, seq_len + 1)`` with ``n < batch_size`` for a lone partial batch).

    Raises:
        DataError: fewer than ``seq_len + 1`` validation tokens, or an argument is < 1.
    """
    if batch_size < 1 or seq_len < 1 or max_batches < 1:
        raise DataError(
            f"batch_size/seq_len/eval_batches: got {batch_size}/{seq_len}/{max_batches}; all must be >= 1"
        )
    window = seq_len + 1
    n_windows = len(val_tokens) // window
    if n_windows == 0:
        raise DataError(
            f"seq_len: the validation split has {len(val_tokens)} tokens, fewer than seq_len + 1 = {window}; "
            "lower seq_len or use a larger corpus"
        )
    total_windows = n_windows
    n_windows = min(n_windows, batch_size * max_batches)
    chosen = (np.arange(n_windows) * total_windows) // n_windows
    all_windows = val_tokens[: total_windows * window].astype(np.int64).reshape(total_windows, window)
    windows = torch.from_numpy(np.ascontiguousarray(all_windows[chosen]))
    if n_windows < batch_size:
        return [windows]
    return list(windows[: (n_windows // batch_size) * batch_size].split(batch_size))
