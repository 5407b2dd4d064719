"""torchft's side of ``bench/survivors.py``: the lighthouse, and one DiLoCo replica per process.

Runs only in a Python where torchft 0.2.0 is installed (``--torchft-python``); atoll never imports torchft
elsewhere. A replica trains atoll's island (same model, data, inner AdamW and schedule as ``atoll train``)
under ``torchft.local_sgd.DiLoCo`` and writes, as JSON: every sync round's start and end (wall clock) and
whether it was committed, the steps done, the participants of the last quorum and the final held-out loss.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any


def lighthouse_main() -> None:
    """Start a lighthouse (min 1 replica, 5 s heartbeat timeout), print its address, serve until SIGTERM."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=5000)
    print(server.address(), flush=True)
    signal.sigwait([signal.SIGTERM])
    server.shutdown()


def replica_main(lighthouse: str, replica: int, config_json: str, kill_step: int, out: str,
                 start_port: int) -> None:
    """One replica: ``kill_step`` > 0 makes it SIGKILL itself as it starts that (1-based) inner step.

    The replicas start training together (a counter in the driver's store at ``start_port``), so the
    first quorum holds all of them and the kill hits a replica of the running quorum.
    """
    import torch
    import torch.distributed as dist
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    from atoll.config import TrainConfig
    from atoll.config.facts import IslandSettings
    from atoll.job.data import eval_batches, sample_batch
    from atoll.job.island import build_island, inner_optimizer
    from atoll.job.run import EVAL_ROWS, evaluate, prepare_inputs

    config = TrainConfig(**json.loads(config_json))
    torch.set_num_threads(1)
    data, model = prepare_inputs(config)
    island = build_island(replica, copy.deepcopy(model), IslandSettings.of(config),
                          inner_optimizer(config.strategy_config))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1, use_async_quorum=False,
        load_state_dict=lambda s: island.model.load_state_dict(s["model"]),
        state_dict=lambda: {"model": island.model.state_dict()},
        replica_id=f"island{replica}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30))
    start = dist.TCPStore("127.0.0.1", start_port, is_master=False, timeout=timedelta(seconds=120))
    start.add("ready", 1)
    while int(start.add("ready", 0)) < config.islands:
        time.sleep(0.05)
    own = config.strategy_config  # diloco: H and the outer optimizer
    outer = torch.optim.SGD(island.model.parameters(), lr=own.outer_lr, momentum=own.outer_momentum,
                            nesterov=own.outer_momentum > 0)
    syncs: list[dict[str, Any]] = []
    with DiLoCo(manager, [island.model], island.optimizer, outer, sync_every=own.sync_every):
        for step in range(config.steps):
            if step + 1 == kill_step:
                with open(out + ".kill", "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            batch = sample_batch(data.island_tokens[replica], config.step_batch_size, config.seq_len, config.seed,
                                 replica, step)
            island.forward_backward(batch)
            island.clip_gradients()
            committed_before = manager.current_step()
            began = time.time()
            island.optimizer.step()  # DiLoCo's hook syncs every sync_every steps
            if (step + 1) % own.sync_every == 0:
                syncs.append({"step": step + 1, "start": began, "end": time.time(),
                              "committed": manager.current_step() > committed_before,
                              "participants": manager.num_participants()})
            island.finish_step()
    val = eval_batches(data.val_tokens, EVAL_ROWS, config.seq_len, config.eval_batches)
    result = {"steps": config.steps, "syncs": syncs, "final_eval_loss": evaluate(island.model, val),
              "participants": syncs[-1]["participants"] if syncs else None}
    with open(out, "w") as f:
        json.dump(result, f)
    manager.shutdown()


if __name__ == "__main__":
    replica_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
