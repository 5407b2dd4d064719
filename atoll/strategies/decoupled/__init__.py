"""``decoupled``: Decoupled DiLoCo. Islands on their own clocks push fragments to a syncer; nobody waits.

Decoupled DiLoCo (arXiv:2604.21428), in the family of asynchronous local SGD (Liu et al. 2024,
arXiv:2401.09135). Each island (a learner, :mod:`~atoll.strategies.decoupled.island`) runs inner steps at its
own speed and, on the staggered fragment schedule, pushes a fragment's pseudo-gradient to the syncer
(:mod:`~atoll.strategies.decoupled.syncer`), which merges a quorum of pushes (or what arrived when the grace
window closes), token-weighted and staleness-discounted, with one outer Nesterov step per fragment, and
answers each push with the merged fragment. The messages are typed records
(:mod:`~atoll.strategies.decoupled.protocol`). No lockstep loop: the ``local`` runtime simulates the islands'
clocks (:mod:`atoll.runtime.events`), the ``ray`` runtime runs them as actors (:mod:`atoll.runtime.ray`).

Launch::

    atoll train --strategy decoupled --islands 4 --island-speeds 1,1,0.5,0.25 --chaos 90:10
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator

from atoll.analysis.cost import Cost, Setting, codec_bits
from atoll.config.parse import parse_chaos
from atoll.config.runtimes import TimeoutSection
from atoll.config.sections import AdamWSection, Codec, CodecSection, FragmentsSection, PullCodec
from atoll.strategies.decoupled.syncer import Syncer
from atoll.strategies.rounds import RoundsConfig
from atoll.strategies.spec import StrategySpec, SuiteRun

if TYPE_CHECKING:
    from atoll.algorithms.fragments import FlatFragment
    from atoll.config.facts import RunFacts
    from atoll.config.section import RunSettings


class DecoupledConfig(RoundsConfig, AdamWSection, CodecSection, FragmentsSection):
    """Decoupled DiLoCo's config: H, the inner AdamW, the syncer's outer optimizer, the codec of the pushes
    (4-bit by default, accumulated in fp32 at the syncer, as Streaming DiLoCo's outer gradients), the fragments,
    and its own: the syncer (quorum and minimum quorum, grace window, staleness, bounds, how pushes are weighed
    and averaged: Decoupled DiLoCo's rules as settings), the islands' speeds, and the simulated failures and step
    of the ``local`` runtime. The outer momentum stays light (the default 0.5): the syncer
    steps at every partial merge, several per H, and a heavier momentum compounds them into an overshoot."""

    codec: Codec = "int4"

    quorum: int | None = Field(
        None, ge=1,
        description="decoupled: distinct islands whose pushes of a fragment make the syncer merge at once "
        "(default: every island; a dead or late one delays a merge by one grace window at most, then those that "
        "pushed are merged; a smaller quorum merges sooner, in parts that weigh each other's pushes as stale).",
    )
    grace_factor: float = Field(
        1.0, gt=0, le=100,
        description="decoupled: the grace window, as a multiple of the median round time the islands "
        "measured (pull to next push); a buffer short of a quorum is merged when it closes, so a dead "
        "island delays a merge by about one round at most.",
    )
    max_staleness: int = Field(
        4, ge=0,
        description="decoupled: a push computed from a global fragment more than this many outer steps old "
        "is dropped (bounded staleness); an island earns one step of credit per drop (at most islands), so "
        "the one that arrives last is not starved.",
    )
    staleness_exponent: float = Field(
        0.5, ge=0, le=10,
        description="decoupled: a in the staleness discount of a push's token weight, (1 + staleness)^-a "
        "(FedAsync, arXiv:1903.03934); 0: none.",
    )
    update_norm_bound: float = Field(
        10.0, gt=1,
        description="decoupled: the syncer rejects a push whose norm exceeds this times what the recent pushes "
        "of its fragment vouch for (scaled by tokens, speed-free), or that claims more than this times its "
        "island's own push of tokens (where no ledger counts them).",
    )
    min_quorum: int = Field(
        1, ge=1,
        description="decoupled: K, the fewest distinct islands a merge of a fragment takes (Decoupled DiLoCo's "
        "minimum quorum); its grace window opens when this many have pushed (1: at the first push), and a buffer "
        "short of it waits for islands, not for the clock. At most --quorum.",
    )
    grace_window: Literal["round", "slack"] = Field(
        "slack",
        description="decoupled: how long a buffer at its minimum quorum waits for more islands: round "
        "(--grace-factor x the median round time the islands measured) or slack (Decoupled DiLoCo's adaptive "
        "window: --grace-slack-fraction x the slack the compute overlap leaves, tau x t_step - (t_quorum + "
        "t_sync), tau = --grace-overlap-steps, all measured by the syncer; 0 when nothing is left: it merges at "
        "once).",
    )
    grace_slack_fraction: float = Field(
        0.5, gt=0, le=1,
        description="decoupled, --grace-window slack: gamma, the share of the slack the grace window may wait.",
    )
    grace_overlap_steps: int | None = Field(
        None, ge=1,
        description="decoupled, --grace-window slack: tau, the inner steps (of a full-speed island) after its "
        "push within which an island should have its merged fragment back; default --sync-every (its next "
        "push of the fragment, which a later answer defers).",
    )
    merge_average: Literal["mean", "radial_directional"] = Field(
        "radial_directional",
        description="decoupled: how the syncer averages a buffer's pushes: mean (token-weighted, or "
        "--robust-merge's rule) or radial_directional (Decoupled DiLoCo: per tensor, the mean of the pushes' norms "
        "along the normalized mean of their directions, so nearly orthogonal pushes do not shrink; embeddings "
        "and the output head by the mean; with --robust-merge none or clip).",
    )
    push_weight: Literal["tokens", "tokens_x_tokens_per_step"] = Field(
        "tokens",
        description="decoupled: a push's merge weight: tokens (one honest push's at most) or "
        "tokens_x_tokens_per_step (Decoupled DiLoCo: times its island's tokens per inner step, so an island of a "
        "larger batch weighs more; equal to tokens where every island has the same batch, as in atoll today).",
    )
    scale_partial_merges: bool = Field(
        True,
        description="decoupled: scale a merge of n < islands distinct islands by n/islands before the outer "
        "step (each partial merge speaks for part of the islands; unscaled, Nesterov 0.7/0.9 overshoots).",
    )
    robust_merge: Literal["none", "clip", "trimmed_mean", "median"] = Field(
        "none",
        description="decoupled: how the syncer merges a buffer's pushes: none (the token-weighted mean), clip "
        "(each push scaled to at most the merge's median norm), trimmed_mean (per coordinate, the top and bottom "
        "quarter dropped) or median (per coordinate); the robust ones bound what a minority of hostile islands "
        "can do to a merge (docs/security.md).",
    )
    realign_pushes: bool = Field(
        True,
        description="decoupled: put an island whose pushes drifted out of phase back in step (a deviation from "
        "Decoupled DiLoCo and Streaming DiLoCo, whose islands keep their fragment schedule's phase for good): when "
        "a fragment's merge holds an island's push but the fragment's previous merge held more islands and not it "
        "(or as many, with the lowest island index), the syncer answers with how far behind it arrived "
        "(a share of the median push-to-push time), and the island shortens its next round by that share of its "
        "H once, so its pushes join the others' merges again; its shorter rounds weigh by their tokens. On by "
        "default (measured: bench/out/service_soak, participation 0.849 -> 0.974 at equal loss); off "
        "(--no-realign-pushes): the paper's fixed schedule (a stopped or restarted island stays shifted for the "
        "rest of the run).",
    )
    pull_codec: PullCodec = Field(
        "int4",
        description="decoupled: what an island's pull of a merged fragment carries: int4 (the default), int8 or "
        "bf16 (the syncer keeps one float32 shadow per fragment and sends the changes since the version the island "
        "holds, encoded with --codec-block-size and error feedback, so the island's copy stays within one change's "
        "rounding of the global fragment; an island too far behind, or rejoining, gets the shadow in float32), or "
        "fp32 (the global fragment itself, 4 bytes per parameter). int4 measured best at the default benchmark "
        "(bench/out/pull_codec_default_int4, docs/decoupled.md). Every runtime.",
    )
    island_speeds: list[float] | None = Field(
        None,
        description="decoupled: relative speed of each island, comma separated, one per island, each in "
        "(0, 1] (e.g. 1,1,0.5,0.25): an island of speed s takes 1/s as long per inner step; sync_every x the "
        "slowest (over the fastest) must be at least fragments. Default: all 1.",
    )
    sim_step_s: float = Field(
        0.1, gt=0,
        description="decoupled, local runtime: simulated compute seconds of one inner step on a speed-1 "
        "island (a fixed cost keeps the event order, hence the run, deterministic for a seed).",
    )
    chaos: str | None = Field(
        None,
        description="decoupled: inject failures, MTBF_S:DOWNTIME_S (e.g. 90:10): each island fails after "
        "exponentially distributed up-times of mean MTBF_S (seeded per island), loses its un-pushed work, "
        "and rejoins from the syncer's newest global parameters DOWNTIME_S later.",
    )

    @field_validator("island_speeds", mode="before")
    @classmethod
    def _parse_speeds(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return [float(x) for x in value.split(",")]
            except ValueError:
                raise ValueError(f"'{value}' is not a comma-separated list of numbers; pass e.g. "
                                 "--island-speeds 1,1,0.5,0.25") from None
        return value

    @field_validator("chaos")
    @classmethod
    def _check_chaos(cls, value: str | None) -> str | None:
        if value is not None:
            parse_chaos(value)
        return value


def island_speeds(own: DecoupledConfig, islands: int) -> list[float]:
    """Each of the ``islands`` islands' relative speed: ``island_speeds``, default all 1.0."""
    return list(own.island_speeds) if own.island_speeds is not None else [1.0] * islands


def validate(own: DecoupledConfig, run: RunSettings) -> None:
    """The quorum, the speeds and the fragment schedule fit the ``run``; failures and speeds are simulated only.

    Raises:
        ValueError: one line naming the field and the fix.
    """
    from atoll.job.model import check_fragments  # transformers only when a config is checked

    check_fragments(run.model, own.fragments)
    if run.runtime == "ray" and (own.chaos is not None or own.island_speeds is not None):
        name = "chaos" if own.chaos is not None else "island_speeds"
        raise ValueError(f"{name}: simulated in the local runtime only (on Ray, failures are real: kill an "
                         f"island's process; speeds come from the hardware); drop --{name.replace('_', '-')} "
                         "or pass --runtime local")
    if own.quorum is not None and own.quorum > run.islands:
        raise ValueError(f"quorum: {own.quorum} exceeds islands ({run.islands}); lower --quorum")
    quorum = own.quorum if own.quorum is not None else run.islands
    if own.min_quorum > quorum:
        raise ValueError(f"min_quorum: {own.min_quorum} exceeds the quorum ({quorum}); lower --min-quorum")
    if own.merge_average == "radial_directional" and own.robust_merge not in ("none", "clip"):
        raise ValueError(f"merge_average: radial_directional averages norms and directions, --robust-merge "
                         f"{own.robust_merge} coordinates; pass --merge-average mean with it (or --robust-merge "
                         "none or clip)")
    if own.island_speeds is not None:
        if len(own.island_speeds) != run.islands:
            raise ValueError(f"island_speeds: {len(own.island_speeds)} values for {run.islands} islands; "
                             "give one speed per island, e.g. --island-speeds 1,1,0.5,0.25")
        bad = [s for s in own.island_speeds if not 0 < s <= 1]
        if bad:
            raise ValueError(f"island_speeds: {bad[0]} is outside (0, 1]; the fastest island is 1, a "
                             "half-speed one 0.5")
    if own.sync_every < own.fragments:
        raise ValueError(f"sync_every ({own.sync_every}) must be at least fragments ({own.fragments}) "
                         "so each fragment syncs once per H steps; raise --sync-every or lower --fragments")
    if own.island_speeds is not None:  # an island at relative speed s takes s x H inner steps per round:
        # fewer than P cannot push every fragment once a round, so it falls behind and its pushes go stale
        slow, fastest = min(own.island_speeds), max(own.island_speeds)
        if own.sync_every * slow / fastest < own.fragments - 1e-9:
            need = math.ceil(own.fragments * fastest / slow - 1e-9)
            raise ValueError(f"island_speeds: an island at {slow:g} of the fastest's speed takes "
                             f"{own.sync_every * slow / fastest:g} inner steps per round of --sync-every "
                             f"{own.sync_every}, fewer than --fragments {own.fragments}, so it cannot push at "
                             f"the others' cadence; raise --sync-every to {need} or more (fragments / slowest speed) "
                             "or lower --fragments")


def local_sync_every(own: DecoupledConfig, islands: int) -> list[int]:
    """Each of the ``islands`` islands' H: ``sync_every`` scaled by its speed over the fastest island's, at least
    ``fragments``.

    Dynamic Local Updates (Liu et al. 2024, arXiv:2401.09135, §4.2): an island at half speed takes half as
    many inner steps per round, so every island pushes each fragment at about the same wall-clock cadence.
    Without it a quarter-speed island's push arrives after four rounds of the others' commits: stale enough
    to be discounted hard or dropped (``max_staleness``), so its compute would be wasted. Its smaller
    contribution is weighed by its tokens in the merge. :func:`validate` refuses speeds whose s x H falls
    below ``fragments`` (the cadence could not hold: at most one fragment is pushed per inner step), so the
    floor at ``fragments`` never lengthens an island's round.
    """
    speeds = island_speeds(own, islands)
    fastest = max(speeds)
    return [max(own.fragments, round(own.sync_every * s / fastest)) for s in speeds]


def make_syncer(own: DecoupledConfig, facts: RunFacts, init: torch.Tensor, index: list[FlatFragment],
                credentials: list[str] | None = None, timeout_s: float | None = None) -> Syncer:
    """The run's syncer over the initial global parameters ``init`` (float32 (numel,)) cut into the fragments
    ``index``, from the strategy's settings ``own`` (quorum and minimum quorum, grace window, staleness, norm
    bound, outer optimizer, robust merge, average and push weight) and the run's ``facts`` (its islands, every
    island's tokens per inner step), each island's push declared as its own H (:func:`local_sync_every`) of inner
    steps; ``credentials``: per island its secret (:mod:`~atoll.strategies.decoupled.trust`), None: pushes not
    authenticated. A round time no push of the island's was seen before is taken up to :func:`max_round_s`
    (``timeout_s``: the runtime's deadline, None on a simulated clock), so a claim cannot stretch the first
    grace windows beyond it either."""
    tau = own.grace_overlap_steps if own.grace_overlap_steps is not None else own.sync_every
    return Syncer(init, index, facts.islands, own.outer_lr, own.outer_momentum,
                  quorum=own.quorum, grace_factor=own.grace_factor, max_staleness=own.max_staleness,
                  staleness_exponent=own.staleness_exponent, norm_bound=own.update_norm_bound,
                  scale_partial=own.scale_partial_merges, credentials=credentials, robust_merge=own.robust_merge,
                  push_tokens=[h * facts.tokens_per_step for h in local_sync_every(own, facts.islands)],
                  max_round_s=max_round_s(own, facts.islands, timeout_s), min_quorum=own.min_quorum,
                  grace_window=own.grace_window,
                  grace_slack_fraction=own.grace_slack_fraction, grace_overlap=tau / own.sync_every,
                  average=own.merge_average, push_weight=own.push_weight,
                  step_tokens=[facts.tokens_per_step] * facts.islands, realign=own.realign_pushes,
                  pull_codec=own.pull_codec, pull_block_size=own.codec_block_size)


#: the deadline a run under a runtime without one (``local``: a simulated clock) allows a first round: the
#: default of the real runtimes' ``collective_timeout_s``
DEFAULT_TIMEOUT_S: float = TimeoutSection.model_fields["collective_timeout_s"].default


def max_round_s(own: DecoupledConfig, islands: int, timeout_s: float | None) -> float:
    """The longest round time (seconds) the syncer takes from a push it has no earlier push of the island's to
    compare with: the runtime's deadline ``timeout_s`` (its ``collective_timeout_s``: the wait the run allows),
    or on a simulated clock (``timeout_s`` None: the ``local`` runtime) :data:`DEFAULT_TIMEOUT_S` and at least
    twice the slowest island's simulated round (its H x ``sim_step_s`` / speed), so a slow simulation's honest
    first round is never cut short."""
    if timeout_s is not None:
        return timeout_s
    speeds = island_speeds(own, islands)
    slowest = max(h * own.sim_step_s / s for h, s in zip(local_sync_every(own, islands), speeds, strict=True))
    return max(DEFAULT_TIMEOUT_S, 2.0 * slowest)


def project(config: DecoupledConfig, s: Setting) -> Cost:
    """decoupled's cost per inner step: each island pushes its b-bit fragments (its codec's) to a syncer and
    pulls the merged fragment back at c bits per parameter (32 with ``pull_codec`` fp32; else the pull codec's
    bits: one change per pull, the steady state of islands that keep up), never waiting for the other islands;
    each direction of the island's link (full duplex, B each way, as the simulated clock's uplink and downlink)
    carries its own; the syncer's link is assumed not to be the bottleneck (a datacenter link, or one syncer
    per fragment)::

        sent = N*b/8 / H;   received = N*c/8 / H;   step = max(t_c, sent*8/B, received*8/B)
        exchange (one fragment's round trip) = N*b/P/B + L + N*c/P/B + L

    Raises:
        ValueError: a codec without fixed bits per element (topk).
    """
    h, b = config.sync_every, codec_bits(config.codec)
    c = codec_bits(config.pull_codec)
    sent = s.params * b / 8 / h if s.islands > 1 else 0.0
    received = s.params * c / 8 / h if s.islands > 1 else 0.0
    t = (s.params * (b + c) / config.fragments / s.bandwidth_bps + 2 * s.latency_s) if s.islands > 1 else 0.0
    return Cost(max(s.step_compute_s, sent * 8 / s.bandwidth_bps, received * 8 / s.bandwidth_bps), sent, t,
                sync_every=h, bytes_received_per_step=received)


SPEC = StrategySpec(
    name="decoupled",
    summary="fragments' pseudo-gradients pushed asynchronously to a syncer, merged at a quorum, token-weighted "
            "(Decoupled DiLoCo, arXiv:2604.21428)",
    config=DecoupledConfig, runtimes=("local", "ray", "service"), validate=validate, lockstep=None, project=project,
    shards=True,
    suite=(SuiteRun("decoupled", "decoupled H={sync_every} P={fragments} {codec}", {"strategy": "decoupled"}),
           SuiteRun("decoupled_chaos", "decoupled H={sync_every} P={fragments} {codec}, standard failure trace",
                    {"strategy": "decoupled", "standard_chaos": True})),
)
