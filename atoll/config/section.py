"""The building block of atoll's configuration: a section of settings owned by one component.

:class:`atoll.config.train.TrainConfig` is assembled from sections (run, model, data, inner and outer
optimizer, codec, network, output, the runtimes', and each strategy's own, declared in the strategy's
module). Every section field keeps today's flat flag (``--sync-every``) and TOML key (``sync_every``), and a
component can ask for just its section with :meth:`Section.of`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

S = TypeVar("S", bound="Section")


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

    @classmethod
    def of(cls: type[S], config: Any) -> S:
        """This section's values taken from a whole config (any object with these attributes)."""
        return cls.model_construct(**{name: getattr(config, name) for name in cls.model_fields})
