"""Starting the ranks of a collective run on one machine (the launcher); torchrun does it across machines."""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import select
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from atoll.errors import AtollError, Interrupted, PeerWriteError, RunFailed, disk_error_line
from atoll.job import stop
from atoll.job.checkpoint import latest_step, resume_advice
from atoll.job.divergence import install_fault_hook_from_env
from atoll.job.lock import claim_run_folder, process_running
from atoll.runtime.collective.failure import EXIT_PEER_FAILURE, LINE_KEY, LINES_ENV, REPORT_KEY
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
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set (:func:`rank_env`). The ranks are forked
    from a ``multiprocessing`` fork server that imported atoll once, so they start in a fraction of a second
    instead of each importing torch and transformers. A :class:`Supervisor` watches them: it restarts a killed
    rank to rejoin the survivors, kills a rank its peers report silent, relays a signal to the ranks, and gives
    the others ``grace_s`` after a failure that ends the job. The ranks run with ``TORCH_CPP_LOG_LEVEL=ERROR``
    unless it is set: a lost store would otherwise make c10d print a warning per reconnection attempt.

    torchrun's own agent (``torch.distributed.elastic``) does not fit here: on one rank's loss it stops every
    other rank and restarts the whole group (measured: ``torchrun --nproc-per-node 2 --max-restarts 1``, rank 1
    SIGKILLed, rank 0 gets SIGTERM and both start again as restart 1), where atoll's survivors go on and only
    the lost rank restarts to rejoin them; and it has no hook to kill a rank that its peers report frozen.
    Across machines the ranks run under torchrun all the same (the package docstring).

    Args:
        config: the run (``runtime="collective"``).
        worker: what each rank runs, as ``"module:function"`` called ``function(config, resume)``
            (``"atoll.training:train"``); the fork server imports the module once, this process never does.
        resume: continue the run in ``config.out`` from its latest checkpoint.
        grace_s: seconds the other ranks get to stop after the first failure (or rank 0's exit).

    Returns:
        The summary that rank 0 wrote to ``<out>/summary.json``.

    Raises:
        ConfigError: ``out`` holds a run already (without ``resume``).
        RunFailed: a rank failed; ``exit_code`` is its exit status (128 + N when killed by signal N).
        Interrupted: SIGINT or SIGTERM arrived; the ranks stopped after the checkpoint they agreed on.
    """
    from atoll.job.model import check_model_config  # (transformers is imported only for a model folder)

    check_model_config(config.model, config.seq_len)  # a model that cannot fit: refused before any folder is made
    out, lock = claim_run_folder(config.out, config.strategy, resume)  # held by the launcher for its ranks
    config = config.model_copy(update={"out": out})
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read by the fork server as it imports torch
    store = loopback_store(config.runtime_config.collective_timeout_s)
    ranks = Supervisor(config, worker, resume, rank_env(config, store.port), grace_s, lock.fd)
    try:
        with stop.on_signals(), stop.at_once(ranks.kill_all):  # (a signal while the data is prepared: no rank starts)
            _prepare_data(config)
            if stop.requested() is None:
                ranks.start()
                ranks.watch(store)
    except BaseException:
        ranks.terminate()
        raise
    finally:
        del store
        lock.abandon()  # (a new folder that holds nothing but the lock is removed: nothing was written)
    return ranks.outcome(out)


def rank_env(config: TrainConfig, port: int) -> dict[str, str]:
    """The environment every rank of a one-machine launch shares, as torchrun would set it (``RANK`` and
    ``LOCAL_RANK`` are each rank's): the store at 127.0.0.1:``port``, gloo on the loopback, and one torch
    thread pool per rank that does not oversubscribe the cores (unless ``threads`` or ``OMP_NUM_THREADS`` say);
    and :data:`~atoll.runtime.collective.failure.LINES_ENV`: the launcher says why the run stopped, once."""
    world = config.islands * config.runtime_config.ranks_per_island
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           LINES_ENV: "1"}  # a rank stopped by a peer's failure hands its line to the launcher (Supervisor.outcome)
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # one machine: gloo's pairs on the loopback too
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    if config.threads is None and "OMP_NUM_THREADS" not in os.environ:  # as torchrun: no oversubscription
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    return env


def _prepare_data(config: TrainConfig) -> None:
    """Tokenize the corpus into the cache once, before any rank starts (each then reads it from there)."""
    from atoll.job.data import default_cache_dir, prepare_data
    from atoll.job.data.pretrained import tokenizer_source

    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache_dir,
                 partition=config.partition, text_field=config.text_field,
                 tokenizer=tokenizer_source(config.model, config.tokenizer), max_documents=config.max_documents)


class Supervisor:
    """The ranks of a one-machine launch and what happened to them: a small process supervisor.

    Every :data:`POLL_S` seconds (:meth:`watch`) it relays a signal this process got to the ranks
    (:meth:`relay_stop`), notes the first rank that failed (:meth:`note_failures`), restarts a rank killed by a
    signal up to ``max_restarts`` times, with ``ATOLL_REJOIN=<incarnation>``, to rejoin the survivors
    (:meth:`restart_lost`, :mod:`~atoll.runtime.collective.rejoin`), kills a rank its peers report silent
    (:data:`REPORT_KEY`: frozen, it would hold its connections open; a restarted rank is watched for such reports
    again once the job admitted it, :data:`ADMITTED_KEY`; :meth:`kill_reported`), and past the deadline kills
    every rank still running (:meth:`enforce_deadline`). With ``min_islands`` below ``islands`` the survivors of
    a lost island go on by themselves; otherwise, after the first failure (and in any case once rank 0 has
    exited), the others get ``grace_s`` seconds to stop by themselves; a rank stopped by a peer's failure hands its
    line over (:meth:`collect_lines`) and :meth:`outcome` says one line for the run.

    Every rank holds a duplicate of the run folder's lock (:mod:`atoll.job.lock`), so the folder stays locked
    while any rank of the run lives, the launcher gone or not: a ``--resume`` started while ranks left behind by a
    killed launcher still write is refused (they stop on their own once they find the store gone). A rank's exit
    status comes from the fork server; a fork server lost (killed) answers 255 for ranks that still run:
    :meth:`watch` then asks them to stop through the store and raises in :meth:`outcome`.

    Args:
        config: the run.
        worker: what each rank runs (``"module:function"``; the fork server preloads the module).
        resume: passed to each rank's worker.
        env: the environment the ranks share (:func:`rank_env`).
        grace_s: seconds the other ranks get after a failure that ends the job.
        lock_fd: the launcher's descriptor of the run folder's lock, duplicated into every rank (None: no lock,
            a platform without ``flock``).
    """

    POLL_S = 0.05

    def __init__(self, config: TrainConfig, worker: str, resume: bool, env: dict[str, str], grace_s: float,
                 lock_fd: int | None = None) -> None:
        import multiprocessing

        self.config, self.worker, self.resume, self.env, self.grace_s = config, worker, resume, env, grace_s
        self.lock_fd = lock_fd
        self.orphans: list[_Orphan] = []  # ranks still running after their fork server was lost (stop_orphans)
        self.orphans_killed = 0  # of those, SIGKILLed past grace_s
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload([worker.split(":")[0]])
        self.world = config.islands * config.runtime_config.ranks_per_island
        self.procs = [self._process(r) for r in range(self.world)]
        self.first: tuple[int, int] | None = None  # (rank, exit status) of the first rank to fail
        self.reported: set[int] = set()  # ranks reported silent by their peers
        self.killed: set[int] = set()  # ranks killed here (reported while running, or restarted)
        self.joining: dict[int, str] = {}  # restarted rank -> its incarnation, until the job admitted it
        self.survive = config.runtime_config.min_islands < config.islands
        self.restarts = [config.runtime_config.max_restarts] * self.world
        self.deadline = math.inf
        self.relayed = False
        # rank -> why it stopped on a peer's failure (its line, the rank it found silent), handed over (collect_lines)
        self.lines: dict[int, tuple[str, int | None]] = {}

    def _process(self, rank: int, incarnation: str | None = None) -> Any:
        env = {**self.env, "RANK": str(rank), "LOCAL_RANK": str(rank),
               **({REJOIN_ENV: incarnation} if incarnation is not None else {})}
        held = _HeldLock(self.lock_fd) if self.lock_fd is not None else None
        return self.ctx.Process(target=_rank_main, name=f"atoll-rank{rank}",
                                args=(self.worker, self.config, self.resume, env, held))

    def start(self) -> None:
        """Start every rank.

        Raises:
            RunFailed: the fork server was lost while it started them (killed): one line, exit status 1.
        """
        try:
            for p in self.procs:
                p.start()
        except (EOFError, OSError) as e:  # (multiprocessing's read of the new rank's pid, or its connection)
            advice = resume_advice(self.config.out) if self.resume else "start it again"
            raise RunFailed(f"the fork server that starts the ranks was lost while it started them (killed?: "
                            f"{type(e).__name__}); {advice}", 1) from None

    def watch(self, store: dist.TCPStore) -> None:
        """Supervise the ranks until none runs; then note a rank that failed without being killed here."""
        while any(p.exitcode is None for p in self.procs):
            self.relay_stop(store)
            self.note_failures()
            self.restart_lost()
            self.kill_reported(store)
            self.enforce_deadline()
            time.sleep(self.POLL_S)
        self.stop_orphans(store)
        for rank, p in enumerate(self.procs):
            if self.first is None and rank not in self.killed and p.exitcode != 0:
                self.first = (rank, p.exitcode)
        self.collect_lines(store)

    def collect_lines(self, store: dist.TCPStore) -> None:
        """Read the lines the ranks stopped by a peer's failure handed over (:data:`LINE_KEY`): :meth:`outcome`
        says one of them for the run, where each survivor used to print its own."""
        import json

        for rank in range(self.world):
            with contextlib.suppress(Exception):  # (a store that fails here, a value not the ranks': not said)
                if store.check([f"{LINE_KEY}{rank}"]):
                    handed = json.loads(store.get(f"{LINE_KEY}{rank}"))
                    suspect = handed["suspect"]
                    self.lines[rank] = (str(handed["line"]),
                                        suspect if isinstance(suspect, int) and 0 <= suspect < self.world else None)

    def relay_stop(self, store: dist.TCPStore) -> None:
        """SIGINT/SIGTERM here: tell the ranks (:data:`REQUEST_KEY`); they checkpoint the step they agree on,
        then stop."""
        if not self.relayed and stop.requested() is not None:
            store.set(REQUEST_KEY, str(stop.requested()))
            self.relayed = True

    def note_failures(self) -> None:
        """Note the first rank that failed (not one killed here); a failure that ends the job (losses are not
        survived), or rank 0's exit, starts the others' grace period."""
        for rank, p in enumerate(self.procs):
            if self.first is None and rank not in self.killed and p.exitcode not in (None, 0):
                self.first = (rank, p.exitcode)
                if not self.survive:
                    self.deadline = min(self.deadline, time.monotonic() + self.grace_s)
        if self.procs[0].exitcode is not None:
            self.deadline = min(self.deadline, time.monotonic() + self.grace_s)

    def restart_lost(self) -> None:
        """Start again a rank (not rank 0) that a signal killed, while it has restarts left and rank 0 runs: it
        rejoins the survivors (:mod:`~atoll.runtime.collective.rejoin`)."""
        for rank, p in enumerate(self.procs):
            if (rank and self.restarts[rank] and p.exitcode is not None and p.exitcode < 0
                    and self.procs[0].exitcode is None):
                self.restarts[rank] -= 1
                self.reported.add(rank)  # the survivors' report of the lost one must not kill the new one
                self.killed.add(rank)
                self.joining[rank] = str(self.config.runtime_config.max_restarts - self.restarts[rank])
                self.procs[rank] = self._process(rank, self.joining[rank])
                self.procs[rank].start()

    def kill_reported(self, store: dist.TCPStore) -> None:
        """Kill a rank its peers reported silent (:data:`REPORT_KEY`) if it still runs (frozen: its peers are done
        with it); a restarted rank the job admitted (:data:`ADMITTED_KEY`) cleared the report about its previous
        process, so a new one is about this one."""
        for rank in _admitted(store, self.joining):
            del self.joining[rank]
            self.reported.discard(rank)
        for rank in _reported(store, self.world, self.reported):
            self.reported.add(rank)
            if self.procs[rank].exitcode is None:
                self.killed.add(rank)
                self.procs[rank].kill()

    def enforce_deadline(self) -> None:
        """Past the grace period, kill every rank still running."""
        if time.monotonic() > self.deadline:
            self.kill_all()

    def stop_orphans(self, store: dist.TCPStore) -> None:
        """The fork server was lost (killed, or a signal to the whole process group: it does not handle SIGTERM)
        while ranks still ran: their exit statuses read 255, which ``multiprocessing.popen_forkserver`` answers
        when the fork server can no longer tell. Ask them to stop after the checkpoint they agree on
        (:data:`REQUEST_KEY`, as SIGTERM would, unless a signal here asked already), give them ``grace_s``, then
        SIGKILL those still running (held by pidfd where Linux has one: a pid reused meanwhile is never hit);
        :meth:`outcome` says so."""
        self.orphans = [o for o in (_Orphan(p.pid) for p in self.procs if p.exitcode == 255 and p.pid is not None)
                        if o.running()]
        if not self.orphans:
            return
        if not self.relayed:
            store.set(REQUEST_KEY, str(int(stop.requested() or signal.SIGTERM)))
            self.relayed = True
        deadline = time.monotonic() + self.grace_s
        while any(o.running() for o in self.orphans) and time.monotonic() < deadline:
            time.sleep(self.POLL_S)
        for o in self.orphans:
            self.orphans_killed += o.kill()

    def kill_all(self) -> None:
        """SIGKILL every rank still running (an orphan of a lost fork server too)."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
        for o in self.orphans:
            o.kill()

    def terminate(self) -> None:
        """The launcher itself failed: SIGTERM every rank started, then SIGKILL those still running after 10 s
        (and at once any a lost fork server left running)."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                p.terminate()
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=10)
                if p.exitcode is None:
                    p.kill()
                elif p.exitcode == 255:
                    _Orphan(p.pid).kill()

    def outcome(self, out: Path) -> dict[str, Any]:
        """Rank 0's summary from ``out``, or the error the ranks' exits say.

        Raises:
            Interrupted: the ranks stopped on a signal after the checkpoint they agreed on.
            RunFailed: a rank failed (the first one, :meth:`note_failures`).
        """
        import json

        rank0 = self.procs[0].exitcode
        asked = stop.requested()
        if asked is None and rank0 in [128 + s for s in stop.SIGNALS]:  # a signal that reached a rank only
            asked = rank0 - 128
        # a signal while the data was prepared (no rank started), or to the whole group (the fork server's end
        # was its part)
        if asked is not None and (rank0 is None or self.orphans):
            raise Interrupted(asked, latest_step(out), out)
        if self.orphans:
            how = (f"{self.orphans_killed} of them {'was' if self.orphans_killed == 1 else 'were'} killed after "
                   f"{self.grace_s:g} s" if self.orphans_killed else "they stopped after the checkpoint they agreed on")
            raise RunFailed(f"the fork server that started the ranks was lost (killed?); {how}; "
                            f"{resume_advice(out)}", 1)
        if self.survive and rank0 == 0 and (out / "summary.json").is_file():
            return json.loads((out / "summary.json").read_text())  # the survivors finished (they said whom they lost)
        if asked is not None and rank0 == 128 + asked:  # stopped after the checkpoint the ranks agreed on
            raise Interrupted(asked, latest_step(out), out)
        if self.first is not None:  # one line for the run: the killed rank's, else the survivor's it handed over
            rank, code = self._ending()
            if code < 0:
                island = rank // self.config.runtime_config.ranks_per_island
                raise RunFailed(f"rank {rank} (island {island}) was killed by "
                                f"{signal.Signals(-code).name}; {resume_advice(out)}", 128 - code)
            # (empty: the rank printed its own line, an error of its own or one the store did not take)
            raise RunFailed(self.lines.get(rank, ("", None))[0] if code == EXIT_PEER_FAILURE else "", code)
        return json.loads((out / "summary.json").read_text())

    def _ending(self) -> tuple[int, int]:
        """(rank, exit status) of the failure that ended the run: the first rank's to fail, unless losses could be
        survived (``min_islands`` below ``islands``: the first may be one the run went on after). Then: rank 0's
        end by a signal (not by this launcher); else, where ranks stopped on a peer's failure (their lines handed
        over), the rank the lowest of them found silent if a signal ended it, else that survivor with its status;
        else the first."""
        assert self.first is not None
        if not self.survive:
            return self.first

        def signalled(rank: int) -> int | None:
            code = None if rank in self.killed else self.procs[rank].exitcode
            return code if code is not None and code < 0 else None

        if (code := signalled(0)) is not None:
            return 0, code
        if not self.lines:
            return self.first
        rank = min(self.lines)
        suspect = self.lines[rank][1]
        if suspect is not None and (code := signalled(suspect)) is not None:
            return suspect, code
        return rank, self.procs[rank].exitcode or EXIT_PEER_FAILURE


def _reported(store: dist.TCPStore, world: int, known: set[int]) -> list[int]:
    """Ranks that their peers reported silent (:data:`REPORT_KEY`) and are not in ``known``."""
    return [r for r in range(world) if r not in known and store.check([f"{REPORT_KEY}{r}"])]


def _admitted(store: dist.TCPStore, joining: dict[int, str]) -> list[int]:
    """The restarted ranks of ``joining`` (rank -> incarnation) that the job has admitted (:data:`ADMITTED_KEY`)."""
    return [r for r, n in joining.items()
            if store.check([f"{ADMITTED_KEY}{r}"]) and store.get(f"{ADMITTED_KEY}{r}").decode() == n]


class _Orphan:
    """A rank whose fork server was lost: not this process's child, so held by a pidfd (Linux 5.3+: it names
    this process, not whatever reuses its pid later), else by its pid."""

    def __init__(self, pid: int) -> None:
        self.pid, self.fd = pid, None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):  # gone already, or a kernel without pidfds
                self.fd = os.pidfd_open(pid)

    def __del__(self) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def running(self) -> bool:
        """Whether it still runs (a pidfd turns readable at the process's exit)."""
        if self.fd is not None:
            return not select.select([self.fd], [], [], 0)[0]
        return process_running(self.pid)

    def kill(self) -> int:
        """SIGKILL it if it still runs: 1 if a signal was sent, else 0."""
        if not self.running():
            return 0
        with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended between the look and the kill
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
            return 1
        return 0


class _HeldLock:
    """The run folder's lock descriptor as it travels to a rank: pickled into the rank's start, it becomes a
    duplicate of the launcher's descriptor (``multiprocessing.reduction.DupFd``, passed through the fork server),
    so the rank holds the same ``flock`` until it exits."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        return _adopt_lock, (reduction.DupFd(self.fd),)


def _adopt_lock(duplicate: Any) -> int:
    """(In the rank.) The lock's descriptor this process now owns: kept open until it exits, and not passed on to
    a program it executes (a descriptor received over a socket is inheritable)."""
    fd = int(duplicate.detach())
    os.set_inheritable(fd, False)
    return fd


def _rank_main(worker: str, config: TrainConfig, resume: bool, env: dict[str, str], lock_fd: int | None) -> None:
    """One rank started by :func:`launch`: its environment as torchrun would set it, then the job; ``lock_fd``,
    its duplicate of the run folder's lock, stays open until the process ends."""
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
    except OSError as e:  # a checkpoint's disk filled up: as `atoll train` says it (one rank says it, once)
        if not isinstance(e, PeerWriteError):
            print(disk_error_line(e, resume_advice(config.out)), file=sys.stderr, flush=True)
        sys.exit(1)


