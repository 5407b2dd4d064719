"""The decoupled syncer's downlink: what an island that pulls a fragment is sent (``pull_codec``).

With ``pull_codec`` ``fp32`` a pull is the global fragment G_k itself, float32 (4 bytes per parameter). With
a lossy pull codec (``bf16``, ``int8``, ``int4`` (the default): the push codecs of
:mod:`atoll.algorithms.codecs`, block-scaled with the run's ``codec_block_size``, nearest rounding) the
syncer keeps **one shadow per fragment**, Q: the float32 values every up-to-date island holds. At each
commit of version k it encodes the change since the shadow and steps the shadow by what that payload
decodes to::

    d_k = encode(G_k − Q_{k−1});    Q_k = Q_{k−1} + decode(d_k)

This is error feedback on the downlink: what one payload lost (G_k − Q_k, one delta's quantization error)
is part of the next delta, so Q never drifts from G by more than one delta's error, however many rounds.
An island that holds version j (the ``base_version`` of its push says which) is sent the payloads
d_{j+1}..d_k and adds their decoded values to its copy in order: the same float32 additions as the
shadow's, so it ends bit-identical to Q_k. An island that holds no version the syncer still has deltas
from (it rejoins, is new, or fell more deltas behind than are kept), or whose deltas would weigh at least
the full fragment, is sent Q_k itself in float32. Only as many payloads are kept per fragment as could ever
be sent (their bytes below the full fragment's: 1 for bf16, 3 for int8, 7 for int4 at a block of 64), so the
syncer's memory is one float32 shadow plus about one fragment of payloads per fragment, not a copy per
island. Pseudo-gradients are taken against Q (the island's base); the syncer merges them into G.

The downlink of the papers, for comparison: Streaming DiLoCo (arXiv:2501.18512) has none: its workers
all-reduce 4-bit outer gradients (accumulated in float32) and each applies the same outer step itself, so
what a worker receives is the quantized mean outer gradient. Decoupled DiLoCo (arXiv:2604.21428) describes
quantized pushes from the learners; a compressed syncer-to-learner transfer is not described in what we
could check (docs/decoupled.md). The delta-with-error-feedback scheme here is the one of compressed
model broadcasts in federated learning (e.g. the server-to-client compression with error feedback of
Tang et al. 2019, DoubleSqueeze, arXiv:1905.05957).

Errors: ValueError from :func:`apply_pull` (a delta pull for a version the island does not hold) and from
:class:`Downlink` (an unknown codec).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from atoll.algorithms.codec_base import Codec, Encoded
from atoll.algorithms.codecs import make_codec
from atoll.algorithms.snapshot import Snapshots
from atoll.config.sections import PULL_CODECS
from atoll.strategies.decoupled.protocol import Pull


def pull_codec(name: str, block_size: int = 64) -> Codec | None:
    """The codec of a run's ``pull_codec`` (nearest rounding, ``block_size`` values per scale); None for fp32.

    Raises:
        ValueError: ``name`` is not one of :data:`~atoll.config.sections.PULL_CODECS`.
    """
    if name not in PULL_CODECS:
        raise ValueError(f"pull_codec: unknown {name!r}; choose one of {', '.join(PULL_CODECS)}")
    return None if name == "fp32" else make_codec(name, block_size=block_size)


class Downlink:
    """The syncer's side of the pulls: per fragment a float32 shadow Q and its last payloads (module docstring).

    Args:
        codec: the pull codec's name (:data:`~atoll.config.sections.PULL_CODECS`); ``fp32``: no shadow, a pull
            is G itself.
        init: per fragment, the initial global parameters (float32 (numel_p,)); the shadows start equal to them.
        block_size: values per scale of the block codecs.

    Attributes:
        shadow: per fragment Q (float32 (numel_p,)), None for fp32.
        version: per fragment, the version Q is at (the syncer's: outer steps committed).
        deltas: per fragment, ``(version, payload)`` of its last :attr:`keep` commits, oldest first.
        keep: payloads kept per fragment: the most that travel for less than the full fragment.

    Raises:
        ValueError: an unknown codec.
    """

    def __init__(self, codec: str, init: list[torch.Tensor], block_size: int = 64) -> None:
        self.name = codec
        self.codec = pull_codec(codec, block_size)
        self.shadow: list[torch.Tensor] | None = (None if self.codec is None else
                                                  [t.detach().to("cpu", torch.float32).clone() for t in init])
        self.version = [0] * len(init)
        self.full_bytes = [int(t.numel()) * 4 for t in init]
        self.delta_bytes = [0 if self.codec is None else self.codec.payload_bytes(int(t.numel())) for t in init]
        self.keep = [0 if d == 0 else (f - 1) // d for f, d in zip(self.full_bytes, self.delta_bytes, strict=True)]
        self.deltas: list[deque[tuple[int, Encoded]]] = [deque(maxlen=max(1, k)) for k in self.keep]
        self.floor = [0] * len(init)  # per fragment: the oldest version an island may hold to be sent deltas
        self._snapshots = Snapshots()  # per fragment: the copy of its shadow that state_dict hands out

    def commit(self, fragment: int, params: torch.Tensor, version: int) -> None:
        """The fragment's global parameters ``params`` (float32 (numel_p,)) are now at ``version``: encode the
        change since the shadow, step the shadow by its decoded values, keep the payload. Nothing for fp32."""
        self.version[fragment] = version
        if self.codec is None or self.shadow is None:
            return
        q = self.shadow[fragment]
        # G_k − Q_{k−1} into a buffer kept between commits (a fresh one costs a page fault per 4 KiB on the CPU)
        change = self.__dict__.get("_change")
        if change is None or change.numel() < q.numel() or change.device != q.device:
            change = self.__dict__["_change"] = torch.empty(max(max(self.full_bytes) // 4, q.numel()),
                                                            dtype=torch.float32, device=q.device)
        enc = self.codec.encode(torch.sub(params.detach().to(torch.float32), q, out=change[:q.numel()]))
        add_decoded_(q, self.codec, enc)
        if self.keep[fragment]:
            self.deltas[fragment].append((version, enc))

    def values(self, fragment: int, params: torch.Tensor) -> torch.Tensor:
        """What an up-to-date island holds of the fragment: Q (a copy), or ``params`` (G) itself for fp32."""
        return params.detach().clone() if self.shadow is None else self.shadow[fragment].clone()

    def pull(self, fragment: int, params: torch.Tensor, version: int, have: int | None = None) -> Pull:
        """The answer to an island that holds version ``have`` of the fragment (None: unknown or none);
        ``params`` and ``version``: the fragment's global parameters G and version, the syncer's (the one source
        of the version: a syncer restored from a checkpoint answers at the version it restored, whatever the
        pull codec).

        Returns:
            a :class:`~atoll.strategies.decoupled.protocol.Pull` at ``version``: its payloads since ``have``
            (``deltas``, ``since=have``: none if ``have`` is the current version) when every one of them is kept
            and the shadow is at ``version``, else the full values (:meth:`values`: Q, or G for fp32) in float32.
        """
        if self.sends_deltas(fragment, version, have):
            assert isinstance(have, int)
            kept = {v: enc for v, enc in self.deltas[fragment]}
            return Pull(fragment, None, version, deltas=tuple(kept[v] for v in range(have + 1, version + 1)),
                        since=have)
        return Pull(fragment, self.values(fragment, params), version)

    def sends_deltas(self, fragment: int, version: int, have: Any) -> bool:
        """Does :meth:`pull` answer an island at ``have`` with payloads (True), or the full fragment (False: no
        pull codec, ``have`` None, not an int, outside ``floor .. version``, or behind the payloads kept)?"""
        if self.codec is None or self.version[fragment] != version or not isinstance(have, int) \
                or isinstance(have, bool) or not self.floor[fragment] <= have <= version:
            return False
        kept = {v for v, _ in self.deltas[fragment]}
        return all(v in kept for v in range(have + 1, version + 1))

    def state_dict(self, lend: bool = False) -> dict[str, Any]:
        """The shadows, their versions and the kept payloads (plain lists, ints and tensors; empty for fp32).

        A shadow is copied once per commit of its fragment: until the fragment's next :meth:`commit` (or
        :meth:`load_state_dict`, :meth:`restart`) every call hands out the same copy, never changed afterwards,
        so a syncer that checkpoints at every commit copies the fragment that changed, not every fragment's
        shadow (bench/outer_round.py, ``syncer_commit``). Treat the tensors as read-only. ``lend``: given back
        with :meth:`release` (:class:`~atoll.algorithms.snapshot.Snapshots`)."""
        if self.shadow is None:
            return {}
        shadow = [self._snapshots.get(p, v, [q], lend)[0]
                  for p, (q, v) in enumerate(zip(self.shadow, self.version, strict=True))]
        return {"codec": self.name, "shadow": shadow, "version": list(self.version),
                "floor": list(self.floor),
                "deltas": [[{"version": v, "tensors": dict(enc.tensors)} for v, enc in d] for d in self.deltas]}

    def release(self, state: dict[str, Any]) -> None:
        """Give back a :meth:`state_dict` made with ``lend=True`` (raises ValueError if it was not lent)."""
        for p, q in enumerate(state.get("shadow", ())):  # (none for fp32: its state is empty)
            self._snapshots.release(p, q)

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore :meth:`state_dict`; False where it holds no shadows of this pull codec (a checkpoint from
        before the pull codec, or of another one: call :meth:`restart`); True for fp32 (nothing to restore)."""
        if self.shadow is None:
            return True
        if state.get("codec") != self.name:
            return False
        self.shadow = [q.to(torch.float32).clone() for q in state["shadow"]]
        self._snapshots.forget()
        self.version = [int(v) for v in state["version"]]
        self.floor = [int(v) for v in state["floor"]]
        for p, d in enumerate(state["deltas"]):
            self.deltas[p].clear()
            for e in d:
                self.deltas[p].append((int(e["version"]), Encoded(dict(e["tensors"]), self.shadow[p].numel(),
                                                                  self.name)))
        return True

    def restart(self, params: list[torch.Tensor], versions: list[int]) -> None:
        """Shadows at the global parameters ``params`` (per fragment float32), no payloads kept: every island
        is then sent its next pull in full, whatever version it holds (a syncer restored from a checkpoint that
        held no shadows, or those of another pull codec)."""
        self.version = list(versions)
        self.floor = [v + 1 for v in versions]
        if self.shadow is not None:
            self.shadow = [t.detach().to(torch.float32).clone() for t in params]
            self._snapshots.forget()
        for d in self.deltas:
            d.clear()


def apply_pull(pull: Pull, held: torch.Tensor, held_version: int, codec: Codec | None,
               in_place: bool = False) -> torch.Tensor:
    """The float32 values (numel_p,) an island holds after ``pull``: its ``params`` if it carries them, else
    ``held`` (the island's copy, at ``held_version``) plus each payload's decoded values, in order (a payload of
    codec ``"fp32"`` is taken as decoded already: what a rank of a sharded island job holds of one, cut from its
    decoded values by its transport, :mod:`~atoll.runtime.service.exchange`).

    Args:
        in_place: add a delta pull's payloads into ``held`` itself (float32, contiguous) and return it, the same
            floats as into a copy; every payload is checked first, so a pull refused leaves ``held`` unchanged.
            False: into a new tensor. (On the CPU a fresh tensor of a large fragment's size costs a page fault per
            4 KiB at its first touch.)

    Raises:
        ValueError: a delta pull from another version than ``held_version``, without a ``codec`` to decode it, or
            with a payload that is not the codec's for ``held``'s length.
    """
    if pull.params is not None:
        return pull.params
    if pull.since != held_version or codec is None:
        raise ValueError(f"pull: fragment {pull.fragment}'s deltas start from version {pull.since}, the island "
                         f"holds {held_version}{'' if codec is not None else ' and has no pull codec'}")
    for enc in pull.deltas:  # every payload checked before any is added: a refused pull changes nothing
        if enc.numel != held.numel():
            raise ValueError(f"pull: fragment {pull.fragment}'s payload holds {enc.numel} values, the island "
                             f"holds {held.numel()}")
        if enc.codec == "fp32":
            if enc.tensors["values"].numel() != held.numel():
                raise ValueError(f"pull: fragment {pull.fragment}'s float32 payload holds "
                                 f"{enc.tensors['values'].numel()} values, the island holds {held.numel()}")
        else:
            codec.check_payload(enc)
    if in_place and (held.dtype != torch.float32 or not held.is_contiguous()):
        raise ValueError(f"pull: in place needs the held values as contiguous float32, not {held.dtype}")
    out = held if in_place else held.detach().to(torch.float32).clone()
    for enc in pull.deltas:  # (an "fp32" payload: one already decoded, a sharded rank's part of it)
        if enc.codec == "fp32":
            out.add_(enc.tensors["values"])
        else:
            add_decoded_(out, codec, enc)  # the shadow's own additions (Downlink.commit): bit-identical to it
    return out


def add_decoded_(target: torch.Tensor, codec: Codec, enc: Encoded) -> torch.Tensor:
    """In place, ``target.add_(codec.decode(enc))`` (``target`` float32 (numel,), on the payload's device), the
    same floats, range by range where the codec decodes in chunks (:meth:`Codec.decoded_chunks`): each chunk added
    while it is in cache, no decoded vector of the fragment's size. Returns ``target``. Raises ValueError as
    :meth:`Codec.decode`."""
    for a, b, decoded in codec.decoded_chunks(enc):
        target[a:b].add_(decoded)
    return target
