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
(:mod:`atoll.runtime.ray`). The runtime is set up before the loop, so the loop never sees it; the run's
bookkeeping (folder, data, model, events, evaluation, checkpoints, summary) is :class:`atoll.job.run.Run`.
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack
from typing import Any

from atoll.config import TrainConfig
from atoll.job import stop
from atoll.job.data import sample_batch
from atoll.job.device import host_memory_bytes, resolve_device
from atoll.job.divergence import Diverged, check_eval, check_resets, inject_fault, record
from atoll.job.island import compile_skipped
from atoll.job.metrics import ProgressDisplay
from atoll.job.run import Run
from atoll.runtime.base import Runtime
from atoll.strategies.registry import spec

LOG_EVERY = 10  # inner steps between two ``train`` events in metrics.jsonl


def make_runtime(config: TrainConfig) -> Runtime:
    """The runtime named by ``config.runtime`` for a lockstep strategy: which islands this process runs,
    their Comm, who writes.

    Raises:
        ConfigError: ``collective`` outside a launched process group of the right size.
    """
    if config.runtime == "collective":
        from atoll.runtime.collective import CollectiveRuntime

        return CollectiveRuntime(config)
    from atoll.runtime.local import LocalRuntime

    return LocalRuntime(config)


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
    if config.runtime != "ray":  # a device that is not here is bad input before anything is written (Ray:
        resolve_device(config.device)  # the islands' nodes decide)
    if spec(config.strategy).lockstep is None:  # asynchronous: islands on their own clocks, a syncer
        if config.runtime == "ray":
            from atoll.runtime.ray import train_ray  # Ray is imported only here

            return train_ray(config, resume)
        from atoll.runtime.events import train_simulated

        return train_simulated(config, resume)
    if config.runtime == "collective":
        from atoll.runtime import collective

        if not collective.in_worker():
            return collective.launch(config, "atoll.train:train", resume)
    runtime = make_runtime(config)
    with runtime.guard():
        return train_lockstep(config, resume, runtime)


def train_lockstep(config: TrainConfig, resume: bool, runtime: Runtime) -> dict[str, Any]:
    """The loop of a lockstep strategy: every island's forward and backward pass, then the strategy's step."""
    host_before = host_memory_bytes()
    run = Run(config, resume, is_main=runtime.is_main)
    runtime.start()
    own = spec(config.strategy)
    islands = [runtime.make_island(i, copy.deepcopy(run.model), config, optimizer=own.inner_optimizer)
               for i in runtime.local_islands]
    startup_host_bytes = host_memory_bytes() - host_before  # the data, the global model, the islands
    assert own.lockstep is not None  # train() sends an asynchronous strategy to its own driver
    strategy = own.lockstep(config.strategy_config, islands, runtime.comm, config.seed)
    comm = runtime.comm
    joined = runtime.joined_state()  # a restarted island: the state of a live one, at its step
    if joined is not None:
        run.start_step, run.state = joined["step"], joined["job"]
    eval_s, held_out = 0.0, run.val  # real seconds evaluating (bench/gpu.py reads it); not run: no cycle

    def evaluate(params: Any) -> float:  # on the islands' devices (the runtime splits the windows)
        nonlocal eval_s
        t_eval = time.perf_counter()
        loss = runtime.evaluate(islands, params, held_out)
        eval_s += time.perf_counter() - t_eval
        return loss

    run.evaluator = evaluate
    run.begin(restore=lambda state: runtime.load_job_state(state, islands, strategy))

    early = runtime.early_checkpoint and run.state is None  # a checkpoint after the first exchange, once
    strategy_s = 0.0  # real seconds in the strategy's steps: exchanges, outer updates (bench/gpu.py reads it)

    def sim_wall_s() -> float:
        return runtime.run_wall_s(run.wall_s())

    diverged: Diverged | None = None
    with ProgressDisplay(config.steps, run.start_step, config.progress and runtime.is_main,
                         every=config.progress_every) as bar:
        try:
            for step in range(run.start_step, config.steps):
                for island in islands:
                    batch = sample_batch(run.data.island_tokens[island.index], config.step_batch_size, config.seq_len,
                                         config.seed, island.index, step)
                    inject_fault(island, step, "weights")  # test hook (atoll.job.divergence)
                    runtime.forward_backward(island, batch, step)  # collective: its rows, the island's mean grad
                    inject_fault(island, step, "grad")
                t_strategy = time.perf_counter()
                with ExitStack() as charging:  # the islands' inner steps in it, told apart without a device read
                    for island in islands:
                        charging.enter_context(island.charging("strategy"))
                    strategy.step(step)  # exchanges; resets a diverged island; raises Diverged when none is left
                strategy_s += time.perf_counter() - t_strategy
                done = step + 1
                if done == config.steps:
                    strategy.finish(done)
                for kind, at, fields in runtime.membership_changes():  # collective: islands lost and rejoined
                    run.events.log(kind, at, sim_wall_s=sim_wall_s(), **fields)
                log_now = done % LOG_EVERY == 0 or done == config.steps
                eval_now = done % config.evaluate_every == 0 or done == config.steps
                if log_now or eval_now:
                    train_loss, tokens = runtime.totals(islands)  # over every island of the job
                if log_now:  # each island's own loss where this process runs every island (not collective)
                    strategy.reset_diverged(done)  # the losses are read now: a diverged island is reset at the latest
                    own_losses = [i.last_loss for i in islands] if len(islands) == config.islands else None
                    run.log_train(done, tokens, train_loss, comm.bytes_sent_per_island, sim_wall_s(),
                                  islands[0].scheduler.get_last_lr()[0], island_loss=own_losses)
                    resets = runtime.island_counts(islands)[1]  # a reset event per island reset since
                    run.events.note_resets(done, resets, sim_wall_s())
                    check_resets(done, sum(resets), config.islands)
                eval_loss = None
                if eval_now:
                    if runtime.clock is not None:  # the evaluation's time, re-timed with the run at other links
                        runtime.clock.mark(done)
                    eval_loss = run.log_eval(done, tokens, strategy.global_params(),
                                             comm.bytes_sent_per_island, sim_wall_s())
                    check_eval(done, eval_loss, run.data.vocab_size)  # every process evaluates the same model
                first_sync = early and comm.exchanges > 0
                stopping = done < config.steps and runtime.stop_after(done)  # a signal: checkpoint, then stop
                if first_sync or (config.checkpoint_every and done % config.checkpoint_every == 0) \
                        or done == config.steps or stopping:
                    early = False
                    runtime.save_checkpoint(run, done, islands, strategy)  # collective: each rank writes its part
                if stopping:
                    raise run.interrupt(done)
                runtime.admit(done, islands, strategy, initial_eval_loss=run.initial_eval_loss,
                              eval_loss=run.eval_loss, wall_s=run.wall_s())
                session_tokens = (done - run.start_step) * config.islands * config.tokens_per_step
                # the loss is read from the device only where it is logged or shown (no sync per inner step)
                shown = None if not (bar.prints(done) or eval_loss is not None) else (
                    train_loss if log_now else sum(i.last_loss for i in islands) / len(islands))
                bar.update(done, train_loss if log_now else shown,
                           session_tokens / max(1e-9, time.perf_counter() - bar.t0), comm.bytes_sent_per_island,
                           eval_loss=eval_loss)
        except Diverged as e:  # every process of the job stops at the same step (the checks are the job's)
            diverged = e

    _, tokens = runtime.totals(islands)
    skipped, resets = runtime.island_counts(islands)
    # the strategy's time outside the islands' timed inner steps: the outer rounds (bench/gpu.py reads it)
    outer_s = strategy_s - sum(i.compute_s_of("strategy") for i in islands)
    summary = run.finish(
        tokens=tokens, bytes_sent_per_island=comm.bytes_sent_per_island, compute_s=runtime.compute_s(islands),
        sim_wall_s=sim_wall_s(), strategy_s=strategy_s, outer_s=outer_s, eval_s=eval_s,
        startup_host_bytes=startup_host_bytes,
        **strategy.summary(), exchanges=comm.exchanges, peak_bytes_per_exchange=comm.peak_bytes_per_exchange,
        rejected_updates=strategy.dropped_updates, skipped_steps=sum(skipped),
        # the slowest island's codec seconds charged on the simulated clock (in sim_wall_s, not in compute_s);
        # None where time is real (the codec's time is in the wall time itself)
        codec_s=max(runtime.clock.codec_s) if runtime.clock is not None else None,
        **({"compile_skipped": compile_skipped(islands), "compile_s": max(i.compile_s for i in islands)}
           if config.compile else {}),
        **({"island_resets": resets} if any(resets) else {}),
        **({"diverged": record(config, diverged)} if diverged is not None else {}),
        **runtime.summary())
    if runtime.is_main:
        trace = getattr(runtime.clock, "trace", None) if runtime.clock is not None else None
        if trace is not None:  # local runtime: lets the run be re-timed at other links (network.replay)
            trace.save(run.out / "clock_trace.json", link_bandwidth_mbps=config.link_bandwidth_mbps,
                       link_latency_ms=config.link_latency_ms, sim_wall_s=summary["sim_wall_s"])
    return summary
