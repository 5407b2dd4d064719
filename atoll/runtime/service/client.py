"""An island's side of ``atoll syncer``: a gRPC client that retries with backoff.

:class:`SyncerClient` opens up to two connections to the syncer: **control** (small JSON calls: join, step
leases, heartbeats, buffer and pull metadata, the commit of a push; only an island's leader, its rank 0,
opens it) and **bulk** (tensor bytes; every rank of an island opens its own, and moves its own slice of a
fragment over it), so a heartbeat is never queued behind a transfer. A call that finds the syncer down
(UNAVAILABLE, a deadline) is retried with exponential backoff (0.1 s doubling to 5 s) until ``give_up_s``
have passed without an answer; a transfer that breaks resumes at the offset the syncer holds
(``UploadStatus``, ``Download`` from an offset), so a failed chunk is sent again, not the whole fragment. A
refused credential is an error at once. Every control call carries the island's session (its ``Join``'s
answer): one the syncer refuses as superseded (a newer job of the same island index joined) stops the job with
one line (:class:`SessionSuperseded`, exit status 2).

:class:`~atoll.runtime.service.lease.StepLease` is how the leader takes inner steps from the run's shared
budget; the island's transport, which runs the exchanges of a fragment's slices, is
:class:`~atoll.runtime.service.exchange.ServiceTransport`.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import torch

from atoll.errors import AtollError, ConfigError
from atoll.runtime.service import flow, schema, wire
from atoll.runtime.service.slices import Ranges

T = TypeVar("T")

#: gRPC codes after which a call is retried (the syncer down, restarting, or the link broken)
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class SyncerUnreachable(AtollError):
    """The syncer gave no answer for ``give_up_s`` seconds."""


class SessionSuperseded(ConfigError):
    """The syncer refused a call of this island's session: a newer join of the same island index superseded it
    (another job started with this ``--island``): this job stops (one line, exit status 2)."""


class UploadLost(Exception):
    """The syncer no longer holds a push's uploaded slices (it restarted between the upload and the commit)."""


class SyncerClient:
    """The calls of one island to ``atoll syncer`` at ``address``.

    Args:
        address: ``HOST:PORT`` of the syncer.
        island, credential: this island's index and secret (sent as call metadata on every call).
        root_certificates: PEM of the CA (or self-signed certificate) to trust; None: the system's roots.
        plaintext: no TLS (refused for a non-loopback address unless ``insecure``).
        give_up_s: seconds without any answer after which a call raises :class:`SyncerUnreachable`.
        server_name: the name the syncer's certificate must carry, when it differs from the address's host.
        control: open the control connection (an island's leader); False: bulk only (its other ranks).
        window: bytes of HTTP/2 receive window each transfer on the bulk connection starts with
            (:func:`~atoll.runtime.service.flow.bulk_options`, ``bulk_window_mib``); None: gRPC's default (64 KiB).

    Attributes:
        bytes_up, bytes_down: safetensors bytes this process sent and received over its bulk connection.
        grant: the newest grant a sharded syncer's coordinator answered with (its ``Join``, ``ReserveSteps``,
            ``Leave``; :class:`~atoll.runtime.service.syncer_shards.Grant`, as JSON); None: none yet (or
            an unsharded syncer).
        grant_source: (a client of a shard other than the coordinator) the coordinator's client, whose newest
            ``grant`` every commit here carries; None: none (the coordinator, or an unsharded syncer).

    Raises:
        ConfigError: a bad address, or plaintext to another host without ``insecure``.
    """

    def __init__(self, address: str, island: int, credential: str, root_certificates: bytes | None = None,
                 plaintext: bool = False, insecure: bool = False, give_up_s: float = 600.0,
                 server_name: str | None = None, control: bool = True, window: int | None = None) -> None:
        try:
            host, _ = wire.parse_address(address, "syncer")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if plaintext and not wire.is_loopback(host) and not insecure:
            raise ConfigError(f"syncer: '{address}' is another host and no TLS is set; pass --tls-ca (or trust the "
                              "system's CAs), or --insecure to send plaintext anyway")
        self.address, self.island, self.give_up_s = address, island, give_up_s
        self.plaintext, self.server_name = plaintext, server_name
        #: seconds between the lines saying that calls wait for an unreachable syncer (the first after 10 s)
        self.waiting_every_s = 20.0
        self.metadata = ((wire.ISLAND_KEY, str(island)), (wire.CREDENTIAL_KEY, credential))
        self.retries = 0
        self.bytes_up = self.bytes_down = 0
        self.grant: dict[str, Any] | None = None
        self.grant_source: SyncerClient | None = None
        self._grant_lock = threading.Lock()
        self.session: int | None = None  # the island's session (its Join's answer): every control call carries it
        self.superseded: str | None = None  # the syncer's line refusing a call of a superseded session
        options = [("grpc.use_local_subchannel_pool", 1),  # control and bulk: two connections, not one shared
                   ("grpc.max_receive_message_length", 2 * wire.CHUNK_BYTES + (1 << 16)),
                   # gRPC's own reconnect backoff grows to 120 s by default: a syncer back after an outage would
                   # wait that long to be seen; ours (the calls' backoff, to 5 s) is the one that counts
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))

        def channel(kind: str) -> grpc.Channel:
            opts = [*options, ("atoll.connection", kind)]
            if kind == "bulk" and window is not None:
                opts += flow.bulk_options(window)
            if plaintext:
                return grpc.insecure_channel(address, options=opts)
            return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates), options=opts)

        self.control = channel("control") if control else None
        self.bulk = channel("bulk")

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        self.bulk.close()

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        """``attempt()`` until it answers; retried with backoff on a lost syncer, up to ``give_up_s``.

        A failure is looked up in :mod:`~atoll.runtime.service.diagnose`'s table: a mistake of the transport's
        settings (server name, CA, expired certificate, TLS to plaintext or plaintext to TLS) is a ConfigError at
        once; a text that names no cause is settled by asking the port (its second time in a row); while the
        syncer does not answer, a line on stderr says so (after 10 s, then every ``waiting_every_s``).

        Raises:
            ConfigError: a refused credential, another model or shard, or a transport mistake (one line).
            SyncerUnreachable: no answer for ``give_up_s``.
        """
        from atoll.runtime.service import diagnose

        start = time.monotonic()
        deadline, delay, last, unnamed = start + self.give_up_s, 0.1, "", 0
        said_at = start - self.waiting_every_s + 10.0  # the first waiting line 10 s after the first failure
        while True:
            try:
                return attempt()
            except grpc.RpcError as e:
                code = e.code() if isinstance(e, grpc.Call) else None
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise ConfigError(f"credential: the syncer refused island {self.island}'s call ({e.details()}); "
                                      "pass this island's own --credential and --island") from None
                if code == grpc.StatusCode.FAILED_PRECONDITION and what in ("Join", "Hello"):
                    raise ConfigError(e.details()) from None  # another model, map or shard: one line
                if code == grpc.StatusCode.PERMISSION_DENIED:  # a fragment sent to a shard that does not own it
                    raise ConfigError(e.details()) from None
                if code == grpc.StatusCode.ABORTED:  # a newer job of this island joined: this one stops
                    raise SessionSuperseded(e.details()) from None
                if code not in RETRY:
                    raise
                last = (e.details() or str(code))[:300]
                found = diagnose.classify(last)
                unnamed = unnamed + 1 if found is None else 0
                if found is None and unnamed % 5 == 2:  # "Socket closed", a handshake cut short: ask the port
                    kind = diagnose.cross_check(self.address, self.plaintext)
                    found = (kind, True) if kind is not None else None
                if found is not None and found[1]:
                    raise ConfigError(diagnose.explain(found[0], self.address, last, self.server_name).line) from None
            now = time.monotonic()
            if now > deadline:
                raise SyncerUnreachable(f"syncer: no answer from '{self.address}' to {what} for {self.give_up_s:g} s "
                                        f"({last}); check that atoll syncer runs there and the TLS settings")
            if now - said_at >= self.waiting_every_s:
                said_at = now
                print(f"atoll: waiting for the syncer at '{self.address}' ({what}: "
                      f"{last.split('last error: ')[-1][:160]}) for {now - start:.0f} s; retrying until "
                      f"--give-up-s {self.give_up_s:g}", file=sys.stderr, flush=True)
            self.retries += 1
            time.sleep(delay)
            delay = min(2 * delay, 5.0)

    def probe(self, timeout_s: float = 5.0) -> None:
        """Check this client's connection (bulk) before any work: a call of a method no syncer serves, whose
        answer (UNIMPLEMENTED) proves that the transport works; retried as :meth:`_retrying` does.

        Raises:
            ConfigError: a transport mistake (one line naming the cause and the fix).
            SyncerUnreachable: no answer for ``give_up_s``.
        """
        stub = self.bulk.unary_unary(wire.method("Probe"))

        def attempt() -> None:
            try:
                stub(b"", timeout=timeout_s)  # no credential: the transport is not checked yet
            except grpc.RpcError as e:
                if isinstance(e, grpc.Call) and e.code() in RETRY:
                    raise
            # any answer of a gRPC server (UNIMPLEMENTED) is one

        self._retrying("connect", attempt)

    def call(self, name: str, payload: schema.Record | dict[str, Any] | None = None, timeout_s: float = 30.0,
             retry: bool = True, bulk: bool = False) -> dict[str, Any]:
        """A control call: its request ``payload``, the method's record of the service's schema
        (:data:`~atoll.runtime.service.schema.REQUESTS`), or a JSON object as it is (a test's malformed
        request); its reply as a JSON object. ``bulk``: over the bulk connection, a transfer's own calls;
        ``retry=False``: one attempt (grpc.RpcError when it fails). A request record with a ``session`` field left
        unset carries this client's :attr:`session` (from its ``Join``); a ``Join``'s answer sets it.

        Raises:
            RuntimeError: a control call of a client without the control connection (not the leader).
            TypeError: ``payload`` is a record of another method's request.
        """
        channel = self.bulk if bulk else self.control
        if channel is None:
            raise RuntimeError(f"{name}: only an island's leader (rank 0) calls the syncer's control methods")
        if isinstance(payload, schema.Record) and type(payload) is not schema.REQUESTS[name]:
            raise TypeError(f"{name}: its request is a {schema.REQUESTS[name].__name__}, not a "
                            f"{type(payload).__name__}")
        if isinstance(payload, schema.Record) and "session" in type(payload).model_fields and \
                "session" not in payload.model_fields_set and self.session is not None:
            payload = type(payload)(**payload.model_dump(exclude_unset=True), session=self.session)
        data = schema.encode(payload) if isinstance(payload, schema.Record) else wire.dumps(payload or {})
        stub = channel.unary_unary(wire.method(name))

        def attempt() -> dict[str, Any]:
            try:
                reply = _reply(name, stub(data, metadata=self.metadata, timeout=timeout_s))
            except grpc.RpcError as e:
                if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.ABORTED:
                    self.superseded = e.details()  # (a heartbeat's: the lease's next step stops the job)
                raise
            if isinstance(reply.get("grant"), dict):
                self._keep_grant(reply["grant"])
            if name == "Join":
                self.session = int(reply["session"])
            return reply

        return self._retrying(name, attempt) if retry else attempt()

    def _keep_grant(self, grant: dict[str, Any]) -> None:
        """Keep ``grant`` if it is newer than the one held (replies of calls in flight may cross)."""
        def order(g: dict[str, Any]) -> tuple[Any, ...]:
            return g.get("session", 0), g.get("epoch", 0), g.get("seq", 0)

        with self._grant_lock:
            if self.grant is None or order(grant) > order(self.grant):
                self.grant = grant

    def upload(self, data: wire.Sendable, fragment: int, ranges: Ranges, upload: str | None = None) -> str:
        """Send a slice's payload ``data`` (the values of ``fragment`` at ``ranges`` of its element order) to the
        syncer in chunks, resuming at the offset it holds after a failure; return the upload's id (``upload``,
        or a fresh one)."""
        upload = upload or uuid.uuid4().hex
        self._send(data, fragment, ranges, upload, None)
        return upload

    def upload_commit(self, data: wire.Sendable, fragment: int, ranges: Ranges, upload: str,
                      request: schema.PushRequest) -> dict[str, Any] | None:
        """Send a slice as :meth:`upload` does, carrying the commit of the push ``request`` (whose ``slices`` name
        ``upload`` and the island's other ranks' uploads): the syncer commits it once it holds every slice, and
        the answer comes back with the upload's reply, one round trip sooner than :meth:`commit` after it. None:
        the other slices did not arrive while the syncer waited; commit with :meth:`commit`.

        Raises:
            UploadLost: the syncer does not hold every slice (it restarted since): upload them again.
        """
        try:
            return self._send(data, fragment, ranges, upload, request).get("push")
        except grpc.RpcError as e:
            if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise UploadLost(e.details()) from None
            raise

    def _send(self, data: wire.Sendable, fragment: int, ranges: Ranges, upload: str,
              commit: schema.PushRequest | None) -> dict[str, Any]:
        """The ``Upload`` of a slice (with ``commit``: carrying it), retried from the offset the syncer holds; the
        reply."""
        stub, first = self.bulk.stream_unary(wire.method("Upload")), True

        def attempt() -> dict[str, Any]:
            nonlocal first
            # a retry continues where the syncer's copy ends (0 if the syncer restarted and lost it)
            offset = 0 if first else self.call("UploadStatus", schema.UploadStatusRequest(upload=upload),
                                               bulk=True)["received"]
            first = False
            header = schema.UploadHeader(upload=upload, fragment=fragment, ranges=ranges, size=len(data),
                                         offset=offset, commit=commit)
            messages = itertools.chain((schema.encode(header),), wire.iter_chunks(data, offset))
            reply = _reply("Upload", stub(messages, metadata=self.metadata, timeout=600.0))
            self.bytes_up += len(data) - offset
            if reply["received"] != len(data):
                raise RuntimeError(f"upload: the syncer holds {reply['received']} of {len(data)} bytes")
            return reply

        return self._retrying("Upload", attempt)

    def download(self, fragment: int, ranges: Ranges | None = None) -> tuple[int, torch.Tensor]:
        """The newest global fragment's values at ``ranges`` of its element order (None: all of it): (its
        version, float32 (values,)), resumed from its offset after a failure."""
        version, _, got = self.download_bytes(fragment, ranges)
        return version, wire.bytes_tensor(got)  # (a view of the bytes received: no copy)

    def download_bytes(self, fragment: int, ranges: Ranges | None = None,
                       have: int | None = None) -> tuple[int, int | None, bytearray]:
        """The bytes of ``Download``: (version, since, safetensors bytes) of the newest global fragment at
        ``ranges`` (None: all of it), or with a ``pull_codec`` other than fp32 of its pull for an island at
        version ``have`` (``since`` not None: the pull codec's payloads of the versions since; None: float32
        values), resumed from its offset after a failure (in the same answer only: version, since and the
        syncer's epoch, its restarts)."""
        stub = self.bulk.unary_stream(wire.method("Download"))
        got, version, since, epoch = bytearray(), None, None, None

        def attempt() -> None:
            nonlocal version, since, epoch
            request = schema.DownloadRequest(fragment=fragment, ranges=ranges, version=version, offset=len(got),
                                             have=have, since=since, epoch=epoch)
            replies: Iterator[bytes] = stub(schema.encode(request), metadata=self.metadata, timeout=600.0)
            header = _reply("Download", next(replies))
            answer = (header["version"], header.get("since"), header.get("epoch"))
            if answer != (version, since, epoch) or header["offset"] != len(got):
                version, since, epoch = answer  # another answer: from the start
                del got[:]
            for chunk in replies:
                got.extend(chunk)
                self.bytes_down += len(chunk)
            if len(got) != header["size"]:
                raise RuntimeError(f"download: {len(got)} of {header['size']} bytes")

        self._retrying("Download", attempt)
        return int(version), since, got

    def push_request(self, uploads: list[str], fragment: int, tokens: int, base_version: int, session: int,
                     round_s: float | None = None, grant: dict[str, Any] | None = None) -> schema.PushRequest:
        """The commit of a push whose slices are ``uploads``; with ``grant`` (default: ``grant_source``'s newest,
        asked now: the lease that granted the push's tokens was fetched before it), for a shard of a sharded
        syncer other than the coordinator."""
        if grant is None and self.grant_source is not None:
            grant = self.grant_source.grant
        return schema.PushRequest(slices=uploads, fragment=fragment, tokens=tokens, base_version=base_version,
                                  round_s=round_s, session=session, **({"grant": grant} if grant is not None else {}))

    def commit(self, uploads: list[str], fragment: int, tokens: int, base_version: int, session: int,
               round_s: float | None = None, grant: dict[str, Any] | None = None) -> dict[str, Any]:
        """Commit a push whose slices are ``uploads`` (:meth:`push_request`'s arguments): the syncer's answer
        ``{"accepted", "answered", "version"}``.

        Raises:
            UploadLost: the syncer does not hold every upload (it restarted since): upload them again.
        """
        request = self.push_request(uploads, fragment, tokens, base_version, session, round_s, grant)
        try:
            return self.call("Push", request)
        except grpc.RpcError as e:
            if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise UploadLost(e.details()) from None
            raise

    def push(self, payload: wire.Sendable, fragment: int, ranges: Ranges, tokens: int, base_version: int, session: int,
             round_s: float | None = None, grant: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upload one slice that is the whole push (``ranges``: all of the fragment), carrying its commit (with
        ``grant``, as :meth:`commit`); uploaded again when the syncer lost it (a restart between the two), up to
        three times."""
        for _ in range(3):
            upload = uuid.uuid4().hex
            request = self.push_request([upload], fragment, tokens, base_version, session, round_s, grant)
            try:
                answer = self.upload_commit(payload, fragment, ranges, upload, request)
                return answer if answer is not None else self.commit([upload], fragment, tokens, base_version,
                                                                     session, round_s, grant)
            except UploadLost:
                continue
        raise SyncerUnreachable(f"syncer: '{self.address}' lost this island's upload three times; check its log")


def _reply(name: str, data: bytes) -> dict[str, Any]:
    """Method ``name``'s reply ``data`` as a JSON object, checked against its record
    (:data:`~atoll.runtime.service.schema.REPLIES`).

    Raises:
        RuntimeError: the reply is not its method's record (a syncer of another version, or no syncer): one line.
    """
    try:
        schema.parse(schema.REPLIES[name], data)
    except schema.SchemaError as e:
        raise RuntimeError(f"syncer: its reply to {name} is not a {schema.REPLIES[name].__name__} ({e}); run the "
                           "same atoll on the syncer and the islands") from None
    return wire.loads(data)
