"""``atoll syncer`` from its start to its end: credentials, the gRPC server, the run's final model and summary.

The handlers themselves are :class:`~atoll.runtime.service.server.SyncerServer`'s.
"""

from __future__ import annotations

import secrets
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from atoll.config import TrainConfig
from atoll.errors import ConfigError
from atoll.runtime.service import wire
from atoll.runtime.service.server import SyncerServer


def load_credentials(folder: Path, islands: int) -> list[str]:
    """One secret per island from ``folder/island_<i>.token``; missing ones are made (:func:`secrets.token_hex`,
    32 hex digits, the file readable by its owner only) and said once on stderr.

    Raises:
        ConfigError: the folder cannot be made or read, or a token file is empty.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tokens, made = [], []
        for i in range(islands):
            path = folder / f"island_{i}.token"
            if not path.exists():
                tmp = folder / f".island_{i}.token.tmp"
                tmp.write_text(secrets.token_hex(16) + "\n")
                tmp.chmod(0o600)
                tmp.replace(path)
                made.append(path.name)
            token = path.read_text().strip()
            if not token:
                raise ConfigError(f"credentials: '{path}' is empty; delete it to have a new secret made")
            tokens.append(token)
    except OSError as e:
        raise ConfigError(f"credentials: cannot use the folder '{folder}' ({e.strerror or e}); pass a writable "
                          "--credentials folder") from None
    if made:
        print(f"atoll syncer: made credentials {', '.join(made)} in {folder}; give island i only its own "
              "island_<i>.token", flush=True)
    return tokens



def serve(config: TrainConfig, listen: str, credentials_dir: Path, tls_cert: Path | None, tls_key: Path | None,
          insecure: bool = False) -> dict[str, Any]:
    """Run ``atoll syncer`` until the run is over; return its summary (the run folder ``<out>/run``).

    Raises:
        ConfigError: a bad listen address, TLS material or credentials folder; plaintext on a non-loopback
            address without ``insecure``; an address that cannot be bound.
    """
    try:
        host, _ = wire.parse_address(listen, "listen")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("tls-cert: --tls-cert and --tls-key go together; pass both (or neither, on loopback)")
    if tls_cert is None and not wire.is_loopback(host) and not insecure:
        raise ConfigError(f"listen: '{listen}' is reachable from other hosts and no TLS is set; pass --tls-cert and "
                          "--tls-key, or --insecure to serve plaintext anyway (never across the internet)")
    from atoll.runtime.service.tls import read_key_pair

    key_pair = read_key_pair(tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
    if config.out is None:
        raise ConfigError("out: atoll syncer keeps its state in a folder; pass --out DIR (the same on a restart)")
    out = Path(config.out)
    credentials = load_credentials(credentials_dir, config.islands)
    server_state = SyncerServer(config, out, credentials)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8 + 4 * config.islands),
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
    print(f"atoll syncer: listening on {listen} ({'TLS' if key_pair else 'plaintext'}), {config.islands} islands, "
          f"state in {out}{restarted}", flush=True)
    try:
        while not server_state.done.is_set():
            server_state.tick()
            time.sleep(0.1)
    finally:
        server.stop(grace=2.0)
    return finish_run(config, out, server_state)


def finish_run(config: TrainConfig, out: Path, state: SyncerServer) -> dict[str, Any]:
    """Evaluate and save the final global model with its summary in ``<out>/run``, as ``atoll train`` would."""
    from atoll.job.run import Run

    final = state.final or {}
    run = Run(config.model_copy(update={"out": out / "run"}))
    run.begin()
    reports = [state.left.get(i, {}) for i in range(config.islands)]
    bytes_sent = [float(r.get("bytes_sent", 0.0)) for r in reports]
    tokens = sum(final["steps_by_island"]) * config.tokens_per_step
    wall_s = final["run_s"]
    run.log_eval(config.steps, tokens, final["global"], sum(bytes_sent) / config.islands, wall_s)
    run.save_checkpoint(config.steps, {"strategy": "decoupled", "versions": final["versions"]}, final["global"])
    compute = [float(r.get("compute_s", 0.0)) for r in reports]
    return run.finish(tokens=tokens, bytes_sent_per_island=sum(bytes_sent) / config.islands, compute_s=max(compute),
                      sim_wall_s=wall_s, bytes_sent_by_island=bytes_sent, fragments=config.fragments, **final["stats"],
                      steps_per_island=final["steps_by_island"], useful_tokens=final["merged_tokens"],
                      island_utilization=[c / wall_s if wall_s > 0 else 0.0 for c in compute],
                      rejoins=[max(0, j - 1) for j in final["joins"]], rejoin_s=final["rejoin_s"],
                      versions=final["versions"], syncer_restarts=final["syncer_restarts"],
                      refused_calls=dict(state.refused_calls), islands_left=sorted(state.left))
