"""Merging what islands send: weighted means in float32, of plain tensors or of codec payloads.

Every average in atoll divides by the weights of the contributions actually given, never by a configured
island count, so an island that did not contribute (failed, dropped, or of weight 0) does not dilute it
(DiLoCo, arXiv:2311.08105 §3; Decoupled DiLoCo's token-weighted merge, arXiv:2604.21428). Lossy payloads
are decoded and accumulated in float32 (Streaming DiLoCo's low-precision communication with fp32
accumulation, arXiv:2501.18512). Pure tensor math; errors are ValueError.

- :func:`weighted_mean`: plain tensors (an all-reduce of float32 values; the syncer's token-weighted merge).
- :func:`radial_directional_mean`: the mean of the tensors' norms along the normalized mean of their unit
  directions (Decoupled DiLoCo's merge of non-embedding tensors); :func:`segmented_mean` applies it, or the
  plain weighted mean, to each tensor of a flat fragment.
- :func:`average_encoded`: each island encodes its tensor with a codec (and its error feedback), every
  island decodes all of them and averages (an all-reduce of encoded payloads, priced by one payload).
- :func:`average_decoded`: the receiving half of it, for payloads that arrived packed from other processes.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from atoll.algorithms.codec_base import Codec
from atoll.algorithms.finite import l2_norm
from atoll.algorithms.wire import ErrorFeedback

__all__ = ["CodecTimes", "Segment", "average_decoded", "average_encoded", "is_embedding",
           "radial_directional_mean", "segmented_mean", "weighted_mean"]

# the lookup tables of Hugging Face causal LMs: token (and position) embeddings and an untied output head
# (Llama, Mistral, Qwen: embed_tokens, lm_head; GPT-2: wte, wpe; GPT-NeoX: embed_in, embed_out; OPT:
# embed_tokens, embed_positions; BLOOM, Falcon: word_embeddings); a tied head is not a parameter of its own
_EMBEDDING_RE = re.compile(r"(?:^|\.)(?:embed_tokens|embed_positions|embed_in|embed_out|tok_embeddings|"
                           r"word_embeddings|position_embeddings|wte|wpe|lm_head)\.")


def is_embedding(name: str) -> bool:
    """Whether the parameter ``name`` is an embedding table or an untied output head (``lm_head``): the
    tensors Decoupled DiLoCo merges by the plain mean (:func:`~atoll.algorithms.merge.segmented_mean`).

    Recognises the module names of Hugging Face causal LMs (``embed_tokens``, ``embed_positions``, ``wte``,
    ``wpe``, ``embed_in``, ``embed_out``, ``word_embeddings``, ``position_embeddings``, ``tok_embeddings``,
    ``lm_head``), e.g. ``is_embedding("model.embed_tokens.weight")``; checked against the models' own
    ``get_input_embeddings`` / ``get_output_embeddings`` in tests/test_merge_rules.py.
    """
    return _EMBEDDING_RE.search(name) is not None


@dataclass
class CodecTimes:
    """Seconds each island spent on the codec in one :func:`average_encoded`, measured with ``timer``.

    Attributes:
        timer: a clock in seconds (``time.perf_counter``; tests give a fake one).
        encode_s: per island, seconds to encode its tensor (its error feedback's decode included); 0 for an
            island of weight 0, which encodes nothing.
        decode_s: per island, seconds to decode its payload (every island decodes every payload).
    """

    timer: Callable[[], float] = time.perf_counter
    encode_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i w_i x_i / Σ_i w_i of same-shaped tensors, accumulated in float32 in the given order.

    Args:
        tensors: same-shaped tensors (any float dtype; converted to float32).
        weights: one non-negative weight per tensor (e.g. tokens trained); default equal.
        out: a float32 tensor of the inputs' shape to accumulate into (reused: no allocation, whose first
            touch costs more than the sum on a CPU); default a new one.

    Returns:
        A float32 tensor of the inputs' shape (``out`` when given).

    Raises:
        ValueError: no tensors, mismatched lengths, or weights summing to zero.
    """
    if not tensors:
        raise ValueError("weighted_mean of no tensors")
    if weights is None:
        weights = [1.0] * len(tensors)
    if len(weights) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights sum to zero")
    if out is None:
        out = torch.zeros_like(tensors[0], dtype=torch.float32)
    else:
        if out.shape != tensors[0].shape or out.dtype != torch.float32:
            raise ValueError(f"out: float32 of shape {tuple(tensors[0].shape)} needed, got {out.dtype} "
                             f"{tuple(out.shape)}")
        out.zero_()
    for t, w in zip(tensors, weights, strict=True):
        out.add_(t.to(torch.float32), alpha=float(w) / total)
    return out


def radial_directional_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted mean of the tensors' L2 norms along the normalized weighted mean of their unit directions.

    ``r̄ · d / ‖d‖`` with ``r̄ = Σ_i w_i ‖x_i‖ / Σ_i w_i`` and ``d = Σ_i w_i x_i / ‖x_i‖``: Decoupled DiLoCo's
    radial-directional averaging (arXiv:2604.21428, as third-party readings describe it). Pseudo-gradients of
    different islands are nearly orthogonal, so their plain mean is shorter than any of them (K orthogonal
    tensors of norm r: r / sqrt(K)); this merge keeps their typical length and averages only their directions.
    Two orthogonal unit directions u1, u2 with norms 1 and 3 give norm 2 along (u1 + u2) / sqrt(2), where the
    plain mean (u1 + 3 u2) / 2 has norm sqrt(10) / 2. Its norm is never above the largest input norm.

    A tensor of norm 0 has no direction: it adds its 0 to the mean norm and nothing to d; if d is 0 (all
    tensors 0, or directions that cancel exactly) the result is 0.

    Args:
        tensors: same-shaped tensors (any float dtype; computed in float32).
        weights: one non-negative weight per tensor (e.g. tokens trained); default equal.
        out: a float32 tensor of the inputs' shape to write the result into; default a new one.

    Returns:
        A float32 tensor of the inputs' shape (``out`` when given).

    Raises:
        ValueError: no tensors, mismatched lengths or shapes, or weights negative, not finite or summing to zero.
    """
    if not tensors:
        raise ValueError("radial_directional_mean of no tensors")
    w = _check_weights(weights, len(tensors))
    shape = tensors[0].shape
    if any(t.shape != shape for t in tensors):
        raise ValueError(f"radial_directional_mean: tensors of different shapes ({tuple(shape)} and others)")
    if out is None:
        out = torch.zeros(shape, dtype=torch.float32, device=tensors[0].device)
    elif out.shape != shape or out.dtype != torch.float32:
        raise ValueError(f"out: float32 of shape {tuple(shape)} needed, got {out.dtype} {tuple(out.shape)}")
    else:
        out.zero_()
    total, radius = math.fsum(w), 0.0
    for t, wi in zip(tensors, w, strict=True):
        norm = l2_norm(t)  # in float32 (float64 sums of its rows' norms: accurate at any length)
        radius += wi * norm
        if norm > 0 and wi > 0:
            out.add_(t.to(torch.float32), alpha=wi / norm)
    length = l2_norm(out)
    if length == 0.0 or not math.isfinite(length):
        return out.zero_()
    return out.mul_(radius / total / length)


#: a tensor of a flat fragment: its elements ``start:stop`` in the fragment's order, and whether it is merged
#: by :func:`radial_directional_mean` (True) or by the plain :func:`weighted_mean` (False: embeddings)
Segment = tuple[int, int, bool]


def segmented_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float] | None, segments: Sequence[Segment],
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Merge flat tensors (numel,) tensor by tensor: each segment ``(start, stop, radial)`` of the elements
    by :func:`radial_directional_mean` if ``radial``, else by :func:`weighted_mean` (Decoupled DiLoCo merges
    embedding tensors by the plain mean, every other tensor radial-directionally).

    Args:
        tensors: same-shaped 1-D tensors, one per push (float32 (numel,)).
        weights: one non-negative weight per tensor; None: equal.
        segments: the tensors' element ranges, disjoint, covering ``0..numel`` exactly once (any order).
        out: a float32 (numel,) tensor to write the result into; default a new one.

    Returns:
        A float32 tensor (numel,) (``out`` when given).

    Raises:
        ValueError: no tensors, mismatched shapes or weights (as the two means), tensors not 1-D, or segments
            that do not cover the elements exactly once.
    """
    if not tensors:
        raise ValueError("segmented_mean of no tensors")
    numel = tensors[0].numel()
    if tensors[0].dim() != 1:
        raise ValueError(f"segmented_mean: flat (numel,) tensors needed, got shape {tuple(tensors[0].shape)}")
    spans = sorted((int(a), int(b)) for a, b, _ in segments)
    edges = [0] + [b for _, b in spans]  # each span starts where the one before it stopped, the last at numel
    if any(a != e or b <= a for (a, b), e in zip(spans, edges, strict=False)) or edges[-1] != numel:
        raise ValueError(f"segments: must cover the {numel} elements exactly once without gaps, got {spans[:4]}"
                         + (" ..." if len(spans) > 4 else ""))
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=tensors[0].device)
    elif out.shape != (numel,) or out.dtype != torch.float32:
        raise ValueError(f"out: float32 of shape ({numel},) needed, got {out.dtype} {tuple(out.shape)}")
    for a, b, radial in segments:
        merge = radial_directional_mean if radial else weighted_mean
        merge([t[a:b] for t in tensors], weights, out=out[a:b])
    return out


def _check_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    w = [1.0] * n if weights is None else [float(v) for v in weights]
    if len(w) != n:
        raise ValueError(f"weights: {len(w)} given for {n} islands")
    if any(not math.isfinite(v) or v < 0 for v in w) or sum(w) <= 0:
        raise ValueError(f"weights: must be finite, >= 0 and not all zero, got {w}")
    return w


def average_decoded(codec: Codec, payloads: Sequence[torch.Tensor], numel: int,
                    weights: Sequence[float] | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Σ_i w_i decode(payload_i) / Σ_i w_i in float32, for payloads packed by :meth:`Encoded.pack`.

    Decoded and accumulated where the payloads are (nothing is copied to the host).

    Args:
        codec: the codec that encoded them.
        payloads: one packed uint8 payload per island, all on one device (a payload of weight 0 is not
            decoded).
        numel: elements of each decoded tensor.
        weights: one weight per payload; default equal.
        device: where the average is accumulated; default the first payload's device (the CPU for none).

    Returns:
        A float32 tensor of shape ``(numel,)`` on ``device``.

    Raises:
        ValueError: weights of the wrong length, negative, not finite or summing to zero; a payload of
            the wrong size.
    """
    w = _check_weights(weights, len(payloads))
    if device is None:
        device = payloads[0].device if payloads else torch.device("cpu")
    acc = torch.zeros(numel, dtype=torch.float32, device=device)
    for buf, wi in zip(payloads, w, strict=True):
        if wi != 0.0:
            acc.add_(codec.decode(codec.unpack(buf, numel)), alpha=wi)
    return acc.div_(math.fsum(w))


def average_encoded(
    per_island: Sequence[torch.Tensor],
    codec: Codec,
    weights: Sequence[float] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    *,
    feedback: Sequence[ErrorFeedback] | None = None,
    key: str = "",
    times: CodecTimes | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Model an all-reduce of encoded tensors: each island encodes, everyone decodes and averages in fp32.

    The result is ``sum_i w_i * decode(encode(x_i)) / sum_i w_i``, accumulated in float32 in island order,
    the same sum as :func:`average_decoded` of the packed payloads.

    Args:
        per_island: one float32 tensor of shape ``(numel,)`` per contributing island (same shape, device).
        codec: the codec every island uses.
        weights: non-negative weights (e.g. token counts), one per island; default equal. Normalised by
            their sum, so the average divides by what actually contributed; an island of weight 0 is
            skipped (not encoded: its generator and residual are untouched).
        generators: per-island random sources for stochastic rounding (or ``None``).
        feedback: optional per-island :class:`ErrorFeedback` (sharing ``codec``); island i then encodes
            ``x_i`` plus its residual under ``key`` and updates it.
        key: the tensor's key for ``feedback``.
        times: if given, filled with each island's encode and decode seconds (replacing what it held).
        out: a float32 tensor of the inputs' shape and device to accumulate the average into (kept by the caller
            across exchanges: a fresh one costs a page fault per 4 KiB on the CPU, more than the sum); default
            a new one.
        scratch: a float32 tensor of the inputs' shape and device each payload is decoded into
            (:meth:`Codec.decode_into`: the values :meth:`Codec.decode` returns), kept by the caller; default one
            tensor of the largest range for all islands. The block codecs decode in
            chunks of about 1 MiB on the CPU (:meth:`Codec.range_decoder`): every island encodes, then each
            chunk of the average is zeroed, each island's decoded chunk added and the sum divided while the chunk
            is in cache, through one chunk-sized buffer (the payloads of every island are held meanwhile).

    Returns:
        ``(average, nbytes)``: float32 tensor of shape ``(numel,)`` (``out`` when given), and the payload bytes
        of ONE island's encoded tensor (what each island sends).

    Raises:
        ValueError: no islands, mismatched shapes, a list of the wrong length, or weights that are
            negative, non-finite or sum to zero.
    """
    n = len(per_island)
    if n == 0:
        raise ValueError("islands: average_encoded needs at least one island's tensor")
    shape = per_island[0].shape
    for i, x in enumerate(per_island):
        if x.shape != shape:
            raise ValueError(f"islands: island {i} sent shape {tuple(x.shape)}, island 0 sent {tuple(shape)}")
    for name, seq in (("generators", generators), ("feedback", feedback)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name}: {len(seq)} given for {n} islands")
    w = _check_weights(weights, n)
    device = per_island[0].device
    for name, buf in (("out", out), ("scratch", scratch)):
        if buf is not None and (buf.shape != shape or buf.dtype != torch.float32 or buf.device != device):
            raise ValueError(f"{name}: float32 of shape {tuple(shape)} on {device} needed, got {buf.dtype} "
                             f"{tuple(buf.shape)} on {buf.device}")
    acc = torch.empty(shape, dtype=torch.float32, device=device) if out is None else out
    flat = acc.view(-1)
    timer = times.timer if times is not None else time.perf_counter
    encode_s, decode_s = [0.0] * n, [0.0] * n
    decoders = []  # every island encodes first (in island order), then the payloads are decoded range by range
    for i, x in enumerate(per_island):
        if w[i] == 0.0:
            continue
        gen = generators[i] if generators is not None else None
        t0 = timer()
        enc = feedback[i].encode(key, x, gen) if feedback is not None else codec.encode(x, gen)
        t1 = timer()
        encode_s[i] = t1 - t0
        decoders.append((i, codec.range_decoder(enc)))
    total = math.fsum(w)
    ranges = decoders[0][1][0] if decoders else []
    if any(r != ranges for _, (r, _) in decoders):  # (one codec, one length: the same ranges for every island)
        raise ValueError("average_encoded: the islands' payloads decode in different ranges")
    # per range, while it is in cache: zeroed, each island's decoded values added with its weight in island
    # order, divided by the weights' sum (the floats of the whole-tensor passes, element by element)
    decoded = scratch.view(-1) if scratch is not None else \
        torch.empty(max((b - a for a, b in ranges), default=0), dtype=torch.float32, device=device)
    for a, b in ranges:
        part = flat[a:b].zero_()
        for i, (_, fn) in decoders:
            t0 = timer()
            fn(a, b, decoded[: b - a])
            decode_s[i] += timer() - t0
            part.add_(decoded[: b - a], alpha=w[i])
        part.div_(total)
    if times is not None:
        times.encode_s, times.decode_s = encode_s, decode_s
    return acc, codec.payload_bytes(int(acc.numel()))
