"""Evaluation: the held-out next-token loss of the global model, on the CPU or on an island's own device."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from atoll.job.device import autocast
from atoll.job.island import Island, next_token_loss


@torch.no_grad()
def evaluate(model: PreTrainedModel, batches: list[torch.Tensor]) -> float:
    """Mean held-out next-token loss (nats per token) of ``model`` over ``batches`` (int64, (b, seq_len + 1))."""
    model.eval()
    losses = [float(next_token_loss(model, b)) for b in batches]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def evaluate_island(island: Island, params: torch.Tensor | None, batches: list[torch.Tensor],
                    which: list[int] | range | None = None) -> dict[int, float]:
    """Held-out next-token loss (nats per token) of the global model on ``island``'s device: batch index ->
    its mean loss, for the batches ``which`` (default all) of ``batches`` (int64, (b, seq_len + 1)).

    The island's own model runs it: its parameters (this rank's pieces for a sharded island, whose FSDP2
    units gather each block as in training) are set to ``params`` (the strategy's ``global_params()``, flat
    float32; None: the model as it is) and put back afterwards, so no second copy of the model is built.
    On a CPU the forward pass is float32, the same numbers as :func:`evaluate` on the global model; on an
    accelerator, under the island's ``--precision`` autocast (as its training forward).
    """
    pieces = island.local_params() if hasattr(island, "local_params") else island.params
    backup = [p.detach().clone() for p in pieces] if params is not None else []
    model = island.model
    try:
        if params is not None:
            island.set_flat_params(params)
        model.eval()
        precision = "fp32" if island.device.type == "cpu" else island.precision
        out = {}
        with autocast(island.device, precision):
            for j in (range(len(batches)) if which is None else which):
                out[j] = float(next_token_loss(model, batches[j].to(island.device, non_blocking=True)))
        return out
    finally:
        model.train()
        for m in model.modules():  # FSDP2 keeps the root's gathered weights after a forward without backward:
            if callable(getattr(m, "reshard", None)):  # free them, or training would reuse the global ones
                m.reshard()
        for p, b in zip(pieces if backup else [], backup, strict=True):
            p.copy_(b)
