"""Streaming DiLoCo fragments: which parameters sync together, and when.

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512, §2.2 "streaming partial updates") splits the
model into P fragments and synchronises one fragment at a time, staggered inside each window of H inner
steps, so the peak bandwidth drops by about P. Fragments follow the paper's *strided* pattern: transformer
layer l belongs to fragment ``l % P``, so every fragment holds layers from the whole depth.

Everything here depends only on the list of parameter names and two integers, so every island computes
the same fragments and the same schedule without talking. A fragment travels as ranges of the flat
parameter vector (:class:`FlatFragment`, from :func:`fragment_slices`): views of the parameters, as torchft
keeps a fragment as a list of parameters; :func:`fragment_flat_indices` gives the same fragments as int64
positions (8 bytes per element: 96 GB at 12B), kept as the reference the views equal bit for bit.

Example (4 layers, P = 2, H = 10)::

    frags = split_fragments([n for n, _ in model.named_parameters()], 2)
    # frags[0]: embeddings + layers 0, 2;  frags[1]: layers 1, 3 + final norm + lm_head
    fragment_sync_steps(2, 10)   # [5, 10]: fragment 0 syncs after steps 5, 15, 25...; fragment 1 after 10, 20...
    fragments_due(4, 2, 10)      # [0]  (inner step 4 is the 5th step)
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["FlatFragment", "Fragment", "as_fragments", "fragment_flat_indices", "fragment_slices",
           "fragment_sync_steps", "fragments_due", "layer_index", "split_fragments"]

# ``model.layers.3.``, ``transformer.h.3.``, ``blocks.3.`` (at the start of the name or after a dot).
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


@dataclass(frozen=True)
class Fragment:
    """One group of parameters synchronised together.

    Attributes:
        index: position in the schedule, ``0 <= index < num_fragments``.
        param_names: the fragment's parameter names, in the order of the list given to
            :func:`split_fragments` (``model.named_parameters()`` order).
    """

    index: int
    param_names: tuple[str, ...]


def layer_index(name: str) -> tuple[str, int] | None:
    """The layer stack and index of a parameter name, or ``None`` outside the layers.

    Recognises ``<prefix>.layers.<l>.``, ``<prefix>.h.<l>.`` and ``<prefix>.blocks.<l>.`` (the first
    match in the name; the prefix may be empty). Returns ``(prefix, l)``, e.g.
    ``layer_index("model.layers.3.mlp.up_proj.weight") == ("model.layers", 3)``.
    """
    m = _LAYER_RE.search(name)
    if m is None:
        return None
    stack = name[: m.end() - len(m.group(1)) - 2]  # the name up to the index, without the dot before it
    return stack, int(m.group(1))


def split_fragments(param_names: list[str], num_fragments: int) -> list[Fragment]:
    """Split parameters into ``num_fragments`` strided fragments (Streaming DiLoCo §2.2, strided pattern).

    Layers are numbered 0..L-1 by stack (in order of first appearance), then by index: for the usual
    decoder-only model, layer l is just ``model.layers.l`` (and a second stack, e.g. a decoder after an
    encoder, continues the numbering). Layer l goes to fragment ``l % num_fragments``. Parameters outside
    the layers go, deterministically: before the first layer parameter in the list (embeddings) to
    fragment 0; after the last one (final norm, lm_head) to fragment ``num_fragments - 1``; between layer
    parameters, to the fragment of the layer parameter just before them. When no name matches a layer
    pattern, the parameters are dealt round-robin in list order (parameter i to fragment ``i % P``).

    Args:
        param_names: parameter names in ``model.named_parameters()`` order (unique).
        num_fragments: P, at least 1 and at most the number of layers (or of parameters without layers).

    Returns:
        ``P`` fragments, index i at position i; every name in exactly one, each keeping list order.
        Depends only on the arguments, so identical on every island.

    Raises:
        ValueError: ``num_fragments`` < 1 or more than the layers (parameters), an empty or duplicated
            name list.
    """
    names = list(param_names)
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"fragments: must be a positive integer, got {num_fragments!r}")
    if not names:
        raise ValueError("fragments: cannot split an empty parameter list")
    if len(set(names)) != len(names):
        dup = next(n for i, n in enumerate(names) if n in names[:i])
        raise ValueError(f"fragments: parameter name {dup!r} appears twice")

    parsed = [layer_index(n) for n in names]
    if all(p is None for p in parsed):
        if num_fragments > len(names):
            raise ValueError(
                f"fragments: {num_fragments} fragments for {len(names)} parameters (no layers found); use <= "
                f"{len(names)}"
            )
        assign = [i % num_fragments for i in range(len(names))]
    else:
        stacks: list[str] = []
        for p in parsed:
            if p is not None and p[0] not in stacks:
                stacks.append(p[0])
        layers = sorted({p for p in parsed if p is not None}, key=lambda p: (stacks.index(p[0]), p[1]))
        if num_fragments > len(layers):
            raise ValueError(
                f"fragments: {num_fragments} fragments for a model with {len(layers)} layers; use <= {len(layers)}"
            )
        rank = {p: i for i, p in enumerate(layers)}
        layer_positions = [i for i, p in enumerate(parsed) if p is not None]
        last_layer_pos = layer_positions[-1]
        assign = []
        current = 0  # fragment of the latest layer parameter seen; 0 before the first
        for i, p in enumerate(parsed):
            if p is not None:
                current = rank[p] % num_fragments
                assign.append(current)
            elif i > last_layer_pos:
                assign.append(num_fragments - 1)
            else:
                assign.append(current)

    groups: list[list[str]] = [[] for _ in range(num_fragments)]
    for name, frag in zip(names, assign, strict=True):
        groups[frag].append(name)
    return [Fragment(index=i, param_names=tuple(g)) for i, g in enumerate(groups)]


def fragment_flat_indices(named_shapes: list[tuple[str, tuple[int, ...]]], num_fragments: int) -> list[torch.Tensor]:
    """Positions of each fragment's elements in the flat vector of all parameters, balanced in size.

    Layer parameters follow :func:`split_fragments` (layer l to fragment ``l % P``). Parameters outside
    the layers (token embeddings, which a tied LM head shares, and the final norm) are not given whole to
    one fragment: each is cut along its first dimension into P row blocks as equal as possible
    (``numpy.array_split`` sizes), block p going to fragment p. In a small model the embedding is a third
    of the parameters; given whole to fragment 0 it would make that fragment's exchange the peak and undo
    Streaming DiLoCo's P-fold cut in peak bandwidth. With L a multiple of P, the fragments are then equal.

    Args:
        named_shapes: ``(name, shape)`` of every parameter in ``model.named_parameters()`` order; the flat
            vector concatenates them in that order, each flattened row-major.
        num_fragments: P (see :func:`split_fragments`).

    Returns:
        P int64 tensors of flat positions, ascending; together they cover ``0 .. numel - 1`` exactly once.
        Depends only on the arguments, so identical on every island.

    Raises:
        ValueError: as :func:`split_fragments`.
    """
    names = [n for n, _ in named_shapes]
    fragments = split_fragments(names, num_fragments)
    owner = {n: f.index for f in fragments for n in f.param_names}
    parts: list[list[torch.Tensor]] = [[] for _ in range(num_fragments)]
    offset = 0
    for name, shape in named_shapes:
        numel = 1
        for d in shape:
            numel *= d
        if layer_index(name) is not None or num_fragments == 1 or not shape or all(
            layer_index(n) is None for n in names
        ):
            parts[owner[name]].append(torch.arange(offset, offset + numel))
        else:
            rows, per_row = shape[0], numel // max(1, shape[0])
            bounds = [rows * p // num_fragments for p in range(num_fragments + 1)]
            for p in range(num_fragments):
                start, stop = offset + bounds[p] * per_row, offset + bounds[p + 1] * per_row
                parts[p].append(torch.arange(start, stop))
        offset += numel
    return [torch.cat(p) if p else torch.zeros(0, dtype=torch.int64) for p in parts]


@dataclass(frozen=True)
class FlatFragment:
    """A fragment as contiguous ranges of the flat parameter vector: views, not an index over every element.

    torchft's Streaming DiLoCo (``local_sgd.py``) keeps a fragment as a list of parameters; atoll's fragments
    also cut the embedding and the final norm into row blocks (:func:`fragment_slices`), so a fragment is a
    short list of ``(start, stop)`` ranges of the flat vector (``model.parameters()`` order, each parameter
    flattened row-major), each inside one parameter: about one range per parameter, a few hundred integers,
    where the int64 positions of :func:`fragment_flat_indices` take 8 bytes per element (96 GB at 12B).

    Gathering a fragment (:meth:`gather`) equals ``flat[positions]`` and scattering (:meth:`scatter_`)
    equals ``flat[positions] = values`` bit for bit (the same elements in the same order; only copies).

    Attributes:
        ranges: ``(start, stop)`` flat positions, ascending and disjoint, in the fragment's element order.
        params: per range, the name of its parameter (:func:`fragment_slices` names them); empty: unknown.
    """

    ranges: tuple[tuple[int, int], ...]
    params: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.params and len(self.params) != len(self.ranges):
            raise ValueError(f"fragment: {len(self.params)} parameter names for {len(self.ranges)} ranges")

    def numel(self) -> int:
        """Elements in the fragment."""
        return sum(b - a for a, b in self.ranges)

    def positions(self) -> torch.Tensor:
        """The flat positions, int64 (numel,): what :func:`fragment_flat_indices` gives (for tests, old code)."""
        parts = [torch.arange(a, b) for a, b in self.ranges]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def tensor_segments(self) -> list[tuple[int, int, str]]:
        """The fragment cut by parameter: ``(start, stop, name)`` offsets into :meth:`gather`'s result, ranges of
        one parameter joined; without ``params``, one segment of every element, named "" (numel 0: none)."""
        if not self.params:
            return [(0, self.numel(), "")] if self.numel() else []
        out: list[tuple[int, int, str]] = []
        offset = 0
        for (a, b), name in zip(self.ranges, self.params, strict=True):
            if out and out[-1][2] == name and out[-1][1] == offset:
                out[-1] = (out[-1][0], offset + b - a, name)
            else:
                out.append((offset, offset + b - a, name))
            offset += b - a
        return out

    @classmethod
    def of_positions(cls, positions: torch.Tensor) -> FlatFragment:
        """The ranges of ascending int64 ``positions`` (runs of consecutive ones).

        Raises:
            ValueError: ``positions`` is not 1-D, or not strictly ascending.
        """
        pos = positions.reshape(-1).to(torch.int64)
        if positions.dim() != 1:
            raise ValueError(f"fragment positions: must be 1-D, got shape {tuple(positions.shape)}")
        if pos.numel() == 0:
            return cls(())
        step = pos[1:] - pos[:-1]
        if bool((step <= 0).any()):
            raise ValueError("fragment positions: must be strictly ascending")
        breaks = (torch.nonzero(step != 1).reshape(-1) + 1).tolist()
        starts = [0, *breaks]
        stops = [*breaks, pos.numel()]
        first = pos[starts].tolist()
        last = pos[[s - 1 for s in stops]].tolist()
        return cls(tuple((a, b + 1) for a, b in zip(first, last, strict=True)))

    def gather(self, flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fragment's elements of ``flat`` (1-D), a new tensor (numel,) of its dtype and device, or
        written into ``out``; equals ``flat[positions]``.

        Raises:
            ValueError: ``flat`` is not 1-D or too short for the fragment's ranges.
        """
        self._fits(flat)
        views = [flat[a:b] for a, b in self.ranges]
        if out is None:
            return torch.cat(views) if views else flat.new_empty(0)
        return torch.cat(views, out=out) if views else out

    def scatter_(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """``flat[positions] = values`` in place (``values``: (numel,), copied element for element).

        Raises:
            ValueError: ``values`` is not of the fragment's size, or ``flat`` is too short for its ranges.
        """
        self._fits(flat)
        if values.numel() != self.numel():
            raise ValueError(f"fragment of {self.numel()} elements given {values.numel()} values")
        offset = 0
        for a, b in self.ranges:
            flat[a:b].copy_(values[offset:offset + b - a])
            offset += b - a

    def _fits(self, flat: torch.Tensor) -> None:
        if self.ranges and (flat.dim() != 1 or self.ranges[-1][1] > flat.numel()):
            raise ValueError(f"fragment ranges up to {self.ranges[-1][1]} do not fit a vector of shape "
                             f"{tuple(flat.shape)}")

    def param_views(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The fragment as 1-D views of ``params`` (the tensors the flat vector concatenates), in element
        order: writing a view writes the parameter. A range that spans parameters is cut at their borders.

        Raises:
            ValueError: a range beyond the parameters' total size.
        """
        starts, total = [], 0
        for p in params:
            starts.append(total)
            total += p.numel()
        views = []
        for a, b in self.ranges:
            if b > total:
                raise ValueError(f"fragment range {a}:{b} beyond the parameters' {total} elements")
            while a < b:
                k = bisect.bisect_right(starts, a) - 1
                stop = min(b, starts[k] + params[k].numel())
                views.append(params[k].reshape(-1)[a - starts[k]:stop - starts[k]])
                a = stop
        return views


def as_fragments(index: Sequence[FlatFragment | torch.Tensor] | None, numel: int) -> list[FlatFragment]:
    """``index`` as :class:`FlatFragment` s (int64 ascending positions converted; None: one fragment of all
    ``numel`` elements), checked to cover exactly ``numel`` elements.

    Raises:
        ValueError: the fragments do not cover ``numel`` elements, or reach beyond them.
    """
    frags = ([FlatFragment(((0, numel),))] if index is None else
             [f if isinstance(f, FlatFragment) else FlatFragment.of_positions(f) for f in index])
    if sum(f.numel() for f in frags) != numel or any(b > numel for f in frags for _, b in f.ranges):
        raise ValueError(f"fragment index covers {sum(f.numel() for f in frags)} of {numel} elements")
    return frags


def fragment_slices(named_shapes: list[tuple[str, tuple[int, ...]]], num_fragments: int) -> list[FlatFragment]:
    """:func:`fragment_flat_indices` as ranges of the flat vector (:class:`FlatFragment`): the same
    fragments, the same element order, one range per parameter or row block instead of an int64 per element,
    each named by its parameter (:attr:`FlatFragment.params`, for per-tensor merges).

    Raises:
        ValueError: as :func:`split_fragments`.
    """
    names = [n for n, _ in named_shapes]
    fragments = split_fragments(names, num_fragments)
    owner = {n: f.index for f in fragments for n in f.param_names}
    no_layers = all(layer_index(n) is None for n in names)
    parts: list[list[tuple[int, int, str]]] = [[] for _ in range(num_fragments)]
    offset = 0
    for name, shape in named_shapes:
        numel = 1
        for d in shape:
            numel *= d
        if layer_index(name) is not None or num_fragments == 1 or not shape or no_layers:
            parts[owner[name]].append((offset, offset + numel, name))
        else:  # outside the layers: P row blocks, block p to fragment p (see fragment_flat_indices)
            rows, per_row = shape[0], numel // max(1, shape[0])
            bounds = [rows * p // num_fragments for p in range(num_fragments + 1)]
            for p in range(num_fragments):
                parts[p].append((offset + bounds[p] * per_row, offset + bounds[p + 1] * per_row, name))
        offset += numel
    kept = [[(a, b, n) for a, b, n in r if b > a] for r in parts]
    return [FlatFragment(tuple((a, b) for a, b, _ in r), tuple(n for _, _, n in r)) for r in kept]


def _check_schedule(num_fragments: int, sync_every: int) -> None:
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"fragments: must be a positive integer, got {num_fragments!r}")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every: must be a positive integer, got {sync_every!r}")
    if sync_every < num_fragments:
        raise ValueError(
            f"sync_every: H={sync_every} is smaller than fragments={num_fragments}; each fragment needs its own "
            "step in the H window (raise sync_every or lower fragments)"
        )


@lru_cache(maxsize=256)
def _offsets(num_fragments: int, sync_every: int) -> tuple[int, ...]:
    # round half up, in integers: round((p + 1) * H / P)
    return tuple(
        (2 * (p + 1) * sync_every + num_fragments) // (2 * num_fragments) for p in range(num_fragments)
    )


def fragment_sync_steps(num_fragments: int, sync_every: int) -> list[int]:
    """Sync offsets of the staggered schedule (Streaming DiLoCo §2.2): ``offset_p`` for each fragment p.

    ``offset_p = round((p + 1) * H / P)`` (halves round up), so ``1 <= offset_0 < ... < offset_{P-1} = H``.
    Fragment p starts a sync after ``offset_p, offset_p + H, offset_p + 2H, ...`` completed inner steps,
    i.e. after 0-based inner step ``step`` when ``step + 1 >= offset_p`` and
    ``(step + 1 - offset_p) % H == 0``. With P = 1 that is DiLoCo (after H, 2H, ... steps); with P
    fragments the syncs are spread evenly, each fragment exactly once per window of H steps.

    Args:
        num_fragments: P >= 1.
        sync_every: H >= P, inner steps per window.

    Returns:
        list of P offsets, in completed inner steps.

    Raises:
        ValueError: P < 1 or H < 1 (names ``fragments`` / ``sync_every``), or H < P (``sync_every``).
    """
    _check_schedule(num_fragments, sync_every)
    return list(_offsets(num_fragments, sync_every))


def fragments_due(step: int, num_fragments: int, sync_every: int) -> list[int]:
    """Fragments that start their sync after inner step ``step`` (0-based; ``step + 1`` steps done).

    Uses the offsets of :func:`fragment_sync_steps`. Because the offsets are distinct and lie in
    ``[1, H]``, at most one fragment is due at any step.

    Args:
        step: 0-based index of the inner step just finished, >= 0.
        num_fragments: P >= 1.
        sync_every: H >= P.

    Returns:
        the due fragment indices, ascending (empty or one element).

    Raises:
        ValueError: ``step`` < 0 (names ``step``), or the checks of :func:`fragment_sync_steps`.
    """
    _check_schedule(num_fragments, sync_every)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: must be a non-negative integer, got {step!r}")
    done = step + 1
    return [
        p
        for p, off in enumerate(_offsets(num_fragments, sync_every))
        if done >= off and (done - off) % sync_every == 0
    ]
