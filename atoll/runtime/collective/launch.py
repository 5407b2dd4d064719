"""Starting the ranks of a collective run on one machine (the launcher); torchrun does it across machines."""

from __future__ import annotations

import importlib
import math
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.errors import AtollError, Interrupted, RunFailed
from atoll.job import stop
from atoll.job.checkpoint import latest_checkpoint, resume_advice
from atoll.job.divergence import install_fault_hook_from_env
from atoll.job.lock import claim_run_folder
from atoll.runtime.collective.failure import REPORT_KEY
from atoll.runtime.collective.rejoin import ADMITTED_KEY, REJOIN_ENV
from atoll.runtime.collective.stop import REQUEST_KEY

if TYPE_CHECKING:  # the launcher (parent process) runs without importing transformers
    from atoll.config import TrainConfig

# ----------------------------------------------------------------------------------------------------------
# launching on one machine


def loopback_store(timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a one-machine launch, listening on 127.0.0.1 only.

    ``TCPStore`` binds every interface by itself, so that any host that reaches this one could list, read, set
    and delete its keys; here it serves a socket bound to the loopback (``master_listen_fd``, which the store
    then owns and closes).
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listener.detach())


def loopback_interface() -> str:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        return next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    except (OSError, StopIteration):
        return "lo"


def launch(config: TrainConfig, worker: str, resume: bool = False,
           grace_s: float = 30.0) -> dict[str, Any]:
    """Run ``config`` as ``islands x ranks_per_island`` local processes; return rank 0's summary.

    The parent hosts the rendezvous store (as torchrun's agent does, so the store outlives any rank),
    prepares the data once (the ranks then read it from the cache), and starts the ranks with ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set. The ranks are forked from a
    ``multiprocessing`` fork server that imported atoll once, so they start in a fraction of a second
    instead of each importing torch and transformers. A rank killed by a signal is started again, up to
    ``max_restarts`` times, to rejoin the survivors (:mod:`~atoll.runtime.collective.rejoin`). A rank that its peers
    report silent in the store (:data:`REPORT_KEY`: frozen, it would hold its connections open) is killed at once; a
    restarted rank is watched for such reports again once it says the job admitted it (:data:`ADMITTED_KEY`).
    With ``min_islands`` below ``islands`` the survivors of a lost island go on by themselves; otherwise,
    after the first failure (and in any case once rank 0 has exited), the others get ``grace_s`` seconds to
    stop by themselves (they print why) and any still running are then killed. The ranks run with
    ``TORCH_CPP_LOG_LEVEL=ERROR`` unless it is set: a lost store would otherwise make c10d print a warning
    per reconnection attempt.

    Args:
        config: the run (``runtime="collective"``).
        worker: what each rank runs, as ``"module:function"`` called ``function(config, resume)``
            (``"atoll.train:train"``); the fork server imports the module once, this process never does.
        resume: continue the run in ``config.out`` from its latest checkpoint.
        grace_s: seconds the other ranks get to stop after the first failure (or rank 0's exit).

    Returns:
        The summary that rank 0 wrote to ``<out>/summary.json``.

    Raises:
        ConfigError: ``out`` holds a run already (without ``resume``).
        RunFailed: a rank failed; ``exit_code`` is its exit status (128 + N when killed by signal N).
    """
    import json
    import multiprocessing

    from atoll.job.data import default_cache_dir, prepare_data
    from atoll.job.data.pretrained import tokenizer_source
    from atoll.job.model import check_model_config  # (transformers is imported only for a model folder)

    check_model_config(config.model, config.seq_len)  # a model that cannot fit: refused before any folder is made
    out, lock = claim_run_folder(config.out, config.strategy, resume)  # held by the launcher for its ranks
    config = config.model_copy(update={"out": out})
    world = config.islands * config.ranks_per_island
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([worker.split(":")[0]])
    store = loopback_store(config.collective_timeout_s)
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # one machine: gloo's pairs on the loopback too
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    if config.threads is None and "OMP_NUM_THREADS" not in os.environ:  # as torchrun: no oversubscription
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    procs = [ctx.Process(target=_rank_main, name=f"atoll-rank{r}",
                         args=(worker, config, resume, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
             for r in range(world)]
    first: tuple[int, int] | None = None  # (rank, exit status) of the first rank to fail
    reported: set[int] = set()  # ranks reported silent by their peers
    killed: set[int] = set()  # ranks killed here (reported while running, or restarted)
    joining: dict[int, str] = {}  # restarted rank -> its incarnation, until the job admitted it
    survive = config.min_islands < config.islands
    restarts = [config.max_restarts] * world
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read by the fork server as it imports torch
    try:
        cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache_dir,
                     partition=config.partition, text_field=config.text_field,
                     tokenizer=tokenizer_source(config.model, config.tokenizer), max_documents=config.max_documents)
        for p in procs:
            p.start()
        deadline = math.inf
        relayed = False
        with stop.on_signals(), stop.at_once(lambda: [p.kill() for p in procs if p.exitcode is None]):
            while any(p.exitcode is None for p in procs):
                if not relayed and stop.requested() is not None:  # SIGINT/SIGTERM here: the ranks checkpoint
                    store.set(REQUEST_KEY, str(stop.requested()))  # the step they agree on, then stop
                    relayed = True
                for rank, p in enumerate(procs):
                    if first is None and rank not in killed and p.exitcode not in (None, 0):
                        first = (rank, p.exitcode)
                        if not survive:
                            deadline = min(deadline, time.monotonic() + grace_s)
                if procs[0].exitcode is not None:
                    deadline = min(deadline, time.monotonic() + grace_s)
                for rank, p in enumerate(procs):  # a killed rank, restarted: it rejoins the survivors (rejoin.py)
                    if (rank and restarts[rank] and p.exitcode is not None and p.exitcode < 0
                            and procs[0].exitcode is None):
                        restarts[rank] -= 1
                        reported.add(rank)  # the survivors' report of the lost one must not kill the new one
                        killed.add(rank)
                        joining[rank] = str(config.max_restarts - restarts[rank])
                        procs[rank] = ctx.Process(target=_rank_main, name=f"atoll-rank{rank}", args=(
                            worker, config, resume, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                     REJOIN_ENV: joining[rank]}))
                        procs[rank].start()
                for rank in _admitted(store, joining):  # it cleared the old report: a new one is about this process
                    del joining[rank]
                    reported.discard(rank)
                for rank in _reported(store, world, reported):
                    reported.add(rank)
                    if procs[rank].exitcode is None:  # frozen: its peers are done with it
                        killed.add(rank)
                        procs[rank].kill()
                if time.monotonic() > deadline:
                    for p in procs:
                        if p.exitcode is None:
                            p.kill()
                time.sleep(0.05)
        for rank, p in enumerate(procs):
            if first is None and rank not in killed and p.exitcode != 0:
                first = (rank, p.exitcode)
    except BaseException:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
                if p.exitcode is None:
                    p.kill()
        raise
    finally:
        del store
        lock.release()
    if survive and procs[0].exitcode == 0 and (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())  # the survivors finished (they said whom they lost)
    asked = stop.requested()
    if asked is not None and procs[0].exitcode == 128 + asked:  # stopped after the checkpoint the ranks agreed on
        try:
            step: int | None = int(latest_checkpoint(out).name.split("_")[1])
        except AtollError:
            step = None
        raise Interrupted(asked, step, out)
    if first is not None:
        rank, code = first
        if code < 0:
            raise RunFailed(f"rank {rank} (island {rank // config.ranks_per_island}) was killed by "
                            f"{signal.Signals(-code).name}; {resume_advice(out)}",
                            128 - code)
        raise RunFailed("", code)
    return json.loads((out / "summary.json").read_text())


def _reported(store: dist.TCPStore, world: int, known: set[int]) -> list[int]:
    """Ranks that their peers reported silent (:data:`REPORT_KEY`) and are not in ``known``."""
    return [r for r in range(world) if r not in known and store.check([f"{REPORT_KEY}{r}"])]


def _admitted(store: dist.TCPStore, joining: dict[int, str]) -> list[int]:
    """The restarted ranks of ``joining`` (rank -> incarnation) that the job has admitted (:data:`ADMITTED_KEY`)."""
    return [r for r, n in joining.items()
            if store.check([f"{ADMITTED_KEY}{r}"]) and store.get(f"{ADMITTED_KEY}{r}").decode() == n]


def _rank_main(worker: str, config: TrainConfig, resume: bool, env: dict[str, str]) -> None:
    """One rank started by :func:`launch`: its environment as torchrun would set it, then the job."""
    os.environ.update(env)
    if config.threads is None and "OMP_NUM_THREADS" in env:  # torch was imported before the variable was set
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    module, _, name = worker.partition(":")
    try:
        install_fault_hook_from_env()  # a test's faults, told at the rank's start (atoll.job.divergence)
        getattr(importlib.import_module(module), name)(config, resume)
    except AtollError as e:
        print(f"atoll: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Interrupted as e:  # a signal: this rank stopped after the step the ranks agreed on (checkpointed)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


