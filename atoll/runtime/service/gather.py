"""The end of a run whose syncer is sharded by fragment: the coordinator (shard 0) gathers the other shards.

Once the step budget is spent and every island has left, the coordinator calls each other shard over the same
authenticated protocol as the islands (TLS as the shards serve it), with the peer credential: ``Finish`` (the
shard merges what is buffered, checkpoints, takes no more pushes, and answers its statistics), ``Download`` of
each of its fragments (float32, chunked, resumed after a failure), then ``Close`` (the shard exits 0). A shard
that is down meanwhile is retried with backoff up to ``give_up_s`` (restarted, it answers from its
checkpoint). The coordinator then evaluates and saves the one model of the run, as an unsharded syncer does.
The shards' side of these calls is :class:`~atoll.runtime.service.shards.Shards`.

Chosen over each shard writing its fragments for a separate ``--gather`` step: the run ends by itself, with
``summary.json`` and the model in ``OUT/run`` on shard 0's host, and no shard needs a filesystem shared with
another.
"""

from __future__ import annotations

import contextlib
from typing import Any

import grpc
import torch

from atoll.errors import ConfigError
from atoll.runtime.service import wire
from atoll.runtime.service.client import SyncerClient
from atoll.runtime.service.server import SyncerServer
from atoll.runtime.service.syncer_shards import combine_stats, owned


class PeerClient(SyncerClient):
    """The coordinator's calls to shard ``shard`` at ``address``: a :class:`SyncerClient` whose calls carry the
    peer credential ``token`` instead of an island's (the other arguments as :class:`SyncerClient`'s)."""

    def __init__(self, address: str, shard: int, token: str, **kwargs: Any) -> None:
        super().__init__(address, -1, token, **kwargs)
        self.shard = shard
        self.metadata = ((wire.PEER_KEY, "0"), (wire.CREDENTIAL_KEY, token))

    def _retrying(self, what: str, attempt: Any) -> Any:
        try:
            return super()._retrying(what, attempt)
        except ConfigError as e:
            if str(e).startswith("credential:"):
                raise ConfigError(f"shards: shard {self.shard} at '{self.address}' refused the coordinator's peer "
                                  "credential: the shards' credentials folders differ; give every shard a copy of "
                                  "shard 0's") from None
            raise


def gather(state: SyncerServer, peers: list[PeerClient]) -> tuple[dict[str, Any], dict[str, int]]:
    """The run's final state from the coordinator's ``state`` (its :meth:`SyncerService.finish
    <atoll.runtime.service.syncer.SyncerService.finish>` in ``state.final``) and every other shard's
    (``peers[s - 1]`` is shard s): the whole model's global parameters (float32 (numel,)), the versions of
    every fragment, the statistics combined (:func:`~atoll.runtime.service.syncer_shards.combine_stats`),
    the merged tokens, the restarts of all shards; and the calls every shard refused, by reason.

    Raises:
        SyncerUnreachable: a shard gave no answer for its ``give_up_s``.
        ConfigError: a shard answered as another shard, or refused the peer credential.
    """
    service, own = state.service, state.final
    assert own is not None and state.shard is not None
    owners, numels = list(state.shard.owners), service.numels
    numel = sum(numels)
    flat = torch.empty(numel, dtype=torch.float32)
    versions = [0] * len(numels)
    for j, g in enumerate(service.fragment_ids):  # the coordinator's own fragments
        service.index[g].scatter_(flat, service.syncer.index[j].gather(own["global"]))
        versions[g] = own["versions"][j]
    share = service.syncer.numel / numel
    parts = [(own["stats"], share)]
    merged, restarts = own["merged_tokens"] * share, [own["syncer_restarts"]]
    refused = dict(state.refused_calls)
    for peer in peers:
        answer = peer.call("Finish", timeout_s=120.0)
        if answer.get("shard") != peer.shard or answer.get("fragments") != owned(owners, peer.shard):
            raise ConfigError(f"shards: '{peer.address}' answered as shard {answer.get('shard')!r} owning "
                              f"{answer.get('fragments')!r}, not as shard {peer.shard}; give every shard the same "
                              "--shards list")
        for g, v in zip(answer["fragments"], answer["versions"], strict=True):
            version, values = peer.download(g)
            if version != v or values.dtype != torch.float32 or values.numel() != numels[g]:
                raise ConfigError(f"shards: shard {peer.shard} sent fragment {g} at version {version} "
                                  f"({values.numel()} values), having finished it at {v} ({numels[g]}); check its log")
            service.index[g].scatter_(flat, values)
            versions[g] = version
        peer_share = float(answer["numel"]) / numel
        parts.append((answer["stats"], peer_share))
        merged += float(answer["merged_tokens"]) * peer_share
        restarts.append(int(answer["restarts"]))
        for reason, n in answer["refused_calls"].items():
            refused[reason] = refused.get(reason, 0) + int(n)
        with contextlib.suppress(grpc.RpcError):  # one attempt: a shard that missed it exits on its own later
            peer.call("Close", retry=False)
    final = {**own, "global": flat, "versions": versions, "stats": combine_stats(parts), "merged_tokens": merged,
             "syncer_restarts": sum(restarts), "shard_restarts": restarts}
    return final, refused
