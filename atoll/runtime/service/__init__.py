"""Decoupled DiLoCo across sites: the syncer as a service (``atoll syncer``), each island a job that dials out.

Launch (one command per site; docs/deployment.md says more)::

    atoll syncer --listen 0.0.0.0:7070 --tls-cert syncer.pem --tls-key syncer.key \\
        --credentials creds/ --out runs/syncer --islands 2 --steps 600 ...        # the syncer's host
    atoll island --syncer syncer.example.org:7070 --tls-ca ca.pem --island 0 \\
        --credential creds/island_0.token --islands 2 --steps 600 ...            # each island's site

The syncer (:mod:`~atoll.runtime.service.server`) serves one
:class:`~atoll.strategies.decoupled.service.SyncerService` (the same object the Ray runtime makes an actor:
the syncer's maths and admission checks in one place) over gRPC; an island
(:mod:`~atoll.runtime.service.island`) runs :meth:`IslandWorker.run
<atoll.strategies.decoupled.island.IslandWorker.run>` (the learner's loop shared with Ray) over a
:class:`~atoll.runtime.service.client.ServiceTransport`. The wire (:mod:`~atoll.runtime.service.wire`) is
JSON for control and safetensors for tensors, never pickle.

Why gRPC (grpcio, already installed with Ray): HTTP/2 streaming for tensors of hundreds of MB in chunks, TLS
and per-call metadata (the island's credential) built in, and generic handlers of raw bytes, so no code
generation and no pickle.
"""
