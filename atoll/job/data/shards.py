"""Token shards: every document encoded to token ids (cached), training documents dealt to islands.

:func:`atoll.job.data.prepare.prepare_data` runs the whole pipeline: ``load_documents``
(``atoll.job.data.sources``), the split (``atoll.job.data.split``), the tokenizer (atoll's BPE,
``atoll.job.data.tokenizer``, or a pretrained one, ``atoll.job.data.pretrained``), then, with the helpers
here (a folder or a Hugging Face dataset: ``atoll.job.data.stream``),

1. tokenize every document with ``encode_batch_fast`` and cache the ids under a key of the corpus
   fingerprint and the tokenizer, or load them;
2. deal the training documents to islands: ``iid`` shuffles them and balances token counts, ``non_iid``
   gives each island whole sources (stdlib: top-level modules), the DiLoCo paper's non-iid setting;
3. concatenate each island's documents, each followed by ``<|endoftext|>``, into its shard.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from atoll.errors import DataError
from atoll.job.data.sources import Document, _one_line
from atoll.job.data.tokenizer import EOS_TOKEN, _atomic_write, load_or_train_tokenizer

log = logging.getLogger(__name__)

# Bump when the token cache layout changes.
TOKENS_FORMAT = "atoll-tokens-v1"
# Each island needs at least this many training tokens (two windows of the smallest sensible context).
MIN_ISLAND_TOKENS = 2 * 1024
# Documents tokenized per encode_batch_fast call: bounds the memory held in Python lists.
ENCODE_CHUNK_DOCS = 1024


@dataclass
class PreparedData:
    """Everything the training loop needs from the data: tokenizer and token shards.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer`` that encoded the corpus: atoll's byte-level BPE, or the backend
            of a pretrained tokenizer.
        vocab_size: ``tokenizer.get_vocab_size()``; may be below the requested size on a tiny corpus.
        eos_id: id of the end-of-sequence token (``<|endoftext|>``, 0, for atoll's BPE), appended after every
            document.
        island_tokens: one 1-D array per island, that island's training shard: its documents concatenated,
            each followed by ``eos_id``. dtype ``uint16`` when ``vocab_size <= 65535`` else ``int32``.
        val_tokens: 1-D array, the validation documents concatenated the same way, same dtype.
        tokenizer_from_cache: True when the tokenizer was loaded from the cache instead of trained.
        num_documents: documents in the corpus (training and validation).
        num_train_tokens: tokens over all island shards (eos included).
        num_val_tokens: ``len(val_tokens)``.
        num_val_documents: documents held out for validation.
        tokens_from_cache: True when the token ids were loaded from the cache instead of tokenized.
        fingerprint: identifies the corpus and a pretrained tokenizer (a resumed run checks it is unchanged):
            ``corpus_fingerprint`` of the documents (in memory) or of the shard files' bytes (streamed),
            with the pretrained tokenizer's hash folded in.
        island_sources: per island, the sorted distinct ``Document.source`` values of its shard.
        pretrained: the ``transformers`` tokenizer loaded with ``AutoTokenizer`` (None for atoll's BPE); saved
            with checkpoints as it is.
        streamed: True when the corpus was read and tokenized shard by shard (a folder, a Hugging Face dataset).
    """

    tokenizer: tokenizers.Tokenizer
    vocab_size: int
    eos_id: int
    island_tokens: list[np.ndarray]
    val_tokens: np.ndarray
    tokenizer_from_cache: bool
    num_documents: int
    num_train_tokens: int
    num_val_tokens: int
    num_val_documents: int = 0
    tokens_from_cache: bool = False
    fingerprint: str = ""
    island_sources: list[list[str]] = field(default_factory=list)
    pretrained: Any = None
    streamed: bool = False


# --------------------------------------------------------------------------------------------------------------
# Fingerprint


def corpus_fingerprint(docs: list[Document]) -> str:
    """sha256 hex digest of every document's id and text, in order (cost: docs/usage.md, Data)."""
    h = hashlib.sha256()
    for d in docs:
        doc_id = d.doc_id.encode("utf-8")
        text = d.text.encode("utf-8", errors="surrogatepass")
        # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        h.update(len(doc_id).to_bytes(8, "little"))
        h.update(doc_id)
        h.update(len(text).to_bytes(8, "little"))
        h.update(text)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------
# Tokens


def _token_dtype(vocab_size: int) -> type[np.unsignedinteger] | type[np.signedinteger]:
    return np.uint16 if vocab_size <= 65535 else np.int32


def _encode_documents(
    tok: tokenizers.Tokenizer, texts: list[str], dtype: type
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of every text, concatenated (no eos), and offsets (int64, ``len(texts) + 1``)."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets; tokenizers >= 0.20
    chunks: list[np.ndarray] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for start in range(0, len(texts), ENCODE_CHUNK_DOCS):
        ids = [e.ids for e in encode(texts[start : start + ENCODE_CHUNK_DOCS], add_special_tokens=False)]
        lengths[start : start + len(ids)] = [len(x) for x in ids]
        total = int(lengths[start : start + len(ids)].sum())
        chunks.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=total))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return tokens, offsets


def tokenizer_hash(tok: tokenizers.Tokenizer) -> str:
    """sha256 hex digest of the tokenizer's JSON: part of every token cache key."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def _load_or_encode(
    tok: tokenizers.Tokenizer, docs: list[Document], fingerprint: str, cache_dir: Path
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per-document token ids, from the cache when present: ``(tokens, offsets, from_cache)``."""
    tok_hash = tokenizer_hash(tok)
    key = hashlib.sha256(f"{TOKENS_FORMAT}|{fingerprint}|{tok_hash}".encode()).hexdigest()[:24]
    tokens_path = cache_dir / f"tokens-{key}.npy"
    offsets_path = cache_dir / f"offsets-{key}.npy"
    dtype = _token_dtype(tok.get_vocab_size())
    if tokens_path.is_file() and offsets_path.is_file():
        try:
            tokens = np.load(tokens_path, allow_pickle=False)
            offsets = np.load(offsets_path, allow_pickle=False)
            if (
                tokens.ndim == 1
                and tokens.dtype == dtype
                and offsets.shape == (len(docs) + 1,)
                and int(offsets[0]) == 0
                and int(offsets[-1]) == len(tokens)
            ):
                return tokens, offsets, True
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable token cache %s: %s", tokens_path, _one_line(exc))
    t0 = time.perf_counter()
    tokens, offsets = _encode_documents(tok, [d.text for d in docs], dtype)
    log.info(
        "tokenized %d documents into %d tokens in %.1f s", len(docs), len(tokens), time.perf_counter() - t0
    )
    # Offsets are written last: a reader that finds them finds complete tokens too.
    _atomic_write(tokens_path, lambda f: np.save(f, tokens, allow_pickle=False))
    _atomic_write(offsets_path, lambda f: np.save(f, offsets, allow_pickle=False))
    return tokens, offsets, False


def _partition(
    sources: list[str], lengths: np.ndarray, num_islands: int, partition: str, seed: int
) -> list[list[int]]:
    """Assign documents (by index) to islands.

    ``iid``: documents in an order shuffled by ``seed``, each to the island with the fewest tokens so far.
    ``non_iid``: documents grouped by source; groups sorted by token count descending then name, each whole
    group to the island with the fewest tokens so far (seed unused). Ties go to the lowest island index.

    Args:
        sources: ``Document.source`` per document.
        lengths: tokens per document (eos included), int64, same length as ``sources``.

    Returns:
        Per island, the document indices in the order they are concatenated.
    """
    heap = [(0, island) for island in range(num_islands)]
    assigned: list[list[int]] = [[] for _ in range(num_islands)]
    if partition == "iid":
        order = np.random.default_rng(seed).permutation(len(sources))
        for i in order.tolist():
            load, island = heapq.heappop(heap)
            assigned[island].append(i)
            heapq.heappush(heap, (load + int(lengths[i]), island))
        return assigned
    groups: dict[str, list[int]] = {}
    for i, source in enumerate(sources):
        groups.setdefault(source, []).append(i)
    if len(groups) < num_islands:
        raise DataError(
            f"partition: non_iid needs at least one source per island but the corpus has {len(groups)} source(s) "
            f"for {num_islands} islands; use partition 'iid', fewer islands, or more source files"
        )
    sizes = {name: int(lengths[idx].sum()) for name, idx in groups.items()}
    for name in sorted(groups, key=lambda n: (-sizes[n], n)):
        load, island = heapq.heappop(heap)
        assigned[island].extend(groups[name])
        heapq.heappush(heap, (load + sizes[name], island))
    return assigned


def _check_islands(island_tokens: list[np.ndarray], num_val_tokens: int, spec: str) -> None:
    """Refuse an island with fewer than ``MIN_ISLAND_TOKENS`` training tokens, saying what the corpus holds."""
    n = len(island_tokens)
    for island, shard in enumerate(island_tokens):
        if len(shard) < MIN_ISLAND_TOKENS:
            fix = (f"use a corpus of at least {n * MIN_ISLAND_TOKENS:,} training tokens, or fewer islands" if n > 1
                   else f"use a corpus of at least {MIN_ISLAND_TOKENS:,} training tokens (docs/usage.md, Data)")
            raise DataError(
                f"data: corpus too small for {n} island{'s' if n > 1 else ''}: island {island} gets {len(shard):,} "
                f"training tokens (need >= {MIN_ISLAND_TOKENS:,}; '{spec}' holds "
                f"{sum(len(s) for s in island_tokens):,} training and {num_val_tokens:,} validation tokens); {fix}"
            )


def assemble(
    shards: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]],
    lengths: np.ndarray,
    is_val: np.ndarray,
    sources: list[str],
    num_islands: int,
    partition: str,
    seed: int,
    eos_id: int,
) -> tuple[list[np.ndarray], np.ndarray, list[list[str]]]:
    """Deal the training documents to islands and concatenate every shard, each document followed by eos.

    Args:
        shards: returns an iterator over the corpus in document order, one part at a time:
            ``(tokens, offsets)`` of consecutive documents (``offsets`` int64, documents + 1); a single part
            for the in-memory path, one per shard file when streaming (only that part is held).
        lengths: tokens per document without eos, int64, (documents,).
        is_val: which documents are held out, bool (documents,).
        sources: ``Document.source`` per document (the ``non_iid`` grouping key).

    Returns:
        ``(island_tokens, val_tokens, island_sources)`` as in :class:`PreparedData`.
    """
    train_idx = np.flatnonzero(~is_val)
    val_idx = np.flatnonzero(is_val)
    assignment = _partition([sources[i] for i in train_idx], lengths[train_idx] + 1, num_islands, partition, seed)
    orders = [[int(train_idx[j]) for j in island_docs] for island_docs in assignment] + [val_idx.tolist()]
    dest = np.full(len(lengths), -1, dtype=np.int64)
    pos = np.zeros(len(lengths), dtype=np.int64)
    sizes: list[int] = []
    for k, order in enumerate(orders):
        idx = np.asarray(order, dtype=np.int64)
        dest[idx] = k
        if len(idx):
            pos[idx[1:]] = np.cumsum(lengths[idx] + 1)[:-1]
        sizes.append(int((lengths[idx] + 1).sum()))
    outs: list[np.ndarray] = []
    first = 0
    for tokens, offsets in shards():
        if not outs:  # the token dtype is known with the first part
            outs = [np.empty(n, dtype=tokens.dtype) for n in sizes]
        for i in range(len(offsets) - 1):
            g, lo, hi = first + i, int(offsets[i]), int(offsets[i + 1])
            out, p = outs[dest[g]], int(pos[g])
            out[p : p + hi - lo] = tokens[lo:hi]
            out[p + hi - lo] = eos_id
        first += len(offsets) - 1
    island_sources = [sorted({sources[i] for i in order}) for order in orders[:-1]]
    return outs[:-1], outs[-1], island_sources


def resolve_tokenizer(
    pretrained: Any, train_docs: Any, vocab_size: int, cache_dir: Path, key: Callable[[], str]
) -> tuple[tokenizers.Tokenizer, int, bool]:
    """The tokenizer that encodes the corpus: ``(tokenizer, eos_id, from_cache)``.

    With ``pretrained`` (an ``AutoTokenizer``), its backend and eos id (``from_cache`` True: nothing trained);
    else atoll's BPE (``load_or_train_tokenizer``) on ``train_docs`` (a list of documents, or a function
    returning an iterator of texts), cached under ``key()``.
    """
    if pretrained is not None:
        from atoll.job.data.pretrained import backend_of

        return backend_of(pretrained), int(pretrained.eos_token_id), True
    tok, cached = load_or_train_tokenizer(train_docs, vocab_size, cache_dir, key())
    return tok, tok.token_to_id(EOS_TOKEN), cached


def with_tokenizer(fingerprint: str, pretrained: Any, tok: tokenizers.Tokenizer) -> str:
    """The corpus fingerprint, with a pretrained tokenizer's hash folded in (atoll's BPE: unchanged, as it
    follows from the corpus)."""
    if pretrained is None:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}|{tokenizer_hash(tok)}".encode()).hexdigest()
