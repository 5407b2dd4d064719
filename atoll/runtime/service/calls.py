"""The gate of ``atoll syncer``'s calls: who calls (an island's identity, a shard's peer credential), what it
asks (its request parsed by the schema), and every refusal, counted by reason and logged at a bounded rate.

Every handler of :class:`~atoll.runtime.service.server.SyncerServer` and of its collaborators (the shards'
calls, :mod:`~atoll.runtime.service.shards`; the tensors', :mod:`~atoll.runtime.service.bulk`) refuses through
one :class:`Gate`, so ``refused_calls`` in the status counts every refusal of the server (a transfer its
island cut, an upload stream that ended early or before its header, is no refusal), and a flood of bad calls
makes a few log lines, not one per call. Every handler also runs inside :meth:`Gate.guarded`: an
exception a handler did not mean (a bug, or an input no check foresaw) is counted by its kind
(``handler_errors`` in the status), logged at the same bounded rate, and answered INTERNAL naming only its
kind (gRPC's own logger, which has a NullHandler, would drop it).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from atoll.runtime.service import schema, wire
from atoll.strategies.decoupled.protocol import is_index

log = logging.getLogger("atoll.syncer")

#: seconds between two log lines of refusals of one reason (the ones between are counted in the next line)
LOG_EVERY_S = 10.0

R = TypeVar("R", bound=schema.Record)


class Gate:
    """Authentication, parsing and refusal of calls (see the module docstring).

    Args:
        islands: the run's islands (K): an island index is ``0..K-1``.
        identity: ``(island, credential) -> bool``, the syncer's admission check (constant time).
        peer_token: the peer credential of a shard of this syncer (None: unsharded, no peer calls).
        lock: the server's lock (the counts are read in its status under it).

    Attributes:
        refused: calls refused, by reason (``no_credential``, ``island``, ``identity``, ``peer``, ``shard``,
            ``schema``; the bulk calls' ``transfers``, ``busy``, ``empty_chunk``, ``commit``, ``stalled``,
            ``quota``; the step leases' ``used``, ``lease``).
        errors: handler exceptions no check foresaw, by kind (the exception's class name).
    """

    def __init__(self, islands: int, identity: Callable[[int, str], bool], peer_token: str | None,
                 lock: threading.Lock) -> None:
        self.islands, self.identity, self.peer_token, self.lock = islands, identity, peer_token, lock
        self.refused: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self._log_lock = threading.Lock()
        self._logged_at: dict[str, float] = {}  # reason -> monotonic time of its last log line
        self._quiet: dict[str, int] = {}  # reason -> refusals not logged since that line

    def refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, reason: str, message: str) -> NoReturn:
        """Count a refusal of ``reason``, log it (at most one line per reason per :data:`LOG_EVERY_S`), and
        abort the call with ``code`` and ``message`` (one line)."""
        with self.lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        self._log(reason, f"refused a call from {context.peer()}: {_named(reason, message)}")
        context.abort(code, message)
        raise AssertionError("unreachable")  # abort raises

    def note(self, reason: str, peer: str, message: str) -> None:
        """Count a refusal of ``reason`` that ends no call here (a stalled transfer cut, an upload evicted over
        its island's quota, a step lease answered "ask again") and log it at the bounded rate of
        :meth:`refuse`. Not under the server's lock."""
        with self.lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        self._log(reason, f"refused a call of {peer}: {_named(reason, message)}")

    def guarded(self, method: str, handle: Callable[..., Any], streaming: bool = False) -> Callable[..., Any]:
        """``handle`` (a gRPC handler: ``(request, context)``; ``streaming``: it returns an iterator of replies)
        with its unforeseen exceptions counted in :attr:`errors` by kind, logged at the bounded rate, and
        answered INTERNAL naming the kind only (no server path or Python text travels). A refusal (the call's
        ``abort``) and a call its client ended go on as they are."""

        def unforeseen(e: Exception, context: grpc.ServicerContext) -> bool:
            if context.code() is not None or not context.is_active():  # aborted on purpose, or the client left
                return False
            kind = type(e).__name__
            with self.lock:
                self.errors[kind] = self.errors.get(kind, 0) + 1
            self._log(f"error:{kind}", f"{method}: the handler failed on a call from {context.peer()}: {kind}: {e}")
            return True

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return handle(request, context)
            except Exception as e:
                if unforeseen(e, context):
                    context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error ({type(e).__name__})")
                raise

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from handle(request, context)
            except Exception as e:
                if unforeseen(e, context):
                    context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error ({type(e).__name__})")
                raise

        return stream if streaming else unary

    def _log(self, reason: str, line: str) -> None:
        now = time.monotonic()
        with self._log_lock:
            last = self._logged_at.get(reason)
            if last is not None and now - last < LOG_EVERY_S:
                self._quiet[reason] = self._quiet.get(reason, 0) + 1
                return
            self._logged_at[reason], quiet = now, self._quiet.pop(reason, 0)
        more = f" (and {quiet} more of {reason} since the last line)" if quiet else ""
        log.warning("atoll syncer: %s%s", line[:300], more)

    def caller(self, context: grpc.ServicerContext, peer: bool = False) -> tuple[int, str]:
        """The calling island and its secret, or refuse the call (UNAUTHENTICATED), counted by reason; ``peer``:
        another shard of this syncer may call too (answered as island -1, after its peer credential)."""
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        island, credential = md.get(wire.ISLAND_KEY), md.get(wire.CREDENTIAL_KEY)
        if wire.PEER_KEY in md:
            if peer:
                return self.peer(context)
            reason = "peer"  # a shard's credential opens only what shards call of each other
        elif island is None or credential is None:
            reason = "no_credential"
        elif not (island.isascii() and island.isdigit() and len(island) <= 8 and is_index(int(island), self.islands)):
            reason = "island"
        elif not self.identity(int(island), credential):
            reason = "identity"
        else:
            return int(island), credential
        self.refuse(context, grpc.StatusCode.UNAUTHENTICATED, reason, f"refused: {reason}")

    def peer(self, context: grpc.ServicerContext) -> tuple[int, str]:
        """Another shard of this syncer (the coordinator gathering the model), proven by the peer credential
        derived from the run's key (:func:`~atoll.runtime.service.syncer_shards.peer_token`): (-1, ""); else
        refuse (UNAUTHENTICATED) and count ``peer``: an island, or a shard of another run."""
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        credential = md.get(wire.CREDENTIAL_KEY)
        if self.peer_token is not None and wire.PEER_KEY in md and isinstance(credential, str) and \
                hmac.compare_digest(credential.encode(), self.peer_token.encode()):
            return -1, ""
        self.refuse(context, grpc.StatusCode.UNAUTHENTICATED, "peer", "refused: peer")

    def parse(self, model: type[R], data: bytes, context: grpc.ServicerContext, method: str) -> R:
        """``method``'s request ``model`` of ``data`` (:func:`~atoll.runtime.service.schema.parse`); else refuse
        the call (INVALID_ARGUMENT, naming the field) and count it as ``schema``."""
        try:
            return schema.parse(model, data)
        except schema.SchemaError as e:
            self.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "schema", f"{method}: {e}")


def _named(reason: str, message: str) -> str:
    """A refusal's log text: ``message`` led by its ``reason``, once (a message that names it first as it is)."""
    return message if message.startswith(f"{reason}:") else f"{reason}: {message}"
