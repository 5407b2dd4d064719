"""The ``atoll syncer`` and ``atoll island`` commands: their flags and what they run (grpc imported only then).

Both run the ``service`` runtime (:class:`~atoll.config.runtimes.ServiceConfig`): ``--ranks-per-island``
(default: torchrun's world size), ``--shard-island`` and ``--slice-transfer`` are each island job's own, so
the syncer sets them aside. Bad input raises :class:`~atoll.errors.AtollError` (one line, exit status 2 from
:func:`atoll.cli.main`); an island that lost its syncer for ``--give-up-s`` exits with status 1, a rank whose
island peer stopped responding with status 3.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from atoll.errors import AtollError


def add_parsers(sub: Any, add_config_flags: Callable[[argparse.ArgumentParser], None] | None) -> None:
    """Add ``atoll syncer`` and ``atoll island`` to the subcommands ``sub``; ``add_config_flags``: adds the run
    settings' flags (None: left out, for a fast parser)."""
    p_syncer = sub.add_parser("syncer", help="serve the syncer of a decoupled run to island jobs that dial in "
                              "(gRPC, TLS, per-island credentials)",
                              description="Serve the syncer of a decoupled run. Give it the run's settings (the "
                              "same as every island's); it keeps its state in --out and continues from it when "
                              "restarted. See docs/deployment.md.")
    p_syncer.add_argument("--config", type=Path, default=None, metavar="PATH", help="a TOML file of run settings")
    p_syncer.add_argument("--listen", default="127.0.0.1:7070", metavar="HOST:PORT",
                          help="address to listen on [default: 127.0.0.1:7070, this host only]")
    p_syncer.add_argument("--credentials", type=Path, default=None, metavar="DIR",
                          help="folder of island_<i>.token secrets, one per island; missing ones are made "
                          "[default: OUT/credentials]")
    p_syncer.add_argument("--tls-cert", type=Path, default=None, metavar="PEM", help="the syncer's TLS certificate")
    p_syncer.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="its private key")
    p_syncer.add_argument("--insecure", action="store_true",
                          help="allow plaintext on an address other hosts can reach (never across the internet)")
    p_island = sub.add_parser("island", help="run one island of a decoupled run as its own job, dialing out to "
                              "atoll syncer", description="Run one island of a decoupled run against the syncer "
                              "at --syncer, as one process or as the R ranks torchrun starts (torchrun "
                              "--nproc-per-node R -m atoll island ...). Give it the run's settings (the same as "
                              "the syncer's). See docs/deployment.md.")
    p_island.add_argument("--config", type=Path, default=None, metavar="PATH", help="a TOML file of run settings")
    p_island.add_argument("--syncer", required=True, metavar="HOST:PORT", help="the address of atoll syncer")
    p_island.add_argument("--island", type=int, required=True, metavar="N", help="this island's index, 0-based")
    p_island.add_argument("--credential", type=Path, required=True, metavar="FILE",
                          help="this island's secret: the island_<N>.token file atoll syncer made")
    p_island.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                          help="the CA (or self-signed certificate) to trust for the syncer [default: the system's]")
    p_island.add_argument("--tls-server-name", default=None, metavar="NAME",
                          help="the name on the syncer's certificate, when it is not --syncer's host")
    p_island.add_argument("--plaintext", action="store_true", help="no TLS (loopback only, unless --insecure)")
    p_island.add_argument("--insecure", action="store_true", help="allow --plaintext to another host")
    p_island.add_argument("--give-up-s", type=float, default=600.0, metavar="X",
                          help="seconds without an answer from the syncer after which the island stops "
                          "(status 1) [default: 600]")
    if add_config_flags is not None:
        add_config_flags(p_syncer)
        add_config_flags(p_island)


#: the settings of an island job alone (islands of one run may differ in them): the syncer sets them aside
ISLAND_ONLY = ("ranks_per_island", "shard_island", "slice_transfer")


def _service_config(args: argparse.Namespace) -> Any:
    from atoll.config import build_config
    from atoll.config.applies import catalog

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC's own INFO lines (each retried handshake) are noise

    overrides = {k: v for k, v in vars(args).items() if k in catalog()}
    if overrides.setdefault("strategy", "decoupled") != "decoupled":
        raise AtollError(f"strategy: atoll {args.command} runs the decoupled strategy, not '{overrides['strategy']}'; "
                         "drop --strategy")
    if overrides.setdefault("runtime", "service") != "service":
        raise AtollError(f"runtime: atoll {args.command} runs the service runtime, not '{overrides['runtime']}'; "
                         "drop --runtime")
    if args.command == "syncer":
        overrides = {k: v for k, v in overrides.items() if k not in ISLAND_ONLY}
    elif "WORLD_SIZE" in os.environ and "ranks_per_island" not in overrides:
        overrides["ranks_per_island"] = os.environ["WORLD_SIZE"]  # torchrun's ranks: the island's, by default
    config = build_config(args.config, overrides)
    if config.strategy != "decoupled":
        raise AtollError(f"strategy: atoll {args.command} runs the decoupled strategy, not '{config.strategy}'; "
                         "set strategy = \"decoupled\" in the TOML file")
    if config.chaos is not None:
        raise AtollError("chaos: simulated in the local runtime only; islands of atoll island fail for real "
                         "(kill one): drop --chaos")
    return config


def syncer(args: argparse.Namespace) -> int:
    config = _service_config(args)
    from atoll.runtime.service.serve import serve

    if config.out is None:
        raise AtollError("out: atoll syncer keeps its state in a folder; pass --out DIR (the same on a restart)")
    credentials = args.credentials if args.credentials is not None else Path(config.out) / "credentials"
    summary = serve(config, args.listen, credentials, args.tls_cert, args.tls_key, insecure=args.insecure)
    print(f"atoll syncer: done; final eval loss {summary['final_eval_loss']:.4f}; run folder: {summary['out']}")
    return 0


def island(args: argparse.Namespace) -> int:
    config = _service_config(args)
    import faulthandler
    import signal

    from atoll.runtime.collective.failure import PeerFailure
    from atoll.runtime.service.client import SyncerClient, SyncerUnreachable
    from atoll.runtime.service.group import IslandGroup
    from atoll.runtime.service.island import lost_peer, read_token, run_island
    from atoll.runtime.service.tls import read_certificate

    if sys.__stderr__ is not None:  # kill -USR1 PID: every thread's stack on stderr (a hang's diagnosis)
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__)
    token = read_token(args.credential)
    ca = read_certificate(args.tls_ca, "tls-ca") if args.tls_ca is not None else None
    if ca is not None and args.plaintext:
        raise AtollError("tls-ca: --tls-ca and --plaintext exclude each other; drop one")
    group = IslandGroup.from_env(config.ranks_per_island, config.device, config.collective_timeout_s)
    client = SyncerClient(args.syncer, args.island, token, root_certificates=ca, plaintext=args.plaintext,
                          insecure=args.insecure, give_up_s=args.give_up_s, server_name=args.tls_server_name,
                          control=group.leader)
    try:
        group.start()
        report = run_island(config, args.island, client, group)
    except SyncerUnreachable as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        return 1
    except PeerFailure as e:
        lost_peer(e, args.island, group)  # exits with status 3
        raise
    finally:
        client.close()
    group.close()
    if group.leader:
        ranks = f" ({group.size} ranks)" if group.size > 1 else ""
        print(f"atoll island {args.island}{ranks}: done; {report['steps']} inner steps, {report['bytes_sent']:,.0f} "
              f"bytes sent, {report['retries']} retried calls, {report['offline_steps']} steps while the syncer was "
              f"unreachable, {report['lease_fetches']} step leases", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``atoll syncer`` or ``atoll island``; return the exit status."""
    return syncer(args) if args.command == "syncer" else island(args)
