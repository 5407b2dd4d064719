"""Facts of one run that its components read besides their own config: a small frozen record, built once from
the whole config by the entry points (:func:`atoll.training.train` and the drivers), so that the runtimes and the
islands never take the whole :class:`~atoll.config.train.TrainConfig`. No torch here.

:class:`RunFacts` is what a runtime reads of the run (how many islands, how long, where, which strategy);
:class:`IslandSettings` is what an island is built from (precision, compile, activation checkpointing, gradient
accumulation, clipping and its learning-rate schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunFacts:
    """What the runtimes read of the run.

    Attributes:
        strategy: the ``--strategy`` name.
        islands: islands of the job.
        steps: inner steps per island.
        seed: the run's seed (a sharded island's model is initialised from it).
        out: the run folder (None: not chosen yet; a resume advice names it).
        device: ``auto``, ``cpu``, ``cuda`` or ``mps`` (:func:`atoll.job.device.resolve_device`).
        speeds: each island's relative speed (1.0: as measured).
        tokens_per_step: training tokens one island consumes per inner step.
        step_batch_size: sequences one island consumes per inner step (grad_accum x batch_size).
        seq_len: tokens per training sequence.
        init_from: the run folder whose weights the model starts from (a warm start), or None.
        evaluate_every: inner steps between two evaluations of the global model.
        checkpoint_every: inner steps between two checkpoints (0: only at the end).
    """

    strategy: str
    islands: int
    steps: int
    seed: int = 0
    out: Path | None = None
    device: str = "auto"
    speeds: tuple[float, ...] = ()
    tokens_per_step: int = 0
    init_from: Path | None = None
    step_batch_size: int = 0
    seq_len: int = 0
    evaluate_every: int = 1
    checkpoint_every: int = 0

    @classmethod
    def of(cls, config: Any) -> RunFacts:
        """The facts of a whole :class:`~atoll.config.train.TrainConfig` (an entry point's)."""
        return cls(strategy=config.strategy, islands=config.islands, steps=config.steps, seed=config.seed,
                   out=config.out, device=config.device, speeds=tuple(config.speeds),
                   tokens_per_step=config.tokens_per_step, init_from=config.init_from,
                   step_batch_size=config.step_batch_size, seq_len=config.seq_len,
                   evaluate_every=config.evaluate_every, checkpoint_every=config.checkpoint_every)


@dataclass(frozen=True)
class IslandSettings:
    """What one island is built from, beside its model and its inner optimizer
    (:func:`atoll.job.island.build_island`).

    Attributes:
        steps: the island's inner steps: its schedule decays to ``min_lr_ratio`` there.
        warmup_steps: linear warmup, in inner steps (capped at a tenth of ``steps``).
        min_lr_ratio: the cosine decay's floor, a fraction of the peak rate.
        grad_clip: clip the gradient norm to this (0: off).
        grad_accum: micro-batches per inner step.
        precision: ``fp32`` or ``bf16`` (autocast).
        compile: compile the forward pass (torch.compile).
        activation_checkpointing: recompute each block's activations in the backward pass.
    """

    steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    grad_accum: int = 1
    precision: str = "fp32"
    compile: bool = False
    activation_checkpointing: bool = False

    @classmethod
    def of(cls, config: Any, steps: int | None = None) -> IslandSettings:
        """The island settings of a whole :class:`~atoll.config.train.TrainConfig`; ``steps``: the island's own
        schedule length where it differs from the run's (a decoupled island's expected steps)."""
        return cls(steps=config.steps if steps is None else steps, warmup_steps=config.warmup_steps,
                   min_lr_ratio=config.min_lr_ratio, grad_clip=config.grad_clip, grad_accum=config.grad_accum,
                   precision=config.precision, compile=config.compile,
                   activation_checkpointing=config.activation_checkpointing)

    def lasting(self, steps: int) -> IslandSettings:
        """These settings with a schedule of ``steps`` inner steps."""
        return replace(self, steps=steps)
