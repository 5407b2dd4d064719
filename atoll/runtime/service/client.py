"""An island's side of ``atoll syncer``: a gRPC client that retries with backoff, and the island's transport.

:class:`SyncerClient` opens two connections to the syncer: **control** (small JSON calls: join, step grants,
heartbeats, buffer and pull metadata, the commit of a push) and **bulk** (tensor bytes), so a heartbeat is
never queued behind a transfer. A call that finds the syncer down (UNAVAILABLE, a deadline) is retried with
exponential backoff (0.1 s doubling to 5 s) until ``give_up_s`` have passed without an answer; a transfer
that breaks resumes at the offset the syncer holds (``UploadStatus``, ``Download`` from an offset), so a failed
chunk is sent again, not the whole fragment. A refused credential is an error at once.

:class:`ServiceTransport` is the :class:`~atoll.strategies.decoupled.island.Transport` of
:meth:`IslandWorker.run <atoll.strategies.decoupled.island.IslandWorker.run>`: each exchange (push, wait for
its merge, pull) runs in a thread, and while the syncer is down the island keeps training on credit for up
to one round (its H) of inner steps, granted when the syncer is back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

from atoll.errors import AtollError, ConfigError
from atoll.runtime.service import wire
from atoll.strategies.decoupled.protocol import Pull, Push

T = TypeVar("T")

#: gRPC codes after which a call is retried (the syncer down, restarting, or the link broken)
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class SyncerUnreachable(AtollError):
    """The syncer gave no answer for ``give_up_s`` seconds."""


class SyncerClient:
    """The calls of one island to ``atoll syncer`` at ``address``.

    Args:
        address: ``HOST:PORT`` of the syncer.
        island, credential: this island's index and secret (sent as call metadata on every call).
        root_certificates: PEM of the CA (or self-signed certificate) to trust; None: the system's roots.
        plaintext: no TLS (refused for a non-loopback address unless ``insecure``).
        give_up_s: seconds without any answer after which a call raises :class:`SyncerUnreachable`.
        server_name: the name the syncer's certificate must carry, when it differs from the address's host.

    Raises:
        ConfigError: a bad address, or plaintext to another host without ``insecure``.
    """

    def __init__(self, address: str, island: int, credential: str, root_certificates: bytes | None = None,
                 plaintext: bool = False, insecure: bool = False, give_up_s: float = 600.0,
                 server_name: str | None = None) -> None:
        try:
            host, _ = wire.parse_address(address, "syncer")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if plaintext and not wire.is_loopback(host) and not insecure:
            raise ConfigError(f"syncer: '{address}' is another host and no TLS is set; pass --tls-ca (or trust the "
                              "system's CAs), or --insecure to send plaintext anyway")
        self.address, self.island, self.give_up_s = address, island, give_up_s
        self.metadata = ((wire.ISLAND_KEY, str(island)), (wire.CREDENTIAL_KEY, credential))
        self.retries = 0
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
            if plaintext:
                return grpc.insecure_channel(address, options=opts)
            return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates), options=opts)

        self.control, self.bulk = channel("control"), channel("bulk")

    def close(self) -> None:
        self.control.close()
        self.bulk.close()

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        """``attempt()`` until it answers; retried with backoff on a lost syncer, up to ``give_up_s``."""
        deadline, delay, last, handshakes = time.monotonic() + self.give_up_s, 0.1, "", 0
        while True:
            try:
                return attempt()
            except grpc.RpcError as e:
                code = e.code() if isinstance(e, grpc.Call) else None
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise ConfigError(f"credential: the syncer refused island {self.island}'s call ({e.details()}); "
                                      "pass this island's own --credential and --island") from None
                if code == grpc.StatusCode.FAILED_PRECONDITION and what == "Join":
                    raise ConfigError(e.details()) from None
                if code not in RETRY:
                    raise
                last = (e.details() or str(code))[:300]
                handshakes = handshakes + 1 if "handshake" in last.lower() else 0
                if handshakes >= 3:  # a syncer that answers, but not in TLS this island trusts: not transient
                    raise ConfigError(f"tls-ca: the TLS handshake with the syncer at '{self.address}' failed 3 times "
                                      f"({last.split(': ')[-1][:120]}); pass the CA that signed its certificate with "
                                      "--tls-ca, --tls-server-name, or --plaintext if it serves plaintext") from None
            if time.monotonic() > deadline:
                raise SyncerUnreachable(f"syncer: no answer from '{self.address}' to {what} for {self.give_up_s:g} s "
                                        f"({last}); check that atoll syncer runs there and the TLS settings")
            self.retries += 1
            time.sleep(delay)
            delay = min(2 * delay, 5.0)

    def call(self, name: str, payload: dict[str, Any] | None = None, timeout_s: float = 30.0,
             retry: bool = True) -> dict[str, Any]:
        """A control call (JSON in and out); ``retry=False``: one attempt (grpc.RpcError when it fails)."""
        stub = self.control.unary_unary(wire.method(name))

        def attempt() -> dict[str, Any]:
            return wire.loads(stub(wire.dumps(payload or {}), metadata=self.metadata, timeout=timeout_s))

        return self._retrying(name, attempt) if retry else attempt()

    def upload(self, data: bytes) -> str:
        """Send ``data`` to the syncer in chunks, resuming at the offset it holds after a failure; return its id."""
        upload, first = uuid.uuid4().hex, True
        stub = self.bulk.stream_unary(wire.method("Upload"))

        def attempt() -> None:
            nonlocal first
            # a retry continues where the syncer's copy ends (0 if the syncer restarted and lost it)
            offset = 0 if first else self.call("UploadStatus", {"upload": upload})["received"]
            first = False
            messages = iter([wire.dumps({"upload": upload, "offset": offset}), *wire.chunks(data, offset)])
            received = wire.loads(stub(messages, metadata=self.metadata, timeout=600.0))["received"]
            if received != len(data):
                raise RuntimeError(f"upload: the syncer holds {received} of {len(data)} bytes")

        self._retrying("Upload", attempt)
        return upload

    def download(self, fragment: int) -> tuple[int, torch.Tensor]:
        """The newest global fragment (its version, float32 (numel_p,)), resumed from its offset after a failure."""
        stub = self.bulk.unary_stream(wire.method("Download"))
        got, version = bytearray(), None

        def attempt() -> None:
            nonlocal version
            replies: Iterator[bytes] = stub(wire.dumps({"fragment": fragment, "version": version, "offset": len(got)}),
                                            metadata=self.metadata, timeout=600.0)
            header = wire.loads(next(replies))
            if header["version"] != version or header["offset"] != len(got):  # a newer version: from the start
                version = header["version"]
                del got[:]
            for chunk in replies:
                got.extend(chunk)
            if len(got) != header["size"]:
                raise RuntimeError(f"download: {len(got)} of {header['size']} bytes")

        self._retrying("Download", attempt)
        return int(version), wire.bytes_tensor(bytes(got))  # type: ignore[arg-type]

    def push(self, push: Push, session: int) -> dict[str, Any]:
        """Upload a push's Δ and commit it: the syncer's answer ``{"accepted", "answered", "version"}``."""
        data = wire.tensor_bytes(push.delta)
        for _ in range(3):  # an upload lost by a syncer that restarted between upload and commit: again
            upload = self.upload(data)
            try:
                return self.call("Push", {"upload": upload, "size": len(data), "fragment": push.fragment,
                                          "tokens": push.tokens, "base_version": push.base_version,
                                          "nbytes": push.nbytes, "round_s": push.round_s, "session": session})
            except grpc.RpcError as e:
                if not (isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.FAILED_PRECONDITION):
                    raise
        raise SyncerUnreachable(f"syncer: '{self.address}' lost this island's upload three times; check its log")


class ServiceTransport:
    """How an island job reaches ``atoll syncer`` (:class:`~atoll.strategies.decoupled.island.Transport`).

    At most one exchange per fragment is in progress, each in a worker thread: upload and commit the push,
    then (if the push waits in the fragment's buffer for a quorum) ask every ``poll_s`` until it is merged,
    then download the global fragment, which :meth:`arrived` hands to the island. A heartbeat thread tells the
    syncer every ``heartbeat_s`` that the island lives, on the control connection.

    Args:
        client: the island's :class:`SyncerClient`.
        fragments: P; session: the island's session from its join.
        offline_steps: inner steps the island may take on credit while the syncer is unreachable.
        tokens_per_step: tokens in one inner step of the island (what a step taken on credit claims).
    """

    def __init__(self, client: SyncerClient, fragments: int, session: int, offline_steps: int,
                 tokens_per_step: int, poll_s: float = 0.02, heartbeat_s: float = 2.0) -> None:
        self.client, self.session, self.offline_steps, self.poll_s = client, session, offline_steps, poll_s
        self.tokens_per_step = tokens_per_step
        self.ungranted = [0] * fragments  # per fragment: credit steps the syncer did not grant (budget spent)
        self._credit = threading.Lock()  # owed and ungranted: the loop's reservations and the pushes' claims
        self.pool = ThreadPoolExecutor(max_workers=max(2, fragments), thread_name_prefix="exchange")
        self.pulled_at = [time.monotonic()] * fragments
        self.exchanges: dict[int, Future[Pull]] = {}
        self.owed = 0  # steps taken on credit while the syncer was unreachable
        self.bytes_sent = 0.0
        self.offline_steps_taken = 0
        self.refused = 0
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True)
        self._beat.start()

    def _heartbeat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with contextlib.suppress(grpc.RpcError):  # the syncer is down: the calls that matter retry themselves
                self.client.call("Heartbeat", timeout_s=5.0, retry=False)

    def reserve_step(self) -> bool:
        with self._credit:
            try:
                granted = self.client.call("ReserveSteps", {"n": self.owed + 1}, timeout_s=10.0,
                                           retry=False)["granted"]
            except grpc.RpcError as e:
                if not (isinstance(e, grpc.Call) and e.code() in RETRY):
                    raise
                if self.owed < self.offline_steps:  # the syncer is down: train on, on credit
                    self.owed += 1
                    self.offline_steps_taken += 1
                    return True
                granted = self.client.call("ReserveSteps", {"n": self.owed + 1})["granted"]  # wait, with backoff
            go = granted > self.owed
            self._granted_credit(min(granted, self.owed))
            return go

    def _granted_credit(self, granted: int) -> None:
        """The syncer granted ``granted`` of the ``owed`` steps taken on credit: the rest are never in a claim."""
        for p in range(len(self.ungranted)):
            self.ungranted[p] += self.owed - granted
        self.owed = 0

    def _claimable(self, push: Push) -> Push | None:
        """``push`` as it may be claimed: the steps taken on credit are reserved first (with retries), as the
        syncer refuses a claim beyond what it granted (``tokens``); steps it no longer grants (the budget was
        spent while it was unreachable) are taken out of the claim, ``tokens_per_step`` tokens each. None: no
        step of the push was granted (it is not sent; its work is lost, as the run's budget is spent)."""
        with self._credit:
            if self.owed:
                self._granted_credit(min(self.client.call("ReserveSteps", {"n": self.owed})["granted"], self.owed))
            tokens = max(0, push.tokens - self.ungranted[push.fragment] * self.tokens_per_step)
            self.ungranted[push.fragment] = 0
        return dataclasses.replace(push, tokens=tokens) if tokens > 0 else None

    def send(self, push: Push) -> None:
        self.bytes_sent += push.nbytes
        push = Push(push.island, push.fragment, push.delta, push.tokens, push.base_version, push.nbytes,
                    round_s=time.monotonic() - self.pulled_at[push.fragment])
        self.exchanges[push.fragment] = self.pool.submit(self._exchange, push)

    def _exchange(self, push: Push) -> Pull:
        claim = self._claimable(push)
        answer = self.client.push(claim, self.session) if claim is not None else {"accepted": True, "answered": True}
        if not answer["accepted"]:
            self.refused += 1
        if answer["accepted"] and not answer["answered"]:  # waits in the buffer for a quorum or its grace window
            while push.fragment in self.client.call("Buffered")["buffered"]:
                time.sleep(self.poll_s)
        version, params = self.client.download(push.fragment)
        return Pull(push.fragment, params, version)

    def _collect(self, fragments: list[int]) -> list[Pull]:
        pulls = []
        for p in fragments:
            pulls.append(self.exchanges.pop(p).result())
            self.pulled_at[p] = time.monotonic()
        return pulls

    def arrived(self) -> list[Pull]:
        return self._collect([p for p, f in self.exchanges.items() if f.done()])

    def settle(self, fragment: int) -> list[Pull]:
        return self._collect([fragment] if fragment in self.exchanges else [])

    def close(self) -> None:
        """Wait until every exchange has ended (its push merged or refused, its answer pulled)."""
        self._collect(list(self.exchanges))
        self._stop.set()
        self.pool.shutdown()
