"""Shared fixtures: a small real-text corpus, a fast config, and the ``atoll`` command run in this process
(:func:`run_cli`) or in a subprocess with a timeout (:func:`run_atoll`, for what needs a process of its own).

Tests marked ``slow`` train models, start processes or run benchmarks; ``python -m pytest -m "not slow"`` is
the fast tier (under a minute), ``python -m pytest`` runs everything.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from atoll.config.applies import applicable

# one thread: tiny models gain nothing from more, and two OpenMP pools spinning on a busy 2-core machine (the
# tests beside other jobs) slow every step many-fold
torch.set_num_threads(1)

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for ``pytest -n 2 --dist loadgroup`` (pytest-xdist; the marks do nothing without it): a module's
    tests stay on one worker, so a module-scoped fixture (a shared trained run) is built once; every test that
    names Ray shares one group, so two local Ray clusters (each a dozen processes) never start at once on the
    2-core machine."""
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            ray = "ray" in item.nodeid.lower()
            item.add_marker(pytest.mark.xdist_group("ray" if ray else item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _no_fault_hook():
    """No test leaves a fault hook installed (:func:`atoll.job.divergence.set_fault_hook`) for the next."""
    from atoll.job.divergence import set_fault_hook

    yield
    set_fault_hook(None)


@pytest.fixture()
def fault_hook():
    """``fault_hook("weights:1:3,grad:0:2")`` installs :func:`atoll.job.divergence.nan_faults` of that spec
    for this test (removed after it): the in-process way to inject faults. A child process is told with
    :data:`atoll.job.divergence.FAULT_HOOK_ENV` in its environment instead."""
    from atoll.job.divergence import nan_faults, set_fault_hook

    def install(spec: str) -> None:
        set_fault_hook(nan_faults(spec))

    return install


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~300 KB .txt corpus: stdlib sources of a few packages, one document per file."""
    files = sorted((STDLIB / "json").glob("*.py")) + sorted((STDLIB / "email").glob("*.py"))
    files += sorted((STDLIB / "asyncio").glob("*.py"))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n\n".join(f.read_text(encoding="utf-8") for f in files))
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("atoll-cache")


@pytest.fixture()
def fast_config(corpus_file: Path, cache_dir: Path, tmp_path: Path) -> dict:
    """Settings of a run that takes a few seconds on 2 CPU cores."""
    return {
        "data": str(corpus_file), "cache_dir": str(cache_dir), "model": "micro", "vocab_size": 512,
        "seq_len": 32, "batch_size": 4, "islands": 2, "steps": 20, "sync_every": 5, "eval_every": 10,
        "eval_batches": 2, "checkpoint_every": 10, "progress": False, "out": str(tmp_path / "run"),
        "threads": 1,
    }


@pytest.fixture()
def syncer(fast_config: dict, tmp_path: Path):  # noqa: ANN201 - a function serving a syncer of given settings
    """``serve(**settings)`` -> (SyncerServer, address, credentials): a decoupled run's syncer (2 fragments, 2
    islands, the run's codec unless ``codec`` is given) in this process, plaintext on loopback; stopped after the
    test."""
    from concurrent import futures

    import grpc

    from atoll.config import build_config
    from atoll.runtime.service.server import SyncerServer

    servers = []

    def serve(**settings: object) -> tuple:
        base = {k: v for k, v in fast_config.items() if k not in ("eval_every", "checkpoint_every")}
        config = build_config(None, {**base, "strategy": "decoupled", "runtime": "service", "fragments": 2,
                                     **settings})
        creds = ["a" * 32, "b" * 32]
        state = SyncerServer.of_run(config, tmp_path / "syncer", creds)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[state.handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return state, f"127.0.0.1:{port}", creds

    yield serve
    for server in servers:
        server.stop(grace=0)


def service_clients(state, address: str, creds: list[str]) -> tuple:  # noqa: ANN001
    """Island 0's leader and its second rank (bulk only), island 1's leader; both islands joined (the run
    starts); island 0 granted a round of steps. Returns (leader0, rank1, leader1, session0, session1)."""
    from atoll.runtime.service.client import SyncerClient

    numels = state.service.syncer.numels
    lead = SyncerClient(address, 0, creds[0], plaintext=True)
    rank1 = SyncerClient(address, 0, creds[0], plaintext=True, control=False)
    other = SyncerClient(address, 1, creds[1], plaintext=True)
    s0 = lead.call("Join", {"numels": numels})["session"]
    s1 = other.call("Join", {"numels": numels})["session"]
    assert lead.call("ReserveSteps", {"n": 5})["granted"] == 5
    return lead, rank1, other, s0, s1


def upload_halves(state, lead, rank1) -> tuple:  # noqa: ANN001
    """Two ranks' halves of one push of fragment 0 (a Δ of seed 0, scaled 1e-3), each encoded with the run's codec
    and uploaded by its rank (ids ``s.0.1.<rank>``), not committed: (delta, halves, encoded, ids)."""
    from atoll.runtime.service import slices, wire

    delta = torch.randn(state.service.syncer.numels[0], generator=torch.Generator().manual_seed(0)) * 1e-3
    halves = slices.even_parts(state.service.syncer.index[0], 2)
    encoded = [state.codec.encode(slices.take(delta, part.ranges)) for part in halves]
    ids = [client.upload(wire.payload_bytes(e.tensors), 0, part.ranges, f"s.0.1.{r}")
           for r, (client, part, e) in enumerate(zip((lead, rank1), halves, encoded, strict=True))]
    return delta, halves, encoded, ids


def cli_flags(settings: dict) -> list[str]:
    """The command-line flags of a settings dict: ``{"sync_every": 5, "progress": False}`` ->
    ``["--sync-every", "5", "--no-progress"]``; settings its strategy and runtime do not read (``sync_every``
    under ddp, from a fixture shared by several strategies) are left out, as ``atoll train`` would refuse them
    (:func:`atoll.config.applies.applicable`, as the benchmarks do)."""
    flags = []
    for key, value in applicable(settings).items():
        flag = "--" + key.replace("_", "-")
        flags += ([flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)])
    return flags


def run_cli(*args: str) -> SimpleNamespace:
    """Run ``atoll ARGS`` in this process: its exit status and what it printed (``returncode``, ``stdout``,
    ``stderr``, as :func:`run_atoll`). For commands that fail fast (bad input): a valid ``train`` would train."""
    from atoll.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own errors
            code = e.code if isinstance(e.code, int) else 1
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def run_atoll(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the ``atoll`` command in a subprocess; a hang fails the test at ``timeout`` seconds."""
    return subprocess.run([sys.executable, "-m", "atoll.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], world: int, timeout: float, **env: str) -> tuple[list[int | None], list[str],
                                                                                 list[str]]:
    """Start ``world`` processes of ``python ARGV`` as torchrun starts its ranks (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a free loopback port; one torch thread each; ``env`` added),
    wait for all up to ``timeout`` seconds and kill what is left. Returns each rank's exit code, stdout and stderr.

    Raises:
        subprocess.TimeoutExpired: a rank ran past ``timeout`` (it and the others are killed).
    """
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1", **env}
    # files, not pipes: a rank blocked on a full pipe while its peer is read would stall the collective
    with contextlib.ExitStack() as files:
        logs = [(files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
                for _ in range(world)]
        procs = [subprocess.Popen([sys.executable, *argv], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=out, stderr=err, text=True) for r, (out, err) in enumerate(logs)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                p.kill()
                p.wait()
        texts = []
        for out, err in logs:
            out.seek(0), err.seek(0)
            texts.append((out.read(), err.read()))
    return [p.returncode for p in procs], [o for o, _ in texts], [e for _, e in texts]


def syncer_commits_on_disk(out: Path) -> int:
    """The outer steps of the newest syncer checkpoint under the run folder ``out`` (its ``latest`` pointer
    names ``step_<commits>``), or -1 while there is none (decoupled runs on Ray and the syncer service)."""
    latest = out / "syncer" / "checkpoints" / "latest"
    try:
        name = os.readlink(latest) if latest.is_symlink() else latest.read_text().strip()
        return int(name.split("_")[1])
    except (OSError, IndexError, ValueError):
        return -1


def make_island(index: int, model: torch.nn.Module, config, clock=None, total_steps: int | None = None,
                speed: float = 1.0, optimizer=None, island_type=None):
    """A test's island from a whole run's ``config``: :func:`atoll.job.island.build_island` with its island
    settings (the schedule over ``total_steps``, default ``steps``) and the strategy's inner optimizer
    (``optimizer``: a spec's ``inner_optimizer``), as the entry points build one."""
    from atoll.config.facts import IslandSettings
    from atoll.job.island import Island, build_island, inner_optimizer

    return build_island(index, model, IslandSettings.of(config, total_steps),
                        inner_optimizer(config.strategy_config, optimizer), clock, speed, island_type or Island)


class CrashAfterCheckpoint(Exception):
    """Raised by :func:`train_crashed_and_resumed`'s checkpoint writer after the checkpoint it was told to cut at."""


def train_crashed_and_resumed(overrides: dict, out: Path, monkeypatch: pytest.MonkeyPatch, step: int) -> dict:
    """Train ``overrides`` into ``out``, cut right after the checkpoint of ``step`` is written (as a kill would),
    then resume it from its folder; the resumed run's summary."""
    import atoll.job.run as run_mod
    from atoll.config import build_config, load_run_config
    from atoll.training import train

    real_save = run_mod.save_checkpoint

    def save_then_crash(run_out, at, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        path = real_save(run_out, at, *args, **kwargs)
        if at == step:
            raise CrashAfterCheckpoint()
        return path

    monkeypatch.setattr(run_mod, "save_checkpoint", save_then_crash)
    with pytest.raises(CrashAfterCheckpoint):
        train(build_config(overrides={**overrides, "out": str(out)}))
    monkeypatch.setattr(run_mod, "save_checkpoint", real_save)
    return train(load_run_config(out), resume=True)


class ThreadRanks:
    """The ranks of an island job as threads of this process, for a test of
    :class:`~atoll.runtime.service.exchange.ServiceTransport`: the collectives it makes of its island group
    (``agree``: the element-wise minimum; ``all_gather``; the leader's ints and bytes broadcast), each a
    rendezvous of all ``n`` (60 s at most)."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=60), [None] * n

    def rank(self, r: int):  # noqa: ANN201 - (the group of rank r)
        ranks = self

        class Rank:
            rank, size, leader = r, ranks.n, r == 0

            @staticmethod
            def _all(x: object) -> list:
                ranks.slots[r] = x
                ranks.barrier.wait()
                out = list(ranks.slots)
                ranks.barrier.wait()
                return out

            def agree(self, local: torch.Tensor) -> torch.Tensor:
                return torch.stack(self._all(local.clone())).min(dim=0).values

            def all_gather(self, mine: torch.Tensor, sizes: list[int]) -> torch.Tensor:
                return torch.cat([x[:n].float() for x, n in zip(self._all(mine.clone()), sizes, strict=True)])

            def broadcast_ints(self, values: list[int]) -> list[int]:
                return list(self._all(list(values))[0])

            def broadcast_bytes(self, data: bytes | None, size: int) -> bytearray:
                got = self._all(None if data is None else bytes(data))[0]
                assert len(got) == size
                return bytearray(got)

        return Rank()
