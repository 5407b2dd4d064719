"""Decoupled DiLoCo across sites: the syncer as a service (``atoll syncer``), each island a job that dials out.

Launch (one command per site; docs/deployment.md says more)::

    atoll syncer --listen 0.0.0.0:7070 --tls-cert syncer.pem --tls-key syncer.key \\
        --credentials creds/ --out runs/syncer --islands 2 --steps 600 ...        # the syncer's host
    atoll island --syncer syncer.example.org:7070 --tls-ca ca.pem --island 0 \\
        --credential creds/island_0.token --islands 2 --steps 600 ...            # an island of one process
    torchrun --nproc-per-node 4 --max-restarts 3 -m atoll island --syncer syncer.example.org:7070 \\
        --tls-ca ca.pem --island 1 --credential creds/island_1.token [--shard-island] ...  # of 4 ranks

The syncer (:mod:`~atoll.runtime.service.server`) serves one
:class:`~atoll.runtime.service.syncer.SyncerService` (the same object the Ray runtime makes an actor:
the syncer's maths and admission checks in one place) over gRPC; an island
(:mod:`~atoll.runtime.service.island`), one process or the R ranks torchrun starts
(:mod:`~atoll.runtime.service.group`), runs :meth:`IslandWorker.run
<atoll.strategies.decoupled.island.IslandWorker.run>` (the learner's loop shared with Ray) on every rank over a
:class:`~atoll.runtime.service.exchange.ServiceTransport`, each rank moving its own slice of every fragment
(:mod:`~atoll.runtime.service.slices`). The wire (:mod:`~atoll.runtime.service.wire`) is JSON for control and
safetensors for tensors (a push: the codec's encoded payload), never pickle.

Why gRPC (grpcio, already installed with Ray): HTTP/2 streaming for tensors of hundreds of MB in chunks, TLS
and per-call metadata (the island's credential) built in, and generic handlers of raw bytes, so no code
generation and no pickle.
"""
