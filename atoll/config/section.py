"""The building blocks of atoll's configuration: sections of settings, and the configs components own.

A :class:`Section` is a group of settings (a pydantic model, ``extra="forbid"``). A
:class:`StrategyConfig` is a strategy's whole config: the shared sections it reads (H, the outer
optimizer, the codec...) and its own settings, declared in the strategy's module; a :class:`RuntimeConfig`
is a runtime's (:mod:`atoll.config.runtimes`). :class:`atoll.config.train.TrainConfig` holds the settings
every run reads plus the chosen strategy's and runtime's configs (the tree), selected by the names
``strategy`` and ``runtime``. Every field keeps its flat flag (``--sync-every``) and TOML key
(``sync_every``). No torch and no strategy here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    """A group of settings of one component (a pydantic model: typed, validated, each field documented)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse ``true``/``false`` for a field that is not a switch (pydantic would read ``true`` as 1)."""
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if annotation is not bool and "bool" not in str(annotation):
                text = str(annotation)
                kind = "a whole number" if "int" in text else "a number" if "float" in text else "a value"
                raise ValueError(f"expected {kind}, not true/false (a switch); write the value itself")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_empty_text(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse an empty or blank string for a text or path setting: ``--out ""`` (an unset shell variable)
        would mean the current folder, ``--tokenizer ""`` the default."""
        if isinstance(value, str) and not value.strip() and info.field_name is not None:
            annotation = str(cls.model_fields[info.field_name].annotation)
            if ("str" in annotation or "Path" in annotation) and "list" not in annotation:
                raise ValueError("empty; pass a value, or leave the setting out for its default")
        return value


class StrategyConfig(Section):
    """A strategy's config: every setting the strategy reads beyond those of every run (a subclass per
    strategy, in its module, listed in its spec: :attr:`atoll.strategies.spec.StrategySpec.config`).

    A subclass inherits the shared sections it reads (``SyncSection``, ``AdamWSection``, ``OuterOptimSection``,
    ``CodecSection``, ``FragmentsSection`` of :mod:`atoll.config.sections`), declares its own fields, and may
    change a shared field's default for itself (streaming's ``codec = "int4"``). It is built and validated
    alone, without a run: ``DiLoCoConfig(sync_every=100)``. The base has no settings (a strategy that reads
    none of them).
    """

    #: setting -> what this strategy reads in its place, said when that setting is refused under it
    instead: ClassVar[dict[str, str]] = {}


class RuntimeConfig(Section):
    """A runtime's config: every setting the runtime reads beyond those of every run
    (:mod:`atoll.config.runtimes`)."""


class RunSettings(Protocol):
    """What a strategy's check across owners (its spec's ``validate``) reads of the run beside its own config: the
    run's own settings (:data:`atoll.config.sections.RUN_SECTIONS`), never another owner's. The run's whole
    config is one; a protocol here, so that a strategy's module depends on this leaf and not on the config that
    assembles every strategy."""

    strategy: str
    runtime: str
    islands: int
    steps: int
    model: str
    device: str
