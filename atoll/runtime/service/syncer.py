"""The syncer of a decoupled run as a service on a real clock: pushes, pulls, the shared step budget, atomic
checkpoints, and the run's clock, whatever carries the calls.

:class:`SyncerService` is one object that two runtimes serve: the ``ray`` runtime makes it an actor
(:mod:`atoll.runtime.ray`), ``atoll syncer`` serves it over gRPC to islands that are jobs of their own
(:mod:`atoll.runtime.service`). It holds a :class:`~atoll.strategies.decoupled.syncer.Syncer` (the maths and the
admission checks, unchanged) and never imports a transport. Calls are not thread-safe: a server that runs
them in threads holds one lock around each.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from atoll.algorithms.fragments import FlatFragment
from atoll.config import TrainConfig
from atoll.job.checkpoint import write_text_atomic
from atoll.runtime.decoupled_job import prepare_job, push_sync_every, syncer_of
from atoll.runtime.service import syncer_shards as sharding
from atoll.runtime.service.durable import DurableService
from atoll.runtime.service.island_state import IslandState, RejoinTimes
from atoll.strategies.decoupled.island import save_path
from atoll.strategies.decoupled.journal import JOURNAL_SIZE
from atoll.strategies.decoupled.progress import RECENT, syncer_events
from atoll.strategies.decoupled.protocol import Pull, Push, is_index
from atoll.strategies.decoupled.syncer import Syncer


class LeaseRefused(Exception):
    """A step lease refused (:meth:`SyncerService.reserve_steps`): nothing granted, the island may ask again.

    Attributes:
        reason: ``used`` (the island's ``used`` fell below what it reported before in its session) or ``lease``
            (it holds as many steps it has not used as an honest island can: :meth:`SyncerService.lease_hold`).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class SyncerRun:
    """What the syncer service reads of the run beside its syncer (plain data: it crosses process boundaries).

    Attributes:
        islands: the run's islands.
        steps: inner steps per island: the shared budget is ``islands x steps``.
        tokens_per_step: training tokens of one inner step of an island (its ledger grants them per step).
        push_tokens: per island, the tokens of one honest push at its own H (a syncer restarted from a
            checkpoint without its ledger grants each island that much more: the steps granted since were taken
            and are not in it).
    """

    islands: int
    steps: int
    tokens_per_step: int
    push_tokens: tuple[int, ...]

    @classmethod
    def of(cls, config: TrainConfig) -> SyncerRun:
        """The facts of a whole run's settings (an entry point's)."""
        return cls(islands=config.islands, steps=config.steps, tokens_per_step=config.tokens_per_step,
                   push_tokens=tuple(h * config.tokens_per_step for h in push_sync_every(config)))


def prepare(config: TrainConfig, credentials: list[str] | None = None, shard: int = 0, shards: int = 1,
            key: bytes = b"") -> tuple[SyncerRun, list[FlatFragment], Syncer, sharding.ShardSpec | None]:
    """The pieces of a :class:`SyncerService` from a run's settings (an entry point's: ``atoll syncer``, the Ray
    actor's process): the run's facts, its job prepared (data and initial model, the same as the islands'; its
    fragments), the syncer of shard ``shard`` of ``shards`` (the whole model when 1, else the fragments the
    shard owns, :class:`~atoll.runtime.service.syncer_shards.ShardSpec` with the run's secret ``key``)
    built from the decoupled strategy's settings with the islands' ``credentials``."""
    torch.set_num_threads(1)
    job = prepare_job(config)
    numels = [int(f.numel()) for f in job.index]
    spec = sharding.ShardSpec.of(shard, shards, key, numels) if shards > 1 else None
    init, index = sharding.shard_vector(job.init_flat, [job.index[p] for p in spec.fragments]) \
        if spec is not None else (job.init_flat, job.index)
    return SyncerRun.of(config), job.index, syncer_of(config, init, index, credentials), spec


class SyncerService(DurableService):
    """The syncer as a Ray actor: pushes, pulls, the shared step budget, atomic checkpoints, and the run's clock.

    The run's clock starts when the first inner step of any island is granted (:meth:`reserve_step`), not when
    the actors start: preparing the data and the model in every actor, and Ray's start-up, are not training
    time. It is this process's monotonic clock, so no clocks of different nodes are compared.

    Every call is checked as if from a stranger: an island index that is not one of the run's is refused
    before anything is recorded for it (a push is refused and counted, as ``island``; :meth:`join`,
    :meth:`reserve_step` and :meth:`buffered` raise ValueError), and only the island's credential opens a
    session (:meth:`join`) or takes a step (:meth:`reserve_step`, else PermissionError). Each step granted is
    entered in the syncer's token ledger (:meth:`~atoll.strategies.decoupled.syncer.Syncer.grant`, open from
    the start), so an island's token claims are bounded by the steps it was granted, as in the local
    simulation. The ledger is checkpointed with the syncer, and with the budget at every grant, release, join
    and leave (``ledger.json``, :meth:`_save_ledger`): a restarted syncer continues from it, so an honest push
    after a restart is not refused for its tokens and the merged tokens never exceed the steps granted (a
    checkpoint without one: each island is granted one push of tokens at its own H more).

    **Leases.** An island job takes its steps a round at a time (:meth:`reserve_steps`, ahead of need: one
    call per lease, not one per inner step), reporting the steps of its session it has used. Steps it was
    granted and did not use go back to the budget: those it returns as it leaves (:meth:`leave_session`: the
    ledger too, as they were never trained), and those of a session that ended without leaving (a killed
    island) when the island joins again (the budget only: the ledger keeps them, as the island may have
    pushed tokens of steps it had not reported yet).

    Args:
        run: what the service reads of the run (:class:`SyncerRun`).
        index: the run's fragments (every one, also those of other shards), their ranges of the flat vector.
        syncer: the syncer of this shard's fragments (all of them unsharded), built from the decoupled strategy's
            config (:func:`prepare` does both from a run's settings), its credentials per island (each island
            actor is given only its own): a push counts only as the island whose secret it carries
            (:class:`~atoll.strategies.decoupled.trust.Admission`).
        out: the run folder (checkpoints go to ``out/syncer``).
        shard, key: this service is shard ``shard`` of a syncer sharded by fragment, ``key`` the run's secret
            (:mod:`~atoll.runtime.service.syncer_shards`): its syncer holds the fragments ``fragment_ids``
            only. A checkpoint of another shard or map is refused (ValueError). None: unsharded.
        pid_dir: the folder under ``out`` where the process writes ``syncer.pid`` (for tests and operators).
    """

    def __init__(self, run: SyncerRun, index: list[FlatFragment], syncer: Syncer, out: str,
                 shard: sharding.ShardSpec | None = None, key: bytes = b"", pid_dir: str = "ray") -> None:
        self.run = run
        self.index, self.numels = index, [int(f.numel()) for f in index]  # the run's fragments
        self.shard = shard
        self.fragment_ids = shard.fragments if shard is not None else list(range(len(index)))
        self.grants = sharding.GrantBook(run.islands, key, shard.run) \
            if shard is not None and not shard.coordinator else None
        self.syncer = syncer
        self.out = Path(out)
        self.t0 = time.monotonic()
        # the start gate (started()): monotonic times of the first join and of the run's start
        self.first_join: float | None = None
        self.started_at: float | None = None
        self.budget = run.islands * run.steps
        self.reserved = 0
        self.islands = [IslandState() for _ in range(run.islands)]  # what the service keeps of each island
        self.rejoins = RejoinTimes()  # bounded however often islands join
        # (island, fragment) this process answered a pull of (or the island joined here): only their 'have' is
        # this process's history (pull_since); not checkpointed, so a restarted syncer trusts none
        self.synced: set[tuple[int, int]] = set()
        self.restarts = 0
        # on _now()'s clock: when the first inner step of the run, and of each island, was granted
        self.first_step_s: float | None = None
        # for the driver's progress and run events (progress()): not checkpointed, a restart starts them anew
        # pushes and rejoins (the syncer journals the rest); the oldest go first where nobody drains them
        self.events: deque[tuple[str, dict[str, Any]]] = deque(maxlen=JOURNAL_SIZE)
        for island in range(run.islands):  # the token ledger holds from the first push on
            self.syncer.grant(island, 0)
        state = self._restore()  # a restart after a crash: from the newest readable checkpoint, and the ledger
        epoch = state.get("service", {}).get("grant_epoch") if state is not None else None
        self.issuer = (sharding.GrantIssuer(self.shard, save_path(self.out) / "coordinator.json",
                                            self.syncer.admission, checkpoint_epoch=epoch)
                       if self.shard and self.shard.coordinator else None)
        self._open_writer()
        pids = self.out / pid_dir
        pids.mkdir(parents=True, exist_ok=True)
        write_text_atomic(pids / "syncer.pid", str(os.getpid()))

    def grant(self, island: int) -> dict[str, Any] | None:
        """(The coordinator of a sharded syncer.) ``island``'s signed grant of its session and tokens granted
        (:class:`~atoll.runtime.service.syncer_shards.GrantIssuer`); None unsharded or on another shard."""
        if self.issuer is None:
            return None
        return self.issuer.sign(island, self.syncer.admission.session[island], self.syncer.bounds.granted[island])

    def admit_grant(self, island: int, grant: Any, session: Any) -> str:
        """(A shard but the coordinator.) Why a push of ``island`` in ``session`` with ``grant`` is refused, or ""
        and its ledger set to its newest grant (:meth:`~atoll.runtime.service.syncer_shards.GrantBook.admit`)."""
        reason, tokens = self.grants.admit(island, grant, session) if self.grants is not None else ("", None)
        if tokens is not None:
            granted = self.syncer.bounds.granted
            self.syncer.grant(island, tokens - (granted[island] if granted is not None else 0))
        return reason

    def _run_clock(self, t: float) -> float:
        """``t`` (this actor's clock) on the run's clock: seconds from the first inner step, 0 before it."""
        return max(0.0, t - self.first_step_s) if self.first_step_s is not None else 0.0

    def _poll(self) -> None:
        if self.syncer.poll(self._now()):
            self._save()

    def _island(self, call: str, island: Any, credential: Any = None) -> None:
        """Refuse a call that names no island of the run (ValueError) or, given a ``credential``, not its own
        (PermissionError); one-line messages."""
        if not is_index(island, self.run.islands):
            raise ValueError(f"{call}: island {island!r} is not one of this run's islands "
                             f"0..{self.run.islands - 1}")
        if credential is not None and not self.syncer.admission.identity(island, credential):
            raise PermissionError(f"{call}: island {island}'s credential does not match; "
                                  "an island calls only as itself")

    def join(self, island: int, credential: str = "") -> tuple[torch.Tensor, list[int], int, int]:
        """An island (re)starts: (global params (numel,), versions, its inner steps so far, its new session
        for its pushes: :meth:`~atoll.strategies.decoupled.syncer.Syncer.rejoin`).

        Raises:
            ValueError: ``island`` is not one of the run's.
            PermissionError: ``credential`` is not the island's (only the island may open its sessions).
        """
        self._island("join", island, credential)
        self.first_join = self.first_join or time.monotonic()
        now = self._now()
        state = self.islands[island]
        state.heard = now
        state.joins += 1
        if state.joins > 1:
            self.rejoins.add(now - state.last_seen)
            self.events.append(("rejoin", {"island": island, "rejoin_s": now - state.last_seen,
                                           "sim_wall_s": self._run_clock(now)}))
        state.last_seen = now
        # a session that ended without leaving (killed): the steps it was granted and never said it used go
        # back to the budget (not to the ledger: it may have pushed tokens of steps it had not reported)
        self._used(island, None)  # (what its pushes claimed counts as used)
        self.release_steps(island, state.leased - state.lease_used, ledger=False)
        state.leased = state.lease_used = state.reported = 0
        self._poll()
        state.claimed_from = list(self.syncer.bounds.claimed[island])  # this session's claims: those from here
        session = self.syncer.rejoin(island)
        state.open_session(session)  # this job's figures (its reports) from here on
        self.synced.update((island, f) for f in range(self.syncer.fragments))  # (it pulls every fragment whole)
        self._save_ledger()
        if self.issuer is not None:  # kept before its grant goes out
            self.issuer.opened(self.syncer.admission)
        return (self.syncer.pulled_params(), [self.syncer.version(p) for p in range(self.syncer.fragments)],
                state.steps, session)

    def started(self, timeout_s: float) -> bool:
        """Has the run started: every island joined, or ``timeout_s`` seconds passed since the first did (or since
        a syncer restarted before every island joined first asked), or steps were granted already (a syncer
        restarted from its checkpoint)? No step is granted before (the gRPC server answers ``wait``; a Ray island
        waits in :meth:`wait_start`): the islands start together, as the learners of one run, and an island that
        takes longer to start (a cold process, torchrun, a loaded host) does not find the shared budget spent by
        the others."""
        if self.first_join is None and any(s.joins > 0 for s in self.islands):
            # a syncer restarted before every island joined: the joins it restored were heard before, and those
            # islands do not join again, so the timeout runs from now (else one that never joins stops the run)
            self.first_join = time.monotonic()
        late = self.first_join is not None and time.monotonic() - self.first_join > timeout_s
        if self.started_at is None and (all(s.joins > 0 for s in self.islands) or self.reserved > 0 or late):
            self.started_at = time.monotonic()
        return self.started_at is not None

    def wait_start(self, island: int, credential: str = "", timeout_s: float = 60.0) -> bool:
        """(Ray) :meth:`started`, asked by ``island`` before its first step (it is heard: waiting is not
        silence).

        Raises:
            ValueError: ``island`` is not one of the run's.
            PermissionError: ``credential`` is not the island's.
        """
        self._island("wait_start", island, credential)
        self.islands[island].heard = self._now()
        return self.started(timeout_s)

    def reserve_step(self, island: int, credential: str = "", loss: Any = None,
                     lr: Any = None) -> tuple[bool, list[int]]:
        """Take one inner step from the shared budget of ``islands x steps``; its tokens are granted to
        ``island`` in the syncer's ledger (the bound of its token claims). ``loss`` and ``lr``: the island's
        last training loss (nats per token) and inner learning rate, for the driver's progress only (a value
        that is not a finite number is ignored).

        Returns (False once the budget is spent; the fragments whose buffer still holds a push of
        ``island``, see :meth:`buffered`).

        Raises:
            ValueError: ``island`` is not one of the run's.
            PermissionError: ``credential`` is not the island's.
        """
        go = self.reserve_steps(island, credential, 1, loss=loss, lr=lr) == 1
        state = self.islands[island]
        state.lease_used = state.leased  # a step asked for alone is taken at once
        return go, self._buffered(island)

    def reserve_steps(self, island: int, credential: str, n: int, used: Any = None, loss: Any = None,
                      lr: Any = None, compute_s: Any = None, bytes_sent: Any = None,
                      bytes_received: Any = None, received: Any = None) -> int:
        """Take up to ``n`` inner steps from the shared budget for ``island`` (a lease), at most
        :meth:`lease_share`: the steps granted (fewer than ``n``: the budget is spent), each entered in the
        syncer's token ledger. ``used``: the steps of its session the island has used so far
        (:meth:`release_steps` gives the rest back if it never returns); ``loss``, ``lr``: as
        :meth:`reserve_step`; ``compute_s``, ``bytes_sent``, ``bytes_received``: the session's figures so far
        (seconds of compute, bytes of its pushes, bytes of the global fragments it pulled;
        :meth:`IslandState.report <atoll.runtime.service.island_state.IslandState.report>`).

        **Bounded by construction** (an island that lies about ``used`` holds at most :meth:`lease_hold` steps
        it has not used): ``used`` never decreases within a session (else refused, ``used``), counts at most
        the steps granted in the session plus the island's credit (:meth:`lease_credit`; more is taken as that
        much), and at least the steps whose tokens its pushes in the session claimed (the token ledger); a
        lease is cut to leave the island at most :meth:`lease_hold` steps granted and not used, and refused
        (``lease``) when it holds that many already. ``received``: the steps of its session the island was
        granted as it counts them; fewer than the syncer granted (a reply that never reached it) are granted
        again in this answer, from the steps already taken from the budget, so an island whose replies were
        lost is never refused.

        Raises:
            ValueError: ``island`` is not one of the run's, or ``n`` is not a positive int.
            PermissionError: ``credential`` is not the island's.
            LeaseRefused: nothing granted (see above): the island asks again once it has used steps.
        """
        self._island("reserve_step", island, credential)
        if not (is_index(n, math.inf) and n > 0):
            raise ValueError(f"reserve_steps: n must be a positive int, got {n!r}")
        state = self._session_record(island)
        state.heard = self._now()
        if is_index(used, math.inf) and used < state.reported:
            raise LeaseRefused("used", f"reserve_steps: island {island} reported {used} steps of its session used "
                                       f"after {state.reported}; the steps used never decrease")
        self._poll()
        self._used(island, used)
        lost = max(0, state.leased - received) if is_index(received, math.inf) else 0
        held, hold = state.leased - state.lease_used, self.lease_hold(island)
        fresh = max(0, min(n - lost, self.lease_share(island), hold - held))
        if fresh == 0 and n > lost:
            raise LeaseRefused("lease", f"reserve_steps: island {island} holds {held} steps of its session it has "
                                        f"not reported used; at most {hold} are granted ahead")
        state.last_seen = state.heard
        if isinstance(loss, float) and math.isfinite(loss) and isinstance(lr, float) and math.isfinite(lr):
            state.last_loss, state.last_lr = loss, lr
        state.report(compute_s=compute_s, bytes_sent=bytes_sent, bytes_received=bytes_received)
        granted = max(0, min(fresh, self.budget - self.reserved))
        if granted == 0:
            self._save_ledger()
            return lost
        self.reserved += granted
        state.steps += granted
        state.leased += granted
        self.syncer.grant(island, granted * self.run.tokens_per_step)
        if state.first_step_s is None:
            state.first_step_s = state.last_seen
            if self.first_step_s is None:  # the run's clock starts: every earlier second was start-up
                self.first_step_s = state.last_seen
        self._save_ledger()
        return lost + granted

    def _session_record(self, island: int) -> IslandState:
        """``island``'s record, its lease that of its present session: a syncer restarted from a checkpoint
        older than the island's join, without its ledger, holds the lease of a session before (the island's
        calls carry the newer one, :meth:`Admission.seen <atoll.strategies.decoupled.trust.Admission.seen>`);
        it is closed as that join would have (the steps not used back to the budget) and the present session's
        opened, so the island's reports are never compared with another session's."""
        state = self.islands[island]
        session = self.syncer.admission.session[island]
        if state.sessions and state.sessions[-1].session < session:
            self.release_steps(island, state.leased - state.lease_used, ledger=False)
            state.leased = state.lease_used = state.reported = 0
            state.claimed_from = None  # its claims since that join are not known
            state.open_session(session)
        return state

    def _own_h(self, island: int) -> int:
        """``island``'s own H (inner steps per round; 0: not known): the size of an honest island's lease."""
        return self.run.push_tokens[island] // self.run.tokens_per_step \
            if self.run.tokens_per_step > 0 and island < len(self.run.push_tokens) else 0

    def lease_share(self, island: int) -> int:
        """The most steps one lease of ``island`` may take: its share of the budget (``steps``, the budget over
        the islands), or two rounds at its own H if more (what an honest island asks at most: a round ahead
        and the steps it trained on credit), so no single call takes the other islands' budget."""
        return max(1, self.run.steps, 2 * self._own_h(island))

    def lease_credit(self, island: int) -> int:
        """The steps ``island`` may take on credit while the syncer is unreachable: one round at its own H
        (:class:`~atoll.runtime.service.lease.StepLease`'s ``offline_steps``, as ``atoll island`` sets it)."""
        return self._own_h(island)

    def lease_hold(self, island: int) -> int:
        """The most steps of its session ``island`` may hold granted and not reported used after a lease: its
        lease in hand, one lease ahead and its credit, a round each at its own H (3 H; an honest
        :class:`~atoll.runtime.service.lease.StepLease` holds at most H/2 when it asks, then asks at most 2 H:
        its round and the steps it took on credit). Without a known H: :meth:`lease_share`."""
        h = self._own_h(island)
        return 3 * h if h > 0 else self.lease_share(island)

    def _claimed_steps(self, island: int) -> int:
        """The steps whose tokens ``island``'s pushes of its current session claimed (the token ledger's claims
        since the session opened, of the fragment with the most; rounded up): what it used at least."""
        state, tps = self.islands[island], self.run.tokens_per_step
        if state.claimed_from is None or tps <= 0:
            return 0
        since = [c - f for c, f in zip(self.syncer.bounds.claimed[island], state.claimed_from, strict=False)]
        return -(-max(0, *since) // tps) if since else 0

    def _used(self, island: int, used: Any) -> None:
        """Record ``used``, the steps of its session ``island`` reports (ignored unless an int >= 0; at most its
        session's grant plus its credit), and the steps the service counts as used: at least those its pushes
        claimed, at most those granted, never fewer than before."""
        state = self.islands[island]
        if is_index(used, math.inf):
            state.reported = max(state.reported, min(used, state.leased + self.lease_credit(island)))
            state.report(steps=state.reported)
        state.lease_used = max(state.lease_used, min(state.leased, max(state.reported, self._claimed_steps(island))))

    def release_steps(self, island: int, n: int, ledger: bool) -> int:
        """Give ``n`` steps granted to ``island`` back to the shared budget (at most those it was granted);
        ``ledger``: take their tokens out of its token ledger too (steps never trained). Returns the steps
        given back."""
        state = self.islands[island]
        n = max(0, min(int(n), state.steps))
        self.reserved -= n
        state.steps -= n
        state.leased -= min(n, state.leased)
        if ledger and n:
            self.syncer.grant(island, -n * self.run.tokens_per_step)
        return n

    def leave_session(self, island: int, used: Any, compute_s: Any = None, bytes_sent: Any = None,
                      bytes_received: Any = None) -> int:
        """``island`` leaves, having used ``used`` steps of its session: the rest of its lease goes back to the
        budget and out of its ledger (:meth:`release_steps`); returns those steps. ``compute_s``, ``bytes_sent``,
        ``bytes_received``: its session's figures at the end (its Leave report).

        Raises:
            ValueError: ``island`` is not one of the run's.
        """
        self._island("leave", island)
        state = self._session_record(island)
        self._used(island, used)  # (a report below the one before counts nothing: the record stands)
        state.report(compute_s=compute_s, bytes_sent=bytes_sent, bytes_received=bytes_received)
        returned = self.release_steps(island, state.leased - state.lease_used, ledger=True)
        state.leased = state.lease_used = 0
        self._save_ledger()
        return returned

    def refuse(self, island: int, fragment: Any, reason: str, tokens: Any) -> None:
        """Count a push of ``island`` refused before it could reach the syncer's own checks (its slices did
        not tile the fragment: ``slices``), as the syncer counts its refusals."""
        self.syncer._refuse(island, fragment, reason, tokens)  # (the syncer's one counter of refusals)
        self.events.append(("push", {"island": island, "fragment": fragment, "outcome": "refused",
                                     "island_step": self.islands[island].steps,
                                     "sim_wall_s": self._run_clock(self._now())}))

    def stop(self) -> int:
        """Grant no more inner steps (the driver was asked to stop by SIGINT or SIGTERM): every island finishes
        the step it holds and pushes what it has not pushed, as at the end of the budget. Returns the inner
        steps granted."""
        self.budget = self.reserved
        return self.reserved

    def buffered(self, island: int) -> list[int]:
        """Fragments whose buffer holds a push of ``island`` not merged yet (closing due grace windows first).

        Raises:
            ValueError: ``island`` is not one of the run's.
        """
        self._island("buffered", island)
        self.islands[island].heard = self._now()  # waiting for its push to merge: alive
        self._poll()
        return self._buffered(island)

    def _buffered(self, island: int) -> list[int]:
        return [p for p, b in enumerate(self.syncer.buffers) if any(x.island == island for x in b.pushes)]

    def push(self, msg: Push, values: bool = True, *, norm: float | None = None,
             owned: bool = False) -> tuple[bool, Pull | None]:
        """Take a push: (accepted, the answer: the global fragment, or None while the push waits in the buffer).

        The answer comes back at once when the push is merged (it completed a quorum) or refused (None if it
        named no island or fragment of the run); while it waits in the buffer the island pulls once
        :meth:`buffered` no longer lists it. A bad push is refused and counted, never raised. ``values`` False:
        the answer's ``params`` are empty (its version and realignment only: the service's islands download the
        values apart, so no copy of the fragment is made under the server's lock). ``norm``, ``owned``: the
        server's facts about the Δ it decoded (:meth:`Syncer.push <atoll.strategies.decoupled.syncer.Syncer.push>`),
        never an island's.
        """
        now = self._now()
        self._poll()
        result = self.syncer.push(msg, now=now, norm=norm, owned=owned)
        if result.reason in ("type", "island", "fragment"):  # nothing of an island's own to record
            if result.reason == "type" and isinstance(msg, Push) and is_index(msg.fragment, self.syncer.fragments):
                # a payload that did not decode, for a fragment of the run: refused now, as any refusal is answered
                return False, self._answer(msg.fragment, None, values)
            return False, None
        if result.reason != "identity":  # the island's own call
            state = self.islands[msg.island]
            state.last_seen = state.heard = now
            state.bytes_received += float(msg.nbytes) if isinstance(msg.nbytes, int | float) else 0.0
            outcome = "accepted" if result.accepted else "stale" if result.reason == "stale" else "refused"
            self.events.append(("push", {"island": msg.island, "fragment": msg.fragment, "outcome": outcome,
                                         "island_step": state.steps,
                                         "sim_wall_s": self._run_clock(now)}))
        if result.committed:
            self._save()
        if result.accepted and msg.fragment in self._buffered(msg.island):
            return True, None
        return result.accepted, self._answer(msg.fragment, msg.island if result.accepted else None, values,
                                             have=msg.base_version)

    def pull(self, fragment: int, island: int | None = None, have: int | None = None) -> Pull:
        """The newest global fragment; ``island``: the answer to that island's merged push, which says how far
        behind it arrived with ``realign_pushes`` (:meth:`Syncer.take_behind
        <atoll.strategies.decoupled.syncer.Syncer.take_behind>`; the ``ray`` runtime's islands ask so); ``have``:
        the version of the fragment the island holds, for a ``pull_codec`` other than fp32 (the changes since it;
        None: the full fragment, :meth:`Syncer.pull <atoll.strategies.decoupled.syncer.Syncer.pull>`).

        Raises:
            ValueError: ``fragment`` is not one of the run's.
        """
        if not is_index(fragment, self.syncer.fragments):
            raise ValueError(f"pull: fragment {fragment!r} is not one of this run's fragments "
                             f"0..{self.syncer.fragments - 1}")
        self._poll()
        return self._answer(fragment, island, have=self.pull_since(island, fragment, have))

    def pull_since(self, island: int | None, fragment: int, have: int | None) -> int | None:
        """(A ``pull_codec`` other than fp32.) The version of ``fragment`` that ``island`` holds, as this process
        can trust it: ``have`` once this process answered the island a pull of it (or the island joined here),
        else None, the full fragment. A syncer restarted from its checkpoint may have lost commits an island had
        already pulled (the checkpoint is written after the answer), and numbers their versions again for other
        changes: a ``have`` from before the restart names another history, and the payloads since it would leave
        the island's copy off the shadow for good. ``island`` None (a caller without restarts): ``have``. Asked
        as the island is answered: from this call on, its versions of ``fragment`` are this process's."""
        trusted = island is None or (island, fragment) in self.synced
        if is_index(island, self.syncer.islands):
            self.synced.add((island, fragment))
        return have if trusted else None

    def merged_answer(self, island: int, fragment: int) -> float | None:
        """The realignment that goes with the answer to ``island``'s push of ``fragment`` (this syncer's index)
        that has left the buffer, merged (the service's ``Buffered`` says so): the share of a round it arrived
        behind the fragment's previous, larger merge, in [0, 1), said once (:meth:`Syncer.take_behind
        <atoll.strategies.decoupled.syncer.Syncer.take_behind>`); None without ``realign_pushes`` (the reply
        leaves the field out) or for no island or fragment of this syncer's."""
        if not self.syncer.realign or not is_index(island, self.syncer.islands) or \
                not is_index(fragment, self.syncer.fragments):
            return None
        return self.syncer.take_behind(island, fragment)

    def _answer(self, fragment: int, island: int | None, values: bool = True, *, have: int | None = None) -> Pull:
        """The answer to ``island``'s push of ``fragment`` (None: refused, no realignment): the newest fragment
        (the changes since ``have`` with a ``pull_codec`` other than fp32); without ``values`` its version only
        (no copy: the server answers a push with the version to pull)."""
        pull = self.syncer.pull(fragment, have) if values else \
            Pull(fragment, torch.empty(0), self.syncer.version(fragment))
        if island is None or not self.syncer.realign or not is_index(island, self.syncer.islands):
            return pull
        return replace(pull, realign=self.syncer.take_behind(island, fragment))

    def finish(self) -> dict[str, Any]:
        """Merge every open buffer, checkpoint, and return the statistics and the global parameters. Raises the
        error of that last checkpoint's write (OSError: a full disk), which no later commit retries.

        Also the run's clock: ``run_s``, seconds from the first inner step granted to now (0 if none was),
        ``clock_s``, the seconds of this service's clock (from its first start, continued across restarts from
        the checkpoint's), and ``island_start_s``, per island the seconds from that first step to the island's
        own first step (None: it took none); ``sessions``: per island its sessions' figures (the most recent,
        :class:`~atoll.runtime.service.island_state.Session` as dicts) and ``island_totals``: per island those
        figures summed over every session.
        """
        self.syncer.flush()
        failed = self.writer.failed
        self._save(wait=True)
        if self.writer.failed > failed and self.last_write_error is not None:  # no next commit to retry at
            raise self.last_write_error
        start = self.first_step_s
        run_s = self._now() - start if start is not None else 0.0
        island_start_s = [None if i.first_step_s is None or start is None else i.first_step_s - start
                          for i in self.islands]
        return {"run_s": run_s, "clock_s": self._now(), "island_start_s": island_start_s,
                "sessions": [[x.state_dict() for x in i.sessions] for i in self.islands],
                "island_totals": [i.total().state_dict() for i in self.islands],
                "stats": self.syncer.stats(), "global": self.syncer.global_params(), "syncer_restarts": self.restarts,
                "merged_tokens": self.syncer.merged_tokens, "rejoin_s": list(self.rejoins.recent),
                "rejoin_times": self.rejoins.summary(),
                "joins": [i.joins for i in self.islands], "steps_by_island": [i.steps for i in self.islands],
                "versions": [self.syncer.version(p) for p in range(self.syncer.fragments)]}

    def alive(self, island: int, session: Any) -> bool:
        """Without the server's lock: if ``session`` is ``island``'s present session (a valid index, an int equal
        to it), note the island heard now and return True; else False (no session, an older or a later one: the
        caller takes the lock and :meth:`heartbeat`'s full check). Only reads and two float assignments, each
        whole under the GIL: a Join racing it opens a newer session, whose calls the island sends after the
        Join's answer, and an older session's heartbeat read before the Join counts its island heard, as it was.
        """
        if not is_index(island, self.run.islands) or not isinstance(session, int) or isinstance(session, bool) \
                or session != self.syncer.admission.session[island]:
            return False
        state = self.islands[island]
        state.last_seen = state.heard = self._now()
        return True

    def heartbeat(self, island: int) -> dict[str, Any]:
        """``island`` is alive (its last call is now); return :meth:`progress` (its run events stay for the
        driver).

        Raises:
            ValueError: ``island`` is not one of the run's.
        """
        self._island("heartbeat", island)
        state = self.islands[island]
        state.last_seen = state.heard = self._now()
        return self.progress(drain=False)

    def progress(self, drain: bool = True) -> dict[str, Any]:
        """The run so far, for the driver's watch, progress line, ``train`` events and run events (and tests).

        Returns commits, steps reserved, the budget, versions; ``silent_s``, per island the seconds since its
        last call (None before its first); ``starved``, the one-line reason to stop if an island's pushes were
        all refused (:meth:`~atoll.strategies.decoupled.syncer.Syncer.starved`; ""); ``run_s`` (the run's
        clock), ``steps_by_island``, ``loss_by_island`` and ``lr_by_island`` (None until an island reports),
        ``bytes_by_island``, the recent ``staleness`` of merged pushes, ``merged_tokens``; and ``events``: the
        run events (kind, fields) since the last call (:mod:`atoll.job.timeline`: pushes, merges, refusals,
        rejoins; each time on the run's clock); ``drain``: hand them over (and forget them), else none.
        """
        self._poll()
        now = self._now()
        events = list(self.events) if drain else []
        if drain:
            self.events.clear()
        # the syncer's clock is this actor's
        for kind, fields in syncer_events(self.syncer.journal.drain() if drain else []):
            events.append((kind, {**fields, "sim_wall_s": self._run_clock(fields["sim_wall_s"])}))
        events.sort(key=lambda e: e[1]["sim_wall_s"])
        start = self.first_step_s
        return {"commits": self.syncer.commits, "reserved": self.reserved, "budget": self.budget,
                "versions": [self.syncer.version(p) for p in range(self.syncer.fragments)],
                "silent_s": [None if i.heard is None else now - i.heard for i in self.islands],
                "starved": self.syncer.starved_message() if self.syncer.starved() else "",
                "run_s": now - start if start is not None else 0.0,
                "steps_by_island": [i.steps for i in self.islands],
                "loss_by_island": [i.last_loss for i in self.islands],
                "lr_by_island": [i.last_lr for i in self.islands],
                "bytes_by_island": [i.bytes_received for i in self.islands],
                "staleness": list(self.syncer.staleness.recent)[-RECENT:], "merged_tokens": self.syncer.merged_tokens,
                "events": events}
