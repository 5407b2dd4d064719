"""``decoupled``: Decoupled DiLoCo. Islands on their own clocks push fragments to a syncer; nobody waits.

Decoupled DiLoCo (arXiv:2604.21428), in the family of asynchronous local SGD (Liu et al. 2024,
arXiv:2401.09135). Each island runs inner AdamW steps on its own shard at its own speed. On the staggered
fragment schedule of Streaming DiLoCo (fragment p after ``offset_p, offset_p + H, ...`` of the island's own
inner steps, where an island's H is proportional to its speed, :func:`local_sync_every`; with ``--fragments 1``
every H steps) it pushes that fragment's pseudo-gradient
Δ = θ_global(v) − θ_island, with its token count and the version v it started from, to the
:class:`~atoll.syncer.Syncer` and goes on training while the push travels, waits in the syncer's buffer, and
the merged global fragment travels back (communication overlaps compute; on arrival the merged fragment
replaces the island's, the work done meanwhile kept on top: :meth:`IslandWorker.adopt`). The syncer merges a
quorum of pushes (or what arrived when the grace window closes), token-weighted and staleness-discounted,
with one outer Nesterov step per fragment.

Launch::

    atoll train --strategy decoupled --islands 4 --island-speeds 1,1,0.5,0.25 --chaos 90:10

The ``local`` runtime (:func:`train_decoupled`) runs every island in this process as a discrete-event
simulation: each island has its own simulated clock; an inner step costs ``sim_step_s / speed`` simulated
seconds (a fixed cost, so the order of events, hence the run, is deterministic for a seed; the real
compute is measured and reported beside it); a push or pull of B bytes takes ``B·8/bandwidth + latency``
on the island's uplink or downlink (:class:`~atoll.runtime.network.Link`; one transfer at a time per
direction, queued behind the previous one), while the island trains on. Pushes are encoded by the run's
codec (:class:`~atoll.strategies.base.Wire`) and counted as bytes sent; pulls are float32 downloads, timed
but not counted as sent. A fragment whose previous push or pull is still on the wire when its next push
is due is pushed at the next due step instead (``deferred_pushes``; its tokens wait). Events are processed
in simulated-time order from a priority queue (ties by island index). ``--steps`` is a budget of ``islands x steps`` inner steps over all islands (the tokens of
every other strategy at equal ``--steps``), shared by speed: a half-speed island takes about half as many.

Failures (``--chaos MTBF_S:DOWNTIME_S``, :class:`~atoll.chaos.FailureTrace`): a step that an outage
interrupts is not taken; the island loses the work it has not pushed, stays down for the outage, then
rejoins by itself: it pulls every global fragment (timed), clears its inner optimizer state and restarts
its fragment schedule; its pushes still on the wire are lost with it. Failures strike while the island
computes (it always does, except while it pulls the model to rejoin; one that begins then takes effect when
that pull ends). The syncer does not wait for a dead island: its grace window (a multiple of the
measured round time) closes and it merges without it.

Metrics in ``summary.json`` (besides the usual ones):

- ``goodput``: useful tokens per simulated second over the failure-free rate. Useful tokens are those
  merged into the global model: every merged push's tokens times its fragment's share of the parameters
  (pushes rejected, dropped as stale, or lost with a failed island do not count). The failure-free rate is
  ``Σ_i tokens_per_step · speed_i / sim_step_s``: every island computing all the time, with no failure and
  no communication. So ``goodput = merged_tokens / sim_wall_s / that rate``, in [0, 1].
- ``island_utilization``: per island, simulated compute seconds (lost work included) over ``sim_wall_s``.
- ``rejected_updates`` (by reason), ``stale_updates``, ``quorum_size_*``, ``staleness_*``, ``commits``,
  ``failures``, ``rejoin_s`` (per rejoin: seconds from failure until training again), ``lost_tokens``
  (trained but never merged: un-pushed at a failure, or pushed but on the wire when the island failed,
  ``lost_pushes``), ``deferred_pushes``, ``steps_per_island``.

Checkpoints, every ``checkpoint_every`` mean inner steps (``islands x checkpoint_every`` finished inner steps)
and at the end, written atomically: ``<out>/checkpoints/step_N/`` holds the global model (as for every
strategy, usable by ``--init-from``) and everything needed to continue exactly (the syncer, every island's
weights, inner optimizer, schedule, fragment bases and codec state, the clocks and the pending events);
``<out>/syncer/`` holds the syncer's state alone. ``--resume`` continues such a run exactly as if it had
not stopped (a longer ``--steps`` continues from the end of a finished run).
"""

from __future__ import annotations

import copy
import heapq
import math
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from atoll.algorithms.fragments import fragments_due
from atoll.algorithms.outer import pseudo_gradient
from atoll.chaos import GIVE_UP_FACTOR, FailureTrace
from atoll.checkpoint import new_run_dir, save_checkpoint
from atoll.config import TrainConfig
from atoll.data import PreparedData, default_cache_dir, eval_batches, prepare_data, sample_batch
from atoll.errors import CheckpointError
from atoll.island import Island, copy_flat_into, cosine_with_warmup
from atoll.metrics import MetricsLog, write_summary
from atoll.model import build_model, count_parameters, param_bytes
from atoll.runtime.network import Link, ring_allreduce_bytes
from atoll.strategies.base import make_wire, model_fragments
from atoll.syncer import Syncer

LOG_EVERY = 10  # mean inner steps per island between two ``train`` events


@dataclass
class Job:
    """What every island and the syncer of a decoupled run share: data, the initial model, fragments."""

    config: TrainConfig
    data: PreparedData
    val: list[torch.Tensor]
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    index: list[torch.Tensor]
    init_flat: torch.Tensor  # the initial global parameters, float32 (numel,), in model.parameters() order

    @property
    def shares(self) -> list[float]:
        """Each fragment's share of the parameters (its numel over the model's), summing to 1."""
        return [int(idx.numel()) / int(self.init_flat.numel()) for idx in self.index]


def prepare_job(config: TrainConfig) -> Job:
    """Data, held-out batches, the initial global model (or ``init_from``'s weights) and the fragments."""
    from atoll.train import load_init_weights

    transformers.utils.logging.disable_progress_bar()
    if config.threads:
        torch.set_num_threads(config.threads)
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    data = prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache_dir,
                        partition=config.partition, text_field=config.text_field)
    val = eval_batches(data.val_tokens, config.batch_size, config.seq_len, config.eval_batches)
    model = build_model(config.model, data.vocab_size, config.seq_len, config.seed)
    if config.init_from is not None:
        load_init_weights(model, Path(config.init_from))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=data.tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    index = model_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], config.fragments)
    init_flat = torch.nn.utils.parameters_to_vector([p.detach() for p in model.parameters()]).float().clone()
    return Job(config, data, val, model, tokenizer, index, init_flat)


def make_syncer(config: TrainConfig, job: Job) -> Syncer:
    """The run's syncer, from its settings (quorum, grace window, staleness, norm bound, outer optimizer)."""
    return Syncer(job.init_flat, job.index, config.islands, config.outer_lr, config.outer_momentum,
                  quorum=config.quorum, grace_factor=config.grace_factor, max_staleness=config.max_staleness,
                  staleness_exponent=config.staleness_exponent, norm_bound=config.update_norm_bound,
                  scale_partial=config.scale_partial_merges)


def local_sync_every(config: TrainConfig) -> list[int]:
    """Each island's H: ``sync_every`` scaled by its speed over the fastest island's, at least ``fragments``.

    Dynamic Local Updates (Liu et al. 2024, arXiv:2401.09135, §4.2): an island at half speed takes half as
    many inner steps per round, so every island pushes each fragment at about the same wall-clock cadence.
    Without it a quarter-speed island's push arrives after four rounds of the others' commits: stale enough
    to be discounted hard or dropped (``max_staleness``), so its compute would be wasted. Its smaller
    contribution is weighed by its tokens in the merge.
    """
    fastest = max(config.speeds)
    return [max(config.fragments, round(config.sync_every * s / fastest)) for s in config.speeds]


def expected_steps(config: TrainConfig) -> list[int]:
    """Each island's share of the ``islands x steps`` budget, proportional to its speed (its LR schedule)."""
    speeds = config.speeds
    return [max(1, math.ceil(config.islands * config.steps * s / sum(speeds))) for s in speeds]


class IslandWorker:
    """One island of a decoupled run: inner steps, pushes and pulls; the same under every runtime.

    Args:
        index: the island's index.
        job: the shared job (its model is copied).
        total_steps: the island's expected inner steps (sets its learning-rate schedule).
        device: where the island's replica and inner optimizer live (exchanged tensors are float32 on the CPU).

    Attributes:
        sync_every: the island's own H (:func:`local_sync_every`: proportional to its speed).
        base, base_version: per fragment, the global fragment (float32, (numel_p,)) the island last pulled,
            and its version; pseudo-gradients are taken against it.
        tokens_since: per fragment, tokens trained since its last push.
        steps: inner steps taken (lost ones included); it also indexes the island's batches.
        round_step: inner steps since the island last (re)joined; drives the fragment schedule.
    """

    def __init__(self, index: int, job: Job, total_steps: int, device: torch.device | str = "cpu") -> None:
        from atoll.train import make_island

        config = job.config
        self.config = config
        self.index = index
        self.job = job
        self.island: Island = make_island(index, copy.deepcopy(job.model).to(device), config, None)
        self.island.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.island.optimizer,
            cosine_with_warmup(min(config.warmup_steps, total_steps // 10), total_steps, config.min_lr_ratio))
        self.fragment_index = job.index
        self.sync_every = local_sync_every(config)[index]
        self.wire = make_wire(config, [index])
        self.base = [job.init_flat[idx].clone() for idx in job.index]
        self.base_version = [0] * len(job.index)
        self.tokens_since = [0] * len(job.index)
        self.steps = 0
        self.round_step = 0

    @property
    def fragments(self) -> int:
        return len(self.fragment_index)

    def train_step(self) -> float:
        """One inner step on the island's next batch; returns its training loss."""
        c = self.config
        batch = sample_batch(self.job.data.island_tokens[self.index], c.batch_size, c.seq_len, c.seed,
                             self.index, self.steps)
        loss = self.island.forward_backward(batch)
        self.island.inner_step()
        self.steps += 1
        self.round_step += 1
        self.tokens_since = [t + c.tokens_per_step for t in self.tokens_since]
        return loss

    def due(self) -> list[int]:
        """Fragments whose push is due after the step just taken (staggered schedule, own step count)."""
        return fragments_due(self.round_step - 1, self.fragments, self.sync_every) if self.round_step else []

    def make_push(self, p: int) -> tuple[torch.Tensor, int, int, int]:
        """(Δ as the syncer receives it, float32 (numel_p,); tokens; base version; bytes on the wire).

        Δ = base − θ_island of fragment p, passed through the run's codec (encoded, then decoded in float32,
        with the island's error feedback); the bytes are those of the encoded payload.
        """
        delta = pseudo_gradient(self.base[p], self.island.flat_params()[self.fragment_index[p]])
        delta, nbytes = self.wire.transmit(0, delta, f"fragment{p}")
        tokens = self.tokens_since[p]
        self.tokens_since[p] = 0
        return delta, tokens, self.base_version[p], int(nbytes)

    def fragment_params(self, p: int) -> torch.Tensor:
        """A float32 copy of the island's own parameters of fragment p, shape (numel_p,)."""
        return self.island.flat_params()[self.fragment_index[p]].clone()

    def adopt(self, p: int, params: torch.Tensor, version: int, at_push: torch.Tensor | None = None) -> None:
        """A pull of fragment p arrived: take the global fragment (float32 (numel_p,)) as the island's own.

        Communication overlaps compute (as in Streaming DiLoCo's overlap, arXiv:2501.18512 §2.2, and the
        eager outer updates of Kale et al. 2025, arXiv:2502.12996): the island went on training while its push
        travelled to the syncer and the pulled fragment travelled back. ``at_push`` is the island's fragment
        when it pushed (float32 (numel_p,); None: nothing was trained meanwhile, the blocking case). The
        island's progress since then, θ_now − θ_at_push, is kept on top of the global fragment:
        θ ← θ_global + (θ_now − θ_at_push), and the base becomes θ_global at ``version``, so the next Δ holds
        exactly the work done after the push (nothing is counted twice, nothing is lost).

        The syncer answers a push with the global fragment of the merge that took it in (at the quorum or
        when the grace window closes), so ``params`` holds the island's own pushed work. (Answering at once
        with the global as it was would, for every push that waits for a quorum, throw the island's round of
        work away locally: in our runs the global model then trailed synchronous DiLoCo by 0.5 nats at step
        100. Keeping its own parameters instead leaves its base version behind, and its next push counts as
        staler than it is: about one push in seven was dropped at ``max_staleness`` with 8 islands.)
        """
        own = self.island.flat_params()
        mine = own[self.fragment_index[p]]
        at_push = mine if at_push is None else at_push
        own[self.fragment_index[p]] = params + (mine - at_push)
        self.island.set_flat_params(own)
        self.base[p] = params.clone()
        self.base_version[p] = version

    def lose_work(self) -> float:
        """A failure: forget what was not pushed; return those tokens (scaled by each fragment's share)."""
        lost = sum(t * share for t, share in zip(self.tokens_since, self.job.shares, strict=True))
        self.tokens_since = [0] * self.fragments
        return lost

    def state_dict(self) -> dict[str, Any]:
        """The island (weights, inner optimizer, schedule) and its exchange state, for checkpoints."""
        return {"island": self.island.state_dict(), "base": [b.clone() for b in self.base],
                "base_version": list(self.base_version), "tokens_since": list(self.tokens_since),
                "steps": self.steps, "round_step": self.round_step, "wire": self.wire.island_state(0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.island.load_state_dict(state["island"])
        self.base = [b.clone() for b in state["base"]]
        self.base_version = [int(v) for v in state["base_version"]]
        self.tokens_since = [int(t) for t in state["tokens_since"]]
        self.steps, self.round_step = int(state["steps"]), int(state["round_step"])
        self.wire.load_island_state(0, state["wire"])

    def rejoin(self, global_flat: torch.Tensor, versions: list[int]) -> None:
        """Restart from the syncer's newest global parameters with a fresh inner optimizer state."""
        self.island.set_flat_params(global_flat)
        self.base = [global_flat[idx].clone() for idx in self.fragment_index]
        self.base_version = list(versions)
        self.island.optimizer.state.clear()
        self.island.optimizer.zero_grad(set_to_none=True)
        self.tokens_since = [0] * self.fragments
        self.round_step = 0


@dataclass
class _Sim:
    """The event loop's state in the local runtime: clocks, counters, and the pending events."""

    clock: list[float]                      # each island's simulated time, seconds
    compute: list[float]                    # simulated compute seconds (lost work included)
    pulled_at: list[list[float]]            # per island and fragment: time of the last pull
    bytes_sent: list[float]
    failures: list[int]
    failed_at: list[float | None]
    rejoins: list[int]
    last_loss: list[float]
    rejoin_s: list[float] = field(default_factory=list)
    lost_tokens: float = 0.0
    started: int = 0                        # inner steps begun (the budget counts these)
    done: int = 0                           # inner steps finished
    queue: list[tuple[float, int, int, str, int]] = field(default_factory=list)  # (time, island, seq, action, fragment)
    # per transfer in flight, by its event's seq: a push {"delta", "tokens", "base_version", "at_push", "epoch"}
    # or a pull {"params", "version", "at_push", "epoch"}
    in_flight: dict[int, dict[str, Any]] = field(default_factory=dict)
    uplink_free: list[float] = field(default_factory=list)    # per island: when its uplink is next idle
    downlink_free: list[float] = field(default_factory=list)  # per island: when its downlink is next idle
    awaiting: list[list[bool]] = field(default_factory=list)  # per island and fragment: a push/pull in flight
    waiting: list[list[dict[str, Any]]] = field(default_factory=list)  # per fragment: islands buffered, unanswered
    epoch: list[int] = field(default_factory=list)            # per island: failures so far (stale transfers die)
    deferred_pushes: int = 0                # pushes skipped because the fragment's previous one was in flight
    lost_pushes: int = 0                    # pushes on the wire when their island failed
    last_arrival: float = 0.0               # simulated time of the last push that reached the syncer
    seq: int = 0
    initial_eval_loss: float = float("nan")
    eval_loss: float = float("nan")

    @classmethod
    def new(cls, islands: int, fragments: int) -> _Sim:
        return cls([0.0] * islands, [0.0] * islands, [[0.0] * fragments for _ in range(islands)], [0.0] * islands,
                   [0] * islands, [None] * islands, [0] * islands, [float("nan")] * islands,
                   uplink_free=[0.0] * islands, downlink_free=[0.0] * islands,
                   awaiting=[[False] * fragments for _ in range(islands)], waiting=[[] for _ in range(fragments)],
                   epoch=[0] * islands)

    def state_dict(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["queue"] = [list(e) for e in self.queue]
        state["in_flight"] = [[n, v] for n, v in self.in_flight.items()]
        state["failed_at"] = [-1.0 if t is None else t for t in self.failed_at]
        return copy.deepcopy(state)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Sim:
        state = dict(state)
        state["queue"] = [(float(t), int(i), int(n), str(a), int(p)) for t, i, n, a, p in state["queue"]]
        state["in_flight"] = {int(n): dict(v) for n, v in state["in_flight"]}
        state["failed_at"] = [None if t < 0 else float(t) for t in state["failed_at"]]
        return cls(**state)


def train_decoupled(config: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Run a ``decoupled`` job in the ``local`` runtime (discrete-event simulation); return its summary.

    See the module docstring for the event model and the metrics. Writes the usual run folder: metrics.jsonl,
    summary.json, report.png, config.json, checkpoints/ (the final global model) and syncer/ (its state).
    """
    from atoll.report import plot_runs
    from atoll.train import evaluate

    t0 = time.perf_counter()
    state: dict[str, Any] | None = None
    if resume:
        from atoll.train import load_latest_state

        out = Path(config.out)  # type: ignore[arg-type]
        start_step, state = load_latest_state(out)
        if "sim" not in state:
            raise CheckpointError(f"resume: the checkpoint of '{out}' holds no decoupled run state; start a new run")
    else:
        out = new_run_dir(config.out, config.strategy)
    job = prepare_job(config)
    K, speeds = config.islands, config.speeds
    syncer = make_syncer(config, job)
    link = Link.from_config(config.link_bandwidth_mbps, config.link_latency_ms)
    trace = FailureTrace.from_spec(config.chaos, K, config.seed) if config.chaos else None
    workers = [IslandWorker(i, job, n) for i, n in enumerate(expected_steps(config))]
    frag_bytes = [int(idx.numel()) * 4 for idx in job.index]
    frag_share = job.shares
    budget = K * config.steps
    tps = config.tokens_per_step
    if state is not None:
        try:
            syncer.load_state_dict(state["syncer"])
            for w, s in zip(workers, state["islands"], strict=True):
                w.load_state_dict(s)
            st = _Sim.from_state(state["sim"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"resume: the checkpoint of '{out}' does not fit this run ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:160]}); start a new run") from None
        log = MetricsLog(out / "metrics.jsonl", truncate_after_step=start_step)
    else:
        st = _Sim.new(K, syncer.fragments)
        log = MetricsLog(out / "metrics.jsonl")
        st.initial_eval_loss = st.eval_loss = evaluate(job.model, job.val)
        log.log("start", step=0, params=count_parameters(job.model), config=config.model_dump(mode="json"),
                train_tokens=job.data.num_train_tokens, val_tokens=job.data.num_val_tokens,
                tokenizer_from_cache=job.data.tokenizer_from_cache)
        log.log("eval", step=0, tokens=0, eval_loss=st.eval_loss, perplexity=math.exp(st.eval_loss),
                sim_wall_s=0.0, bytes_sent_per_island=0.0)
    (out / "config.json").write_text(config.model_dump_json(indent=2))

    def schedule(i: int, at: float, action: str, p: int = -1) -> int:
        """Queue island i's ``action`` at simulated time ``at``; return the event's seq (its key in in_flight)."""
        heapq.heappush(st.queue, (at, i, st.seq, action, p))
        st.seq += 1
        return st.seq - 1

    def next_step(i: int) -> None:
        """Start island i's next inner step at its clock, or its failure if an outage interrupts it."""
        if st.started >= budget:
            return  # the budget is spent: the island stops
        t, dur = st.clock[i], config.sim_step_s / speeds[i]
        if trace is not None:
            down, up = trace.next_outage(i, t)
            if down < t + dur:
                schedule(i, max(down, t), "fail")
                return
        st.started += 1
        schedule(i, t + dur, "step")

    def send_pull(p: int, t: float, waiters: list[dict[str, Any]]) -> None:
        """Send the global fragment p as it is at time t to each waiting island, over its downlink."""
        params, version = syncer.pull(p)
        for m in waiters:
            i = m["island"]
            st.downlink_free[i] = arrive = max(t, st.downlink_free[i]) + link.transfer_seconds(frag_bytes[p], 1)
            st.in_flight[schedule(i, arrive, "pull", p)] = {
                "island": i, "fragment": p, "params": params, "version": version, "at_push": m["at_push"],
                "epoch": m["epoch"]}

    def close_windows(at: float, flush: bool = False) -> None:
        """Merge the buffers whose grace window has closed by ``at`` (``flush``: every open buffer) and
        answer the islands whose pushes they held."""
        if flush:
            syncer.flush()
        else:
            syncer.poll(at)
        for q in range(syncer.fragments):
            answer(q, at)

    def answer(p: int, t: float) -> None:
        """Fragment p's buffer was merged (or emptied) by time t: answer every island whose push it held."""
        if not syncer.buffers[p].pushes and st.waiting[p]:
            waiters, st.waiting[p] = st.waiting[p], []
            send_pull(p, t, [m for m in waiters if m["epoch"] == st.epoch[m["island"]]])

    def global_model_now() -> PreTrainedModel:
        copy_flat_into(list(job.model.parameters()), syncer.global_params())
        return job.model

    def checkpoint(step: int) -> None:
        """Everything to continue exactly: syncer, islands, clocks and pending events (atomic)."""
        job_state = {"strategy": "decoupled", "syncer": syncer.state_dict(),
                     "islands": [w.state_dict() for w in workers], "sim": st.state_dict(),
                     "data_fingerprint": job.data.fingerprint}
        path = save_checkpoint(out, step, job_state, model=global_model_now(), tokenizer=job.tokenizer)
        log.log("checkpoint", step=step, path=str(path))

    if state is None:
        for i in range(K):
            next_step(i)
    else:  # islands idle at the checkpoint (the end of a shorter run) go on, if the budget grew
        busy = {e[1] for e in st.queue if e[3] in ("step", "fail", "rejoin")}  # transfers run beside compute
        for i in range(K):
            if i in busy:
                continue
            if st.failed_at[i] is not None and st.clock[i] <= st.failed_at[i]:  # down: rejoin after the outage
                schedule(i, trace.next_outage(i, st.failed_at[i])[1], "rejoin")  # type: ignore[union-attr, arg-type]
            else:
                next_step(i)
    give_up_at = GIVE_UP_FACTOR * config.steps * config.sim_step_s / min(speeds)
    gave_up = False
    while st.queue or syncer.next_deadline() is not None:
        if not st.queue:  # only open buffers are left: close them and answer the islands they hold, so no
            close_at = syncer.next_deadline()[0]  # type: ignore[index]  # final push below repeats merged work
            if math.isfinite(close_at):
                close_windows(close_at)
            else:  # no round time measured yet: no window to wait for
                close_windows(st.last_arrival, flush=True)
            continue
        t, i, seq, action, p = st.queue[0]
        if t > give_up_at:
            gave_up = True
            print(f"atoll: warning: chaos: {config.chaos} leaves almost no up-time for a step; stopped at "
                  f"simulated {t:.3g} s ({GIVE_UP_FACTOR:g}x the failure-free time) with {st.done} of {budget} "
                  "inner steps done (raise MTBF_S or lower DOWNTIME_S)", file=sys.stderr)
            break
        deadline = syncer.next_deadline()
        if deadline is not None and deadline[0] <= t:  # a grace window closes: merge without the missing
            close_windows(deadline[0])
            continue
        heapq.heappop(st.queue)
        w = workers[i]
        if action == "step":
            st.last_loss[i] = w.train_step()
            dur = config.sim_step_s / speeds[i]
            st.clock[i], st.compute[i] = t, st.compute[i] + dur
            st.done += 1
            due = w.due()  # at most one fragment is due per step
            if due and st.awaiting[i][due[0]]:  # its previous push or pull is still on the wire: next time
                st.deferred_pushes += 1
            elif due:  # push it on the island's uplink and train on: the transfers overlap compute
                q = due[0]
                at_push = w.fragment_params(q)
                delta, tokens, base_version, nbytes = w.make_push(q)
                st.bytes_sent[i] += nbytes
                st.uplink_free[i] = arrive = max(t, st.uplink_free[i]) + link.transfer_seconds(nbytes, 1)
                st.awaiting[i][q] = True
                st.in_flight[schedule(i, arrive, "push", q)] = {
                    "island": i, "fragment": q, "delta": delta, "tokens": tokens, "base_version": base_version,
                    "at_push": at_push, "epoch": st.epoch[i]}
            next_step(i)
            mean_steps = st.done / K
            if st.done % (K * LOG_EVERY) == 0:
                log.log("train", step=st.done // K, tokens=st.done * tps, loss=sum(st.last_loss) / K,
                        bytes_sent_per_island=sum(st.bytes_sent) / K, sim_wall_s=max(st.clock),
                        lr=w.island.scheduler.get_last_lr()[0])
            if st.done % (K * config.eval_every) == 0 and st.done < budget:
                st.eval_loss = evaluate(global_model_now(), job.val)
                log.log("eval", step=int(mean_steps), tokens=st.done * tps, eval_loss=st.eval_loss,
                        perplexity=math.exp(st.eval_loss), sim_wall_s=max(st.clock),
                        bytes_sent_per_island=sum(st.bytes_sent) / K)
            if config.checkpoint_every and st.done % (K * config.checkpoint_every) == 0 and st.done < budget:
                syncer.save(out / "syncer")
                checkpoint(st.done // K)
        elif action == "push":  # the push reaches the syncer; the island is answered once it is merged
            msg = st.in_flight.pop(seq)
            if msg["epoch"] != st.epoch[i]:  # the island failed while it was on the wire: lost (tokens
                st.lost_pushes += 1           # counted at the failure)
                continue
            result = syncer.push(i, p, msg["delta"], msg["tokens"], msg["base_version"], now=t,
                                 round_s=t - st.pulled_at[i][p])
            st.last_arrival = max(st.last_arrival, t)
            waiter = {"island": i, "at_push": msg["at_push"], "epoch": msg["epoch"]}
            if result.accepted:
                st.waiting[p].append(waiter)
                answer(p, t)  # if it completed a quorum: everyone in the merge gets the new global fragment
            else:  # refused (invalid or stale): answered at once with the global fragment as it is
                send_pull(p, t, [waiter])
        elif action == "pull":  # the pulled fragment arrives: adopt it, keeping the work done since the push
            msg = st.in_flight.pop(seq)
            if msg["epoch"] != st.epoch[i]:
                continue
            w.adopt(p, msg["params"], msg["version"], at_push=msg["at_push"])
            st.awaiting[i][p] = False
            st.pulled_at[i][p] = t
        elif action == "fail":
            st.failures[i] += 1
            st.failed_at[i] = t
            st.lost_tokens += w.lose_work() + sum(  # pushes still on the wire die with the island
                m["tokens"] * frag_share[m["fragment"]] for m in st.in_flight.values()
                if m["island"] == i and m["epoch"] == st.epoch[i] and "tokens" in m)
            st.epoch[i] += 1
            st.awaiting[i] = [False] * syncer.fragments
            _, up = trace.next_outage(i, t)  # type: ignore[union-attr]
            st.clock[i] = t
            schedule(i, up, "rejoin")
        elif action == "rejoin":
            if st.started >= budget:
                continue  # the run is over: the island stays down
            w.rejoin(syncer.global_params(), [syncer.version(q) for q in range(syncer.fragments)])
            st.clock[i] = t + link.transfer_seconds(sum(frag_bytes), 1)  # blocking: nothing to train on yet
            st.uplink_free[i] = st.downlink_free[i] = st.clock[i]
            st.pulled_at[i] = [st.clock[i]] * syncer.fragments
            st.rejoin_s.append(st.clock[i] - st.failed_at[i])  # type: ignore[operator]
            st.rejoins[i] += 1
            next_step(i)

    # --- the end: every live island pushes what it has not pushed, the syncer merges every buffer --------
    alive = [i for i in range(K) if st.failed_at[i] is None or st.clock[i] > st.failed_at[i]]
    for i in sorted(alive, key=lambda j: (st.clock[j], j)):
        w = workers[i]
        for p in range(syncer.fragments):
            if w.tokens_since[p] > 0:
                delta, tokens, base_version, nbytes = w.make_push(p)
                st.bytes_sent[i] += nbytes
                st.uplink_free[i] = arrive = max(st.clock[i], st.uplink_free[i]) + link.transfer_seconds(nbytes, 1)
                syncer.push(i, p, delta, tokens, base_version, now=arrive, round_s=arrive - st.pulled_at[i][p])
                st.last_arrival = max(st.last_arrival, arrive)
    syncer.flush()
    for i in alive:  # every live island takes the final global fragments, as a pull would: a run continued with
        for p in range(syncer.fragments):  # a longer --steps must not push its final work a second time
            workers[i].adopt(p, *syncer.pull(p))
    sim_wall_s = max([st.last_arrival] + ([st.clock[i] for i in alive] or [max(st.clock)]))
    st.eval_loss = evaluate(global_model_now(), job.val)
    log.log("eval", step=config.steps, tokens=st.done * tps, eval_loss=st.eval_loss, perplexity=math.exp(st.eval_loss),
            sim_wall_s=sim_wall_s, bytes_sent_per_island=sum(st.bytes_sent) / K)
    syncer.save(out / "syncer")
    checkpoint(config.steps)

    ideal_rate = sum(tps * s / config.sim_step_s for s in speeds)
    stats = syncer.stats()
    n_params = count_parameters(job.model)
    ddp_bytes = config.steps * ring_allreduce_bytes(param_bytes(job.model), K)
    mean_bytes = sum(st.bytes_sent) / K
    wall_s = time.perf_counter() - t0
    summary: dict[str, Any] = {
        "strategy": config.strategy, "runtime": config.runtime, "islands": K, "sync_every": config.sync_every,
        "steps": config.steps, "model": config.model, "params": n_params, "data": config.data,
        "partition": config.partition, "seed": config.seed, "tokens": st.done * tps,
        "initial_eval_loss": st.initial_eval_loss, "final_eval_loss": st.eval_loss, "final_perplexity": math.exp(st.eval_loss),
        "bytes_sent_per_island": mean_bytes, "bytes_sent_by_island": st.bytes_sent, "ddp_bytes_per_island": ddp_bytes,
        "reduction_vs_ddp": ddp_bytes / mean_bytes if mean_bytes else None, "codec": config.codec,
        "fragments": config.fragments, "overlap_steps": 0, "exchanges": stats["accepted_updates"],
        "peak_bytes_per_exchange": float(max(frag_bytes)) if config.codec == "fp32" else None,
        **stats, "skipped_steps": sum(w.island.skipped_steps for w in workers),
        "link_bandwidth_mbps": config.link_bandwidth_mbps, "link_latency_ms": config.link_latency_ms,
        "island_speeds": speeds, "sim_step_s": config.sim_step_s, "chaos": config.chaos,
        "steps_per_island": [w.steps for w in workers], "deferred_pushes": st.deferred_pushes,
        "lost_pushes": st.lost_pushes,
        "useful_tokens": syncer.merged_tokens, "lost_tokens": st.lost_tokens,
        "goodput": syncer.merged_tokens / sim_wall_s / ideal_rate if sim_wall_s > 0 else 1.0,
        "island_utilization": [c / sim_wall_s if sim_wall_s > 0 else 1.0 for c in st.compute],
        "failures": st.failures, "rejoins": st.rejoins, "rejoin_s": st.rejoin_s,
        "down_at_end": [i for i in range(K) if i not in alive], "gave_up": gave_up,
        "measured_compute_s": [w.island.compute_s for w in workers],
        "compute_s": max(st.compute), "sim_wall_s": sim_wall_s,
        "compute_utilization": max(st.compute) / sim_wall_s if sim_wall_s > 0 else 1.0,
        "wall_s": wall_s, "init_from": str(config.init_from) if config.init_from else None, "out": str(out),
    }
    log.log("end", step=config.steps, **summary)
    log.close()
    write_summary(out, summary)
    plot_runs([out], out / "report.png")
    return summary
