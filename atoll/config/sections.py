"""The sections of a run's settings that every strategy shares, and the runtimes' own.

Each strategy's own section lives in its module (:mod:`atoll.strategies.streaming`, ``demo``, ``decoupled``)
and is collected by :mod:`atoll.config.train`. A field's description is its ``--help`` text.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from atoll.config.parse import parse_resources
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
    runtime: Literal["local", "collective", "ray"] = Field(
        "local",
        description="How islands run: local (one process, islands in turn, simulated network clock) or "
        "collective (real processes over torch.distributed: gloo on CPU, NCCL on GPUs; started by 'atoll "
        "train' on one machine, or by torchrun across machines) or ray (decoupled only: the syncer and "
        "every island as Ray actors on real clocks; see ray_address).",
    )
    islands: int = Field(4, ge=1, le=1024, description="Number of islands (model replicas, each its own shard).")
    sync_every: int = Field(
        50, ge=1, le=MAX_STEPS,
        description="H: inner steps between two outer synchronisations (diloco, streaming, sparseloco, decoupled).",
    )
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


class InnerOptimSection(Section):
    """The inner optimizer of every island (AdamW; DeMo's own rate is in its section) and its schedule."""

    lr: float = Field(3e-3, gt=0, le=10, description="Peak learning rate of the inner AdamW optimizer.")
    warmup_steps: int = Field(40, ge=0, le=MAX_STEPS,
                              description="Linear learning-rate warmup, in inner steps (capped at a tenth of steps).")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1,
        description="Cosine decay floor, as a fraction of the peak rate (lr; demo_lr for demo).",
    )
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay of the inner AdamW.")
    grad_clip: float = Field(1.0, ge=0, description="Clip each island's gradient norm to this (0: off).")
    inner_optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="Each island's inner optimizer: adamw, or muon (torch.optim.Muon on the hidden "
        "matrices at the same lr and weight decay, AdamW on embeddings, head and vectors; MuLoCo).")


class OuterOptimSection(Section):
    """The outer optimizer on pseudo-gradients: SGD with Nesterov momentum (DiLoCo, arXiv:2311.08105)."""

    outer_lr: float = Field(0.7, gt=0, description="Outer learning rate (DiLoCo: 0.7).")
    outer_momentum: float = Field(
        0.5, ge=0, lt=1,
        description="Outer Nesterov momentum (0 = plain SGD; the DiLoCo paper's 0.9, tuned for H=500 from a "
        "pretrained model, overshoots in short runs from scratch: docs/results.md, \"DiLoCo's defining result\").",
    )
    outer_adapt: Literal["none", "agreement"] = Field(
        "none", description="diloco: an adaptive outer step. agreement: each tensor's share of the outer step "
        "follows how much the islands agree on its pseudo-gradient (its estimated signal share over the "
        "model's mean, at most 2x); the overall outer rate stays outer_lr (atoll.algorithms.agreement).")


class CodecSection(Section):
    """How exchanged tensors travel (:mod:`atoll.algorithms.codecs`, :class:`atoll.algorithms.wire.Wire`)."""

    codec: Literal["fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int8", "int4", "topk"] = Field(
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


class FragmentsSection(Section):
    """Fragments of strided layers synced in turn (Streaming DiLoCo, arXiv:2501.18512; Decoupled DiLoCo)."""

    fragments: int = Field(4, ge=1, description="streaming, decoupled: P, fragments of strided layers synced in turn.")


class NetworkSection(Section):
    """The links of the simulated network clock (``local`` runtime)."""

    link_bandwidth_mbps: float = Field(
        100.0, gt=0, description="Each island's link bandwidth in Mbit/s, for the simulated network clock."
    )
    link_latency_ms: float = Field(10.0, ge=0, description="One-way link latency in milliseconds.")


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


class CollectiveSection(Section):
    """The ``collective`` runtime (real processes over torch.distributed)."""

    ranks_per_island: int = Field(
        1, ge=1, le=1024,
        description="collective: processes (ranks) per island; they split the island's batch by rows and "
        "average their gradients every step (data parallel inside the island). batch_size must be divisible "
        "by it. World size = islands x ranks_per_island.",
    )
    shard_island: bool = Field(
        False,
        description="collective: shard each island's model, gradients and AdamW state over its ranks with "
        "PyTorch FSDP2 (fully_shard), each rank holding 1/R; the strategy exchanges each rank's shard with the "
        "ranks at its position in the other islands (HSDP-like). ddp and diloco; needs --ranks-per-island 2 "
        "or more.",
    )
    collective_timeout_s: float = Field(
        60.0, ge=1, le=86400,
        description="collective: deadline in seconds of every collective and of joining the process groups; "
        "a rank that dies is usually detected within seconds (closed connection, missing heartbeat), a "
        "hung one at this deadline. The run then stops with status 3 and can be resumed. ray: how long the "
        "driver waits for the other islands once one has finished. From 1 s (the store's clients and the "
        "heartbeat need a second) to 86400 s (one day; the backends' timers overflow far above).",
    )
    min_islands: int = Field(
        1, ge=1, le=4096,
        description="collective: keep training while at least this many islands are alive. A lost island "
        "(any of its ranks) is dropped, the survivors re-form their groups and average over the islands that "
        "contributed; below this (or when island 0, which writes the run folder, is lost) the run stops with "
        "status 3. Set it to --islands to stop at any loss.",
    )
    max_restarts: int = Field(
        0, ge=0, le=1000,
        description="collective, one-machine launcher: restart a lost island's rank up to this many times; it "
        "rejoins the running job at the end of an inner step with the state of a live island (not from disk). "
        "Needs --min-islands below --islands and one rank per island.",
    )


class RaySection(Section):
    """The ``ray`` runtime (islands and the syncer as Ray actors); only it may change these."""

    ray_address: str | None = Field(
        None,
        description="ray runtime: address of a running Ray cluster to join (ray start --head prints it); "
        "default: start a local Ray.",
    )
    ray_cpus_per_island: float = Field(
        1.0, gt=0, description="ray runtime: CPUs Ray reserves for each island actor (its placement resource)."
    )
    ray_gpus_per_island: float = Field(
        0.0, ge=0, description="ray runtime: GPUs Ray reserves for each island actor (0: none)."
    )
    ray_logs: bool = Field(
        False,
        description="ray runtime: show Ray's own output (its workers' lines, autoscaler messages, info logs) "
        "beside atoll's; default: kept out (errors of the run are reported either way).",
    )
    ray_island_resources: list[dict[str, float]] | None = Field(
        None,
        description="ray runtime: custom Ray resources each island actor needs, to pin islands to a region "
        "or a hardware generation: NAME=AMOUNT[,NAME=AMOUNT] per island, islands separated by ';' "
        "(e.g. 'us_east=1;us_east=1;eu_west=1;eu_west=1'), or one entry for every island. Nodes declare them "
        "with ray start --resources; a local Ray started by atoll declares what the islands need.",
    )

    @field_validator("ray_island_resources", mode="before")
    @classmethod
    def _parse_resources(cls, value: object) -> object:
        if isinstance(value, str):
            return [parse_resources(part) for part in value.split(";")]
        return value
