"""The ``atoll syncer`` and ``atoll island`` commands: their flags and what they run (grpc imported only then).

Both run the ``service`` runtime, whose config (:class:`~atoll.config.runtimes.ServiceConfig`) holds every
setting of the two commands (``--listen``, ``--tls-cert``, ``--syncer``, ``--island``...: flags and TOML keys):
those of one command alone are set aside by the other where one TOML file holds them for every process, and
refused as its flags. ``--ranks-per-island`` (default: torchrun's world size), ``--shard-island`` and
``--slice-transfer`` are each island job's own (islands of one run may differ in them). Bad input raises
:class:`~atoll.errors.AtollError` (one line, exit status 2 from :func:`atoll.cli.main`); an island that lost
its syncer for ``--give-up-s`` exits with status 1, a rank whose island peer stopped responding with status 3,
a SIGTERMed island (after leaving the syncer) with status 143.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atoll.errors import AtollError
from atoll.runtime.process_end import end_process

if TYPE_CHECKING:
    from atoll.config import TrainConfig


#: run settings ``atoll island`` does not read, refused as its flags (from a TOML file serving every process they
#: are the syncer's): the run folder, its metrics and trackers are the syncer's, an island has no progress bar
ISLAND_UNREAD = ("out", "tracker", "progress_every")


def add_parsers(sub: Any, add_config_flags: Callable[[argparse.ArgumentParser], None] | None) -> None:
    """Add ``atoll syncer`` and ``atoll island`` to the subcommands ``sub``; ``add_config_flags``: adds the run
    settings' flags (None: left out, with the service's own, for a fast parser)."""
    p_syncer = sub.add_parser("syncer", help="serve the syncer of a decoupled run to island jobs that dial in "
                              "(gRPC, TLS, per-island credentials)",
                              description="Serve the syncer of a decoupled run. Give it the run's settings (the "
                              "same as every island's); it keeps its state in --out and continues from it when "
                              "restarted. See docs/deployment.md.")
    p_syncer.add_argument("--config", type=Path, default=None, metavar="PATH", help="a TOML file of run settings "
                          "(one file may serve the syncer and every island: each sets aside the other's own settings)")
    p_island = sub.add_parser("island", help="run one island of a decoupled run as its own job, dialing out to "
                              "atoll syncer", description="Run one island of a decoupled run against the syncer "
                              "at --syncer, as one process or as the R ranks torchrun starts (torchrun "
                              "--nproc-per-node R -m atoll island ...). Give it the run's settings (the same as "
                              "the syncer's). See docs/deployment.md.")
    p_island.add_argument("--config", type=Path, default=None, metavar="PATH", help="a TOML file of run settings "
                          "(one file may serve the syncer and every island: each sets aside the other's own settings)")
    if add_config_flags is not None:
        _add_service_flags(p_syncer, "syncer")
        _add_service_flags(p_island, "island")
        add_config_flags(p_syncer)
        add_config_flags(p_island)


def _add_service_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per setting of ``atoll <command>`` alone and of both commands (:mod:`atoll.config.runtimes`'
    sections of :class:`~atoll.config.runtimes.ServiceConfig`), documented from the field; the other command's
    own settings are flags too, hidden, so that giving one is refused in one sentence (:func:`build`)."""
    from atoll.config.runtimes import IslandJobSection, ServiceLinkSection, SyncerSection

    own, other = (SyncerSection, IslandJobSection) if command == "syncer" else (IslandJobSection, SyncerSection)
    group = parser.add_argument_group(f"atoll {command}'s settings (each also a key of the TOML file)")
    for section, where in ((own, group), (ServiceLinkSection, group), (other, parser)):
        for name, field in section.model_fields.items():
            said = field.default is None and "default" in str(field.description).lower()  # (or required)
            text = argparse.SUPPRESS if section is other else \
                str(field.description) + ("" if said or "(required)" in str(field.description) else
                                          f" [default: {field.default}]")
            flag = "--" + name.replace("_", "-")
            if field.annotation is bool:
                where.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                   help=text)
            else:
                metavar = (field.json_schema_extra or {}).get("metavar", "X")  # type: ignore[union-attr]
                where.add_argument(flag, dest=name, metavar=metavar, default=argparse.SUPPRESS, help=text)


def build(args: argparse.Namespace) -> TrainConfig:
    """The run's config of ``atoll syncer`` or ``atoll island`` (``args.command``): defaults < ``--config`` TOML <
    flags, the decoupled strategy under the service runtime. The other command's own settings
    (:data:`~atoll.config.runtimes.ISLAND_ONLY`, :data:`~atoll.config.runtimes.SYNCER_ONLY`) are set aside where
    the TOML file has them and refused as flags; ``atoll island``'s ranks default to torchrun's world size.

    Raises:
        AtollError: a flag of the other command, another strategy or runtime, a chaos trace, or any bad setting
            (:func:`atoll.config.build_config`), in one line.
    """
    from atoll.config import build_config
    from atoll.config.applies import catalog
    from atoll.config.runtimes import ISLAND_ONLY, SYNCER_ONLY, ServiceConfig, service_command

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC's own INFO lines (each retried handshake) are noise

    command = f"atoll {args.command}"
    other = ISLAND_ONLY if args.command == "syncer" else SYNCER_ONLY
    overrides = {k: v for k, v in vars(args).items() if k in catalog() or k in ServiceConfig.model_fields}
    refused = next((k for k in overrides if k in other), None)
    if refused is not None:
        raise AtollError(f"{refused}: {command} does not use it (only {service_command(refused)}); drop "
                         f"--{refused.replace('_', '-')}")
    unread = next((k for k in ISLAND_UNREAD if k in overrides), None) if args.command == "island" else None
    if unread is not None:  # the run's folder, metrics and trackers are the syncer's (docs/deployment.md)
        raise AtollError(f"{unread}: atoll island does not use it (the syncer writes the run's folder, events and "
                         f"trackers: give it to atoll syncer, see its status page); drop --{unread.replace('_', '-')}")
    if overrides.setdefault("strategy", "decoupled") != "decoupled":
        raise AtollError(f"strategy: {command} runs the decoupled strategy, not '{overrides['strategy']}'; "
                         "drop --strategy")
    if overrides.setdefault("runtime", "service") != "service":
        raise AtollError(f"runtime: {command} runs the service runtime, not '{overrides['runtime']}'; drop --runtime")
    if args.command == "island" and "WORLD_SIZE" in os.environ and "ranks_per_island" not in overrides:
        overrides["ranks_per_island"] = os.environ["WORLD_SIZE"]  # torchrun's ranks: the island's, by default
    config = build_config(args.config, overrides, set_aside=other)
    if config.strategy != "decoupled":
        raise AtollError(f"strategy: {command} runs the decoupled strategy, not '{config.strategy}'; "
                         "set strategy = \"decoupled\" in the TOML file")
    if config.runtime != "service":
        raise AtollError(f"runtime: {command} runs the service runtime, not '{config.runtime}'; "
                         "set runtime = \"service\" in the TOML file (or leave it out)")
    if config.strategy_config.chaos is not None:
        raise AtollError("chaos: simulated in the local runtime only; islands of atoll island fail for real "
                         "(kill one): drop --chaos")
    if args.command == "island":
        ServiceConfig.of_run(config).require_island_job()
    return config


def syncer(args: argparse.Namespace) -> int:
    """``atoll syncer``: serve the run's syncer until the run is over; its last line, status 0 (1: a shard the
    coordinator gathers stayed unreachable)."""
    config = build(args)
    from atoll.runtime.service.client import SyncerUnreachable
    from atoll.runtime.service.serve import serve

    try:
        summary = serve(config)
    except SyncerUnreachable as e:  # a shard the coordinator gathers: its state stays in its checkpoint
        print(f"atoll: error: {e}; restart that shard on its folder, then this one", file=sys.stderr)
        return 1
    if "final_eval_loss" not in summary:
        print(f"atoll syncer: shard {summary['shard']} done; its fragments were gathered by shard 0", flush=True)
        return 0
    print(f"atoll syncer: done; final eval loss {summary['final_eval_loss']:.4f}; run folder: {summary['out']}")
    return 0


def island(args: argparse.Namespace) -> int:
    """``atoll island``: run this rank of the island job until the run's budget is spent; the leader's last line,
    status 0 (1: the syncer stayed unreachable; 3: a rank of the island stopped responding; 143: SIGTERM, after
    leaving the syncer)."""
    config = build(args)
    from atoll.runtime.service.client import SyncerUnreachable
    from atoll.runtime.service.island import Terminated, island_job

    try:
        report = island_job(config)
    except SyncerUnreachable as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        return 1
    except Terminated:  # before it joined, or after it left: nothing to return to the syncer
        from atoll.config.runtimes import ServiceConfig

        print(f"atoll island {ServiceConfig.of_run(config).island}: SIGTERM: stopped", file=sys.stderr, flush=True)
        return 143
    if report["terminated"]:
        if report["rank"] == 0:
            print(f"atoll island {report['island']}: SIGTERM: stopped after {report['steps']} inner steps and left "
                  "the syncer (the rest of its step lease returned); the same command rejoins", file=sys.stderr,
                  flush=True)
        end_process(143)
    if report["rank"] == 0:
        ranks = f" ({report['ranks']} ranks)" if report["ranks"] > 1 else ""
        print(f"atoll island {report['island']}{ranks}: done; {report['steps']} inner steps, "
              f"{report['bytes_sent']:,.0f} bytes sent, {report.get('bytes_received', 0.0):,.0f} received, "
              f"{report['retries']} retried calls, {report['offline_steps']} "
              f"steps while the syncer was unreachable, {report['lease_fetches']} step leases", flush=True)
    end_process(0)


def run(args: argparse.Namespace) -> int:
    """Run ``atoll syncer`` or ``atoll island``; return the exit status."""
    return syncer(args) if args.command == "syncer" else island(args)
