"""Each runtime's own config: the settings the ``local``, ``collective`` and ``ray`` runtimes read.

They live here rather than in the runtimes' packages so that the config imports neither torch nor Ray (an
optional extra). Each is built and validated alone (``CollectiveConfig(min_islands=2)``): its checks of its own
settings are its validators; a check across owners (the run's islands, the batch) is the whole config's.
The runtime registry (:mod:`atoll.runtime.registry`) lists each runtime with its config
(:func:`atoll.runtime.registry.configs`: each ``--runtime`` name -> its config). A setting of one runtime given
under another is refused (:func:`atoll.config.applies.unused_setting`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from atoll.config.parse import is_loopback, parse_address, parse_resources
from atoll.config.section import RuntimeConfig, Section
from atoll.errors import ConfigError


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


def _addresses(value: object, field: str) -> object:
    """A comma-separated text (a flag) or a list (a TOML array) of ``HOST:PORT`` -> the list, each checked."""
    if isinstance(value, str):
        value = [a.strip() for a in value.split(",")]
    if isinstance(value, list):
        for address in value:
            if isinstance(address, str):
                _parsed(address, field)
    return value


def _parsed(address: str, field: str) -> tuple[str, int]:
    try:
        return parse_address(address, field)
    except ValueError as e:  # (its text names the field, as pydantic's location does)
        raise ValueError(str(e).split(": ", 1)[1]) from None


def _existing(path: Path | None, what: str) -> Path | None:
    if path is not None and not path.is_file():
        raise ValueError(f"'{path}' is not a file; pass the path of {what}")
    return path


class ServiceLinkSection(Section):
    """The settings of both ``atoll syncer`` and ``atoll island``: how they trust, and how long they wait for,
    the other end of a connection."""

    tls_ca: Path | None = Field(
        None, json_schema_extra={"metavar": "PEM"},
        description="atoll island: the CA (or self-signed certificate) to trust for the syncer; atoll syncer (shard "
        "0 of a sharded one): the CA of the other shards' certificates, to gather them at the run's end. Default: "
        "the system's CAs.",
    )
    insecure: bool = Field(
        False,
        description="atoll syncer: allow plaintext on an address other hosts can reach; atoll island: allow "
        "--plaintext to another host. Never across the internet.",
    )
    give_up_s: float = Field(
        600.0, gt=0, le=30 * 86400,
        description="atoll island: seconds without an answer from the syncer after which the island stops (status "
        "1); atoll syncer: (shard 0) seconds a shard it gathers may stay unreachable, (other shards) seconds to "
        "wait for shard 0 once gathered.",
    )

    bulk_window_mib: float = Field(
        8.0, gt=0, le=1024, json_schema_extra={"metavar": "MIB"},
        description="atoll syncer and atoll island: the HTTP/2 receive window each bulk transfer (a slice's upload or "
        "download) starts with, in MiB; size it to the link's bandwidth-delay product (1 Gbit/s x 70 ms round trip: "
        "8.75 MB, shared by an island's ranks), and raise the hosts' TCP buffers to match (docs/deployment.md). The "
        "syncer holds at most --bulk-slots windows of unread bytes.",
    )

    @field_validator("tls_ca")
    @classmethod
    def _tls_ca_exists(cls, value: Path | None) -> Path | None:
        return _existing(value, "a PEM certificate")


class SyncerSection(Section):
    """``atoll syncer``'s own settings: where it listens, its TLS identity, the islands' credentials, its shards.
    ``atoll island`` sets them aside when they come from the run's TOML file (one file serves every process)."""

    listen: str = Field(
        "127.0.0.1:7070", json_schema_extra={"metavar": "HOST:PORT"},
        description="atoll syncer: the address to listen on (127.0.0.1: this host only; 0.0.0.0: every interface, "
        "which needs --tls-cert and --tls-key, or --insecure).",
    )
    credentials: Path | None = Field(
        None, json_schema_extra={"metavar": "DIR"},
        description="atoll syncer: the folder of island_<i>.token secrets, one per island; missing ones are made. "
        "Default: OUT/credentials.",
    )
    tls_cert: Path | None = Field(
        None, json_schema_extra={"metavar": "PEM"},
        description="atoll syncer: its TLS certificate (with --tls-key); default: none (plaintext, loopback only).",
    )
    tls_key: Path | None = Field(
        None, json_schema_extra={"metavar": "PEM"},
        description="atoll syncer: the private key of --tls-cert (unencrypted PEM).",
    )
    shards: list[str] | None = Field(
        None, json_schema_extra={"metavar": "HOST:PORT,..."},
        description="atoll syncer sharded by fragment: every shard's address, comma-separated (a TOML list): the "
        "islands' --syncer list, the same on every shard. Default: one syncer.",
    )
    shard: int = Field(
        0, ge=0, le=4095, json_schema_extra={"metavar": "S"},
        description="atoll syncer sharded by fragment: this shard's place in --shards, 0-based; shard 0 "
        "coordinates.",
    )
    bulk_slots: int = Field(
        64, ge=1, le=4096, json_schema_extra={"metavar": "N"},
        description="atoll syncer: transfers (uploads and downloads of tensor slices) it serves at once, every "
        "island together; one more is refused as busy (the island retries). The server's threads are these plus "
        "the control calls' own, so heartbeats, leases and commits never wait behind transfers.",
    )
    island_transfers: int = Field(
        16, ge=1, le=4096, json_schema_extra={"metavar": "N"},
        description="atoll syncer: transfers one island may have open at once (an island of R ranks moves R "
        "slices at once); one more is refused as busy (the island retries).",
    )
    chunk_timeout_s: float = Field(
        30.0, gt=0, le=3600, json_schema_extra={"metavar": "S"},
        description="atoll syncer: seconds a transfer may go without a chunk moving before it is cut (the island "
        "resumes it where the syncer's bytes end).",
    )
    progress_every_s: float = Field(
        30.0, ge=0, le=86400, json_schema_extra={"metavar": "SECONDS"},
        description="atoll syncer: seconds between two progress lines on stderr (islands alive with their inner "
        "step and last push, merges, staleness, goodput, bytes in and out, refusals by reason); 0: none.",
    )
    metrics_listen: str | None = Field(
        None, json_schema_extra={"metavar": "HOST:PORT"},
        description="atoll syncer: serve a status page (/), its JSON (/status.json) and Prometheus metrics "
        "(/metrics) over HTTP at this address, e.g. 127.0.0.1:9400; loopback addresses only (the page has no "
        "TLS or login: reach it from elsewhere through an SSH tunnel). Default: none.",
    )

    @field_validator("listen")
    @classmethod
    def _listen_address(cls, value: str) -> str:
        _parsed(value, "listen")
        return value

    @field_validator("shards", mode="before")
    @classmethod
    def _shard_addresses(cls, value: object) -> object:
        return _addresses(value, "shards")

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_loopback(cls, value: str | None) -> str | None:
        if value is not None and not is_loopback(_parsed(value, "metrics_listen")[0]):
            raise ValueError(f"'{value}' is reachable from other hosts and the status page has no "
                             "TLS or login; pass a loopback address (127.0.0.1:PORT) and reach it through an SSH "
                             "tunnel")
        return value

    @field_validator("tls_cert", "tls_key")
    @classmethod
    def _tls_files_exist(cls, value: Path | None) -> Path | None:
        return _existing(value, "a PEM file")


class IslandJobSection(Section):
    """``atoll island``'s own settings: which syncer to dial, as which island, with which secret. ``atoll syncer``
    sets them aside when they come from the run's TOML file; ``atoll island`` needs the first three."""

    syncer: list[str] | None = Field(
        None, json_schema_extra={"metavar": "HOST:PORT[,...]"},
        description="atoll island (required): the address of atoll syncer; of a sharded one, every shard's, in the "
        "order of its --shards (comma-separated; a TOML list).",
    )
    island: int | None = Field(
        None, ge=0, le=4095, json_schema_extra={"metavar": "N"},
        description="atoll island (required): this island's index, 0-based.",
    )
    credential: Path | None = Field(
        None, json_schema_extra={"metavar": "FILE"},
        description="atoll island (required): this island's secret, the island_<N>.token file atoll syncer made.",
    )
    tls_server_name: str | None = Field(
        None, json_schema_extra={"metavar": "NAME"},
        description="atoll island: the name on the syncer's certificate, when it is not --syncer's host.",
    )
    plaintext: bool = Field(
        False, description="atoll island: no TLS to the syncer (loopback only, unless --insecure).",
    )
    emulate_step_s: float | None = Field(
        None, gt=0, le=3600, json_schema_extra={"metavar": "S"},
        description="atoll island, for benchmarks of several islands on one host: each inner step lasts at least S "
        "seconds (the island waits out the rest), so islands on equal hardware run at the island_speeds the run "
        "declares (an island of speed s: S = the fastest's S / s). Default: as fast as the hardware goes.",
    )

    @field_validator("syncer", mode="before")
    @classmethod
    def _syncer_addresses(cls, value: object) -> object:
        return _addresses(value, "syncer")

    @field_validator("credential")
    @classmethod
    def _credential_exists(cls, value: Path | None) -> Path | None:
        return _existing(value, "the island_<i>.token file atoll syncer made for this island")


#: the settings of ``atoll syncer`` alone (``atoll island`` sets them aside from the TOML file, refuses the flags)
SYNCER_ONLY: tuple[str, ...] = tuple(SyncerSection.model_fields)
#: the settings of an ``atoll island`` job alone (islands of one run may differ in them): the syncer sets aside
ISLAND_ONLY: tuple[str, ...] = (*IslandJobSection.model_fields, *IslandRanksSection.model_fields, "slice_transfer")
#: the settings only the ``atoll syncer`` and ``atoll island`` commands take (not ``atoll train``'s flags)
SERVICE_COMMANDS_ONLY: frozenset[str] = frozenset(
    (*SyncerSection.model_fields, *IslandJobSection.model_fields, *ServiceLinkSection.model_fields))


#: the service's settings that are no part of the run's record (:mod:`atoll.config.run_record`, compared at an
#: island's join): the syncer's own (:data:`SYNCER_ONLY`: where it listens, its TLS identity, the credentials, its
#: shards), each island job's own (:data:`ISLAND_ONLY`: its syncer, index, secret, ranks, sharding, slices), and
#: how each end trusts and waits for the other (TLS trust, give-up, the collective deadline): none changes the
#: maths, the data or the schedule
NOT_OF_THE_RUN: frozenset[str] = frozenset(
    (*SYNCER_ONLY, *ISLAND_ONLY, *ServiceLinkSection.model_fields, *TimeoutSection.model_fields))


def service_command(name: str) -> str:
    """Which command reads service setting ``name``: ``atoll syncer``, ``atoll island``, or both."""
    return "atoll syncer" if name in SYNCER_ONLY else "atoll island" if name in ISLAND_ONLY else \
        "atoll syncer and atoll island"


class ServiceConfig(SyncerSection, IslandJobSection, ServiceLinkSection, IslandRanksSection, TimeoutSection,
                    RuntimeConfig):
    """The ``service`` runtime's settings: ``atoll syncer`` and ``atoll island``, each island a job of its own
    (torchrun) that dials out to the syncer (:mod:`atoll.runtime.service`). ``atoll train`` does not run it.

    One TOML file serves the syncer and every island: each command sets aside the other's own settings found in
    the file (:data:`SYNCER_ONLY`, :data:`ISLAND_ONLY`) and refuses them as flags. The ranks, the sharding and the
    slices are each island job's own (islands of one run may differ in them).
    """

    slice_transfer: Literal["ranks", "leader"] = Field(
        "ranks",
        description="atoll island of several ranks: how a push and a pull of a fragment travel. ranks (default, "
        "measured in bench/out/service_slices): every rank uploads and downloads its own slice over its own "
        "connection (its shard's part with --shard-island, else 1/R of the fragment), and the island's ranks "
        "all-gather the pulled slices; leader: rank 0 gathers the slices, pushes and pulls the whole fragment "
        "and hands the ranks their parts.",
    )

    @model_validator(mode="after")
    def _check_service(self) -> ServiceConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert: --tls-cert and --tls-key go together; pass both (or neither, on loopback)")
        host, _ = parse_address(self.listen, "listen")
        if self.tls_cert is None and not is_loopback(host) and not self.insecure:
            raise ValueError(f"listen: '{self.listen}' is reachable from other hosts and no TLS is set; pass "
                             "--tls-cert and --tls-key, or --insecure to serve plaintext anyway (never across the "
                             "internet)")
        count = max(1, len(self.shards or []))
        if self.shard >= count:
            raise ValueError(f"shard: {self.shard} is not one of the {count} shards of --shards (0..{count - 1}); "
                             "pass --shard S with S this shard's place in --shards")
        if self.plaintext and self.tls_ca is not None:
            raise ValueError("tls_ca: --tls-ca and --plaintext exclude each other; drop one")
        for address in (self.syncer or []) if self.plaintext and not self.insecure else []:
            if not is_loopback(parse_address(address, "syncer")[0]):
                raise ValueError(f"syncer: '{address}' is another host and --plaintext sends in the clear; pass "
                                 "--tls-ca (or trust the system's CAs), or --insecure to send plaintext anyway")
        return self

    @classmethod
    def of_run(cls, config: Any) -> ServiceConfig:
        """The service runtime's config of a whole run's ``config`` (its ``runtime_config``).

        Raises:
            ConfigError: ``config`` is not a run of the service runtime.
        """
        own = config.runtime_config
        if not isinstance(own, cls):
            raise ConfigError(f"runtime: atoll syncer and atoll island run the service runtime, not "
                              f"'{config.runtime}'; drop --runtime")
        return own

    def require_island_job(self) -> None:
        """Check that ``atoll island`` has the settings it cannot run without (the syncer's address, the island's
        index and its credential), given as a flag or in the TOML file.

        Raises:
            ConfigError: one of them is unset (one line naming it and the flag).
        """
        for name in ("syncer", "island", "credential"):
            if getattr(self, name) is None:
                field = IslandJobSection.model_fields[name]
                metavar = (field.json_schema_extra or {}).get("metavar", "VALUE")  # type: ignore[union-attr]
                raise ConfigError(f"{name}: atoll island needs it; pass --{name} {metavar} (or set {name} in the "
                                  "TOML file)")

