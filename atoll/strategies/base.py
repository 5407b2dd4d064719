"""The interface every strategy implements, so the training loop never sees which one runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from atoll.config import TrainConfig
from atoll.island import Island
from atoll.runtime.comm import Comm


class Strategy(ABC):
    """What islands exchange and when.

    The loop calls :meth:`step` once per inner step, after every local island has run its forward and
    backward pass, and :meth:`finish` once at the end. The strategy takes the inner optimizer steps and
    issues the collectives through ``comm``.

    Args:
        config: the run's configuration.
        islands: the islands this process runs (all of them in the ``local`` runtime).
        comm: the collectives across every island of the job.
    """

    name: str
    #: Dotted paths of the :meth:`state_dict` entries that hold one item per local island, in the order of
    #: ``islands`` (``*`` stands for every element of a list). A multi-process runtime uses them to merge the
    #: states of its one-island strategies into the all-island format of the ``local`` runtime, and back.
    per_island_state: tuple[str, ...] = ()
    #: contributions left out of an average because they were not finite (see :func:`drop_non_finite`)
    dropped_updates: int = 0

    def __init__(self, config: TrainConfig, islands: list[Island], comm: Comm) -> None:
        self.config = config
        self.islands = islands
        self.comm = comm

    @abstractmethod
    def step(self, step: int) -> None:
        """Finish inner step ``step`` (0-based) on every local island: exchange, then optimizer steps."""

    def finish(self, steps_done: int) -> None:  # noqa: B027 - optional hook
        """Bring the global model up to date at the end of training (e.g. a last outer step)."""

    @abstractmethod
    def global_params(self) -> torch.Tensor:
        """The global model's parameters, a flat float32 CPU vector in ``model.parameters()`` order."""

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state (outer optimizers, error-feedback residuals...), for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore :meth:`state_dict`."""

    def merge_island_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """Combine :meth:`state_dict` outputs of strategies that each ran some islands into one state.

        Args:
            states: one state per process, in island order (each for its own islands, e.g. one each).

        Returns:
            The state of one strategy running all those islands (the ``local`` runtime's format): the
            per-island entries (:attr:`per_island_state`) concatenated, every other entry from ``states[0]``
            (the same on every island: global parameters, outer momentum, results of exchanges).
        """
        return _map_per_island(states[0], self.per_island_state,
                               lambda path: [x for s in states for x in _get_path(s, path)])

    def select_island_states(self, state: dict[str, Any], positions: list[int]) -> dict[str, Any]:
        """The part of an all-island :meth:`state_dict` that belongs to the islands at ``positions``.

        Raises:
            CheckpointError: a per-island entry holds fewer items than ``positions`` needs.
        """
        from atoll.errors import CheckpointError

        def pick(path: list[str]) -> list[Any]:
            items = _get_path(state, path)
            if not items:  # e.g. no error-feedback residuals: empty for every island
                return []
            if max(positions) >= len(items):
                raise CheckpointError(f"resume: the checkpoint's strategy state holds {len(items)} islands "
                                      f"under '{'.'.join(path)}'; resume with the run's own --islands")
            return [items[p] for p in positions]

        return _map_per_island(state, self.per_island_state, pick)


def _get_path(state: Any, path: list[str]) -> Any:
    for key in path:
        state = state[int(key)] if isinstance(state, list) else state[key]
    return state


def _map_per_island(state: dict[str, Any], patterns: tuple[str, ...], fn: Any) -> dict[str, Any]:
    """A copy of ``state`` (containers copied, leaves shared) with each path matching ``patterns`` replaced
    by ``fn(path)``, ``path`` a list of keys (list indices as strings)."""
    import copy

    out = copy.copy(state)
    for pattern in patterns:
        for path in _expand(out, pattern.split(".")):
            parent = _get_path(out, path[:-1])
            value = fn(path)
            if isinstance(parent, list):
                parent[int(path[-1])] = value
            else:
                parent[path[-1]] = value
    return out


def _expand(state: Any, parts: list[str], prefix: list[str] | None = None) -> list[list[str]]:
    """The concrete paths of a pattern; copies the containers on the way so replacing does not alias."""
    prefix = prefix or []
    if not parts:
        return [prefix]
    head, rest = parts[0], parts[1:]
    node = _get_path(state, prefix) if prefix else state
    keys = [str(i) for i in range(len(node))] if head == "*" else [head]
    paths = []
    for k in keys:
        child = node[int(k)] if isinstance(node, list) else node[k]
        if isinstance(child, (list, dict)) and rest:
            child = list(child) if isinstance(child, list) else dict(child)
            if isinstance(node, list):
                node[int(k)] = child
            else:
                node[k] = child
        paths += _expand(state, rest, prefix + [k])
    return paths


def drop_non_finite(tensors: list[torch.Tensor], weights: list[float]
                    ) -> tuple[list[torch.Tensor], list[float], list[bool]]:
    """Give weight 0 (and zeros) to contributions that are not finite, so they never reach the average.

    A faulty island (NaN or infinite weights after a bad step) must not corrupt the global model: its
    pseudo-gradient is left out and the mean divides by what the others contributed.

    Returns:
        (tensors, weights, dropped): tensors keep their shapes; ``dropped[i]`` tells whether contribution i
        was left out.
    """
    dropped = [not bool(torch.isfinite(t).all()) for t in tensors]
    out_t = [torch.zeros_like(t) if bad else t for t, bad in zip(tensors, dropped, strict=True)]
    out_w = [0.0 if bad else w for w, bad in zip(weights, dropped, strict=True)]
    return out_t, out_w, dropped


class Wire:
    """The codec a strategy's exchanges use, with each local island's error feedback and random source.

    ``codec == "fp32"`` without error feedback sends tensors as they are (no encode/decode round trip).
    Random sources for stochastic rounding are seeded by (seed, island) and saved in checkpoints, so a
    resumed run rounds exactly as an uninterrupted one.
    """

    def __init__(self, config: TrainConfig, local_islands: list[int]) -> None:
        from atoll.algorithms.codecs import ErrorFeedback, make_codec

        lossy = config.codec != "fp32"
        self.codec = make_codec(config.codec, block_size=config.codec_block_size, rounding=config.codec_rounding,
                                topk_fraction=config.topk_fraction) if lossy else None
        self.feedback = ([ErrorFeedback(self.codec) for _ in local_islands]
                         if lossy and config.error_feedback else None)
        self.generators = None
        if lossy and config.codec_rounding == "stochastic":
            self.generators = [torch.Generator().manual_seed(config.seed * 1_000_003 + i) for i in local_islands]

    def kwargs(self, key: str) -> dict[str, Any]:
        """Keyword arguments of ``Comm.all_reduce_mean`` for the tensor named ``key``."""
        return {"codec": self.codec, "feedback": self.feedback, "key": key, "generators": self.generators}

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": [f.state_dict() for f in self.feedback] if self.feedback else [],
                "generators": [g.get_state() for g in self.generators] if self.generators else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f, s in zip(self.feedback or [], state["feedback"], strict=False):
            f.load_state_dict(s)
        for g, s in zip(self.generators or [], state["generators"], strict=False):
            g.set_state(s)
