"""Large corpora: read and tokenize a folder of shards, or a Hugging Face dataset, one shard at a time.

The in-memory path (:func:`atoll.job.data.shards.prepare_data` on a file) holds every document's text at
once. Here a corpus is a list of shard files (``.txt`` / ``.jsonl`` / ``.parquet``, sorted by relative path,
as :func:`atoll.job.data.sources.load_documents` reads a folder), and

1. every shard file is hashed (sha256 of its bytes); the corpus fingerprint hashes the names and hashes;
2. atoll's BPE, when no pretrained tokenizer is given, trains on a stream of the training documents' texts
   (read shard by shard), and is cached under the fingerprint;
3. each shard is tokenized on its own and cached as one ``stream-<key>.npz`` (token ids, offsets, each
   document's split number and source; numeric and fixed-width text arrays, never pickles), keyed by the
   shard's name and bytes and the tokenizer (with a pretrained tokenizer, a shard added to the folder costs only its
   own tokenization; atoll's BPE is retrained on the new corpus, so every shard is tokenized again);
4. the documents are split and dealt to islands exactly as in memory (:func:`atoll.job.data.shards.assemble`):
   the same tokenizer and the same documents give the same island shards and validation tokens.

Only one shard's text and tokens are in memory at a time; the island shards themselves are (2 bytes per
token with a vocabulary up to 65,535). ``hf:NAME`` is streamed (``datasets``' ``streaming=True``) into
parquet shard files of ``HF_SHARD_DOCS`` documents in the cache once, then read as a folder: later runs need
no network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from atoll.errors import DataError
from atoll.job.data.shards import (
    TOKENS_FORMAT,
    PreparedData,
    _check_islands,
    _encode_documents,
    _token_dtype,
    assemble,
    resolve_tokenizer,
    tokenizer_hash,
    with_tokenizer,
)
from atoll.job.data.sources import (
    SUPPORTED_SUFFIXES,
    Document,
    _hub_unreachable_reason,
    _load_file,
    _one_line,
    is_hub_id,
)
from atoll.job.data.split import doc_unit, val_mask
from atoll.job.data.tokenizer import _atomic_write, _ensure_dir

log = logging.getLogger(__name__)

# Bump when the streamed shard cache or the fingerprint recipe changes.
STREAM_FORMAT = "atoll-stream-v1"
# Documents per parquet shard written from a streamed Hugging Face dataset (about 40 MB of web text).
HF_SHARD_DOCS = 10_000
_READ_BYTES = 1 << 20


def shard_files(folder: Path) -> list[tuple[Path, str]]:
    """The shard files of a folder: every .txt/.jsonl/.parquet below it, with its relative name, sorted.

    Raises:
        DataError: the folder holds none.
    """
    files = sorted(((p, p.relative_to(folder).as_posix()) for p in folder.rglob("*")
                    if p.is_file() and p.suffix in SUPPORTED_SUFFIXES), key=lambda f: f[1])
    if not files:
        raise DataError(f"data: directory '{folder}' has no .txt/.jsonl/.parquet files; add some or pass another path")
    return files


def file_digest(path: Path) -> str:
    """sha256 hex digest of a file's bytes, read 1 MiB at a time."""
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while block := f.read(_READ_BYTES):
                h.update(block)
    except OSError as exc:
        raise DataError(f"data: cannot read '{path}' ({_one_line(exc)}); check the file and its permissions") from exc
    return h.hexdigest()


def iter_shards(files: list[tuple[Path, str]], text_field: str) -> Iterator[list[Document]]:
    """Each shard file's documents in turn: a generator, so one shard is read only when the previous is done."""
    for path, name in files:
        yield _load_file(path, name, text_field)


def _load_shard(path: Path) -> dict[str, np.ndarray] | None:
    """A cached shard's arrays, or None when missing or unreadable."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("tokens", "offsets", "units", "source_index", "sources")}
        if int(arrays["offsets"][-1]) == len(arrays["tokens"]) and len(arrays["units"]) == len(arrays["offsets"]) - 1:
            return arrays
    except (OSError, ValueError, KeyError) as exc:
        log.warning("ignoring unreadable shard cache %s: %s", path, _one_line(exc))
    return None


def _tokenize_shard(docs: list[Document], tok: Any, dtype: type) -> dict[str, np.ndarray]:
    """One shard's cache arrays: token ids, offsets (int64), split numbers (float64), sources (index, names)."""
    tokens, offsets = _encode_documents(tok, [d.text for d in docs], dtype)
    names = sorted({d.source for d in docs})
    index = {s: i for i, s in enumerate(names)}
    return {"tokens": tokens, "offsets": offsets,
            "units": np.array([doc_unit(d.doc_id) for d in docs], dtype=np.float64),
            "source_index": np.array([index[d.source] for d in docs], dtype=np.int32),
            "sources": np.array(names, dtype=str) if names else np.zeros(0, dtype="<U1")}


def prepare_streamed(spec: str, num_islands: int, vocab_size: int, seed: int, cache_dir: Path, partition: str,
                     val_fraction: float, text_field: str, pretrained: Any = None,
                     max_documents: int | None = None) -> PreparedData:
    """:func:`atoll.job.data.shards.prepare_data` for a folder of shards or a Hugging Face dataset, one shard
    in memory at a time (see the module docstring); arguments as there.

    Raises:
        DataError: as ``prepare_data``; the dataset cannot be streamed (offline, no column ``text_field``).
    """
    _ensure_dir(cache_dir)
    if _is_hf(spec):  # the dataset's text column was written to the shards' "text" column
        folder, text_field = hf_shards(spec, text_field, cache_dir, max_documents), "text"
    else:
        folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise DataError(f"data: '{spec}' is not a folder; pass a folder of .txt/.jsonl/.parquet shards or hf:NAME")
    files = shard_files(folder)
    t0 = time.perf_counter()
    digests = [file_digest(p) for p, _ in files]
    h = hashlib.sha256(f"{STREAM_FORMAT}|{text_field}".encode())
    for (_, name), digest in zip(files, digests, strict=True):
        h.update(f"|{name}|{digest}".encode())
    fingerprint = h.hexdigest()

    def train_texts() -> Iterator[str]:  # the training documents' texts, shard by shard
        for docs in iter_shards(files, text_field):
            units = np.array([doc_unit(d.doc_id) for d in docs], dtype=np.float64)
            yield from (d.text for d, u in zip(docs, units, strict=True) if u >= val_fraction)

    tok, eos_id, tok_cached = resolve_tokenizer(pretrained, train_texts, vocab_size, cache_dir,
                                                lambda: f"{fingerprint}|val={val_fraction}")
    tok_hash, dtype = tokenizer_hash(tok), _token_dtype(tok.get_vocab_size())
    paths, cached = [], 0
    meta: list[dict[str, np.ndarray]] = []  # per shard: lengths, units, sources (the tokens stay on disk)
    for (path, name), digest in zip(files, digests, strict=True):
        # The name is part of the key: documents' ids, hence their split, derive from it.
        key = hashlib.sha256(f"{TOKENS_FORMAT}|{STREAM_FORMAT}|{text_field}|{name}|{digest}|{tok_hash}".encode())
        cache = cache_dir / f"stream-{key.hexdigest()[:24]}.npz"
        arrays = _load_shard(cache)
        if arrays is None or arrays["tokens"].dtype != dtype:
            arrays = _tokenize_shard(_load_file(path, name, text_field), tok, dtype)
            _atomic_write(cache, lambda f, a=arrays: np.savez(f, **a))
        else:
            cached += 1
        paths.append(cache)
        meta.append({"lengths": np.diff(arrays["offsets"]), "units": arrays["units"],
                     "sources": arrays["sources"][arrays["source_index"]]})
        del arrays
    log.info("prepared %d shards (%d from the cache) in %.1f s", len(files), cached, time.perf_counter() - t0)
    lengths = np.concatenate([m["lengths"] for m in meta]).astype(np.int64)
    if len(lengths) < 2:
        raise DataError(f"data: '{spec}' holds {len(lengths)} document(s); at least 2 are needed for a validation "
                        "split (separate documents in a .txt file by a blank line)")
    is_val = val_mask(np.concatenate([m["units"] for m in meta]), val_fraction)
    sources = [str(s) for m in meta for s in m["sources"]]

    def parts() -> Iterator[tuple[np.ndarray, np.ndarray]]:  # one shard's tokens in memory at a time
        for cache in paths:
            with np.load(cache, allow_pickle=False) as z:
                yield z["tokens"], z["offsets"]

    island_tokens, val_tokens, island_sources = assemble(parts, lengths, is_val, sources, num_islands, partition,
                                                         seed, eos_id)
    _check_islands(island_tokens, len(val_tokens), spec)
    return PreparedData(
        tokenizer=tok, vocab_size=tok.get_vocab_size(), eos_id=eos_id, island_tokens=island_tokens,
        val_tokens=val_tokens, tokenizer_from_cache=tok_cached, num_documents=len(lengths),
        num_train_tokens=sum(len(s) for s in island_tokens), num_val_tokens=len(val_tokens),
        num_val_documents=int(is_val.sum()), tokens_from_cache=cached == len(files),
        fingerprint=with_tokenizer(fingerprint, pretrained, tok), island_sources=island_sources,
        pretrained=pretrained, streamed=True,
    )


def _is_hf(spec: str) -> bool:
    return spec.startswith("hf:") or is_hub_id(spec)


def hf_shards(spec: str, text_field: str, cache_dir: Path, max_documents: int | None = None,
              shard_docs: int | None = None) -> Path:
    """A Hugging Face dataset's ``train`` split as a folder of parquet shards in the cache (written once).

    The split is read with ``datasets.load_dataset(..., streaming=True)``: ``shard_docs`` (default
    ``HF_SHARD_DOCS``) documents are held
    at a time, written as ``shard-NNNNN.parquet`` (columns ``text`` and ``source``, the dataset name), and the
    folder appears (renamed whole) once the stream ends or ``max_documents`` documents were read. A later call
    finds it and touches no network.

    Args:
        spec: ``hf:NAME``, ``hf:NAME:CONFIG`` or ``owner/name``.

    Returns:
        The folder ``<cache_dir>/hf-<key>``.

    Raises:
        DataError: the Hub cannot be reached, the dataset cannot be streamed, has no column ``text_field``,
            or holds no text.
    """
    shard_docs = shard_docs or HF_SHARD_DOCS
    name, _, config = spec.removeprefix("hf:").partition(":")
    if not name:
        raise DataError(f"data: '{spec}' names no dataset; use hf:NAME or hf:NAME:CONFIG")
    key = hashlib.sha256(f"{STREAM_FORMAT}|{name}|{config}|train|{text_field}|{max_documents}|{shard_docs}".encode())
    folder = cache_dir / f"hf-{key.hexdigest()[:24]}"
    if (folder / "complete.json").is_file():
        return folder
    head, fix = f"data: cannot stream Hugging Face dataset '{name}'", "pass a local folder of shards or --data stdlib"
    reason = _hub_unreachable_reason()
    if reason is not None:
        raise DataError(f"{head} (offline or not found: {reason}); {fix}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = cache_dir / f".hf-{key.hexdigest()[:24]}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    texts: list[str] = []
    shards = docs = 0

    def flush() -> None:
        nonlocal shards
        table = pa.table({"text": texts, "source": [name] * len(texts)})
        pq.write_table(table, tmp / f"shard-{shards:05d}.parquet")
        shards += 1
        texts.clear()

    try:
        import datasets

        rows = iter(datasets.load_dataset(name, config or None, split="train", streaming=True))
        while max_documents is None or docs < max_documents:
            try:
                row = next(rows)
            except StopIteration:
                break
            if text_field not in row:
                raise DataError(f"data: Hugging Face dataset '{name}' has no column '{text_field}' (columns: "
                                f"{', '.join(list(row)[:10])}); set text_field to the column that holds the text")
            text = row[text_field]
            if isinstance(text, str) and text.strip():
                texts.append(text)
                docs += 1
                if len(texts) == shard_docs:
                    flush()
        if texts:
            flush()
    except DataError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError...)
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"{head} (offline or not found: {_one_line(exc)}); {fix}") from exc
    if docs == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"data: '{spec}' contains no non-empty documents; pass a dataset with some text")
    (tmp / "complete.json").write_text(json.dumps({"dataset": name, "config": config, "split": "train",
                                                   "documents": docs, "shards": shards}))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished the same folder first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("streamed %d documents of %s into %d shards", docs, name, shards)
    return folder
