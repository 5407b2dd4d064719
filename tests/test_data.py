"""Tests for atoll.job.data: loaders, split, tokenizer cache, shards, batches. CPU only, small corpora, fast."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import atoll.job.data as data_mod
import atoll.job.data.sources as sources_mod
from atoll.errors import DataError
from atoll.job.data import (
    Document,
    corpus_fingerprint,
    default_cache_dir,
    eval_batches,
    load_documents,
    load_or_train_tokenizer,
    prepare_data,
    sample_batch,
    split_documents,
)

WORDS = (
    "the",
    "island",
    "model",
    "trains",
    "tokens",
    "while",
    "slow",
    "links",
    "carry",
    "a",
    "small",
    "pseudo",
    "gradient",
    "between",
    "regions",
    "and",
    "every",
    "outer",
    "step",
    "averages",
    "the",
    "replicas",
    "of",
    "def",
    "class",
    "return",
    "import",
    "lambda",
    "yield",
    "async",
    "await",
)


def make_texts(n: int, seed: int = 0, min_words: int = 60, max_words: int = 120) -> list[str]:
    """n distinct pseudo-English documents; document i contains the marker ``doc{i}``."""
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(min_words, max_words)))
        texts.append(f"doc{i} " + " ".join(words) + ".")
    return texts


def make_docs(n: int, num_sources: int = 1, seed: int = 0) -> list[Document]:
    return [
        Document(text=t, source=f"src{i % num_sources}", doc_id=f"corpus.jsonl:{i + 1}")
        for i, t in enumerate(make_texts(n, seed))
    ]


def write_jsonl(path: Path, texts: list[str], sources: list[str] | None = None, field: str = "text") -> Path:
    with path.open("w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            obj = {field: text}
            if sources is not None:
                obj["source"] = sources[i]
            f.write(json.dumps(obj) + "\n")
    return path


def split_at_eos(shard: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """A shard back into its documents (every document ends with eos)."""
    assert len(shard) > 0 and shard[-1] == eos_id
    ends = np.flatnonzero(shard == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [shard[s:e] for s, e in zip(starts, ends, strict=True)]


# ----------------------------------------------------------------------------------------------------------
# Loaders


def test_missing_path_raises_one_line_data_error(tmp_path: Path) -> None:
    for spec in (str(tmp_path / "nope.txt"), str(tmp_path / "missing_dir") + "/", "nope.jsonl", "./a/b"):
        with pytest.raises(DataError) as info:
            load_documents(spec)
        msg = str(info.value)
        assert msg.startswith("data:") and "does not exist" in msg and "\n" not in msg


def test_unknown_source_and_unsupported_extension(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data: unknown data source"):
        load_documents("not-a-corpus")
    csv = tmp_path / "corpus.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_documents(str(csv))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    with pytest.raises(DataError, match="no non-empty documents"):
        load_documents(str(empty))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match="no .txt/.jsonl/.parquet files"):
        load_documents(str(tmp_path / "emptydir"))


def test_txt_documents_split_by_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text(
        "first doc line 1\nstill first\n\nsecond doc\n \n\t\n\n\nthird doc\n", encoding="utf-8"
    )
    docs = load_documents(str(path))
    assert [d.text for d in docs] == ["first doc line 1\nstill first", "second doc", "third doc"]
    assert [d.doc_id for d in docs] == ["book.txt#0", "book.txt#1", "book.txt#2"]
    assert {d.source for d in docs} == {"book.txt"}


def test_txt_with_one_blank_line_between_paragraphs_trains(tmp_path: Path) -> None:
    """A normal prose file (one blank line between paragraphs) is many documents, about 5% held out."""
    path = tmp_path / "essay.txt"
    path.write_text("\n\n".join(make_texts(300, seed=3)) + "\n", encoding="utf-8")
    data = prepare_data(str(path), 1, 300, seed=0, cache_dir=tmp_path)
    assert data.num_documents == 300 and 5 <= data.num_val_documents <= 30
    assert data.num_val_tokens < 0.12 * (data.num_train_tokens + data.num_val_tokens)


def test_txt_too_small_says_how_much_is_needed(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("\n\n".join(make_texts(4, seed=4)) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as one:
        prepare_data(str(path), 1, 300, seed=0, cache_dir=tmp_path)
    msg = str(one.value)
    assert msg.startswith("data: corpus too small for 1 island:") and "\n" not in msg
    assert "at least 2,048 training tokens" in msg and "fewer islands" not in msg and "validation tokens" in msg
    with pytest.raises(DataError, match=r"at least 8,192 training tokens, or fewer islands"):
        prepare_data(str(path), 4, 300, seed=0, cache_dir=tmp_path)
    single = tmp_path / "single.txt"
    single.write_text("one paragraph\nof two lines\n", encoding="utf-8")
    with pytest.raises(DataError, match="separate documents in a .txt file by a blank line"):
        prepare_data(str(single), 1, 300, seed=0, cache_dir=tmp_path)


def test_txt_single_long_document_is_cut_at_line_boundaries(tmp_path: Path) -> None:
    lines = [f"line {i} " + "x" * (i % 70) for i in range(3000)]
    text = "\n".join(lines)
    assert len(text) > 3 * data_mod.TXT_CHUNK_CHARS
    path = tmp_path / "one.txt"
    path.write_text(text, encoding="utf-8")
    docs = load_documents(str(path))
    assert len(docs) >= 3
    assert "".join(d.text for d in docs) == text
    for d in docs:
        assert len(d.text) <= data_mod.TXT_CHUNK_CHARS
        assert d.text.startswith("line ")  # every piece starts at a line start
    assert len({d.doc_id for d in docs}) == len(docs)


def test_jsonl_loading(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"text": "alpha", "source": "wiki"})
        + "\n\n"
        + json.dumps({"text": "beta"})
        + "\n"
        + json.dumps({"text": "   "})
        + "\n"
        + json.dumps({"content": "x", "text": "gamma", "source": 3})
        + "\n",
        encoding="utf-8",
    )
    docs = load_documents(str(path))
    assert docs == [
        Document("alpha", "wiki", "c.jsonl:1"),
        Document("beta", "c.jsonl", "c.jsonl:3"),
        Document("gamma", "c.jsonl", "c.jsonl:5"),
    ]


def test_jsonl_errors_name_the_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", ["a", "b"], field="body")
    with pytest.raises(DataError, match="line 1 has no field 'text'; set --text-field"):
        load_documents(str(path))
    assert [d.text for d in load_documents(str(path), text_field="body")] == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_documents(str(bad))


def test_parquet_loading(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"content": ["one", None, "two", ""], "id": [1, 2, 3, 4]}), path)
    docs = load_documents(str(path), text_field="content")
    assert docs == [Document("one", "c.parquet", "c.parquet:0"), Document("two", "c.parquet", "c.parquet:2")]
    with pytest.raises(DataError, match="no column 'text'"):
        load_documents(str(path))
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_documents(str(not_parquet))


def test_directory_loading_is_recursive_and_sorted(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("from a")
    (tmp_path / "b" / "c.txt").write_text("from c")
    write_jsonl(tmp_path / "b" / "d.jsonl", ["from d"])
    pq.write_table(pa.table({"text": ["from e"]}), tmp_path / "e.parquet")
    (tmp_path / "ignored.md").write_text("not loaded")
    docs = load_documents(str(tmp_path))
    assert [d.text for d in docs] == ["from a", "from c", "from d", "from e"]
    assert [d.source for d in docs] == ["a.txt", "b/c.txt", "b/d.jsonl", "e.parquet"]


def test_hf_offline_is_a_fast_one_line_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        sources_mod, "_hub_unreachable_reason", lambda: "cannot reach huggingface.co:443: test"
    )
    for spec in ("hf:roneneldan/TinyStories", "hf:wikitext:wikitext-2-raw-v1", "owner/name"):
        with pytest.raises(DataError) as info:
            load_documents(spec)
        msg = str(info.value)
        assert msg.startswith("data: ") and "offline or not found" in msg and "\n" not in msg
        assert "--data stdlib" in msg


def test_hf_load_failure_becomes_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None):  # noqa: ANN001, ANN202
        calls.append((name, config, split))
        raise ConnectionError("Couldn't reach 'x/y' on the Hub\n(LocalEntryNotFoundError)")

    monkeypatch.setattr(sources_mod, "_hub_unreachable_reason", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(
        DataError, match=r"^data: cannot load Hugging Face dataset 'x/y' .*Couldn't reach"
    ) as info:
        load_documents("hf:x/y:cfg")
    assert "\n" not in str(info.value)
    assert calls == [("x/y", "cfg", "train")]


@pytest.mark.timeout(15)
def test_stdlib_loader_excludes_tests() -> None:
    t0 = time.perf_counter()
    docs = load_documents("stdlib")
    assert time.perf_counter() - t0 < 15
    assert len(docs) > 1000
    ids = [d.doc_id for d in docs]
    assert len(set(ids)) == len(ids)
    for doc_id in ids:
        path = "/" + doc_id.split("#")[0]
        assert "/test/" not in path and "/tests/" not in path and "/idle_test/" not in path
        assert not path.rsplit("/", 1)[-1].startswith("test_")
        assert "site-packages" not in path
    sources = {d.source for d in docs}
    assert {"email", "json", "os", "pydoc_topics"} <= sources
    assert all(d.text.strip() for d in docs)
    assert 5e6 < sum(len(d.text) for d in docs) < 5e7
    assert docs == load_documents("stdlib")  # deterministic order


# ----------------------------------------------------------------------------------------------------------
# Split and fingerprint


def test_split_is_by_document_deterministic_and_disjoint() -> None:
    docs = make_docs(400)
    train, val = split_documents(docs, 0.1)
    train2, val2 = split_documents(list(reversed(docs)), 0.1)
    assert {d.doc_id for d in val} == {d.doc_id for d in val2}
    assert {d.doc_id for d in train} == {d.doc_id for d in train2}
    assert not {d.doc_id for d in train} & {d.doc_id for d in val}
    assert len(train) + len(val) == len(docs)
    assert 20 <= len(val) <= 65  # ~40 expected
    # Membership depends on the doc_id alone, not on the other documents.
    _, val_half = split_documents(docs[:200], 0.1)
    assert {d.doc_id for d in val_half} == {d.doc_id for d in val if d in docs[:200]}


def test_split_keeps_one_document_on_each_side() -> None:
    two = make_docs(2)
    for fraction in (0.001, 0.999):
        train, val = split_documents(two, fraction)
        assert len(train) == 1 and len(val) == 1
    assert split_documents(two[:1], 0.5) == (two[:1], [])
    with pytest.raises(DataError, match="val_fraction"):
        split_documents(two, 0.0)


def test_corpus_fingerprint() -> None:
    docs = make_docs(5)
    fp = corpus_fingerprint(docs)
    assert fp == corpus_fingerprint(list(docs)) and len(fp) == 64
    changed = docs[:4] + [Document(docs[4].text + "!", docs[4].source, docs[4].doc_id)]
    assert corpus_fingerprint(changed) != fp
    assert corpus_fingerprint([Document("ab", "s", "x"), Document("c", "s", "y")]) != corpus_fingerprint(
        [Document("a", "s", "x"), Document("bc", "s", "y")]
    )


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_is_cached_and_reused(tmp_path: Path) -> None:
    docs = make_docs(100)
    fp = corpus_fingerprint(docs)
    tok1, cached1 = load_or_train_tokenizer(docs, 300, tmp_path, fp)
    assert cached1 is False
    files = sorted(tmp_path.glob("tokenizer-*.json"))
    assert len(files) == 1
    tok2, cached2 = load_or_train_tokenizer(docs, 300, tmp_path, fp)
    assert cached2 is True
    samples = [d.text for d in docs[:10]] + ["ünïcödé ✓ 漢字 \t\n tabs", "<|endoftext|>"]
    assert [e.ids for e in tok1.encode_batch(samples)] == [e.ids for e in tok2.encode_batch(samples)]
    assert tok1.token_to_id("<|endoftext|>") == 0 and tok1.get_vocab_size() == 300
    # Byte-level: any text round-trips exactly, no unknown token.
    for text in samples[:-1]:
        assert tok2.decode(tok2.encode(text).ids) == text
    tok3, cached3 = load_or_train_tokenizer(docs, 320, tmp_path, fp)
    assert cached3 is False and tok3.get_vocab_size() == 320
    assert len(list(tmp_path.glob("tokenizer-*.json"))) == 2
    assert not list(tmp_path.glob(".*tmp"))  # atomic writes leave no temporary files


def test_tokenizer_cache_corrupt_file_is_retrained(tmp_path: Path) -> None:
    docs = make_docs(30)
    fp = corpus_fingerprint(docs)
    load_or_train_tokenizer(docs, 270, tmp_path, fp)
    (path,) = tmp_path.glob("tokenizer-*.json")
    path.write_text("{truncated")
    tok, cached = load_or_train_tokenizer(docs, 270, tmp_path, fp)
    assert cached is False and tok.get_vocab_size() == 270
    assert load_or_train_tokenizer(docs, 270, tmp_path, fp)[1] is True


def test_vocab_size_too_small(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="^vocab_size: 256 .*at least 257"):
        load_or_train_tokenizer(make_docs(3), 256, tmp_path, "x")


def test_stdlib_subset_tokenizer_round_trips(tmp_path: Path) -> None:
    docs = load_documents("stdlib")[::40]  # ~30 modules, a few hundred KB: trains in well under a second
    tok, _ = load_or_train_tokenizer(docs, 512, tmp_path, corpus_fingerprint(docs))
    for doc in docs[:5]:
        ids = tok.encode(doc.text).ids
        assert tok.decode(ids) == doc.text
        assert len(ids) < len(doc.text.encode("utf-8"))  # merges compress


# ----------------------------------------------------------------------------------------------------------
# prepare_data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[str]]:
    """A jsonl corpus of 240 documents from 8 sources (src0..src7), text i contains ``doc{i}``."""
    texts = make_texts(240, seed=1)
    sources = [f"src{i % 8}" for i in range(len(texts))]
    path = write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", texts, sources)
    return path, texts, sources


def test_prepare_iid_shards_are_balanced_and_disjoint(corpus, tmp_path: Path) -> None:  # noqa: ANN001
    path, texts, _ = corpus
    data = prepare_data(str(path), 4, 300, seed=0, cache_dir=tmp_path, val_fraction=0.1)
    assert data.vocab_size == 300 and data.eos_id == 0 and data.num_documents == len(texts)
    assert len(data.island_tokens) == 4
    assert all(s.dtype == np.uint16 and s.ndim == 1 for s in data.island_tokens)
    assert data.val_tokens.dtype == np.uint16
    lengths = [len(s) for s in data.island_tokens]
    assert data.num_train_tokens == sum(lengths) and data.num_val_tokens == len(data.val_tokens)
    assert min(lengths) >= 2048
    # Greedy to the least-loaded island: shards differ by less than the longest document.
    longest = max(len(d) + 1 for s in data.island_tokens for d in split_at_eos(s, data.eos_id))
    assert max(lengths) - min(lengths) <= longest
    # Decode every shard back into documents: disjoint, and with validation they are exactly the corpus.
    tok = data.tokenizer
    shard_texts = [{tok.decode(d.tolist()) for d in split_at_eos(s, data.eos_id)} for s in data.island_tokens]
    val_texts = {tok.decode(d.tolist()) for d in split_at_eos(data.val_tokens, data.eos_id)}
    assert len(val_texts) == data.num_val_documents >= 1
    all_sets = [*shard_texts, val_texts]
    assert sum(len(s) for s in all_sets) == len(texts)
    assert set().union(*all_sets) == set(texts)
    # Another seed deals the documents differently; the same seed identically.
    again = prepare_data(str(path), 4, 300, seed=0, cache_dir=tmp_path, val_fraction=0.1)
    assert all(np.array_equal(a, b) for a, b in zip(again.island_tokens, data.island_tokens, strict=True))
    other = prepare_data(str(path), 4, 300, seed=1, cache_dir=tmp_path, val_fraction=0.1)
    assert not np.array_equal(other.island_tokens[0], data.island_tokens[0])
    assert np.array_equal(other.val_tokens, data.val_tokens)


def test_prepare_second_run_uses_caches(corpus, tmp_path: Path) -> None:  # noqa: ANN001
    path, _, _ = corpus
    cold = prepare_data(str(path), 2, 300, seed=0, cache_dir=tmp_path)
    assert not cold.tokenizer_from_cache and not cold.tokens_from_cache
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 1 and len(list(tmp_path.glob("offsets-*.npy"))) == 1
    warm = prepare_data(str(path), 2, 300, seed=0, cache_dir=tmp_path)
    assert warm.tokenizer_from_cache and warm.tokens_from_cache
    assert warm.fingerprint == cold.fingerprint
    for a, b in zip(
        cold.island_tokens + [cold.val_tokens], warm.island_tokens + [warm.val_tokens], strict=True
    ):
        assert np.array_equal(a, b) and a.dtype == b.dtype


def test_prepare_non_iid_islands_see_disjoint_sources(corpus, tmp_path: Path) -> None:  # noqa: ANN001
    path, texts, sources = corpus
    data = prepare_data(str(path), 4, 300, seed=0, cache_dir=tmp_path, partition="non_iid")
    source_of = dict(zip(texts, sources, strict=True))
    seen = []
    for shard, declared in zip(data.island_tokens, data.island_sources, strict=True):
        island_sources = {
            source_of[data.tokenizer.decode(d.tolist())] for d in split_at_eos(shard, data.eos_id)
        }
        assert island_sources == set(declared)
        assert len(island_sources) == 2  # 8 equal-sized sources over 4 islands
        seen.append(island_sources)
    for i in range(4):
        for j in range(i + 1, 4):
            assert not seen[i] & seen[j]
    assert set().union(*seen) == set(sources)
    with pytest.raises(DataError, match="^partition: non_iid needs at least one source per island"):
        prepare_data(str(path), 9, 300, seed=0, cache_dir=tmp_path, partition="non_iid")


def test_prepare_rejects_a_corpus_too_small_for_the_islands(corpus, tmp_path: Path) -> None:  # noqa: ANN001
    path, _, _ = corpus
    with pytest.raises(DataError, match="^data: corpus too small for 40 islands"):
        prepare_data(str(path), 40, 300, seed=0, cache_dir=tmp_path)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("\n\n\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(40)))
    with pytest.raises(DataError, match=r"^data: corpus too small for 1 island: .*; use a corpus of at least 2,048 "
                                        r"training tokens \(docs/usage.md, Data\)$"):
        prepare_data(str(tiny), 1, 300, seed=0, cache_dir=tmp_path)
    with pytest.raises(DataError, match="^partition: unknown value"):
        prepare_data(str(path), 2, 300, seed=0, cache_dir=tmp_path, partition="random")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------
# Batches


def test_sample_batch_is_a_function_of_seed_island_step() -> None:
    shard = (np.arange(5000) % 65000).astype(np.uint16)
    b = sample_batch(shard, 8, 32, seed=3, island=1, step=7)
    assert b.shape == (8, 33) and b.dtype == torch.int64
    assert torch.equal(b, sample_batch(shard, 8, 32, seed=3, island=1, step=7))
    assert not torch.equal(b, sample_batch(shard, 8, 32, seed=3, island=1, step=8))
    assert not torch.equal(b, sample_batch(shard, 8, 32, seed=3, island=2, step=7))
    assert not torch.equal(b, sample_batch(shard, 8, 32, seed=4, island=1, step=7))
    # Each row is a contiguous window of the shard.
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(8, 32, dtype=torch.int64))
    # A shard of exactly seq_len + 1 tokens has one possible window.
    assert torch.equal(
        sample_batch(shard[:33], 2, 32, 0, 0, 0), torch.from_numpy(shard[:33].astype(np.int64)).repeat(2, 1)
    )
    with pytest.raises(DataError, match="fewer than seq_len"):
        sample_batch(shard[:32], 2, 32, 0, 0, 0)


def test_eval_batches_shapes() -> None:
    val = np.arange(1000, dtype=np.uint16)
    batches = eval_batches(val, batch_size=4, seq_len=9, max_batches=3)
    assert len(batches) == 3 and all(b.shape == (4, 10) and b.dtype == torch.int64 for b in batches)
    # 12 of the 100 whole windows, spread evenly: window j is whole window floor(j * 100 / 12)
    starts = torch.cat(batches)[:, 0]
    assert starts.tolist() == [(j * 100 // 12) * 10 for j in range(12)]
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 10)) for row in torch.cat(batches))
    all_full = eval_batches(val, batch_size=4, seq_len=9, max_batches=1000)
    assert len(all_full) == 25  # 100 windows
    assert len(eval_batches(val, batch_size=30, seq_len=9, max_batches=10)) == 3  # 100 // 30, partial dropped
    lone = eval_batches(val[:35], batch_size=4, seq_len=9, max_batches=2)
    assert len(lone) == 1 and lone[0].shape == (3, 10)  # a lone partial batch is kept
    assert all(torch.equal(a, b) for a, b in zip(batches, eval_batches(val, 4, 9, 3), strict=True))
    with pytest.raises(DataError, match="^seq_len: the validation split has 9 tokens"):
        eval_batches(val[:9], batch_size=4, seq_len=9, max_batches=1)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ATOLL_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ATOLL_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "atoll"


# ----------------------------------------------------------------------------------------------------------
# Streaming: a folder of shards, a Hugging Face dataset


def write_shards(folder: Path) -> None:
    """Five shards of three kinds, 200 documents in all (sources as file names or a jsonl field)."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = make_texts(200, seed=5)
    write_jsonl(folder / "a.jsonl", texts[:50], [f"web{i % 3}" for i in range(50)])
    (folder / "b").mkdir()
    write_jsonl(folder / "b" / "c.jsonl", texts[50:90])
    pq.write_table(pa.table({"text": texts[90:150]}), folder / "d.parquet")
    (folder / "e.txt").write_text("\n\n".join(texts[150:180]) + "\n", encoding="utf-8")
    write_jsonl(folder / "f.jsonl", texts[180:])


@pytest.mark.parametrize("partition", ["iid", "non_iid"])
def test_streamed_folder_gives_the_in_memory_tokens(tmp_path: Path, partition: str) -> None:
    write_shards(tmp_path / "shards")
    spec = str(tmp_path / "shards")
    mem = prepare_data(spec, 3, 300, seed=2, cache_dir=tmp_path / "mem", partition=partition, stream=False)
    streamed = prepare_data(spec, 3, 300, seed=2, cache_dir=tmp_path / "st", partition=partition)
    assert streamed.streamed and not mem.streamed
    assert streamed.tokenizer.to_str() == mem.tokenizer.to_str() and streamed.vocab_size == mem.vocab_size == 300
    for a, b in zip(mem.island_tokens + [mem.val_tokens], streamed.island_tokens + [streamed.val_tokens], strict=True):
        assert a.dtype == b.dtype == np.uint16 and np.array_equal(a, b)
    assert streamed.num_documents == mem.num_documents == 200
    assert streamed.num_val_documents == mem.num_val_documents >= 1
    assert streamed.island_sources == mem.island_sources
    assert len(list((tmp_path / "st").glob("stream-*.npz"))) == 5  # one token cache per shard
    warm = prepare_data(spec, 3, 300, seed=2, cache_dir=tmp_path / "st", partition=partition)
    assert warm.tokens_from_cache and warm.tokenizer_from_cache and warm.fingerprint == streamed.fingerprint
    assert all(np.array_equal(a, b) for a, b in zip(warm.island_tokens, streamed.island_tokens, strict=True))


def test_streaming_holds_one_shard_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import atoll.job.data.stream as stream_mod

    write_shards(tmp_path / "shards")
    files = stream_mod.shard_files(tmp_path / "shards")
    reads: list[str] = []
    real_load = stream_mod._load_file
    monkeypatch.setattr(stream_mod, "_load_file", lambda p, n, f: reads.append(n) or real_load(p, n, f))
    shards = stream_mod.iter_shards(files, "text")
    assert reads == []  # a generator: nothing read before it is asked
    first = next(shards)
    assert reads == ["a.jsonl"] and len(first) == 50
    next(shards)
    assert reads == ["a.jsonl", "b/c.jsonl"]
    # prepare: the BPE reads the shards once in turn, the tokenization once more; each encode call sees one shard.
    reads.clear()
    encoded: list[int] = []
    real_encode = stream_mod._encode_documents
    monkeypatch.setattr(stream_mod, "_encode_documents",
                        lambda tok, texts, dtype: encoded.append(len(texts)) or real_encode(tok, texts, dtype))
    data = prepare_data(str(tmp_path / "shards"), 2, 300, seed=0, cache_dir=tmp_path / "c")
    names = [n for _, n in files]
    assert reads == names + names and encoded == [50, 40, 60, 30, 20] and data.num_documents == 200
    # A changed shard invalidates the BPE (trained on the corpus), so every shard is tokenized again; an
    # unchanged corpus reads no text at all.
    reads.clear()
    prepare_data(str(tmp_path / "shards"), 2, 300, seed=0, cache_dir=tmp_path / "c")
    assert reads == []


def test_hf_dataset_is_streamed_into_cached_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    import atoll.job.data.stream as stream_mod

    texts = make_texts(250, seed=6)
    pulled: list[int] = []
    calls: list[tuple] = []

    def fake_load_dataset(name, config=None, split=None, streaming=False):  # noqa: ANN001, ANN202
        calls.append((name, config, split, streaming))

        def rows():  # noqa: ANN202
            for i, t in enumerate(texts):
                pulled.append(i)
                yield {"content": t, "id": i}

        return rows()

    monkeypatch.setattr(stream_mod, "_hub_unreachable_reason", lambda: None)
    monkeypatch.setattr(stream_mod, "HF_SHARD_DOCS", 64)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(DataError, match=r"^data: Hugging Face dataset 'org/web' has no column 'body'"):
        prepare_data("hf:org/web:en", 2, 300, seed=0, cache_dir=tmp_path, text_field="body")
    calls.clear()
    pulled.clear()
    data = prepare_data("hf:org/web:en", 2, 300, seed=0, cache_dir=tmp_path, text_field="content",
                        max_documents=200)
    assert calls == [("org/web", "en", "train", True)] and len(pulled) == 200  # stops at max_documents
    folder = next(tmp_path.glob("hf-*"))
    assert sorted(p.name for p in folder.glob("*.parquet")) == [f"shard-0000{i}.parquet" for i in range(4)]
    assert data.streamed and data.num_documents == 200 and data.island_sources == [["org/web"], ["org/web"]]
    decoded = {data.tokenizer.decode(d.tolist()) for s in data.island_tokens + [data.val_tokens]
               for d in split_at_eos(s, data.eos_id)}
    assert decoded == set(texts[:200])
    monkeypatch.setattr(stream_mod, "_hub_unreachable_reason", lambda: "cannot reach huggingface.co:443: test")
    again = prepare_data("hf:org/web:en", 2, 300, seed=0, cache_dir=tmp_path, text_field="content",
                         max_documents=200)  # the cached shards: no network
    assert len(calls) == 1 and again.fingerprint == data.fingerprint and again.tokens_from_cache
    with pytest.raises(DataError, match=r"^data: cannot stream Hugging Face dataset 'org/other' \(offline"):
        prepare_data("hf:org/other", 2, 300, seed=0, cache_dir=tmp_path)


def test_atoll_prepare_fills_the_cache_that_train_reads(tmp_path: Path) -> None:
    from conftest import run_cli

    write_shards(tmp_path / "shards")
    flags = ["--data", str(tmp_path / "shards"), "--cache-dir", str(tmp_path / "c"), "--islands", "2",
             "--vocab-size", "300"]
    cold = run_cli("prepare", *flags)
    assert cold.returncode == 0, cold.stderr
    assert ("200 documents" in cold.stdout
            and "300-token vocabulary (atoll's BPE, trained); tokens tokenized" in cold.stdout)
    warm = run_cli("prepare", *flags)
    assert "(atoll's BPE, cached); tokens from the cache" in warm.stdout
    data = prepare_data(str(tmp_path / "shards"), 2, 300, seed=0, cache_dir=tmp_path / "c")
    assert data.tokens_from_cache and data.tokenizer_from_cache
    assert f"{data.num_train_tokens:,} training" in warm.stdout


def test_streamed_copies_of_a_shard_keep_their_own_split(tmp_path: Path) -> None:
    """Two files of the same bytes share nothing in the cache: their documents' ids, hence split, differ."""
    folder = tmp_path / "shards"
    folder.mkdir()
    texts = make_texts(80, seed=7)
    write_jsonl(folder / "x.jsonl", texts)
    write_jsonl(folder / "y.jsonl", texts)
    mem = prepare_data(str(folder), 2, 300, seed=0, cache_dir=tmp_path / "m", stream=False)
    streamed = prepare_data(str(folder), 2, 300, seed=0, cache_dir=tmp_path / "s")
    assert streamed.num_val_documents == mem.num_val_documents
    assert np.array_equal(streamed.val_tokens, mem.val_tokens)
    assert all(np.array_equal(a, b) for a, b in zip(streamed.island_tokens, mem.island_tokens, strict=True))
    assert len(list((tmp_path / "s").glob("stream-*.npz"))) == 2
    # A changed shard changes the fingerprint a resumed run checks.
    write_jsonl(folder / "y.jsonl", texts[:-1])
    assert prepare_data(str(folder), 2, 300, seed=0, cache_dir=tmp_path / "s").fingerprint != streamed.fingerprint


def test_max_documents_is_for_hf_datasets_only(corpus, tmp_path: Path) -> None:  # noqa: ANN001
    path, _, _ = corpus
    with pytest.raises(DataError, match="^max_documents: applies to hf: datasets only"):
        prepare_data(str(path), 2, 300, seed=0, cache_dir=tmp_path, max_documents=10)


def test_a_few_invalid_bytes_read_as_replacement_characters(tmp_path: Path) -> None:
    from atoll.job.data.sources import read_utf8

    path = tmp_path / "scraped.txt"
    path.write_bytes(("word " * 2000).encode() + b"\xff" + b" tail")  # one bad byte in 10,006
    text = read_utf8(path)
    assert text.count("\ufffd") == 1 and text.endswith(" tail")
    path.write_bytes(("word " * 200).encode() + b"\xff" * 5)  # 5 bad bytes in 1,005: not text
    with pytest.raises(DataError, match=r"is not UTF-8 text \(5 invalid bytes, the first 0xff at byte 1,000\)"):
        read_utf8(path)


def test_a_vocabulary_the_corpus_cannot_fill_is_said_and_recorded(fast_config, capsys) -> None:
    from atoll.config import build_config
    from atoll.job.run import prepare_inputs

    data, model = prepare_inputs(build_config(overrides={**fast_config, "vocab_size": 60_000}))
    note = [line for line in capsys.readouterr().err.splitlines() if line.startswith("atoll: note: vocab_size")]
    assert data.vocab_size < 60_000 and model.get_input_embeddings().weight.shape[0] == data.vocab_size
    assert len(note) == 1 and f"{data.vocab_size:,}-token BPE, not the 60,000 asked for" in note[0]
