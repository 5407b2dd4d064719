"""Data: corpus -> tokenizer (atoll's byte-level BPE or a pretrained one) -> token shards per island -> batches.

1. ``sources``: read a corpus (``"stdlib"``, the default, needs no download; ``.txt`` / ``.jsonl`` /
   ``.parquet`` files) into ``Document`` s; ``split``: hold out validation documents by a hash of their id.
2. ``tokenizer``: train a byte-level BPE on the training documents, or load it from the cache;
   ``pretrained``: or use a model's own tokenizer (``AutoTokenizer``).
3. ``shards``: tokenize every document (cached) and deal the training documents to islands (``iid`` or
   ``non_iid``); ``prepare_data`` runs steps 1 to 3. ``stream``: the same for a folder of shards or a
   Hugging Face dataset, one shard in memory at a time, the tokens cached per shard.
4. ``batches``: random training windows, a pure function of ``(seed, island, step)``, and evenly spread
   validation windows.

What preparing the default corpus costs: docs/usage.md, Data. ::

    from atoll.job.data import prepare_data, sample_batch, eval_batches, default_cache_dir

    data = prepare_data("stdlib", num_islands=4, vocab_size=4096, seed=0, cache_dir=default_cache_dir())
    batch = sample_batch(data.island_tokens[0], batch_size=8, seq_len=256, seed=0, island=0, step=0)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    val = eval_batches(data.val_tokens, batch_size=8, seq_len=256, max_batches=4)
"""

from atoll.job.data.batches import eval_batches, sample_batch
from atoll.job.data.prepare import prepare_data
from atoll.job.data.shards import (
    ENCODE_CHUNK_DOCS,
    MIN_ISLAND_TOKENS,
    TOKENS_FORMAT,
    PreparedData,
    corpus_fingerprint,
)
from atoll.job.data.sources import (
    STDLIB_CHUNK_CHARS,
    SUPPORTED_SUFFIXES,
    TXT_CHUNK_CHARS,
    Document,
    load_documents,
)
from atoll.job.data.split import split_documents
from atoll.job.data.tokenizer import EOS_TOKEN, TOKENIZER_FORMAT, default_cache_dir, load_or_train_tokenizer

__all__ = [
    "ENCODE_CHUNK_DOCS",
    "EOS_TOKEN",
    "MIN_ISLAND_TOKENS",
    "STDLIB_CHUNK_CHARS",
    "SUPPORTED_SUFFIXES",
    "TOKENIZER_FORMAT",
    "TOKENS_FORMAT",
    "TXT_CHUNK_CHARS",
    "Document",
    "PreparedData",
    "corpus_fingerprint",
    "default_cache_dir",
    "eval_batches",
    "load_documents",
    "load_or_train_tokenizer",
    "prepare_data",
    "sample_batch",
    "split_documents",
]
