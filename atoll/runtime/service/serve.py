"""``atoll syncer`` from its start to its end: credentials, the gRPC server, the run's final model and summary.

The handlers themselves are :class:`~atoll.runtime.service.server.SyncerServer`'s. A syncer sharded by
fragment (``--shard S --shards ADDR0,ADDR1,...``) runs one ``serve`` per shard: each keeps its state in
``OUT/shard_<S>``; shard 0 (the coordinator) makes the credentials (the islands' tokens and the run's key,
``syncer.key``) and, at the run's end, gathers the other shards (:mod:`~atoll.runtime.service.gather`) and
writes the run folder ``OUT/run``; the other shards read the same credentials folder (copied to their hosts)
and exit once the coordinator has gathered them.
"""

from __future__ import annotations

import secrets
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from atoll.config import TrainConfig
from atoll.config.runtimes import ServiceConfig
from atoll.errors import ConfigError
from atoll.runtime.service import wire
from atoll.runtime.service.island_state import Session, finite
from atoll.runtime.service.server import SyncerServer

#: the run's secret of a sharded syncer (in the credentials folder, beside the islands' tokens; never an island's)
RUN_KEY = "syncer.key"
#: seconds a shard other than the coordinator waits for the credentials shard 0 makes (one host, one folder)
CREDENTIALS_WAIT_S = 120.0


def load_credentials(folder: Path, islands: int, run_key: bool = False, make: bool = True) -> list[str]:
    """One secret per island from ``folder/island_<i>.token`` (and, ``run_key``, the run's key ``syncer.key``,
    64 hex digits); missing ones are made (:func:`secrets.token_hex`, the file readable by its owner only) and
    said once on stdout. ``make`` False (a shard other than the coordinator): made by none; waited for up to
    :data:`CREDENTIALS_WAIT_S` (shard 0 on the same host makes them), else an error.

    Raises:
        ConfigError: the folder cannot be made or read, a token file is empty, or (not ``make``) missing.
    """
    folder = Path(folder)
    names = [*(f"island_{i}.token" for i in range(islands)), *([RUN_KEY] if run_key else [])]
    if not make:
        deadline = time.monotonic() + CREDENTIALS_WAIT_S
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            print(f"atoll syncer: waiting for shard 0's credentials in {folder} ({', '.join(missing[:3])}); copy "
                  "that folder from shard 0's host", flush=True)
        while missing and time.monotonic() < deadline:
            time.sleep(0.5)
            missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ConfigError(f"credentials: '{folder / missing[0]}' is missing; copy shard 0's --credentials folder "
                              "to this host (every shard reads the same one) and pass it with --credentials")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tokens, made = [], []
        for name in names:
            path = folder / name
            if not path.exists():
                tmp = folder / f".{name}.tmp"
                tmp.write_text(secrets.token_hex(32 if name == RUN_KEY else 16) + "\n")
                tmp.chmod(0o600)
                tmp.replace(path)
                made.append(path.name)
            token = path.read_text().strip()
            if not token:
                raise ConfigError(f"credentials: '{path}' is empty; delete it to have a new secret made")
            if name != RUN_KEY:
                tokens.append(token)
    except OSError as e:
        raise ConfigError(f"credentials: cannot use the folder '{folder}' ({e.strerror or e}); pass a writable "
                          "--credentials folder") from None
    if made:
        print(f"atoll syncer: made credentials {', '.join(made)} in {folder}; give island i only its own "
              f"island_<i>.token{'; every shard the whole folder' if run_key else ''}", flush=True)
    return tokens



def serve(config: TrainConfig) -> dict[str, Any]:
    """Run ``atoll syncer`` until the run is over; return its summary (the run folder ``<out>/run``), or, for a
    shard other than the coordinator, ``{"shard": S}`` once the coordinator has gathered it.

    ``config`` is the run's, its ``runtime_config`` the service's (:class:`~atoll.config.runtimes.ServiceConfig`:
    the address to listen on, TLS, the credentials folder, ``shard`` of ``shards`` for a syncer sharded by
    fragment, ``tls_ca`` and ``give_up_s`` for the coordinator's gathering: seconds it retries a shard before
    it gives up; another shard: seconds it waits, once gathered, for the coordinator's ``Close``).

    Raises:
        ConfigError: no ``out``, more shards than fragments, unreadable TLS material or credentials folder, an
            address that cannot be bound.
        SyncerUnreachable: (the coordinator) a shard gave no answer to its gathering for ``give_up_s``.
    """
    settings = ServiceConfig.of_run(config)
    fragments = config.strategy_config.fragments
    shard, shards, listen = settings.shard, settings.shards, settings.listen
    count = max(1, len(shards or []))
    if count > fragments:
        raise ConfigError(f"shards: {count} shards for {fragments} fragments; each shard owns at least one "
                          "fragment: list at most --fragments addresses in --shards")
    if config.out is None:
        raise ConfigError("out: atoll syncer keeps its state in a folder; pass --out DIR (the same on a restart)")
    from atoll.runtime.service.tls import read_certificate, read_key_pair

    key_pair = read_key_pair(settings.tls_cert, settings.tls_key) \
        if settings.tls_cert is not None and settings.tls_key is not None else None
    tls_ca = read_certificate(settings.tls_ca, "tls_ca") if settings.tls_ca is not None else None
    out = Path(config.out)
    credentials_dir = settings.credentials if settings.credentials is not None else out / "credentials"
    sharded = count > 1
    credentials = load_credentials(credentials_dir, config.islands, run_key=sharded, make=shard == 0)
    key = (Path(credentials_dir) / RUN_KEY).read_text().strip().encode() if sharded else b""
    try:
        server_state = SyncerServer.of_run(config, out / f"shard_{shard}" if sharded else out, credentials,
                                           shard=shard, shards=count, key=key)
    except ValueError as e:  # a checkpoint of another shard, or of another map
        if not str(e).startswith("shards:"):
            raise
        raise ConfigError(str(e)) from None
    # a thread per call: per island its heartbeat, lease, transfers and a long poll per fragment (Buffered)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8 + config.islands * (4 + fragments)),
                         handlers=[server_state.handler()],
                         options=[("grpc.max_receive_message_length", 2 * wire.CHUNK_BYTES + (1 << 16)),
                                  ("grpc.so_reuseport", 0)])
    try:
        if key_pair is not None:
            port = server.add_secure_port(listen, grpc.ssl_server_credentials([key_pair]))
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as e:
        raise ConfigError(f"listen: cannot listen on '{listen}' ({e}); pick a free port or another address") from None
    if port == 0:
        raise ConfigError(f"listen: cannot listen on '{listen}' (in use, or not this host's); pick a free port")
    server.start()
    restarted = (f", restarted from commit {server_state.service.syncer.commits}"
                 if server_state.service.restarts else "")
    service = server_state.service
    role = (f" as shard {shard} of {count} ({'the coordinator, ' if shard == 0 else ''}fragments "
            f"{service.fragment_ids}, {service.syncer.numel:,} parameters)" if sharded else "")
    print(f"atoll syncer: listening on {listen} ({'TLS' if key_pair else 'plaintext'}){role}, {config.islands} "
          f"islands, state in {server_state.out}{restarted}", flush=True)
    finished_at: float | None = None
    try:
        while not server_state.done.is_set():
            server_state.tick()
            time.sleep(0.1)
            if server_state.finished is not None:  # gathered; the coordinator's Close may never come
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > settings.give_up_s:
                    break
    finally:
        server.stop(grace=2.0)
        server_state.tick()  # the last status (gathered, done)
    if not server_state.coordinator:
        return {"shard": shard}
    if not sharded:
        return finish_run(config, out, server_state)
    from atoll.runtime.service.gather import PeerClient, gather
    from atoll.runtime.service.syncer_shards import peer_token

    clients = [PeerClient(shards[s], s, peer_token(key), root_certificates=tls_ca, plaintext=key_pair is None,
                          insecure=settings.insecure, give_up_s=settings.give_up_s) for s in range(1, count)]
    try:
        final, refused = gather(server_state, clients)
    finally:
        for c in clients:
            c.close()
    return finish_run(config, out, server_state, final, refused)


def finish_run(config: TrainConfig, out: Path, state: SyncerServer, final: dict[str, Any] | None = None,
               refused_calls: dict[str, int] | None = None) -> dict[str, Any]:
    """Evaluate and save the final global model with its summary in ``<out>/run``, as ``atoll train`` would;
    ``final``, ``refused_calls``: the whole run's, gathered from its shards (default: ``state``'s own).

    An island's bytes, compute and tokens are summed over its sessions (each job it ran, a killed one's as far
    as it reported; ``island_sessions``: per session); ``wall_s`` is the run's real wall time (the syncer's
    clock from its first start, restarts continued, and the final evaluation), ``run_s`` the seconds from the
    first inner step granted to the end (``island_utilization``'s denominator); no simulated-link field. Every
    figure an island reported is read as a finite number (else 0), so no report can stop the summary."""
    from atoll.job.run import Run

    final = final or state.final or {}
    sharded = {"shards": len(final["shard_restarts"]), "shard_restarts": final["shard_restarts"]} \
        if "shard_restarts" in final else {}
    run = Run(config.model_copy(update={"out": out / "run"}))
    run.begin()
    run.prior_wall_s = finite(final.get("clock_s", 0.0))  # the run's wall time: the syncer's clock, then this
    totals = [Session.of(t) for t in final["island_totals"]]
    bytes_sent = [t.bytes_sent for t in totals]
    tokens = sum(final["steps_by_island"]) * config.tokens_per_step
    run_s = finite(final["run_s"])
    run.log_eval(config.steps, tokens, final["global"], sum(bytes_sent) / config.islands, run_s)
    run.save_checkpoint(config.steps, {"strategy": "decoupled", "versions": final["versions"]}, final["global"])
    compute = [t.compute_s for t in totals]
    sessions = [[{**x, "tokens": x["steps"] * config.tokens_per_step} for x in island] for island in final["sessions"]]
    return run.finish(tokens=tokens, bytes_sent_per_island=sum(bytes_sent) / config.islands, compute_s=max(compute),
                      sim_wall_s=None, bytes_sent_by_island=bytes_sent, fragments=config.strategy_config.fragments,
                      **final["stats"], run_s=run_s,
                      steps_per_island=final["steps_by_island"], useful_tokens=final["merged_tokens"],
                      island_utilization=[c / run_s if run_s > 0 else 0.0 for c in compute],
                      island_sessions=sessions, compute_s_by_island=compute,
                      rejoins=[max(0, j - 1) for j in final["joins"]], rejoin_s=final["rejoin_s"],
                      rejoin_times=final["rejoin_times"],
                      versions=final["versions"], syncer_restarts=final["syncer_restarts"],
                      refused_calls=dict(refused_calls if refused_calls is not None else state.refused_calls),
                      islands_left=sorted(state.left), **sharded)
