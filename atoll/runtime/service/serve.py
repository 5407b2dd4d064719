"""``atoll syncer`` from its start to its end: credentials, the gRPC server, the run's final model and summary.

The handlers themselves are :class:`~atoll.runtime.service.server.SyncerServer`'s. A syncer sharded by
fragment (``--shard S --shards ADDR0,ADDR1,...``) runs one ``serve`` per shard: each keeps its state in
``OUT/shard_<S>``; shard 0 (the coordinator) makes the credentials (the islands' tokens and the run's key,
``syncer.key``) and, at the run's end, gathers the other shards (:mod:`~atoll.runtime.service.gather`) and
writes the run folder ``OUT/run``; the other shards read the same credentials folder (copied to their hosts)
and exit once the coordinator has gathered them.

While it serves, the run is shown live (:mod:`~atoll.runtime.service.monitor`): a progress line every
``progress_every_s`` seconds, the run folder's events and trackers as they happen (opened at the start:
:func:`open_run`), and with ``metrics_listen`` a status page with Prometheus metrics
(:mod:`~atoll.runtime.service.status`).
"""

from __future__ import annotations

import json
import secrets
import time
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from atoll.config import TrainConfig
from atoll.config.facts import RunFacts
from atoll.config.run_record import run_record, shown
from atoll.config.runtimes import ServiceConfig
from atoll.errors import ConfigError
from atoll.job.checkpoint import write_text_atomic
from atoll.job.lock import RunLock
from atoll.runtime.service import flow, wire
from atoll.runtime.service.island_state import Session, finite
from atoll.runtime.service.monitor import Monitor
from atoll.runtime.service.server import SyncerServer
from atoll.runtime.service.status import StatusServer

if TYPE_CHECKING:
    from atoll.job.run import Run

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
            if not path.exists():  # readable by its owner only from its first byte on, fsynced
                write_text_atomic(path, secrets.token_hex(32 if name == RUN_KEY else 16) + "\n", mode=0o600)
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



#: server keepalive: seconds between the server's pings of a connection, and to wait for the answer before it
#: closes the connection (a peer gone without a FIN)
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 60.0, 20.0
#: seconds a connection with no call in progress is kept (an idle stranger's, or an island's between calls: it
#: reconnects at its next call)
IDLE_S = 300.0
#: seconds a new connection may take for its TLS and HTTP/2 handshakes
HANDSHAKE_S = 20.0
#: file descriptors kept out of the connections' share (checkpoints, logs, the status, gRPC's own)
FILES_RESERVED = 256


def raise_nofile() -> int:
    """Raise this process's soft limit of open files (``RLIMIT_NOFILE``) to its hard limit (an inherited soft
    limit of 1,024 is a thousand idle connections); returns the soft limit now (-1: no such limit here)."""
    try:
        import resource
    except ImportError:  # not a POSIX host
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a container's limit above what this process may take: keep the soft one
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def build_server(state: SyncerServer, settings: ServiceConfig, islands: int, fragments: int) -> grpc.Server:
    """The gRPC server of ``state``'s handlers (not started, no port yet), bounded by construction.

    Threads: the control calls' (``8 + islands x (4 + fragments)``: per island its heartbeat, lease, commit
    and a long poll per fragment, ``Buffered``) plus ``bulk_slots`` (the transfers' admission,
    :meth:`~atoll.runtime.service.bulk.Bulk.admitted`, never lets more run at once), so control calls never
    wait behind transfers. Connections: server keepalive (:data:`KEEPALIVE_S`), idle ones closed after
    :data:`IDLE_S`, handshakes bounded (:data:`HANDSHAKE_S`), and at most the open-file limit (raised to its
    hard limit, :func:`raise_nofile`) less :data:`FILES_RESERVED` of them, so connections never take the
    descriptors of the syncer's own files. gRPC has no cap per peer address: one address may hold them all.
    Every stream starts with a ``bulk_window_mib`` receive window (:mod:`~atoll.runtime.service.flow`), so at
    most ``bulk_slots`` such windows of uploads wait unread.
    """
    files = raise_nofile()
    connections = max(64, files - FILES_RESERVED) if files > 0 else 1 << 16
    control = 8 + islands * (4 + fragments)
    options = [("grpc.max_receive_message_length", 2 * wire.CHUNK_BYTES + (1 << 16)), ("grpc.so_reuseport", 0),
               ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
               ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
               ("grpc.max_connection_idle_ms", int(IDLE_S * 1000)),
               ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_S * 1000)),
               ("grpc.max_allowed_incoming_connections", connections),
               *flow.bulk_options(flow.window_bytes(settings.bulk_window_mib))]
    return grpc.server(futures.ThreadPoolExecutor(max_workers=control + settings.bulk_slots),
                       handlers=[state.handler()], options=options)


#: the run's record (:func:`atoll.config.run_record.run_record`), in the syncer's folder: whose run its state is;
#: written at its first start
SETTINGS = "settings.json"


def claim_folder(config: TrainConfig, out: Path, state_dir: Path) -> RunLock:
    """The restart rule of ``atoll syncer`` (docs/deployment.md): the same command resumes its own run; a folder
    of a finished run, of another run (another :func:`~atoll.config.run_record.run_record`: the record an island's
    join is checked against) or of ``atoll train`` is refused
    before anything is written. Then ``state_dir`` (``out``, or a shard's ``out/shard_<S>``) is locked for this
    process (:class:`~atoll.job.lock.RunLock`) and, at a first start, the run's record written there.

    Raises:
        ConfigError: one line naming the folder (or the first differing setting, with both values) and the fix.
    """
    summary = out / "run" / "summary.json"
    if summary.is_file():
        raise ConfigError(f"out: '{out}' holds a finished run (its summary: '{summary}'); a syncer never rewrites "
                          "it: choose another --out for a new run")
    if (out / "config.json").is_file() or (out / "checkpoints").is_dir():
        raise ConfigError(f"out: '{out}' holds an 'atoll train' run (config.json, checkpoints/), not a syncer's; "
                          "choose another --out")
    record, path = run_record(config), state_dir / SETTINGS
    if path.exists():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(saved, dict):
                raise ValueError("not a record of settings")
        except (OSError, ValueError):
            raise ConfigError(f"out: '{path}' is unreadable; it names the run this folder holds: restore it, or "
                              "choose another --out") from None
        for key in (k for k in record if k in saved):  # (a setting one side does not know: another version's)
            if saved[key] != record[key]:
                raise ConfigError(f"{key}: '{out}' holds a run with {key} = {shown(saved[key])}, not "
                                  f"{shown(record[key])}; restart with the settings it was started with (the same "
                                  "command), or choose another --out for a new run")
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(state_dir)
    if not path.exists():
        try:
            write_text_atomic(path, json.dumps(record, indent=1, sort_keys=True))
        except BaseException:
            lock.release()
            raise
    return lock


def serve(config: TrainConfig) -> dict[str, Any]:
    """Run ``atoll syncer`` until the run is over; return its summary (the run folder ``<out>/run``), or, for a
    shard other than the coordinator, ``{"shard": S}`` once the coordinator has gathered it.

    ``config`` is the run's, its ``runtime_config`` the service's (:class:`~atoll.config.runtimes.ServiceConfig`:
    the address to listen on, TLS, the credentials folder, ``shard`` of ``shards`` for a syncer sharded by
    fragment, ``tls_ca`` and ``give_up_s`` for the coordinator's gathering: seconds it retries a shard before
    it gives up; another shard: seconds it waits, once gathered, for the coordinator's ``Close``).

    Restarted with the same command on its folder, it continues its run from its newest readable checkpoint
    (and completes an end that was cut: :func:`finish_run`); a folder of another or a finished run is refused
    (:func:`claim_folder`).

    Raises:
        ConfigError: no ``out``, more shards than fragments, unreadable TLS material or credentials folder, an
            address that cannot be bound, a folder of another run or of a finished one.
        CheckpointError: the folder has checkpoints and none is readable.
        SyncerUnreachable: (the coordinator) a shard gave no answer to its gathering for ``give_up_s``.
    """
    settings = ServiceConfig.of_run(config)
    fragments = config.strategy_config.fragments
    shard, shards = settings.shard, settings.shards
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
    sharded = count > 1
    lock = claim_folder(config, out, out / f"shard_{shard}" if sharded else out)  # before anything is written
    try:
        return _serve(config, settings, out, key_pair, tls_ca)
    finally:
        lock.release()


def _serve(config: TrainConfig, settings: ServiceConfig, out: Path, key_pair: tuple[bytes, bytes] | None,
           tls_ca: bytes | None) -> dict[str, Any]:
    """:func:`serve` once its folder is claimed."""
    fragments = config.strategy_config.fragments
    shard, shards, listen = settings.shard, settings.shards, settings.listen
    count = max(1, len(shards or []))
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
    server = build_server(server_state, settings, config.islands, fragments)
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
          f"island{'s' if config.islands != 1 else ''}, state in {server_state.out}{restarted}", flush=True)
    finished_at: float | None = None
    monitor: Monitor | None = None
    run: Run | None = None
    page: StatusServer | None = None
    try:
        # the live view (atoll.runtime.service.monitor): the run folder's events from now on (the coordinator's),
        # the progress line, and the status page with its metrics where --metrics-listen asks for them
        run = open_run(config, out / "run") if server_state.coordinator else None
        if run is not None:  # the run's wall time: the syncer's clock (continued across restarts), then this run's
            run.prior_wall_s = server_state.service._now()
        monitor = Monitor(server_state, RunFacts.of(config), settings.progress_every_s if config.progress else 0.0,
                          run).start()
        if settings.metrics_listen is not None:
            page = StatusServer(settings.metrics_listen, lambda: monitor.current if monitor is not None else {},
                                title=f"atoll syncer{f' shard {shard}' if sharded else ''}: {out}")
            host = settings.metrics_listen.rsplit(":", 1)[0]
            print(f"atoll syncer: status page on http://{host}:{page.port}/ (/status.json, /metrics)", flush=True)
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
        if monitor is not None:
            monitor.stop()  # its last look: the events of the final merges
        if page is not None:
            page.close()
    if not server_state.coordinator:
        return {"shard": shard}
    if not sharded:
        return finish_run(config, out, server_state, run=run)
    from atoll.runtime.service.gather import PeerClient, gather
    from atoll.runtime.service.syncer_shards import peer_token

    clients = [PeerClient(shards[s], s, peer_token(key), root_certificates=tls_ca, plaintext=key_pair is None,
                          insecure=settings.insecure, give_up_s=settings.give_up_s) for s in range(1, count)]
    try:
        final, refused = gather(server_state, clients)
    finally:
        for c in clients:
            c.close()
    return finish_run(config, out, server_state, final, refused, run=run)


def open_run(config: TrainConfig, folder: Path) -> Run:
    """The run folder ``folder`` (``<out>/run``) of a syncer, opened and begun (its ``start`` and initial ``eval``
    events; the trackers of ``--tracker``) so that its events are written as they happen. A syncer restarted
    on its own folder continues the events it had written (a run folder with events, no checkpoint and no
    summary: the run was not over).

    An end of this run cut during its final write (the final model written, no summary) is set aside: the end is
    written again whole (:func:`finish_run`).

    Raises:
        ConfigError: the folder holds another run (a summary), or is not writable.
    """
    import shutil

    from atoll.errors import DataError
    from atoll.job.checkpoint import checkpoint_folders
    from atoll.job.metrics import read_metrics
    from atoll.job.run import Run

    metrics = folder / "metrics.jsonl"
    history: list[dict[str, Any]] = []
    if not (folder / "summary.json").exists() and checkpoint_folders(folder / "checkpoints"):
        # this run's end, cut during its final write (claim_folder refused any other run's folder)
        print(f"atoll syncer: '{folder}' holds an end of this run that was cut before its summary; writing it "
              "again from the syncer's final state", flush=True)
        shutil.rmtree(folder / "checkpoints")
    if metrics.is_file() and not (folder / "summary.json").exists():
        try:
            history = read_metrics(metrics)
        except DataError:
            history = []
        metrics.unlink()  # written again below, with this start's own events after it
        (folder / "config.json").unlink(missing_ok=True)
    run = Run(config.model_copy(update={"out": folder}))
    if history:
        metrics.write_text("".join(json.dumps(e) + "\n" for e in history))
    run.begin()
    run.events.restore(history)
    return run


def finish_run(config: TrainConfig, out: Path, state: SyncerServer, final: dict[str, Any] | None = None,
               refused_calls: dict[str, int] | None = None, run: Run | None = None) -> dict[str, Any]:
    """Evaluate and save the final global model with its summary in ``<out>/run``, as ``atoll train`` would, and
    draw its ``timeline.png``; ``final``, ``refused_calls``: the whole run's, gathered from its shards (default:
    ``state``'s own); ``run``: the run folder opened at the start (:func:`open_run`; default: opened now).
    Resumable: an end cut by a kill or a power cut before its summary is written again whole from the syncer's
    final state, which its last checkpoint holds (:func:`open_run` sets the cut end's model aside).

    An island's bytes, compute and tokens are summed over its sessions (each job it ran, a killed one's as far
    as it reported; ``island_sessions``: per session); ``wall_s`` is the run's real wall time (the syncer's
    clock from its first start, restarts continued, and the final evaluation), ``run_s`` the seconds from the
    first inner step granted to the end (``island_utilization``'s denominator); no simulated-link field. Every
    figure an island reported is read as a finite number (else 0), so no report can stop the summary."""
    final = final or state.final or {}
    sharded = {"shards": len(final["shard_restarts"]), "shard_restarts": final["shard_restarts"]} \
        if "shard_restarts" in final else {}
    if run is None:  # opened only now: the run's wall time before is the syncer's clock
        run = open_run(config, out / "run")
        run.prior_wall_s = finite(final.get("clock_s", 0.0))
    totals = [Session.of(t) for t in final["island_totals"]]
    bytes_sent = [t.bytes_sent for t in totals]
    bytes_received = [t.bytes_received for t in totals]
    tokens = sum(final["steps_by_island"]) * config.tokens_per_step
    run_s = finite(final["run_s"])
    run.log_eval(config.steps, tokens, final["global"], sum(bytes_sent) / config.islands, run_s,
                 sum(bytes_received) / config.islands)
    run.save_checkpoint(config.steps, {"strategy": "decoupled", "versions": final["versions"]}, final["global"])
    compute = [t.compute_s for t in totals]
    sessions = [[{**x, "tokens": x["steps"] * config.tokens_per_step} for x in island] for island in final["sessions"]]
    return run.finish(tokens=tokens, bytes_sent_per_island=sum(bytes_sent) / config.islands,
                      bytes_received_per_island=sum(bytes_received) / config.islands, compute_s=max(compute),
                      sim_wall_s=None, bytes_sent_by_island=bytes_sent, bytes_received_by_island=bytes_received,
                      fragments=config.strategy_config.fragments,
                      **final["stats"], run_s=run_s,
                      steps_per_island=final["steps_by_island"], useful_tokens=final["merged_tokens"],
                      island_utilization=[c / run_s if run_s > 0 else 0.0 for c in compute],
                      island_sessions=sessions, compute_s_by_island=compute,
                      rejoins=[max(0, j - 1) for j in final["joins"]], rejoin_s=final["rejoin_s"],
                      rejoin_times=final["rejoin_times"],
                      versions=final["versions"], syncer_restarts=final["syncer_restarts"],
                      refused_calls=dict(refused_calls if refused_calls is not None else state.refused_calls),
                      islands_left=sorted(state.left), timeline=True, **sharded)
