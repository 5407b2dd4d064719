"""Token shards: every document encoded to token ids (cached), training documents dealt to islands.

``prepare_data`` runs the whole pipeline: ``load_documents`` and ``split_documents`` (``atoll.job.data.sources``),
``load_or_train_tokenizer`` (``atoll.job.data.tokenizer``), then

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import tokenizers

from atoll.errors import DataError
from atoll.job.data.sources import Document, _one_line, load_documents, split_documents
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
        tokenizer: the byte-level BPE tokenizer (``tokenizers.Tokenizer``).
        vocab_size: ``tokenizer.get_vocab_size()``; may be below the requested size on a tiny corpus.
        eos_id: id of ``<|endoftext|>`` (0), appended after every document.
        island_tokens: one 1-D array per island, that island's training shard: its documents concatenated,
            each followed by ``eos_id``. dtype ``uint16`` when ``vocab_size <= 65535`` else ``int32``.
        val_tokens: 1-D array, the validation documents concatenated the same way, same dtype.
        tokenizer_from_cache: True when the tokenizer was loaded from the cache instead of trained.
        num_documents: documents in the corpus (training and validation).
        num_train_tokens: tokens over all island shards (eos included).
        num_val_tokens: ``len(val_tokens)``.
        num_val_documents: documents held out for validation.
        tokens_from_cache: True when the token ids were loaded from the cache instead of tokenized.
        fingerprint: ``corpus_fingerprint`` of the whole corpus (to check a resumed run uses the same data).
        island_sources: per island, the sorted distinct ``Document.source`` values of its shard.
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


# --------------------------------------------------------------------------------------------------------------
# Fingerprint


def corpus_fingerprint(docs: list[Document]) -> str:
    """sha256 hex digest of every document's id and text, in order (cost: README, Data)."""
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


def _load_or_encode(
    tok: tokenizers.Tokenizer, docs: list[Document], fingerprint: str, cache_dir: Path
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per-document token ids, from the cache when present: ``(tokens, offsets, from_cache)``."""
    tok_hash = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
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


def _concat_with_eos(
    tokens: np.ndarray, offsets: np.ndarray, indices: Iterable[int], eos_id: int
) -> np.ndarray:
    """The documents ``indices`` concatenated, each followed by ``eos_id``; same dtype as ``tokens``."""
    eos = np.array([eos_id], dtype=tokens.dtype)
    parts: list[np.ndarray] = []
    for i in indices:
        parts.append(tokens[offsets[i] : offsets[i + 1]])
        parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=tokens.dtype)


def prepare_data(
    spec: str,
    num_islands: int,
    vocab_size: int,
    seed: int,
    cache_dir: Path,
    partition: Literal["iid", "non_iid"] = "iid",
    val_fraction: float = 0.05,
    text_field: str = "text",
) -> PreparedData:
    """Load, split, tokenize and shard a corpus for ``num_islands`` islands (cached; see the module docstring).

    Args:
        spec: the corpus, as for ``load_documents`` (``"stdlib"``, a path, ``"hf:NAME[:CONFIG]"``).
        num_islands: number of training shards, >= 1.
        vocab_size: requested tokenizer size, >= 257.
        seed: shuffles the ``iid`` assignment of documents to islands.
        cache_dir: where the tokenizer and token ids are cached (see ``default_cache_dir``).
        partition: ``"iid"`` (shuffled documents, balanced token counts) or ``"non_iid"`` (whole sources per
            island, balanced greedily).
        val_fraction: fraction of documents held out for validation, in (0, 1).
        text_field: field / column with the text for .jsonl, .parquet and Hugging Face data.

    Returns:
        A ``PreparedData``; shards hold token ids (``uint16`` when the vocabulary fits, else ``int32``).

    Raises:
        DataError: any ``load_documents`` / ``load_or_train_tokenizer`` error; ``partition`` unknown, or
            ``non_iid`` with fewer sources than islands; fewer than 2 documents; an island with fewer than
            2048 training tokens (corpus too small for that many islands).
    """
    if num_islands < 1:
        raise DataError(f"islands: {num_islands} islands requested; use at least 1")
    if partition not in ("iid", "non_iid"):
        raise DataError(f"partition: unknown value '{partition}'; use 'iid' or 'non_iid'")
    docs = load_documents(spec, text_field=text_field)
    if len(docs) < 2:
        raise DataError(
            f"data: '{spec}' holds a single document; at least 2 are needed for a validation split "
            "(separate documents in a .txt file by two blank lines)"
        )
    fingerprint = corpus_fingerprint(docs)
    train_docs, val_docs = split_documents(docs, val_fraction)
    tok, tok_cached = load_or_train_tokenizer(
        train_docs, vocab_size, cache_dir, corpus_fingerprint(train_docs)
    )
    eos_id = tok.token_to_id(EOS_TOKEN)
    tokens, offsets, tokens_cached = _load_or_encode(tok, docs, fingerprint, cache_dir)

    val_ids = {d.doc_id for d in val_docs}
    train_idx = [i for i, d in enumerate(docs) if d.doc_id not in val_ids]
    val_idx = [i for i, d in enumerate(docs) if d.doc_id in val_ids]
    lengths = np.diff(offsets)[train_idx] + 1  # + eos
    assignment = _partition([docs[i].source for i in train_idx], lengths, num_islands, partition, seed)
    island_tokens = [
        _concat_with_eos(tokens, offsets, (train_idx[j] for j in island_docs), eos_id)
        for island_docs in assignment
    ]
    for island, shard in enumerate(island_tokens):
        if len(shard) < MIN_ISLAND_TOKENS:
            islands = f"{num_islands} islands" if num_islands != 1 else "1 island"
            raise DataError(
                f"data: corpus too small for {islands}: island {island} gets {len(shard)} training "
                f"tokens (need >= {MIN_ISLAND_TOKENS}); use a larger corpus"
                + (" or fewer islands" if num_islands > 1 else "")
            )
    val_tokens = _concat_with_eos(tokens, offsets, val_idx, eos_id)
    island_sources = [sorted({docs[train_idx[j]].source for j in island_docs}) for island_docs in assignment]
    return PreparedData(
        tokenizer=tok,
        vocab_size=tok.get_vocab_size(),
        eos_id=eos_id,
        island_tokens=island_tokens,
        val_tokens=val_tokens,
        tokenizer_from_cache=tok_cached,
        num_documents=len(docs),
        num_train_tokens=sum(len(s) for s in island_tokens),
        num_val_tokens=len(val_tokens),
        num_val_documents=len(val_docs),
        tokens_from_cache=tokens_cached,
        fingerprint=fingerprint,
        island_sources=island_sources,
    )
