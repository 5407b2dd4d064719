"""Each runtime's own config: the settings the ``local``, ``collective`` and ``ray`` runtimes read.

They live here rather than in the runtimes' packages so that the config imports neither torch nor Ray (an
optional extra). Each is built and validated alone (``CollectiveConfig(min_islands=2)``): its checks of its own
settings are its validators; a check across owners (the run's islands, the batch) is the whole config's.
The runtime registry (:mod:`atoll.runtime.registry`) lists each runtime with its config
(:func:`atoll.runtime.registry.configs`: each ``--runtime`` name -> its config). A setting of one runtime given
under another is refused (:func:`atoll.config.applies.unused_setting`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from atoll.config.parse import parse_resources
from atoll.config.section import RuntimeConfig, Section


class TimeoutSection(Section):
    """The deadline of the runtimes whose islands are real processes."""

    collective_timeout_s: float = Field(
        60.0, ge=1, le=86400,
        description="collective: deadline in seconds of every collective and of joining the process groups; "
        "a rank that dies is usually detected within seconds (closed connection, missing heartbeat), a "
        "hung one at this deadline. The run then stops with status 3 and can be resumed. ray: how long the "
        "driver waits for the other islands once one has finished. From 1 s (the store's clients and the "
        "heartbeat need a second) to 86400 s (one day; the backends' timers overflow far above). collective: "
        "the floor of each exchange's deadline, which grows with its bytes at --collective-link-mbps.",
    )


class LocalConfig(RuntimeConfig):
    """The ``local`` runtime's settings: the links of its simulated network clock (:mod:`atoll.runtime.local`)."""

    link_bandwidth_mbps: float = Field(
        100.0, gt=0, description="Each island's link bandwidth in Mbit/s, for the simulated network clock."
    )
    link_latency_ms: float = Field(10.0, ge=0, description="One-way link latency in milliseconds.")


class IslandRanksSection(Section):
    """Islands of several ranks: the ``collective`` runtime's, and ``atoll island`` jobs' (the ``service`` runtime)."""

    ranks_per_island: int = Field(
        1, ge=1, le=1024,
        description="collective, atoll island: processes (ranks) per island; they split the island's batch by rows "
        "and average their gradients every step (data parallel inside the island). batch_size must be divisible "
        "by it. collective: world size = islands x ranks_per_island; atoll island: torchrun's world size (the "
        "default there), and islands of one run may differ in it.",
    )
    shard_island: bool = Field(
        False,
        description="collective, atoll island: shard each island's model, gradients and AdamW state over its ranks "
        "with PyTorch FSDP2 (fully_shard), each rank holding 1/R; the strategy exchanges each rank's shard (with "
        "the ranks at its position in the other islands; atoll island: with the syncer, over the rank's own "
        "connection); demo and sparseloco select from each whole tensor, all-gathered inside the island. Every "
        "built-in strategy; needs --ranks-per-island 2 or more.",
    )

    @model_validator(mode="after")
    def _shards_need_ranks(self) -> IslandRanksSection:
        if self.shard_island and self.ranks_per_island < 2:
            raise ValueError("shard_island: an island of one rank has nothing to shard; pass --ranks-per-island 2 "
                             "or more, or drop --shard-island")
        return self


#: why --max-restarts is refused (a restarted island rejoins survivors: fewer islands needed than run, one rank each)
RESTARTS_NEED = ("max_restarts: a restarted island rejoins survivors that went on without it; it needs --min-islands "
                 "below --islands and --ranks-per-island 1")


class CollectiveConfig(IslandRanksSection, TimeoutSection, RuntimeConfig):
    """The ``collective`` runtime's settings: real processes over torch.distributed
    (:mod:`atoll.runtime.collective`)."""

    collective_link_mbps: float = Field(
        100.0, gt=0, le=1e7,
        description="collective: the slowest link between two islands in Mbit/s, which each exchange's deadline "
        "assumes: its bytes x 8 / this x 4 (a safety factor), plus the latencies, plus --collective-timeout-s "
        "(atoll.runtime.collective.comm.exchange_deadline_s). Too low only lengthens the wait for a hung peer "
        "(a dead one is found by its heartbeat within seconds); too high fails a slow but healthy exchange.",
    )
    async_checkpoint: bool = Field(
        False,
        description="collective: write periodic checkpoints in the background (torchtitan's asynchronous mode): "
        "each rank copies its part to host memory (pinned on a GPU; as many bytes as its state) and trains on "
        "while a thread writes it; rank 0 commits the checkpoint once every part is on disk, and the next "
        "checkpoint waits for it. The last checkpoint and a signal's are written in the foreground. A crash "
        "while one is written resumes from the one before (atoll.runtime.collective.async_checkpoint).",
    )
    collective_link_latency_ms: float = Field(
        10.0, ge=0, le=60000,
        description="collective: one-way latency of that link in milliseconds, once per ring step in the deadline.",
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

    @model_validator(mode="after")
    def _restarts_need_one_rank(self) -> CollectiveConfig:
        if self.max_restarts and self.ranks_per_island > 1:  # (and survivors: the whole config's check)
            raise ValueError(RESTARTS_NEED)
        return self


class RayConfig(TimeoutSection, RuntimeConfig):
    """The ``ray`` runtime's settings: islands and the syncer as Ray actors (:mod:`atoll.runtime.ray`)."""

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

    @field_validator("ray_island_resources")
    @classmethod
    def _custom_resources(cls, value: list[dict[str, float]] | None) -> list[dict[str, float]] | None:
        for res in value or []:
            for name, amount in res.items():
                if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
                    raise ValueError(f"'{name}' is not a custom resource name; use --ray-cpus-per-island / "
                                     "--ray-gpus-per-island for CPUs and GPUs")
                if not 0 < amount < float("inf"):
                    raise ValueError(f"{name}={amount} must be a positive number")
        return value


class ServiceConfig(IslandRanksSection, TimeoutSection, RuntimeConfig):
    """The ``service`` runtime's settings: ``atoll syncer`` and ``atoll island``, each island a job of its own
    (torchrun) that dials out to the syncer (:mod:`atoll.runtime.service`). ``atoll train`` does not run it.
    The ranks, the sharding and the slices are each island job's own (islands of one run may differ in them);
    the syncer reads none of them."""

    slice_transfer: Literal["ranks", "leader"] = Field(
        "ranks",
        description="atoll island of several ranks: how a push and a pull of a fragment travel. ranks (default, "
        "measured in bench/out/service_slices): every rank uploads and downloads its own slice over its own "
        "connection (its shard's part with --shard-island, else 1/R of the fragment), and the island's ranks "
        "all-gather the pulled slices; leader: rank 0 gathers the slices, pushes and pulls the whole fragment "
        "and hands the ranks their parts.",
    )
