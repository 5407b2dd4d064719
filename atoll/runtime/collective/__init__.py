"""The ``collective`` runtime: every island as real processes over ``torch.distributed``.

Launch on one machine (atoll starts the ``islands x ranks_per_island`` processes itself)::

    atoll train --runtime collective --islands 2 --ranks-per-island 2

or across machines with torchrun (run on every node, ``--node-rank`` its number; atoll reads ``RANK``/``WORLD_SIZE``
from it; node 0 hosts the rendezvous store at ``--master-addr``; tested on two network namespaces standing for
two hosts, ``tests/test_multinode.py``)::

    GLOO_SOCKET_IFNAME=eth1 torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr NODE0_IP \\
        --master-port 29400 -m atoll.cli train --runtime collective --islands 2 --ranks-per-island 2

Process layout: world = ``islands`` x ``ranks_per_island`` (R) ranks; island i is ranks [i*R, (i+1)*R).
Every rank runs one island (the strategy's ``islands`` list has length 1). Two kinds of process groups:

- an *island group* per island (its R ranks): plain data parallel every inner step. Each rank computes
  the gradient of its ``batch_size / R`` rows of the island's batch and the ranks average their gradients
  before the strategy sees them, so an island of R ranks computes what one rank with the whole batch would
  (:mod:`~atoll.runtime.collective.rank_island`, shared with ``atoll island``'s jobs of R ranks).
- a *cross-island group* per position r in an island (ranks r, R + r, 2R + r, ...): it carries only what
  the strategy sends. A payload is cut into R equal pieces; rank r moves piece r over its cross-island
  group, then the island's ranks all-gather their pieces. Every island therefore sends each byte once
  (spread over its R ranks' links), and every rank of every island ends with bitwise the same result.

Backend: NCCL when CUDA is available (each rank on GPU ``LOCAL_RANK``; a gloo group carries checkpoints and
counters), gloo otherwise.

Bytes are counted from the tensors handed to the network, with the ring costs of :mod:`atoll.runtime.network`
(all-reduce of B bytes: 2(K-1)/K*B per island; all-gather of B bytes per island: (K-1)*B). Protocol
scalars (one weight per exchange, and at most R-1 bytes or elements of padding to cut equal pieces) are
not counted.

Failure: every collective has a deadline: ``collective_timeout_s``, and for an exchange across islands that
floor plus its transfer time at ``collective_link_mbps`` times a safety factor
(:func:`~atoll.runtime.collective.comm.exchange_deadline_s`). A dead rank usually breaks its
peers' pending collectives at once (gloo: "Connection closed by peer"); a heartbeat through the
rendezvous store also catches a rank that stops without closing its connections (no heartbeat for
``min(10 s, collective_timeout_s)``), and reports it in the store, where the one-machine launcher kills it.
With ``min_islands`` below ``islands`` (the default), the survivors go on: they agree on the islands alive
(:mod:`~atoll.runtime.collective.quorum`), re-form their groups and redo the failed collective
(:meth:`CollectiveRuntime.recover`). Otherwise, or when island 0 is lost, or below ``min_islands``, the
surviving ranks stop with one line, ``atoll: error: island J (rank R) stopped responding at inner step N
(<reason>); resume with 'atoll train --resume OUT' (from step S)``, and exit with status 3
(:data:`EXIT_PEER_FAILURE`) via ``os._exit``, because a backend with a dead peer can hang in its clean-up.
Under torchrun each prints it; under the one-machine launcher each hands it to the launcher, which says one
line for the run: ``rank R (island J) was killed by SIGKILL; resume ...`` where a signal ended the lost rank,
else the first survivor's line.
A new run checkpoints after its first exchange, so there is a resume point before ``checkpoint_every``.
With ``max_restarts``, the launcher starts a killed rank again and it rejoins the running job with a live
island's state (:mod:`~atoll.runtime.collective.rejoin`).
The one-machine launcher (:func:`launch`) exits with the status of the first rank that failed.

Test hook: the environment variable ``ATOLL_TEST_KILL_RANK_AT_STEP=RANK:N[:STOP]`` makes global rank RANK
kill itself with SIGKILL (or freeze with SIGSTOP) as it starts inner step N (1-based); several entries are
separated by commas (``1:40,2:80``), ``+N`` counts from the job's first rejoin (``1:8,2:+5``), and a
restarted rank keeps the hook. A fault hook as the NaN faults' (:mod:`atoll.job.faults`), read once as each
rank starts (never in a step), as is ``ATOLL_TEST_KILL_STAMP`` (a file where the killed rank notes when it
died); for fault-injection tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atoll.job.faults import KILL_HOOK_ENV
from atoll.runtime.collective.failure import (
    EXIT_PEER_FAILURE,
    HEARTBEAT_S,
    HEARTBEAT_STALE_S,
    PeerFailure,
    in_worker,
)
from atoll.runtime.collective.launch import launch
from atoll.runtime.collective.runtime import CollectiveRuntime

if TYPE_CHECKING:
    from atoll.config import TrainConfig

__all__ = ["EXIT_PEER_FAILURE", "HEARTBEAT_S", "HEARTBEAT_STALE_S", "KILL_HOOK_ENV", "CollectiveRuntime",
           "PeerFailure", "in_worker", "launch", "start_job"]


def start_job(config: TrainConfig, entry: str, resume: bool = False) -> dict[str, Any] | None:
    """The runtime's launcher (:attr:`atoll.runtime.spec.RuntimeSpec.launcher`): outside torchrun, start the
    job's processes on this machine, each running ``entry`` (``module:function``) with the whole config
    (:func:`launch`), and return rank 0's summary; None inside one of them (torchrun set ``RANK``)."""
    return None if in_worker() else launch(config, entry, resume)
