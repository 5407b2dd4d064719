"""``atoll syncer``: one :class:`~atoll.strategies.decoupled.service.SyncerService` served over gRPC.

Every call is authenticated: its metadata carries the caller's island index and secret (``atoll-island``,
``atoll-credential``), checked with the syncer's own admission check
(:meth:`Admission.identity <atoll.strategies.decoupled.trust.Admission.identity>`, constant time) before
anything else; a call without them (``no_credential``), naming no island of the run (``island``) or with
another island's secret (``identity``) is refused with UNAUTHENTICATED, counted in ``refused_calls`` by
reason and logged. A push that passes is then checked as the syncer checks every push (form, identity,
freshness: a replay is refused and counted as ``replay``, bounds). Payloads are JSON and safetensors only.

Threads: gRPC runs calls on a pool of threads; every call into the service holds one lock, so the
service sees one call at a time, as the Ray actor does. Tensor bytes are received and sent outside the
lock, so a slow upload never holds up a heartbeat. A poll thread closes due grace windows, writes
``<out>/service/status.json`` (commits, versions, refusals: for operators and tests) and ends the run once
the step budget is spent and every island that joined has left (or ``collective_timeout_s`` after the
budget was spent). The service checkpoints atomically after every commit (``<out>/syncer``); restarted on
the same folder it continues from its newest checkpoint, and the islands, which retry with backoff, resume.
At the end the global model is evaluated and saved, with a summary, in the run folder ``<out>/run``.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from atoll.config import TrainConfig
from atoll.errors import ConfigError
from atoll.runtime.service import wire
from atoll.strategies.decoupled.protocol import Push, is_index
from atoll.strategies.decoupled.service import SyncerService

log = logging.getLogger("atoll.syncer")

#: uploads (a push's tensor in transfer) one island may have open at once; the oldest is dropped beyond
OPEN_UPLOADS = 8
#: answers to completed pushes remembered per island, so a commit retried after a lost reply is not a replay
ANSWERS = 16


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


class SyncerServer:
    """The gRPC handlers around one :class:`SyncerService` (see the module docstring).

    Args:
        config: the run's settings (the same the islands are given).
        out: the syncer's folder (``syncer/`` checkpoints, ``service/status.json``, ``run/`` at the end).
        credentials: per island its secret.
    """

    def __init__(self, config: TrainConfig, out: Path, credentials: list[str]) -> None:
        self.config, self.out = config, Path(out)
        self.service = SyncerService(config.model_dump_json(), str(self.out), credentials, pid_dir="service")
        self.lock = threading.Lock()
        self.uploads: dict[int, OrderedDict[str, bytearray]] = {i: OrderedDict() for i in range(config.islands)}
        self.answers: dict[int, OrderedDict[str, dict[str, Any]]] = {i: OrderedDict() for i in range(config.islands)}
        self.pulls: dict[int, tuple[int, bytes]] = {}  # fragment -> (version, safetensors bytes)
        self.refused_calls: dict[str, int] = {}
        # island -> its report at leaving; kept beside the checkpoints so a restarted syncer knows who left
        self.left: dict[int, dict[str, Any]] = self._load_left()
        self.spent_at: float | None = None
        self.done = threading.Event()
        self.final: dict[str, Any] | None = None
        self.written_status = ""
        self.max_upload = 4 * max(self.service.syncer.numels) + (1 << 16)  # float32 + the safetensors header

    # --- authentication -----------------------------------------------------------------------------------
    def _caller(self, context: grpc.ServicerContext) -> tuple[int, str]:
        """The calling island and its secret, or abort the call (UNAUTHENTICATED), counted by reason."""
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        island, credential = md.get(wire.ISLAND_KEY), md.get(wire.CREDENTIAL_KEY)
        if island is None or credential is None:
            reason = "no_credential"
        elif not (island.isdigit() and is_index(int(island), self.config.islands)):
            reason = "island"
        elif not self.service.syncer.admission.identity(int(island), credential):
            reason = "identity"
        else:
            return int(island), credential
        with self.lock:
            self.refused_calls[reason] = self.refused_calls.get(reason, 0) + 1
        log.warning("refused a call from %s: %s (island %r)", context.peer(), reason, island)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"refused: {reason}")
        raise AssertionError("unreachable")  # abort raises

    @staticmethod
    def _request(data: bytes, context: grpc.ServicerContext) -> dict[str, Any]:
        try:
            return wire.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a JSON object ({e})"[:200])
            raise AssertionError("unreachable") from None

    # --- control ------------------------------------------------------------------------------------------
    def Join(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802 - gRPC method names
        island, credential = self._caller(context)
        req = self._request(data, context)
        numels = self.service.syncer.numels
        if req.get("numels") != numels:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"model: this island's fragments hold {req.get('numels')} parameters, the syncer's {numels}; "
                          "give the island the syncer's --model, --fragments and --seed")
        with self.lock:
            _, versions, steps, session = self.service.join(island, credential)
            self.left.pop(island, None)
            self._save_left()
        return wire.dumps({"versions": versions, "steps": steps, "session": session})

    def ReserveSteps(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        island, credential = self._caller(context)
        n = self._request(data, context).get("n", 1)
        if not (is_index(n, 1 << 20) and n > 0):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "n: a positive int")
        granted, buffered = 0, []
        with self.lock:
            for _ in range(n):
                go, buffered = self.service.reserve_step(island, credential)
                if not go:
                    break
                granted += 1
        return wire.dumps({"granted": granted, "buffered": buffered})

    def Buffered(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        island, _ = self._caller(context)
        with self.lock:
            return wire.dumps({"buffered": self.service.buffered(island)})

    def Heartbeat(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        island, _ = self._caller(context)
        with self.lock:
            progress = self.service.heartbeat(island)
        return wire.dumps({**progress, "spent": self.service.reserved >= self.service.budget})

    def PullMeta(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        self._caller(context)
        fragment = self._request(data, context).get("fragment")
        version, payload = self._pull(fragment, context)
        return wire.dumps({"version": version, "size": len(payload)})

    def UploadStatus(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        island, _ = self._caller(context)
        upload = str(self._request(data, context).get("upload"))
        with self.lock:
            buf = self.uploads[island].get(upload)
            done = upload in self.answers[island]
        return wire.dumps({"received": len(buf) if buf is not None else 0, "done": done})

    def Push(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        """Commit an uploaded push: decode its tensor, hand it to the syncer; answer (accepted, the version to pull)."""
        island, credential = self._caller(context)
        req = self._request(data, context)
        upload = str(req.get("upload"))
        with self.lock:
            if upload in self.answers[island]:  # a retry whose first reply was lost: the same answer
                return wire.dumps(self.answers[island][upload])
            buf = self.uploads[island].pop(upload, None)
        if buf is None or len(buf) != req.get("size"):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "upload: incomplete or unknown; upload it again")
        try:
            delta: Any = wire.bytes_tensor(bytes(buf))
        except ValueError:
            delta = None  # refused by the syncer's own check (type), and counted there
        round_s = req.get("round_s")
        msg = Push(island, req.get("fragment"), delta, req.get("tokens"), req.get("base_version"),
                   nbytes=req.get("nbytes", 0) if is_index(req.get("nbytes", 0), math.inf) else 0,
                   round_s=float(round_s) if isinstance(round_s, int | float) and math.isfinite(round_s) else None,
                   session=req.get("session"), credential=credential)
        with self.lock:
            accepted, pull = self.service.push(msg)
            answer = {"accepted": accepted, "answered": pull is not None,
                      "version": pull.version if pull is not None else None}
            self.answers[island][upload] = answer
            while len(self.answers[island]) > ANSWERS:
                self.answers[island].popitem(last=False)
        return wire.dumps(answer)

    def Leave(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        island, _ = self._caller(context)
        report = self._request(data, context)
        keep = ("steps", "compute_s", "bytes_sent", "last_loss", "codec_s", "resets", "skipped_steps")
        with self.lock:
            self.left[island] = {k: report[k] for k in keep if isinstance(report.get(k), int | float)}
            self._save_left()
        return wire.dumps({"ok": True})

    def _load_left(self) -> dict[int, dict[str, Any]]:
        try:
            saved = wire.loads((self.out / "service" / "left.json").read_bytes())
        except (OSError, ValueError):
            return {}
        return {int(k): v for k, v in saved.items() if str(k).isdigit() and isinstance(v, dict)}

    def _save_left(self) -> None:
        from atoll.job.checkpoint import write_text_atomic

        write_text_atomic(self.out / "service" / "left.json",
                          wire.dumps({str(k): v for k, v in self.left.items()}).decode())

    @property
    def joined(self) -> set[int]:
        """Islands that joined the run (in the syncer's checkpoint: a restarted syncer waits for them too)."""
        return {i for i, n in enumerate(self.service.joins) if n > 0}

    # --- bulk ---------------------------------------------------------------------------------------------
    def Upload(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:  # noqa: N802
        """A push's tensor bytes: a JSON header ``{"upload", "offset"}``, then raw chunks appended at ``offset``."""
        island, _ = self._caller(context)
        header = self._request(next(requests, b""), context)
        upload, offset = str(header.get("upload")), header.get("offset", 0)
        with self.lock:
            uploads = self.uploads[island]
            buf = uploads.setdefault(upload, bytearray())
            uploads.move_to_end(upload)
            while len(uploads) > OPEN_UPLOADS:
                uploads.popitem(last=False)
        if not (is_index(offset, len(buf) + 1)):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"offset: {offset!r}, the syncer holds {len(buf)} bytes")
        del buf[offset:]
        for chunk in requests:
            if len(buf) + len(chunk) > self.max_upload:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"upload: over {self.max_upload} bytes")
            buf += chunk
        return wire.dumps({"received": len(buf)})

    def Download(self, data: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        """A global fragment: a JSON header ``{"version", "size", "offset"}``, then its safetensors bytes from
        ``offset`` (from 0 when the version asked for is no longer the newest)."""
        self._caller(context)
        req = self._request(data, context)
        version, payload = self._pull(req.get("fragment"), context)
        offset = req.get("offset", 0)
        if req.get("version") != version or not is_index(offset, len(payload) + 1):
            offset = 0
        yield wire.dumps({"version": version, "size": len(payload), "offset": offset})
        yield from wire.chunks(payload, offset)

    def _pull(self, fragment: Any, context: grpc.ServicerContext) -> tuple[int, bytes]:
        if not is_index(fragment, self.service.syncer.fragments):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"fragment: {fragment!r} is not one of the run's")
        with self.lock:
            cached = self.pulls.get(fragment)
            if cached is not None and cached[0] == self.service.syncer.version(fragment):
                return cached
            pull = self.service.pull(fragment)  # a copy: serialized below, outside the lock
        cached = (pull.version, wire.tensor_bytes(pull.params))
        with self.lock:
            self.pulls[fragment] = cached
        return cached

    # --- the run ------------------------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        """The service's generic handler: raw bytes in and out (no protobuf, no pickle)."""
        methods = {name: grpc.unary_unary_rpc_method_handler(getattr(self, name)) for name in wire.CONTROL}
        methods["Upload"] = grpc.stream_unary_rpc_method_handler(self.Upload)
        methods["Download"] = grpc.unary_stream_rpc_method_handler(self.Download)
        return grpc.method_handlers_generic_handler(wire.SERVICE, methods)

    def status(self) -> dict[str, Any]:
        """What ``<out>/service/status.json`` holds."""
        s = self.service
        return {"commits": s.syncer.commits, "versions": [s.syncer.version(p) for p in range(s.syncer.fragments)],
                "reserved": s.reserved, "budget": s.budget, "restarts": s.restarts,
                "steps_by_island": list(s.steps_by_island),
                "merged_tokens_by_island": list(s.syncer.tokens_by_outcome["merged"]),
                "refused_calls": dict(self.refused_calls), "rejected_updates": s.syncer.rejected_updates,
                "rejected_by_reason": dict(s.syncer.rejected_by_reason), "joined": sorted(self.joined),
                "left": sorted(self.left), "done": self.done.is_set()}

    def tick(self) -> None:
        """Close due grace windows, write the status, and end the run when it is over (the poll thread's step)."""
        from atoll.job.checkpoint import write_text_atomic

        with self.lock:
            self.service.progress()  # polls: closes due grace windows (and checkpoints a commit)
            now = time.monotonic()
            if self.spent_at is None and self.service.reserved >= self.service.budget:
                self.spent_at = now
            over = self.spent_at is not None and (
                (self.joined and self.joined <= set(self.left))
                or now - self.spent_at > self.config.collective_timeout_s)
            if over and self.final is None:
                self.final = self.service.finish()
                self.done.set()
            status = wire.dumps(self.status()).decode()
        if status != self.written_status:  # written when it changed, not ten times a second
            write_text_atomic(self.out / "service" / "status.json", status)
            self.written_status = status


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
