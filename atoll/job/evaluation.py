"""Evaluation: the held-out next-token loss of the global model, on the CPU or on an island's own device.

Every driver evaluates where its islands compute: the lockstep runtimes and the decoupled event simulation on
island 0's device (:func:`evaluate_island`: the island's own model, its parameters swapped for the global ones
and put back), the Ray driver on the device the run names when its node has it (:func:`evaluate_global`: the
global model moved there for the evaluation). On a CPU both give the float32 numbers of :func:`evaluate`, bit
for bit. The syncer service (``atoll syncer``) keeps the CPU evaluation: the paper's syncer is CPU-only.
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from atoll.job.device import autocast
from atoll.job.island import Island, copy_flat_into, next_token_loss


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


class IslandEvaluator:
    """A run's evaluator (:attr:`atoll.job.run.Run.evaluator`) on an island's device: ``evaluator(params)`` is the
    mean of :func:`evaluate_island` over ``batches`` for the global parameters ``params`` (flat float32; None:
    ``initial``, else the island's model as it is).

    It holds the island and the batches, never the run: a reference cycle through the run would keep the run,
    and the lock on its folder, alive past an error until the garbage collector ran.

    Attributes:
        seconds: real seconds spent evaluating (``eval_s`` of the summary).
    """

    def __init__(self, island: Island, batches: list[torch.Tensor], initial: torch.Tensor | None = None) -> None:
        self.island, self.batches, self.initial = island, batches, initial
        self.seconds = 0.0

    def __call__(self, params: torch.Tensor | None) -> float:
        t0 = time.perf_counter()
        losses = evaluate_island(self.island, self.initial if params is None else params, self.batches)
        self.seconds += time.perf_counter() - t0
        return sum(losses[j] for j in range(len(self.batches))) / len(self.batches)


class GlobalEvaluator:
    """A run's evaluator that moves the global model to ``device`` for each evaluation (:func:`evaluate_global`):
    ``evaluator(params)`` -> the mean held-out loss. Holds the model and the batches, never the run (see
    :class:`IslandEvaluator`).

    Attributes:
        seconds: real seconds spent evaluating (``eval_s`` of the summary).
    """

    def __init__(self, model: PreTrainedModel, batches: list[torch.Tensor], device: torch.device,
                 precision: str = "fp32") -> None:
        self.model, self.batches, self.device, self.precision = model, batches, device, precision
        self.seconds = 0.0

    def __call__(self, params: torch.Tensor | None) -> float:
        t0 = time.perf_counter()
        loss = evaluate_global(self.model, params, self.batches, self.device, self.precision)
        self.seconds += time.perf_counter() - t0
        return loss


@torch.no_grad()
def evaluate_global(model: PreTrainedModel, params: torch.Tensor | None, batches: list[torch.Tensor],
                    device: torch.device, precision: str = "fp32") -> float:
    """Mean held-out next-token loss (nats per token) of the global model on ``device``.

    Args:
        model: the run's global model, float32 on the CPU; its parameters are set to ``params`` first.
        params: the global parameters, flat float32 (numel,) (None: the model as it is).
        batches: held-out windows, int64 (b, seq_len + 1).
        device: where to evaluate. Off the CPU the model is moved there for the evaluation and back to the
            CPU afterwards (no second copy of the model on either side; two host-device copies of it), and the
            forward pass runs under ``precision``'s autocast, as the islands' training forward; the losses are
            summed there and read once.
        precision: ``fp32`` or ``bf16`` (:func:`atoll.job.device.autocast`; float32 on the CPU).

    Returns:
        The mean loss over ``batches``; on the CPU, :func:`evaluate`'s number.
    """
    if params is not None:
        copy_flat_into(list(model.parameters()), params)
    if device.type == "cpu":
        return evaluate(model, batches)
    model.to(device)
    try:
        model.eval()
        with autocast(device, precision):
            total = sum(next_token_loss(model, b.to(device, non_blocking=True)).float() for b in batches)
        return float(total) / len(batches)
    finally:
        model.train()
        model.to("cpu")
