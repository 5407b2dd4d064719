"""Who may push to the syncer of Decoupled DiLoCo, and which push is a replay: identity and freshness per island.

Each push names its island, and the merge, the quorum and the token ledger are kept per island, so an
island index that anyone may claim lets one sender push as all of them (and fill a quorum by itself).
:class:`Admission` holds, per island, a secret **credential** (issued by whoever starts the island: the
Ray driver makes one with :func:`secrets.token_hex` per island actor and hands it to that actor and to the
syncer only; the local simulation issues its own). A push whose credential does not match its island's,
compared in constant time (:func:`hmac.compare_digest`), is refused (``identity``).

**Replays.** An honest island pushes a fragment once per version it started from: after a push it waits for
the answer (the merged fragment, of a newer version) before it pushes that fragment again. So a push whose
base version is not newer than the island's last accepted push of the fragment is refused (``replay``): the
same push sent twice is merged once. Only a restart breaks the rule (an island that failed while its push
waited in a buffer rejoins at the same version and pushes new work from it): the runtime opens a new
**session** for the island when it (re)joins (:meth:`Admission.rejoin`), pushes carry their session, and a push
of an earlier session is a replay too. A push of a later session than the syncer's (a syncer restarted from a
checkpoint older than the island's join) opens that session: only the island's own pushes can, and a replay
of any of them is still refused.

**Fencing.** A join supersedes the island's sessions before it: the calls of an older session (an island job
started twice with one index, or a torchrun attempt that outlived its restart) are refused (:meth:`Admission.stale`;
the service counts them as ``stale_session``), so the newest job alone trains as the island.

**What sessions do not guard.** The island holds its credential, so it can open a session whenever it likes
(a push of a later session, or ``join`` again on Ray), and push again from a version it has pushed from:
the replay rule keeps a third party's copy of a push out, not the island's own repeated pushes. Those are
bounded per island by the syncer instead (:mod:`~atoll.strategies.decoupled.syncer`): a buffer holds one push
per island (a newer one replaces it), the norm bound keeps one entry per island
(:mod:`~atoll.strategies.decoupled.bounds`), and the token ledger bounds its claims by the steps it was
granted. So no session trick gives an island a second vote in a merge, a say in the norm bound beyond its
own entry, or tokens it was not granted; this module stays the check of *who* pushes and of replays.

:meth:`Admission.refusal` is the syncer's check of a push before its bounds: its form (an island and a
fragment of the run, :func:`~atoll.strategies.decoupled.protocol.tensor_refusal`, ints for its counts and
version, never bools), then who sent it, then whether it is a replay. Rejections are counted per island and
reason (:attr:`Admission.rejected_by_island`), for the summary.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from typing import Any

from atoll.strategies.decoupled.protocol import Push, is_index, tensor_refusal


class Admission:
    """Credentials and the last accepted base version per island and fragment.

    Args:
        islands: K; fragments: P.
        credentials: per island its secret (a str); None: islands are not authenticated (every push is
            taken as coming from the island it names).
    """

    def __init__(self, islands: int, fragments: int, credentials: Sequence[str] | None = None) -> None:
        if credentials is not None and len(credentials) != islands:
            raise ValueError(f"credentials: {len(credentials)} given for {islands} islands")
        self.islands = islands
        self.credentials = list(credentials) if credentials is not None else None
        self.last_base = [[-1] * fragments for _ in range(islands)]  # per island, fragment: last accepted base
        self.session = [0] * islands                                 # per island: its joins so far
        self.rejected_by_island: dict[str, list[int]] = {}           # reason -> per island

    def identity(self, island: int, credential: Any) -> bool:
        """Does ``credential`` prove the push comes from ``island`` (always, without credentials)?"""
        if self.credentials is None:
            return True
        return isinstance(credential, str) and hmac.compare_digest(credential.encode(),
                                                                   self.credentials[island].encode())

    def refusal(self, msg: Push, numels: Sequence[int], versions: Sequence[int]) -> str:
        """Why the syncer refuses ``msg`` before its bounds, or "": ``island`` (not an index of the run),
        ``identity``, ``fragment``, its Δ's (``type``, ``dtype``, ``shape``, ``non_finite``), ``tokens``,
        ``version`` (not one the syncer issued) or ``replay``. ``numels``, ``versions``: per fragment, its
        values and outer steps committed."""
        island, fragment, base = msg.island, msg.fragment, msg.base_version
        if not is_index(island, self.islands):
            return "island"
        if not self.identity(island, msg.credential):
            return "identity"
        if not is_index(fragment, len(numels)):
            return "fragment"
        if reason := tensor_refusal(msg.delta, numels[fragment]):
            return reason
        if not (is_index(msg.tokens, math.inf) and msg.tokens > 0):
            return "tokens"
        if not is_index(base, versions[fragment] + 1):
            return "version"
        return "" if self.fresh(island, fragment, base, msg.session) else "replay"

    def fresh(self, island: int, fragment: int, base_version: int, session: Any) -> bool:
        """Is the push of a later session than the island's present one, or of the present one from a
        ``base_version`` newer than its last accepted push of ``fragment`` in it (not a replay)?

        A later session is the island's to open (see the module docstring: this bounds replays by others,
        not how often the island pushes)."""
        if not isinstance(session, int) or isinstance(session, bool) or session < self.session[island]:
            return False
        return session > self.session[island] or base_version > self.last_base[island][fragment]

    def rejoin(self, island: int) -> int:
        """``island`` (re)joins: a new session, in which any base version is new; return the session."""
        self.session[island] += 1
        self.last_base[island] = [-1] * len(self.last_base[island])
        return self.session[island]

    def stale(self, island: int, session: Any) -> bool:
        """Is ``session`` (an int a call of ``island`` carries) older than the island's present one: a session a
        newer join superseded (fenced: its calls are refused, so an older job or torchrun attempt of the island
        cannot act for the present one)? None (a call that names no session) is not stale."""
        return isinstance(session, int) and not isinstance(session, bool) and session < self.session[island]

    def seen(self, island: int, session: Any) -> None:
        """A call of ``island`` carried ``session``: a later one than the present (a syncer restarted from a
        checkpoint older than the island's join) becomes the present one, as its first accepted push would make
        it (so the island's next join opens a newer session still, and fences this one)."""
        if isinstance(session, int) and not isinstance(session, bool) and session > self.session[island]:
            self.session[island] = session
            self.last_base[island] = [-1] * len(self.last_base[island])

    def accepted(self, island: int, fragment: int, base_version: int, session: int) -> None:
        """A push of ``island`` from ``base_version`` in ``session`` was accepted: an equal or older one is a
        replay."""
        if session > self.session[island]:
            self.session[island] = session
            self.last_base[island] = [-1] * len(self.last_base[island])
        self.last_base[island][fragment] = base_version

    def rejected(self, island: int, reason: str) -> None:
        """Count a refused push of ``island`` (an index in range) for ``reason``."""
        self.rejected_by_island.setdefault(reason, [0] * self.islands)[island] += 1

    def state_dict(self) -> dict[str, Any]:
        """Last accepted base versions and rejection counts (never the credentials)."""
        return {"last_base": [list(b) for b in self.last_base], "session": list(self.session),
                "rejected_by_island": {k: list(v) for k, v in self.rejected_by_island.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_base = [[int(x) for x in b] for b in state["last_base"]]
        self.session = [int(x) for x in state["session"]]
        self.rejected_by_island = {str(k): [int(x) for x in v] for k, v in state["rejected_by_island"].items()}
