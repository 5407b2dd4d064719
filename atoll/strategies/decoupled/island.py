"""One island (a learner) of Decoupled DiLoCo: inner steps, pushes and pulls, the same under every runtime.

Each island runs inner AdamW steps on its own shard at its own speed. On the staggered fragment schedule of
Streaming DiLoCo (fragment p after ``offset_p, offset_p + H, ...`` of the island's own inner steps, where an
island's H is proportional to its speed, :func:`local_sync_every`) it pushes that fragment's
pseudo-gradient Δ = θ_global(v) − θ_island with its token count and the version v it started from, and
trains on while the push travels, waits for its merge, and the merged fragment travels back; on arrival the
merged fragment replaces the island's own, the work done meanwhile kept on top (:meth:`IslandWorker.adopt`).
:meth:`IslandWorker.run` is that loop on a real clock (the ``ray`` runtime); the ``local`` runtime's event
simulation (:mod:`atoll.runtime.events`) calls the same steps in simulated time.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import PreTrainedModel

from atoll.algorithms.fragments import FlatFragment, fragments_due
from atoll.algorithms.outer import pseudo_gradient
from atoll.job.data import PreparedData, sample_batch
from atoll.job.divergence import inject_fault
from atoll.job.island import Island, build_island, inner_optimizer
from atoll.strategies.base import make_wire, model_fragments
from atoll.strategies.decoupled import DecoupledConfig, island_speeds, local_sync_every
from atoll.strategies.decoupled.downlink import apply_pull, pull_codec
from atoll.strategies.decoupled.protocol import Pull, Push

if TYPE_CHECKING:
    from atoll.config.facts import IslandSettings, RunFacts


@dataclass
class Job:
    """What every island and the syncer of a decoupled run share: settings, data, the initial model, fragments.

    Attributes:
        own: the decoupled strategy's config.
        facts: the run's facts the islands read (islands, steps, seed, batch, tokens per step).
        settings: how an island is built (its schedule set per island, :func:`expected_steps`).
        index: per fragment, its ranges of the flat vector (:class:`~atoll.algorithms.fragments.FlatFragment`,
            views of the parameters; the same on every island).
        init_flat: the initial global parameters, float32 (numel,), in ``model.parameters()`` order.
    """

    own: DecoupledConfig
    facts: RunFacts
    settings: IslandSettings
    data: PreparedData
    model: PreTrainedModel
    index: list[FlatFragment]
    init_flat: torch.Tensor

    @classmethod
    def of(cls, own: DecoupledConfig, facts: RunFacts, settings: IslandSettings, data: PreparedData,
           model: PreTrainedModel) -> Job:
        """The job of a run's data and initial model (its fragments cut from the model's layers).

        Raises:
            ConfigError: the model has fewer layers than ``fragments``.
        """
        index = model_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], own.fragments)
        init_flat = torch.nn.utils.parameters_to_vector([p.detach() for p in model.parameters()]).float().clone()
        return cls(own, facts, settings, data, model, index, init_flat)

    @property
    def shares(self) -> list[float]:
        """Each fragment's share of the parameters (its numel over the model's), summing to 1."""
        return [int(idx.numel()) / int(self.init_flat.numel()) for idx in self.index]


def expected_steps(own: DecoupledConfig, islands: int, steps: int) -> list[int]:
    """Each island's share of the ``islands x steps`` budget, proportional to its speed (its LR schedule)."""
    speeds = island_speeds(own, islands)
    return [max(1, math.ceil(islands * steps * s / sum(speeds))) for s in speeds]


class Transport(Protocol):
    """How an island on a real clock reaches the syncer (:meth:`IslandWorker.run`; the ``ray`` runtime's)."""

    def reserve_step(self) -> bool:
        """Take one inner step from the run's shared budget; False once it is spent."""

    def send(self, push: Push) -> None:
        """Send a push without waiting for its answer."""

    def arrived(self) -> list[Pull]:
        """The answers (merged global fragments) that arrived since the last call, without waiting."""

    def settle(self, fragment: int) -> list[Pull]:
        """Wait until the fragment's exchange in progress (if any) has ended; return the answers it brought."""

    def close(self) -> None:
        """Wait until every push sent has reached the syncer."""


class IslandWorker:
    """One island of a decoupled run: inner steps, pushes and pulls.

    A rank of an island job of several ranks (:mod:`atoll.runtime.service.island`) is one too: it is given
    its ``island`` (under DDP, or FSDP2-sharded) and the part of each fragment it ``held`` (a sharded rank
    holds its shard's part only), pushes the ``send_range`` of it, and leaves the codec to its transport
    (``transport_encodes``: the encoded payload is what travels).

    Args:
        index: the island's index.
        job: the shared job (its model is copied, unless ``island`` is given).
        total_steps: the island's expected inner steps (sets its learning-rate schedule).
        device: where the island's replica and inner optimizer live (exchanged tensors are float32 on the CPU).
        island: the island's replica, built by the caller (a rank's); None: a copy of the job's model.
        held: per fragment, what of it this worker holds, as ranges of its island's flat vector
            (:meth:`~atoll.job.island.Island.flat_params`); None: ``job.index``, every fragment whole. With
            ``held``, the base starts at zeros: call :meth:`start_from` before training.

    Attributes:
        sync_every: the island's own H (:func:`local_sync_every`: proportional to its speed).
        base, base_version: per fragment, the global fragment (float32, (numel_p,): the values held) the island
            last pulled, and its version; pseudo-gradients are taken against it.
        at_push: per fragment, the island's own parameters when it last pushed (float32 (numel_p,); None
            with no exchange in progress): its work since then is kept on top of the answer. Written into a
            buffer the worker keeps, so it is overwritten at the fragment's next push (:meth:`state_dict`
            copies it).
        tokens_since: per fragment, tokens trained since its last push.
        steps: inner steps taken (lost ones included); it also indexes the island's batches.
        round_step: inner steps since the island last (re)joined, plus the steps its realignments skipped
            (:meth:`realign`); drives the fragment schedule.
        pushed_at: per fragment, :attr:`steps` at its last push (-1: none yet).
        realigned_at: :attr:`steps` at the island's last realignment or (re)join: an answer to a push from
            before it is not acted on again (-1: none yet).
        send_range: per fragment, the values ``[a, b)`` of what it holds that its push carries (default all).
        transport_encodes: a push carries the raw Δ and its transport encodes it with :attr:`wire` (False: the
            push carries the decoded Δ, ``wire.transmit``'s, as the local and Ray runtimes hand it over).
    """

    def __init__(self, index: int, job: Job, total_steps: int, device: torch.device | str = "cpu",
                 island: Island | None = None, held: list[FlatFragment] | None = None) -> None:
        self.index = index
        self.job = job
        self.island: Island = island if island is not None else build_island(
            index, copy.deepcopy(job.model).to(device), job.settings.lasting(total_steps), inner_optimizer(job.own))
        self.fragment_index = held if held is not None else job.index
        self.sync_every = local_sync_every(job.own, job.facts.islands)[index]
        self.wire = make_wire(job.own, [index], job.facts.seed)
        self.pull_codec = pull_codec(job.own.pull_codec, job.own.codec_block_size)  # decodes delta pulls
        self.base = ([frag.gather(job.init_flat) for frag in job.index] if held is None else
                     [torch.zeros(frag.numel()) for frag in held])
        self.base_version = [0] * len(job.index)
        self.at_push: list[torch.Tensor | None] = [None] * len(job.index)
        # per fragment, the float32 CPU buffer (numel_p,) that each push's θ_at_push is written into: allocated at
        # the fragment's first push and kept (4 bytes per parameter held, on the host), where a fresh copy of a
        # large fragment would cost the CPU a page fault per 4 KiB at every push; at_push[p] is it, or None
        self._at_push_buffers: list[torch.Tensor | None] = [None] * len(self.fragment_index)
        self.tokens_since = [0] * len(job.index)
        self.steps = 0
        self.round_step = 0
        self.pushed_at = [-1] * len(job.index)
        self.realigned_at = -1
        self.send_range = [(0, frag.numel()) for frag in self.fragment_index]
        self.transport_encodes = False

    @property
    def fragments(self) -> int:
        return len(self.fragment_index)

    def run(self, transport: Transport) -> None:
        """The island's loop on a real clock (Decoupled DiLoCo's learner), until the shared budget is spent."""
        while transport.reserve_step():
            self.train_step()                              # an inner step on the island's own shard
            for pull in transport.arrived():               # merged fragments that came back meanwhile
                self.adopt(pull)
            for p in self.due():                           # this fragment's turn on the staggered schedule
                for pull in transport.settle(p):           # at most one exchange per fragment in progress
                    self.adopt(pull)
                transport.send(self.push(p))               # and train on while it travels
        for p in range(self.fragments):                    # the end: push what was not pushed yet
            if self.tokens_since[p] > 0:
                for pull in transport.settle(p):
                    self.adopt(pull)
                transport.send(self.push(p))
        transport.close()

    def train_step(self) -> float:
        """One inner step on the island's next batch; returns its training loss."""
        c = self.job.facts
        batch = sample_batch(self.job.data.island_tokens[self.index], c.step_batch_size, c.seq_len, c.seed,
                             self.index, self.steps)
        inject_fault(self.island, self.steps, "weights")  # test hook (atoll.job.divergence)
        self.forward_backward(batch)
        inject_fault(self.island, self.steps, "grad")
        diverged = self.island.diverged
        if diverged:  # its weights are lost: restart from the global model it last pulled
            self.reset()
            self.island.skip_step()
        else:
            self.island.inner_step()
        self.steps += 1
        self.round_step += 1
        if not diverged:
            self.tokens_since = [t + c.tokens_per_step for t in self.tokens_since]
        return self.island.last_loss

    def forward_backward(self, batch: torch.Tensor) -> None:
        """The gradient of the island's batch (int64 (rows, seq_len + 1)); a rank of an island job of several
        ranks takes its rows and averages the gradient with its peers (:mod:`atoll.runtime.service.island`)."""
        self.island.forward_backward(batch)

    def due(self) -> list[int]:
        """Fragments whose push is due after the step just taken (staggered schedule, own step count)."""
        return fragments_due(self.round_step - 1, self.fragments, self.sync_every) if self.round_step else []

    def push(self, p: int) -> Push:
        """Fragment p's push: Δ = base − θ_island (of its :attr:`send_range`) passed through the run's codec
        (encoded, then decoded in float32, with the island's error feedback; left to the transport with
        :attr:`transport_encodes`, nbytes 0), the tokens since its last push, its base version and the
        encoded payload's bytes. Remembers θ_island of the fragment for :meth:`adopt`. Δ is a tensor made for
        this push alone, which the worker keeps no reference to: a runtime in the same process hands it to the
        syncer without a copy (``Syncer.push(owned=True)``, :mod:`atoll.runtime.events`)."""
        kept = self._at_push_buffers[p]  # θ_at_push lands in a buffer kept between pushes (see __init__)
        if kept is None:
            kept = self._at_push_buffers[p] = torch.empty(self.fragment_index[p].numel(), dtype=torch.float32)
        mine = self.island.flat_params(self.fragment_index[p], out=kept)  # a copy of the fragment's views alone
        self.at_push[p] = mine
        a, b = self.send_range[p]
        raw = pseudo_gradient(self.base[p][a:b], mine[a:b])
        delta, nbytes = (raw, 0) if self.transport_encodes else self.wire.transmit(0, raw, f"fragment{p}")
        tokens, self.tokens_since[p] = self.tokens_since[p], 0
        self.pushed_at[p] = self.steps
        return Push(self.index, p, delta, tokens, self.base_version[p], int(nbytes))

    def adopt(self, pull: Pull) -> None:
        """An answer arrived: take the global fragment (float32 (numel_p,)) as the island's own. A delta pull
        (``pull_codec`` other than fp32) is first decoded onto the island's base, the global fragment it last
        pulled (:func:`~atoll.strategies.decoupled.downlink.apply_pull`; ValueError if it is for another version).

        Communication overlaps compute (as in Streaming DiLoCo's overlap, arXiv:2501.18512 §2.2, and the
        eager outer updates of Kale et al. 2025, arXiv:2502.12996): the island went on training while its push
        travelled to the syncer and the pulled fragment travelled back. Its progress since the push,
        θ_now − θ_at_push, is kept on top of the global fragment: θ ← θ_global + (θ_now − θ_at_push), and the
        base becomes θ_global at the pull's version, so the next Δ holds exactly the work done after the push
        (nothing is counted twice, nothing is lost). With no push in progress (a final pull) the island simply
        takes the global fragment.

        The syncer answers a push with the global fragment of the merge that took it in (at the quorum or
        when the grace window closes), so the answer holds the island's own pushed work. Answering at once
        with the global fragment as it was would throw the island's round of work away for every push that
        waits for a quorum; keeping its own parameters instead would leave its base version behind, so that
        its next push counted as staler than it is.
        """
        p = pull.fragment
        # a delta pull is added to the base itself (the island's own copy: state_dict copies it)
        values = apply_pull(pull, self.base[p], self.base_version[p], self.pull_codec, in_place=True)
        at_push = self.at_push[p]
        if at_push is None:  # a final pull: replace
            self.island.set_flat_params(values, self.fragment_index[p])
        else:  # on the parameters' views, in place: θ ← (θ − θ_at_push) + θ_global, the same floats as on a copy
            with torch.no_grad():
                offset = 0
                for view in self.island.param_views(self.fragment_index[p]):
                    n = view.numel()
                    view.sub_(at_push[offset:offset + n].to(view.device, non_blocking=True))
                    view.add_(values[offset:offset + n].to(view.device, non_blocking=True))
                    offset += n
        self.base[p] = values.clone() if values is pull.params else values
        self.base_version[p] = pull.version
        self.at_push[p] = None
        if self.job.own.realign_pushes and at_push is not None:
            self.realign(p, pull.realign)

    def realign(self, p: int, behind: float) -> int:
        """``realign_pushes``: the answer to fragment p's push says it arrived ``behind`` (a share of a round,
        [0, 1)) the fragment's previous, larger merge (:meth:`Syncer.realign_share
        <atoll.strategies.decoupled.syncer.Syncer.realign_share>`): shorten the next round by that share of the
        island's H, once, so its pushes arrive with the others'. Returns the inner steps skipped (0: none).

        The whole schedule moves (``round_step`` jumps ahead by ``round(behind x H)``): a stop or a restart
        shifts every fragment of the island alike, and the staggered order is kept (at most one fragment due
        per step). A fragment whose due step falls in the skipped steps is pushed one round later, its longer
        round weighed by its tokens (at most one round's, :meth:`Syncer.weight
        <atoll.strategies.decoupled.syncer.Syncer.weight>`); no fragment is pushed sooner than its next
        scheduled push minus the shift, so an island never pushes a fragment twice into one merge. An answer to
        a push made before (or at the step of) the island's last realignment or (re)join is not acted on (it
        measured the old phase). A ``behind`` that is no finite number in [0, 1) (an answer over a network, not
        trusted blindly) is not acted on.
        """
        if isinstance(behind, bool) or not isinstance(behind, int | float) or not (
                math.isfinite(behind) and 0 <= behind < 1):
            return 0
        steps = round(behind * self.sync_every)
        if not 0 < steps < self.sync_every or self.pushed_at[p] <= self.realigned_at:
            return 0
        self.round_step += steps
        self.realigned_at = self.steps
        return steps

    def reset(self) -> None:
        """A diverged island (its loss not finite): back to the global fragments it last pulled, with a fresh
        inner optimizer, counted in ``island.reset_count``. Its work since its last pushes is lost (nothing
        of it is pushed); an answer still on the way replaces its fragment as a final pull would."""
        for frag, base in zip(self.fragment_index, self.base, strict=True):  # (the fragments tile the model)
            self.island.set_flat_params(base, frag)
        self.island.optimizer.state.clear()
        self.island.optimizer.zero_grad(set_to_none=True)
        self.island.reset_count += 1
        self.at_push = [None] * self.fragments
        self.tokens_since = [0] * self.fragments

    def lose_work(self) -> float:
        """A failure: forget what was not pushed; return those tokens (scaled by each fragment's share)."""
        lost = sum(t * share for t, share in zip(self.tokens_since, self.job.shares, strict=True))
        self.tokens_since = [0] * self.fragments
        return lost

    def rejoin(self, global_flat: torch.Tensor, versions: list[int]) -> None:
        """Restart from the syncer's newest global parameters (float32 (numel,)) with a fresh inner optimizer
        state."""
        self.start_from([Pull(p, frag.gather(global_flat), v)
                         for p, (frag, v) in enumerate(zip(self.fragment_index, versions, strict=True))])

    def start_from(self, pulls: list[Pull]) -> None:
        """(Re)start from the global fragments ``pulls`` (one per fragment: the values held, float32, at their
        versions) with a fresh inner optimizer state and schedule of pushes."""
        for pull in pulls:
            values = apply_pull(pull, self.base[pull.fragment], self.base_version[pull.fragment], self.pull_codec)
            self.island.set_flat_params(values, self.fragment_index[pull.fragment])
            self.base[pull.fragment] = values.clone()
            self.base_version[pull.fragment] = pull.version
        self.at_push = [None] * self.fragments
        self.island.optimizer.state.clear()
        self.island.optimizer.zero_grad(set_to_none=True)
        self.tokens_since = [0] * self.fragments
        self.round_step = 0
        self.realigned_at = self.steps

    def state_dict(self) -> dict[str, Any]:
        """The island (weights, inner optimizer, schedule) and its exchange state, for checkpoints."""
        return {"island": self.island.state_dict(), "base": [b.clone() for b in self.base],
                "base_version": list(self.base_version), "tokens_since": list(self.tokens_since),
                "at_push": [None if t is None else t.clone() for t in self.at_push],
                "steps": self.steps, "round_step": self.round_step, "wire": self.wire.island_state(0),
                "pushed_at": list(self.pushed_at), "realigned_at": self.realigned_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.island.load_state_dict(state["island"])
        self.base = [b.clone() for b in state["base"]]
        self.base_version = [int(v) for v in state["base_version"]]
        self.tokens_since = [int(t) for t in state["tokens_since"]]
        self.at_push = [None if t is None else t.clone() for t in state["at_push"]]
        self.steps, self.round_step = int(state["steps"]), int(state["round_step"])
        self.pushed_at = [int(x) for x in state.get("pushed_at", self.pushed_at)]  # absent: older checkpoints
        self.realigned_at = int(state.get("realigned_at", self.realigned_at))
        self.wire.load_island_state(0, state["wire"])


def save_path(out: Path) -> Path:
    """Where a decoupled run's syncer saves its state alone: ``<out>/syncer``."""
    return Path(out) / "syncer"
