"""What the training loop asks of a runtime: which islands this process runs, and how the job adds up.

A :class:`Runtime` is set up before the loop so the loop never branches on it. It says which islands this
process runs (all of them in ``local``, one in ``collective``), gives their :class:`~atoll.runtime.comm.Comm`,
computes an island's gradient for its batch (data parallel over the island's ranks where it has several),
sums what the loop reports over every island of the job, assembles a checkpoint's state in one format
whatever the runtime, and says which process writes the run's outputs.

The loop (:func:`atoll.training.train_lockstep`) meets it at a few named points per inner step:
:meth:`Runtime.inner_steps` (the islands' passes, a test's faults around them), :meth:`Runtime.log_membership`
(islands lost and rejoined) and :meth:`Runtime.end_step` (checkpoint, a signal's stop, restarted islands
admitted), and at its end for the job's totals (:meth:`Runtime.job_totals`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from atoll.job.divergence import inject_fault
from atoll.runtime.comm import Comm
from atoll.runtime.network import SimClock

if TYPE_CHECKING:  # not at run time: the collective launcher imports this without transformers
    from atoll.config.facts import IslandSettings
    from atoll.job.island import InnerOptimizer, Island
    from atoll.job.run import Run
    from atoll.strategies.base import Strategy


class JobTotals(NamedTuple):
    """What a job adds up at its end, over every island (:meth:`Runtime.job_totals`).

    Attributes:
        tokens: training tokens of every island.
        compute_s: measured compute seconds of the slowest island.
        skipped_steps: inner steps skipped for a gradient that was not finite, over every island.
        island_resets: per island, in index order, how often it was reset.
        codec_s: the slowest island's codec seconds charged on the simulated clock; None where time is real.
        extra: the runtime's own entries of ``summary.json`` (:meth:`Runtime.summary`).
    """

    tokens: int
    compute_s: float
    skipped_steps: int
    island_resets: list[int]
    codec_s: float | None
    extra: dict[str, Any]


class Runtime(ABC):
    """How the islands of one job run and talk.

    Built by the entry point (:func:`atoll.training.make_runtime`, from its spec in :mod:`atoll.runtime.registry`) as
    ``cls(config, facts, strategy=...)``: its own config (a :class:`~atoll.config.section.RuntimeConfig`), the
    run's :class:`~atoll.config.facts.RunFacts` and the strategy's config; never the whole run's config.

    Attributes:
        comm: the collectives across every island (valid after :meth:`start`).
        clock: the simulated network clock charged by the islands, or None where time is real.
        local_islands: indices of the islands this process runs, ascending.
        device: where this process's island replicas live (CPU, or this rank's GPU).
        is_main: whether this process writes the run's outputs (metrics, checkpoints, summary, report) and
            shows progress.
        early_checkpoint: whether a new run also checkpoints right after its first exchange (a run whose
            processes can be lost then has something to resume from before ``checkpoint_every``).
    """

    comm: Comm
    clock: SimClock | None = None
    local_islands: list[int]
    device: torch.device = torch.device("cpu")
    is_main: bool = True
    early_checkpoint: bool = False

    def device_of(self, island: int) -> torch.device:
        """Where island ``island`` of this process computes (default: :attr:`device`)."""
        return self.device

    def make_island(self, index: int, model: torch.nn.Module, settings: IslandSettings,
                    optimizer: InnerOptimizer) -> Island:
        """Island ``index`` of this process around ``model`` (a CPU copy of the global model it may keep):
        moved to :meth:`device_of`, built from the island ``settings`` with its inner optimizer
        (``optimizer(model)``: :func:`atoll.job.island.build_island`). Called after :meth:`start`."""
        from atoll.job.island import build_island

        return build_island(index, model.to(self.device_of(index)), settings, optimizer, self.clock)

    def make_strategy(self, build: Callable[..., Strategy], config: Any, islands: list[Island], seed: int) -> Strategy:
        """The lockstep strategy over this process's islands: ``build(config, islands, comm, seed)`` (a spec's
        ``lockstep``, with the strategy's config). Called after :meth:`make_island`."""
        return build(config, islands, self.comm, seed)

    def evaluate(self, islands: list[Island], params: torch.Tensor | None, batches: list[torch.Tensor]) -> float:
        """Mean held-out loss (nats per token) of the global model ``params`` (the strategy's
        ``global_params()``; None: the initial model) over ``batches``, on the first island's device
        (:func:`atoll.job.evaluation.evaluate_island`); collective call."""
        from atoll.job.evaluation import evaluate_island

        losses = evaluate_island(islands[0], params, batches)
        return sum(losses[j] for j in range(len(batches))) / len(batches)

    def full_params(self, params: torch.Tensor) -> torch.Tensor:
        """The whole flat parameter vector from what the strategy holds (``global_params()``); the same
        vector unless islands are sharded; collective call."""
        return params

    def membership_changes(self) -> list[tuple[str, int, dict[str, Any]]]:
        """Islands lost and rejoined since the last call, as run events (kind, inner step, fields; the
        ``collective`` runtime's): none where islands are not processes of their own."""
        return []

    # --- the loop's entry points (atoll.training.train_lockstep) ---------------------------------------------
    def inner_steps(self, islands: list[Island], batches: list[torch.Tensor], step: int) -> None:
        """Inner step ``step`` (0-based) of this process's islands: each one's forward and backward pass on its
        batch (:meth:`forward_backward`; ``batches[k]`` is ``islands[k]``'s), with a test's faults injected
        before and after it (:func:`atoll.job.divergence.inject_fault`)."""
        for island, batch in zip(islands, batches, strict=True):
            inject_fault(island, step, "weights")  # test hook (atoll.job.divergence)
            self.forward_backward(island, batch, step)
            inject_fault(island, step, "grad")

    def log_membership(self, run: Run) -> None:
        """Log the islands lost and rejoined since the last call (:meth:`membership_changes`) as run events."""
        for kind, at, fields in self.membership_changes():
            run.events.log(kind, at, sim_wall_s=self.run_wall_s(run.wall_s()), **fields)

    def end_step(self, run: Run, done: int, islands: list[Island], strategy: Strategy, checkpoint: bool) -> None:
        """The end of inner step ``done`` (1-based count; collective call): the checkpoint when ``checkpoint``
        (the job's schedule) or when the job stops here on a signal (:meth:`stop_after`; then
        :class:`~atoll.errors.Interrupted` is raised), then the islands restarted since are admitted
        (:meth:`admit`)."""
        stopping = done < run.config.steps and self.stop_after(done)
        if checkpoint or stopping:  # collective: each rank writes its part; the last and a signal's in the foreground
            self.save_checkpoint(run, done, islands, strategy, background=not stopping and done < run.config.steps)
        if stopping:
            raise run.interrupt(done)
        self.admit(done, islands, strategy, initial_eval_loss=run.initial_eval_loss, eval_loss=run.eval_loss,
                   wall_s=run.wall_s())

    def settle_checkpoints(self, run: Run) -> None:  # noqa: B027 - optional hook
        """Wait for the checkpoint still written in the background, if any, when the loop ends without a last
        checkpoint of its own (a job that diverged): the collective runtime's ``--async-checkpoint``."""

    def job_totals(self, islands: list[Island]) -> JobTotals:
        """The job's totals at its end, for the summary (collective call: :meth:`totals`, :meth:`island_counts`,
        :meth:`compute_s`, in that order on every process)."""
        _, tokens = self.totals(islands)
        skipped, resets = self.island_counts(islands)
        return JobTotals(tokens, self.compute_s(islands), sum(skipped), resets, self.codec_s(), self.summary())

    def mark_eval(self, done: int) -> None:
        """An evaluation after ``done`` inner steps starts: marked on the simulated clock, where there is one
        (its time is then re-timed with the run at other links, :func:`atoll.runtime.network.replay`)."""
        if self.clock is not None:
            self.clock.mark(done)

    def codec_s(self) -> float | None:
        """The slowest island's codec seconds charged on the simulated clock (in ``sim_wall_s``, not in
        ``compute_s``); None where time is real (the codec's time is in the wall time itself)."""
        return max(self.clock.codec_s) if self.clock is not None else None

    def save_trace(self, path: Path, sim_wall_s: float) -> None:  # noqa: B027 - optional hook
        """Write the simulated clock's trace to ``path`` (JSON), so the run can be re-timed at other links
        (:func:`atoll.runtime.network.replay`): the local runtime's; nothing where time is real."""

    def summary(self) -> dict[str, Any]:
        """What the runtime adds to ``summary.json`` (the collective runtime: sharded islands, the islands it
        lost); collective call."""
        return {}

    def joined_state(self) -> dict[str, Any] | None:
        """``{"step": inner steps done, "job": state in :meth:`job_state`'s format}`` when this process joined a
        running job (a restarted island of the collective runtime); None otherwise."""
        return None

    def admit(self, done: int, islands: list[Island], strategy: Strategy, **extra: Any) -> None:  # noqa: B027
        """Let restarted islands join at the end of inner step ``done`` (collective runtime); collective call."""

    def stop_after(self, done: int) -> bool:
        """Whether the job stops at the end of inner step ``done`` on a signal (:mod:`atoll.job.stop`), with a
        checkpoint of it: here, as soon as this process was asked; the collective runtime's processes agree
        on one step first. Called by every process at the end of every inner step."""
        from atoll.job import stop

        return stop.requested() is not None

    def start(self) -> None:  # noqa: B027 - optional hook
        """Join the job (process groups, heartbeats); called once, after the data is ready."""

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Context of the whole job: where a runtime turns a lost peer into a clean stop, and cleans up."""
        yield

    @abstractmethod
    def forward_backward(self, island: Island, batch: torch.Tensor, step: int) -> None:
        """Leave in ``island`` the gradient of its mean loss on ``batch`` (int64, (batch_size, seq_len + 1)).

        Also sets ``island.last_loss`` and adds the batch's tokens to ``island.tokens``, as
        :meth:`Island.forward_backward` does; ``step`` is the 0-based inner step.
        """

    @abstractmethod
    def totals(self, islands: list[Island]) -> tuple[float, int]:
        """(mean last training loss, tokens processed) over every island of the job; collective call."""

    @abstractmethod
    def island_counts(self, islands: list[Island]) -> tuple[list[int], list[int]]:
        """Per island of the job, in index order: (``skipped_steps``, ``reset_count``); collective call."""

    @abstractmethod
    def compute_s(self, islands: list[Island]) -> float:
        """Measured compute seconds of the slowest island of the job; collective call."""

    @abstractmethod
    def run_wall_s(self, real_s: float) -> float:
        """The wall time reported as ``sim_wall_s``: the simulated clock, or ``real_s`` where time is real."""

    @abstractmethod
    def job_state(self, islands: list[Island], strategy: Strategy, **extra: Any) -> dict[str, Any] | None:
        """The job's resumable state in the ``local`` runtime's format; collective call.

        Returns:
            ``{"islands": [state of island 0, 1, ...], "strategy": ..., "comm": ..., "clock": ..., **extra}``
            on the main process; None on the others.
        """

    def save_checkpoint(self, run: Run, step: int, islands: list[Island], strategy: Strategy,
                        background: bool = False) -> None:
        """Write the job's checkpoint at inner step ``step`` (collective call): by default the main process
        writes :meth:`job_state` and the global model (:meth:`atoll.job.run.Run.save_checkpoint`).
        ``background``: the job may train on while it is written (a periodic checkpoint, not the last one nor a
        signal's), where the runtime can (the collective runtime's ``--async-checkpoint``); here it is ignored."""
        job = self.job_state(islands, strategy, wall_s=run.wall_s())  # None but on the main process
        params = self.full_params(strategy.global_params())
        if job is not None:
            run.save_checkpoint(step, job, params)

    @abstractmethod
    def load_job_state(self, state: dict[str, Any], islands: list[Island], strategy: Strategy) -> None:
        """Restore this process's islands, strategy, counters (and clock) from :meth:`job_state`'s format.

        Raises:
            CheckpointError: the checkpoint holds another number of islands.
        """
