"""The byte-level BPE tokenizer, trained on the training documents and cached by corpus and size.

``load_or_train_tokenizer`` trains a byte-level BPE on the training documents only, or loads it from the
cache; the cache key hashes the training corpus and the vocabulary size. Cache files are written atomically
(``_atomic_write``), so ranks preparing the same data at once never read a half-written file.
``default_cache_dir`` is where the tokenizer and the token ids are cached by default.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from atoll.errors import DataError
from atoll.job.data.sources import Document, _one_line
from atoll.job.metrics import status

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# Bump when the tokenizer recipe changes (pre-tokenizer, trainer options): old cache files are then ignored.
TOKENIZER_FORMAT = "atoll-bpe-v1"


def _tokenizer_key(fingerprint: str, vocab_size: int) -> str:
    return hashlib.sha256(f"{TOKENIZER_FORMAT}|{fingerprint}|{vocab_size}".encode()).hexdigest()[:24]


def load_or_train_tokenizer(
    train_docs: Sequence[Document] | Callable[[], Iterable[str]], vocab_size: int, cache_dir: Path, fingerprint: str
) -> tuple[tokenizers.Tokenizer, bool]:
    """Load the cached byte-level BPE tokenizer for this corpus and size, or train and cache it.

    The tokenizer: ByteLevel pre-tokenizer (GPT-2 regex, no prefix space) and decoder, BPE trained with
    ``BpeTrainer`` over the document texts, all 256 bytes in the initial alphabet (so any text encodes, no
    unknown token), ``<|endoftext|>`` at id 0. Training the stdlib at 4096 tokens takes a few seconds.

    Args:
        train_docs: the documents to train on (training split only, so validation stays unseen), or a function
            returning an iterator of their texts (the streaming path: one shard in memory at a time).
        vocab_size: requested vocabulary size including the 256 bytes and ``<|endoftext|>``; >= 257. A small
            corpus may yield fewer tokens (``get_vocab_size()`` tells the real size).
        cache_dir: directory for ``tokenizer-<key>.json``; created if missing.
        fingerprint: identifies ``train_docs`` (use ``corpus_fingerprint(train_docs)``); part of the key.

    Returns:
        ``(tokenizer, loaded_from_cache)``.

    Raises:
        DataError: ``vocab_size`` < 257, ``train_docs`` is empty, or ``cache_dir`` is not writable.
    """
    if vocab_size < 257:
        raise DataError(
            f"vocab_size: {vocab_size} is too small for a byte-level tokenizer; use at least 257 (256 bytes + eos)"
        )
    if not callable(train_docs) and not train_docs:
        raise DataError("data: no training documents to train the tokenizer on; pass a larger corpus")
    _ensure_dir(cache_dir)
    path = cache_dir / f"tokenizer-{_tokenizer_key(fingerprint, vocab_size)}.json"
    if path.is_file():
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
            if tok.token_to_id(EOS_TOKEN) == 0:
                return tok, True
        except Exception as exc:  # a truncated or foreign file: retrain and overwrite it
            log.warning("ignoring unreadable tokenizer cache %s: %s", path, _one_line(exc))
    if callable(train_docs):  # streamed shards: their size is not known before reading them
        what = "the corpus's shards, read one at a time"
    else:
        chars = sum(len(d.text) for d in train_docs)
        size = f"{chars / 1e6:.1f}M" if chars >= 1e6 else f"{chars:,}"  # a small corpus not as 0.0M
        what = f"{len(train_docs):,} document{'s' if len(train_docs) != 1 else ''} ({size} characters)"
    status(f"training a {vocab_size}-token BPE tokenizer on {what}; once per corpus and vocabulary, then read from "
           f"{cache_dir} ...")
    t0 = time.perf_counter()
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = train_docs() if callable(train_docs) else (d.text for d in train_docs)
    tok.train_from_iterator(texts, trainer=trainer)
    log.info("trained a %d-token BPE in %.1f s", tok.get_vocab_size(), time.perf_counter() - t0)
    _atomic_write(path, lambda f: f.write(tok.to_str().encode("utf-8")))
    return tok, False


def _ensure_dir(cache_dir: Path) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"cache_dir: cannot create '{cache_dir}' ({_one_line(exc)}); set ATOLL_CACHE_DIR to a writable directory"
        ) from exc


def _atomic_write(path: Path, write: Callable[[object], object]) -> None:
    """Write through ``write(binary_file)`` to a temporary file, then rename it over ``path``.

    Readers never see a half-written file, and concurrent writers (several ranks preparing the same data)
    each rename a complete file of the same content.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"cache_dir: cannot write '{path}' ({_one_line(exc)}); set ATOLL_CACHE_DIR to a writable directory"
        ) from exc


def default_cache_dir() -> Path:
    """``$ATOLL_CACHE_DIR`` if set and non-empty, else ``~/.cache/atoll`` (not created here)."""
    env = os.environ.get("ATOLL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "atoll"
