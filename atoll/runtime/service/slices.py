"""A fragment cut into slices: which rank of an island job pushes and pulls which of its values.

An island of R ranks moves each fragment over R connections at once, one per rank, so no rank gathers the
whole fragment and every host's network is used (the learners of Decoupled DiLoCo, arXiv:2604.21428, are
data-parallel jobs whose ranks each hold part of the model). A rank's *part* of fragment p is a set of
ranges of the fragment's element order (the order of :class:`~atoll.algorithms.fragments.FlatFragment`,
which the syncer knows), and the same values as ranges of the rank's own flat vector:

- an unsharded island (every rank holds the whole model; :func:`even_parts`): rank r takes the r-th of R
  contiguous runs of the fragment, as equal as possible (``numpy.array_split`` sizes), and the island's
  ranks all-gather what they pulled;
- a sharded island (FSDP2 ``Shard(0)``, :func:`shard_parts`): rank r's part is its shard's intersection
  with the fragment, one range per parameter piece; its local vector is its shard, so it pulls exactly
  what it holds.

The syncer reassembles a push from the slices of an island (:func:`tiles`, :func:`assemble`): the slices
must tile the fragment exactly, each value once, or the push is refused. Pure index maths, ValueError only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from atoll.algorithms.codec_base import Codec, Encoded
from atoll.algorithms.fragments import FlatFragment

#: ``((start, stop), ...)``: ascending, disjoint ranges of a fragment's element order
Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Part:
    """One rank's part of one fragment.

    Attributes:
        ranges: its values as ranges of the fragment's element order (ascending, disjoint).
        local: the same values, in the same order, as ranges of the rank's local flat vector (its parameters
            in ``model.parameters()`` order, or a sharded rank's pieces of them).
    """

    ranges: Ranges
    local: FlatFragment

    def numel(self) -> int:
        """Values in the part."""
        return sum(b - a for a, b in self.ranges)


def _sub(fragment: FlatFragment, start: int, stop: int) -> FlatFragment:
    """The values ``start:stop`` of the fragment's element order, as ranges of the flat vector."""
    out, at = [], 0
    for a, b in fragment.ranges:
        lo, hi = max(a, a + start - at), min(b, a + stop - at)
        if lo < hi:
            out.append((lo, hi))
        at += b - a
    return FlatFragment(tuple(out))


def even_parts(fragment: FlatFragment, ranks: int) -> list[Part]:
    """The fragment cut into ``ranks`` contiguous runs of its element order (sizes ``numpy.array_split``'s:
    the first ``n % R`` one longer), each as a :class:`Part` of a rank that holds the whole model.

    Raises:
        ValueError: ``ranks`` < 1.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    n = fragment.numel()
    bounds = [r * (n // ranks) + min(r, n % ranks) for r in range(ranks + 1)]
    return [Part(((a, b),) if b > a else (), _sub(fragment, a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]


def shard_pieces(numels: Sequence[int], counts: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Where each rank's shard sits: per rank, ``(flat_start, flat_stop, local_start)`` of each of its
    parameter pieces, ascending.

    Args:
        numels: each parameter's elements, in ``model.parameters()`` order.
        counts: (R, P) int64, elements of parameter j held by rank r
            (:attr:`ShardLayout.counts <atoll.runtime.collective.sharding.ShardLayout.counts>`); FSDP2's
            ``Shard(0)`` gives rank r the rows after those of ranks 0..r-1, so its piece of parameter j is
            flat ``[o_j + sum_{r'<r} c[r', j], o_j + sum_{r'<=r} c[r', j])``.

    Raises:
        ValueError: the counts of a parameter do not add up to its elements.
    """
    c = counts.tolist()
    ranks = len(c)
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(ranks)]
    local = [0] * ranks
    offset = 0
    for j, numel in enumerate(numels):
        if sum(c[r][j] for r in range(ranks)) != numel:
            raise ValueError(f"parameter {j}: its pieces hold {sum(c[r][j] for r in range(ranks))} of {numel}")
        at = offset
        for r in range(ranks):
            if c[r][j]:
                pieces[r].append((at, at + c[r][j], local[r]))
            at += c[r][j]
            local[r] += c[r][j]
        offset += numel
    return pieces


def shard_parts(fragment: FlatFragment, pieces: Sequence[Sequence[tuple[int, int, int]]]) -> list[Part]:
    """Each rank's part of ``fragment``: its shard's ``pieces`` (:func:`shard_pieces`) intersected with the
    fragment's ranges, in the fragment's element order."""
    parts = []
    for mine in pieces:
        ranges: list[tuple[int, int]] = []
        local: list[tuple[int, int]] = []
        at = 0  # the fragment's element order
        for a, b in fragment.ranges:
            for s, e, lo in mine:  # (a few hundred pieces: a linear scan is cheaper than it looks)
                i, j = max(a, s), min(b, e)
                if i < j:
                    ranges.append((at + i - a, at + j - a))
                    local.append((lo + i - s, lo + j - s))
            at += b - a
        parts.append(Part(_merge(ranges), FlatFragment(_merge(local))))
    return parts


def _merge(ranges: list[tuple[int, int]]) -> Ranges:
    """Adjacent ranges joined (``(0, 4), (4, 9)`` -> ``(0, 9)``)."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def tiles(slices: Sequence[Ranges], numel: int) -> bool:
    """Do the ``slices`` (each a slice's ranges) cover ``0..numel-1`` exactly, every value once?"""
    ranges = sorted(r for s in slices for r in s)
    end = 0
    for a, b in ranges:
        if a != end or b <= a:
            return False
        end = b
    return end == numel


def assemble(numel: int, slices: Sequence[tuple[Ranges, torch.Tensor]]) -> torch.Tensor:
    """The fragment (float32 (numel,)) from ``slices``: each slice's values (1-D, as long as its ranges)
    written at its ranges. The caller checks :func:`tiles` first.

    Raises:
        ValueError: a slice's values are not as long as its ranges.
    """
    out = torch.empty(numel, dtype=torch.float32)
    for ranges, values in slices:
        if values.numel() != sum(b - a for a, b in ranges):
            raise ValueError(f"a slice of {sum(b - a for a, b in ranges)} values given {values.numel()}")
        assemble_into(out, ranges, values)
    return out


def assemble_payloads(numel: int, payloads: Sequence[tuple[Ranges, Encoded]], codec: Codec) -> torch.Tensor:
    """The fragment (float32 (numel,)) from its slices' codec payloads: a slice of one range is decoded straight
    into its place (:meth:`Codec.decode_into <atoll.algorithms.codec_base.Codec.decode_into>`: one pass over its
    values, no decoded copy to assemble), one of several ranges is decoded, then written at its ranges. The
    caller checks :func:`tiles` first.

    Raises:
        ValueError: a payload is not ``codec``'s layout for its ranges' length.
    """
    out = torch.empty(numel, dtype=torch.float32)
    for ranges, payload in payloads:
        if payload.numel != sum(b - a for a, b in ranges):
            raise ValueError(f"a slice of {sum(b - a for a, b in ranges)} values given {payload.numel}")
        if len(ranges) == 1:
            codec.decode_into(payload, out[ranges[0][0]:ranges[0][1]])
        else:
            assemble_into(out, ranges, codec.decode(payload))
    return out


def assemble_into(out: torch.Tensor, ranges: Ranges, values: torch.Tensor) -> None:
    """Write ``values`` (1-D, as long as ``ranges``) at ``ranges`` of ``out`` (1-D), in order."""
    at = 0
    for a, b in ranges:
        out[a:b].copy_(values[at:at + b - a])
        at += b - a


def take(values: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """The values of a whole fragment (1-D) at ``ranges`` of its element order, concatenated (a new tensor)."""
    views = [values[a:b] for a, b in ranges]
    return torch.cat(views) if views else values.new_empty(0)
