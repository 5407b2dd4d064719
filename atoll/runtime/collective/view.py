"""What the collective runtime's helpers (:mod:`~atoll.runtime.collective.quorum`,
:mod:`~atoll.runtime.collective.rejoin`, :mod:`~atoll.runtime.collective.report`,
:mod:`~atoll.runtime.collective.checkpointing`, :mod:`~atoll.runtime.collective.evaluation`) use of a
:class:`~atoll.runtime.collective.runtime.CollectiveRuntime`: a protocol, so that they annotate their ``rt``
without importing the runtime, which imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from atoll.config.facts import RunFacts
    from atoll.config.runtimes import CollectiveConfig
    from atoll.runtime.collective.comm import DistComm
    from atoll.runtime.collective.heartbeat import _Heartbeat
    from atoll.runtime.collective.job_tokens import JobTokens
    from atoll.runtime.collective.membership import Membership
    from atoll.runtime.collective.sharding import ShardLayout


class CollectiveView(Protocol):
    """One rank of the collective runtime, as its helpers see it: its place in the job, the islands alive,
    its store, groups and comm, and the calls that re-form the groups or end the process."""

    config: CollectiveConfig
    facts: RunFacts
    torch_ddp: bool
    rank: int
    world: int
    islands: int
    ranks_per_island: int
    island: int
    position: int
    is_main: bool
    step: int | None
    membership: Membership
    heartbeat: _Heartbeat | None
    store: dist.Store
    prefix: str
    control: Any
    comm: DistComm
    recovery_s: list[float]
    job_tokens: JobTokens
    #: --async-checkpoint's state (:class:`~atoll.runtime.collective.async_checkpoint.BackgroundCheckpoints`, which
    #: builds on this protocol)
    background: Any
    #: the survivors' quorum (:class:`~atoll.runtime.collective.quorum.Quorum`, which builds on this protocol), or
    #: None where a loss is not survived
    quorum: Any

    @property
    def layout(self) -> ShardLayout:
        """Sharded islands: the layout of the island's shards."""

    def full_params(self, params: torch.Tensor) -> torch.Tensor:
        """Sharded islands: every rank's shard of ``params`` gathered into the whole vector (collective)."""

    def close_groups(self) -> None:
        """Close this rank's connections and process groups at once."""

    def init_epoch(self) -> None:
        """Join the default group of the membership's epoch and form its groups."""

    def abort(self, reason: str, suspect: int | None = None, *, advice: str | None = None) -> None:
        """Print why this rank stops and exit (does not return)."""
