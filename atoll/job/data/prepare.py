"""``prepare_data``: a corpus prepared for the islands, in memory (a file, ``stdlib``) or streamed (a folder of
shards, a Hugging Face dataset: :mod:`atoll.job.data.stream`); the steps are in :mod:`atoll.job.data.shards`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np

from atoll.errors import DataError
from atoll.job.data.pretrained import load_pretrained_tokenizer
from atoll.job.data.shards import (
    PreparedData,
    _check_islands,
    _load_or_encode,
    assemble,
    corpus_fingerprint,
    resolve_tokenizer,
    with_tokenizer,
)
from atoll.job.data.sources import is_hub_id, load_documents
from atoll.job.data.split import doc_unit, val_mask
from atoll.job.data.stream import prepare_streamed
from atoll.job.data.tokenizer import _ensure_dir


def prepare_data(
    spec: str,
    num_islands: int,
    vocab_size: int,
    seed: int,
    cache_dir: Path,
    partition: Literal["iid", "non_iid"] = "iid",
    val_fraction: float = 0.05,
    text_field: str = "text",
    tokenizer: Any = None,
    stream: bool | None = None,
    max_documents: int | None = None,
) -> PreparedData:
    """Load, split, tokenize and shard a corpus for ``num_islands`` islands (cached; see the module docstring).

    Args:
        spec: the corpus, as for ``load_documents`` (``"stdlib"``, a path, ``"hf:NAME[:CONFIG]"``).
        num_islands: number of training shards, >= 1.
        vocab_size: requested tokenizer size, >= 257 (atoll's BPE only).
        seed: shuffles the ``iid`` assignment of documents to islands.
        cache_dir: where the tokenizer and token ids are cached (see ``default_cache_dir``).
        partition: ``"iid"`` (shuffled documents, balanced token counts) or ``"non_iid"`` (whole sources per
            island, balanced greedily).
        val_fraction: fraction of documents held out for validation, in (0, 1).
        text_field: field / column with the text for .jsonl, .parquet and Hugging Face data.
        tokenizer: None for atoll's byte-level BPE trained on the training documents; a folder or Hugging
            Face id to load with ``AutoTokenizer``; or a tokenizer already loaded that way.
        stream: read and tokenize shard by shard (:mod:`atoll.job.data.stream`); None: for a folder and a
            Hugging Face dataset (the same tokens as in memory, a different ``fingerprint``).
        max_documents: Hugging Face datasets: stream at most this many documents (default: the whole split).

    Returns:
        A ``PreparedData``; shards hold token ids (``uint16`` when the vocabulary fits, else ``int32``).

    Raises:
        DataError: any ``load_documents`` / ``load_or_train_tokenizer`` error; ``partition`` unknown, or
            ``non_iid`` with fewer sources than islands; fewer than 2 documents; an island with fewer than
            2048 training tokens (corpus too small for that many islands); ``max_documents`` for a source
            other than a Hugging Face dataset.
        ConfigError: the pretrained tokenizer cannot be loaded (field ``tokenizer``).
    """
    if num_islands < 1:
        raise DataError(f"islands: {num_islands} islands requested; use at least 1")
    if partition not in ("iid", "non_iid"):
        raise DataError(f"partition: unknown value '{partition}'; use 'iid' or 'non_iid'")
    if isinstance(tokenizer, str):
        tokenizer = load_pretrained_tokenizer(tokenizer)
    if stream is None:
        stream = spec.startswith("hf:") or Path(spec).expanduser().is_dir() or is_hub_id(spec)
    if max_documents is not None and not (spec.startswith("hf:") or is_hub_id(spec)):
        raise DataError(f"max_documents: applies to hf: datasets only, not to '{spec}'; leave it out, or keep "
                        "fewer files in the folder")
    if stream:
        return prepare_streamed(spec, num_islands, vocab_size, seed, cache_dir, partition, val_fraction,
                                text_field, tokenizer, max_documents)
    _ensure_dir(cache_dir)
    docs = load_documents(spec, text_field=text_field)
    if len(docs) < 2:
        raise DataError(
            f"data: '{spec}' holds a single document; at least 2 are needed for a validation split "
            "(separate documents in a .txt file by a blank line)"
        )
    fingerprint = corpus_fingerprint(docs)
    is_val = val_mask(np.array([doc_unit(d.doc_id) for d in docs], dtype=np.float64), val_fraction)
    train_docs = [d for d, v in zip(docs, is_val, strict=True) if not v]
    tok, eos_id, tok_cached = resolve_tokenizer(tokenizer, train_docs, vocab_size, cache_dir,
                                                lambda: corpus_fingerprint(train_docs))
    tokens, offsets, tokens_cached = _load_or_encode(tok, docs, fingerprint, cache_dir)
    island_tokens, val_tokens, island_sources = assemble(
        lambda: iter([(tokens, offsets)]), np.diff(offsets), is_val, [d.source for d in docs],
        num_islands, partition, seed, eos_id,
    )
    _check_islands(island_tokens, len(val_tokens), spec)
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
        num_val_documents=int(is_val.sum()),
        tokens_from_cache=tokens_cached,
        fingerprint=with_tokenizer(fingerprint, tokenizer, tok),
        island_sources=island_sources,
        pretrained=tokenizer,
    )
