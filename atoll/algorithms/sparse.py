"""SparseLoCo's compressor: top-k per tile of each parameter, values quantized to 2 bits, the exact size,
and the reference's aggregation (each island's payload clipped to the median norm, then each entry averaged
over the islands that sent it).

Sarfi, Thérien, Lidin, Belilovsky 2025, "Communication Efficient LLM Pre-training with SparseLoCo"
(arXiv:2508.15706), §3, as its released code and Templar's ``compress.py`` compute it:

* Tiles (``layout="tiles"``, the reference). ``chunk`` is the element count of a full square tile, side
  ``s = sqrt(chunk)`` (64 for 4096). A parameter of ndim >= 2, viewed as (rows, cols = prod(rest)), is cut
  into ``h x w`` tiles, ``h`` the largest divisor of rows that is <= s and ``w`` the same for cols; a 1-D
  parameter (n,) into runs of ``w`` (the largest divisor of n that is <= s). In every tile the
  ``k_t = max(1, round(topk * h * w / chunk))`` entries of largest magnitude are kept (``tile_k="scaled"``,
  the release's rule: k scaled to the tile, 64 in a 64 x 64 tile at top-64/4096, about one per 1-D run of
  64). Templar's ``compress`` keeps ``min(topk, h * w)`` in every tile instead (``tile_k="topk"``, a
  setting: a 1-D run of 64 at top-64 goes whole, a 44 x 64 tile keeps 64), clamped to at least 2 and an
  even number for its 12-bit index packing; atoll packs indices as whole bytes and keeps 1.
* Flat chunks (``layout="flat"``, atoll's earlier rule, a setting): each parameter's slice of the flat vector
  is cut into ``ceil(numel / chunk)`` contiguous chunks, the last padded with zeros, ``topk`` kept in every
  chunk even a short one (so norms and biases send most of themselves every round).

2-bit values: each kept value becomes one of four levels of its tile, ``-hi, -lo, +lo, +hi``, where ``lo``
and ``hi`` are the mean magnitudes of the tile's kept values below and above their median: a two-level
Lloyd quantizer of the magnitudes with the sign (a tile of equal magnitudes is exact). The levels travel as
two float32 per tile. The rounding error stays in the sender's error-feedback accumulator and is sent later
(SparseLoCo §3). ``bits=32`` sends the kept values as float32 instead, for the identities and studies.

Aggregation (:meth:`SparseCompressor.aggregate`), as Templar's ``TopKCompressor.batch_decompress`` (with
``clip_norm=True``, what its ``outer_step`` always passes) computes it, in two steps:

1. Median-norm clipping (``clip="median"``): for every parameter tensor, each island's decoded values are
   scaled by ``min(1, m / (‖v_i‖ + 1e-8))``, where ``‖v_i‖`` is the L2 norm of the values island i sent for
   that tensor and ``m`` the median of those norms over the islands (``torch.median``: the lower of the two
   middle values for an even count). No island's payload outweighs the typical one; none is scaled up.
   ``clip="none"`` skips it (the SparseLoCo release's plain scatter-mean; a setting).
2. The senders' mean: ``scatter_reduce(reduce="mean", include_self=False)``: an entry is the mean over the
   islands that *sent* it, not over all islands (two islands, top-1 of (1, 0) and (0, 1): the aggregate is
   (1, 1), not (0.5, 0.5)). atoll weighs each sender by its tokens (equal tokens: the reference exactly).

Dividing by every island (atoll's rule before issue 24) measured 6% worse on the micro model
(bench/out/beyond_w24/results.md: 4.079 against 3.843) and is gone.

One tensor at a time (a sharded island's: :mod:`atoll.runtime.collective.sharded_sparseloco`):
:meth:`SparseCompressor.of_tensor` compresses one parameter alone with the same tiles, k and levels;
:meth:`~SparseCompressor.join` puts the tensors' payloads together into the model's (what
:meth:`~SparseCompressor.compress` makes of the flat vector, every tile being selected on its own) and
:meth:`~SparseCompressor.split` cuts a model's payload into them. The tables of tile positions (8 bytes per
element) are built on first use, so a compressor that only sizes, joins and splits payloads holds none.

Bytes of one payload, for ``C`` tiles and ``n = sum of k_t`` kept entries (``index_bytes`` 1, 2 or 4: the
smallest signed integer that holds the largest tile's ``h * w - 1``)::

    bits=2:   n * index_bytes + ceil(n / 4) + 8 * C
    bits=32:  n * index_bytes + 4 * n
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from atoll.algorithms.dct import _as_2d_shape, index_dtype_for, largest_divisor_at_most
from atoll.algorithms.demo_payload import pack_2bit, unpack_2bit

__all__ = ["CLIPS", "LAYOUTS", "TILE_KS", "SparseCompressor"]

LAYOUTS = ("tiles", "flat")
#: how many entries a tile smaller than a full one keeps (module docstring)
TILE_KS = ("scaled", "topk")
#: how each island's payload is clipped before the senders' mean (module docstring)
CLIPS = ("median", "none")
#: Templar's guard against a zero norm in the clip factor
CLIP_EPS = 1e-8


def _tile_grid(shape: Sequence[int], side: int) -> tuple[int, int, int, int]:
    """How a parameter is cut into tiles: ``(rows, cols, h, w)``, the (rows, cols) view (a 1-D run along the
    only axis: one row) and the tile's sides, the largest divisors of each that are <= ``side``."""
    rows, cols = _as_2d_shape(shape)
    if len(tuple(shape)) <= 1:  # a 1-D run along the only axis
        rows, cols = 1, rows * cols
    return rows, cols, largest_divisor_at_most(rows, side), largest_divisor_at_most(cols, side)


def _tiles_of(shape: Sequence[int], offset: int, side: int) -> torch.Tensor:
    """Flat positions (offset + row-major index) of every tile of a parameter, (tiles, h * w) int64,
    tiles in (row-block, col-block) order, elements row-major inside a tile."""
    rows, cols, h, w = _tile_grid(shape, side)
    grid = torch.arange(rows * cols).view(rows // h, h, cols // w, w).permute(0, 2, 1, 3)
    return grid.reshape(-1, h * w) + offset


class SparseCompressor:
    """Top-k per tile with 2-bit (or float32) values over a model's flat parameter vector.

    Args:
        shapes: the model's parameter shapes (or element counts, taken as 1-D), in the flat vector's order.
        chunk: elements of a full tile (``layout="tiles"``: a square, side ``sqrt(chunk)``) or of a flat chunk.
        topk: entries kept per full tile or chunk (1 <= topk <= chunk).
        bits: 2 (sign + one of two per-tile magnitude levels) or 32 (float32 values).
        layout: ``"tiles"`` (the reference) or ``"flat"`` (contiguous chunks; module docstring).
        tile_k: ``"scaled"`` (k scaled to a smaller tile: the release) or ``"topk"`` (``min(topk, tile)``:
            Templar); tiles only.

    Raises:
        ValueError: a setting out of range, or ``chunk`` not a square with ``layout="tiles"``.
    """

    def __init__(self, shapes: Sequence[Sequence[int] | int], chunk: int, topk: int, bits: int = 2,
                 layout: str = "tiles", tile_k: str = "scaled") -> None:
        if not 1 <= topk <= chunk:
            raise ValueError(f"topk {topk} must lie in 1..chunk ({chunk})")
        if bits not in (2, 32):
            raise ValueError(f"bits must be 2 or 32, not {bits}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
        if tile_k not in TILE_KS:
            raise ValueError(f"tile_k must be one of {', '.join(TILE_KS)}, not {tile_k!r}")
        side = math.isqrt(chunk)
        if layout == "tiles" and side * side != chunk:
            raise ValueError(f"chunk {chunk} is not a square (tiles of side sqrt(chunk)); pass 4096 (64 x 64), "
                             "1024 (32 x 32), ... or layout 'flat'")
        dims = [(int(s),) if isinstance(s, int) else tuple(int(d) for d in s) for s in shapes]
        self.numel, self.chunk, self.topk, self.bits, self.layout = sum(math.prod(d) for d in dims), chunk, topk, \
            bits, layout
        self.shapes, self.tile_k, self._side = dims, tile_k, side
        #: the end of each parameter in the flat vector, (P,) int64 (the clip's per-tensor norms)
        self.ends = torch.tensor([math.prod(d) for d in dims], dtype=torch.int64).cumsum(0)
        # per parameter: (tile elements e, entries kept per tile k, tiles); the tiles' positions are built on first
        # use (:attr:`groups`: 8 bytes per element), so the sizes of a model's payload cost no table of it
        self._plan: list[tuple[int, int, int]] = []
        self.kept_real = 0  # entries that can carry a value: at most the real (unpadded) elements of each tile
        for d in dims:
            n = math.prod(d)
            if layout == "tiles":
                _, _, h, w = _tile_grid(d, side)
                e = h * w
                k = min(e, max(1, round(topk * e / chunk)) if tile_k == "scaled" else topk)
                self._plan.append((e, k, n // e))
                self.kept_real += n // e * k
            else:  # the last chunk padded: it can carry at most its real elements
                self._plan.append((chunk, topk, math.ceil(n / chunk)))
                self.kept_real += n // chunk * topk + min(topk, n % chunk)
        keys = list(dict.fromkeys((e, k) for e, k, _ in self._plan))  # the groups, in order of first appearance
        self.chunks = sum(c for _, _, c in self._plan)
        self.index_dtype = index_dtype_for(max(e for e, _ in keys) if keys else 1)
        #: per parameter, where it sits in a payload (its group's tiles, in parameter order, then the next
        #: group's): ``(first entry, end entry, first tile, end tile)``
        self.spans: list[tuple[int, int, int, int]] = []
        first = {}
        entry = tile = 0
        for key in keys:
            first[key] = (entry, tile)
            tiles = sum(c for e, k, c in self._plan if (e, k) == key)
            entry, tile = entry + tiles * key[1], tile + tiles
        for e, k, c in self._plan:
            a, t = first[(e, k)]
            self.spans.append((a, a + c * k, t, t + c))
            first[(e, k)] = (a + c * k, t + c)

    @functools.cached_property
    def groups(self) -> list[tuple[torch.Tensor, int]]:
        """Tiles of equal size and k, in order of first appearance: (flat positions (C_g, e) int64, k); a flat
        chunk's padding points at ``numel`` (a zero that is never sent as a value). Built on first use."""
        groups: dict[tuple[int, int], list[torch.Tensor]] = {}
        offset = 0
        for d, (e, k, _) in zip(self.shapes, self._plan, strict=True):
            n = math.prod(d)
            if self.layout == "tiles":
                tiles = _tiles_of(d, offset, self._side)
            else:
                pos = torch.arange(offset, offset + math.ceil(n / e) * e)
                tiles = torch.where(pos < offset + n, pos, torch.tensor(self.numel)).view(-1, e)
            groups.setdefault((e, k), []).append(tiles)
            offset += n
        return [(torch.cat(t), k) for (_, k), t in groups.items()]

    @property
    def kept(self) -> int:
        """Entries sent per payload, the sum over tiles of their ``k`` (flat: padded positions included)."""
        return sum(c * k for _, k, c in self._plan)

    @property
    def density(self) -> float:
        """The share of the model's entries a payload can update (at most 1; padding is never counted)."""
        return self.kept_real / self.numel

    def payload_bytes(self) -> int:
        """Bytes of one payload on the wire (module docstring)."""
        n = self.kept
        idx = n * torch.empty(0, dtype=self.index_dtype).element_size()
        return idx + (math.ceil(n / 4) + 8 * self.chunks if self.bits == 2 else 4 * n)

    def compress(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The payload of ``x`` (float32, (numel,)): ``indices`` (n,) within each tile (tile by tile), and
        ``signs`` (the 2-bit level codes, (ceil(n / 4),) uint8) with ``levels`` (C, 2) float32 ``[lo, hi]``
        for ``bits=2``, or ``values`` (n,) float32 for ``bits=32``."""
        flat = x.detach().reshape(-1).float()
        idx_parts, val_parts, levels, codes = [], [], [], []
        for k, tiles in self._select(flat):
            idx, vals = (torch.cat(t) for t in zip(*tiles, strict=True))
            idx_parts.append(idx.reshape(-1))
            if self.bits == 32:
                val_parts.append(vals.reshape(-1))
                continue
            mag = vals.abs()
            high = mag > mag.median(dim=1, keepdim=True).values
            n_hi = high.sum(dim=1)
            hi = torch.where(high, mag, 0).sum(dim=1) / n_hi.clamp(min=1)
            lo = torch.where(high, 0, mag).sum(dim=1) / (k - n_hi).clamp(min=1)
            levels.append(torch.stack([lo, hi], dim=1))
            codes.append(((vals < 0).to(torch.uint8) * 2 + high.to(torch.uint8)).reshape(-1))  # 0 +lo 1 +hi 2 -lo 3 -hi
        out = {"indices": torch.cat(idx_parts).to(self.index_dtype)}
        if self.bits == 32:
            return {**out, "values": torch.cat(val_parts)}
        return {**out, "signs": pack_2bit(torch.cat(codes)), "levels": torch.cat(levels)}

    def _select(self, flat: torch.Tensor) -> list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Per group (:attr:`groups`' order): its k and, in pieces of consecutive tiles, the sorted indices
        (tiles, k) int64 of each tile's k entries of largest magnitude and their values (tiles, k) float32.

        Tiles: each parameter's tiles are copied (a strided view, row-blocks at a time of about 1 MiB) into one
        scratch buffer, so no table of positions is read and nothing of the model's size is allocated; every
        tile is selected alone, so its entries are those of one selection over the whole group. Flat chunks:
        gathered through the positions' table (the padding points at a zero after the vector)."""
        if self.layout != "tiles":
            flat = torch.cat([flat, flat.new_zeros(1)])
            out = []
            for gather, k in self.groups:
                xc = flat[gather]
                idx = torch.topk(xc.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
                out.append((k, [(idx, xc.gather(1, idx))]))
            return out
        scratch = torch.empty(0, dtype=torch.float32)
        out = []
        for (e, k), members in self._tile_plan.items():
            pieces = []
            for offset, rows, cols, h, w in members:
                blocks = flat[offset:offset + rows * cols].view(rows // h, h, cols // w, w)
                step = max(1, (1 << 18) // (h * cols))  # row-blocks per piece
                for a in range(0, rows // h, step):
                    part = blocks[a:a + step]
                    n = part.numel()
                    if scratch.numel() < n:
                        scratch = torch.empty(n, dtype=torch.float32)
                    xc = scratch[:n].view(part.shape[0], cols // w, h, w).copy_(part.permute(0, 2, 1, 3))
                    xc = xc.view(-1, e)
                    idx = torch.topk(xc.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
                    pieces.append((idx, xc.gather(1, idx)))
            out.append((k, pieces))
        return out

    @functools.cached_property
    def _entry_level(self) -> torch.Tensor:
        """For each entry of a payload (tile by tile), the position of its tile's ``lo`` level in the flattened
        (C, 2) levels: ``2 * tile``, (n,) int64. Built on first use."""
        first = torch.tensor([0] + [int(g.shape[0]) for g, _ in self.groups[:-1]]).cumsum(0)
        tile = torch.cat([f + torch.arange(int(g.shape[0])).repeat_interleave(k)
                          for f, (g, k) in zip(first.tolist(), self.groups, strict=True)])
        return tile * 2

    @functools.cached_property
    def _entry_start(self) -> torch.Tensor:
        """For each entry of a payload (tile by tile), where its tile starts in its group's flattened table of
        positions (:attr:`groups`): ``tile within the group * tile elements``, (n,) int64. Built on first use."""
        return torch.cat([torch.arange(int(g.shape[0])).repeat_interleave(k) * int(g.shape[1])
                          for g, k in self.groups])

    @functools.cached_property
    def _tile_plan(self) -> dict[tuple[int, int], list[tuple[int, int, int, int, int]]]:
        """Tiles: per group (tile elements, k), in order of first appearance, its parameters in flat order as
        ``(offset, rows, cols, h, w)`` (:func:`_tile_grid`)."""
        plan: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}
        offset = 0
        for d, (e, k, _) in zip(self.shapes, self._plan, strict=True):
            plan.setdefault((e, k), []).append((offset, *_tile_grid(d, self._side)))
            offset += math.prod(d)
        return plan

    def _entries(self, payload: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A payload's entries, checked against this compressor's sizes: its indices (n,) as sent, and its
        float32 values (n,) with None (``bits=32``) or its 2-bit codes (n,) uint8 with its levels (C, 2) float32.

        Raises:
            ValueError: the payload's tensors do not have this compressor's sizes.
        """
        n = self.kept
        idx = payload["indices"].reshape(-1)
        if idx.numel() != n:
            raise ValueError(f"sparseloco payload: {idx.numel()} indices, expected {n}")
        if self.bits == 32:
            vals = payload["values"].float().reshape(-1)
            if vals.numel() != n:
                raise ValueError(f"sparseloco payload: {vals.numel()} values, expected {n}")
            return idx, vals, None
        levels = payload["levels"].float()
        if tuple(levels.shape) != (self.chunks, 2):
            raise ValueError(f"sparseloco payload: levels of shape {tuple(levels.shape)}, expected ({self.chunks}, 2)")
        return idx, unpack_2bit(payload["signs"], n, "sparseloco"), levels

    def positions_and_values(self, payload: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat positions (n,) int64 (``numel`` for a flat chunk's padding) and float32 values (n,) that a
        payload sets.

        Raises:
            ValueError: the payload's tensors do not have this compressor's sizes, or an index lies outside
                its tile (a payload is checked as if from a stranger).
        """
        idx, vals, levels = self._entries(payload)
        idx = idx.long()
        if levels is not None:  # the 2-bit codes: one of the tile's two levels (lo, hi: code bit 0), with the sign
            codes = vals.long()
            mag = levels.reshape(-1).index_select(0, self._entry_level + (codes & 1))
            vals = torch.where(codes >= 2, -mag, mag)
        # index_select on the flattened tables, not 2-D gather or [] indexing: the same integers, 3-4x faster on the CPU
        positions, start = [], 0
        for gather, k in self.groups:
            end = start + gather.shape[0] * k
            part = idx[start:end]
            if part.numel() and (int(part.min()) < 0 or int(part.max()) >= gather.shape[1]):
                raise ValueError(f"sparseloco payload: an index outside its tile of {gather.shape[1]} elements")
            positions.append(gather.view(-1).index_select(0, self._entry_start[start:end] + part))
            start = end
        return torch.cat(positions), vals

    # --- one parameter at a time (a sharded island's: atoll.runtime.collective.sharded_sparseloco) ------------
    def of_tensor(self, j: int) -> SparseCompressor:
        """The compressor of parameter ``j`` alone, with these settings: the same tiles, k and values, so its
        payload of the tensor is the tensor's part of this compressor's payload of the model (:meth:`split`,
        :meth:`join`; its indices may be of a narrower dtype). Its positions count from the tensor's start."""
        return SparseCompressor([self.shapes[j]], self.chunk, self.topk, self.bits, self.layout, self.tile_k)

    def split(self, payload: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every parameter's part of a payload of the model, in parameter order, each a payload of
        :meth:`of_tensor`: views of its indices and levels (or values), its 2-bit codes packed again.

        Raises:
            ValueError: the payload's tensors do not have this compressor's sizes.
        """
        idx, vals, levels = self._entries(payload)
        if levels is None:
            return [{"indices": idx[a:b], "values": vals[a:b]} for a, b, _, _ in self.spans]
        return [{"indices": idx[a:b], "signs": pack_2bit(vals[a:b]), "levels": levels[s:t]}
                for a, b, s, t in self.spans]

    def join(self, parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The payload of the model from each parameter's own (parameter order; :meth:`of_tensor` ``(j)``'s
        :meth:`compress` of tensor j): what :meth:`compress` makes of the flat vector, every tile being selected
        and quantized on its own (:meth:`split` undoes it).

        Raises:
            ValueError: not one part per parameter.
        """
        if len(parts) != len(self.spans):
            raise ValueError(f"sparseloco join: {len(parts)} parts for {len(self.spans)} parameters")
        ordered = [parts[j] for j in sorted(range(len(parts)), key=lambda j: self.spans[j][0])]
        out = {"indices": torch.cat([p["indices"].reshape(-1).to(self.index_dtype) for p in ordered])}
        if self.bits == 32:
            return {**out, "values": torch.cat([p["values"] for p in ordered])}
        codes = torch.cat([unpack_2bit(p["signs"], p["indices"].numel(), "sparseloco") for p in ordered])
        return {**out, "signs": pack_2bit(codes), "levels": torch.cat([p["levels"] for p in ordered])}

    def empty(self) -> dict[str, torch.Tensor]:
        """A payload of this compressor's sizes that sets zeros (index 0 of every tile, value 0): what an island
        whose pseudo-gradient is not finite sends, with weight 0 (nobody decodes it)."""
        n = self.kept
        out = {"indices": torch.zeros(n, dtype=self.index_dtype)}
        if self.bits == 32:
            return {**out, "values": torch.zeros(n)}
        return {**out, "signs": pack_2bit(torch.zeros(n, dtype=torch.uint8)), "levels": torch.zeros(self.chunks, 2)}

    def decompress(self, payload: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 (numel,) vector a payload stands for (zeros where nothing was kept). Raises ValueError
        as :meth:`positions_and_values`."""
        pos, vals = self.positions_and_values(payload)
        out = torch.zeros(self.numel + 1, dtype=torch.float32)
        out.scatter_(0, pos, vals)  # positions within a payload are distinct
        return out[:-1]

    def subtract_(self, x: torch.Tensor, payload: dict[str, torch.Tensor]) -> torch.Tensor:
        """In place, ``x.sub_(decompress(payload))`` (the same floats: ``x − 0`` is ``x``) without the dense
        (numel,) vector: only the payload's entries are read and written. ``x``: float32 (numel,), contiguous.
        Returns ``x``. Raises ValueError as :meth:`positions_and_values`."""
        self._subtract_kept_(x, payload)
        return x

    def subtract_energy_(self, x: torch.Tensor, payload: dict[str, torch.Tensor]) -> tuple[float, float, int]:
        """:meth:`subtract_`, returning the payload's entries' share of ``‖x‖²``: ``Σ_kept x²`` before and
        ``Σ_kept (x − v)²`` after (float64 sums over those entries only: no pass over ``x``), and how many entries
        it set (``x.numel()``: every one, so ‖x‖² after is the second exactly). Raises ValueError as
        :meth:`positions_and_values`."""
        old, new = self._subtract_kept_(x, payload)
        return float(old.double().square().sum()), float(new.double().square().sum()), old.numel()

    def _subtract_kept_(self, x: torch.Tensor, payload: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`subtract_`'s work; returns the kept entries' values of ``x`` before and after (float32 (n,))."""
        pos, vals = self.positions_and_values(payload)
        if self.layout != "tiles":  # a flat chunk's padding (position numel) sets nothing
            keep = pos < self.numel
            pos, vals = pos[keep], vals[keep]
        old = x.index_select(0, pos)
        new = old - vals
        x.scatter_(0, pos, new)  # positions within a payload are distinct
        return old, new

    def parameter_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The parameter index (0..P-1) of each flat position, int64 of the same shape; a flat chunk's padding
        (position ``numel``) gets index P."""
        return torch.bucketize(positions, self.ends, right=True)

    def aggregate(self, payloads: Sequence[dict[str, torch.Tensor]], weights: Sequence[float],
                  clip: str = "median", out: torch.Tensor | None = None) -> torch.Tensor:
        """The islands' combined update, float32 (numel,) (module docstring, "Aggregation").

        With ``clip="median"`` each island's values for a parameter tensor are first scaled by
        ``min(1, m / (‖v_i‖ + 1e-8))``, ``m`` the median over the islands of those norms (Templar's
        ``batch_decompress(clip_norm=True)``); then each entry is the weighted mean of the values of the islands
        that sent it, ``sum_i w_i v_i / sum_i w_i`` over senders i of that entry (0 where nobody sent it); with
        equal weights the reference's ``scatter_reduce(mean, include_self=False)``. Payloads of weight 0 count
        nowhere, in the median neither.

        ``out``: a float32 (numel,) tensor to write the result into (kept by the caller across rounds), or None
        for a fresh one. The float64 sums live in buffers this compressor keeps (16 bytes per element each).

        Raises:
            ValueError: no positive weight, an unknown clip, or a malformed payload.
        """
        if clip not in CLIPS:
            raise ValueError(f"aggregate clip must be one of {', '.join(CLIPS)}, not {clip!r}")
        live = [(payload, w) for payload, w in zip(payloads, weights, strict=True) if w > 0]
        if not live:
            raise ValueError("sparseloco aggregate: no payload has a positive weight")
        decoded = [self.positions_and_values(payload) for payload, _ in live]
        if clip == "median":
            tensors = len(self.ends) + 1  # and the padding's bucket
            owner = [self.parameter_of(pos) for pos, _ in decoded]
            norms = torch.stack([torch.zeros(tensors).index_add_(0, o, vals.square()).sqrt()
                                 for o, (_, vals) in zip(owner, decoded, strict=True)])  # (islands, tensors)
            factor = (norms.median(dim=0).values / (norms + CLIP_EPS)).clamp(max=1.0)
            decoded = [(pos, vals * f[o]) for (pos, vals), f, o in zip(decoded, factor, owner, strict=True)]
        sums = self.__dict__.get("_sums")
        if sums is None:  # zeros between calls: each call clears the entries it wrote
            sums = self.__dict__["_sums"] = torch.zeros(2, self.numel + 1, dtype=torch.float64)
        num, den = sums
        sent = torch.cat([pos for pos, _ in decoded])  # every entry some island sent (repeated: once per sender)
        try:
            # scatter_add_ and index_select, not index_add_ and [] indexing: the same floats (a payload's positions
            # are distinct, so each entry gets one addition per sender, in the senders' order), 2-4x faster
            for (pos, vals), (_, w) in zip(decoded, live, strict=True):
                num.scatter_add_(0, pos, vals.double() * w)
                den.scatter_add_(0, pos, torch.full_like(vals, w, dtype=torch.float64))
            # where(den > 0, num / den.clamp(min=1e-300), 0), computed at the sent entries only: where nobody
            # sent, it is +0.0 (the zeroed result); where some island did, den >= its weight (the same floats)
            mean = (num.index_select(0, sent) / den.index_select(0, sent).clamp_(min=1e-300)).float()
        finally:
            num.index_fill_(0, sent, 0.0)
            den.index_fill_(0, sent, 0.0)
        if self.layout != "tiles":  # a flat chunk's padding (position numel) is not an entry of the result
            keep = sent < self.numel
            sent, mean = sent[keep], mean[keep]
        out = torch.zeros(self.numel, dtype=torch.float32) if out is None else out.zero_()
        out.scatter_(0, sent, mean)  # a repeated entry gets the same value from each of its senders
        return out
