"""A syncer sharded by fragment, on the wire: what a shard adds to ``atoll syncer``'s handlers, and how the
coordinator gathers the run at its end.

Each shard is an ``atoll syncer`` of its own fragments (:mod:`~atoll.runtime.service.syncer_shards`: the map,
the grants). :class:`ShardCalls` is the part of :class:`~atoll.runtime.service.server.SyncerServer` that knows
it is one shard of several:

- **Ownership.** A call naming a fragment another shard owns (an upload, a commit, a download) is refused
  (PERMISSION_DENIED, one line at the island) and counted in ``refused_calls`` as ``shard``; the coordinator's
  own calls (``Join``, ``ReserveSteps``, ``Heartbeat``, ``Leave``) are refused by the other shards.
- **The map, checked at the join.** An island sends the fragment -> shard map it derived from its ``--syncer``
  list to the coordinator (``Join``) and says ``Hello`` to every other shard (the shard it thinks it dialed,
  the map, and the coordinator's grant, which verifies there only under the same run key): an island whose
  map, order of addresses or credentials differ is refused in one line before its first step.
- **Grants.** The coordinator answers ``Join``, ``ReserveSteps`` and ``Leave`` with the island's signed grant;
  another shard checks the grant a push carries before the syncer's own checks (``SyncerService.admit_grant``).
- **Peers.** Another shard's calls carry the peer credential (``atoll-peer`` metadata,
  :func:`~atoll.runtime.service.syncer_shards.peer_token`): only they open ``Finish`` and ``Close``
  (refused to an island, and counted as ``peer``), and ``Download`` takes them too.

**The end** is the coordinator's (:mod:`~atoll.runtime.service.gather`): it calls each other shard's
``Finish``, downloads its fragments, and closes it.
"""

from __future__ import annotations

import hmac
import logging
import threading
from typing import TYPE_CHECKING, Any

import grpc

from atoll.runtime.service import wire
from atoll.runtime.service.syncer_shards import Grant, ShardSpec, peer_token
from atoll.strategies.decoupled.protocol import is_index

if TYPE_CHECKING:
    from atoll.runtime.service.syncer import SyncerService

log = logging.getLogger("atoll.syncer")


class ShardCalls:
    """The handlers and checks of a shard of a sharded syncer (see the module docstring), mixed into
    :class:`~atoll.runtime.service.server.SyncerServer`; unsharded (``shard`` None), every check passes as
    before and ``Hello`` answers shard 0 of 1."""

    service: SyncerService
    lock: threading.Lock
    refused_calls: dict[str, int]
    done: threading.Event
    final: dict[str, Any] | None

    def _init_shards(self, key: bytes) -> None:
        """Set what the checks read, once ``service`` exists (``key``: the run's secret; b"" unsharded)."""
        self.shard: ShardSpec | None = self.service.shard
        self.coordinator = self.shard is None or self.shard.coordinator
        self.owners = list(self.shard.owners) if self.shard is not None else [0] * len(self.service.numels)
        # the run's fragment -> this shard's syncer's (only the fragments it owns)
        self.local = {g: j for j, g in enumerate(self.service.fragment_ids)}
        self.peer_token = peer_token(key) if self.shard is not None else None
        self.finished: dict[str, Any] | None = None  # a shard's answer to the coordinator's Finish

    def _caller(self, context: grpc.ServicerContext, peer: bool = False) -> tuple[int, str]:
        raise NotImplementedError  # SyncerServer's

    @staticmethod
    def _request(data: bytes, context: grpc.ServicerContext) -> dict[str, Any]:
        raise NotImplementedError  # SyncerServer's

    def _peer(self, context: grpc.ServicerContext) -> tuple[int, str]:
        """Another shard of this syncer (the coordinator gathering the model), proven by the peer credential
        derived from the run's key (:func:`~atoll.runtime.service.syncer_shards.peer_token`); else abort
        (UNAUTHENTICATED) and count ``peer``: an island, or a shard of another run."""
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        credential = md.get(wire.CREDENTIAL_KEY)
        if self.peer_token is not None and wire.PEER_KEY in md and isinstance(credential, str) and \
                hmac.compare_digest(credential.encode(), self.peer_token.encode()):
            return -1, ""
        with self.lock:
            self.refused_calls["peer"] = self.refused_calls.get("peer", 0) + 1
        log.warning("refused a call from %s: peer (not a shard of this run's syncer)", context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "refused: peer")
        raise AssertionError("unreachable")

    def _fragment(self, fragment: Any, context: grpc.ServicerContext) -> int:
        """This shard's syncer's index of the run's ``fragment``; abort (INVALID_ARGUMENT) if it is no fragment
        of the run, and (PERMISSION_DENIED, counted as ``shard``) if another shard owns it."""
        if not is_index(fragment, len(self.owners)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"fragment: {fragment!r} is not one of the run's")
        return self._own(fragment, context)

    def _own(self, fragment: int, context: grpc.ServicerContext) -> int:
        if fragment not in self.local:
            with self.lock:
                self.refused_calls["shard"] = self.refused_calls.get("shard", 0) + 1
            log.warning("refused a call from %s: fragment %d is shard %d's", context.peer(), fragment,
                        self.owners[fragment])
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"shards: fragment {fragment} is shard {self.owners[fragment]}'s, not this shard's "
                          f"({self.shard.shard if self.shard else 0}); give --syncer every shard's address, in the "
                          "order of the shards' --shards")
        return self.local[fragment]

    def _coordinator_only(self, context: grpc.ServicerContext, what: str) -> None:
        if not self.coordinator:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards: {what} goes to shard 0 (the coordinator), and this is shard "
                          f"{self.shard.shard if self.shard else 0}; list shard 0's address first in --syncer")

    def _check_map(self, req: dict[str, Any], context: grpc.ServicerContext) -> None:
        """Abort (FAILED_PRECONDITION, one line) an island whose fragments or fragment -> shard map differ."""
        numels = self.service.numels
        if req.get("numels") != numels:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"model: this island's fragments hold {req.get('numels')} parameters, the syncer's {numels}; "
                          "give the island the syncer's --model, --fragments and --seed")
        owners = req.get("shards", [0] * len(numels))
        if owners != self.owners:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards: this island routes the fragments to {owners} (shard per fragment), the syncer's "
                          f"{len(set(self.owners))} shards own {self.owners}; give --syncer every shard's address, "
                          "in the order of the shards' --shards")

    def _grant(self, island: int) -> dict[str, Any]:
        """(Under the lock.) ``{"grant": ...}``, the coordinator's signed grant of ``island``; {} unsharded."""
        grant = self.service.grant(island)
        return {"grant": grant} if grant is not None else {}

    def Hello(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        """An island checks a shard before it routes fragments to it: the same fragments and map, the shard it
        thinks (``shard``), and (not the coordinator) that the coordinator's ``grant`` verifies here (the same
        run key). Answers ``{"shard", "fragments"}``; a mismatch is one line (FAILED_PRECONDITION)."""
        island, _ = self._caller(context)
        req = self._request(data, context)
        self._check_map(req, context)
        me = self.shard.shard if self.shard is not None else 0
        if req.get("shard") != me:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards: the address this island dialed as shard {req.get('shard')!r} is shard {me}; "
                          "give --syncer the shards' addresses in the order of their --shards")
        if self.service.grants is not None:
            grant = Grant.verified(req.get("grant"), self.shard.key, self.shard.run) if self.shard else None
            if grant is None or grant.island != island:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shards: shard {me} cannot verify the coordinator's grant of island {island}: the "
                              "shards' credentials differ; give every shard a copy of shard 0's --credentials folder")
        return wire.dumps({"shard": me, "fragments": self.service.fragment_ids})

    # --- the end of a sharded run (called by the coordinator) -----------------------------------------------
    def Finish(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        """(A shard, from the coordinator at the run's end.) Merge what is buffered, checkpoint, take no more
        pushes, and answer this shard's part of the run's summary (its fragments, their versions, its share of
        the parameters, its syncer's statistics, its refused calls and restarts); the coordinator then downloads
        its fragments and says ``Close``. Called again (the coordinator restarted), the same answer."""
        self._peer(context)
        with self.lock:
            if self.finished is None:
                final = self.service.finish()
                self.finished = {
                    "shard": self.shard.shard if self.shard is not None else 0,
                    "fragments": self.service.fragment_ids,
                    "versions": final["versions"], "numel": self.service.syncer.numel,
                    "stats": final["stats"], "merged_tokens": final["merged_tokens"],
                    "restarts": final["syncer_restarts"], "refused_calls": dict(self.refused_calls)}
            return wire.dumps(self.finished)

    def Close(self, data: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        """(A shard, from the coordinator once it holds this shard's fragments.) Stop serving: the run is over."""
        self._peer(context)
        self.done.set()
        return wire.dumps({"ok": True})

    def _shard_status(self) -> dict[str, Any]:
        """A shard's entries of ``status.json``: which, of how many, its fragments, and whether it is finished."""
        if self.shard is None:
            return {}
        finished = self.final is not None if self.coordinator else self.finished is not None
        return {"shard": self.shard.shard, "shards": self.shard.shards, "fragments": self.service.fragment_ids,
                "finished": finished}
