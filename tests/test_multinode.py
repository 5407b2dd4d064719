"""More than one machine, emulated: two network namespaces joined by veth links stand for two hosts.

Each host is a namespace of :class:`~atoll.benchmarks.netns.EmulatedWan` (its own interfaces, addresses and ports;
the only way out is its ``wan0`` at 10.77.0.1 or 10.77.0.2, links at 1 Gbit/s), so whatever one host's
processes say to the other's crosses the veth link, never the loopback. Two setups, as a user runs them on two
real hosts (docs/runtimes.md, "Real processes: the collective runtime" and "Ray: the decoupled
strategy on actors"):

- torchrun on each host (static rendezvous at host 0's address) running a ``diloco`` collective job, one
  island per host: it ends with bitwise the weights of the same job on one host, and the links carried at
  least the bytes atoll counted;
- a Ray cluster, head on host 0 and a worker on host 1 (``ray start``), running ``decoupled`` with one island
  on each node; the worker node is killed mid-run (every process in its namespace), and the run still
  finishes: the head's island trains and is merged on, the lost island is reported.

Needs root and ``ip netns`` (skipped with the reason otherwise); the Ray test also needs Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import cli_flags
from safetensors.torch import load_file

from atoll.benchmarks.namespaces import netns_pids, unavailable_reason
from atoll.benchmarks.netns import IFNAME, EmulatedWan
from atoll.errors import CheckpointError
from atoll.job.checkpoint import latest_checkpoint, load_checkpoint

REASON = unavailable_reason()
two_hosts = pytest.mark.skipif(REASON is not None, reason=f"two hosts in network namespaces: {REASON}")

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
RATE_MBPS = 1000  # fast links: the tests are about where the bytes go, not how long they take


@pytest.fixture()
def settings(corpus_file: Path, cache_dir: Path) -> dict:
    return {"data": str(corpus_file), "cache_dir": str(cache_dir), "model": "micro", "vocab_size": 512,
            "seq_len": 32, "batch_size": 4, "islands": 2, "threads": 1, "eval_batches": 2, "progress": False}


def _env(**extra: str) -> dict[str, str]:
    """This environment without any rank's variables, atoll importable, one thread per process, no GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "RAY_ADDRESS")}
    path = [str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env.update({"PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **extra})
    return env


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:07d}" / "model" / "model.safetensors"))


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    return [p.poll() for p in procs]


# ----------------------------------------------------------------------------------------------------------
# torchrun on two hosts


@pytest.mark.slow
@two_hosts
def test_torchrun_on_two_hosts_trains_as_one_host(settings: dict, tmp_path: Path) -> None:
    run = {**settings, "strategy": "diloco", "runtime": "collective", "steps": STEPS, "sync_every": 5,
           "eval_every": STEPS, "checkpoint_every": 0}
    # the same job on one host (atoll's launcher); it also fills the data cache both hosts then read
    one = subprocess.run([sys.executable, "-m", "atoll.cli", "train",
                          *cli_flags({**run, "out": str(tmp_path / "one")})],
                         capture_output=True, text=True, timeout=180, env=_env())
    assert one.returncode == 0, one.stderr[-3000:]

    out = tmp_path / "two"
    argv = [*cli_flags({**run, "out": str(out)})]
    with EmulatedWan(islands=2, rate_mbps=RATE_MBPS) as wan:
        before = wan.counters()
        procs = []
        for node in range(2):  # what a user types on each host (docs/runtimes.md): rendezvous at host 0's address
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1", "--master-addr", wan.island_ip(0), "--master-port", "29400",
                   "-m", "atoll.cli", "train", *argv]
            with open(tmp_path / f"host{node}.log", "w") as log:  # a file: a pipe nobody reads could fill up
                procs.append(wan.popen(node, cmd, env=_env(GLOO_SOCKET_IFNAME=IFNAME), stdout=log,
                                       stderr=subprocess.STDOUT))
        codes = _wait_all(procs, 150)
        after = wan.counters()
    logs = [(tmp_path / f"host{node}.log").read_text() for node in range(2)]
    assert codes == [0, 0], "\n".join(f"host {n}: {log[-2000:]}" for n, log in enumerate(logs))
    assert "run folder:" in logs[0] and "run folder:" not in logs[1]  # rank 0 (host 0) speaks for the run

    # bitwise the one-host job: the same collectives, only over a link instead of the loopback
    mine, ref = _weights(out, STEPS), _weights(tmp_path / "one", STEPS)
    assert mine.keys() == ref.keys()
    assert all(torch.equal(mine[k], ref[k]) for k in ref)
    summary = json.loads((out / "summary.json").read_text())
    ref_summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    for key in ("final_eval_loss", "tokens", "bytes_sent_per_island", "exchanges"):
        assert summary[key] == ref_summary[key], key
    # what atoll counted left each host over its link (plus headers, ACKs, the store and the final gather)
    sent = [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before, strict=True)]
    assert summary["bytes_sent_per_island"] > 0
    assert all(s >= summary["bytes_sent_per_island"] for s in sent), (sent, summary["bytes_sent_per_island"])


# ----------------------------------------------------------------------------------------------------------
# a Ray cluster on two hosts, and the loss of one


def _syncer_state(out: Path) -> dict | None:
    """The syncer's newest checkpoint (``<out>/syncer``), or None before its first."""
    for _ in range(5):  # a checkpoint may be replaced while it is read
        try:
            return load_checkpoint(latest_checkpoint(out / "syncer"))[1]
        except (CheckpointError, OSError):
            time.sleep(0.1)
    return None


def test_an_island_is_lost_when_no_live_node_has_its_resources(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    from atoll.config.runtimes import RayConfig
    from atoll.runtime.ray import cluster
    from atoll.runtime.ray.cluster import placeable

    config = RayConfig(ray_island_resources="host_a=1;host_b=1", ray_cpus_per_island=2)  # of 2 islands
    assert cluster.island_demand(config, 2, 1) == {"CPU": 2.0, "host_b": 1.0}  # no GPU asked: not a demand
    head = {"Alive": True, "Resources": {"CPU": 4.0, "host_a": 1.0}}
    worker = {"Alive": True, "Resources": {"CPU": 4.0, "host_b": 1.0}}
    monkeypatch.setattr(ray, "nodes", lambda: [head, worker])
    assert placeable(cluster.island_demand(config, 2, 0)) and placeable(cluster.island_demand(config, 2, 1))
    monkeypatch.setattr(ray, "nodes", lambda: [head, {**worker, "Alive": False}])  # the worker node died
    assert placeable(cluster.island_demand(config, 2, 0)) and not placeable(cluster.island_demand(config, 2, 1))
    monkeypatch.setattr(ray, "nodes", lambda: [head, {"Alive": True, "Resources": {"CPU": 1.0, "host_b": 1.0}}])
    assert not placeable(cluster.island_demand(config, 2, 1))  # a node with the resource but too few CPUs in total


@pytest.mark.slow
@two_hosts
@pytest.mark.skipif(shutil.which("ray") is None, reason="needs Ray (the `ray` command): pip install 'ray[default]'")
def test_ray_cluster_on_two_hosts_survives_losing_the_worker_node(settings: dict, tmp_path: Path) -> None:
    steps = 150
    out = tmp_path / "ray-run"
    temp_dir = Path(f"/tmp/atoll-ray-{os.getpid()}-{secrets.token_hex(2)}")  # Ray's sockets: a short path
    # the cluster's own token (Ray's token authentication stays on), given to every node and to the driver
    env = _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    # the head declares a node dead after 3 failed health checks 1 s apart (Ray's default: 5, 3 s apart)
    head_env = {**env, "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    node_flags = ["--num-cpus", "1", "--object-store-memory", str(80 * 2**20), "--disable-usage-stats"]
    try:
        with EmulatedWan(islands=2, rate_mbps=RATE_MBPS) as wan:
            head = wan.island_ip(0)
            for node, cmd in ((0, ["--head", "--port", "6379", "--include-dashboard", "false", "--temp-dir",
                                   str(temp_dir), "--resources", '{"host_a": 1}']),
                              (1, ["--address", f"{head}:6379", "--resources", '{"host_b": 1}'])):
                start = wan.popen(node, ["ray", "start", "--node-ip-address", wan.island_ip(node), *cmd, *node_flags],
                                  env=head_env if node == 0 else env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                log = start.communicate(timeout=120)[0]
                assert start.returncode == 0, log[-3000:]
            # island 0 on the head, island 1 on the worker; the driver runs on the head
            driver_log = tmp_path / "driver.log"  # a file: a pipe nobody reads could fill up
            with open(driver_log, "w") as log:
                driver = wan.popen(0, [sys.executable, "-m", "atoll.cli", "train", *cli_flags({
                    **settings, "strategy": "decoupled", "runtime": "ray", "ray_address": f"{head}:6379",
                    "ray_island_resources": "host_a=1;host_b=1", "fragments": 2, "sync_every": 4, "steps": steps,
                    "out": str(out)})], env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 150
            pid_files = [out / "ray" / f"island_{i}.pid" for i in range(2)]
            while not all(f.is_file() for f in pid_files) or (state := _syncer_state(out)) is None \
                    or state["syncer"]["commits"] < 2:  # both islands up, the syncer committing
                assert driver.poll() is None, driver_log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no commit within 150 s"
                time.sleep(0.2)
            pids = [int(f.read_text()) for f in pid_files]
            syncer_pid = int((out / "ray" / "syncer.pid").read_text())
            assert pids[0] in netns_pids(wan.island_ns[0]) and pids[1] in netns_pids(wan.island_ns[1])
            assert syncer_pid in netns_pids(wan.island_ns[0])  # beside the driver and the run folder
            # the worker node dies: every process in its namespace (its raylet, agents and island 1)
            for pid in netns_pids(wan.island_ns[1]):
                os.kill(pid, signal.SIGKILL)
            merged_at_kill = state["syncer"]["merged_tokens_per_island"]
            try:
                driver.wait(timeout=150)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the run did not finish within 150 s of the worker node's loss: "
                            f"{driver_log.read_text()[-3000:]}")
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    output = driver_log.read_text()
    assert driver.returncode == 0, output[-3000:]
    assert "atoll: warning: island 1 lost its node and cannot be restarted (no live node has CPU=1, host_b=1)" in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_islands"] == [1] and summary["failures"] == [0, 1], summary
    assert summary["abandoned_islands"] == [] and summary["rejoins"] == [0, 0] and summary["syncer_restarts"] == 0
    # the head's island trained on and was merged after the loss: it took the lost island's share of the budget
    assert sum(summary["steps_per_island"]) == 2 * steps
    assert summary["steps_per_island"][0] > steps
    final = _syncer_state(out)["syncer"]["merged_tokens_per_island"]
    assert final[0] > merged_at_kill[0]
    assert summary["island_nodes"][0] is not None and summary["island_nodes"][1] is None
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
