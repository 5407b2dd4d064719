"""The training job: data -> islands -> inner steps and exchanges -> evaluation -> checkpoint and report.

Launch::

    atoll train                                   # diloco, 4 islands, tiny model, stdlib corpus
    atoll train --strategy ddp --islands 4 --steps 600 --out runs/ddp
    atoll train --resume runs/ddp                 # continue from its latest checkpoint

or from Python::

    from atoll import TrainConfig, train
    summary = train(TrainConfig(strategy="diloco", islands=4, sync_every=50))

:func:`train` picks the driver: a lockstep strategy (ddp, diloco, streaming, demo) runs the loop below under
the ``local`` runtime (every island in this process, on a simulated network clock) or the ``collective``
one (one island per process over ``torch.distributed``; only rank 0 writes); an asynchronous strategy
(decoupled) runs under the ``local`` runtime's event simulation (:mod:`atoll.runtime.events`) or on Ray
(:mod:`atoll.runtime.ray`). The runtime is set up before the loop, which never branches on it and meets it at
named points only (:class:`atoll.runtime.base.Runtime`: the islands' inner step, membership events, the end of a
step, the job's totals); the run's bookkeeping (folder, data, model, events, evaluation, checkpoints, summary) is
:class:`atoll.job.run.Run`, and what the loop holds and measures is :class:`LockstepJob`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from atoll.config import TrainConfig
from atoll.config.facts import IslandSettings, RunFacts
from atoll.job import stop
from atoll.job.data import sample_batch
from atoll.job.device import host_memory_bytes, resolve_device
from atoll.job.divergence import Diverged, check_eval, check_resets, record
from atoll.job.island import Island, compile_skipped, inner_optimizer
from atoll.job.metrics import ProgressDisplay
from atoll.job.run import Run
from atoll.runtime.base import Runtime
from atoll.runtime.registry import spec as runtime_spec
from atoll.runtime.spec import load
from atoll.strategies.registry import spec

LOG_EVERY = 10  # inner steps between two ``train`` events in metrics.jsonl


def make_runtime(config: TrainConfig) -> Runtime:
    """The runtime named by ``config.runtime`` for a lockstep strategy (its spec in
    :mod:`atoll.runtime.registry`), built from its own config, the run's facts and the strategy's config:
    which islands this process runs, their Comm, who writes.

    Raises:
        ConfigError: ``collective`` outside a launched process group of the right size.
    """
    build = runtime_spec(config.runtime).runtime_class()
    return build(config.runtime_config, RunFacts.of(config), strategy=config.strategy_config)


def train(config: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Run one training job; return its summary (also written to ``<out>/summary.json``).

    With ``runtime="collective"`` outside torchrun, this starts ``islands x ranks_per_island`` processes on
    this machine, each running this function (:func:`atoll.runtime.collective.launch`), and returns rank 0's
    summary. Inside one of them (torchrun sets ``RANK``), it runs one island and returns the same summary on
    every rank; a lost peer ends the process with status 3 and one line on stderr.

    Args:
        config: the run's configuration.
        resume: continue the run in ``config.out`` from its latest checkpoint.

    Returns:
        The summary dict (see docs/usage.md, "The run folder"): strategy, islands, tokens, initial and final eval loss,
        bytes sent per island, what ddp would send, compute, simulated and real wall seconds; ``diverged``
        (step, reason, fix) when the job diverged and stopped early (:mod:`atoll.job.divergence`).

    Raises:
        ConfigError, DataError, CheckpointError: bad input; the message names the field and the fix.
        RunFailed: (collective launcher) a rank failed; carries its exit status.
        Interrupted: SIGINT or SIGTERM arrived (:mod:`atoll.job.stop`); the checkpoint of the inner step the
            run had reached is written (every runtime and strategy), and a resume continues exactly.
    """
    with stop.on_signals():  # SIGINT, SIGTERM: a checkpoint of the step reached, then Interrupted (exit 128 + N)
        return _train(config, resume)


def _train(config: TrainConfig, resume: bool) -> dict[str, Any]:
    """:func:`train` with the signals routed to :mod:`atoll.job.stop`."""
    where = runtime_spec(config.runtime)
    if where.refusal is not None:  # (the service runtime: atoll syncer and atoll island run it)
        from atoll.errors import ConfigError

        raise ConfigError(where.refusal)
    if config.runtime != "ray":  # a device that is not here is bad input before anything is written (Ray:
        resolve_device(config.device)  # the islands' nodes decide)
    if spec(config.strategy).lockstep is None:  # asynchronous: islands on their own clocks, a syncer
        return where.driver()(config, resume)  # (Ray is imported only there)
    if where.launcher is not None:  # the collective runtime outside torchrun: start its processes
        summary = load(where.launcher)(config, "atoll.training:train", resume)
        if summary is not None:
            return summary
    runtime = make_runtime(config)
    with runtime.guard():
        return train_lockstep(config, resume, runtime)


def train_lockstep(config: TrainConfig, resume: bool, runtime: Runtime) -> dict[str, Any]:
    """The loop of a lockstep strategy: every island's forward and backward pass, then the strategy's step.

    The runtime is met at four points: the islands' inner step, the membership events (the collective runtime's
    islands lost and rejoined), the end of the step (checkpoint, a signal's stop, restarted islands admitted)
    and, in :meth:`LockstepJob.finish`, the job's totals for the summary.
    """
    job = LockstepJob(config, resume, runtime)  # the run, this process's islands, the strategy; resumed or joined
    run, islands, strategy = job.run, job.islands, job.strategy
    with ProgressDisplay(config.steps, run.start_step, config.progress and runtime.is_main,
                         every=config.progress_every) as bar:
        try:
            for step in range(run.start_step, config.steps):
                runtime.inner_steps(islands, [job.batch(island, step) for island in islands], step)
                job.strategy_step(step)  # an exchange and an outer step when due; resets a diverged island
                done = step + 1
                if done == config.steps:
                    strategy.finish(done)
                runtime.log_membership(run)  # collective: the islands lost and rejoined, as run events
                loss, eval_loss = job.log(done, shown=bar.prints(done))  # train, eval events; divergence checks
                runtime.end_step(run, done, islands, strategy, checkpoint=job.checkpoint_due(done))
                bar.update(done, loss, job.tokens_per_s(done, bar.t0), job.comm.bytes_sent_per_island,
                           eval_loss=eval_loss, bytes_received=job.comm.bytes_received_per_island)
        except Diverged as e:  # every process of the job stops at the same step (the checks are the job's)
            job.diverged = e
    runtime.settle_checkpoints(run)  # one written in the background, where no last checkpoint settled it
    return job.finish()


class LockstepJob:
    """What the lockstep loop holds: the run, this process's islands and the strategy, and what it measures.

    Built before the loop: the runtime joins the job, makes this process's islands around copies of the global
    model, the strategy takes them with the runtime's comm, and the run begins (a new run evaluates the initial
    model; a resumed one, or an island restarted into a running job, takes its state).

    Attributes:
        run: the run's folder, data, events, evaluation, checkpoints and summary (:class:`~atoll.job.run.Run`).
        islands: this process's islands (every island in ``local``, one in ``collective``).
        strategy: the lockstep strategy over them.
        comm: the runtime's collectives across every island (bytes sent, exchanges).
        strategy_s: real seconds in the strategy's steps: exchanges, outer updates (bench/gpu.py reads it).
        startup_host_bytes: host memory taken by the data, the global model and the islands.
        diverged: what stopped a job that diverged (:mod:`atoll.job.divergence`), else None.
    """

    def __init__(self, config: TrainConfig, resume: bool, runtime: Runtime) -> None:
        host_before = host_memory_bytes()
        self.config, self.runtime = config, runtime
        self.run = run = Run(config, resume, is_main=runtime.is_main)
        runtime.start()
        own = spec(config.strategy)
        settings, inner = IslandSettings.of(config), inner_optimizer(config.strategy_config, own.inner_optimizer)
        self.islands = [runtime.make_island(i, copy.deepcopy(run.model), settings, inner)
                        for i in runtime.local_islands]
        self.startup_host_bytes = host_memory_bytes() - host_before
        assert own.lockstep is not None  # train() sends an asynchronous strategy to its own driver
        self.comm = runtime.comm
        self.strategy = runtime.make_strategy(own.lockstep, config.strategy_config, self.islands, config.seed)
        joined = runtime.joined_state()  # a restarted island: the state of a live one, at its step
        if joined is not None:
            run.start_step, run.state = joined["step"], joined["job"]
        self.strategy_s = 0.0
        self.diverged: Diverged | None = None
        self.train_loss = 0.0  # the job's mean training loss at the last logging step
        run.evaluator, self._eval_s = _timed_evaluation(runtime, self.islands, run.val)
        run.begin(restore=lambda state: runtime.load_job_state(state, self.islands, self.strategy))
        self.first_exchange_checkpoint = runtime.early_checkpoint and run.state is None  # once, a new run's

    @property
    def eval_s(self) -> float:
        """Real seconds evaluating so far (bench/gpu.py reads it)."""
        return self._eval_s[0]

    def batch(self, island: Island, step: int) -> torch.Tensor:
        """Island ``island``'s batch of inner step ``step`` (0-based), int64 (step_batch_size, seq_len + 1)."""
        config = self.config
        return sample_batch(self.run.data.island_tokens[island.index], config.step_batch_size, config.seq_len,
                            config.seed, island.index, step)

    def strategy_step(self, step: int) -> None:
        """The strategy's step after inner step ``step``'s passes, timed (its inner optimizer steps apart).

        Raises:
            Diverged: no island is left to reset a diverged one from.
        """
        t_strategy = time.perf_counter()
        with ExitStack() as charging:  # the islands' inner steps in it, told apart without a device read
            for island in self.islands:
                charging.enter_context(island.charging("strategy"))
            self.strategy.step(step)  # exchanges; resets a diverged island at an exchange
        self.strategy_s += time.perf_counter() - t_strategy

    @property
    def outer_s(self) -> float:
        """Of :attr:`strategy_s`, the seconds outside the islands' timed inner steps: the outer rounds
        (bench/gpu.py reads it)."""
        return self.strategy_s - sum(i.compute_s_of("strategy") for i in self.islands)

    def sim_wall_s(self) -> float:
        """The run's wall time on its clock: simulated (``local``), or real seconds."""
        return self.runtime.run_wall_s(self.run.wall_s())

    def log(self, done: int, shown: bool) -> tuple[float | None, float | None]:
        """The ``train`` event every :data:`LOG_EVERY` inner steps and the ``eval`` event every
        ``evaluate_every`` (both at the last), after ``done`` inner steps; the divergence checks on them.

        Returns:
            (the training loss to show, or None where none is read: the loss is read from the device only
            where it is logged, or ``shown`` by the progress display, or evaluated; the held-out loss, or None).

        Raises:
            Diverged: the held-out loss, or the islands' resets, say the job diverged.
        """
        config, run, islands, runtime = self.config, self.run, self.islands, self.runtime
        log_now = done % LOG_EVERY == 0 or done == config.steps
        eval_now = done % config.evaluate_every == 0 or done == config.steps
        if log_now or eval_now:
            self.train_loss, tokens = runtime.totals(islands)  # over every island of the job
        if log_now:  # each island's own loss where this process runs every island (not collective)
            self.strategy.reset_diverged(done)  # the losses are read now: a diverged island is reset at the latest
            own_losses = [i.last_loss for i in islands] if len(islands) == config.islands else None
            run.log_train(done, tokens, self.train_loss, self.comm.bytes_sent_per_island, self.sim_wall_s(),
                          islands[0].scheduler.get_last_lr()[0], island_loss=own_losses,
                          bytes_received_per_island=self.comm.bytes_received_per_island)
            resets = runtime.island_counts(islands)[1]  # a reset event per island reset since
            run.events.note_resets(done, resets, self.sim_wall_s())
            check_resets(done, sum(resets), config.islands)
        eval_loss = None
        if eval_now:
            runtime.mark_eval(done)  # the evaluation's time, re-timed with the run at other links
            eval_loss = run.log_eval(done, tokens, self.strategy.global_params(), self.comm.bytes_sent_per_island,
                                     self.sim_wall_s(), self.comm.bytes_received_per_island)
            check_eval(done, eval_loss, run.data.vocab_size)  # every process evaluates the same model
        if log_now:
            return self.train_loss, eval_loss
        local = sum(i.last_loss for i in islands) / len(islands) if shown or eval_loss is not None else None
        return local, eval_loss

    def checkpoint_due(self, done: int) -> bool:
        """Whether a checkpoint is due after ``done`` inner steps: every ``checkpoint_every``, at the last step,
        and where the runtime asks (:attr:`~atoll.runtime.base.Runtime.early_checkpoint`) after a new run's
        first exchange."""
        every = self.config.checkpoint_every
        due = ((self.first_exchange_checkpoint and self.comm.exchanges > 0) or (every and done % every == 0)
               or done == self.config.steps)
        self.first_exchange_checkpoint &= not due
        return bool(due)

    def tokens_per_s(self, done: int, since: float) -> float:
        """This session's training tokens (every island's) per real second since ``since`` (perf_counter)."""
        session_tokens = (done - self.run.start_step) * self.config.islands * self.config.tokens_per_step
        return session_tokens / max(1e-9, time.perf_counter() - since)

    def finish(self) -> dict[str, Any]:
        """The summary (:meth:`atoll.job.run.Run.finish`), with the runtime's totals over every island; the
        clock's trace beside it (local runtime). Collective call."""
        config, runtime, islands, strategy, comm = self.config, self.runtime, self.islands, self.strategy, self.comm
        end = runtime.job_totals(islands)
        summary = self.run.finish(
            tokens=end.tokens, bytes_sent_per_island=comm.bytes_sent_per_island,
            bytes_received_per_island=comm.bytes_received_per_island, compute_s=end.compute_s,
            sim_wall_s=self.sim_wall_s(), strategy_s=self.strategy_s, outer_s=self.outer_s, eval_s=self.eval_s,
            startup_host_bytes=self.startup_host_bytes,
            **strategy.summary(), exchanges=comm.exchanges, peak_bytes_per_exchange=comm.peak_bytes_per_exchange,
            rejected_updates=strategy.dropped_updates, skipped_steps=end.skipped_steps, codec_s=end.codec_s,
            **({"compile_skipped": compile_skipped(islands), "compile_s": max(i.compile_s for i in islands)}
               if config.compile else {}),
            **({"island_resets": end.island_resets} if any(end.island_resets) else {}),
            **({"diverged": record(config.strategy_config, config, self.diverged)}
               if self.diverged is not None else {}),
            **end.extra)
        if runtime.is_main:
            runtime.save_trace(self.run.out / "clock_trace.json", summary["sim_wall_s"])
        return summary


def _timed_evaluation(runtime: Runtime, islands: list[Island], held_out: list[torch.Tensor]
                      ) -> tuple[Callable[[torch.Tensor | None], float], list[float]]:
    """The run's evaluator (the global model's held-out loss on the islands' devices; the runtime splits the
    windows) and the cell its seconds add up in: a closure over neither the run nor the job, which the run
    holds it from (no reference cycle)."""
    spent = [0.0]

    def evaluate(params: torch.Tensor | None) -> float:
        t_eval = time.perf_counter()
        loss = runtime.evaluate(islands, params, held_out)
        spent[0] += time.perf_counter() - t_eval
        return loss

    return evaluate, spent
