"""The training loss: mean next-token cross-entropy, in float32 without a float32 copy of the logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

#: the most logits (elements) :func:`chunked_cross_entropy` turns to float32 at once: 2**26 (256 MiB)
LOSS_CHUNK_ELEMENTS = 1 << 26


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                          chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> torch.Tensor:
    """Mean cross-entropy (nats) of ``logits`` (..., vocab), any float dtype, against ``targets`` (...) int64,
    computed in float32 a chunk of rows at a time; a 0-d float32.

    Each chunk's float32 copy (at most ``chunk_elements`` elements) exists only while its loss is computed:
    ``torch.utils.checkpoint`` recomputes it in the backward pass, so what is kept for the gradient is the
    logits in their own dtype (bfloat16 under ``--precision bf16``), never a float32 copy of them all nor
    of their log-softmax. The same chunked-loss idea as Liger Kernel's fused linear cross-entropy (Hsu et
    al. 2024, arXiv:2410.10989), without fusing the head's matmul.

    Raises:
        ValueError: ``targets`` does not match ``logits``' leading shape, or ``chunk_elements`` < 1.
    """
    if logits.shape[:-1] != targets.shape or chunk_elements < 1:
        raise ValueError(f"chunked_cross_entropy: logits {tuple(logits.shape)} against targets "
                         f"{tuple(targets.shape)}, chunk of {chunk_elements} elements")
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    rows = max(1, chunk_elements // logits.shape[-1])
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for chunk, chunk_targets in zip(flat.split(rows), flat_targets.split(rows), strict=True):
        total = total + torch.utils.checkpoint.checkpoint(_cross_entropy_sum, chunk, chunk_targets,
                                                          use_reentrant=False)
    return total / flat_targets.numel()


def next_token_loss(model: Callable[..., Any], batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``batch``, a LongTensor (batch, seq_len + 1); a 0-d float32.

    Float32 logits (``--precision fp32``) take PyTorch's cross-entropy as they are; lower-precision logits
    (bf16 autocast) go through :func:`chunked_cross_entropy`, so no float32 copy of the whole logits (and
    their gradient) is made: the loss itself is still computed and returned in float32.
    """
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    if logits.dtype == torch.float32:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return chunked_cross_entropy(logits, batch[:, 1:])
