"""Joining or starting a Ray cluster for a decoupled run, and the islands' placement resources."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import ray

from atoll.config import TrainConfig
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


def init_ray(config: TrainConfig) -> bool:
    """Connect to ``ray_address``, or start a local Ray; True if this call started or connected it."""
    if ray.is_initialized():
        return False
    if config.ray_address:
        ray.init(address=config.ray_address, logging_level="warning")
        return True
    paths = [str(Path(__file__).resolve().parents[3])]  # the folder atoll is imported from + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    threads = str(config.threads or 1)
    cpus = max(os.cpu_count() or 1, math.ceil(config.islands * config.ray_cpus_per_island) + 1)
    # a local Ray is one node: it declares the custom resources the islands ask for (regions, hardware
    # generations), so a run meant for a cluster can be tried on one machine
    custom: dict[str, float] = {}
    for res in island_resources(config):
        for name, amount in res.items():
            custom[name] = custom.get(name, 0.0) + amount
    ray.init(num_cpus=cpus, resources=custom or None, include_dashboard=False, logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
                                       "OMP_NUM_THREADS": threads}})
    return True


def island_resources(config: TrainConfig) -> list[dict[str, float]]:
    """Each island's custom Ray resources (``ray_island_resources``; one entry applies to every island)."""
    res = config.ray_island_resources or [{}]
    return [dict(r) for r in (res * config.islands if len(res) == 1 else res)]


class IslandLost(Exception):
    """An island actor cannot be restarted: no live node of the cluster has the resources it asks for (its node
    is gone, and with it the only place it could run); the message says which resources."""


def island_demand(config: TrainConfig, island: int) -> dict[str, float]:
    """What island ``island``'s actor asks Ray for: ``CPU``, ``GPU`` (when > 0) and its custom resources."""
    demand = {"CPU": config.ray_cpus_per_island, "GPU": config.ray_gpus_per_island, **island_resources(config)[island]}
    return {name: amount for name, amount in demand.items() if amount > 0}


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
