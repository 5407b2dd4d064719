"""The training job: data -> islands -> inner steps and exchanges -> evaluation -> checkpoint and report.

Launch::

    atoll train                                   # diloco, 4 islands, tiny model, stdlib corpus
    atoll train --strategy ddp --islands 4 --steps 600 --out runs/ddp
    atoll train --resume runs/ddp                 # continue from its latest checkpoint

or from Python::

    from atoll import TrainConfig, train
    summary = train(TrainConfig(strategy="diloco", islands=4, sync_every=50))

The loop below reads top to bottom: every island runs a forward and backward pass on its own batch, then
the strategy takes the inner optimizer steps and issues whatever collective it needs. The runtime is set up
before the loop (:func:`make_runtime`), so the loop never sees it: ``local`` runs every island in this
process on a simulated network clock; ``collective`` (``--runtime collective``, see
:mod:`atoll.runtime.collective`) runs one island per process over ``torch.distributed``, and only rank 0
writes the run's outputs.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from atoll.checkpoint import latest_checkpoint, load_checkpoint, new_run_dir, save_checkpoint
from atoll.config import TrainConfig
from atoll.data import default_cache_dir, eval_batches, prepare_data, sample_batch
from atoll.errors import CheckpointError, ConfigError, DataError
from atoll.island import Island, copy_flat_into, cosine_with_warmup, next_token_loss
from atoll.metrics import MetricsLog, NullLog, ProgressDisplay, write_summary
from atoll.model import build_model, count_parameters, param_bytes
from atoll.report import plot_runs
from atoll.runtime.base import Runtime
from atoll.runtime.comm import Comm
from atoll.runtime.local import LocalRuntime
from atoll.runtime.network import SimClock, ring_allreduce_bytes
from atoll.strategies.base import Strategy

LOG_EVERY = 10  # inner steps between two ``train`` events in metrics.jsonl


def make_runtime(config: TrainConfig) -> Runtime:
    """The runtime named by ``config.runtime``: which islands this process runs, their Comm, who writes.

    Raises:
        ConfigError: ``collective`` outside a launched process group of the right size.
    """
    if config.runtime == "collective":
        from atoll.runtime.collective import CollectiveRuntime

        return CollectiveRuntime(config)
    return LocalRuntime(config)


def make_strategy(config: TrainConfig, islands: list[Island], comm: Comm) -> Strategy:
    """The strategy object named by ``config.strategy``."""
    if config.strategy == "ddp":
        from atoll.strategies.ddp import DDP

        return DDP(config, islands, comm)
    if config.strategy == "diloco":
        from atoll.strategies.diloco import DiLoCo

        return DiLoCo(config, islands, comm)
    if config.strategy == "streaming":
        from atoll.strategies.streaming import StreamingDiLoCo

        return StreamingDiLoCo(config, islands, comm)
    if config.strategy == "demo":
        from atoll.strategies.demo import DeMoStrategy

        return DeMoStrategy(config, islands, comm)
    raise ConfigError(f"strategy: '{config.strategy}' has no lockstep strategy object; use ddp, diloco, streaming "
                      "or demo (decoupled runs through atoll.strategies.decoupled.train_decoupled)")


def make_island(index: int, model: PreTrainedModel, config: TrainConfig, clock: SimClock | None) -> Island:
    """An island with its own replica, inner optimizer and warmup-cosine schedule.

    The inner optimizer is AdamW (betas 0.9, 0.95; no weight decay on norms), or DeMo for ``demo``.
    """
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer: torch.optim.Optimizer
    if config.strategy == "demo":
        from atoll.algorithms.demo import DeMo

        optimizer = DeMo(groups, lr=config.demo_lr, beta=config.demo_beta, chunk=config.demo_chunk,
                         topk=config.demo_topk, sign_values=config.demo_sign_values)
    else:
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(config.effective_warmup_steps, config.steps, config.min_lr_ratio)
    )
    return Island(index, model, optimizer, scheduler, grad_clip=config.grad_clip, clock=clock)


@torch.no_grad()
def evaluate(model: PreTrainedModel, batches: list[torch.Tensor]) -> float:
    """Mean held-out next-token loss (nats per token) of ``model`` over ``batches``."""
    model.eval()
    losses = [float(next_token_loss(model, b)) for b in batches]
    model.train()
    return sum(losses) / len(losses)


def load_init_weights(model: PreTrainedModel, run_dir: Path) -> None:
    """Copy the global weights of another run's latest checkpoint into ``model`` (a warm start).

    Raises:
        ConfigError: ``init_from`` holds no checkpoint or a model of another shape.
    """
    from safetensors.torch import load_file

    try:
        ckpt = latest_checkpoint(run_dir)
    except Exception:
        raise ConfigError(f"init_from: '{run_dir}' holds no atoll checkpoint; pass the --out folder of a finished run") from None
    try:
        weights = load_file(str(ckpt / "model" / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error type for damaged files
        raise ConfigError(f"init_from: cannot read the weights of '{ckpt}' ({type(e).__name__}); "
                          "pass a run whose checkpoint is intact") from None
    own = model.state_dict()
    mismatched = [k for k, v in weights.items() if k not in own or own[k].shape != v.shape]
    missing = [k for k in own if k not in weights and not k.endswith("lm_head.weight")]
    if mismatched or missing:
        raise ConfigError(f"init_from: the model in '{ckpt}' does not match --model/--vocab-size of this run "
                          f"({(mismatched + missing)[0]}); use the same model and vocabulary as that run")
    model.load_state_dict(weights, strict=False)
    model.tie_weights()


def load_latest_state(out: Path) -> tuple[int, dict[str, Any]]:
    """The newest checkpoint of ``out`` that reads back whole, falling back to older ones.

    Raises:
        CheckpointError: no checkpoint of the run is readable (the message names the newest one's fault).
    """
    root = Path(out) / "checkpoints"
    first = latest_checkpoint(out)
    candidates = [first] + sorted((p for p in root.glob("step_*") if p != first and (p / "state.json").is_file()),
                                  key=lambda p: p.name, reverse=True)
    error: CheckpointError | None = None
    for path in candidates:
        try:
            step, state = load_checkpoint(path)
            if not isinstance(state, dict) or "islands" not in state:
                raise CheckpointError(f"resume: checkpoint '{path}' has no island state; start a new run")
            if error is not None:
                print(f"atoll: warning: {error}; resuming from {path.name} instead", file=sys.stderr)
            return step, state
        except CheckpointError as e:
            error = error or e
    raise error  # type: ignore[misc]


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
        The summary dict (see README, "Output"): strategy, islands, tokens, initial and final eval loss,
        bytes sent per island, what ddp would send, compute, simulated and real wall seconds.

    Raises:
        ConfigError, DataError, CheckpointError: bad input; the message names the field and the fix.
        RunFailed: (collective launcher) a rank failed; carries its exit status.
    """
    if config.strategy == "decoupled":  # its own event loop: islands on their own clocks, a syncer
        if config.runtime == "ray":
            if resume:
                raise ConfigError("resume: a decoupled run on Ray cannot be resumed (only its syncer state is "
                                  "saved, under <out>/syncer); start a new run from its final model with "
                                  "--init-from RUN_DIR")
            from atoll.runtime.ray import train_ray  # Ray is imported only here

            return train_ray(config)
        from atoll.strategies.decoupled import train_decoupled

        return train_decoupled(config, resume)
    if config.runtime == "collective":
        from atoll.runtime import collective

        if not collective.in_worker():
            return collective.launch(config, resume)
    runtime = make_runtime(config)
    with runtime.guard():
        return _train(config, resume, runtime)


def _train(config: TrainConfig, resume: bool, runtime: Runtime) -> dict[str, Any]:
    t0 = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()  # our own progress bar is the one that counts
    if config.threads:
        torch.set_num_threads(config.threads)
    if resume:
        out = Path(config.out)  # type: ignore[arg-type]
        start_step, state = load_latest_state(out)
        if start_step > config.steps:
            raise ConfigError(f"steps: {config.steps} is below the checkpoint's step {start_step}; "
                              f"pass --steps {start_step} or more")
    else:
        out = new_run_dir(config.out, config.strategy) if runtime.is_main else Path(str(config.out))
        start_step, state = 0, None

    # --- data and model ----------------------------------------------------------------------------
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    data = prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache_dir,
                        partition=config.partition, text_field=config.text_field)
    if state is not None and state.get("data_fingerprint", data.fingerprint) != data.fingerprint:
        raise DataError(f"data: the corpus '{config.data}' changed since this run started, so its tokenizer and "
                        "shards would differ; restore the data, or start a new run with --init-from")
    val = eval_batches(data.val_tokens, config.batch_size, config.seq_len, config.eval_batches)
    global_model = build_model(config.model, data.vocab_size, config.seq_len, config.seed)
    if config.init_from is not None and not resume:
        load_init_weights(global_model, Path(config.init_from))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=data.tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    n_params = count_parameters(global_model)

    # --- runtime: this process's islands, how they talk, strategy ---------------------------------
    runtime.start()
    comm = runtime.comm
    islands = [make_island(i, copy.deepcopy(global_model).to(runtime.device), config, runtime.clock)
               for i in runtime.local_islands]
    strategy = make_strategy(config, islands, comm)

    log = (MetricsLog(out / "metrics.jsonl", truncate_after_step=start_step if resume else None)
           if runtime.is_main else NullLog())
    prior_wall_s = 0.0
    if state is not None:
        try:
            runtime.load_job_state(state, islands, strategy)
            initial_eval_loss = float(state["initial_eval_loss"])
            eval_loss = float(state["eval_loss"])
            prior_wall_s = float(state["wall_s"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"resume: the checkpoint of '{out}' does not fit this run ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:160]}); start a new run") from None
    else:
        initial_eval_loss = eval_loss = evaluate(global_model, val)
        log.log("start", step=0, params=n_params, config=config.model_dump(mode="json"),
                train_tokens=data.num_train_tokens, val_tokens=data.num_val_tokens,
                tokenizer_from_cache=data.tokenizer_from_cache)
        log.log("eval", step=0, tokens=0, eval_loss=initial_eval_loss, perplexity=math.exp(initial_eval_loss),
                sim_wall_s=0.0, bytes_sent_per_island=0.0)

    if runtime.is_main:  # only now: a resume that failed above has left the run folder untouched
        (out / "config.json").write_text(config.model_dump_json(indent=2))

    def sync_global_model() -> None:
        copy_flat_into(list(global_model.parameters()), strategy.global_params())

    def wall_s() -> float:
        return prior_wall_s + time.perf_counter() - t0

    # --- the loop ----------------------------------------------------------------------------------
    session_tokens = 0
    with ProgressDisplay(config.steps, start_step, config.progress and runtime.is_main) as bar:
        for step in range(start_step, config.steps):
            for island in islands:
                batch = sample_batch(data.island_tokens[island.index], config.batch_size, config.seq_len,
                                     config.seed, island.index, step)
                runtime.forward_backward(island, batch, step)  # collective: its rows, the island's mean grad
            strategy.step(step)
            done = step + 1
            if done == config.steps:
                strategy.finish(done)
            session_tokens += config.islands * config.tokens_per_step
            log_now = done % LOG_EVERY == 0 or done == config.steps
            eval_now = done % config.eval_every == 0 or done == config.steps
            if log_now or eval_now:
                train_loss, tokens = runtime.totals(islands)  # over every island of the job
            if log_now:
                log.log("train", step=done, tokens=tokens, loss=train_loss,
                        bytes_sent_per_island=comm.bytes_sent_per_island,
                        sim_wall_s=runtime.run_wall_s(wall_s()), lr=islands[0].scheduler.get_last_lr()[0])
            if eval_now:
                sync_global_model()
                eval_loss = evaluate(global_model, val)
                log.log("eval", step=done, tokens=tokens, eval_loss=eval_loss, perplexity=math.exp(eval_loss),
                        sim_wall_s=runtime.run_wall_s(wall_s()),
                        bytes_sent_per_island=comm.bytes_sent_per_island)
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.steps:
                sync_global_model()
                job = runtime.job_state(islands, strategy, initial_eval_loss=initial_eval_loss,
                                        eval_loss=eval_loss, wall_s=wall_s(), data_fingerprint=data.fingerprint)  # None but on the main process
                if job is not None:
                    path = save_checkpoint(out, done, job, model=global_model, tokenizer=tokenizer)
                    log.log("checkpoint", step=done, path=str(path))
            bar.update(done, sum(i.last_loss for i in islands) / len(islands),
                       session_tokens / max(1e-9, time.perf_counter() - t0), comm.bytes_sent_per_island)

    # --- summary and report ------------------------------------------------------------------------
    _, tokens = runtime.totals(islands)
    ddp_bytes = config.steps * ring_allreduce_bytes(param_bytes(global_model), config.islands)
    compute_s = runtime.compute_s(islands)
    sim_wall_s = runtime.run_wall_s(wall_s())
    summary: dict[str, Any] = {
        "strategy": config.strategy, "runtime": config.runtime, "islands": config.islands,
        "sync_every": config.sync_every, "steps": config.steps, "model": config.model, "params": n_params,
        "data": config.data, "partition": config.partition, "seed": config.seed, "tokens": tokens,
        "initial_eval_loss": initial_eval_loss, "final_eval_loss": eval_loss,
        "final_perplexity": math.exp(eval_loss),
        "bytes_sent_per_island": comm.bytes_sent_per_island, "ddp_bytes_per_island": ddp_bytes,
        "reduction_vs_ddp": (ddp_bytes / comm.bytes_sent_per_island) if comm.bytes_sent_per_island else None,
        "codec": config.codec, "fragments": config.fragments if config.strategy == "streaming" else 1,
        "overlap_steps": config.overlap_steps if config.strategy == "streaming" else 0,
        "exchanges": comm.exchanges, "peak_bytes_per_exchange": comm.peak_bytes_per_exchange,
        "rejected_updates": strategy.dropped_updates,
        "skipped_steps": sum(i.skipped_steps for i in islands),
        "link_bandwidth_mbps": config.link_bandwidth_mbps, "link_latency_ms": config.link_latency_ms,
        "compute_s": compute_s, "sim_wall_s": sim_wall_s,
        "compute_utilization": compute_s / sim_wall_s if sim_wall_s > 0 else 1.0,
        "wall_s": wall_s(),
        "init_from": str(config.init_from) if config.init_from else None, "out": str(out),
    }
    log.log("end", step=config.steps, **summary)
    log.close()
    if runtime.is_main:
        write_summary(out, summary)
        trace = getattr(runtime.clock, "trace", None) if runtime.clock is not None else None
        if trace is not None:  # local runtime: lets the run be re-timed at other links (network.replay)
            trace.save(out / "clock_trace.json", link_bandwidth_mbps=config.link_bandwidth_mbps,
                       link_latency_ms=config.link_latency_ms, sim_wall_s=sim_wall_s)
        plot_runs([out], out / "report.png")
    return summary
