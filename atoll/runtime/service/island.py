"""``atoll island``: one island of a decoupled run as a job of its own, which only dials out to ``atoll syncer``.

The island prepares the same data and initial model as the syncer (the same run settings), joins (a new
session; its inner steps so far, should it be a restart), pulls every global fragment, and runs the learner's
loop shared with the Ray runtime (:meth:`IslandWorker.run <atoll.strategies.decoupled.island.IslandWorker.run>`)
over a :class:`~atoll.runtime.service.client.ServiceTransport`. When the step budget is spent it pushes what
it has not pushed, waits for those exchanges, reports its counters (``Leave``) and exits 0. Killed and started
again with the same command, it rejoins from the newest global fragments; its un-pushed work is lost.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from atoll.config import TrainConfig
from atoll.errors import ConfigError
from atoll.job.device import resolve_device
from atoll.runtime.service.client import ServiceTransport, SyncerClient
from atoll.strategies.decoupled.island import IslandWorker, Job, expected_steps


def read_token(path: Path) -> str:
    """The island's secret from the file ``atoll syncer`` made for it.

    Raises:
        ConfigError: unreadable or empty.
    """
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"credential: cannot read '{path}' ({e.strerror or e}); pass the island_<i>.token file "
                          "atoll syncer made for this island") from None
    if not token:
        raise ConfigError(f"credential: '{path}' is empty; pass the island_<i>.token file atoll syncer made")
    return token


def run_island(config: TrainConfig, island: int, client: SyncerClient) -> dict[str, Any]:
    """Train island ``island`` of the run against the syncer ``client`` reaches; return its counters.

    Raises:
        ConfigError: ``island`` is not one of the run's, the syncer's model differs, or the credential is refused.
        SyncerUnreachable: the syncer gave no answer for ``client.give_up_s``.
    """
    if not 0 <= island < config.islands:
        raise ConfigError(f"island: {island} is not one of the run's islands 0..{config.islands - 1}; pass "
                          "--island in that range")
    if config.threads:
        torch.set_num_threads(config.threads)
    job = Job.prepare(config)
    joined = client.call("Join", {"numels": [int(i.numel()) for i in job.index]})
    flat, versions = job.init_flat.clone(), []
    for p, idx in enumerate(job.index):  # the newest global fragments, each over the bulk connection
        version, params = client.download(p)
        idx.scatter_(flat, params)  # a fragment is a view of the flat vector (FlatFragment)
        versions.append(version)
    worker = IslandWorker(island, job, expected_steps(config)[island], resolve_device(config.device))
    worker.rejoin(flat, versions)
    worker.steps = int(joined["steps"])
    transport = ServiceTransport(client, worker.fragments, int(joined["session"]), offline_steps=worker.sync_every,
                                 tokens_per_step=config.tokens_per_step)
    t0 = time.monotonic()
    worker.run(transport)
    report = {"steps": worker.steps, "compute_s": worker.island.compute_s, "bytes_sent": transport.bytes_sent,
              "last_loss": worker.island.last_loss, "codec_s": worker.wire.codec_s[0],
              "resets": worker.island.reset_count, "skipped_steps": worker.island.skipped_steps}
    client.call("Leave", report)
    return {**report, "island": island, "wall_s": time.monotonic() - t0, "retries": client.retries,
            "offline_steps": transport.offline_steps_taken, "refused_pushes": transport.refused,
            "session": int(joined["session"])}
