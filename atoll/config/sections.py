"""The shared settings: the sections every run reads, and those some strategies read and share.

:class:`atoll.config.train.TrainConfig` holds the run's (run, model, device, data, schedule, output); a
strategy's config (:class:`~atoll.config.section.StrategyConfig`, in the strategy's module) inherits the
shared sections it reads (H, AdamW, the outer optimizer, the codec, fragments) beside its own settings; the
runtimes' configs are in :mod:`atoll.config.runtimes`. A field's description is its ``--help`` text. This
module imports neither torch nor any strategy.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from atoll.config.section import Section

#: the most inner steps a step count may name (``steps``, H, warmup, evaluation and checkpoint intervals): a
#: billion is years of training at any speed atoll reaches; a larger number is a typo
MAX_STEPS = 10**9


class RunSection(Section):
    """What runs: the strategy, the runtime, how many islands, how long, which seed."""

    strategy: str = Field(
        "diloco",
        description="What islands exchange: ddp (gradients every step), diloco (pseudo-gradients every H "
        "steps), streaming (fragments, overlapped, quantized), demo (top-k DCT of a decoupled momentum), "
        "sparseloco (top-k of error-feedback accumulators, 2-bit values, every H steps), decoupled (Decoupled "
        "DiLoCo: islands on their own clocks push fragments to a syncer that merges a "
        "quorum, token-weighted). The strategies are listed in atoll.strategies.registry.",
    )
    runtime: str = Field(
        "local",
        description="How islands run: local (one process, islands in turn, simulated network clock) or "
        "collective (real processes over torch.distributed: gloo on CPU, NCCL on GPUs; started by 'atoll "
        "train' on one machine, or by torchrun across machines) or ray (decoupled only: the syncer and "
        "every island as Ray actors on real clocks; see ray_address) or service (decoupled across sites: the "
        "runtime of 'atoll syncer' and 'atoll island', which set it; not 'atoll train'). The runtimes are "
        "listed in atoll.runtime.registry.",
    )
    islands: int = Field(4, ge=1, le=1024, description="Number of islands (model replicas, each its own shard).")
    steps: int = Field(800, ge=1, le=MAX_STEPS, description="Inner steps per island (each island sees steps x batch "
                       "tokens; decoupled: a budget of islands x steps shared by speed).")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the model initialisation, data shards and batches.")


class ModelSection(Section):
    """The model: a preset or a Hugging Face folder, and an optional warm start."""

    model: str = Field(
        "nano",
        description="Model size preset (Llama-style: nano ~0.27M with the default vocabulary, tiny ~2M, 20m, "
        "125m, 1b parameters; micro for tests), a local Hugging Face causal LM folder, or a Hub id (owner/name; "
        "needs internet or HF_HUB_OFFLINE=1 with a cached copy). A pretrained model trains on its own tokenizer.",
    )
    init_from: Path | None = Field(
        None, description="Start from the final weights of another atoll run folder (a warm start)."
    )


class DeviceSection(Section):
    """Where islands compute and in which precision (atoll.job.device)."""

    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="Where islands compute: auto (CUDA when present, then MPS, else the CPU), cpu, cuda "
        "(local runtime: islands on the visible GPUs round-robin, several may share one; collective: one GPU "
        "per rank, NCCL) or mps. The global model, the outer optimizer and the codecs stay float32 on the CPU.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Forward and backward precision: fp32, or bf16 autocast with float32 weights, "
        "gradients and optimizer state (the outer step and codecs stay float32).")
    compile: bool = Field(
        False, description="Compile each island's forward pass with torch.compile; when compilation fails "
        "at the first call the island trains in eager mode and the run says why (summary.json "
        "compile_skipped); a later failure (out of memory) stops the run.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder block's activations in the backward pass instead of keeping "
        "them (transformers' gradient checkpointing, non-reentrant torch.utils.checkpoint): about a third more "
        "compute for activation memory that no longer grows with the number of layers; the loss is unchanged.")


class DataSection(Section):
    """The corpus, its tokenizer and what one island consumes per inner step."""

    data: str = Field(
        "stdlib",
        description="Corpus: 'stdlib' (the interpreter's standard library source, no download), a local "
        ".txt/.jsonl/.parquet file, a folder of them (read and tokenized one shard at a time, cached per shard), "
        "or hf:NAME[:CONFIG] for a Hugging Face dataset (streamed once into the cache; needs internet then).",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer: 'bpe' (a byte-level BPE of vocab_size tokens trained on the corpus), or a "
        "folder / Hugging Face id loaded with AutoTokenizer. Default: the --model folder's own tokenizer when it "
        "has one, else bpe.")
    max_documents: int | None = Field(
        None, ge=2, description="hf: datasets: stream at most this many documents of the train split (default: "
        "all of it).")
    text_field: str = Field("text", description="Field holding the text in .jsonl/.parquet/Hugging Face data.")
    partition: Literal["iid", "non_iid"] = Field(
        "iid", description="How documents are dealt to islands: iid (shuffled) or non_iid (grouped by source)."
    )
    vocab_size: int = Field(1024, ge=257, le=262144, description="Byte-level BPE vocabulary size (atoll's BPE only: "
                            "a pretrained tokenizer brings its own).")
    seq_len: int = Field(128, ge=8, le=1 << 20, description="Tokens per training sequence.")
    batch_size: int = Field(32, ge=1, le=1 << 16, description="Sequences per micro-batch (per island, per forward "
                            "and backward pass); an inner step takes grad_accum of them.")
    grad_accum: int = Field(
        1, ge=1, le=1 << 12, description="Gradient accumulation: micro-batches of batch_size sequences per inner "
        "step, their gradients summed before the one optimizer step (a sharded island reduce-scatters only on "
        "the last). Tokens per inner step = grad_accum x batch_size x seq_len; --grad-accum 4 --batch-size 8 "
        "trains as --batch-size 32 in a quarter of the activation memory.")


class ScheduleSection(Section):
    """The inner steps' schedule and clipping, on every island whatever its optimizer."""

    warmup_steps: int = Field(40, ge=0, le=MAX_STEPS,
                              description="Linear learning-rate warmup, in inner steps (capped at a tenth of steps).")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1,
        description="Cosine decay floor, as a fraction of the peak rate (lr; demo_lr for demo).",
    )
    grad_clip: float = Field(1.0, ge=0, description="Clip each island's gradient norm to this (0: off).")


class AdamWSection(Section):
    """The inner AdamW optimizer of every island (or Muon on the hidden matrices): the strategies that do not bring
    their own (demo does: its section)."""

    lr: float = Field(3e-3, gt=0, le=10, description="Peak learning rate of the inner AdamW optimizer.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay of the inner AdamW.")
    inner_optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="Each island's inner optimizer: adamw, or muon (torch.optim.Muon on the hidden "
        "matrices at the same lr and weight decay, AdamW on embeddings, head and vectors; MuLoCo).")


class SyncSection(Section):
    """H, the inner steps of an outer round (the strategies with outer rounds: diloco, streaming, sparseloco,
    decoupled)."""

    sync_every: int = Field(
        50, ge=1, le=MAX_STEPS,
        description="H: inner steps between two outer synchronisations (diloco, streaming, sparseloco, "
        "decoupled).",
    )


class OuterOptimSection(Section):
    """The outer optimizer on pseudo-gradients: SGD with Nesterov momentum (DiLoCo, arXiv:2311.08105)."""

    outer_lr: float = Field(0.7, gt=0, description="Outer learning rate (DiLoCo: 0.7).")
    outer_momentum: float = Field(
        0.5, ge=0, lt=1,
        description="Outer Nesterov momentum (0 = plain SGD; the DiLoCo paper's 0.9, tuned for H=500 from a "
        "pretrained model, overshoots in short runs from scratch: docs/results.md, \"DiLoCo's defining result\").",
    )


#: the encodings of exchanged tensors (:mod:`atoll.algorithms.codecs`)
Codec = Literal["fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int8", "int4", "topk"]
#: what a decoupled island's pull carries (``pull_codec``, :mod:`atoll.strategies.decoupled.downlink`): the
#: float32 fragment, or the changes since the island's version in one of the push codecs
PullCodec = Literal["fp32", "bf16", "int8", "int4"]
PULL_CODECS: tuple[str, ...] = typing.get_args(PullCodec)


class CodecSection(Section):
    """How exchanged tensors travel (:mod:`atoll.algorithms.codecs`, :class:`atoll.algorithms.wire.Wire`)."""

    codec: Codec = Field(
        "fp32",
        description="Encoding of exchanged tensors (gradients for ddp, pseudo-gradients for diloco and "
        "streaming): fp32, bf16, fp16, fp8-e4m3, fp8-e5m2, int8, int4 (per-block scales), topk.",
    )
    codec_block_size: int = Field(64, ge=1, le=1 << 20,
                                  description="Elements per scale block of the fp8/int8/int4 codecs.")
    codec_rounding: Literal["nearest", "stochastic"] = Field(
        "nearest", description="Rounding of the lossy codecs: nearest, or stochastic (unbiased)."
    )
    topk_fraction: float = Field(0.01, gt=0, le=1, description="Fraction of entries the topk codec keeps.")
    error_feedback: bool = Field(
        False, description="Keep what the codec lost and add it to the next exchange (error feedback)."
    )


#: the codecs the compiled outer round quantizes with (:class:`~atoll.algorithms.fused_round.FusedRound`)
COMPILED_CODECS = ("fp32", "int8", "int4")


class OuterKernelSection(Section):
    """How the outer round runs: torch ops one by one, or compiled into few passes over the parameters
    (:mod:`atoll.algorithms.fused_round`: diloco and streaming; :mod:`atoll.algorithms.fused_accumulate`:
    sparseloco)."""

    outer_kernel: Literal["eager", "compiled"] = Field(
        "eager", description="diloco, streaming, sparseloco: how the outer round runs. eager: one torch kernel per "
        "operation, the reference's floats. compiled: the pseudo-gradients, their (int8/int4: quantized) mean, the "
        "outer Nesterov step and the islands' restart (streaming: mixing) fused by torch.compile into a few loops "
        "over the parameters, each read and written about once (atoll.algorithms.fused_round); sparseloco: the "
        "accumulation and its norms in one loop, the top-k as the reference (atoll.algorithms.fused_accumulate). "
        "Not the same floats (rounded in its own order); needs the local runtime, CPU islands and a C++ compiler "
        "(diloco, streaming: codec fp32, int8 or int4; diloco: outer_adapt none).")

    @model_validator(mode="after")
    def _compiled_codecs(self) -> OuterKernelSection:
        codec = getattr(self, "codec", "fp32")
        if self.outer_kernel == "compiled" and codec not in COMPILED_CODECS:
            raise ValueError("outer_kernel: the compiled round fuses an fp32, int8 or int4 mean; pass --codec fp32, "
                             "int8 or int4, or --outer-kernel eager")
        return self


class FragmentsSection(Section):
    """Fragments of strided layers synced in turn (Streaming DiLoCo, arXiv:2501.18512; Decoupled DiLoCo)."""

    fragments: int = Field(4, ge=1, description="streaming, decoupled: P, fragments of strided layers synced in turn.")


class OutputSection(Section):
    """Evaluation, checkpoints, where outputs go, threads and progress."""

    eval_every: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Evaluate the global model every N inner steps (default: about 20 "
        "evaluations per run, every steps // 20).")
    eval_batches: int = Field(
        16, ge=1, description="Batches of 8 held-out windows of seq_len tokens per evaluation (the same windows "
        "whatever --batch-size, so runs of different batch sizes are compared on the same text).")
    checkpoint_every: int = Field(
        100, ge=0, le=MAX_STEPS, description="Write a resumable checkpoint every N inner steps (0: only at the end)."
    )
    out: Path | None = Field(None, description="Output folder (default: runs/<strategy>-<time>).")
    cache_dir: Path | None = Field(
        None, description="Cache for tokenizers and token ids (default: $ATOLL_CACHE_DIR or ~/.cache/atoll)."
    )
    threads: int | None = Field(None, ge=1, le=1024, description="torch CPU threads (default: torch's choice).")
    progress: bool = Field(True, description="Show progress on stderr: a live bar on a terminal, otherwise (a log "
                           "file, a cluster job) one plain line every progress_every steps and at evaluations.")
    progress_every: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Inner steps between two plain progress lines when stderr is not a "
        "terminal (default: a twentieth of the run).")
    tracker: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="Experiment trackers that also receive the run's metrics: tensorboard "
        "(event files in <out>/tensorboard), wandb (Weights & Biases; offline with WANDB_MODE=offline), a "
        "comma-separated list, or none. Each is an extra: pip install atoll[tensorboard] / atoll[wandb].")

    @field_validator("tracker", mode="before")
    @classmethod
    def _parse_tracker(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)):
            value = list(dict.fromkeys(v for v in value if v != "none"))
            known = typing.get_args(typing.get_args(cls.model_fields["tracker"].annotation)[0])  # the Literal's
            unknown = [v for v in value if v not in known]
            if unknown:
                raise ValueError(f"{unknown[0]!r} is not {', '.join(known)} or none; pass one of them, or a "
                                 "comma-separated list")
        return value

    @field_validator("tracker")
    @classmethod
    def _tracker_installed(cls, value: list[str]) -> list[str]:
        from atoll.job.trackers import check_installed  # importlib only: nothing heavy

        check_installed(value)
        return value


#: the sections every run reads (fields of TrainConfig itself), in --help order
RUN_SECTIONS: tuple[type[Section], ...] = (RunSection, ModelSection, DeviceSection, DataSection, ScheduleSection,
                                           OutputSection)
#: the sections some strategies read and share (each strategy's config inherits those it reads), in --help order
SHARED_SECTIONS: tuple[type[Section], ...] = (SyncSection, AdamWSection, OuterOptimSection, CodecSection,
                                              OuterKernelSection, FragmentsSection)
