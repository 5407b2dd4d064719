"""``outer_kernel = "compiled"``: where a strategy's compiled outer round runs, how it is built, and how it gives up.

Shared by diloco (the whole round at once), streaming (each fragment's round in two halves), whose loops are
:class:`~atoll.algorithms.fused_round.FusedRound`, and sparseloco (the accumulation,
:class:`~atoll.algorithms.fused_accumulate.FusedAccumulate`). The setting is checked against the run by
:func:`validate` (a run's config) and again by :meth:`CompiledRounds.build_fused` (a strategy built from the
API). A process that has compiled these loops too often already (torch's recompile limit: a sweep of many
settings in one process) runs the eager round instead, said once and in the summary.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from torch import Tensor

from atoll.algorithms.fused_round import FusedRound
from atoll.errors import ConfigError, exception_line

if TYPE_CHECKING:
    from atoll.algorithms.wire import Wire
    from atoll.config.section import RunSettings
    from atoll.config.sections import OuterKernelSection
    from atoll.job.island import Island
    from atoll.runtime.comm import Comm

#: why ``outer_kernel = "compiled"`` is refused under another runtime and on an accelerator
NEEDS_LOCAL = ("outer_kernel: the compiled round needs every island in this process; pass --runtime local, or "
               "--outer-kernel eager")
NEEDS_CPU = "outer_kernel: the compiled round runs on the CPU; pass --device cpu, or --outer-kernel eager"

#: a strategy's compiled loops (:class:`FusedRound`, :class:`~atoll.algorithms.fused_accumulate.FusedAccumulate`)
Loops = TypeVar("Loops")


def validate(own: OuterKernelSection, run: RunSettings) -> None:
    """``outer_kernel = "compiled"`` runs only where every island is in this process on the CPU.

    Raises:
        ValueError: compiled under another runtime, or on an accelerator (one line naming the fix).
    """
    if own.outer_kernel != "compiled":
        return
    if run.runtime != "local":
        raise ValueError(NEEDS_LOCAL)
    if run.device not in ("auto", "cpu"):
        raise ValueError(NEEDS_CPU)


class CompiledRounds(Generic[Loops]):
    """A strategy's compiled outer round: built (:meth:`build_compiled`, :meth:`build_fused`), counted and given up.

    Attributes:
        fused: the compiled loops, or None (eager: the setting's default, or given up).
        compiled_rounds: rounds (streaming: fragments' rounds) the compiled loops ran.
        compile_skipped: why the compiled round was given up (one line), or None.
    """

    fused: Loops | None = None
    compiled_rounds: int = 0
    compile_skipped: str | None = None
    islands: list[Island]
    wire: Wire

    def build_compiled(self, config: Any, islands: list[Island], comm: Comm,
                       build: Callable[[], Loops]) -> Loops | None:
        """The compiled loops of ``outer_kernel = "compiled"`` (None: eager), made by ``build``, which compiles
        them before training starts; every island's parameters made one vector.

        Args:
            config: the strategy's config (its ``outer_kernel``).
            build: makes the loops and compiles them (their ``warm_up``).

        Raises:
            ConfigError: compiled, but the islands are not all in this process on the CPU, or the machine cannot
                compile (no C++ compiler, ...).
        """
        if config.outer_kernel != "compiled":
            return None
        if not comm.in_memory:
            raise ConfigError(NEEDS_LOCAL)
        if any(island.device.type != "cpu" for island in islands):
            raise ConfigError(NEEDS_CPU)
        try:
            fused = build()
        except Exception as e:  # noqa: BLE001 - whatever the compiler raises, one line
            from torch._dynamo.exc import FailOnRecompileLimitHit  # (loaded by the compile: no start-up cost)

            if isinstance(e, FailOnRecompileLimitHit):  # it compiled, too often in this process
                self.give_up(e)
                return None
            raise ConfigError(f"outer_kernel: torch.compile cannot build the round here ({exception_line(e)}); pass "
                              "--outer-kernel eager") from None
        for island in islands:  # one vector per island: a compiled loop is one call
            island.make_contiguous()
        return fused

    def build_fused(self, config: Any, islands: list[Island], comm: Comm, wire: Wire,
                    warm_up: Callable[[FusedRound], None]) -> FusedRound | None:
        """:meth:`build_compiled` of a :class:`FusedRound` (diloco's, streaming's round) with the outer optimizer's
        and the codec's settings, compiled by ``warm_up`` (:meth:`FusedRound.warm_up`, ...).

        Raises:
            ConfigError: as :meth:`build_compiled`.
        """
        def build() -> FusedRound:
            fused = FusedRound(config.outer_lr, config.outer_momentum, codec=wire.codec,
                               error_feedback=config.error_feedback)
            warm_up(fused)
            return fused

        return self.build_compiled(config, islands, comm, build)  # type: ignore[arg-type]

    def contiguous_views(self) -> list[Tensor] | None:
        """Every island's parameters as one flat fp32 vector (shape ``(N,)``, where they lie), or None where one's
        are not (:meth:`~atoll.job.flat_views.FlatViews.contiguous_params`): the eager round then runs."""
        views = [island.contiguous_params() for island in self.islands]
        return None if any(v is None for v in views) else views  # type: ignore[return-value]

    def compiled_inputs(self, globals_: Tensor, key: str) -> tuple[list[Tensor], list[Tensor] | None] | None:
        """Every island's parameters as one flat fp32 vector (:meth:`contiguous_views`) and, with error
        feedback, each island's residual of the exchange ``key`` (the shape of ``globals_``, on the CPU): what a
        compiled loop reads. None where the eager round must run instead: an island's parameters are not one vector
        (:meth:`~atoll.job.flat_views.FlatViews.contiguous_params`), or a residual does not exist yet (its first
        encode keeps it), has another shape or lies off the CPU."""
        views = self.contiguous_views()
        residuals = None if self.wire.feedback is None else [f.residual(key) for f in self.wire.feedback]
        if views is None or (residuals is not None and any(
                r is None or r.shape != globals_.shape or r.device.type != "cpu" for r in residuals)):
            return None
        return views, residuals  # type: ignore[return-value]  # (None checked above)

    def give_up(self, why: Exception | str) -> None:
        """The eager round from now on, said once (a warning) and in the summary's ``outer_kernel_skipped``."""
        self.fused, self.compile_skipped = None, why if isinstance(why, str) else exception_line(why)
        warnings.warn(f"outer_kernel compiled given up, the eager round from now on: {self.compile_skipped}",
                      RuntimeWarning, stacklevel=3)

    def compiled_state(self, outer_kernel: str) -> dict[str, Any]:
        """The checkpoint's ``outer_rounds_compiled`` where the setting is compiled (read by
        :meth:`load_compiled_state`)."""
        return {"outer_rounds_compiled": self.compiled_rounds} if outer_kernel == "compiled" else {}

    def load_compiled_state(self, state: dict[str, Any]) -> None:
        """The count of compiled rounds from a checkpoint (0 where it was eager)."""
        self.compiled_rounds = int(state.get("outer_rounds_compiled", 0))

    def compiled_summary(self, outer_kernel: str) -> dict[str, Any]:
        """The summary's ``outer_rounds_compiled`` (and ``outer_kernel_skipped``) where the setting is compiled."""
        if outer_kernel != "compiled":
            return {}
        return {"outer_rounds_compiled": self.compiled_rounds,
                **({"outer_kernel_skipped": self.compile_skipped} if self.compile_skipped else {})}
