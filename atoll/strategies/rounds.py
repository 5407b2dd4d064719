"""The round bookkeeping DiLoCo-style strategies share: H inner steps, one outer step, every island restarts.

One copy for ``diloco`` and ``sparseloco`` (docs/reliability.md): an island whose loss is not finite is
reset to the global model with a fresh inner optimizer before its next inner step; at a round's end an
island whose pseudo-gradient was not finite is left out (weight 0) and reset to the new global model; a
round in which no island contributed, or whose new global parameters are not finite, is the job diverged
(:class:`~atoll.job.divergence.Diverged`), never a silent skip.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch

from atoll.algorithms.finite import all_finite
from atoll.algorithms.outer import OuterOptimizer
from atoll.job.divergence import Diverged
from atoll.strategies.base import Strategy

if TYPE_CHECKING:
    from atoll.config import TrainConfig
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm


class OuterRounds(Strategy):
    """A strategy of synchronous rounds of ``sync_every`` inner steps and one outer step on the CPU.

    Subclasses implement :meth:`outer_step`, which ends with :meth:`commit_round`.

    Attributes:
        outer: the global parameters (float32, CPU) and the outer optimizer.
        tokens_at_sync: each local island's token count at the last round's end (its weight counts from it).
        last_sync_step: the inner steps done at the last round's end.
    """

    def __init__(self, config: TrainConfig, islands: list[Island], comm: Comm) -> None:
        super().__init__(config, islands, comm)
        self.outer = OuterOptimizer(islands[0].flat_params(), config.outer_lr, config.outer_momentum,
                                    pin=islands[0].device.type == "cuda")
        self.tokens_at_sync = [island.tokens for island in islands]
        self.last_sync_step = 0
        self.dropped_updates = 0

    def step(self, step: int) -> None:
        for position, island in enumerate(self.islands):
            if island.diverged:  # its loss is not finite: restart it from the global model (docs/reliability.md)
                self.reset_island(position, self.outer.params.detach())
                island.skip_step()
            else:
                island.inner_step()
        if (step + 1) % self.config.sync_every == 0:
            self.outer_step(step + 1)

    @abstractmethod
    def outer_step(self, steps_done: int) -> None:
        """Exchange, take the outer step, :meth:`commit_round`."""

    def reset_island(self, position: int, params: torch.Tensor) -> None:
        """Reset a diverged local island to ``params`` with a fresh inner optimizer; what it trained since the
        last sync is lost (its weight at the next sync counts its tokens from now)."""
        self.islands[position].reset_to(params)
        self.tokens_at_sync[position] = self.islands[position].tokens

    def round_weights(self) -> list[int]:
        """Each local island's tokens trained since the last round (its weight in the average; integers, as the
        collectives have always been given them, so that the mean's rounding is unchanged)."""
        return [island.tokens - t0 for island, t0 in zip(self.islands, self.tokens_at_sync, strict=True)]

    def no_contribution(self, steps_done: int) -> Diverged:
        """The error for a round in which no island of the job had a finite pseudo-gradient."""
        return Diverged(steps_done, "no island had a finite pseudo-gradient to average (every island diverged "
                                    "since the last sync)")

    def commit_round(self, new_global: torch.Tensor, dropped: list[bool], steps_done: int) -> None:
        """Restart every local island from ``new_global`` (a dropped one reset, with a fresh inner optimizer).

        Raises:
            Diverged: ``new_global`` is not finite (nothing is applied).
        """
        if not all_finite(new_global):
            raise Diverged(steps_done, "the global model is not finite after the outer step")
        for position, island in enumerate(self.islands):
            if dropped[position]:  # its weights are lost: reset it, with a fresh inner optimizer
                self.reset_island(position, new_global)
            else:
                island.set_flat_params(new_global)
        self.tokens_at_sync = [island.tokens for island in self.islands]
        self.last_sync_step = steps_done

    def finish(self, steps_done: int) -> None:
        if self.last_sync_step != steps_done:
            self.outer_step(steps_done)

    def global_params(self) -> torch.Tensor:
        return self.outer.params.detach().clone()
