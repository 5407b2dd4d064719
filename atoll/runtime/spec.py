"""What a runtime declares about itself (:class:`RuntimeSpec`), listed in :mod:`atoll.runtime.registry`; read
by the config (its settings, its name), the entry point :func:`atoll.training.train` and ``--help``.

A spec is light: it imports neither torch nor the runtime's module, which it names by dotted path and imports
when a run is built under it (the config stays torch-free)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from atoll.config.section import RuntimeConfig

#: the two kinds of strategies: lockstep ones (a spec's ``lockstep`` class, the loop of atoll.training) and
#: asynchronous ones (islands on their own clocks, driven by the runtime's own event loop)
Kind = Literal["lockstep", "asynchronous"]


def load(path: str) -> Any:
    """The object at dotted ``path``: ``package.module:name`` (the module imported on this call).

    Raises:
        ImportError, AttributeError: no such module or name.
    """
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class RuntimeSpec:
    """What atoll needs to know of one runtime.

    Attributes:
        name: the ``--runtime`` value.
        summary: one line for the docs and the error messages.
        config: the runtime's config (a :class:`~atoll.config.section.RuntimeConfig` subclass): its settings,
            each a flag and a TOML key; a setting of another runtime's config that this one does not have is
            refused under it (:func:`atoll.config.applies.unused_setting`).
        kinds: the kinds of strategies it runs (``lockstep``, ``asynchronous``).
        lockstep: dotted path (``module:Class``) of the :class:`~atoll.runtime.base.Runtime` the lockstep loop
            meets, built as ``Class(config, facts, strategy=strategy config)`` (its own config, the run's
            :class:`~atoll.config.facts.RunFacts`, the strategy's config); None: it runs no lockstep strategy
            under ``atoll train``.
        asynchronous: dotted path (``module:function``) of its driver of an asynchronous strategy,
            ``function(config, resume) -> summary`` (an entry point: it takes the whole run's config); None:
            it drives none under ``atoll train``.
        launcher: dotted path (``module:function``) of ``function(config, entry, resume) -> summary | None``,
            which starts the job's processes where this process is not one of them (the collective runtime
            outside torchrun: :func:`atoll.runtime.collective.launch`), each running ``entry`` (``module:name``)
            with the whole config, and returns the main one's summary; None inside one of them. None: the job
            runs in this process.
        refusal: the one line ``atoll train`` answers a run under it with, where ``atoll train`` does not run
            it (the service runtime: ``atoll syncer`` and ``atoll island`` do).
    """

    name: str
    summary: str
    config: type[RuntimeConfig] = RuntimeConfig
    kinds: tuple[Kind, ...] = ("lockstep",)
    lockstep: str | None = None
    asynchronous: str | None = None
    launcher: str | None = None
    refusal: str | None = None

    def runtime_class(self) -> Callable[..., Any]:
        """The lockstep :class:`~atoll.runtime.base.Runtime` class (its module imported now).

        Raises:
            ValueError: this runtime runs no lockstep strategy under ``atoll train``.
        """
        if self.lockstep is None:
            raise ValueError(f"the {self.name} runtime runs no lockstep strategy")
        return load(self.lockstep)

    def driver(self) -> Callable[..., dict[str, Any]]:
        """The driver of an asynchronous strategy (its module imported now).

        Raises:
            ValueError: this runtime drives no asynchronous strategy under ``atoll train``.
        """
        if self.asynchronous is None:
            raise ValueError(f"the {self.name} runtime drives no asynchronous strategy")
        return load(self.asynchronous)
