"""The interface every strategy implements, so the training loop never sees which one runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from atoll.algorithms.codec_base import Codec
from atoll.algorithms.codecs import make_codec
from atoll.algorithms.finite import all_finite
from atoll.algorithms.fragments import FlatFragment
from atoll.algorithms.wire import Wire

if TYPE_CHECKING:
    from atoll.config.section import StrategyConfig
    from atoll.config.sections import CodecSection
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm


class Strategy(ABC):
    """What islands exchange and when.

    The loop calls :meth:`step` once per inner step, after every local island has run its forward and
    backward pass, and :meth:`finish` once at the end. The strategy takes the inner optimizer steps and
    issues the collectives through ``comm``.

    A strategy is built from its own config and its collaborators, never from the whole run's config.

    Args:
        config: the strategy's own config (its spec's :attr:`~atoll.strategies.spec.StrategySpec.config`:
            the shared sections it reads and its own settings).
        islands: the islands this process runs (all of them in the ``local`` runtime).
        comm: the collectives across every island of the job.
        seed: the run's seed (random sources of its exchanges, e.g. stochastic rounding).
    """

    name: str
    #: contributions left out of an average because they were not finite (see :func:`drop_non_finite`)
    dropped_updates: int = 0

    def __init__(self, config: StrategyConfig, islands: list[Island], comm: Comm, seed: int = 0) -> None:
        self.config = config
        self.islands = islands
        self.comm = comm
        self.seed = seed

    @abstractmethod
    def step(self, step: int) -> None:
        """Finish inner step ``step`` (0-based) on every local island: exchange, then optimizer steps."""

    def finish(self, steps_done: int) -> None:  # noqa: B027 - optional hook
        """Bring the global model up to date at the end of training (e.g. a last outer step)."""

    def reset_diverged(self, steps_done: int | None = None) -> int:
        """At a logging step (``steps_done`` inner steps done), where the loop reads the losses on the host
        anyway: reset the local islands that diverged since the strategy last looked (their loss not finite;
        docs/reliability.md, "Bad numbers"); returns how many. A strategy that looks at every step's exchange
        (the host path of ``ddp``, ``demo``) has nothing left to do. Collective where it resets from a peer.

        Raises:
            Diverged: no healthy island is left to reset from.
        """
        return 0

    @abstractmethod
    def global_params(self) -> torch.Tensor:
        """The global model's parameters, a flat float32 CPU vector in ``model.parameters()`` order."""

    def summary(self) -> dict[str, Any]:
        """The strategy's own entries of the run summary (its exchange layout)."""
        return {"fragments": 1, "overlap_steps": 0}

    # --- checkpoint state: what every island shares, and what each island holds alone ----------------
    def state_dict(self) -> dict[str, Any]:
        """The state every island holds alike (global parameters, outer momentum, exchanges in flight).

        In a run of one island per process every process holds the same copy; a checkpoint keeps one.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore :meth:`state_dict`."""

    def island_state(self, position: int) -> dict[str, Any]:
        """The state of the local island at ``position`` (``self.islands[position]``) alone: what it has
        trained since the last exchange, its codec's error feedback and random source, ..."""
        return {}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore :meth:`island_state` of the local island at ``position``."""


def codec_of(config: CodecSection) -> Codec:
    """The codec of a strategy's codec settings (``codec``, its block size, rounding and top-k fraction): the one
    place they become a :class:`~atoll.algorithms.codec_base.Codec` (the ``atoll syncer``'s check of a push's
    payload and an island job's encoding build it here, :func:`make_wire` through :class:`Wire`'s).

    Raises:
        ValueError: an unknown codec name.
    """
    return make_codec(config.codec, block_size=config.codec_block_size, rounding=config.codec_rounding,
                      topk_fraction=config.topk_fraction)


def make_wire(config: CodecSection, local_islands: list[int], seed: int) -> Wire:
    """The :class:`~atoll.algorithms.wire.Wire` of a strategy's codec settings (``codec``, its block size,
    rounding, top-k fraction, error feedback) for the local islands, seeded with the run's ``seed``."""
    return Wire(config.codec, local_islands, block_size=config.codec_block_size, rounding=config.codec_rounding,
                topk_fraction=config.topk_fraction, error_feedback=config.error_feedback, seed=seed)


def model_fragments(named_shapes: list[tuple[str, tuple[int, ...]]], fragments: int) -> list[FlatFragment]:
    """Each of ``fragments`` fragments of a model as ranges of the flat vector (views of the parameters, see
    :func:`atoll.algorithms.fragments.fragment_slices`), the same on every island.

    Raises:
        ConfigError: the model cannot be cut into that many fragments (names ``fragments`` and the fix).
    """
    from atoll.algorithms.fragments import fragment_slices
    from atoll.errors import ConfigError

    try:
        return fragment_slices(named_shapes, fragments)
    except ValueError as e:
        raise ConfigError(f"{e}; lower --fragments (the model's layers bound it)") from None


def drop_non_finite(tensors: list[torch.Tensor], weights: list[float]
                    ) -> tuple[list[torch.Tensor], list[float], list[bool]]:
    """Give weight 0 (and zeros) to contributions that are not finite, so they never reach the average.

    A faulty island (NaN or infinite weights after a bad step) must not corrupt the global model: its
    pseudo-gradient is left out and the mean divides by what the others contributed. Checked with
    :func:`all_finite` (one pass; the exact check only on alarm).

    Returns:
        (tensors, weights, dropped): tensors keep their shapes; ``dropped[i]`` tells whether contribution i
        was left out.
    """
    dropped = [not all_finite(t) for t in tensors]
    out_t = [torch.zeros_like(t) if bad else t for t, bad in zip(tensors, dropped, strict=True)]
    out_w = [0.0 if bad else w for w, bad in zip(weights, dropped, strict=True)]
    return out_t, out_w, dropped
