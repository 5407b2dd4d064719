"""Where a vector of the outer optimizer lies in an island's flat parameter vector, and a block codec's cut of it.

The outer optimizer keeps the whole model's globals as one vector (diloco) or one per fragment (Streaming
DiLoCo, arXiv:2501.18512: strided layers, plus row blocks of the embedding and the final norm,
:class:`~atoll.algorithms.fragments.FlatFragment`). A compiled round (:mod:`atoll.algorithms.fused_round`)
reads and writes the islands' parameters where they lie, span by span, not through a gathered copy; a block
codec's blocks follow the vector's order, so a few of them lie across two spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atoll.algorithms.fragments import FlatFragment

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Where the outer optimizer's vector (the whole model's, or one fragment's, in its element order) lies in an
    island's flat parameter vector (:meth:`~atoll.job.flat_views.FlatViews.contiguous_params`).

    Attributes:
        spans: ``(offset, start, length)``: the vector's elements [offset, offset + length) are the flat vector's
            [start, start + length); in the vector's order, together all of it. The whole model is one span; a
            fragment of strided layers (:class:`~atoll.algorithms.fragments.FlatFragment`) one per run of adjacent
            ranges: about one per layer, plus the embedding's and the final norm's rows.
    """

    spans: tuple[tuple[int, int, int], ...]

    @classmethod
    def whole(cls, numel: int) -> Layout:
        """The whole model: its vector is the flat vector."""
        return cls(((0, 0, numel),) if numel else ())

    @classmethod
    def of(cls, fragment: FlatFragment) -> Layout:
        """A fragment's ranges of the flat vector, adjacent ones joined."""
        spans: list[tuple[int, int, int]] = []
        offset = 0
        for a, b in fragment.ranges:
            if spans and spans[-1][1] + spans[-1][2] == a:
                spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + b - a)
            elif b > a:
                spans.append((offset, a, b - a))
            offset += b - a
        return cls(tuple(spans))

    @property
    def numel(self) -> int:
        """Elements of the vector."""
        return sum(n for _, _, n in self.spans)

    @property
    def flat_numel(self) -> int:
        """The least length of a flat vector that holds every span."""
        return max((start + n for _, start, n in self.spans), default=0)

    def of_vector(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """The vector's spans: views (detached: a view's base would be guarded by the compiled loops)."""
        return [vector[o:o + n].detach() for o, _, n in self.spans]

    def of_flat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """An island's flat vector's spans, in the vector's order: views (writing them writes the island)."""
        return [flat[start:start + n].detach() for _, start, n in self.spans]

    def gather(self, flat: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """The vector's elements [a, b) from an island's flat vector: a copy, (b − a,) float32."""
        return torch.cat([flat[start + max(a, o) - o:start + min(b, o + n) - o]
                          for o, start, n in self.spans if o < b and a < o + n])

    def chunks(self, block_size: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """The vector cut for a block codec: chunks ``(offset, start, length)`` of whole blocks, each inside one
        span (the compiled loop's), and the rest as vector ranges [a, b): blocks across two spans and a partial
        last block (a few per fragment, run uncompiled on gathered copies)."""
        chunks: list[tuple[int, int, int]] = []
        rest: list[tuple[int, int]] = []
        covered = 0  # the vector's elements before this are in a chunk or in the rest
        for o, start, n in self.spans:
            a, b = -(-o // block_size) * block_size, (o + n) // block_size * block_size
            if b > a:
                if a > covered:
                    rest.append((covered, a))
                chunks.append((a, start + a - o, b - a))
                covered = b
        if covered < self.numel:
            rest.append((covered, self.numel))
        return chunks, rest
