"""The building block of atoll's configuration: a section of settings owned by one component.

:class:`atoll.config.train.TrainConfig` is assembled from sections (run, model, data, inner and outer
optimizer, codec, network, output, the runtimes', and each strategy's own, declared in the strategy's
module). Every section field keeps today's flat flag (``--sync-every``) and TOML key (``sync_every``), and a
component can ask for just its section with :meth:`Section.of`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

S = TypeVar("S", bound="Section")


class Section(BaseModel):
    """A group of settings of one component (a pydantic model: typed, validated, each field documented)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @classmethod
    def of(cls: type[S], config: Any) -> S:
        """This section's values taken from a whole config (any object with these attributes)."""
        return cls.model_construct(**{name: getattr(config, name) for name in cls.model_fields})
