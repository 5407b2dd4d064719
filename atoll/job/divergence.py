"""Divergence: an island whose weights went bad is reset; a job that diverged stops with its summary.

An island has *diverged* when its training loss is not finite (NaN or infinite weights make every loss
NaN): its weights are lost, so it is reset (:meth:`atoll.job.island.Island.reset_to`) from the global model
(``diloco``, ``streaming``, ``decoupled``) or from a healthy peer's replica (``ddp``, ``demo``), and counted
in ``island_resets``. The lockstep strategies read the losses on the host only at their exchanges and at the
loop's logging steps (:meth:`atoll.strategies.base.Strategy.reset_diverged`), never inside an inner step: a
diverged island is reset there, before its weights reach an exchange (docs/reliability.md, "Bad numbers").
A gradient that is not finite on weights that are (an overflow) only skips that island's step
(``skipped_steps``, :meth:`~atoll.job.island.Island.clip_gradients`).

The *job* has diverged when no island is left to copy from (every island diverged at once, or every
pseudo-gradient of an exchange was not finite), when the global model's held-out loss is not finite or
above :data:`LOSS_BOUND_FACTOR` x ln(vocabulary) (far worse than a uniform guess), or when the islands were
reset more than :data:`RESET_LIMIT` times each on average. It then stops: :class:`Diverged` carries the
step and what went wrong; the driver writes the summary with a ``diverged`` entry and the ``atoll``
command prints :func:`message` and exits with status 1.

Tests inject faults through a hook they install (:func:`set_fault_hook`; the ``fault_hook`` fixture of
``tests/conftest.py``): the loops call :func:`inject_fault`, which does nothing unless one is installed, and
never read the environment. :func:`nan_faults` is the usual hook (``weights:ISLAND:STEP`` or
``grad:ISLAND:STEP``, 1-based inner step, comma separated: that island's weights or gradient become NaN at
that step); :func:`atoll.job.faults.kill_faults` kills or freezes a rank of the collective runtime as it starts
a step. A process started for a test (``atoll`` in a subprocess, a rank of the collective runtime) is told
by ONE mechanism, read once as it starts, never in a step: :data:`FAULT_HOOK_ENV` (and
:data:`atoll.job.faults.KILL_HOOK_ENV`) in its environment, which :func:`install_fault_hook_from_env` (called
by ``atoll``'s entry, each launched rank's and each Ray island actor's) turns into those hooks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from atoll.errors import ConfigError

if TYPE_CHECKING:
    from atoll.config.section import StrategyConfig
    from atoll.config.sections import ScheduleSection
    from atoll.job.island import Island

#: resets per island, on average over the job's islands, past which the job counts as diverged
RESET_LIMIT = 5
#: a held-out loss (nats per token) above this many times ln(vocabulary size) counts as diverged
LOSS_BOUND_FACTOR = 10.0
#: test only, read once at process start (:func:`install_fault_hook_from_env`): ``weights:ISLAND:STEP`` or
#: ``grad:ISLAND:STEP`` (comma separated) make that island's weights (before its forward pass) or gradient
#: (after its backward pass) NaN at that 1-based inner step
FAULT_HOOK_ENV = "ATOLL_TEST_NAN_AT"
#: a fault hook: ``hook(island, step, kind, **where)`` with the 0-based inner step and ``kind`` "weights" or "grad"
#: (every runtime) or "start" (a rank of the collective runtime starting the step; ``where``: its ``rank`` and
#: ``first_rejoin``, :mod:`atoll.job.faults`); a hook ignores the kinds and keywords it has no use for
FaultHook = Callable[..., None]
_fault_hook: FaultHook | None = None


class Diverged(Exception):
    """The job diverged at inner step ``step`` (1-based): ``what`` says how (one clause, no advice)."""

    def __init__(self, step: int, what: str) -> None:
        super().__init__(f"step {step}: {what}")
        self.step = step
        self.what = what


def eval_diverged(loss: float, vocab_size: int) -> str | None:
    """Why a held-out loss (nats per token) means the global model diverged, or None when it does not."""
    if not math.isfinite(loss):
        return f"the global model's held-out loss is {loss}"
    bound = LOSS_BOUND_FACTOR * math.log(vocab_size)
    if loss > bound:
        return (f"the global model's held-out loss is {loss:.4g}, above {LOSS_BOUND_FACTOR:g} x ln(vocabulary) = "
                f"{bound:.4g} (a uniform guess scores {math.log(vocab_size):.4g})")
    return None


def resets_diverged(resets: int, islands: int) -> str | None:
    """Why ``resets`` island resets over a job of ``islands`` islands mean it diverged, or None."""
    if resets > RESET_LIMIT * islands:
        return f"the islands were reset {resets} times, more than {RESET_LIMIT} per island"
    return None


def check_eval(step: int, loss: float, vocab_size: int) -> None:
    """Raise :class:`Diverged` at ``step`` when the held-out loss ``loss`` says so (:func:`eval_diverged`)."""
    why = eval_diverged(loss, vocab_size)
    if why:
        raise Diverged(step, why)


def check_resets(step: int, resets: int, islands: int) -> None:
    """Raise :class:`Diverged` at ``step`` when the job's island resets are past the limit."""
    why = resets_diverged(resets, islands)
    if why:
        raise Diverged(step, why)


def learning_rates(strategy: StrategyConfig) -> tuple[str, ...]:
    """The learning rates of a strategy's own config, in its order: every setting of it named ``lr`` or ending
    in ``_lr`` (ddp: lr; diloco: lr, outer_lr; demo: demo_lr; a plain-averaging FedAvg, no outer optimizer:
    lr)."""
    return tuple(name for name in type(strategy).model_fields if name == "lr" or name.endswith("_lr"))


def advice(strategy: StrategyConfig, schedule: ScheduleSection) -> str:
    """What to change before starting again: lower the learning rates of the ``strategy``'s own config
    (:func:`learning_rates`: a strategy without an outer optimizer, ddp, demo or a plain-averaging FedAvg, is
    never told of ``--outer-lr``), raise the run's warmup (``schedule``: the run's section; where it has
    ``steps`` and the warmup is capped at a tenth of them, more steps), and keep its gradient clipping on."""
    lower = " or ".join(f"--{name.replace('_', '-')} (it is {getattr(strategy, name):g})"
                        for name in learning_rates(strategy))
    clip = "" if schedule.grad_clip > 0 else ", keep --grad-clip on"
    given, steps = schedule.warmup_steps, getattr(schedule, "steps", None)
    if isinstance(steps, int) and given > steps // 10:  # the warmup is capped at a tenth of the run: raising it
        warmup = f"lengthen the warmup with --steps (--warmup-steps {given} is capped at a tenth of --steps " \
                 f"{steps}: {steps // 10})"  # alone changes nothing
    else:
        warmup = f"raise --warmup-steps (it is {given})"
    return f"{'lower ' + lower + ', ' if lower else ''}{warmup}{clip}, and start again"


def record(strategy: StrategyConfig, schedule: ScheduleSection, error: Diverged) -> dict[str, Any]:
    """The summary's ``diverged`` entry: ``step`` (1-based inner step), ``reason``, ``fix`` (:func:`advice`, from
    the ``strategy``'s own config and the run's ``schedule``)."""
    return {"step": error.step, "reason": error.what, "fix": advice(strategy, schedule)}


def until_diverged(run: Callable[..., Any], *args: Any) -> Diverged | None:
    """Call ``run(*args)`` (a driver's loop); return the :class:`Diverged` that stopped it, or None."""
    try:
        run(*args)
    except Diverged as e:
        return e
    return None


def island_extras(strategy: StrategyConfig, schedule: ScheduleSection, islands: list[Island],
                  diverged: Diverged | None) -> dict[str, Any]:
    """The summary's entries of a driver that holds every island: ``island_resets`` (per island, when one
    was reset) and ``diverged`` (:func:`record` with the ``strategy``'s config and the run's ``schedule``, when
    the job diverged)."""
    resets = [i.reset_count for i in islands]
    return {**({"island_resets": resets} if any(resets) else {}),
            **({"diverged": record(strategy, schedule, diverged)} if diverged is not None else {})}


def message(diverged: dict[str, Any]) -> str:
    """The one line a diverged run ends with: ``training diverged at step N: <reason>; <fix>``."""
    return f"training diverged at step {diverged['step']}: {diverged['reason']}; {diverged['fix']}"


def set_fault_hook(hook: FaultHook | None) -> FaultHook | None:
    """Install ``hook`` (None: none) as the fault hook :func:`inject_fault` calls; return the one it replaces.

    For tests only: the ``fault_hook`` fixture of ``tests/conftest.py`` installs one and removes it after
    the test.
    """
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    return previous


def parse_faults(spec: str, source: str = FAULT_HOOK_ENV) -> list[tuple[str, int, int]]:
    """``weights:ISLAND:STEP`` or ``grad:ISLAND:STEP`` entries, comma separated, as ``(kind, island, step)``
    (``step`` 1-based).

    Raises:
        ConfigError: a malformed entry (names ``source`` and the format).
    """
    faults = []
    for item in spec.split(","):
        try:
            kind, island, step = item.split(":")
            if kind not in ("weights", "grad"):
                raise ValueError(kind)
            faults.append((kind, int(island), int(step)))
        except ValueError:
            raise ConfigError(f"{source}: expected weights|grad:ISLAND:STEP (e.g. grad:1:3), got "
                              f"{item!r}") from None
    return faults


def nan_faults(spec: str, source: str = FAULT_HOOK_ENV) -> FaultHook:
    """The fault hook of ``spec`` (:func:`parse_faults`, parsed now): at each of its entries it fills that
    island's parameters (``weights``, before the forward pass) or their gradients (``grad``, after the
    backward pass) with NaN.

    Raises:
        ConfigError: a malformed ``spec``.
    """
    faults = frozenset(parse_faults(spec, source))

    def hook(island: Island, step: int, kind: str, **_: Any) -> None:
        if (kind, island.index, step + 1) not in faults:
            return
        with torch.no_grad():
            for p in island.params:
                if kind == "weights":
                    p.fill_(math.nan)
                elif p.grad is not None:
                    p.grad.fill_(math.nan)

    return hook


def install_fault_hook_from_env() -> None:
    """At a process's start (``atoll``'s entry, a launched rank's): install the faults a test's child process
    is told in its environment: :func:`nan_faults` of :data:`FAULT_HOOK_ENV`, and the kill hook of
    :data:`atoll.job.faults.KILL_HOOK_ENV` (:func:`atoll.job.faults.kill_faults`) and the pace hook of
    :data:`atoll.job.faults.PACE_HOOK_ENV` (:func:`atoll.job.faults.pace_faults`), all that are set, in that order;
    otherwise nothing.

    Raises:
        ConfigError: a malformed value.
    """
    from atoll.job.faults import kill_faults_from_env, pace_faults_from_env

    value = os.environ.get(FAULT_HOOK_ENV)
    hooks = [hook for hook in (nan_faults(value) if value else None, kill_faults_from_env(), pace_faults_from_env())
             if hook is not None]
    if len(hooks) == 1:
        set_fault_hook(hooks[0])
    elif hooks:
        def both(island: Island, step: int, kind: str, **where: Any) -> None:
            for hook in hooks:
                hook(island, step, kind, **where)

        set_fault_hook(both)


def inject_fault(island: Island, step: int, kind: str, **where: Any) -> None:
    """Call the installed fault hook (:func:`set_fault_hook`; nothing when none is) for ``island`` at
    0-based inner step ``step``: ``kind="weights"`` before its forward pass, ``"grad"`` after its backward,
    ``"start"`` as a rank of the collective runtime starts the step (``where``: ``rank``, ``first_rejoin``)."""
    if _fault_hook is not None:
        _fault_hook(island, step, kind, **where)
