"""Data pipeline; the code moves from here into one module per stage in the next commit."""

from atoll.data.sources import (  # noqa: F401
    ENCODE_CHUNK_DOCS,
    EOS_TOKEN,
    MIN_ISLAND_TOKENS,
    STDLIB_CHUNK_CHARS,
    SUPPORTED_SUFFIXES,
    TOKENIZER_FORMAT,
    TOKENS_FORMAT,
    TXT_CHUNK_CHARS,
    Document,
    PreparedData,
    corpus_fingerprint,
    default_cache_dir,
    eval_batches,
    load_documents,
    load_or_train_tokenizer,
    prepare_data,
    sample_batch,
    split_documents,
)
