"""Data: corpus -> documents -> byte-level BPE tokenizer -> token shards per island.

The default corpus needs no download: the running interpreter's standard library source (without its tests)
plus the ``pydoc_data`` topics, about 11 MB of text. Users can point at their own ``.txt`` / ``.jsonl`` /
``.parquet`` files (or a directory of them), or at a Hugging Face dataset when online::

    from atoll.data import prepare_data, sample_batch, eval_batches, default_cache_dir

    data = prepare_data("stdlib", num_islands=4, vocab_size=4096, seed=0, cache_dir=default_cache_dir())
    batch = sample_batch(data.island_tokens[0], batch_size=8, seq_len=256, seed=0, island=0, step=0)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    val = eval_batches(data.val_tokens, batch_size=8, seq_len=256, max_batches=4)

The pipeline, and what each stage costs on 2 CPU cores for the stdlib corpus (Python 3.11: 1,142
documents, 3.4 M tokens at a 4096-token vocabulary; about 7 s cold, 0.1 s with a warm cache):

1. ``load_documents``: read the corpus into ``Document`` s (text, source, doc_id). 0.2 s.
2. ``split_documents``: hold out validation documents by a sha256 of their ``doc_id``, so the split is
   the same on every machine and in every run (Python's ``hash`` is salted per process; we avoid it).
3. ``load_or_train_tokenizer``: train a byte-level BPE on the training documents only (seconds) or load
   it from the cache (2-8 s at 4096 tokens). The cache key hashes the training corpus and vocabulary size.
4. Tokenize every document with ``encode_batch_fast`` and cache the ids (5-12 s cold; the ByteLevel regex
   runs at about 1 MB/s per core), or load them (milliseconds).
5. Deal the training documents to islands: ``iid`` shuffles them and balances token counts, ``non_iid``
   gives each island whole sources (stdlib: top-level modules), the DiLoCo paper's non-iid setting.

Batches are a pure function of ``(seed, island, step)``: a resumed run draws exactly the same batches
without any saved iterator state.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import logging
import os
import re
import socket
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from atoll.errors import DataError

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# Bump when the tokenizer recipe changes (pre-tokenizer, trainer options): old cache files are then ignored.
TOKENIZER_FORMAT = "atoll-bpe-v1"
# Bump when the token cache layout changes.
TOKENS_FORMAT = "atoll-tokens-v1"
# Each island needs at least this many training tokens (two windows of the smallest sensible context).
MIN_ISLAND_TOKENS = 2 * 1024
# A .txt file that is one huge document is cut into pieces of about this many characters.
TXT_CHUNK_CHARS = 20_000
# Standard library modules longer than this are cut into pieces (before a top-level statement if possible).
STDLIB_CHUNK_CHARS = 16_000
# Documents tokenized per encode_batch_fast call: bounds the memory held in Python lists.
ENCODE_CHUNK_DOCS = 1024
SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")

_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"})
# pydoc_data/topics.py holds the same text as the pydoc topics, which are added one document per topic.
_STDLIB_SKIP_FILES = frozenset({"pydoc_data/topics.py"})
_HF_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Two or more blank lines (blank = only spaces or tabs) separate documents in a .txt file.
_TXT_DOC_SEP_RE = re.compile(r"\n(?:[ \t]*\n){2,}")


@dataclass(frozen=True)
class Document:
    """One document of the corpus.

    Attributes:
        text: the document's text (never empty or only whitespace).
        source: grouping key for the non-iid partition. stdlib: the top-level module or package name
            (``"email"``, ``"os"``) or ``"pydoc_topics"``; .txt/.parquet: the file name (relative to the
            directory when a directory was given); .jsonl: the object's ``"source"`` field if it is a
            string, else the file name; Hugging Face: the dataset name.
        doc_id: stable unique id: a relative path, or ``"<path>#<piece>"`` for a long module cut into pieces
            (stdlib), ``"pydoc_topics:<topic>"``, ``"<file>:<line>"`` (.jsonl), ``"<file>:<row>"`` (.parquet),
            ``"<file>#<index>"`` (.txt), ``"<dataset>:<row>"`` (Hugging Face).
    """

    text: str
    source: str
    doc_id: str


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
# Loading documents


def load_documents(spec: str, text_field: str = "text") -> list[Document]:
    """Read a corpus into documents.

    Args:
        spec: where the text is:
            ``"stdlib"``: the running interpreter's standard library ``*.py`` files (tests excluded; a
            module longer than 16,000 characters is cut into pieces, preferably before a top-level
            statement) plus one document per ``pydoc_data.topics`` entry, about 11 MB, ~1,100 documents;
            an existing path: a ``.txt`` file (documents separated by two or more blank lines; a single
            document longer than 20,000 characters is cut at line boundaries into ~20,000-character pieces),
            a ``.jsonl`` file (one JSON object per line), a ``.parquet`` file, or a directory searched
            recursively for those three kinds;
            ``"hf:NAME"`` / ``"hf:NAME:CONFIG"`` / ``"owner/name"`` (not an existing path): the ``train``
            split of a Hugging Face dataset (needs the network or a cached copy with ``HF_HUB_OFFLINE=1``).
        text_field: the JSON field / Parquet column / dataset column that holds the text.

    Returns:
        The non-empty documents in a deterministic order (sorted by file, then position in the file).

    Raises:
        DataError: the path does not exist, has an unsupported extension, a JSON line is invalid or lacks
            ``text_field``, the Hugging Face dataset cannot be loaded, or the corpus has no non-empty text.
    """
    if spec == "stdlib":
        docs = _load_stdlib()
    elif spec.startswith("hf:"):
        name, _, config = spec[3:].partition(":")
        if not name:
            raise DataError(f"data: '{spec}' names no dataset; use hf:NAME or hf:NAME:CONFIG")
        docs = _load_hf(name, config or None, text_field, spec)
    else:
        path = Path(spec).expanduser()
        if path.exists():
            docs = _load_path(path, text_field)
        elif _HF_REPO_RE.match(spec) and not spec.endswith(SUPPORTED_SUFFIXES):
            docs = _load_hf(spec, None, text_field, spec, not_a_path=True)
        elif "/" in spec or os.sep in spec or spec.endswith(SUPPORTED_SUFFIXES):
            raise DataError(
                f"data: path '{spec}' does not exist; pass an existing .txt/.jsonl/.parquet file or directory, "
                "or 'stdlib'"
            )
        else:
            raise DataError(
                f"data: unknown data source '{spec}'; pass 'stdlib', an existing .txt/.jsonl/.parquet file or "
                "directory, or hf:NAME for a Hugging Face dataset"
            )
    if not docs:
        raise DataError(f"data: '{spec}' contains no non-empty documents; pass a corpus with some text")
    return docs


def _load_stdlib() -> list[Document]:
    """The standard library's source files (no tests) and the pydoc topics, sorted by doc_id per kind."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(
            f"data: the standard library source is not at '{root}' in this Python; "
            "pass a .txt/.jsonl/.parquet path instead of 'stdlib'"
        )
    rel_paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("."))
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(".py") and not name.startswith("test_"):
                rel = (rel_dir / name).as_posix()
                if rel not in _STDLIB_SKIP_FILES:
                    rel_paths.append(rel)
    docs = []
    for rel in sorted(rel_paths):
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        source = rel.split("/", 1)[0].removesuffix(".py")
        if len(text) <= STDLIB_CHUNK_CHARS:
            docs.append(Document(text=text, source=source, doc_id=rel))
            continue
        # Long modules become several documents: a finer validation split and better balanced shards.
        pieces = [p for p in _chunk_lines(text, STDLIB_CHUNK_CHARS, _is_top_level_statement) if p.strip()]
        docs.extend(Document(text=p, source=source, doc_id=f"{rel}#{i}") for i, p in enumerate(pieces))
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; the source files are plenty
        topics = {}
    for key in sorted(topics):
        text = topics[key]
        if isinstance(text, str) and text.strip():
            docs.append(Document(text=text, source="pydoc_topics", doc_id=f"pydoc_topics:{key}"))
    return docs


def _load_path(path: Path, text_field: str) -> list[Document]:
    """Documents from an existing file or directory (recursively every .txt/.jsonl/.parquet, sorted)."""
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise DataError(
                f"data: directory '{path}' has no .txt/.jsonl/.parquet files; add some or pass another path"
            )
        docs: list[Document] = []
        for file in files:
            docs.extend(_load_file(file, file.relative_to(path).as_posix(), text_field))
        return docs
    return _load_file(path, path.name, text_field)


def _load_file(path: Path, name: str, text_field: str) -> list[Document]:
    """Documents from one file; ``name`` is its display name, used for ``source`` and ``doc_id``."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            return _load_txt(path, name)
        if suffix == ".jsonl":
            return _load_jsonl(path, name, text_field)
        if suffix == ".parquet":
            return _load_parquet(path, name, text_field)
    except OSError as exc:
        raise DataError(
            f"data: cannot read '{path}' ({_one_line(exc)}); check the file and its permissions"
        ) from exc
    raise DataError(
        f"data: unsupported file type '{path.suffix or '(none)'}' for '{path}'; pass a .txt, .jsonl or .parquet "
        "file or a directory of them"
    )


def _load_txt(path: Path, name: str) -> list[Document]:
    text = path.read_text(encoding="utf-8", errors="replace")
    pieces = [p.strip("\n") for p in _TXT_DOC_SEP_RE.split(text)]
    pieces = [p for p in pieces if p.strip()]
    if len(pieces) == 1 and len(pieces[0]) > TXT_CHUNK_CHARS:
        pieces = [p for p in _chunk_lines(pieces[0], TXT_CHUNK_CHARS) if p.strip()]
    return [Document(text=p, source=name, doc_id=f"{name}#{i}") for i, p in enumerate(pieces)]


def _chunk_lines(text: str, max_chars: int, prefer: Callable[[str], bool] | None = None) -> Iterator[str]:
    """Cut text at line boundaries into pieces of about ``max_chars`` (a longer single line stays whole).

    With ``prefer``, a piece that has reached ``max_chars`` ends before the next line for which
    ``prefer(line)`` is true (for code: a top-level statement), or at 1.5 x ``max_chars`` at the latest.
    """
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        new_size = size + len(line)
        if piece and new_size > max_chars and (prefer is None or prefer(line) or new_size > 1.5 * max_chars):
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    if piece:
        yield "".join(piece)


def _is_top_level_statement(line: str) -> bool:
    """True for a line of Python source that starts a statement at column 0 (not a comment or a bracket)."""
    return line[:1] not in ("", " ", "\t", "\n", "\r", "#", ")", "]", "}")


def _load_jsonl(path: Path, name: str, text_field: str) -> list[Document]:
    docs = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"data: '{path}' line {lineno} is not valid JSON ({exc.msg}); write one JSON object per line"
                ) from exc
            if not isinstance(obj, dict) or text_field not in obj:
                raise DataError(
                    f"data: '{path}' line {lineno} has no field '{text_field}'; set text_field to the field "
                    "that holds the text"
                )
            text = obj[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"data: '{path}' line {lineno} field '{text_field}' is {type(text).__name__}, not a string; "
                    "set text_field to a text field"
                )
            source = obj.get("source")
            if text.strip():
                docs.append(
                    Document(
                        text=text,
                        source=source if isinstance(source, str) else name,
                        doc_id=f"{name}:{lineno}",
                    )
                )
    return docs


def _load_parquet(path: Path, name: str, text_field: str) -> list[Document]:
    import pyarrow.parquet as pq

    try:
        schema_names = pq.read_schema(path).names
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for a file that is not parquet
        raise DataError(
            f"data: '{path}' is not a readable Parquet file ({_one_line(exc)}); check the file"
        ) from exc
    if text_field not in schema_names:
        raise DataError(
            f"data: '{path}' has no column '{text_field}' (columns: {', '.join(schema_names[:10])}); set text_field "
            "to the column that holds the text"
        )
    columns = [text_field] + (["source"] if "source" in schema_names and text_field != "source" else [])
    table = pq.read_table(path, columns=columns)
    texts = table.column(text_field).to_pylist()
    sources = table.column("source").to_pylist() if "source" in columns else [None] * len(texts)
    docs = []
    for row, (text, source) in enumerate(zip(texts, sources, strict=True)):
        if text is None:
            continue
        if not isinstance(text, str):
            raise DataError(
                f"data: '{path}' column '{text_field}' holds {type(text).__name__}, not strings; set text_field "
                "to a text column"
            )
        if text.strip():
            docs.append(
                Document(
                    text=text, source=source if isinstance(source, str) else name, doc_id=f"{name}:{row}"
                )
            )
    return docs


def _load_hf(
    name: str, config: str | None, text_field: str, spec: str, not_a_path: bool = False
) -> list[Document]:
    """The ``train`` split of a Hugging Face dataset, failing fast (no 20 s of retries) when offline."""
    head = (
        f"data: '{spec}' is not an existing path and cannot be loaded as a Hugging Face dataset"
        if not_a_path
        else f"data: cannot load Hugging Face dataset '{name}'"
    )
    fix = "pass a local .txt/.jsonl/.parquet path or --data stdlib"
    reason = _hub_unreachable_reason()
    if reason is not None:
        raise DataError(f"{head} (offline or not found: {reason}); {fix}")
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split="train")
    except Exception as exc:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError...)
        raise DataError(f"{head} (offline or not found: {_one_line(exc)}); {fix}") from exc
    if text_field not in ds.column_names:
        raise DataError(
            f"data: Hugging Face dataset '{name}' has no column '{text_field}' (columns: "
            f"{', '.join(ds.column_names[:10])}); set text_field to the column that holds the text"
        )
    docs = []
    for row, text in enumerate(ds[text_field]):
        if isinstance(text, str) and text.strip():
            docs.append(Document(text=text, source=name, doc_id=f"{name}:{row}"))
    return docs


def _hub_unreachable_reason(timeout_s: float = 3.0) -> str | None:
    """Why the Hub cannot be reached, or None when it can (or when we cannot tell: offline mode, a proxy).

    ``datasets`` retries a failed HEAD request five times with backoff (about 23 s); a TCP probe with a
    short timeout turns "no network" into an immediate, clear error instead.
    """
    env = os.environ
    if env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return None  # datasets will use its local cache; let it report a miss itself
    if any(
        env.get(k)
        for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    ):
        return None  # a direct probe says nothing about the proxy's reachability
    endpoint = env.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"cannot reach {host}:{port}: {_one_line(exc)}"


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one short line for an error message."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------------------
# Split and fingerprint


def _doc_hash_unit(doc_id: str) -> float:
    """A deterministic number in [0, 1) from sha256(doc_id): the same in every process and on every machine."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_documents(
    docs: list[Document], val_fraction: float = 0.05
) -> tuple[list[Document], list[Document]]:
    """Hold out validation documents, chosen by a sha256 of each ``doc_id``.

    A document goes to validation when ``sha256(doc_id)`` maps below ``val_fraction``, so the split does not
    depend on the order of ``docs`` nor on which other documents exist. With two or more documents each side
    gets at least one (the lowest-hash document is moved to validation, or the highest to training).

    Args:
        docs: the corpus; ``doc_id`` values should be unique.
        val_fraction: expected fraction of documents held out, in (0, 1).

    Returns:
        ``(train_docs, val_docs)``, disjoint, each in the input order. With one document: ``([doc], [])``.

    Raises:
        DataError: ``val_fraction`` is not in (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction: {val_fraction} is not between 0 and 1 (exclusive); use e.g. 0.05")
    units = [_doc_hash_unit(d.doc_id) for d in docs]
    is_val = [u < val_fraction for u in units]
    if len(docs) == 1:
        is_val = [False]  # one document cannot be split; it trains
    elif docs:
        if not any(is_val):
            is_val[min(range(len(docs)), key=units.__getitem__)] = True
        elif all(is_val):
            is_val[max(range(len(docs)), key=units.__getitem__)] = False
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    return train, val


def corpus_fingerprint(docs: list[Document]) -> str:
    """sha256 hex digest of every document's id and text, in order (about 30 ms for the 11 MB stdlib)."""
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
# Tokenizer


def _tokenizer_key(fingerprint: str, vocab_size: int) -> str:
    return hashlib.sha256(f"{TOKENIZER_FORMAT}|{fingerprint}|{vocab_size}".encode()).hexdigest()[:24]


def load_or_train_tokenizer(
    train_docs: list[Document], vocab_size: int, cache_dir: Path, fingerprint: str
) -> tuple[tokenizers.Tokenizer, bool]:
    """Load the cached byte-level BPE tokenizer for this corpus and size, or train and cache it.

    The tokenizer: ByteLevel pre-tokenizer (GPT-2 regex, no prefix space) and decoder, BPE trained with
    ``BpeTrainer`` over the document texts, all 256 bytes in the initial alphabet (so any text encodes, no
    unknown token), ``<|endoftext|>`` at id 0. Training the stdlib at 4096 tokens takes a few seconds.

    Args:
        train_docs: the documents to train on (training split only, so validation stays unseen).
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
    if not train_docs:
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
    tok.train_from_iterator((d.text for d in train_docs), trainer=trainer, length=len(train_docs))
    log.info(
        "trained a %d-token BPE on %d documents in %.1f s",
        tok.get_vocab_size(),
        len(train_docs),
        time.perf_counter() - t0,
    )
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
            raise DataError(
                f"data: corpus too small for {num_islands} islands: island {island} gets {len(shard)} training "
                f"tokens (need >= {MIN_ISLAND_TOKENS}); use a larger corpus or fewer islands"
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


# --------------------------------------------------------------------------------------------------------------
# Batches


def sample_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, island: int, step: int
) -> torch.Tensor:
    """Random windows of an island's shard, a pure function of ``(seed, island, step)``.

    Window starts are drawn uniformly from ``[0, len(tokens) - seq_len - 1]`` by
    ``np.random.default_rng([seed, island, step])``: no iterator state, so a resumed run draws the same
    batches, and each island draws independently of the others.

    Args:
        tokens: 1-D shard of token ids (any integer dtype).
        batch_size: windows per batch, >= 1.
        seq_len: model context in tokens, >= 1; each window holds ``seq_len + 1`` tokens (inputs
            ``[:, :-1]``, targets ``[:, 1:]``).
        seed, island, step: non-negative integers.

    Returns:
        ``torch.int64`` tensor of shape ``(batch_size, seq_len + 1)`` on the CPU.

    Raises:
        DataError: the shard is shorter than ``seq_len + 1``, or an argument is out of range.
    """
    if batch_size < 1 or seq_len < 1:
        raise DataError(f"batch_size/seq_len: got {batch_size}/{seq_len}; both must be >= 1")
    if min(seed, island, step) < 0:
        raise DataError(f"seed: seed, island and step must be >= 0 (got {seed}, {island}, {step})")
    window = seq_len + 1
    if len(tokens) < window:
        raise DataError(
            f"seq_len: island {island}'s shard has {len(tokens)} tokens, fewer than seq_len + 1 = {window}; "
            "lower seq_len or use a larger corpus / fewer islands"
        )
    rng = np.random.default_rng([seed, island, step])
    starts = rng.integers(0, len(tokens) - window, size=batch_size, endpoint=True)
    idx = starts[:, None] + np.arange(window)
    return torch.from_numpy(tokens[idx].astype(np.int64))


def eval_batches(
    val_tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int
) -> list[torch.Tensor]:
    """Non-overlapping windows spread evenly over the whole validation split, grouped into batches.

    The split holds ``M = len(val_tokens) // (seq_len + 1)`` whole windows; ``n = min(M, batch_size *
    max_batches)`` of them are used, window ``j`` of ``n`` being whole window ``floor(j * M / n)``, so a
    small evaluation still samples every part of the split rather than its first documents. Batches hold
    ``batch_size`` windows; a last partial batch is dropped unless it is the only one (then it has fewer
    rows).

    Args:
        val_tokens: 1-D validation token ids.
        batch_size: windows per batch, >= 1.
        seq_len: model context; windows hold ``seq_len + 1`` tokens.
        max_batches: at most this many batches, >= 1.

    Returns:
        A list of 1 to ``max_batches`` ``torch.int64`` tensors of shape ``(batch_size, seq_len + 1)`` (or
        ``(n, seq_len + 1)`` with ``n < batch_size`` for a lone partial batch).

    Raises:
        DataError: fewer than ``seq_len + 1`` validation tokens, or an argument is < 1.
    """
    if batch_size < 1 or seq_len < 1 or max_batches < 1:
        raise DataError(
            f"batch_size/seq_len/eval_batches: got {batch_size}/{seq_len}/{max_batches}; all must be >= 1"
        )
    window = seq_len + 1
    n_windows = len(val_tokens) // window
    if n_windows == 0:
        raise DataError(
            f"seq_len: the validation split has {len(val_tokens)} tokens, fewer than seq_len + 1 = {window}; "
            "lower seq_len or use a larger corpus"
        )
    total_windows = n_windows
    n_windows = min(n_windows, batch_size * max_batches)
    chosen = (np.arange(n_windows) * total_windows) // n_windows
    all_windows = val_tokens[: total_windows * window].astype(np.int64).reshape(total_windows, window)
    windows = torch.from_numpy(np.ascontiguousarray(all_windows[chosen]))
    if n_windows < batch_size:
        return [windows]
    return list(windows[: (n_windows // batch_size) * batch_size].split(batch_size))


def default_cache_dir() -> Path:
    """``$ATOLL_CACHE_DIR`` if set and non-empty, else ``~/.cache/atoll`` (not created here)."""
    env = os.environ.get("ATOLL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "atoll"
