"""Copies of tensors that change in place, made once per version, for a checkpoint written on another thread.

A syncer checkpoints at every commit (:mod:`atoll.runtime.service.durable`): its globals, outer momentum and
pull shadows step in place, while the checkpoint writer reads the state of an earlier commit on its own thread.
So the state hands out copies. :class:`Snapshots` makes one copy per version of each key (a fragment's globals,
its momentum, its shadow) and hands the same copy to every caller until the version changes.

Copying into freshly allocated memory costs the page faults of its first touch, several times the copy itself
(bench/out/outer_round_36e). So a copy that was *lent* (:meth:`Snapshots.get` with ``lend=True``) and given
back (:meth:`release`, once the writer no longer reads the state: written, or replaced before its write) after
a newer version replaced it becomes the buffer of the key's next copy. A copy handed out without lending is
never reused: its holder keeps it as long as it likes.

Errors: ValueError from :meth:`Snapshots.release` of a copy that is not lent.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Snapshots"]


@dataclass
class _Copy:
    version: int
    tensors: list[torch.Tensor]
    lent: int = 0  # lent out and not yet given back
    kept: bool = False  # handed out without lending: never reused


class Snapshots:
    """Per key, the copy of its tensors at their current version (module docstring). Thread-safe: the syncer's
    thread calls :meth:`get`, and :meth:`release` comes from the checkpoint writer's thread or the syncer's.

    Memory: per key one copy, plus at most one buffer set waiting for reuse, plus the copies still lent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[Hashable, _Copy] = {}
        self._retired: dict[Hashable, list[_Copy]] = {}  # replaced by a newer version, still lent
        self._free: dict[Hashable, list[torch.Tensor]] = {}  # a set of buffers given back, for the next copy

    def get(self, key: Hashable, version: int, sources: Sequence[torch.Tensor],
            lend: bool = False) -> list[torch.Tensor]:
        """Copies of ``sources`` (CPU tensors) at ``version``: made at the first call of a version (into a
        given-back buffer set of the key where one fits, else new memory), the same tensors after. Treat them as
        read-only. ``lend``: the caller gives them back with :meth:`release` once it no longer reads them (then
        their memory may carry a later version's copy); otherwise they are never reused."""
        with self._lock:
            cur = self._current.get(key)
            if cur is None or cur.version != version:
                if cur is not None:
                    self._retire(key, cur)
                cur = _Copy(version, self._copy(key, sources))
                self._current[key] = cur
            if lend:
                cur.lent += 1
            else:
                cur.kept = True
            return list(cur.tensors)

    def release(self, key: Hashable, first: torch.Tensor) -> None:
        """Give back one lending of ``key``'s copy whose first tensor is ``first`` (the copy itself, not its
        version: after :meth:`forget` a new copy may carry the version of one still lent).

        Raises:
            ValueError: no lending of that copy is outstanding.
        """
        with self._lock:
            cur = self._current.get(key)
            if cur is not None and cur.tensors[0] is first and cur.lent > 0:
                cur.lent -= 1
                return
            for old in self._retired.get(key, []):
                if old.tensors[0] is first and old.lent > 0:
                    old.lent -= 1
                    if old.lent == 0:
                        self._retired[key].remove(old)
                        self._reuse(key, old)
                    return
        raise ValueError(f"snapshot: this copy of {key!r} is not lent")

    def forget(self) -> None:
        """Drop every current copy (the state was replaced: a load or a restart); lent copies stay lent."""
        with self._lock:
            for key, cur in list(self._current.items()):
                self._retire(key, cur)
            self._current.clear()

    def _retire(self, key: Hashable, old: _Copy) -> None:
        if old.lent:
            self._retired.setdefault(key, []).append(old)
        else:
            self._reuse(key, old)

    def _reuse(self, key: Hashable, old: _Copy) -> None:
        if not old.kept:
            self._free[key] = old.tensors

    def _copy(self, key: Hashable, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        free = self._free.pop(key, None)
        if free is None or len(free) != len(sources) or any(
                b.shape != s.shape or b.dtype != s.dtype for b, s in zip(free, sources, strict=True)):
            return [s.detach().clone() for s in sources]
        for b, s in zip(free, sources, strict=True):
            b.copy_(s)
        return free
