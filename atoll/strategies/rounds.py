"""The round bookkeeping DiLoCo-style strategies share: inner steps, then an exchange of pseudo-gradients.

One copy for ``diloco``, ``sparseloco`` and ``streaming`` (docs/reliability.md); each strategy keeps only its
maths. :class:`Rounds` holds, per exchanged part of the model (the whole model, or each fragment of
``streaming``), the global parameters and their outer optimizer (float32, CPU) and a :class:`RoundClock`
(each local island's tokens at the part's last sync, the step of that sync); it resets an island whose loss
is not finite to the global model with a fresh inner optimizer (:meth:`Rounds.reset_diverged`) at the start
of every exchange, before its pseudo-gradient is taken, and at the loop's logging steps, where the losses are
read anyway: nothing is read on the host in the inner steps between (a diverged island's steps are skipped
on its device, its gradient not being finite); it syncs at the end every part trained since its last sync
(:meth:`Rounds.finish`), and checkpoints that state in the format the strategies have always written.
:class:`OuterRounds` adds the synchronous whole-model round of
``diloco`` and ``sparseloco``: at a round's end an island whose pseudo-gradient was not finite is left out
(weight 0) and reset to the new global model; a round in which no island contributed, or whose new global
parameters are not finite, is the job diverged (:class:`~atoll.job.divergence.Diverged`), never a silent skip.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from atoll.algorithms.finite import all_finite
from atoll.algorithms.outer import OuterOptimizer
from atoll.config.section import StrategyConfig
from atoll.config.sections import OuterOptimSection, SyncSection
from atoll.job.divergence import Diverged
from atoll.strategies.base import Strategy

if TYPE_CHECKING:
    from atoll.algorithms.fragments import FlatFragment
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm


class RoundsConfig(SyncSection, OuterOptimSection, StrategyConfig):
    """The config of a strategy of outer rounds: H and the outer optimizer (its subclasses add the rest)."""


class RoundClock:
    """The bookkeeping of one exchanged part of the model (the whole model, or one fragment).

    Args:
        islands: the local islands; their token counts now start the first round.

    Attributes:
        tokens_at_sync: each local island's token count at the part's last sync (its weight counts from it).
        last_sync_step: the inner steps done at the part's last sync (0 before the first).
    """

    def __init__(self, islands: list[Island]) -> None:
        self.tokens_at_sync = [island.tokens for island in islands]
        self.last_sync_step = 0

    def weights(self, islands: list[Island]) -> list[int]:
        """Each local island's tokens trained since the last sync (its weight in the average; integers, as the
        collectives have always been given them, so that the mean's rounding is unchanged)."""
        return [island.tokens - t0 for island, t0 in zip(islands, self.tokens_at_sync, strict=True)]

    def commit(self, islands: list[Island], steps_done: int) -> None:
        """A sync after ``steps_done`` inner steps: every island's weight counts from its tokens now."""
        self.tokens_at_sync = [island.tokens for island in islands]
        self.last_sync_step = steps_done


class Rounds(Strategy):
    """Strategies that exchange pseudo-gradients of global parameters held on the CPU, per part of the model.

    Subclasses implement :meth:`after_inner` (when to exchange, after every inner step) and :meth:`sync` (one
    part's exchange at the end of training), and call :meth:`reset_diverged` as an exchange starts;
    :meth:`drain` finishes what is in flight first.

    Args:
        config: the strategy's config (a :class:`RoundsConfig`: ``sync_every``, ``outer_lr``, ``outer_momentum``).
        islands: the local islands.
        comm: the collectives across every island of the job.
        seed: the run's seed.
        index: the fragments, each synced on its own (``streaming``); None: the whole model at once.

    Attributes:
        outers: one outer optimizer (global parameters, float32, CPU; pinned with an accelerator) per part.
        clocks: one :class:`RoundClock` per part.
        numel: the length of the island's flat vector: the model's parameter count (a sharded island's rank:
            its shard's).
    """

    #: checkpoint lists with one entry per part (``streaming``), rather than the one part's entries alone
    fragmented: bool = False

    config: RoundsConfig

    def __init__(self, config: RoundsConfig, islands: list[Island], comm: Comm, seed: int = 0,
                 index: list[FlatFragment] | None = None) -> None:
        super().__init__(config, islands, comm, seed)
        self.index = index
        self.numel = sum(p.numel() for p in islands[0].local_params())  # a sharded island's: its rank's shard
        pin = islands[0].device.type == "cuda"  # pinned host backups (torchft's)
        # the whole model: flat_params() (a sharded island's is its rank's shard, and takes no fragment)
        starts = [islands[0].flat_params()] if index is None else [islands[0].flat_params(frag) for frag in index]
        self.outers = [OuterOptimizer(flat, config.outer_lr, config.outer_momentum, pin=pin) for flat in starts]
        self.clocks = [RoundClock(islands) for _ in self.outers]
        self.dropped_updates = 0

    def step(self, step: int) -> None:
        for island in self.islands:  # nothing read on the host: a diverged island's step is skipped on its device
            island.inner_step()
        self.after_inner(step)

    def reset_diverged(self, steps_done: int | None = None) -> int:
        """Restart every local island whose last loss is not finite from the global model, with a fresh inner
        optimizer (docs/reliability.md, "Bad numbers"); its weight in each part's next sync counts its tokens
        from now. Reads each island's last loss on the host: called as an exchange starts (before the
        pseudo-gradients, which a diverged island's NaN weights would otherwise poison) and at the loop's
        logging steps, never in between. Returns the islands reset."""
        reset = 0
        for position, island in enumerate(self.islands):
            if island.diverged:
                self.reset_island(position, self._restart_params())
                reset += 1
        return reset

    @abstractmethod
    def after_inner(self, step: int) -> None:
        """After 0-based inner step ``step`` of every local island: the exchanges due now."""

    @abstractmethod
    def sync(self, part: int, steps_done: int) -> None:
        """Exchange part ``part`` at the end of training, after ``steps_done`` inner steps, and apply it."""

    def drain(self) -> None:  # noqa: B027 - optional hook
        """Apply every exchange still in flight (before :meth:`finish` syncs what is left)."""

    def finish(self, steps_done: int) -> None:
        """Apply what is in flight, then sync every part trained since its last sync (no overlap)."""
        self.drain()
        for part, clock in enumerate(self.clocks):
            if clock.last_sync_step != steps_done:
                self.sync(part, steps_done)

    def _restart_params(self) -> torch.Tensor:
        """The global parameters a diverged island restarts from, float32 (numel,)."""
        return self.outers[0].params.detach() if self.index is None else self.global_params()

    def reset_island(self, position: int, params: torch.Tensor) -> None:
        """Reset a diverged local island to ``params`` (float32, (numel,)) with a fresh inner optimizer; what it
        trained since each part's last sync is lost (its weights at the next syncs count its tokens from now)."""
        island = self.islands[position]
        island.reset_to(params)
        for clock in self.clocks:
            clock.tokens_at_sync[position] = island.tokens

    def global_params(self) -> torch.Tensor:
        if self.index is None:
            return self.outers[0].params.detach().clone()
        flat = torch.empty(self.numel, dtype=torch.float32)
        for frag, outer in zip(self.index, self.outers, strict=True):
            frag.scatter_(flat, outer.params.detach())
        return flat

    def _per_part(self, values: list[Any]) -> Any:
        return values if self.fragmented else values[0]

    def _parts(self, value: Any) -> list[Any]:
        return list(value) if self.fragmented else [value]

    # --- checkpoint state: ``outer`` and ``last_sync_step`` shared, ``tokens_at_sync`` per island; per part
    # lists where fragmented, else the one part's entries (the format of every checkpoint written so far) -----
    def state_dict(self) -> dict[str, Any]:
        return {"outer": self._per_part([o.state_dict() for o in self.outers]),
                "last_sync_step": self._per_part([c.last_sync_step for c in self.clocks])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for outer, s in zip(self.outers, self._parts(state["outer"]), strict=True):
            outer.load_state_dict(s)
        for clock, s in zip(self.clocks, self._parts(state["last_sync_step"]), strict=True):
            clock.last_sync_step = int(s)

    def island_state(self, position: int) -> dict[str, Any]:
        return {"tokens_at_sync": self._per_part([c.tokens_at_sync[position] for c in self.clocks])}

    def load_island_state(self, position: int, state: dict[str, Any]) -> None:
        for clock, t in zip(self.clocks, self._parts(state["tokens_at_sync"]), strict=True):
            clock.tokens_at_sync[position] = int(t)


class OuterRounds(Rounds):
    """A strategy of synchronous rounds of ``sync_every`` inner steps and one outer step over the whole model.

    Subclasses implement :meth:`outer_step`, which ends with :meth:`commit_round`.

    Attributes:
        outer: the global parameters (float32, CPU) and the outer optimizer.
        tokens_at_sync: each local island's token count at the last round's end (its weight counts from it).
        last_sync_step: the inner steps done at the last round's end.
    """

    @property
    def outer(self) -> OuterOptimizer:
        """The outer optimizer of the whole model (its global parameters: float32 (numel,), CPU)."""
        return self.outers[0]

    @property
    def tokens_at_sync(self) -> list[int]:
        """Each local island's token count at the last round's end (:class:`RoundClock`)."""
        return self.clocks[0].tokens_at_sync

    @property
    def last_sync_step(self) -> int:
        """The inner steps done at the last round's end (:class:`RoundClock`)."""
        return self.clocks[0].last_sync_step

    def after_inner(self, step: int) -> None:
        if (step + 1) % self.config.sync_every == 0:
            self.reset_diverged()
            self.outer_step(step + 1)

    def sync(self, part: int, steps_done: int) -> None:
        self.reset_diverged()
        self.outer_step(steps_done)

    @abstractmethod
    def outer_step(self, steps_done: int) -> None:
        """Exchange, take the outer step, :meth:`commit_round`."""

    def round_weights(self) -> list[int]:
        """Each local island's tokens trained since the last round (:meth:`RoundClock.weights`)."""
        return self.clocks[0].weights(self.islands)

    def no_contribution(self, steps_done: int) -> Diverged:
        """The error for a round in which no island of the job had a finite pseudo-gradient with tokens to weigh
        it."""
        return Diverged(steps_done, "no island had a finite pseudo-gradient to average (every island diverged "
                                    "since the last sync, or none trained on a token since it)")

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
        self.clocks[0].commit(self.islands, steps_done)
