"""Typed, validated configuration of a training run.

One pydantic model, :class:`TrainConfig`, holds every knob. Values come from three places, later ones
winning: the defaults below, a TOML file (``atoll train --config run.toml``), and command-line flags
(``--sync-every 50``). Every field is documented; ``atoll train --help`` prints them all.

A bad value raises :class:`atoll.errors.ConfigError` with one line that names the field and the fix;
the command line turns it into ``atoll: error: ...`` and exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from atoll.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Strategy = Literal["ddp", "diloco", "streaming", "demo", "decoupled"]
Runtime = Literal["local", "collective", "ray"]


class TrainConfig(BaseModel):
    """Every setting of one ``atoll train`` run.

    Terms follow the DiLoCo literature: an *island* is one model replica with its own data shard;
    *inner steps* are its local optimizer steps; every ``sync_every`` (H) inner steps the islands
    exchange *pseudo-gradients* and an *outer optimizer* updates the global parameters.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # --- what to run -------------------------------------------------------------------------------
    strategy: Strategy = Field(
        "diloco",
        description="What islands exchange: ddp (gradients every step), diloco (pseudo-gradients every H "
        "steps), streaming (fragments, overlapped, quantized), demo (top-k DCT of a decoupled momentum), "
        "decoupled (Decoupled DiLoCo: islands on their own clocks push fragments to a syncer that merges a "
        "quorum, token-weighted).",
    )
    runtime: Runtime = Field(
        "local",
        description="How islands run: local (one process, islands in turn, simulated network clock) or "
        "collective (real processes over torch.distributed: gloo on CPU, NCCL on GPUs; started by 'atoll "
        "train' on one machine, or by torchrun across machines) or ray (decoupled only: the syncer and "
        "every island as Ray actors on real clocks; see ray_address).",
    )
    ranks_per_island: int = Field(
        1, ge=1, le=1024,
        description="collective: processes (ranks) per island; they split the island's batch by rows and "
        "average their gradients every step (data parallel inside the island). batch_size must be divisible "
        "by it. World size = islands x ranks_per_island.",
    )
    collective_timeout_s: float = Field(
        60.0, gt=0,
        description="collective: deadline in seconds of every collective and of joining the process groups; "
        "a rank that dies is usually detected within seconds (closed connection, missing heartbeat), a "
        "hung one at this deadline. The run then stops with status 3 and can be resumed. ray: how long the "
        "driver waits for the other islands once one has finished.",
    )
    islands: int = Field(4, ge=1, le=1024, description="Number of islands (model replicas, each its own shard).")
    sync_every: int = Field(
        50, ge=1, description="H: inner steps between two outer synchronisations (diloco, streaming, decoupled)."
    )
    steps: int = Field(600, ge=1, description="Inner steps per island (each island sees steps x batch tokens; "
                       "decoupled: a budget of islands x steps shared by speed).")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the model initialisation, data shards and batches.")

    # --- model and data ----------------------------------------------------------------------------
    model: str = Field(
        "tiny",
        description="Model size preset (tiny ~2M, 20m, 125m, 1b parameters; Llama-style) or a local path to "
        "a Hugging Face causal LM folder.",
    )
    init_from: Path | None = Field(
        None, description="Start from the final weights of another atoll run folder (a warm start)."
    )
    data: str = Field(
        "stdlib",
        description="Corpus: 'stdlib' (the interpreter's standard library source, no download), a local "
        ".txt/.jsonl/.parquet file or folder, or hf:NAME for a Hugging Face dataset (needs internet).",
    )
    text_field: str = Field("text", description="Field holding the text in .jsonl/.parquet/Hugging Face data.")
    partition: Literal["iid", "non_iid"] = Field(
        "iid", description="How documents are dealt to islands: iid (shuffled) or non_iid (grouped by source)."
    )
    vocab_size: int = Field(4096, ge=257, le=262144, description="Byte-level BPE vocabulary size.")
    seq_len: int = Field(128, ge=8, le=1 << 20, description="Tokens per training sequence.")
    batch_size: int = Field(8, ge=1, le=1 << 16, description="Sequences per island per inner step.")

    # --- inner optimizer (AdamW) ---------------------------------------------------------------------
    lr: float = Field(3e-3, gt=0, le=10, description="Peak learning rate of the inner AdamW optimizer.")
    warmup_steps: int = Field(50, ge=0, description="Linear learning-rate warmup, in inner steps (capped at a tenth of steps).")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1,
        description="Cosine decay floor, as a fraction of the peak rate (lr; demo_lr for demo). Default 0.1; for "
        "demo 1.0, a constant rate after warmup (the best of bench/demo_sweep.py).",
    )
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay of the inner AdamW.")
    grad_clip: float = Field(1.0, ge=0, description="Clip each island's gradient norm to this (0: off).")

    # --- outer optimizer (SGD with Nesterov momentum on pseudo-gradients) ----------------------------
    outer_lr: float = Field(0.7, gt=0, description="Outer learning rate (DiLoCo: 0.7).")
    outer_momentum: float = Field(
        0.9, ge=0, lt=1,
        description="Outer Nesterov momentum (DiLoCo: 0.9; 0 = plain SGD). Default 0.9; for decoupled 0.5 (its "
        "many partial merges compound momentum; see README).",
    )

    # --- what travels: the codec layer ----------------------------------------------------------------
    codec: Literal["fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int8", "int4", "topk"] = Field(
        "fp32",
        description="Encoding of exchanged tensors (gradients for ddp, pseudo-gradients for diloco and "
        "streaming): fp32, bf16, fp16, fp8-e4m3, fp8-e5m2, int8, int4 (per-block scales), topk.",
    )
    codec_block_size: int = Field(64, ge=1, le=1 << 20, description="Elements per scale block of the fp8/int8/int4 codecs.")
    codec_rounding: Literal["nearest", "stochastic"] = Field(
        "nearest", description="Rounding of the lossy codecs: nearest, or stochastic (unbiased)."
    )
    topk_fraction: float = Field(0.01, gt=0, le=1, description="Fraction of entries the topk codec keeps.")
    error_feedback: bool = Field(
        False, description="Keep what the codec lost and add it to the next exchange (error feedback)."
    )

    # --- Streaming DiLoCo (arXiv:2501.18512) -----------------------------------------------------------
    fragments: int = Field(4, ge=1, description="streaming, decoupled: P, fragments of strided layers synced in turn.")
    overlap_steps: int = Field(
        1, ge=0, description="streaming: tau, inner steps that overlap a fragment's exchange before it is merged."
    )
    mixing_alpha: float = Field(
        0.5, ge=0, le=1,
        description="streaming: alpha; after an exchange a fragment becomes alpha*local + (1-alpha)*global.",
    )

    # --- DeMo / DisTrO (Peng, Quesnelle, Kingma 2024) -------------------------------------------------
    demo_lr: float = Field(3e-3, gt=0, le=10, description="demo: peak learning rate of the sign update.")
    demo_topk: int = Field(32, ge=1, description="demo: DCT components kept per chunk.")
    demo_chunk: int = Field(64, ge=1, description="demo: DCT chunk size along each axis.")
    demo_beta: float = Field(0.999, ge=0, lt=1, description="demo: decay of the decoupled momentum.")
    demo_sign_values: bool = Field(
        True, description="demo: send only the signs of the kept values, {-1, 0, +1} packed 2 bits each; "
        "--no-demo-sign-values sends float32 values (2.7x the bytes; bench/demo_sweep.py: signs no worse).",
    )

    # --- Decoupled DiLoCo (arXiv:2604.21428): syncer, quorum, grace window, failures ---------------
    quorum: int | None = Field(
        None, ge=1,
        description="decoupled: distinct islands whose pushes of a fragment make the syncer merge at once "
        "(default: half the islands, rounded up); fewer are merged when the grace window closes.",
    )
    grace_factor: float = Field(
        1.0, gt=0, le=100,
        description="decoupled: the grace window, as a multiple of the median round time the islands "
        "measured (pull to next push); a buffer short of a quorum is merged when it closes, so a dead "
        "island delays a merge by about one round at most.",
    )
    max_staleness: int = Field(
        4, ge=0,
        description="decoupled: a push computed from a global fragment more than this many outer steps old "
        "is dropped (bounded staleness).",
    )
    staleness_exponent: float = Field(
        0.5, ge=0, le=10,
        description="decoupled: a in the staleness discount of a push's token weight, (1 + staleness)^-a "
        "(FedAsync, arXiv:1903.03934); 0: none.",
    )
    update_norm_bound: float = Field(
        10.0, gt=1,
        description="decoupled: the syncer rejects a push whose norm exceeds this times the running median "
        "norm of recently accepted pushes of its fragment.",
    )
    scale_partial_merges: bool = Field(
        True,
        description="decoupled: scale a merge of n < islands distinct islands by n/islands before the outer "
        "step (each partial merge speaks for part of the islands; unscaled, Nesterov 0.7/0.9 overshoots).",
    )
    island_speeds: list[float] | None = Field(
        None,
        description="decoupled: relative speed of each island, comma separated, one per island, each in "
        "(0, 1] (e.g. 1,1,0.5,0.25): an island of speed s takes 1/s as long per inner step. Default: all 1.",
    )
    sim_step_s: float = Field(
        0.1, gt=0,
        description="decoupled, local runtime: simulated compute seconds of one inner step on a speed-1 "
        "island (a fixed cost keeps the event order, hence the run, deterministic for a seed).",
    )
    chaos: str | None = Field(
        None,
        description="decoupled: inject failures, MTBF_S:DOWNTIME_S (e.g. 90:10): each island fails after "
        "exponentially distributed up-times of mean MTBF_S (seeded per island), loses its un-pushed work, "
        "and rejoins from the syncer's newest global parameters DOWNTIME_S later.",
    )
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
    ray_island_resources: list[dict[str, float]] | None = Field(
        None,
        description="ray runtime: custom Ray resources each island actor needs, to pin islands to a region "
        "or a hardware generation: NAME=AMOUNT[,NAME=AMOUNT] per island, islands separated by ';' "
        "(e.g. 'us_east=1;us_east=1;eu_west=1;eu_west=1'), or one entry for every island. Nodes declare them "
        "with ray start --resources; a local Ray started by atoll declares what the islands need.",
    )

    # --- simulated network ---------------------------------------------------------------------------
    link_bandwidth_mbps: float = Field(
        100.0, gt=0, description="Each island's link bandwidth in Mbit/s, for the simulated network clock."
    )
    link_latency_ms: float = Field(10.0, ge=0, description="One-way link latency in milliseconds.")

    # --- evaluation, checkpoints, output -------------------------------------------------------------
    eval_every: int = Field(100, ge=1, description="Evaluate the global model every N inner steps.")
    eval_batches: int = Field(16, ge=1, description="Batches of held-out data per evaluation.")
    checkpoint_every: int = Field(
        100, ge=0, description="Write a resumable checkpoint every N inner steps (0: only at the end)."
    )
    out: Path | None = Field(None, description="Output folder (default: runs/<strategy>-<time>).")
    cache_dir: Path | None = Field(
        None, description="Cache for tokenizers and token ids (default: $ATOLL_CACHE_DIR or ~/.cache/atoll)."
    )
    threads: int | None = Field(None, ge=1, le=1024, description="torch CPU threads (default: torch's choice).")
    progress: bool = Field(True, description="Show the live progress bar.")

    @model_validator(mode="before")
    @classmethod
    def _strategy_defaults(cls, data: Any) -> Any:
        # sign-SGD (demo) learns best at a constant rate after warmup (bench/demo_sweep.py); AdamW with a decay
        if isinstance(data, dict) and data.get("min_lr_ratio") is None and data.get("strategy") == "demo":
            data = {**data, "min_lr_ratio": DEMO_MIN_LR_RATIO}
        # decoupled merges a partial quorum many times per H: Nesterov 0.9 compounds those steps and
        # overshoots (300-step tiny benchmark, blocking transfers then: 6.235 at 0.9 against 5.292 at 0.5, diloco int4 5.422)
        if isinstance(data, dict) and data.get("outer_momentum") is None and data.get("strategy") == "decoupled":
            data = {**data, "outer_momentum": DECOUPLED_OUTER_MOMENTUM}
        return data

    @field_validator("island_speeds", mode="before")
    @classmethod
    def _parse_speeds(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return [float(x) for x in value.split(",")]
            except ValueError:
                raise ValueError(f"'{value}' is not a comma-separated list of numbers; pass e.g. "
                                 "--island-speeds 1,1,0.5,0.25") from None
        return value

    @field_validator("ray_island_resources", mode="before")
    @classmethod
    def _parse_resources(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [parse_resources(part) for part in value.split(";")]
        return value

    @field_validator("chaos")
    @classmethod
    def _check_chaos(cls, value: str | None) -> str | None:
        if value is not None:
            parse_chaos(value)
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        decoupled_only = [("island_speeds", self.island_speeds is not None), ("chaos", self.chaos is not None),
                          ("quorum", self.quorum is not None)]
        if self.strategy != "decoupled":
            for name, given in decoupled_only:
                if given:
                    raise ValueError(f"{name}: only the decoupled strategy uses it; add --strategy decoupled "
                                     f"or drop --{name.replace('_', '-')}")
        # tuning fields that only one strategy or runtime reads: a changed value elsewhere is a mistake
        for name in _DECOUPLED_TUNING if self.strategy != "decoupled" else ():
            if getattr(self, name) != TrainConfig.model_fields[name].default:
                raise ValueError(f"{name}: only the decoupled strategy uses it; add --strategy decoupled or drop "
                                 f"--{name.replace('_', '-')}")
        for name in _RAY_ONLY if self.runtime != "ray" else ():
            if getattr(self, name) != TrainConfig.model_fields[name].default:
                raise ValueError(f"{name}: only the ray runtime uses it; add --runtime ray or drop "
                                 f"--{name.replace('_', '-')}")
        if self.ray_island_resources is not None:
            if len(self.ray_island_resources) not in (1, self.islands):
                raise ValueError(f"ray_island_resources: {len(self.ray_island_resources)} entries for "
                                 f"{self.islands} islands; give one per island (';'-separated) or one for all")
            for res in self.ray_island_resources:
                for name, amount in res.items():
                    if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
                        raise ValueError(f"ray_island_resources: '{name}' is not a custom resource name; use "
                                         "--ray-cpus-per-island / --ray-gpus-per-island for CPUs and GPUs")
                    if not 0 < amount < float("inf"):
                        raise ValueError(f"ray_island_resources: {name}={amount} must be a positive number")
        if self.runtime == "ray" and self.strategy != "decoupled":
            raise ValueError("runtime: ray runs only the decoupled strategy; add --strategy decoupled")
        if self.runtime == "ray" and (self.chaos is not None or self.island_speeds is not None):
            name = "chaos" if self.chaos is not None else "island_speeds"
            raise ValueError(f"{name}: simulated in the local runtime only (on Ray, failures are real: kill an "
                             f"island's process; speeds come from the hardware); drop --{name.replace('_', '-')} "
                             "or pass --runtime local")
        if self.strategy == "decoupled":
            if self.runtime == "collective":
                raise ValueError("runtime: decoupled runs under local or ray, not collective; pass --runtime local")
            if self.quorum is not None and self.quorum > self.islands:
                raise ValueError(f"quorum: {self.quorum} exceeds islands ({self.islands}); lower --quorum")
            if self.island_speeds is not None:
                if len(self.island_speeds) != self.islands:
                    raise ValueError(f"island_speeds: {len(self.island_speeds)} values for {self.islands} islands; "
                                     "give one speed per island, e.g. --island-speeds 1,1,0.5,0.25")
                bad = [s for s in self.island_speeds if not 0 < s <= 1]
                if bad:
                    raise ValueError(f"island_speeds: {bad[0]} is outside (0, 1]; the fastest island is 1, a "
                                     "half-speed one 0.5")
            if self.sync_every < self.fragments:
                raise ValueError(f"sync_every ({self.sync_every}) must be at least fragments ({self.fragments}) "
                                 "so each fragment syncs once per H steps; raise --sync-every or lower --fragments")
        if self.strategy == "streaming":
            if self.sync_every < self.fragments:
                raise ValueError(f"sync_every ({self.sync_every}) must be at least fragments ({self.fragments}) "
                                 "so each fragment syncs once per H steps; raise --sync-every or lower --fragments")
            if self.overlap_steps >= self.sync_every:
                raise ValueError(f"overlap_steps ({self.overlap_steps}) must be below sync_every "
                                 f"({self.sync_every}); lower --overlap-steps")
        if self.runtime == "collective" and self.batch_size % self.ranks_per_island:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by ranks_per_island "
                             f"({self.ranks_per_island}), each rank taking an equal share of the island's "
                             "rows; change --batch-size or --ranks-per-island")
        if self.strategy == "demo" and self.demo_topk > self.demo_chunk * self.demo_chunk:
            raise ValueError(f"demo_topk ({self.demo_topk}) exceeds a chunk's {self.demo_chunk}x{self.demo_chunk} "
                             "components; lower --demo-topk")
        return self

    @property
    def speeds(self) -> list[float]:
        """Each island's relative speed (``island_speeds``, default all 1.0)."""
        return list(self.island_speeds) if self.island_speeds is not None else [1.0] * self.islands

    @property
    def effective_warmup_steps(self) -> int:
        """Warmup actually used: ``warmup_steps``, capped at a tenth of ``steps`` for short runs."""
        return min(self.warmup_steps, self.steps // 10)

    @property
    def tokens_per_step(self) -> int:
        """Training tokens one island consumes per inner step (batch_size x seq_len)."""
        return self.batch_size * self.seq_len


DEMO_MIN_LR_RATIO = 1.0  # demo's default cosine floor (see TrainConfig._strategy_defaults)
DECOUPLED_OUTER_MOMENTUM = 0.5  # decoupled's default outer Nesterov momentum (see TrainConfig._strategy_defaults)
_DECOUPLED_TUNING = ("grace_factor", "max_staleness", "staleness_exponent", "update_norm_bound",
                     "scale_partial_merges", "sim_step_s")
_RAY_ONLY = ("ray_address", "ray_cpus_per_island", "ray_gpus_per_island", "ray_island_resources")


def parse_resources(value: str) -> dict[str, float]:
    """``"NAME=AMOUNT[,NAME=AMOUNT]"`` -> {name: amount}: one island's custom Ray resources.

    Raises:
        ValueError: an entry that is not NAME=NUMBER (the message names the fix).
    """
    out: dict[str, float] = {}
    for item in value.split(","):
        name, sep, amount = item.strip().partition("=")
        try:
            out[name.strip()] = float(amount)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"'{item.strip()}' is not NAME=AMOUNT; pass e.g. --ray-island-resources "
                             "'us_east=1;us_east=1;eu_west=1;eu_west=1'")
    return out


def parse_chaos(value: str) -> tuple[float, float]:
    """``"MTBF_S:DOWNTIME_S"`` -> (mean up-time between failures, downtime), seconds, both > 0.

    Raises:
        ValueError: not two positive finite numbers separated by a colon (the message names the fix).
    """
    parts = value.split(":")
    try:
        mtbf, down = (float(x) for x in parts)
        ok = len(parts) == 2 and 0 < mtbf < float("inf") and 0 < down < float("inf")
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"'{value}' is not MTBF_S:DOWNTIME_S with two positive numbers of seconds; "
                         "pass e.g. --chaos 90:10 (down about 10% of the time)")
    return mtbf, down


def _fix_hint(field: str) -> str:
    flag = "--" + field.replace("_", "-")
    return f"set {flag} (or '{field}' in the TOML file) to a valid value; see 'atoll train --help'"


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        return f"{loc}: unknown setting; remove it (known settings: 'atoll train --help')"
    if msg.startswith("Value error, "):
        text = msg[len("Value error, "):]
        return text if loc == "config" else f"{loc}: {text}"
    got = first.get("input")
    got_s = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"{loc}: {msg[0].lower() + msg[1:]}{got_s}; {_fix_hint(loc)}"


def build_config(toml_path: Path | None = None, overrides: dict[str, Any] | None = None,
                 base: dict[str, Any] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from defaults, an optional base dict, a TOML file and overrides.

    Args:
        toml_path: a TOML file whose top-level keys are :class:`TrainConfig` fields (or a ``[train]``
            table holding them).
        overrides: field values that win over the file (typically parsed command-line flags); values
            may be strings, which pydantic converts.
        base: values applied before the file (a resumed run's saved config).

    Returns:
        The validated config.

    Raises:
        ConfigError: a missing or unparsable TOML file, an unknown field, or an invalid value; the
            one-line message names the field and the fix.
    """
    values: dict[str, Any] = dict(base or {})
    if toml_path is not None:
        if not Path(toml_path).is_file():  # also a folder
            raise ConfigError(f"config: file '{toml_path}' does not exist; pass an existing TOML file")
        try:
            doc = tomllib.loads(Path(toml_path).read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config: '{toml_path}' is not valid UTF-8 TOML ({e}); fix the file") from None
        table = doc.get("train", doc) if isinstance(doc.get("train"), dict) or "train" not in doc else None
        if table is None:
            raise ConfigError(f"config: 'train' in '{toml_path}' must be a table ([train]); fix the file")
        if table is not doc and set(doc) - {"train"}:
            extra = ", ".join(sorted(set(doc) - {"train"}))
            raise ConfigError(f"config: '{toml_path}' has settings outside [train] ({extra}); move them into [train]")
        values.update(table)
    values.update(overrides or {})
    try:
        return TrainConfig(**values)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


#: Settings a resumed run may change: how long it trains, how it reports and how its islands run (a
#: collective checkpoint resumes under ``local`` and back), never what it computes.
RESUMABLE_OVERRIDES = frozenset({
    "steps", "eval_every", "eval_batches", "checkpoint_every", "progress", "threads", "cache_dir",
    "link_bandwidth_mbps", "link_latency_ms", "collective_timeout_s", "runtime", "ranks_per_island",
})


def load_run_config(run_dir: Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The saved config of a run folder, with ``overrides`` applied (e.g. more ``steps``).

    Only the settings in :data:`RESUMABLE_OVERRIDES` may differ from the saved ones: the strategy, model,
    data, islands, optimizers and codec define the run, and changing them mid-run would silently train
    something else (start a new run with ``--init-from`` instead). Nothing is written here.

    Raises:
        ConfigError: the folder holds no readable ``config.json`` (field ``resume``), or an override
            changes a setting that defines the run (names it).
    """
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"resume: '{run_dir}' is not an atoll run folder (no config.json); pass a run's --out folder")
    try:
        base = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(base, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"resume: '{path}' is unreadable ({e}); restore it from a backup or start a new run") from None
    saved = build_config(base={k: v for k, v in base.items() if k != "out"}, overrides={"out": str(run_dir)})
    overrides = {k: v for k, v in (overrides or {}).items() if k != "out"}
    config = build_config(base=saved.model_dump(), overrides={**overrides, "out": str(run_dir)})
    for name in overrides:
        if name not in RESUMABLE_OVERRIDES and getattr(config, name) != getattr(saved, name):
            raise ConfigError(
                f"{name}: cannot change on resume (the run has {getattr(saved, name)!r}); start a new run with "
                f"--init-from {run_dir} instead"
            )
    return config
