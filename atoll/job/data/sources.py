"""Corpus sources: read documents and hold out a validation split.

The default corpus needs no download: the running interpreter's standard library source (without its tests)
plus the ``pydoc_data`` topics, about 11 MB of text. Users can point at their own ``.txt`` / ``.jsonl`` /
``.parquet`` files (or a directory of them), or at a Hugging Face dataset when online.

1. ``load_documents``: read the corpus into ``Document`` s (text, source, doc_id).
2. ``split_documents`` (``atoll.job.data.split``): hold out validation documents by a sha256 of their
   ``doc_id``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from atoll.errors import DataError

# A .txt file that is one huge document is cut into pieces of about this many characters.
TXT_CHUNK_CHARS = 20_000
# Standard library modules longer than this are cut into pieces (before a top-level statement if possible).
STDLIB_CHUNK_CHARS = 16_000
SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")

_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"})
# pydoc_data/topics.py holds the same text as the pydoc topics, which are added one document per topic.
_STDLIB_SKIP_FILES = frozenset({"pydoc_data/topics.py"})
_HF_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# One or more blank lines (blank = only spaces or tabs) separate documents in a .txt file.
_TXT_DOC_SEP_RE = re.compile(r"\n(?:[ \t]*\n)+")


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


# --------------------------------------------------------------------------------------------------------------
# Loading documents


def load_documents(spec: str, text_field: str = "text") -> list[Document]:
    """Read a corpus into documents.

    Args:
        spec: where the text is:
            ``"stdlib"``: the running interpreter's standard library ``*.py`` files (tests excluded; a
            module longer than 16,000 characters is cut into pieces, preferably before a top-level
            statement) plus one document per ``pydoc_data.topics`` entry, about 11 MB, ~1,100 documents;
            an existing path: a ``.txt`` file (documents separated by one or more blank lines; a document
            longer than 20,000 characters is cut at line boundaries into ~20,000-character pieces),
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


#: the share of a text file's bytes that may be invalid UTF-8 (read as U+FFFD) before it is refused as not text
MAX_INVALID_UTF8 = 0.001


def read_utf8(path: Path) -> str:
    """A text file's content as UTF-8; a few invalid bytes (a scraped corpus) read as U+FFFD.

    Raises:
        DataError: more than :data:`MAX_INVALID_UTF8` of the bytes are not UTF-8 (Latin-1 text, a binary
            file), naming the first bad byte and the fix.
    """
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
        if bad > MAX_INVALID_UTF8 * max(1, len(raw)):
            raise DataError(f"data: '{path}' is not UTF-8 text ({bad:,} invalid bytes, the first "
                            f"0x{raw[exc.start]:02x} at byte {exc.start:,}); convert it "
                            "(e.g. iconv -f latin1 -t utf-8) or pass another file") from None
        return text


def _load_txt(path: Path, name: str) -> list[Document]:
    text = read_utf8(path)
    pieces = [p.strip("\n") for p in _TXT_DOC_SEP_RE.split(text)]
    pieces = [c for p in pieces if p.strip() for c in (_chunk_lines(p, TXT_CHUNK_CHARS) if len(p) > TXT_CHUNK_CHARS
                                                       else (p,)) if c.strip()]
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
                    f"data: '{path}' line {lineno} has no field '{text_field}'; set --text-field to the field "
                    "that holds the text"
                )
            text = obj[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"data: '{path}' line {lineno} field '{text_field}' is {type(text).__name__}, not a string; "
                    "set --text-field to a text field"
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
            f"data: '{path}' has no column '{text_field}' (columns: {', '.join(schema_names[:10])}); set --text-field "
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
                f"data: '{path}' column '{text_field}' holds {type(text).__name__}, not strings; set --text-field "
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
            f"{', '.join(ds.column_names[:10])}); set --text-field to the column that holds the text"
        )
    docs = []
    for row, text in enumerate(ds[text_field]):
        if isinstance(text, str) and text.strip():
            docs.append(Document(text=text, source=name, doc_id=f"{name}:{row}"))
    return docs


def is_hub_id(name: str) -> bool:
    """True for ``owner/name`` that is not an existing path: a Hugging Face Hub repository id."""
    return bool(_HF_REPO_RE.match(name)) and not Path(name).expanduser().exists()


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
