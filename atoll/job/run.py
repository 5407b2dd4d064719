"""One training job's bookkeeping, written once for every driver.

A driver (the lockstep loop of :mod:`atoll.training`, the decoupled event simulation of
:mod:`atoll.runtime.events`, the Ray driver of :mod:`atoll.runtime.ray`, every rank of the collective runtime)
owns only its loop; a :class:`Run` owns the rest::

    run = Run(config, resume)                     # run folder (new, or the one resumed and its checkpoint),
                                                  # data, tokenizer, global model (or --init-from's weights)
    run.begin(restore=load_my_state)              # metrics log; the checkpoint's state, or the initial eval
    ... the driver's loop: run.log_train(...), run.log_eval(...), run.save_checkpoint(...)
    summary = run.finish(tokens=..., bytes_sent_per_island=..., bytes_received_per_island=..., compute_s=...,
                         sim_wall_s=..., **own)

Units: tokens, bytes, seconds; losses in nats per token. Only the main process (``is_main``) writes the
run folder; the others keep the same numbers and write nothing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from atoll.config import TrainConfig
from atoll.config.runtimes import CollectiveConfig
from atoll.errors import CheckpointError, ConfigError, DataError
from atoll.job.checkpoint import (
    commit_checkpoint,
    load_latest_state,
    new_run_dir,
    save_checkpoint,
    write_checkpoint_files,
    write_text_atomic,
)
from atoll.job.data import PreparedData, default_cache_dir, eval_batches, prepare_data
from atoll.job.data.pretrained import load_pretrained_tokenizer, tokenizer_source
from atoll.job.device import peak_accelerator_bytes, resolve_device
from atoll.job.evaluation import evaluate
from atoll.job.island import copy_flat_into
from atoll.job.lock import RunLock, claim_run_folder
from atoll.job.metrics import (
    LINK_SETTINGS,
    MetricsLog,
    NullLog,
    owned_settings,
    perplexity,
    read_metrics,
    write_summary,
)
from atoll.job.model import (
    PRESETS,
    build_model,
    check_model_config,
    check_vocab,
    count_parameters,
    param_bytes,
)
from atoll.job.report import plot_runs
from atoll.job.timeline import RunEvents, plot_timeline
from atoll.job.trackers import Tracker, open_trackers
from atoll.job.warm_start import load_init_weights
from atoll.runtime.network import ring_allreduce_bytes

#: held-out windows per evaluation batch, whatever the run's batch size (runs are compared on the same text)
EVAL_ROWS = 8


def is_meta(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are on the meta device (shapes without storage)."""
    return any(p.is_meta for p in model.parameters())


def prepare_inputs(config: TrainConfig, warm_start: bool = True, notes: bool = True,
                   meta: bool | None = None) -> tuple[PreparedData, PreTrainedModel]:
    """The corpus prepared for the run's islands (tokenizer, shards, validation tokens; cached) and the
    initial global model: a preset seeded by ``seed`` (on the meta device for sharded islands of the collective
    runtime, or where ``meta`` says so: shapes only), or a pretrained model (loaded first, so that a tokenizer
    it cannot embed fails before the corpus is tokenized), with ``init_from``'s weights when ``warm_start``
    (not on a resume: the checkpoint's weights follow).

    The tokenizer is ``--tokenizer``'s, else the model folder's own, else atoll's BPE trained on the corpus
    (:func:`atoll.job.data.pretrained.tokenizer_source`). With ``notes``, a tokenizer that differs from the
    model (a BPE for a pretrained model, fewer tokens than its embeddings) is said in one line on stderr.

    Raises:
        ConfigError, DataError: bad input (one line naming the field and the fix).
    """
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    source = tokenizer_source(config.model, config.tokenizer)
    pretrained = load_pretrained_tokenizer(source) if source else None
    model = None
    if config.model not in PRESETS:
        model = build_model(config.model, 0, config.seq_len, config.seed)  # the vocabulary is checked below
        note = check_vocab(model, len(pretrained), config.model, source) if pretrained is not None else (
            f"'{config.model}' brings no tokenizer (or --tokenizer bpe): training a {config.vocab_size}-token BPE on "
            "--data, whose ids mean nothing to the loaded embeddings; pass --tokenizer FOLDER for the model's own")
        if note and notes:
            print(f"atoll: note: {note}", file=sys.stderr)
    data = prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache_dir,
                        partition=config.partition, text_field=config.text_field, tokenizer=pretrained,
                        max_documents=config.max_documents)
    if pretrained is None and data.vocab_size < config.vocab_size and notes:  # the corpus ran out of merges
        print(f"atoll: note: vocab_size: the corpus yields a {data.vocab_size:,}-token BPE, not the "
              f"{config.vocab_size:,} asked for; the model embeds {data.vocab_size:,} tokens (summary.json "
              "vocab_size); pass a larger corpus for more", file=sys.stderr)
    # sharded islands of a preset: no whole model in any process (each rank materialises its pieces)
    if meta is None:
        meta = isinstance(config.runtime_config, CollectiveConfig) and config.runtime_config.shard_island
    if model is None:
        model = build_model(config.model, data.vocab_size, config.seq_len, config.seed, meta=meta)
    elif pretrained is None:
        check_vocab(model, data.vocab_size, config.model)
    if config.init_from is not None and warm_start and not is_meta(model):  # (else: per rank, its pieces)
        load_init_weights(model, Path(config.init_from))
    return data, model


class Run:
    """A run's folder, data, global model, metrics, evaluation, checkpoints and summary.

    Args:
        config: the run's settings.
        resume: continue the run in ``config.out`` from its newest readable checkpoint.
        is_main: this process writes the run folder (the others of a multi-process run do not).

    Attributes:
        out: the run folder.
        start_step: inner steps done at the checkpoint resumed (0 for a new run).
        state: the checkpoint's state when resuming (None for a new run); the driver restores its part.
        data: the prepared corpus (tokenizer, island shards, validation tokens).
        val: held-out batches, int64 tensors (batch_size, seq_len + 1).
        model: the global model (float32, CPU); :meth:`evaluate` copies the global parameters into it.
        tokenizer: the run's tokenizer, saved beside every checkpoint's model.
        n_params: parameters of the model.
        initial_eval_loss, eval_loss: held-out loss before training and at the last evaluation.
        trackers: the experiment trackers of ``config.tracker`` (main process, from :meth:`begin`), which
            receive every event :meth:`emit` writes.
        events: the run events (:class:`atoll.job.timeline.RunEvents`: failures, rejoins, resets, refusals,
            pushes, merges), counted across a resume.

    Raises:
        ConfigError, DataError, CheckpointError: bad input (one line naming the field and the fix).
    """

    def __init__(self, config: TrainConfig, resume: bool = False, is_main: bool = True) -> None:
        self.t0 = time.perf_counter()
        self.config, self.is_main = config, is_main
        transformers.utils.logging.disable_progress_bar()  # our own progress display is the one that counts
        if config.threads:
            torch.set_num_threads(config.threads)
        self.state: dict[str, Any] | None = None
        self.start_step = 0
        self.lock: RunLock | None = None  # the collective runtime's launcher holds its ranks' folder
        check_model_config(config.model, config.seq_len)  # a model folder that cannot fit: before any folder
        if is_main and config.runtime != "collective":
            self.out, self.lock = claim_run_folder(config.out, config.strategy, resume)
        elif resume or not is_main:
            self.out = Path(str(config.out))
        else:
            self.out = new_run_dir(config.out, config.strategy)
        try:
            self._load_inputs(resume)
        except BaseException:
            if self.lock is not None:  # bad input: a folder made for this run is removed again
                self.lock.abandon()
            raise
        self.val = eval_batches(self.data.val_tokens, EVAL_ROWS, config.seq_len, config.eval_batches)
        self.tokenizer = self.data.pretrained or PreTrainedTokenizerFast(  # saved with every checkpoint
            tokenizer_object=self.data.tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
            pad_token="<|endoftext|>")
        self.n_params = count_parameters(self.model)
        self.initial_eval_loss = self.eval_loss = math.nan
        self.prior_wall_s = 0.0
        self.log: MetricsLog | NullLog = NullLog()
        self.trackers: list[Tracker] = []  # TensorBoard, W&B (config.tracker), main process only
        self.events = RunEvents(self.emit, config.islands)  # failures, rejoins, resets, pushes, ...
        self.rate_mark = (time.perf_counter(), 0)  # (time, tokens) of the last ``train`` event: its interval's rate
        # how the global model is evaluated: params (the strategy's global_params(); None: the initial model)
        # -> held-out loss; None: float32 on the CPU with :attr:`model` (the syncer service's: it is CPU-only by
        # design, as the paper's syncer; every other driver evaluates where its islands compute)
        self.evaluator: Callable[[torch.Tensor | None], float] | None = None

    def _load_inputs(self, resume: bool) -> None:
        """The checkpoint's state (resume), then the data and the model (a fresh one, or ``init_from``'s)."""
        config = self.config
        if resume:
            # the collective runtime's ranks each read their own part of a per-rank checkpoint
            self.start_step, self.state = load_latest_state(self.out, consolidate=config.runtime != "collective")
            if self.start_step > config.steps:
                raise ConfigError(f"steps: {config.steps} is below the checkpoint's step {self.start_step}; "
                                  f"pass --steps {self.start_step} or more")
            if self.is_main:  # (a run killed after its last checkpoint redoes the steps since)
                print(f"atoll: resuming {self.out} from its checkpoint at step {self.start_step} of {config.steps}",
                      file=sys.stderr, flush=True)
        self.data, self.model = prepare_inputs(config, warm_start=not resume, notes=self.is_main)
        if (self.state is not None
                and self.state.get("data_fingerprint", self.data.fingerprint) != self.data.fingerprint):
            raise DataError(f"data: the corpus '{config.data}' or its tokenizer changed since this run started, so the "
                            "shards would differ; restore the data, or start a new run with --init-from")

    @property
    def init_params(self) -> torch.Tensor:
        """The global model's parameters before training, flat float32 (numel,) in ``parameters()`` order."""
        return torch.nn.utils.parameters_to_vector([p.detach() for p in self.model.parameters()]).float().clone()

    def wall_s(self) -> float:
        """Real seconds of this run so far, those before a resume included."""
        return self.prior_wall_s + time.perf_counter() - self.t0

    def begin(self, restore: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Open the metrics log and the trackers; then the checkpoint's state (``restore`` takes the driver's part
        of it) or, for a new run, the initial evaluation with its ``start`` and ``eval`` events; then ``config.json``.

        Raises:
            CheckpointError: the checkpoint does not fit this run (the folder is left as it was).
        """
        config = self.config
        if self.is_main:
            self.log = MetricsLog(self.out / "metrics.jsonl",
                                  truncate_after_step=self.start_step if self.state is not None else None)
            resuming = self.state is not None
            history = read_metrics(self.out / "metrics.jsonl") if resuming else None
            self.events.restore(history or [])  # the run events kept up to the checkpoint: their counts go on
            self.trackers = open_trackers(config.tracker, self.out, config.model_dump(mode="json"),
                                          self.start_step if resuming else None, history if config.tracker else None)
        if self.state is not None:
            try:
                if restore is not None:
                    restore(self.state)
                self.initial_eval_loss = float(self.state["initial_eval_loss"])
                self.eval_loss = float(self.state["eval_loss"])
                self.prior_wall_s = float(self.state.get("wall_s", 0.0))
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                raise CheckpointError(f"resume: the checkpoint of '{self.out}' does not fit this run "
                                      f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                                      "start a new run") from None
        else:
            self.initial_eval_loss = self.eval_loss = (self.evaluator(None) if self.evaluator is not None
                                                       else evaluate(self.model, self.val))
            self.log.log("start", step=0, params=self.n_params, config=config.model_dump(mode="json"),
                         train_tokens=self.data.num_train_tokens, val_tokens=self.data.num_val_tokens,
                         tokenizer_from_cache=self.data.tokenizer_from_cache)
            self.emit("eval", step=0, tokens=0, eval_loss=self.initial_eval_loss,
                      perplexity=perplexity(self.initial_eval_loss), sim_wall_s=0.0, bytes_sent_per_island=0.0,
                      bytes_received_per_island=0.0)
        if self.is_main:  # only now: a resume that failed above has left the run folder untouched
            write_text_atomic(self.out / "config.json", config.model_dump_json(indent=2))
        self.rate_mark = (time.perf_counter(), self.start_step * config.islands * config.tokens_per_step)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Log one event to ``metrics.jsonl`` and to every tracker; return it."""
        record = self.log.log(event, **fields)
        for tracker in self.trackers:
            tracker.log(record)
        return record

    # --- during the loop ------------------------------------------------------------------------------
    def set_global(self, params: torch.Tensor) -> PreTrainedModel:
        """Copy the global parameters (flat float32, (numel,)) into :attr:`model`; return it."""
        copy_flat_into(list(self.model.parameters()), params)
        return self.model

    def log_train(self, step: int, tokens: int, loss: float, bytes_sent_per_island: float, sim_wall_s: float,
                  lr: float, island_loss: list[float] | None = None,
                  island_bytes_sent: list[float] | None = None, island_steps: list[int] | None = None,
                  bytes_received_per_island: float | None = None,
                  island_bytes_received: list[float] | None = None) -> None:
        """A ``train`` event: the islands' mean training loss at inner step ``step`` (1-based count); with
        each island's own loss (nats per token), bytes sent and received and inner steps where the driver has
        them (``bytes_received_per_island`` None: not known live, left out of the event).

        Every ``train`` event also carries the interval's pace and memory since the previous one (or since
        :meth:`begin`): ``tokens_per_s``, training tokens of every island per real second, and
        ``peak_accelerator_bytes``, the most accelerator memory this process held (None on the CPU,
        :func:`~atoll.job.device.peak_accelerator_bytes`)."""
        extra: dict[str, Any] = {}
        if island_loss is not None:
            extra["island_loss"] = [float(x) for x in island_loss]
        if island_bytes_sent is not None:
            extra["island_bytes_sent"] = [float(x) for x in island_bytes_sent]
        if island_bytes_received is not None:
            extra["island_bytes_received"] = [float(x) for x in island_bytes_received]
        if island_steps is not None:
            extra["island_steps"] = [int(x) for x in island_steps]
        now, (then, tokens_then) = time.perf_counter(), self.rate_mark
        self.rate_mark = (now, tokens)
        if bytes_received_per_island is not None:
            extra["bytes_received_per_island"] = float(bytes_received_per_island)
        self.emit("train", step=step, tokens=tokens, loss=loss, bytes_sent_per_island=bytes_sent_per_island,
                  sim_wall_s=sim_wall_s, lr=lr, tokens_per_s=(tokens - tokens_then) / max(now - then, 1e-9),
                  peak_accelerator_bytes=peak_accelerator_bytes(), **extra)

    def log_eval(self, step: int, tokens: int, params: torch.Tensor, bytes_sent_per_island: float,
                 sim_wall_s: float, bytes_received_per_island: float | None = None) -> float:
        """Evaluate the global parameters ``params`` on the held-out batches (with :attr:`evaluator` where the
        driver set one); log an ``eval`` event; return it. ``bytes_received_per_island`` None: not known, left
        out of the event."""
        self.eval_loss = (self.evaluator(params) if self.evaluator is not None
                          else evaluate(self.set_global(params), self.val))
        self.emit("eval", step=step, tokens=tokens, eval_loss=self.eval_loss, perplexity=perplexity(self.eval_loss),
                  sim_wall_s=sim_wall_s, bytes_sent_per_island=bytes_sent_per_island,
                  **({} if bytes_received_per_island is None
                     else {"bytes_received_per_island": float(bytes_received_per_island)}))
        return self.eval_loss

    def save_checkpoint(self, step: int, state: dict[str, Any], params: torch.Tensor, tmp: Path | None = None,
                        meta: dict[str, Any] | None = None, **fields: Any) -> Path:
        """Write a checkpoint atomically: the global parameters as a Hugging Face model with the tokenizer, and
        the driver's ``state`` with what a resume of this run needs (losses, wall time, data fingerprint).
        ``tmp`` and ``meta``: the folder other processes wrote their parts into, and its description
        (:func:`atoll.job.checkpoint.save_checkpoint`); ``fields``: more of the ``checkpoint`` event's."""
        state = self.checkpoint_state(state)
        if is_meta(self.model):  # sharded islands: the export's tensors are views of params, no second copy
            path = save_checkpoint(self.out, step, state, model=self.model, tokenizer=self.tokenizer, tmp=tmp,
                                   meta=meta, model_state=self.export_state(params))
        else:
            path = save_checkpoint(self.out, step, state, model=self.set_global(params), tokenizer=self.tokenizer,
                                   tmp=tmp, meta=meta)
        self.log.log("checkpoint", step=step, path=str(path), **fields)
        return path

    def checkpoint_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The driver's ``state`` with what a resume of this run needs from the run itself (the losses, the wall
        time so far, the data's fingerprint), as of now."""
        return {**state, "initial_eval_loss": self.initial_eval_loss, "eval_loss": self.eval_loss,
                "wall_s": self.wall_s(), "data_fingerprint": self.data.fingerprint}

    def export_state(self, params: torch.Tensor) -> dict[str, torch.Tensor]:
        """The global model's weights by name as views of ``params`` (flat float32, (numel,), in ``parameters()``
        order), for :meth:`PreTrainedModel.save_pretrained`: no copy, and :attr:`model` is left as it is (so
        another thread may write them while this one trains). Tied names (a head sharing the embedding) view the
        same elements; the model's buffers, if it has persistent ones, are its own."""
        offsets: dict[int, tuple[int, torch.Size]] = {}
        offset = 0
        for p in self.model.parameters():
            offsets[id(p)] = (offset, p.shape)
            offset += p.numel()
        views: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            at, shape = offsets[id(p)]
            views[name] = params[at:at + shape.numel()].view(shape)
        if not is_meta(self.model):
            views.update({name: b for name, b in self.model.named_buffers()
                          if name in self.model.state_dict() and name not in views})
        return views

    def write_checkpoint(self, step: int, state: dict[str, Any], params: torch.Tensor, tmp: Path,
                         meta: dict[str, Any] | None = None) -> None:
        """Write the shared part of a checkpoint into ``tmp`` (:func:`~atoll.job.checkpoint.write_checkpoint_files`)
        from ``state`` (already :meth:`checkpoint_state`) and the global parameters ``params`` (flat float32),
        without touching :attr:`model`: safe on a background thread while the job trains. Renamed into place by
        :meth:`commit_checkpoint`.

        Raises:
            OSError: the disk is full or the folder not writable; ``tmp`` is removed.
        """
        write_checkpoint_files(tmp, step, state, model=self.model, tokenizer=self.tokenizer, meta=meta,
                               model_state=self.export_state(params))

    def commit_checkpoint(self, step: int, tmp: Path) -> Path:
        """Rename the written folder ``tmp`` into place as the checkpoint of ``step`` and point ``latest`` at it
        (:func:`~atoll.job.checkpoint.commit_checkpoint`); return its folder. Logs nothing (the caller does,
        on the thread that owns the log)."""
        return commit_checkpoint(self.out, tmp, step)

    # --- the end --------------------------------------------------------------------------------------
    def interrupt(self, step: int | None, advice: str | None = None) -> BaseException:
        """Close the metrics log, the trackers and the folder's lock of a run stopped by a signal after its
        checkpoint of inner step ``step`` (None: none was written); return the
        :class:`~atoll.errors.Interrupted` for the driver to raise (:mod:`atoll.job.stop`)."""
        from atoll.job import stop

        self.log.close()
        for tracker in self.trackers:
            tracker.close()
        if self.lock is not None:
            self.lock.release()
        return stop.interrupted(step, self.out, advice)

    def finish(self, *, tokens: int, bytes_sent_per_island: float, bytes_received_per_island: float,
               compute_s: float, sim_wall_s: float | None, timeline: bool = False, **own: Any) -> dict[str, Any]:
        """The summary: what every run reports, then the driver's ``own`` entries; the ``end`` event,
        ``summary.json`` and ``report.png`` (main process), and with ``timeline`` (an asynchronous run's
        drivers) ``timeline.png`` (:func:`atoll.job.timeline.plot_timeline`). Returns the summary.

        Args:
            tokens: training tokens of every island.
            bytes_sent_per_island: bytes one island sent (the mean over islands where they differ).
            bytes_received_per_island: bytes one island received, counted the same way (a ring collective's
                receive half; a decoupled island's pulls). ddp's ring all-reduce moves as many bytes each way, so
                the summary's ``ddp_bytes_per_island`` is both directions' baseline, and ``reduction_vs_ddp``
                (sent), ``reduction_vs_ddp_received`` and ``reduction_vs_ddp_total`` (both directions over
                twice ddp's) divide it by each.
            compute_s: compute seconds of the slowest island.
            sim_wall_s: the run's wall time on its clock (simulated, or real); None: the run has no clock but the
                real one (the service's): no ``sim_wall_s`` in the summary, its utilization over ``wall_s``.
            own: the driver's own entries (codec, fragments, exchanges, goodput, ...), in order; a run that
                diverged passes ``diverged`` (:func:`atoll.job.divergence.record`): its ``end`` event is at
                that step.
        """
        config = self.config
        ddp_bytes = config.steps * ring_allreduce_bytes(param_bytes(self.model), config.islands)
        summary: dict[str, Any] = {
            "strategy": config.strategy, "runtime": config.runtime, "islands": config.islands,
            **owned_settings(config.strategy_config, config.runtime_config, ("sync_every",)),
            "steps": config.steps, "model": config.model, "params": self.n_params, "vocab_size": self.data.vocab_size,
            "data": config.data, "partition": config.partition, "seed": config.seed, "tokens": tokens,
            "initial_eval_loss": self.initial_eval_loss, "final_eval_loss": self.eval_loss,
            "final_perplexity": perplexity(self.eval_loss),
            "bytes_sent_per_island": bytes_sent_per_island, "bytes_received_per_island": bytes_received_per_island,
            "ddp_bytes_per_island": ddp_bytes,
            "reduction_vs_ddp": (ddp_bytes / bytes_sent_per_island) if bytes_sent_per_island else None,
            "reduction_vs_ddp_received": (ddp_bytes / bytes_received_per_island) if bytes_received_per_island else None,
            "reduction_vs_ddp_total": (2 * ddp_bytes / (bytes_sent_per_island + bytes_received_per_island)
                                       if bytes_sent_per_island + bytes_received_per_island else None),
            # demo and sparseloco encode in their own way (their sections), not with the run's codec
            "codec": owned_settings(config.strategy_config, config.runtime_config, ("codec",)).get("codec"),
            # what the pulls travel as (decoupled's pull_codec), where the strategy has one
            **owned_settings(config.strategy_config, config.runtime_config, ("pull_codec",)),
            "device": config.device if config.runtime == "ray" else resolve_device(config.device),
            "precision": config.precision, "compile": config.compile, **own,
            **owned_settings(config.strategy_config, config.runtime_config, LINK_SETTINGS),
            "compute_s": compute_s, **({"sim_wall_s": sim_wall_s} if sim_wall_s is not None else {}),
            "compute_utilization": _utilization(compute_s, sim_wall_s if sim_wall_s is not None else self.wall_s()),
            "wall_s": self.wall_s(),
            "init_from": str(config.init_from) if config.init_from else None, "out": str(self.out),
        }
        end = own["diverged"]["step"] if own.get("diverged") else config.steps
        self.emit("end", step=end, **summary)
        self.log.close()
        for tracker in self.trackers:
            tracker.close()
        if self.is_main:
            write_summary(self.out, summary)
            plot_runs([self.out], self.out / "report.png")
            if timeline:
                plot_timeline(self.out / "metrics.jsonl", self.out / "timeline.png")
        if self.lock is not None:
            self.lock.release()
        return summary


def _utilization(compute_s: float, wall_s: float) -> float:
    """Compute seconds over wall seconds (1 without wall time)."""
    return compute_s / wall_s if wall_s > 0 else 1.0
