"""A syncer sharded by fragment, on the wire: what a shard adds to ``atoll syncer``'s handlers, and how the
coordinator gathers the run at its end.

Each shard is an ``atoll syncer`` of its own fragments (:mod:`~atoll.runtime.service.syncer_shards`: the map,
the grants). :class:`Shards` is the collaborator of :class:`~atoll.runtime.service.server.SyncerServer` that
knows it is one shard of several:

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

import threading
from typing import TYPE_CHECKING, Any

import grpc

from atoll.runtime.service import schema
from atoll.runtime.service.calls import Gate
from atoll.runtime.service.syncer_shards import Grant, ShardSpec

if TYPE_CHECKING:
    from atoll.runtime.service.syncer import SyncerService


class Shards:
    """The checks and handlers of a shard of a sharded syncer (see the module docstring), held by
    :class:`~atoll.runtime.service.server.SyncerServer`; unsharded (the service's ``shard`` None), every check
    passes and ``Hello`` answers shard 0 of 1.

    Args:
        service: the syncer service served (its shard, fragments, grants).
        lock: the server's lock (one call into the service at a time).
        gate: the server's :class:`~atoll.runtime.service.calls.Gate` (refusals, counted).
        done: set when the coordinator says ``Close``: the server stops.

    Attributes:
        finished: this shard's answer to the coordinator's ``Finish`` (None before).
    """

    def __init__(self, service: SyncerService, lock: threading.Lock, gate: Gate, done: threading.Event) -> None:
        self.service, self.lock, self.gate, self.done = service, lock, gate, done
        self.shard: ShardSpec | None = service.shard
        self.coordinator = self.shard is None or self.shard.coordinator
        self.owners = list(self.shard.owners) if self.shard is not None else [0] * len(service.numels)
        # the run's fragment -> this shard's syncer's (only the fragments it owns)
        self.local = {g: j for j, g in enumerate(service.fragment_ids)}
        self.finished: schema.FinishReply | None = None

    @property
    def me(self) -> int:
        """This shard's index (0 unsharded)."""
        return self.shard.shard if self.shard is not None else 0

    def fragment(self, fragment: int | None, context: grpc.ServicerContext) -> int:
        """This shard's syncer's index of the run's ``fragment``; refuse (INVALID_ARGUMENT) if it is no fragment
        of the run, and (PERMISSION_DENIED, counted as ``shard``) if another shard owns it."""
        if fragment is None or not fragment < len(self.owners):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"fragment: {fragment!r} is not one of the run's")
        return self.own(fragment, context)

    def own(self, fragment: int, context: grpc.ServicerContext) -> int:
        """As :meth:`fragment`, for a fragment of the run's."""
        if fragment not in self.local:
            self.gate.refuse(context, grpc.StatusCode.PERMISSION_DENIED, "shard",
                             f"shards: fragment {fragment} is shard {self.owners[fragment]}'s, not this shard's "
                             f"({self.me}); give --syncer every shard's address, in the order of the shards' --shards")
        return self.local[fragment]

    def coordinator_only(self, context: grpc.ServicerContext, what: str) -> None:
        """Abort (FAILED_PRECONDITION) ``what``, a call of the coordinator's alone, at another shard."""
        if not self.coordinator:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards: {what} goes to shard 0 (the coordinator), and this is shard {self.me}; list "
                          "shard 0's address first in --syncer")

    def check_map(self, req: schema.JoinRequest, context: grpc.ServicerContext) -> None:
        """Abort (FAILED_PRECONDITION, one line) an island whose fragments or fragment -> shard map differ."""
        numels = list(self.service.numels)
        if list(req.numels) != numels:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"model: this island's fragments hold {list(req.numels)[:64]} parameters, the syncer's "
                          f"{numels}; give the island the syncer's --model, --fragments and --seed")
        owners = list(req.shards) if req.shards is not None else [0] * len(numels)
        if owners != self.owners:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards: this island routes the fragments to {owners} (shard per fragment), the syncer's "
                          f"{len(set(self.owners))} shards own {self.owners}; give --syncer every shard's address, "
                          "in the order of the shards' --shards")

    def grant(self, island: int) -> dict[str, Any]:
        """(Under the lock.) ``{"grant": ...}``, the coordinator's signed grant of ``island`` (a reply's
        field); {} unsharded."""
        grant = self.service.grant(island)
        return {"grant": schema.Grant.model_validate(grant)} if grant is not None else {}

    def hello(self, island: int, req: schema.HelloRequest, context: grpc.ServicerContext) -> schema.HelloReply:
        """An island checks a shard before it routes fragments to it: the same fragments and map, the shard it
        thinks (``shard``), and (not the coordinator) that the coordinator's ``grant`` verifies here (the same
        run key). Answers its shard and fragments; a mismatch is one line (FAILED_PRECONDITION)."""
        self.check_map(req, context)
        if req.shard != self.me:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards: the address this island dialed as shard {req.shard} is shard {self.me}; give "
                          "--syncer the shards' addresses in the order of their --shards")
        if self.service.grants is not None:
            shown = req.grant.model_dump() if req.grant is not None else None
            grant = Grant.verified(shown, self.shard.key, self.shard.run) if self.shard else None
            if grant is None or grant.island != island:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shards: shard {self.me} cannot verify the coordinator's grant of island {island}: the "
                              "shards' credentials differ; give every shard a copy of shard 0's --credentials folder")
        return schema.HelloReply(shard=self.me, fragments=self.service.fragment_ids)

    # --- the end of a sharded run (called by the coordinator) -----------------------------------------------
    def finish(self) -> schema.FinishReply:
        """(A shard, from the coordinator at the run's end.) Merge what is buffered, checkpoint, take no more
        pushes, and answer this shard's part of the run's summary (its fragments, their versions, its share of
        the parameters, its syncer's statistics, its refused calls and restarts); the coordinator then downloads
        its fragments and says ``Close``. Called again (the coordinator restarted), the same answer."""
        with self.lock:
            if self.finished is None:
                final = self.service.finish()
                self.finished = schema.FinishReply(
                    shard=self.me, fragments=self.service.fragment_ids, versions=final["versions"],
                    numel=self.service.syncer.numel, stats=final["stats"], merged_tokens=final["merged_tokens"],
                    restarts=final["syncer_restarts"], refused_calls=dict(self.gate.refused))
            return self.finished

    def close(self) -> schema.OkReply:
        """(A shard, from the coordinator once it holds this shard's fragments.) Stop serving: the run is over."""
        self.done.set()
        return schema.OkReply(ok=True)

    def status(self, final: bool) -> dict[str, Any]:
        """A shard's entries of ``status.json``: which, of how many, its fragments, and whether it is finished
        (``final``: the coordinator's run is over)."""
        if self.shard is None:
            return {}
        finished = final if self.coordinator else self.finished is not None
        return {"shard": self.shard.shard, "shards": self.shard.shards, "fragments": self.service.fragment_ids,
                "finished": finished}
