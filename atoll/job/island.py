"""An island: one model replica with its own data shard, inner optimizer and learning-rate schedule."""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from transformers import PreTrainedModel

from atoll.algorithms.muon import MuonWithAdamW, muon_with_adamw
from atoll.config.facts import IslandSettings
from atoll.job.device import CompiledForward, autocast, synchronize
from atoll.job.flat_views import FlatViews
from atoll.job.loss import next_token_loss
from atoll.job.model import enable_activation_checkpointing
from atoll.runtime.network import SimClock


def cosine_with_warmup(warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier: linear warmup to 1 over ``warmup_steps``, then cosine decay to ``min_ratio``."""

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


@torch.no_grad()
def copy_flat_into(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector (numel,) into ``params`` in place, element for element.

    Unlike ``torch.nn.utils.vector_to_parameters``, which rebinds each ``param.data`` to a *view* of the
    vector (so replicas fed the same vector would share storage), this copies.

    Raises:
        ValueError: the vector's length differs from the parameters' total size.
    """
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat vector of {flat.numel()} elements for parameters of {total}")
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset:offset + n].view_as(p))
        offset += n


class Island(FlatViews):
    """One replica of the model, trained by its inner optimizer on its own shard.

    Args:
        index: the island's index in the job (0-based).
        model: its model replica (float32; on CPU or an accelerator).
        optimizer: the inner optimizer over ``model.parameters()`` (AdamW, or DeMo for ``demo``).
        scheduler: the learning-rate schedule stepped once per inner step.
        grad_clip: clip the gradient norm to this before each inner step (0: off).
        clock: simulated clock charged with this island's measured compute time (None: not simulated).
        speed: relative hardware speed (1.0 = as measured; 0.5 = charged twice the measured time).
        precision: ``fp32``, or ``bf16`` for a bfloat16-autocast forward and backward pass (float32 weights,
            gradients and optimizer state; :func:`atoll.job.device.autocast`).
        grad_accum: micro-batches per inner step (gradient accumulation; ``--grad-accum``).

    No host synchronization in the inner step: the loss, the finite checks and (on CUDA) the timing stay on
    the device and are read when asked for (``last_loss``, ``diverged``, ``skipped_steps``, ``compute_s``: at
    logging steps and exchanges). With a fused optimizer (AdamW on CUDA) a gradient that is not finite skips
    the step on the device (the optimizer's ``found_inf``, as ``torch.amp.GradScaler`` uses it); other
    optimizers (DeMo, Muon, AdamW on the CPU, where no device waits) read the flag on the host. A diverged
    island (its loss not finite: NaN weights) takes no step either (its gradient is not finite) until the
    strategy resets it at its next exchange or logging step (:mod:`atoll.job.divergence`).

    Attributes:
        compute_s: measured compute seconds (divided by ``speed``).
        compile_s: seconds of the first, compiling step with ``--compile`` (not in ``compute_s``).
        tokens: training tokens processed.
        last_loss: the training loss of the last inner step's forward passes (mean over its micro-batches).
        skipped_steps: inner steps skipped because the gradient was not finite while the loss was (the steps
            of a diverged island before its reset are not counted: it is counted in ``reset_count``).
        reset_count: times the island was reset because it diverged (:meth:`reset_to`).
    """

    def __init__(self, index: int, model: PreTrainedModel, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, grad_clip: float = 1.0,
                 clock: SimClock | None = None, speed: float = 1.0, precision: str = "fp32",
                 grad_accum: int = 1) -> None:
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        self.index = index
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.clock = clock
        self.speed = speed
        self.precision = precision
        self.grad_accum = grad_accum
        self.params = [p for p in model.parameters()]
        self.device = self.params[0].device
        self.named_params = dict(model.named_parameters())
        self.forward: Callable[..., Any] = model  # the training forward pass (CompiledForward with --compile)
        #: torch's DistributedDataParallel around the model where the runtime averages gradients with its
        #: backward hooks (:mod:`atoll.runtime.collective.torch_ddp`); None otherwise
        self.ddp: Any = None
        #: whether the loss of the step in progress is finite (a 0-d bool on the device), set before the last
        #: micro-batch's backward pass, when its gradient is all-reduced by ``ddp``'s hooks
        self.loss_finite: torch.Tensor | None = None
        #: under ``ddp``'s hooks: the islands whose gradient the mean holds (0-d float32 on the device)
        self.sync_islands: torch.Tensor | None = None
        self._compute_s = 0.0
        self.compile_s = 0.0
        self.tokens = 0
        self._skipped = 0  # skipped steps read on the host; those counted on the device are in _skipped_device
        self._skipped_device: torch.Tensor | None = None
        self.reset_count = 0
        self._loss: float | torch.Tensor = float("nan")  # a 0-d device tensor until read
        self._reset_since_loss = False  # reset_to() since the last forward pass: ``diverged`` is False
        self._timings: list[tuple[Any, Any, bool, str | None]] = []  # CUDA events of timed blocks not yet read
        self._label: str | None = None  # what timed blocks are counted under besides compute_s (charging())
        self._labelled_s: dict[str, float] = {}
        # every parameter group fused: the optimizer takes found_inf and skips a non-finite step on the device
        self.skips_on_device = bool(optimizer.param_groups) and all(
            g.get("fused") for g in optimizer.param_groups)

    # --- what is read at logging steps (one host synchronization each) ---------------------------
    @property
    def last_loss(self) -> float:
        """The training loss of the last inner step (nats; NaN before the first); reading it waits for it."""
        if isinstance(self._loss, torch.Tensor):
            self._loss = float(self._loss)
        return self._loss

    @last_loss.setter
    def last_loss(self, value: float | torch.Tensor) -> None:
        self._loss = value

    @property
    def loss_tensor(self) -> torch.Tensor:
        """The last inner step's loss as a 0-d float32 tensor on the island's device (no synchronization)."""
        if isinstance(self._loss, torch.Tensor):
            return self._loss
        return torch.tensor(self._loss, dtype=torch.float32, device=self.device)

    @property
    def skipped_steps(self) -> int:
        """Inner steps skipped because the gradient was not finite (reading it waits for the device's count)."""
        if self._skipped_device is not None:
            self._skipped += int(self._skipped_device)
            self._skipped_device = None
        return self._skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped, self._skipped_device = int(value), None

    @property
    def compute_s(self) -> float:
        """Measured compute seconds, divided by ``speed`` (reading it waits for the timed work on CUDA)."""
        self.settle_timing()
        return self._compute_s

    @property
    def settled_compute_s(self) -> float:
        """Compute seconds charged so far, without waiting for the device (CUDA timings not read yet are not in
        it): what another thread may read while this island trains (a progress report)."""
        return self._compute_s

    @compute_s.setter
    def compute_s(self, value: float) -> None:
        self.settle_timing()
        self._compute_s = float(value)

    def settle_timing(self, keep: int = 0) -> None:
        """Charge the CUDA-event timings not yet read but the last ``keep`` (waits for their work to end);
        a no-op elsewhere."""
        cut = max(0, len(self._timings) - keep)
        timings, self._timings = self._timings[:cut], self._timings[cut:]
        for start, end, compiling, label in timings:
            end.synchronize()
            self._charge(start.elapsed_time(end) / 1000.0, compiling, label)

    def charge(self, seconds: float) -> None:
        """Charge ``seconds`` of compute measured outside :meth:`timed` (divided by ``speed``, as the timed work):
        work a strategy did once on the CPU for several islands of this process, each of which would do it alone
        (DeMo's decode of the islands' mean, :mod:`atoll.strategies.demo`)."""
        self._charge(seconds, False, self._label)

    def _charge(self, seconds: float, compiling: bool, label: str | None = None) -> None:
        if compiling:
            self.compile_s += seconds
            return
        dt = seconds / self.speed
        self._compute_s += dt
        if label is not None:
            self._labelled_s[label] = self._labelled_s.get(label, 0.0) + dt
        if self.clock is not None:
            self.clock.compute(self.index, dt)

    @contextmanager
    def charging(self, label: str) -> Iterator[None]:
        """Count the compute timed inside the block under ``label`` too (:meth:`compute_s_of`), besides
        ``compute_s``: how the loop tells the inner steps a strategy takes apart from its own work, without
        reading a CUDA timing per step."""
        previous, self._label = self._label, label
        try:
            yield
        finally:
            self._label = previous

    def compute_s_of(self, label: str) -> float:
        """Measured compute seconds timed inside :meth:`charging` blocks of ``label`` (divided by ``speed``;
        reading it waits for the timed work on CUDA)."""
        self.settle_timing()
        return self._labelled_s.get(label, 0.0)

    @contextmanager
    def timed(self, compiling: bool = False) -> Iterator[None]:
        """Measure the enclosed compute and charge it to this island (and its simulated clock). On CUDA two
        events bracket the work in its stream, read later (:meth:`settle_timing`: when ``compute_s`` is read,
        or before the simulated clock prices a collective), so the host never waits for the device here; on
        the CPU (and MPS, synchronized) ``time.perf_counter``. With ``compiling`` (the first step of a
        ``--compile`` island) the seconds go to ``compile_s`` instead: a one-off start-up cost, not
        training compute."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)  # this island's GPU's, not the current device's
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._timings.append((start, end, compiling, self._label))
            if len(self._timings) > 64:  # the oldest are long done: reading them waits for nothing
                self.settle_timing(keep=16)
            if self.clock is not None:
                self.clock.defer(self.settle_timing)
            return
        synchronize(self.device)
        t0 = time.perf_counter()
        yield
        synchronize(self.device)
        self._charge(time.perf_counter() - t0, compiling, self._label)

    def micro_batches(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``batch`` (rows, seq_len + 1) cut into ``grad_accum`` micro-batches of equal rows.

        Raises:
            ValueError: the rows are not a multiple of ``grad_accum``.
        """
        if batch.shape[0] % self.grad_accum:
            raise ValueError(f"a batch of {batch.shape[0]} rows cannot be cut into {self.grad_accum} equal "
                             "micro-batches")
        return batch.split(batch.shape[0] // self.grad_accum)

    def gradient_sync(self, last: bool) -> AbstractContextManager[Any]:
        """The context of one micro-batch's backward pass: whether its gradients are synchronized across the
        island's ranks. Unsharded islands have nothing to synchronize in the backward pass (the runtime
        averages the accumulated gradient once); a sharded island turns FSDP2's reduce-scatter off but
        for the last micro-batch (:class:`~atoll.runtime.collective.sharding.ShardedIsland`); under torch's
        DDP the micro-batches but the last run in ``no_sync`` (their gradients accumulate locally)."""
        if self.ddp is not None and not last:
            return self.ddp.no_sync()
        return nullcontext()

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-token loss of ``batch`` (LongTensor, (rows, seq_len + 1)) and its gradient, accumulated over
        ``grad_accum`` micro-batches of equal rows (each micro-batch's mean loss scaled by 1 / grad_accum,
        so the gradient is that of the whole batch's mean loss); returns the mean loss, a 0-d float32 tensor
        on the device (not read: no synchronization)."""
        compiling = isinstance(self.forward, CompiledForward) and not self.forward.called
        with self.timed(compiling):
            batch = batch.to(self.device, non_blocking=True)
            micro = self.micro_batches(batch)
            total: torch.Tensor | None = None
            for k, part in enumerate(micro):
                with self.gradient_sync(k == len(micro) - 1):
                    with autocast(self.device, self.precision):
                        loss = next_token_loss(self.forward, part)
                    total = loss.detach() if total is None else total + loss.detach()
                    if k == len(micro) - 1:  # read (on the device) by DDP's hooks in this backward pass
                        self.loss_finite = torch.isfinite(total)
                    (loss if len(micro) == 1 else loss / len(micro)).backward()
            assert total is not None
            mean = total if len(micro) == 1 else total / len(micro)
        self.tokens += batch[:, 1:].numel()
        self._loss, self._reset_since_loss = mean, False
        return mean

    def inner_step(self) -> None:
        """Clip the gradient, take one inner optimizer step, advance the schedule, clear the gradient.

        With a fused optimizer the step is skipped on the device when the gradient is not finite (no host
        synchronization); otherwise :meth:`clip_gradients` decides on the host.
        """
        with self.timed():
            if self.skips_on_device:
                found_inf = (~torch.isfinite(self.clip_norm())).to(torch.float32)
                self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # read by fused AdamW's step
                self.optimizer.step()
                skipped = found_inf * torch.isfinite(self.loss_tensor)  # a diverged island's steps: not counted
                self._skipped_device = skipped if self._skipped_device is None else self._skipped_device + skipped
            elif self.clip_gradients():
                self.optimizer.step()
            else:  # skipped on the host: the schedule moves on all the same
                self.skip_step()
                return
            self.finish_step()

    def clip_norm(self) -> torch.Tensor:
        """Clip the gradient norm to ``grad_clip`` (0: no clipping); the total norm before clipping, a 0-d
        tensor on the device (not read). Not timed: call inside :meth:`timed`."""
        return torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip if self.grad_clip > 0 else float("inf"))

    def clip_gradients(self) -> bool:
        """Clip the gradient norm to ``grad_clip`` (0: no clipping); drop a gradient that is not finite.

        A NaN or infinite gradient (an overflow, a bad batch, a faulty device) never reaches the optimizer
        state or the weights: the gradients are cleared, ``skipped_steps`` counts it (where the loss was
        finite: a diverged island's steps are not counted), and False is returned so the caller skips the
        optimizer step. Reads the norm on the host (and the loss, when the norm is not finite). Not timed:
        call inside :meth:`timed`.
        """
        if torch.isfinite(self.clip_norm()):
            return True
        for p in self.params:
            p.grad = None
        self._skipped += math.isfinite(self.last_loss)
        return False

    def finish_step(self) -> None:
        """Advance the learning-rate schedule and clear the gradients, after an optimizer step."""
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """Advance the learning-rate schedule without an optimizer step (a step lost to a reset), so every
        island's schedule stays at its step count; clear the gradients."""
        self.schedule_to(self.scheduler.last_epoch + 1)
        self.optimizer.zero_grad(set_to_none=True)

    def schedule_to(self, step: int) -> None:
        """Move the learning-rate schedule forward to inner step ``step`` (its count of steps taken), without
        optimizer steps: an island job started again continues the schedule where its steps so far left it
        (the syncer's count at its join), not from the warmup's first step. A schedule at or past ``step``
        stays."""
        with warnings.catch_warnings():  # torch warns when the schedule moves before any optimizer step
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            while self.scheduler.last_epoch < step:
                self.scheduler.step()

    @property
    def diverged(self) -> bool:
        """Whether the last training loss was not finite, and the island was not reset since: its weights are
        lost (:mod:`atoll.job.divergence`). Reading it waits for the loss: the strategies read it at their
        exchanges and logging steps only."""
        return not self._reset_since_loss and not math.isfinite(self.last_loss)

    def reset_to(self, flat: torch.Tensor, keep_optimizer: bool = False) -> None:
        """Reset a diverged island: weights from ``flat`` (float32, (numel,)), gradients cleared, the inner
        optimizer's state cleared (``keep_optimizer``: kept, where it is every replica's alike, as in ddp);
        counted in ``reset_count``. The learning-rate schedule goes on."""
        self.set_flat_params(flat)
        if not keep_optimizer:  # Muon islands: both inner optimizers' state (the wrapper holds none itself)
            (self.optimizer.clear_state() if isinstance(self.optimizer, MuonWithAdamW)
             else self.optimizer.state.clear())
        self.optimizer.zero_grad(set_to_none=True)
        self.reset_count += 1
        self._reset_since_loss = True

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this island exactly: weights, optimizer, schedule, counters."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "compute_s": self.compute_s,
            "tokens": self.tokens,
            "skipped_steps": self.skipped_steps,
            "reset_count": self.reset_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.compute_s = float(state["compute_s"])
        self.tokens = int(state["tokens"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.reset_count = int(state.get("reset_count", 0))


#: an island's inner-optimizer factory: its model -> the optimizer over its parameters (:func:`inner_optimizer`)
InnerOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


def adamw(groups: list[dict[str, Any]], config: Any) -> torch.optim.Optimizer:
    """The inner optimizer of every strategy but those that bring their own: AdamW at ``config.lr`` (a
    strategy's config with the AdamW section), betas (0.9, 0.95); the fused CUDA kernel when the parameters are
    on a GPU (one launch for all of them), else PyTorch's default."""
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), **({"fused": True} if on_cuda else {}))


def inner_optimizer(strategy: Any, own: Callable[[list[dict[str, Any]], Any], torch.optim.Optimizer] | None = None
                    ) -> InnerOptimizer:
    """An island's inner-optimizer factory from the strategy's config ``strategy``: ``own(param_groups,
    strategy)`` (a strategy's own, e.g. DeMo; its spec's ``inner_optimizer``), else AdamW (:func:`adamw`) or,
    with ``inner_optimizer = "muon"``, Muon on the hidden matrices and AdamW on the rest
    (:func:`atoll.algorithms.muon.muon_with_adamw`). Weight decay only on matrices: the strategy's
    ``weight_decay``, or the AdamW section's default for a strategy without one (its groups carry it all the
    same: DeMo reads it)."""
    from atoll.config.sections import AdamWSection

    weight_decay = getattr(strategy, "weight_decay", AdamWSection.model_fields["weight_decay"].default)

    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if own is not None:
            return own(groups, strategy)
        if strategy.inner_optimizer == "muon":
            return muon_with_adamw(list(model.named_parameters()), strategy.lr, weight_decay)
        return adamw(groups, strategy)

    return build


def build_island(index: int, model: PreTrainedModel, settings: IslandSettings, optimizer: InnerOptimizer,
                 clock: SimClock | None = None, speed: float = 1.0, island_type: type[Island] = Island) -> Island:
    """An island with its own replica, inner optimizer (``optimizer(model)``: :func:`inner_optimizer`) and
    warmup-cosine schedule: warmup over ``settings.warmup_steps`` (at most a tenth of the island's steps),
    decay to ``min_lr_ratio`` at ``settings.steps``. ``island_type`` is the class built (a
    :class:`~atoll.runtime.collective.sharding.ShardedIsland` for a model sharded beforehand)."""
    inner = optimizer(model)
    total = settings.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        inner, cosine_with_warmup(min(settings.warmup_steps, total // 10), total, settings.min_lr_ratio))
    if settings.activation_checkpointing:
        enable_activation_checkpointing(model)
    island = island_type(index, model, inner, scheduler, grad_clip=settings.grad_clip, clock=clock, speed=speed,
                         precision=settings.precision, grad_accum=settings.grad_accum)
    if settings.compile:
        island.forward = CompiledForward(model)
    return island


def compile_skipped(islands: list[Island]) -> str | None:
    """Why ``--compile`` fell back to eager mode on any of ``islands`` (the first reason), or None."""
    return next((r for r in (getattr(i.forward, "skipped", None) for i in islands) if r), None)
