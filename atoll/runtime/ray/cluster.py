"""Joining or starting a Ray cluster for a decoupled run, and the islands' placement resources."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import ray

from atoll.config.runtimes import RayConfig
from atoll.errors import ConfigError


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast when nothing answers at ``address`` (``host:port`` or ``ray://host:port``; ``auto`` unchecked).

    ``ray.init`` retries an unreachable cluster for minutes; a TCP connect with a deadline tells at once.

    Raises:
        ConfigError: malformed address, or no listener at it within ``timeout_s`` seconds.
    """
    import socket

    if not address or address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray_address: '{address}' is not HOST:PORT (ray start --head prints it, e.g. "
                          "10.0.0.1:6379); fix --ray-address")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"ray_address: no Ray cluster answers at {address} ({e.strerror or e}); start one with "
                          "`ray start --head` there or fix --ray-address") from None


#: tries of a local Ray's start (:func:`start_local_ray`)
START_TRIES = 3


def start_local_ray(**kwargs: Any) -> None:
    """``ray.init(**kwargs)`` of a local Ray (no address), tried again (up to :data:`START_TRIES` times) when
    Ray gives up waiting for its raylet: Ray waits a fixed 30 s for the raylet to register with its GCS
    (``ray/_private/node.py``), which a loaded machine can exceed (seen at a 1-minute load of 5 on 2 cores);
    what was started is shut down before the next try.

    Raises:
        Exception: Ray's own, when the last try fails too (or at once for any other error).
    """
    for attempt in range(START_TRIES):
        try:
            ray.init(**kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this case
            if "timed out during startup" not in str(e) or attempt == START_TRIES - 1:
                raise
            ray.shutdown()


def init_ray(config: RayConfig, islands: int, threads: int | None = None) -> bool:
    """Connect to ``ray_address``, or start a local Ray for ``islands`` island actors (each with ``threads``
    torch threads, default 1); True if this call started or connected it.

    Ray's own output (its workers' lines, the autoscaler's, its info logs) stays out of atoll's unless
    ``ray_logs`` (``--ray-logs``) asks for it: ``log_to_driver`` and ``logging_level``. atoll's islands and
    syncer report through the driver, so nothing of the run is lost; an actor's traceback still reaches the
    driver with the error it raises."""
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": config.ray_logs, "logging_level": "info" if config.ray_logs else "error"}
    if config.ray_address:
        ray.init(address=config.ray_address, **quiet)
        return True
    # the folder atoll is imported from, then this process's PYTHONPATH (the islands import what the driver can)
    paths = [str(Path(__file__).resolve().parents[3])]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    cpus = max(os.cpu_count() or 1, math.ceil(islands * config.ray_cpus_per_island) + 1)
    # a local Ray is one node: it declares the custom resources the islands ask for (regions, hardware
    # generations), so a run meant for a cluster can be tried on one machine
    custom: dict[str, float] = {}
    for res in island_resources(config, islands):
        for name, amount in res.items():
            custom[name] = custom.get(name, 0.0) + amount
    start_local_ray(num_cpus=cpus, resources=custom or None, include_dashboard=False, **quiet,
                    runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
                                              "OMP_NUM_THREADS": str(threads or 1)}})
    return True


def island_resources(config: RayConfig, islands: int) -> list[dict[str, float]]:
    """Each of the ``islands`` islands' custom Ray resources (``ray_island_resources``; one entry applies to
    every island)."""
    res = config.ray_island_resources or [{}]
    return [dict(r) for r in (res * islands if len(res) == 1 else res)]


class IslandLost(Exception):
    """An island actor cannot be restarted: no live node of the cluster has the resources it asks for (its node
    is gone, and with it the only place it could run); the message says which resources."""


def island_demand(config: RayConfig, islands: int, island: int) -> dict[str, float]:
    """What island ``island``'s actor (of ``islands``) asks Ray for: ``CPU``, ``GPU`` (when > 0) and its custom
    resources."""
    demand = {"CPU": config.ray_cpus_per_island, "GPU": config.ray_gpus_per_island,
              **island_resources(config, islands)[island]}
    return {name: amount for name, amount in demand.items() if amount > 0}


def _offer(resources: dict[str, float]) -> str:
    """A node's resources as ``CPU=2, GPU=0, region_a=1`` (CPU and GPU always, memory and Ray's own
    per-node markers left out)."""
    shown = {"CPU": resources.get("CPU", 0.0), "GPU": resources.get("GPU", 0.0),
             **{k: v for k, v in sorted(resources.items())
                if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")}}
    return ", ".join(f"{k}={v:g}" for k, v in shown.items())


def _field(name: str) -> str:
    """The setting that asks for resource ``name``."""
    return {"CPU": "ray_cpus_per_island", "GPU": "ray_gpus_per_island"}.get(name, "ray_island_resources")


def check_resources(config: RayConfig, islands: int) -> None:
    """Refuse, before any actor is placed, ``islands`` islands that no node of the cluster can ever run.

    Ray queues an actor whose resources no node has and waits for an autoscaler to add one, forever on a
    fixed cluster (printing only its own autoscaler errors). So each island's demand (:func:`island_demand`)
    must fit on one live node's total resources, and the islands together in the cluster's (they all run at
    once for the whole run).

    Raises:
        ConfigError: one line naming the setting, the resource asked for and what the nodes offer.
    """
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    offers = "; ".join(f"node {i}: {_offer(r)}" for i, r in enumerate(nodes)) or "no live node"
    for island in range(islands):
        demand = island_demand(config, islands, island)
        if any(all(r.get(name, 0.0) >= amount for name, amount in demand.items()) for r in nodes):
            continue
        lacking = [name for name, amount in demand.items() if not any(r.get(name, 0.0) >= amount for r in nodes)]
        short = lacking[0] if lacking else next(iter(demand))  # else: each on some node, never all on one
        asked = ", ".join(f"{name}={amount:g}" for name, amount in demand.items())
        raise ConfigError(f"{_field(short)}: island {island} asks Ray for {asked} and no node of the cluster has "
                          f"{short}={demand[short]:g} ({offers}); lower --{_field(short).replace('_', '-')} or add a "
                          "node that offers it (ray start --resources / --num-gpus)")
    total: dict[str, float] = {}
    for island in range(islands):
        for name, amount in island_demand(config, islands, island).items():
            total[name] = total.get(name, 0.0) + amount
    for name, amount in total.items():
        have = sum(r.get(name, 0.0) for r in nodes)
        if amount > have + 1e-9:
            raise ConfigError(f"{_field(name)}: the {islands} islands ask Ray for {name}={amount:g} in all, "
                              f"and the cluster has {name}={have:g} ({offers}); the islands run at once, so lower "
                              f"--islands or --{_field(name).replace('_', '-')}, or add nodes")


def placeable(demand: dict[str, float]) -> bool:
    """True when some live node of the cluster has at least ``demand`` of every resource in total (in use or
    not): an actor restarted with that demand will run once the resources are free."""
    return any(node["Alive"] and all(node["Resources"].get(name, 0.0) >= amount for name, amount in demand.items())
               for node in ray.nodes())


def wait_restarted(actor: Any, demand: dict[str, float], timeout_s: float = 120.0) -> None:
    """Block until a restarting island actor answers again (calls fail while Ray restarts it).

    Args:
        actor: the island's actor handle.
        demand: the resources it asks for (:func:`island_demand`), checked against the live nodes while waiting.
        timeout_s: the longest wait, seconds.

    Raises:
        IslandLost: no live node has ``demand`` any more (its node died and no other offers the resources), so
            Ray cannot restart it; seen as soon as Ray declares the node dead.
        RayActorError: the actor died for good (its restarts are used up) or did not answer in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.pid.remote(), timeout=max(1.0, min(2.0, deadline - time.monotonic())))
            return
        except ray.exceptions.ActorDiedError:
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if not placeable(demand):
                wanted = ", ".join(f"{name}={amount:g}" for name, amount in demand.items())
                raise IslandLost(f"no live node has {wanted}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
